"""Checkers for workbook 06: a ZeRO-1 optimizer step and ZeRO-3's gather/free around a layer.

Both judge the result (against one process, float64 / float32 with tight tolerances) AND what the
ranks sent, from the run's trace: ZeRO's point is to shard memory at DDP's communication cost, so
an answer that gets the numbers right by moving more bytes is refused, with the bytes it moved.
"""
import math
import re

import torch
import torch.nn.functional as F

from .. import models, trace as _trace
from ..cost import TERMS
from ..emulate import _MODEL
from ..launch import RankFailed
from ..sharding import ZeRO, chunk_bounds, gather_flat
from . import CheckFailed, compare, forbid, passed, run_learner, sizes_phrase

# Parameter counts 60, 10, 50, 5, 15, 3: none divides by both 2 and 3, so slices are padded.
SIZES, STEPS, BATCH, LR = (6, 10, 5, 3), 3, 12, 0.05
TIMEOUT = 20  # a learner's deadlock is reported (with where each rank waits) within this


def _course_code():
    return (ZeRO, ZeRO.step, ZeRO._reduce_scatter_grad, ZeRO._all_gather_param, ZeRO._gather,
            gather_flat, zero3_forward_reference)


def _run(rank_fn, ws, fn, name):
    """run_learner, traced; gloo's own words about mismatched calls become one sentence."""
    try:
        return run_learner(rank_fn, ws, fn, name=name, timeout=TIMEOUT, trace=True)
    except RankFailed as e:
        calls = re.findall(r"distributed_c10d\.py\", line \d+, in (\w+)", e.remote_traceback)
        # gloo's own words ("Connection reset by peer ... GLHF", or an abort when the sizes it
        # receives differ) say nothing a learner can use.
        aborted = e.exc_type is None and "SIGABRT" in str(e)
        if aborted or (calls and ("gloo" in str(e) or getattr(e, "peer_lost", False))):
            op = f"{calls[-1]} calls" if calls else "collectives"
            raise CheckFailed(
                f"with world_size={ws}, the ranks' {op} did not match (gloo failed on rank "
                f"{e.rank}): every rank must pass tensors of the same size, so pad each slice "
                f"to ceil(numel / world_size) elements (F.pad) before gathering or scattering "
                f"and trim the padding after — the last ranks' slices are shorter when numel "
                f"does not divide.") from None
        raise


def _traffic(trace, rank):
    """(bytes rank sent in a ring/tree, {op: bytes}) over its calls, as the α-β model counts them:
    an all-reduce sends 2(N-1)/N of the tensor, a reduce-scatter or an all-gather (N-1)/N."""
    per_op = {}
    for e in trace.comm(rank):
        n = len(e["group"]) if e["group"] else trace.world_size
        volume = TERMS[_MODEL.get(e["op"], "send")](e["bytes"], n)[1] if n > 1 else 0
        per_op[e["op"]] = per_op.get(e["op"], 0) + volume
    return sum(per_op.values()), per_op


def _kb(b):
    return f"{b:,.0f} B"


def _check_traffic(trace, ws, allowed, what, rule):
    for rank in range(ws):
        total, per_op = _traffic(trace, rank)
        if total > allowed * (1 + 1e-9):
            calls = ", ".join(f"{op} {_kb(v)}" for op, v in sorted(per_op.items()))
            raise CheckFailed(
                f"with world_size={ws}, rank {rank} sent {_kb(total)} ({calls}; from the run's "
                f"trace), {total / allowed:.2f}× the {_kb(allowed)} {what}; {rule}")


# ---- exercise 1: a ZeRO-1 step --------------------------------------------------------------

def _zero1_rank(rank, world_size, fn):
    torch.set_default_dtype(torch.float64)
    model = models.make_mlp(SIZES, seed=3)
    params = list(model.parameters())
    shards = []
    for p in params:
        lo, hi = chunk_bounds(p.numel(), world_size, rank)
        shards.append(torch.nn.Parameter(p.data.view(-1)[lo:hi]))
    optimizer = torch.optim.Adam(shards, lr=LR)
    x, y = models.regression_data(64, SIZES[0], SIZES[-1], seed=4)
    for gx, gy in models.batches_of(x, y, BATCH, STEPS):
        model.zero_grad()
        optimizer.zero_grad()
        F.mse_loss(model(gx.chunk(world_size)[rank]), gy.chunk(world_size)[rank]).backward()
        with forbid(*_course_code(), exercise="write the ZeRO-1 step yourself"), \
                _trace.span("zero1_step"):
            fn(params, shards, optimizer)
    states = sum(v.numel() for st in optimizer.state.values() for v in st.values() if v.dim())
    return [p.detach().clone() for p in params], states


def _zero1_reference():
    torch.set_default_dtype(torch.float64)
    try:
        model = models.make_mlp(SIZES, seed=3)
        x, y = models.regression_data(64, SIZES[0], SIZES[-1], seed=4)
        models.train_reference(model, models.batches_of(x, y, BATCH, STEPS), optimizer="adam",
                               lr=LR)
        return [p.detach().clone() for p in model.parameters()]
    finally:
        torch.set_default_dtype(torch.float32)


def _padded(numels, ws):
    """Elements a collective over per-parameter slices moves: each padded to ceil(n/ws)·ws."""
    return sum(math.ceil(n / ws) * ws for n in numels)


