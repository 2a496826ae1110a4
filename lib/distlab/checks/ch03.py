"""Checkers of workbook 03: a ring all-reduce and a tree broadcast, built from send/recv.

Each checker runs the learner's function on real ranks at odd world sizes and at lengths that do
not divide by the world size (some shorter than it), and compares every rank's answer with
torch.distributed's own collective on the same inputs.
"""
import math

import torch
import torch.distributed as dist

from . import CheckFailed, compare, passed, run_learner, sizes_phrase
from ..launch import RankFailed
from . import run

WORLD_SIZES = (2, 3, 5)
LENGTHS = (1, 4, 7, 13)
# The built-in collectives a learner might reach for; inside the check they refuse to run.
BUILTINS = ("all_reduce", "reduce", "broadcast", "all_gather", "all_gather_into_tensor",
            "all_gather_single", "reduce_scatter", "reduce_scatter_tensor",
            "reduce_scatter_single", "all_to_all", "all_to_all_single", "scatter", "gather",
            "all_reduce_coalesced", "all_gather_coalesced", "broadcast_object_list",
            "all_gather_object", "gather_object", "scatter_object_list", "_all_gather_base",
            "_reduce_scatter_base")


class UsedBuiltinCollective(RuntimeError):
    pass


def _data(rank, length):
    return torch.randn(length, generator=torch.Generator().manual_seed(1000 * rank + length))


def _forbid_builtins():
    def refuse(name):
        def refused(*args, **kwargs):
            raise UsedBuiltinCollective(
                f"your function called dist.{name}; the exercise is to build it from "
                f"send/recv (or isend/irecv) only.")
        return refused
    # Both names: `dist.x` and torch's internal `distributed_c10d.x` (what helpers call).
    saved = {(module, name): getattr(module, name) for module in (dist, dist.distributed_c10d)
             for name in BUILTINS if hasattr(module, name)}
    for module, name in saved:
        setattr(module, name, refuse(name))
    return saved


def _restore(saved):
    for (module, name), fn in saved.items():
        setattr(module, name, fn)


# ---- what runs on the ranks ----------------------------------------------------------------------

def _learner_all_reduce(rank, world_size, fn):
    saved = _forbid_builtins()
    try:
        return [fn(_data(rank, n)) for n in LENGTHS]
    finally:
        _restore(saved)


def _reference_all_reduce(rank, world_size):
    out = []
    for n in LENGTHS:
        t = _data(rank, n)
        dist.all_reduce(t)
        out.append(t)
    return out


def _sources(world_size):
    return sorted({0, world_size - 1, world_size // 2})


def _count_sends():
    """Wrap send and isend so the check can count this rank's messages; returns (counter, undo)."""
    import torch.distributed.distributed_c10d as c10d
    counter, depth = [0], [0]
    saved = []
    for name in ("send", "isend"):
        original = getattr(c10d, name)

        def counting(*args, _original=original, **kwargs):
            # send may be built on isend: count the learner's call, not torch's inner one.
            counter[0] += depth[0] == 0
            depth[0] += 1
            try:
                return _original(*args, **kwargs)
            finally:
                depth[0] -= 1
        # Both names: P2POp accepts only the op that distributed_c10d itself calls isend.
        for module in (dist, c10d):
            saved.append((module, name, getattr(module, name)))
            setattr(module, name, counting)

    def undo():
        for module, name, fn in saved:
            setattr(module, name, fn)
    return counter, undo


def _learner_broadcast(rank, world_size, fn):
    saved = _forbid_builtins()
    counter, undo = _count_sends()
    try:
        results, sends = [], []
        for src in _sources(world_size):
            for n in LENGTHS:
                before = counter[0]
                results.append(fn(_data(rank, n), src))
                sends.append(counter[0] - before)
        return results, sends
    finally:
        undo()
        _restore(saved)


def _reference_broadcast(rank, world_size):
    out = []
    for src in _sources(world_size):
        for n in LENGTHS:
            t = _data(rank, n)
            dist.broadcast(t, src)
            out.append(t)
    return out


# ---- the checkers --------------------------------------------------------------------------------

def _run(fn, world_size, worker, name):
    try:
        return run_learner(worker, world_size, fn, name=name, timeout=60)
    except RankFailed as e:
        if e.exc_type == UsedBuiltinCollective.__name__:
            raise CheckFailed(str(e).splitlines()[0].split(": ", 1)[1]) from None
        raise


def check_ring_all_reduce(ring_all_reduce):
    """`ring_all_reduce(tensor)` returns the sum over ranks of a 1-D tensor, using send/recv only."""
    name = getattr(ring_all_reduce, "__name__", "ring_all_reduce")
    for ws in WORLD_SIZES:
        got = _run(ring_all_reduce, ws, _learner_all_reduce, name)
        expected = run(_reference_all_reduce, ws)
        for rank in range(ws):
            for i, n in enumerate(LENGTHS):
                compare(got[rank][i], expected[rank][i],
                        f"{name} with world_size={ws}, length {n}: on rank {rank}",
                        atol=1e-5, rtol=1.3e-6)
    passed(f"{name} equals dist.all_reduce on every rank at world sizes "
           f"{sizes_phrase(WORLD_SIZES)} and lengths {sizes_phrase(LENGTHS)}.")


def check_tree_broadcast(tree_broadcast):
    """`tree_broadcast(tensor, src)` returns src's tensor on every rank, using send/recv only."""
    name = getattr(tree_broadcast, "__name__", "tree_broadcast")
    for ws in WORLD_SIZES:
        got = _run(tree_broadcast, ws, _learner_broadcast, name)
        expected = run(_reference_broadcast, ws)
        cases = [(src, n) for src in _sources(ws) for n in LENGTHS]
        for rank in range(ws):
            for i, (src, n) in enumerate(cases):
                compare(got[rank][0][i], expected[rank][i],
                        f"{name} with world_size={ws}, src={src}, length {n}: on rank {rank}",
                        atol=0, rtol=0)
        rounds = math.ceil(math.log2(ws))
        for i, (src, n) in enumerate(cases):
            sent = got[src][1][i]
            if sent > rounds:
                raise CheckFailed(
                    f"{name} with world_size={ws}, src={src}: the source sent {sent} messages, "
                    f"but a binomial tree needs only {rounds} (ceil(log2 {ws})); let every rank "
                    f"that already has the data pass it on.")
    passed(f"{name} equals dist.broadcast on every rank at world sizes "
           f"{sizes_phrase(WORLD_SIZES)}, from several source ranks and lengths "
           f"{sizes_phrase(LENGTHS)}, and the source sends only ceil(log2 N) messages.")
