"""Checkers of workbook 12: the online softmax in the form a flash kernel streams it (a running
maximum, a running sum and an unnormalised output), one ring hop, ring attention in the other
direction (the queries travel, K and V stay), ring attention's backward (the chapter shows the
course's, not this one), and a prediction: one ring step's kernel and hop, and the block length
where the hop hides.

The online softmax is checked in this process on blocks of keys folded one by one, two
sequences interleaved (a fold that remembers more than its state cannot pass), with rows whose
maximum arrives in the last block, rows that see no key at all or none in the first blocks, and
scores of about a thousand (exp overflows float64 above 709). The ring hop, the pass-Q ring and
the backward run on real ranks at world sizes 3 and 5, where left and right neighbours differ;
the run's trace must show point-to-point messages to the right neighbour only, judged by the
bytes they carry (one packed message per hop is as good as one per tensor): a hop carries
exactly its tensors; the pass-Q ring at least the queries' N − 1 hops and the output's way
home, under grouped-query attention where K and V are four times smaller than Q, so that a ring
that passes K and V instead is refused although its numbers are right.

The prediction (`check_ring_step`) is compared term by term (the kernel; the hop's bandwidth
term with α = 0; its latency with infinite bandwidth) with the closed form, then with the
course's ring attention run at full size on meta tensors under the emulator, on a device and
two links built here (NVLink-like and InfiniBand-like), below and above the learner's crossover.
"""
import contextlib
import io
import math

import torch

from . import (CheckFailed, call_learner, compare, first_difference, forbid, passed, run,
               run_learner, sizes_phrase)
from .. import context_parallel as cp
from .. import cost as _cost
from .. import hardware as _hardware
from .. import trace as _trace
from .. import ulysses as _ulysses

WORLD_SIZES = (3, 5)
COURSE = (cp.merge, cp._shift, cp.ring_attention, cp.RingAttention, cp.block_attention,
          cp.all_gather_attention, cp.dense_attention)
# Scores of about a thousand: exp overflows float64 above 709, so a softmax (or a merge) that
# does not subtract its maximum (or the log-sum-exp) returns inf or nan here.
LARGE = 500.0


# ---- exercise 1: the online softmax, as a flash kernel streams it ---------------------------------

def _fold_cases():
    """[(what, scores, v, blocks)]: scores (..., q, keys) with -inf where masked, split into
    blocks of keys. Row 0's maximum is in the last block; row 1 sees no key at all; row 2 sees
    none in the first block; row 3's last key scores 800 above the rest (a fold that keeps its
    first maximum as the reference overflows)."""
    g = torch.Generator().manual_seed(21)
    cases = []
    for shape, blocks, shift in ((((1, 2), 4, 3), (3, 1, 4, 2), 0.0),
                                 (((2, 1), 4, 5), (1, 5, 2), 0.0),
                                 (((1, 3), 5, 2), (2, 2, 3), 1000.0)):
        lead, n_q, d_v = shape
        n_k = sum(blocks)
        scores = 3 * torch.randn(*lead, n_q, n_k, generator=g, dtype=torch.float64) + shift
        scores[..., 0, -1] += 25.0                              # row 0: its max comes last
        scores[..., 1, :] = -math.inf                           # row 1: sees nothing
        scores[..., 2, : blocks[0]] = -math.inf                 # row 2: nothing in block 1
        scores[..., 3, -1] += 800.0                             # row 3: a jump past exp's range
        v = torch.randn(*lead, n_k, d_v, generator=g, dtype=torch.float64)
        what = (f"scores {tuple(scores.shape)} in blocks of {list(blocks)} keys"
                + (f", scores of about {shift:.0f}" if shift else ""))
        cases.append((what, scores, v, blocks))
    return cases


def _softmax_reference(scores, v):
    lse = torch.logsumexp(scores, dim=-1)
    p = torch.exp(scores - torch.where(torch.isinf(lse), 0.0, lse).unsqueeze(-1))
    return p @ v, lse


def _start(scores, v):
    lead = scores.shape[:-1]
    return (torch.zeros(*lead, v.shape[-1], dtype=v.dtype), torch.full(lead, -math.inf,
            dtype=scores.dtype), torch.zeros(lead, dtype=scores.dtype))


