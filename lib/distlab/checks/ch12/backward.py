"""Workbook 12, exercise 4: ring attention's backward."""
import math

import torch

from ... import context_parallel as cp
from .. import CheckFailed, compare, first_difference, forbid, passed, run_learner, sizes_phrase
from ._common import COURSE, LARGE, WORLD_SIZES, _ring_traffic


def _dense_grads(seq_len, scale=1.0):
    """Dense causal attention in float64 over one seeded sequence (queries times `scale`):
    inputs, dO, output, the log-sum-exp of every query, and the gradients dq, dk, dv."""
    g = torch.Generator().manual_seed(4)
    q, k, v, grad_out = (torch.randn(1, 2, seq_len, 4, dtype=torch.float64, generator=g)
                         for _ in range(4))
    q = q * scale
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = cp.dense_attention(*leaves, causal=True)
    out.backward(grad_out)
    pos = torch.arange(seq_len, dtype=torch.float64)
    scores = (q @ k.transpose(-2, -1)) / math.sqrt(q.shape[-1])
    lse = torch.logsumexp(scores.masked_fill(pos[None, :] > pos[:, None], -math.inf), dim=-1)
    return (q, k, v, grad_out, out.detach(), lse), [t.grad for t in leaves]


def _backward_rank(rank, world_size, ring_backward, seq_len):
    """(positions, gradients, gradients at scores of about a thousand) on this rank."""
    positions = cp.zigzag_positions(seq_len, rank, world_size)
    got = []
    for scale in (1.0, LARGE):
        (q, k, v, grad_out, out, lse), _ = _dense_grads(seq_len, scale)
        mine = [t[:, :, positions].contiguous() for t in (q, k, v, out, lse, grad_out)]
        with forbid(*COURSE, _dense_grads, exercise="write the backward ring yourself"):
            got.append(ring_backward(*mine[:3], positions, *mine[3:]))
    return positions, got[0], got[1]


def check_ring_backward(ring_backward):
    """ring_backward(q, k, v, positions, out, lse, grad_out) -> (dq, dk, dv) of this rank's
    block under causal attention, the blocks (and their gradients) passed around the ring."""
    for n in WORLD_SIZES:
        seq_len = 4 * n
        _, expected = _dense_grads(seq_len)
        results = run_learner(_backward_rank, n, ring_backward, seq_len,
                              name="ring_backward", trace=True, timeout=20)
        for rank, (positions, got, _) in enumerate(results):
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
        _, large = _dense_grads(seq_len, LARGE)
        for rank, (positions, _, got) in enumerate(results):
            got = list(got) if isinstance(got, (tuple, list)) else [got]
            if any(isinstance(g, torch.Tensor) and not torch.isfinite(g).all() for g in got):
                raise CheckFailed(
                    f"with scores of about a thousand (world_size={n}, rank {rank}) your "
                    f"gradients hold inf or nan: exp overflows float64 above 709. Take P as "
                    f"exp(S - lse) in one exponential, never exp(S) / exp(lse).")
            compare(got, [e[:, :, positions] for e in large], f"gradients (dq, dk, dv) at "
                    f"scores of about a thousand, world_size={n}, rank {rank}", 1e-10, 1e-10)
        block = 2 * 4 * 4 * 8                   # one K (or V) block: 2 heads × 4 tokens × 4
        least = 2 * n * 2 * block               # two runs; dK and dV make N hops to come home
        for rank, nbytes in enumerate(_ring_traffic(results.trace, n,
                                                    "ring attention's backward")):
            if nbytes < least:
                raise CheckFailed(f"on {n} ranks rank {rank} sent {nbytes:,} bytes in its two "
                                  f"runs; a block's dK and dV must make N = {n} hops to come "
                                  f"home, at least {least:,} bytes.")
    passed(f"ring attention's backward equals dense causal attention's gradients on "
           f"{sizes_phrase(WORLD_SIZES)} ranks, also at scores of about a thousand; the block "
           f"gradients came home around the ring.")
