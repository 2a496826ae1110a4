"""Checkers of workbook 12: the online-softmax merge, one ring hop, ring attention built from
them, and ring attention's backward (the chapter shows the course's, not this one).

The merge is checked in this process on small hand-made partials (including rows that saw no
key at all); the ring hop and the ring attention run on real ranks at world sizes 3 and 5, where
left and right neighbours differ, and the run's trace must show messages to the right neighbour
only, each tensor once per hop.
"""
import math

import torch

from . import (CheckFailed, call_learner, compare, first_difference, forbid, passed, run_learner,
               sizes_phrase)
from .. import context_parallel as cp

WORLD_SIZES = (3, 5)
COURSE = (cp.merge, cp._shift, cp.ring_attention, cp.RingAttention, cp.block_attention,
          cp.all_gather_attention, cp.dense_attention)


# ---- exercise 1: merge ---------------------------------------------------------------------------

def _partials():
    """Two partial attentions of 3 queries over disjoint keys; query 2 saw no key in part b."""
    g = torch.Generator().manual_seed(12)
    q, k, v = (torch.randn(1, 1, 3, 2, dtype=torch.float64, generator=g) for _ in range(3))
    k2, v2 = (torch.randn(1, 1, 2, 2, dtype=torch.float64, generator=g) for _ in range(2))
    pos = torch.tensor([0.0, 1.0, 2.0], dtype=torch.float64)
    a = cp.block_attention(q, k, v, pos, pos, False, 1.0)
    # keys at positions 3 and 4 under a causal mask: queries 0-2 see none of them ...
    b = cp.block_attention(q, k2, v2, pos, torch.tensor([1.0, 3.0], dtype=torch.float64),
                           True, 1.0)
    return a, b, (q, torch.cat([k, k2], -2), torch.cat([v, v2], -2))


def check_merge(merge):
    """merge(out_a, lse_a, out_b, lse_b) -> (out, lse) must equal attention over both key sets."""
    (out_a, lse_a), (out_b, lse_b), _ = _partials()
    with forbid(*COURSE, exercise="write the merge yourself"):
        got = call_learner(merge, out_a.clone(), lse_a.clone(), out_b.clone(), lse_b.clone(),
                           name="merge")
    if not isinstance(got, tuple) or len(got) != 2:
        raise CheckFailed(f"merge must return a pair (out, lse); it returned "
                          f"{type(got).__name__} {got!r:.80}.")
    out, lse = got
    expected_out, expected_lse = cp.merge(out_a, lse_a, out_b, lse_b)
    if isinstance(lse, torch.Tensor) and torch.isnan(lse).any() or \
            isinstance(out, torch.Tensor) and torch.isnan(out).any():
        raise CheckFailed("merge returned nan: a row that saw no key has lse = -inf, and "
                          "exp(-inf - (-inf)) is nan. Treat an lse of -inf as weight 0.")
    compare(lse, expected_lse, "merge's lse (the log of the total softmax denominator)",
            atol=1e-12, rtol=1e-12)
    compare(out, expected_out, "merge's output (each part weighted by exp(lse_part - lse))",
            atol=1e-12, rtol=1e-12)
    # Merging with nothing (lse = -inf everywhere) must leave a partial result unchanged, even
    # its rows that saw no key either (lse -inf on both sides: where ring attention starts).
    empty = (torch.zeros_like(out_b), torch.full_like(lse_b, -math.inf))
    with forbid(*COURSE, exercise="write the merge yourself"):
        same = call_learner(merge, *empty, out_b.clone(), lse_b.clone(), name="merge")
    if torch.isnan(same[0]).any() or torch.isnan(same[1]).any():
        raise CheckFailed("merge returned nan when neither part had seen a key for some query "
                          "(both lse = -inf, and exp(-inf - (-inf)) is nan). Treat an lse of "
                          "-inf as weight 0.")
    compare(same[0], out_b, "merge of an empty partial (lse = -inf) with a partial result",
            atol=1e-12, rtol=1e-12)
    passed("merge combines two partial attentions exactly, rows that saw no key included.")