def _state_ok(state, scores, v, where):
    lead = tuple(scores.shape[:-1])
    shapes = (lead + (v.shape[-1],), lead, lead)
    if (not isinstance(state, (tuple, list)) or len(state) != 3
            or not all(torch.is_tensor(t) and tuple(t.shape) == s for t, s in zip(state, shapes))):
        raise CheckFailed(f"fold {where} should return the state (acc, m, l) with shapes "
                          f"{[s for s in shapes]} — the output so far, unnormalised, the running "
                          f"maximum and the running sum — and nothing that grows with the keys; "
                          f"got {state!r:.80}.")
    return tuple(state)


def _learner_fold(fold, state, scores, v, where):
    with forbid(*COURSE, exercise="write the online softmax yourself"):
        got = call_learner(fold, state, scores.clone(), v.clone(), name="fold")
    return _state_ok(got, scores, v, where)


def check_online_softmax(fold, finish):
    """fold((acc, m, l), scores, v) -> (acc, m, l) folds a block of keys into the running state;
    finish((acc, m, l)) -> (out, lse): softmax(all scores) @ all v and the log-sum-exp."""
    cases = _fold_cases()
    states = [_start(scores, v) for _, scores, v, _ in cases]
    cuts = [[0, *torch.tensor(blocks).cumsum(0).tolist()] for _, _, _, blocks in cases]
    # The cases' blocks folded in turn, interleaved: a fold that keeps anything beyond its state
    # mixes the sequences.
    for step in range(max(len(b) for _, _, _, b in cases)):
        for i, (what, scores, v, blocks) in enumerate(cases):
            if step >= len(blocks):
                continue
            a, b = cuts[i][step], cuts[i][step + 1]
            states[i] = _learner_fold(fold, states[i], scores[..., a:b], v[..., a:b, :],
                                      f"on {what}, block {step + 1}")
    for (what, scores, v, blocks), state in zip(cases, states):
        with forbid(*COURSE, exercise="write the online softmax yourself"):
            got = call_learner(finish, state, name="finish")
        if not isinstance(got, (tuple, list)) or len(got) != 2:
            raise CheckFailed(f"finish should return (out, lse); got {got!r:.80}.")
        out, lse = got
        want_out, want_lse = _softmax_reference(scores, v)
        where = f"on {what}"
        if not (torch.is_tensor(out) and torch.is_tensor(lse) and out.shape == want_out.shape
                and lse.shape == want_lse.shape):
            raise CheckFailed(f"finish {where} should return out {tuple(want_out.shape)} and lse "
                              f"{tuple(want_lse.shape)}; got {out!r:.60} and {lse!r:.60}.")
        finite = torch.isfinite(want_lse)
        bad = [r for r in range(scores.shape[-2])
               if not torch.isfinite(out[..., r, :]).all() or torch.isnan(lse[..., r]).any()
               or (torch.isinf(lse[..., r]) & finite[..., r]).any()]
        if bad and bad[0] in (1, 2):
            which = "no key" + (" in the first block" if bad[0] == 2 else "")
            came = "nan" if torch.isnan(out[..., bad[0], :]).any() else "inf"
            raise CheckFailed(
                f"{where}: row {bad[0]} (which sees {which}) came out {came}. A row that has "
                f"seen no key yet has m = -inf, and exp(-inf - (-inf)) is nan: where the new "
                f"maximum is -inf, rescale by 0 (nothing was accumulated), and finish a row "
                f"with l = 0 as output 0, lse -inf.")
        if bad:
            raise CheckFailed(
                f"{where}: row {bad[0]} came out inf or nan: one of its scores is 800 above the "
                f"others, and exp of a difference above 709 overflows float64. Exponentiate "
                f"scores minus the running maximum — the largest score seen so far — only.")
        compare(lse, want_lse, f"finish's lse {where} (the log of the whole softmax "
                f"denominator)", atol=1e-10, rtol=1e-12)
        seen = [r for r in range(scores.shape[-2]) if r != 1]       # row 1 saw no key
        scale = ((out * want_out).sum(-1) / (want_out * want_out).sum(-1).clamp_min(1e-300))
        if (torch.allclose(out[..., seen, :], scale[..., seen, None] * want_out[..., seen, :],
                           atol=1e-10, rtol=1e-8)
                and not torch.allclose(scale[..., seen], torch.ones_like(scale[..., seen]))):
            raise CheckFailed(
                f"{where}: every output row points the right way but has the wrong length (row "
                f"0 is {scale.reshape(-1, scale.shape[-1])[0, 0].item():.3g} times the softmax's): "
                f"acc is not normalised — finish divides it by the softmax's denominator, l.")
        if first_difference(out[..., 0, :], want_out[..., 0, :], 1e-10, 1e-10):
            raise CheckFailed(
                f"{where}: row 0 is wrong — its maximum arrives in the last block. When a block "
                f"raises a row's maximum from m to m', what was accumulated so far was weighted "
                f"by exp(score − m): rescale both acc and l by exp(m − m') before adding the "
                f"block.")
        compare(out, want_out, f"finish's output {where} (softmax of all the scores times v)",
                atol=1e-10, rtol=1e-10)
    passed("fold and finish stream a softmax exactly, block by block — rows whose maximum "
           "arrives last, rows that see nothing, or nothing at first, and scores of about a "
           "thousand — on 3 shapes folded interleaved, the state never larger than one output "
           "row, one maximum and one sum per query.")