def check_zero1_step(fn, world_sizes=(2, 3)):
    """fn(params, shards, optimizer) must leave every rank with the parameters of Adam on one
    process, keep Adam's state for its slices only, and send no more than DDP sends."""
    want = _zero1_reference()
    numels = [p.numel() for p in want]
    n = sum(numels)
    names = [f"{i}.{k}" for i in range(0, 2 * (len(SIZES) - 1), 2) for k in ("weight", "bias")]
    for ws in world_sizes:
        got = _run(_zero1_rank, ws, fn, "zero1_step")
        for rank, (params, states) in enumerate(got):
            for name, g, w in zip(names, params, want):
                compare(g, w, f"zero1_step with world_size={ws}, rank {rank}, after {STEPS} "
                        f"steps, parameter net.{name}", atol=1e-10, rtol=1e-9)
        total_states = sum(states for _, states in got)
        if total_states != 2 * n:
            raise CheckFailed(f"with world_size={ws} the ranks keep {total_states} optimizer "
                              f"state values in all; sharded Adam keeps 2 per parameter "
                              f"({2 * n}), split between the ranks.")
        # DDP all-reduces the gradients: 2(N-1)/N of them per step. ZeRO-1 moves the same, as a
        # reduce-scatter of the gradients + an all-gather of the updated slices (padded slices
        # cost a few bytes more; one flat buffer for all parameters, less).
        ring = 2 * (ws - 1) / ws * 8 * STEPS
        _check_traffic(got.trace, ws, ring * _padded(numels, ws),
                       f"that a reduce-scatter of the gradients plus an all-gather of the updated "
                       f"slices send in {STEPS} steps (DDP's all-reduce: {_kb(ring * n)})",
                       "ZeRO-1 costs what DDP costs because an all-reduce IS a reduce-scatter "
                       "followed by an all-gather: reduce-scatter the gradients (each rank needs "
                       "only the average of its own slice) instead of all-reducing them, then "
                       "all-gather the updated slices.")
    passed(f"zero1_step trains exactly like Adam on one process, on {sizes_phrase(world_sizes)} "
           f"ranks over {STEPS} steps, each rank keeping only its slice of Adam's state and "
           f"sending what DDP sends (a reduce-scatter + an all-gather).")


# ---- exercise 2: ZeRO-3's gather / run / free ------------------------------------------------

CALLS = 2  # two forwards: the second must gather again what the first freed


def _zero3_rank(rank, world_size, fn):
    torch.manual_seed(0)
    dense = torch.nn.Linear(7, 5)
    layer = torch.nn.Linear(7, 5)
    shards = {}
    for name, p in dense.named_parameters():
        lo, hi = chunk_bounds(p.numel(), world_size, rank)
        shards[name] = p.detach().reshape(-1)[lo:hi].clone()
    for p in layer.parameters():
        p.data.zero_()
        p.untyped_storage().resize_(0)
    outs, wants, freed = [], [], True
    for call in range(CALLS):
        x = torch.arange(28.).reshape(4, 7) / 10 + rank + call
        with torch.no_grad():
            with forbid(*_course_code(), exercise="write the gather yourself"):
                outs.append(fn(layer, shards, x))
            wants.append(dense(x))
        freed = freed and all(p.untyped_storage().nbytes() == 0 for p in layer.parameters())
    return outs, wants, freed


def check_zero3_forward(fn, world_sizes=(2, 3, 4)):
    """fn(layer, shards, x): gather the layer's weights, run it, free them again."""
    numels = [7 * 5, 5]
    for ws in world_sizes:
        got = _run(_zero3_rank, ws, fn, "zero3_forward")
        for rank, (outs, wants, freed) in enumerate(got):
            for call, (out, want) in enumerate(zip(outs, wants)):
                compare(out, want, f"zero3_forward with world_size={ws}, rank {rank}, "
                        f"forward {call + 1} of {CALLS}, output", atol=1e-6, rtol=1e-5)
            if not freed:
                raise CheckFailed(f"with world_size={ws}, rank {rank} still holds the full "
                                  f"weights after the forward: free them (resize their storage "
                                  f"to 0) once the output is computed.")
        allowed = (ws - 1) / ws * 4 * _padded(numels, ws) * CALLS
        _check_traffic(got.trace, ws, allowed,
                       f"that all-gathering the weight and the bias sends in {CALLS} forwards",
                       "each rank has only its slice, so gather the slices with one all_gather "
                       "per parameter (every rank contributes its slice) rather than all-reducing "
                       "zero-padded full copies or sending more than once.")
    passed(f"zero3_forward gathers the full layer with one all-gather per parameter, gives the "
           f"dense output and frees the weights again, {CALLS} forwards on "
           f"{sizes_phrase(world_sizes)} ranks.")


def zero3_forward_reference(layer, shards, x):
    """The answer, used by the tests (not shown in the workbook; refused inside a check)."""
    for name, p in layer.named_parameters():
        full = gather_flat(shards[name], p.numel())
        p.untyped_storage().resize_(p.numel() * p.element_size())
        p.data.view(-1).copy_(full)
    out = layer(x)
    for p in layer.parameters():
        p.untyped_storage().resize_(0)
    return out