# ---- exercise 2: one hop of the ring -------------------------------------------------------------

def _hop_rank(rank, world_size, ring_hop):
    mine = [torch.full((2,), float(rank + 1)), torch.arange(3, dtype=torch.float64) + 10 * rank]
    with forbid(*COURSE, exercise="post the sends and receives yourself"):
        got = ring_hop([t.clone() for t in mine])
    return [t.clone() for t in got] if isinstance(got, (list, tuple)) else got


def _check_ring_messages(trace, world_size, per_hop, what):
    for rank in range(world_size):
        right, left = (rank + 1) % world_size, (rank - 1) % world_size
        for peer, nbytes in trace.sends(rank):
            if peer != right:
                raise CheckFailed(f"rank {rank} sent {nbytes} bytes to rank {peer}; in a ring, "
                                  f"rank {rank} only sends to its right neighbour, rank {right}.")
        for event in trace.comm(rank):
            if event["op"] == "recv" and event["peer"] not in (None, left):
                raise CheckFailed(f"rank {rank} received from rank {event['peer']}; in a ring, "
                                  f"it only receives from its left neighbour, rank {left}.")
            if event["op"] not in ("send", "recv"):
                raise CheckFailed(f"rank {rank} called {event['op']}; {what} uses only "
                                  f"point-to-point messages to its neighbours.")
        sends = len(trace.sends(rank))
        if sends != per_hop:
            raise CheckFailed(f"rank {rank} sent {sends} messages; {what} sends each of its "
                              f"{per_hop} tensors once to the right.")


def check_ring_hop(ring_hop):
    """ring_hop(tensors) sends each tensor to the right neighbour and returns the left one's."""
    for n in WORLD_SIZES:
        results = run_learner(_hop_rank, n, ring_hop, name="ring_hop", trace=True, timeout=20)
        for rank, got in enumerate(results):
            left = (rank - 1) % n
            expected = [torch.full((2,), float(left + 1)),
                        torch.arange(3, dtype=torch.float64) + 10 * left]
            compare(got, expected, f"ring_hop with world_size={n}, rank {rank} (it should hold "
                    f"rank {left}'s tensors)")
        _check_ring_messages(results.trace, n, 2, "one ring hop")
    passed(f"ring_hop passes every tensor one step to the right, on {sizes_phrase(WORLD_SIZES)} "
           f"ranks, and talks only to its neighbours.")


# ---- exercise 3: ring attention forward from the two ---------------------------------------------

def _attention_rank(rank, world_size, attention, seq_len):
    positions = cp.zigzag_positions(seq_len, rank, world_size)
    g = torch.Generator().manual_seed(3)
    full = [torch.randn(1, 2, seq_len, 4, dtype=torch.float64, generator=g) for _ in range(3)]
    q, k, v = [t[:, :, positions].contiguous() for t in full]
    with forbid(cp.ring_attention, cp.RingAttention, cp.all_gather_attention, cp.dense_attention,
                cp._shift, exercise="build ring attention from your merge and ring_hop"):
        return positions, attention(q, k, v, positions)


def check_ring_attention(attention):
    """attention(q, k, v, positions) -> causal attention of this rank's queries over the whole
    sequence, with K/V (and their positions) passed around the ring."""
    for n in WORLD_SIZES:
        seq_len = 4 * n
        g = torch.Generator().manual_seed(3)
        full = [torch.randn(1, 2, seq_len, 4, dtype=torch.float64, generator=g) for _ in range(3)]
        expected = cp.dense_attention(*full, causal=True)
        results = run_learner(_attention_rank, n, attention, seq_len, name="ring attention",
                              trace=True, timeout=20)
        for rank, (positions, got) in enumerate(results):
            compare(got, expected[:, :, positions],
                    f"attention with world_size={n}, rank {rank} (tokens {positions.tolist()})",
                    atol=1e-10, rtol=1e-10)
        t = results.trace
        sent = len(t.sends(0))
        # K and V travel (and their positions, unless you compute them): 2 or 3 tensors a hop.
        if sent % (n - 1) or sent // (n - 1) not in (2, 3):
            raise CheckFailed(f"on {n} ranks rank 0 sent {sent} messages; the K/V blocks must "
                              f"travel n - 1 = {n - 1} hops, 2 or 3 tensors each (K, V and "
                              f"maybe their positions).")
        _check_ring_messages(t, n, sent, "ring attention")
    passed(f"ring attention equals dense causal attention on {sizes_phrase(WORLD_SIZES)} ranks, "
           f"with K/V blocks passed only to the right neighbour.")