# ---- the ring's traffic, judged by what it carried -----------------------------------------------

def _ring_traffic(trace, world_size, what):
    """Point-to-point messages to the right neighbour only; returns the bytes each rank sent."""
    sent = []
    for rank in range(world_size):
        right, left = (rank + 1) % world_size, (rank - 1) % world_size
        for event in trace.comm(rank):
            if event["op"] not in ("send", "recv"):
                raise CheckFailed(f"rank {rank} called {event['op']}; {what} uses only "
                                  f"point-to-point messages to its neighbours.")
            if event["op"] == "send" and event["peer"] != right:
                raise CheckFailed(f"rank {rank} sent {event['bytes']} bytes to rank "
                                  f"{event['peer']}; in a ring, rank {rank} only sends to its "
                                  f"right neighbour, rank {right}.")
            if event["op"] == "recv" and event["peer"] not in (None, left):
                raise CheckFailed(f"rank {rank} received from rank {event['peer']}; in a ring, "
                                  f"it only receives from its left neighbour, rank {left}.")
        sent.append(sum(b for _, b in trace.sends(rank)))
    return sent


# ---- exercise 2: one hop of the ring -------------------------------------------------------------

def _hop_tensors(rank, seed=0):
    g = torch.Generator().manual_seed(1000 * seed + rank)
    return [torch.randn(2, generator=g, dtype=torch.float64),
            torch.randn(3, 2, generator=g, dtype=torch.float64),
            torch.randint(0, 100, (4,), generator=g)]


def _hop_rank(rank, world_size, ring_hop):
    mine = _hop_tensors(rank)
    with forbid(*COURSE, _hop_tensors, exercise="post the sends and receives yourself"):
        got = ring_hop([t.clone() for t in mine])
    return [t.clone() for t in got] if isinstance(got, (list, tuple)) else got


def check_ring_hop(ring_hop):
    """ring_hop(tensors) sends each tensor to the right neighbour and returns the left one's."""
    hop_bytes = sum(t.numel() * t.element_size() for t in _hop_tensors(0))
    for n in WORLD_SIZES:
        results = run_learner(_hop_rank, n, ring_hop, name="ring_hop", trace=True, timeout=20)
        for rank, got in enumerate(results):
            left = (rank - 1) % n
            compare(got, _hop_tensors(left), f"ring_hop with world_size={n}, rank {rank} (it "
                    f"should hold rank {left}'s tensors, same shapes and dtypes)")
        for rank, nbytes in enumerate(_ring_traffic(results.trace, n, "one ring hop")):
            if nbytes != hop_bytes:
                raise CheckFailed(f"with world_size={n}, rank {rank} sent {nbytes} bytes; one "
                                  f"hop sends its {hop_bytes} bytes of tensors once to the "
                                  f"right, no more.")
    passed(f"ring_hop passes every tensor one step to the right, on {sizes_phrase(WORLD_SIZES)} "
           f"ranks, each byte once, and talks only to its neighbours.")


# ---- exercise 3: ring attention with the queries travelling --------------------------------------

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


# ---- exercise 4: ring attention's backward -------------------------------------------------------

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


# ---- exercise 5: predict, then run — one ring step, and where its hop hides ----------------------
#
# The learner writes one causal zig-zag ring step's kernel and hop (`ring_step`) and the block
# length at which they are equal (`crossover`), on an α-β link. The closed form below charges
# what the emulator charges for the course's ring attention on the device and links built here
# (a flash kernel's FLOPs at a flat rate, K and V as two messages of α + bytes / B each); the run
# is that ring attention at full size on meta tensors, whose virtual clocks the check reads.

