"""Checkers for chapter 02, the collectives.

Predictions ("what does every rank hold after reduce_scatter?") are written by the learner as
plain single-process functions and compared with what the real collective returns on real
ranks. The others run on the ranks: reduce_scatter built from all_to_all (judged by its values
and by the collectives the trace shows), `all_gather_uneven` (compared with the inputs it was
given; the object collectives refused), and a broadcast autograd sees (its result and every
rank's gradient against single-process autograd's).
"""
import contextlib
import re

import torch
import torch.distributed as dist

from ..launch import RunTimeout
from . import (CheckFailed, RankFailed, UsedCourseCode, _refusing_code, call_learner, compare,
               forbid, passed, run, run_learner, sizes_phrase)
from .ch01 import learner_run

WORLD_SIZES = (2, 3, 4)
TIMEOUT = 20  # a learner's hang is reported, with where each rank waits, within this


def _inputs(world_size, per_rank, seed):
    """Small distinct integers (as floats) per rank, so any mix-up changes some element."""
    g = torch.Generator().manual_seed(seed + world_size)
    return [torch.randint(-9, 10, (per_rank,), generator=g).float() + 100 * r
            for r in range(world_size)]


# ---- what the real collectives give, run on real ranks ------------------------------------------

def _real_reduce_scatter(rank, world_size, inputs):
    x = inputs[rank]
    out = torch.empty(x.numel() // world_size, dtype=x.dtype)
    dist.reduce_scatter_single(out, x)
    return out


def _real_all_to_all(rank, world_size, inputs):
    x = inputs[rank]
    out = torch.empty_like(x)
    dist.all_to_all_single(out, x)
    return out


def real(collective, inputs):
    """What every rank holds after `collective` ('reduce_scatter' or 'all_to_all') on `inputs`."""
    fn = {"reduce_scatter": _real_reduce_scatter, "all_to_all": _real_all_to_all}[collective]
    return list(run(fn, len(inputs), inputs, timeout=60))


def _references():
    """The checker's own answer key: refused inside the learner's function."""
    return (real, _real_reduce_scatter, _real_all_to_all)


# ---- exercise 1 and 2: predict the result -----------------------------------------------------

def _predict(fn, inputs, name, collective):
    try:
        with forbid(*_references(), exercise=f"predict what {collective} gives by reasoning "
                                             f"about the data, in one process"):
            return call_learner(fn, [t.clone() for t in inputs], name=name)
    except UsedCourseCode as e:
        raise CheckFailed(str(e)) from None


def _check_prediction(fn, collective, name):
    for ws in WORLD_SIZES:
        for per_chunk in (1, 3):
            inputs = _inputs(ws, ws * per_chunk, seed=per_chunk)
            expected = real(collective, inputs)
            got = _predict(fn, inputs, name, collective)
            context = f"{name} with world_size={ws} and {per_chunk} element(s) per chunk"
            if not isinstance(got, (list, tuple)) or len(got) != ws:
                compare(got, expected, context)
            for rank in range(ws):
                compare(got[rank], expected[rank], f"{context}, rank {rank}", atol=0, rtol=0)
    passed(f"{name} predicts what {collective} gives every rank, at world sizes "
           f"{sizes_phrase(WORLD_SIZES)} (checked against the real collective on real ranks).")


def check_predict_reduce_scatter(fn):
    """fn(inputs) -> one tensor per rank: what reduce_scatter (SUM) leaves on each rank."""
    _check_prediction(fn, "reduce_scatter", getattr(fn, "__name__", "predict_reduce_scatter"))


# ---- exercise 2: reduce_scatter built from all_to_all -----------------------------------------

_ALLOWED_IN_RS = ("all_to_all", "barrier")


def _reduce_scatter_on_ranks(rank, world_size, fn, per_chunks):
    from ..collectives import ring_all_reduce, ring_reduce_scatter
    out = []
    with forbid(*_references(), ring_reduce_scatter, ring_all_reduce,
                exercise="build reduce_scatter from all_to_all yourself"):
        for per_chunk in per_chunks:
            x = _inputs(world_size, world_size * per_chunk, seed=7 + per_chunk)[rank]
            out.append(fn(x.clone()))
    return out


def check_reduce_scatter_from_all_to_all(fn):
    """fn(x) runs on every rank with its 1-D tensor; returns this rank's chunk of the sum, built
    with all_to_all and local arithmetic only."""
    name = getattr(fn, "__name__", "reduce_scatter_from_all_to_all")
    per_chunks = (1, 3)
    for ws in WORLD_SIZES:
        got = learner_run(_reduce_scatter_on_ranks, ws, fn, per_chunks, name=name,
                          hang_rule="every rank must call the same all_to_all with tensors of "
                          "the same size.")
        for i, per_chunk in enumerate(per_chunks):
            expected = real("reduce_scatter", _inputs(ws, ws * per_chunk, seed=7 + per_chunk))
            for rank in range(ws):
                compare(got[rank][i], expected[rank],
                        f"{name} with world_size={ws} and {per_chunk} element(s) per chunk, "
                        f"rank {rank}", atol=0, rtol=0)
        for rank in range(ws):
            calls = got.trace.comm(rank)
            other = next((e for e in calls if e["op"] not in _ALLOWED_IN_RS), None)
            if other is not None:
                what = ("reduce_scatter itself" if other["op"] == "reduce_scatter"
                        else f"{other['op']}")
                raise CheckFailed(f"{name} with world_size={ws}: the values are right, but rank "
                                  f"{rank} called {what}; the exercise is to build "
                                  f"reduce_scatter from all_to_all and local sums only.")
            if not any(e["op"] == "all_to_all" for e in calls):
                raise CheckFailed(f"{name} with world_size={ws}: rank {rank} never called "
                                  f"all_to_all.")
    passed(f"{name} gives what reduce_scatter gives every rank, at world sizes "
           f"{sizes_phrase(WORLD_SIZES)}, with one all_to_all and a local sum.")


# ---- exercise 3: all_gather for tensors of different lengths ----------------------------------

def _uneven_inputs(world_size):
    # Awkward on purpose: one empty rank, a longest rank that is not the last, odd lengths.
    lengths = [(3 * r + 2) % 5 + (r % 2) for r in range(world_size)]
    lengths[world_size // 2] = 0
    g = torch.Generator().manual_seed(world_size)
    return [torch.randn(n, generator=g) for n in lengths]


def _object_collectives():
    return (dist.all_gather_object, dist.gather_object, dist.broadcast_object_list,
            dist.scatter_object_list)


@contextlib.contextmanager
def _no_object_collectives():
    """Inside a rank: torch's object collectives raise UsedCourseCode with a sentence. They
    pickle each tensor into a byte tensor and share lengths for it: the very work the exercise
    asks for, done for any Python object (and slower: a copy, a pickle and a host sync each)."""
    saved = []
    for fn in _object_collectives():
        message = (f"your function used dist.{fn.__name__}, which pickles each tensor and does "
                   f"the length-sharing for you; the exercise is to gather the tensors "
                   f"themselves with tensor collectives (share the lengths, pad, all_gather, "
                   f"trim).")
        saved.append((fn, fn.__code__))
        fn.__code__ = _refusing_code(message, fn.__code__.co_freevars)
    try:
        yield
    finally:
        for fn, code in saved:
            fn.__code__ = code


def _run_uneven(rank, world_size, fn, inputs):
    with forbid(*_references(), exercise="write the uneven all-gather yourself"), \
            _no_object_collectives():
        return fn(inputs[rank].clone())


def check_all_gather_uneven(fn):
    """fn(tensor) runs on every rank; returns the list of every rank's 1-D tensor, in rank order."""
    name = getattr(fn, "__name__", "all_gather_uneven")
    for ws in WORLD_SIZES:
        inputs = _uneven_inputs(ws)
        lengths = ", ".join(str(t.numel()) for t in inputs)
        try:
            got = run_learner(_run_uneven, ws, fn, inputs, name=name, timeout=TIMEOUT)
        except RunTimeout as e:
            # A rank with nothing to send can finish while its peers wait for its data.
            stuck = "; ".join(line.strip() for line in str(e).splitlines()[1:1 + ws])
            raise CheckFailed(f"{name} with world_size={ws} (lengths {lengths}) hung: {stuck} "
                              f"(a collective needs the same shapes on every rank).") from None
        except RankFailed as e:
            if e.exc_type != "RuntimeError":
                raise  # a bug in the learner's own Python: their traceback says more than we can
            # gloo's own words, minus the C++ file name, are the useful part.
            said = re.sub(r"\[[^\]]*\.(cc|cpp|h):\d+\] ", "", str(e).splitlines()[0])
            said = said.split(". ")[0].rstrip(".")
            raise CheckFailed(f"{name} with world_size={ws} (lengths {lengths}) failed: {said} "
                              f"(a collective needs the same shapes on every rank).") from None
        for rank in range(ws):
            compare(got[rank], inputs,
                    f"{name} with world_size={ws} (lengths {lengths}), rank {rank}",
                    atol=0, rtol=0)
    passed(f"{name} gathers tensors of different lengths (an empty one too) at world sizes "
           f"{sizes_phrase(WORLD_SIZES)}.")


# ---- exercise 4: a broadcast that autograd sees ------------------------------------------------

BROADCAST_CASES = ((2, 1), (3, 0), (4, 2))   # (world size, src): the source is not always rank 0


def _weights(rank, n):
    # Every rank uses the broadcast value with its own weights, so each gradient is different.
    return torch.arange(1.0, n + 1) * (rank + 1) + 0.5 * rank


def _torch_broadcast_autograd():
    import torch.distributed.nn.functional as F
    return (F.broadcast, F._Broadcast.forward, F._Broadcast.backward)


def _broadcast_grad_on_ranks(rank, world_size, fn, src, n):
    from ..collectives import tree_broadcast
    x = (torch.arange(float(n)) + 100 * rank).requires_grad_()
    with forbid(*_references(), *_torch_broadcast_autograd(), tree_broadcast,
                exercise="write the broadcast's backward yourself, as a torch.autograd.Function"):
        y = fn(x, src)
        if not isinstance(y, torch.Tensor):
            return "not a tensor", repr(y)
        if not y.requires_grad:
            return "no graph", None
        (y * _weights(rank, n)).sum().backward()
    return y.detach(), x.grad


def check_broadcast_with_grad(fn):
    """fn(x, src) on every rank -> src's x on every rank, differentiable: the gradient of src's x
    is the sum of every rank's gradient of the result; the other ranks' x get zeros."""
    name = getattr(fn, "__name__", "broadcast_with_grad")
    n = 3
    for ws, src in BROADCAST_CASES:
        got = learner_run(_broadcast_grad_on_ranks, ws, fn, src, n, name=name,
                          hang_rule="every rank must call the same collectives, in forward and "
                          "in backward.")
        context = f"{name} with world_size={ws}, src={src}"
        for rank, (y, grad) in enumerate(got):
            if y == "not a tensor":
                raise CheckFailed(f"{context}: rank {rank} got {grad} back; return a tensor.")
            if y == "no graph":
                raise CheckFailed(f"{context}: rank {rank}'s result does not require grad, so "
                                  f"autograd cannot reach x: dist.broadcast works in place, "
                                  f"outside autograd's graph; wrap it in a torch.autograd."
                                  f"Function whose backward you write.")
            compare(y, torch.arange(float(n)) + 100 * src, f"{context}, rank {rank}'s result")
            if grad is None:
                raise CheckFailed(f"{context}: rank {rank}'s x.grad is None; backward must "
                                  f"return a gradient for x on every rank (zeros where x was "
                                  f"not used).")
            expected = (sum(_weights(r, n) for r in range(ws)) if rank == src
                        else torch.zeros(n))
            why = ("the sum of every rank's gradient of the result" if rank == src
                   else f"zeros: only rank {src}'s x reached the result")
            compare(grad, expected, f"{context}, rank {rank}'s x.grad (should be {why})")
    cases = ", ".join(f"{ws} ranks from src {src}" for ws, src in BROADCAST_CASES)
    passed(f"{name} broadcasts and sends the gradients back to the source ({cases}).")