# ---- exercise 4: ring attention's backward -------------------------------------------------------

def _dense_grads(seq_len):
    """Dense causal attention in float64 over one seeded sequence: inputs, dO, output, the
    log-sum-exp of every query, and the gradients dq, dk, dv."""
    g = torch.Generator().manual_seed(4)
    q, k, v, grad_out = (torch.randn(1, 2, seq_len, 4, dtype=torch.float64, generator=g)
                         for _ in range(4))
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = cp.dense_attention(*leaves, causal=True)
    out.backward(grad_out)
    pos = torch.arange(seq_len, dtype=torch.float64)
    scores = (q @ k.transpose(-2, -1)) / math.sqrt(q.shape[-1])
    lse = torch.logsumexp(scores.masked_fill(pos[None, :] > pos[:, None], -math.inf), dim=-1)
    return (q, k, v, grad_out, out.detach(), lse), [t.grad for t in leaves]


def _backward_rank(rank, world_size, ring_backward, seq_len):
    positions = cp.zigzag_positions(seq_len, rank, world_size)
    (q, k, v, grad_out, out, lse), _ = _dense_grads(seq_len)
    mine = [t[:, :, positions].contiguous() for t in (q, k, v)]
    with forbid(*COURSE, exercise="write the backward ring yourself"):
        got = ring_backward(*mine, positions, out[:, :, positions].contiguous(),
                            lse[:, :, positions].contiguous(), grad_out[:, :, positions].contiguous())
    return positions, got


def check_ring_backward(ring_backward):
    """ring_backward(q, k, v, positions, out, lse, grad_out) -> (dq, dk, dv) of this rank's
    block under causal attention, the blocks (and their gradients) passed around the ring."""
    for n in WORLD_SIZES:
        seq_len = 4 * n
        _, expected = _dense_grads(seq_len)
        results = run_learner(_backward_rank, n, ring_backward, seq_len,
                              name="ring_backward", trace=True, timeout=20)
        for rank, (positions, got) in enumerate(results):
            if not isinstance(got, (tuple, list)) or len(got) != 3:
                raise CheckFailed(f"ring_backward must return (dq, dk, dv); rank {rank} returned "
                                  f"{type(got).__name__} {got!r:.80}.")
            where = f"world_size={n}, rank {rank} (tokens {positions.tolist()})"
            compare(got[0], expected[0][:, :, positions], f"dq with {where}", 1e-10, 1e-10)
            for name, g, e in (("dk", got[1], expected[1]), ("dv", got[2], expected[2])):
                if first_difference(g, e[:, :, positions], 1e-10, 1e-10):
                    raise CheckFailed(
                        f"{name} with {where} is not the dense gradient, though dq is right: "
                        f"every rank's queries add to every block's key and value gradients, so "
                        f"those must travel with the block and come home — N = {n} hops, one more "
                        f"than K and V need — before you return them "
                        f"({first_difference(g, e[:, :, positions], 1e-10, 1e-10)}).")
        t = results.trace
        sent = len(t.sends(0))
        _check_ring_messages(t, n, sent, "ring attention's backward")
        if sent < 2 * n:
            raise CheckFailed(f"on {n} ranks rank 0 sent {sent} messages; a block's dK and dV "
                              f"must make N = {n} hops to come home (2 tensors a hop at least).")
    passed(f"ring attention's backward equals dense causal attention's gradients on "
           f"{sizes_phrase(WORLD_SIZES)} ranks; the block gradients came home around the ring.")