# The check's GPU: a flash kernel at a flat 400 TFLOP/s in bf16, between FlashAttention-2's
# ≈ 346 and FlashAttention-3's 740 TFLOP/s on an H100 (Shah et al. 2024, FlashAttention-3,
# abstract; chapter 12 section 6 quotes both). Built here, like the links below, so that the
# check never moves when a preset is recalibrated.
FLOPS = 400e12
# α-β links, NVLink-like and InfiniBand-like: NVLink 4's and one NDR NIC's achieved bus bandwidth
# and message latency as distlab.hardware's NVLINK4 and IB_NDR carry them today (370 GB/s, 5 µs;
# 47 GB/s, 10 µs: NCCL's tuning model and nccl-tests, sourced there)
NVLINK = _cost.Link(5e-6, 370e9, "NVLink-like")
IB = _cost.Link(10e-6, 47e9, "InfiniBand-like")
# (heads, kv_heads, head_dim, itemsize, flops, link): multi-head and grouped-query attention,
# bf16 and fp32, a slow kernel on a slow link
STEP_CASES = [(32, 32, 128, 2, FLOPS, NVLINK), (32, 8, 128, 2, FLOPS, IB),
              (16, 16, 64, 4, 60e12, _cost.Link(20e-6, 25e9, "a slow link"))]
BLOCKS = (1_000, 4_096, 30_000)
RANKS = 3                       # the emulated ring: left and right neighbours differ


def _closed_step(c, heads, kv_heads, head_dim, itemsize, flops, link):
    """(kernel, hop) seconds of one step: a causal zig-zag step is half a block's 4·c²·H·d."""
    kernel = 0.5 * 4 * c * c * heads * head_dim / flops
    hop = 2 * (link.alpha + c * kv_heads * head_dim * itemsize / link.bandwidth)
    return kernel, hop


def _closed_crossover(heads, kv_heads, head_dim, itemsize, flops, link):
    """The c where kernel = hop: a·c² = b·c + 2α, its positive root."""
    a = 2 * heads * head_dim / flops
    b = 2 * kv_heads * head_dim * itemsize / link.bandwidth
    return (b + math.sqrt(b * b + 8 * a * link.alpha)) / (2 * a)


_REFUSED = (cp.ring_step_seconds, cp.overlap_condition, cp.overlap_block_length,
            _closed_step, _closed_crossover)


def _learner(fn, name, *args):
    with forbid(*_REFUSED, exercise="write the formula yourself"):
        return call_learner(fn, *args, name=name)


def _seconds(got, name, what):
    try:
        value = float(got)
    except (TypeError, ValueError):
        raise CheckFailed(f"{name} should return {what} as a number; got {got!r:.80}.") from None
    if not math.isfinite(value) or value < 0:
        raise CheckFailed(f"{name} returned {value!r} for {what}: a finite number >= 0.")
    return value


def _step(ring_step, c, *case):
    got = _learner(ring_step, "ring_step", c, *case)
    if not isinstance(got, (tuple, list)) or len(got) != 2:
        raise CheckFailed(f"ring_step must return a pair (kernel seconds, hop seconds); it "
                          f"returned {type(got).__name__} {got!r:.80}.")
    return (_seconds(got[0], "ring_step", "the kernel's seconds"),
            _seconds(got[1], "ring_step", "the hop's seconds"))


def _close(a, b, rel=1e-6):
    return math.isclose(a, b, rel_tol=rel, abs_tol=1e-18)


def _kernel_hint(ratio, heads, kv_heads):
    if _close(ratio, 2):
        return ("it counts the whole c×c block; under a causal mask with zig-zag blocks every "
                "step computes half a block (f = ½)")
    if _close(ratio, 0.5):
        return ("it counts half of the FLOPs: Q·Kᵀ and P·V are 2·c²·d each per head, "
                "4·c²·H·d for a whole block, half of that under the causal mask")
    if heads != kv_heads and _close(ratio, kv_heads / heads):
        return "the kernel's FLOPs count every query head (H), not the K/V heads"
    return "the kernel is 4·f·c²·H·d FLOPs at `flops` FLOP/s, f = ½ for a causal zig-zag step"


