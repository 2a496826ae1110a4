"""Ring attention: the K/V blocks go around the ring while each rank attends to the one in
hand; the backward carries each block's gradient home the same way. One ring for every mask:
what each step computes is its plan, from positions (`block_plan`: plain or causal) or from
positions and document ids (`document_plan`, in `documents`: packed sequences)."""
import collections
import math

import torch
import torch.distributed as dist

from .blocks import (_add_rows, _as_q_heads, _attend_plan, _check_block, _grads, _lse_dtype,
                     _rows, _sum_heads, merge)
from .exchange import _all_positions, _positions_for, _shift, _wait
from .plan import FULL, block_plan, plan_work

RingStep = collections.namedtuple("RingStep", "step block kind pairs size kernels")
RingStep.__doc__ = """One forward ring step on one rank: the block (its owner's rank) in hand,
kind "skip" (no query sees a key of it), "full" (every query sees every key) or "masked",
`pairs` the query-key pairs its kernels charge, `size` the block's queries × keys, `kernels`
how many flash kernels it ran."""


class RingAttention(torch.autograd.Function):
    """Forward: N steps, each attending to the K/V block in hand while the next one travels.
    Backward: the same ring again; dK and dV ride along with their block and arrive home last.

    At step s rank r holds the block of rank r−s (mod N), and receives that of rank r−s−1.
    `plan(r, owner)` gives the pieces of the owner's block that this rank's queries see, from
    `positions` (every rank's, gathered once) and the mask (`block_plan`): fully masked pieces
    are skipped, diagonal ones cost half, so the work of a step is what the layout gives it —
    with zig-zag, the same on every rank. (Chapter 12b's packed documents run on this same
    ring, planned by `document_plan`.) Under grouped-query attention K and V have fewer heads
    than Q: the ring carries them (and their gradients) that small, and each rank widens the
    block in hand for its kernels."""

    @staticmethod
    def forward(ctx, q, k, v, positions, plan, group, log=None):
        n, r = dist.get_world_size(group), dist.get_rank(group)
        scale = 1.0 / math.sqrt(q.shape[-1])
        lengths = [len(p) for p in positions]
        out = lse = None
        blocks = (k, v)
        for step in range(n):
            owner = (r - step) % n
            pending = (_shift(blocks, group, lengths[(owner - 1) % n]) if step < n - 1
                       else None)              # the next block travels, whatever this step does
            pieces = plan(r, owner)
            for rows, o, l in _attend_plan(q, *_as_q_heads(q, blocks), positions[r],
                                           positions[owner], pieces, scale):
                if rows == (0, q.shape[-2]):
                    out, lse = (o, l) if out is None else merge(out, lse, o, l)
                else:
                    if out is None:
                        out = torch.zeros(q.shape, dtype=_lse_dtype(q), device=q.device)
                        lse = torch.full(q.shape[:-1], float("-inf"), dtype=_lse_dtype(q),
                                         device=q.device)
                    merged, merged_lse = merge(_rows(out, rows), _rows(lse, rows), o, l)
                    _rows(out, rows).copy_(merged)
                    _rows(lse, rows).copy_(merged_lse)
            if log is not None:
                log.append(_ring_step(step, owner, pieces, q.shape[-2], lengths[owner]))
            if pending is not None:
                blocks, handles = pending
                _wait(handles)
        if out is None:                            # no token on this rank
            out = torch.zeros_like(q)
            lse = torch.full(q.shape[:-1], float("-inf"), dtype=_lse_dtype(q), device=q.device)
        # merging in the log-sum-exp's float32 (16-bit inputs) promotes the running output to
        # it, as real ring kernels accumulate; the result is returned in the inputs' dtype
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.group, ctx.scale, ctx.positions, ctx.plan = group, scale, positions, plan
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse = ctx.saved_tensors
        group, scale, positions, plan = ctx.group, ctx.scale, ctx.positions, ctx.plan
        n, r = dist.get_world_size(group), dist.get_rank(group)
        lengths = [len(p) for p in positions]
        grad_out = grad_out.contiguous()
        dq = torch.zeros_like(q)
        blocks, arriving_grads = (k, v), None
        for step in range(n):
            owner = (r - step) % n
            arriving = lengths[(owner - 1) % n]       # K, V and their gradients alike
            # K and V do not change: they leave for the next rank right away and travel while
            # this rank computes.
            ahead = _shift(blocks, group, arriving) if step < n - 1 else None
            wide = _as_q_heads(q, blocks)
            dk, dv = torch.zeros_like(wide[0]), torch.zeros_like(wide[1])
            for rows, pieces in plan(r, owner):
                for cols, kind in pieces:
                    gq, gk, gv = _grads(q, *wide, positions[r], positions[owner], out, lse,
                                        grad_out, rows, cols, kind, scale)
                    dq = _add_rows(dq, rows, gq)
                    dk, dv = _add_rows(dk, cols, gk), _add_rows(dv, cols, gv)
            dk, dv = _sum_heads(dk, k.shape[1]), _sum_heads(dv, k.shape[1])
            # The block's gradient so far comes from the left neighbour, sent at its previous
            # step while this step's kernels ran; add this rank's share and pass it on, to be
            # waited for one step later (after N hops it is back with its owner).
            if arriving_grads is not None:
                (dk_in, dv_in), handles = arriving_grads
                _wait(handles)
                dk, dv = dk.add_(dk_in), dv.add_(dv_in)
            arriving_grads = _shift((dk, dv), group, arriving) if n > 1 else ((dk, dv), [])
            if ahead is not None:
                blocks, handles = ahead
                _wait(handles)
        (dk, dv), handles = arriving_grads
        _wait(handles)
        return dq, dk, dv, None, None, None, None


def _ring_step(step, owner, plan, queries, keys):
    """The log's entry for one forward step (`RingStep`)."""
    if not plan:
        kind = "skip"
    elif plan == [((0, queries), [((0, keys), FULL)])]:
        kind = "full"
    else:
        kind = "masked"
    return RingStep(step, owner, kind, plan_work(plan), queries * keys,
                    sum(len(pieces) for _, pieces in plan))


def _check_log(log):
    if log is not None and not isinstance(log, list):
        raise TypeError(f"log must be a list (each forward step appends a RingStep) or None; "
                        f"got a {type(log).__name__}.")


def ring_attention(q, k, v, positions, causal=False, group=None, log=None):
    """Attention of this rank's queries over the whole sequence, K/V passed around the ring.
    The ranks' blocks may hold different numbers of tokens. q, k and v may be meta tensors
    (full-size emulation); positions are real integers. `log`, a list, receives a `RingStep`
    per forward step."""
    _check_block(q, k, v, positions)
    _check_log(log)
    every = _all_positions(_positions_for(q, positions), group)

    def plan(mine, owner):            # rank mine's queries against the block of rank owner
        return block_plan(every[mine], every[owner], causal)

    return RingAttention.apply(q, k, v, every, plan, group, log)
