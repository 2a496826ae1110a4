"""Workbook 12, exercise 3: ring attention with the queries travelling, K and V at home."""
import torch

from ... import context_parallel as cp
from ... import ulysses as _ulysses
from .. import CheckFailed, compare, forbid, passed, run_learner, sizes_phrase
from ._common import LARGE, WORLD_SIZES, _ring_traffic


HEADS, KV_HEADS, HEAD_DIM, PER_RANK = 4, 1, 4, 4


def _gqa_inputs(seq_len, scale=1.0):
    g = torch.Generator().manual_seed(3)
    q = torch.randn(1, HEADS, seq_len, HEAD_DIM, dtype=torch.float64, generator=g)
    k, v = (torch.randn(1, KV_HEADS, seq_len, HEAD_DIM, dtype=torch.float64, generator=g)
            for _ in range(2))
    return q * scale, k, v


def _gqa_dense(seq_len, scale=1.0):
    q, k, v = _gqa_inputs(seq_len, scale)
    r = HEADS // KV_HEADS
    return cp.dense_attention(q, k.repeat_interleave(r, 1), v.repeat_interleave(r, 1), True)


def _pass_q_rank(rank, world_size, attention, seq_len):
    positions = cp.zigzag_positions(seq_len, rank, world_size)
    course = (cp.ring_attention, cp.RingAttention, cp.all_gather_attention, cp.dense_attention,
              cp._shift, _ulysses.ulysses_attention, _gqa_inputs, _gqa_dense)
    outs = []
    for scale in (1.0, LARGE):
        q, k, v = [t[:, :, positions].contiguous() for t in _gqa_inputs(seq_len, scale)]
        with forbid(*course, exercise="pass the queries around the ring yourself"):
            outs.append(attention(q, k, v, positions))
    return positions, outs


def check_ring_attention_pass_q(attention):
    """attention(q, k, v, positions) -> causal attention of this rank's queries over the whole
    sequence, K and V staying home, the queries (and their partial results) passed around."""
    q_bytes = HEADS * PER_RANK * HEAD_DIM * 8
    kv_bytes = 2 * KV_HEADS * PER_RANK * HEAD_DIM * 8
    for n in WORLD_SIZES:
        seq_len = PER_RANK * n
        results = run_learner(_pass_q_rank, n, attention, seq_len, name="ring attention",
                              trace=True, timeout=20)
        for scale, i in ((1.0, 0), (LARGE, 1)):
            expected = _gqa_dense(seq_len, scale)
            for rank, (positions, outs) in enumerate(results):
                got = outs[i]
                where = (f"attention with world_size={n}, rank {rank} (tokens "
                         f"{positions.tolist()})" + (", scores of about a thousand" if i else ""))
                if i and torch.is_tensor(got) and not torch.isfinite(got).all():
                    raise CheckFailed(f"{where}: your attention returned inf or nan: merge the "
                                      f"partial results by their log-sum-exps, never by "
                                      f"exponentiating one.")
                compare(got, expected[:, :, positions], where, atol=1e-10, rtol=1e-10)
        sent = _ring_traffic(results.trace, n, "ring attention")
        least = 2 * ((n - 1) * q_bytes + q_bytes)      # two runs: q's n-1 hops, the output home
        for rank, nbytes in enumerate(sent):
            if nbytes < least:
                kv = nbytes <= 2 * (n - 1) * (kv_bytes + 8 * PER_RANK)
                raise CheckFailed(
                    f"on {n} ranks rank {rank} sent {nbytes:,} bytes in its two runs; "
                    + ("that is K and V travelling, as in the chapter's ring — here K and V stay "
                       "home and the queries travel (with their output so far), " if kv else
                       "the queries must make n - 1 hops and their output come home, ")
                    + f"at least {least:,} bytes.")
    passed(f"ring attention with the queries travelling equals dense causal attention (4 query "
           f"heads, 1 K/V head) on {sizes_phrase(WORLD_SIZES)} ranks, also at scores of about a "
           f"thousand; only the queries and their partial results went round, to the right "
           f"neighbour only.")