def _hop_hint(ratio, heads, kv_heads, itemsize):
    if heads != kv_heads and _close(ratio, heads / kv_heads):
        return ("under grouped-query attention K and V have kv_heads heads: the hop carries "
                "kv_heads·head_dim values per token, not heads·head_dim")
    if _close(ratio, 0.5):
        return "two tensors travel each hop: K and V"
    if _close(ratio, 2 / itemsize) or _close(ratio, 4 / itemsize) or _close(ratio, 1 / itemsize):
        return f"each value is `itemsize` bytes ({itemsize} here)"
    return "K and V are c·kv_heads·head_dim values of `itemsize` bytes each, sent at B bytes/s"


def _check_terms(ring_step, crossover):
    for heads, kv_heads, head_dim, itemsize, flops, link in STEP_CASES:
        case = (heads, kv_heads, head_dim, itemsize, flops, link)
        shape = (f"H = {heads}, KV = {kv_heads}, d = {head_dim}, {itemsize}-byte values, "
                 f"{flops / 1e12:g} TFLOP/s, {link}")
        free_bw = _cost.Link(link.alpha, math.inf, link.name)
        no_alpha = _cost.Link(0.0, link.bandwidth, link.name)
        for c in BLOCKS:
            kernel, hop = _closed_step(c, *case)
            got_kernel, got_hop = _step(ring_step, c, *case)
            if not _close(got_kernel, kernel):
                raise CheckFailed(
                    f"ring_step's kernel for c = {c:,} tokens ({shape}) is {got_kernel * 1e6:.4g} "
                    f"µs, the closed form {kernel * 1e6:.4g} µs: "
                    f"{_kernel_hint(got_kernel / kernel, heads, kv_heads)}.")
            _, bw_hop = _closed_step(c, *case[:5], no_alpha)
            _, got_bw = _step(ring_step, c, *case[:5], no_alpha)
            if not _close(got_bw, bw_hop):
                raise CheckFailed(
                    f"ring_step's hop for c = {c:,} tokens ({shape}) with α = 0 is "
                    f"{got_bw * 1e6:.4g} µs, the bandwidth term {bw_hop * 1e6:.4g} µs: "
                    f"{_hop_hint(got_bw / bw_hop, heads, kv_heads, itemsize)}.")
            _, got_alpha = _step(ring_step, c, *case[:5], free_bw)
            if not _close(got_alpha, 2 * link.alpha):
                counted = (f"{got_alpha / link.alpha:.3g}·α" if got_alpha else "nothing")
                raise CheckFailed(
                    f"ring_step's hop with infinite bandwidth ({shape}) counts {counted}; it "
                    f"pays 2·α: K and V are two messages, each with the link's latency "
                    f"link.alpha.")
            if not _close(got_hop, hop):
                raise CheckFailed(f"ring_step's hop for c = {c:,} ({shape}) is "
                                  f"{got_hop * 1e6:.4g} µs, the closed form {hop * 1e6:.4g} µs, "
                                  f"though its latency and bandwidth terms are right alone: "
                                  f"they add up.")
        want = _closed_crossover(*case)
        got = _seconds(_learner(crossover, "crossover", *case), "crossover", "tokens per rank")
        plain = _closed_crossover(*case[:5], no_alpha)
        if not _close(got, want):
            if _close(got, plain) or _close(got, plain / 2) or _close(got, plain * 2):
                raise CheckFailed(
                    f"crossover({shape}) is {got:,.1f} tokens per rank, the closed form "
                    f"{want:,.1f}: yours leaves out the latency. With α the hop is 2α + b·c, so "
                    f"the kernel a·c² catches up only at the positive root of a·c² = b·c + 2α "
                    f"(without α: {plain:,.1f}).")
            mine = _step(ring_step, want, *case)
            raise CheckFailed(
                f"crossover({shape}) is {got:,.1f} tokens per rank, the closed form {want:,.1f} "
                f"(where your ring_step gives kernel {mine[0] * 1e6:.4g} µs and hop "
                f"{mine[1] * 1e6:.4g} µs): the crossover is the block length at which the two "
                f"are equal.")


def _emulated_ring(rank, world_size, blocks, heads, head_dim):
    """The course's ring attention forward, causal zig-zag, bf16 meta tensors at full size:
    this rank's virtual seconds for each block length (tokens per rank)."""
    import torch.distributed as dist
    seconds = []
    for c in blocks:
        positions = cp.zigzag_positions(c * world_size, rank, world_size)
        with torch.device("meta"):
            q, k, v = [torch.empty(1, heads, c, head_dim, dtype=torch.bfloat16)
                       for _ in range(3)]
        dist.barrier()
        start = _trace.now()
        cp.ring_attention(q, k, v, positions, causal=True)
        seconds.append(_trace.now() - start)
    return seconds


