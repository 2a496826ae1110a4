"""Checkers for chapter 02, the collectives.

Predictions ("what does every rank hold after reduce_scatter?") are written by the learner as
plain single-process functions and compared with what the real collective returns on real
ranks. `all_gather_uneven` runs on the ranks itself and is compared with the inputs it was given.
"""
import contextlib
import re

import torch
import torch.distributed as dist

from ..launch import RunTimeout
from . import (CheckFailed, RankFailed, UsedCourseCode, _refusing_code, call_learner, compare,
               forbid, passed, run, run_learner, sizes_phrase)

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


def check_predict_all_to_all(fn):
    """fn(inputs) -> one tensor per rank: what all_to_all leaves on each rank."""
    _check_prediction(fn, "all_to_all", getattr(fn, "__name__", "predict_all_to_all"))


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