def check_ring_step(ring_step, crossover):
    """ring_step(c, heads, kv_heads, head_dim, itemsize, flops, link) -> (kernel s, hop s) of one
    causal zig-zag ring-attention forward step; crossover(heads, kv_heads, head_dim, itemsize,
    flops, link) -> tokens per rank where they are equal. Compared term by term with the closed
    form, then with the course's ring attention emulated at full size below and above it."""
    for fn, name in ((ring_step, "ring_step"), (crossover, "crossover")):
        if not callable(fn):
            raise TypeError(f"the check needs your functions, check_ring_step(ring_step, "
                            f"crossover); {name} is {fn!r}.")
    _check_terms(ring_step, crossover)
    # The run: a device that charges a flash kernel its FLOPs at FLOPS (no launch floor, memory
    # traffic free), links whose messages cost α + bytes / B and whose collectives only their
    # bytes (the ring's two tiny all-gathers of block lengths and positions)
    device = _hardware.Device("a GPU built by the check", {torch.float32: FLOPS,
                                                            torch.bfloat16: FLOPS}, 1e18)
    heads, head_dim, lines = 32, 128, []
    for link in (NVLINK, IB):
        wire = _hardware.Link(link.name, link.bandwidth, latency=0.0, p2p_latency=link.alpha)
        cluster = _hardware.Cluster(f"{RANKS} GPUs on {link.name} links", device, wire, None,
                                    RANKS, "built by the check")
        yours = _seconds(_learner(crossover, "crossover", heads, heads, head_dim, 2, FLOPS, link),
                         "crossover", "tokens per rank")
        blocks = [max(2, 2 * round(yours * f / 2)) for f in (0.5, 2.0)]     # zig-zag: even c
        with contextlib.redirect_stdout(io.StringIO()):
            got = run(_emulated_ring, RANKS, blocks, heads, head_dim, emulate=cluster,
                      timeout=120)
        for i, c in enumerate(blocks):
            emulated = max(seconds[i] for seconds in got)
            kernel, hop = _closed_step(c, heads, heads, head_dim, 2, FLOPS, link)
            closed = kernel + (RANKS - 1) * max(kernel, hop)
            if not math.isclose(emulated, closed, rel_tol=0.01):
                raise RuntimeError(f"the emulated ring took {emulated * 1e6:.4g} µs at c = {c:,} "
                                   f"and the closed form says {closed * 1e6:.4g} µs: the emulator "
                                   f"no longer charges what this check assumes — a bug in the "
                                   f"course, not in your formula.")
            k, h = _step(ring_step, c, heads, heads, head_dim, 2, FLOPS, link)
            predicted = k + (RANKS - 1) * max(k, h)
            if not math.isclose(predicted, emulated, rel_tol=0.01):
                raise CheckFailed(f"at c = {c:,} tokens per rank on {link}, your step predicts "
                                  f"a ring forward of {predicted * 1e6:.4g} µs (one kernel, then "
                                  f"{RANKS - 1} steps of the longer of kernel and hop), the "
                                  f"emulated run took {emulated * 1e6:.4g} µs.")
            exposed = max(0.0, emulated - RANKS * kernel) / emulated
            lines.append(f"  {link.name:16} c = {c:>6,} ({'below' if i == 0 else 'above'} your "
                         f"crossover {yours:,.0f}): predicted {predicted * 1e3:7.3f} ms, "
                         f"emulated {emulated * 1e3:7.3f} ms, hop exposed {exposed:4.0%}")
    print("\n".join(lines))
    passed("ring_step and crossover match the closed form term by term (the kernel 2·c²·H·d / P; "
           "the hop 2·(α + c·KV·d·itemsize / B); the root of a·c² = b·c + 2α) on "
           f"{len(STEP_CASES)} shapes and links, and the course's ring attention emulated at "
           f"full size on {RANKS} ranks within 1 % below and above your crossover (the emulator "
           f"charges the same formulas, so this checks the ring's critical path — the next block "
           f"travels while this one is computed — not the hardware; times modeled, not "
           f"measured).")
