"""Checkers of workbook 12: the online-softmax merge, one ring hop, ring attention built from
them, ring attention's backward (the chapter shows the course's, not this one), and a
prediction: one ring step's kernel and hop, and the block length where the hop hides.

The merge is checked in this process on small hand-made partials (including rows that saw no
key at all, and partials whose log-sum-exp is about 800, where exp overflows float64); the ring
hop and the ring attention run on real ranks at world sizes 3 and 5, where left and right
neighbours differ, and the run's trace must show messages to the right neighbour only, each
tensor once per hop. Ring attention and its backward are also run on scores of about a
thousand (a softmax without its max subtracted overflows), and ring attention's memory is
tracked op by op: with the same block length at 3 and at 5 ranks an online ring holds the same
bytes, while one that keeps every visiting block (and softmaxes once at the end) holds more with
every rank added.

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
from ..zero_memory import PeakTracker

WORLD_SIZES = (3, 5)
COURSE = (cp.merge, cp._shift, cp.ring_attention, cp.RingAttention, cp.block_attention,
          cp.all_gather_attention, cp.dense_attention)
# Scores of about a thousand: exp overflows float64 above 709, so a softmax (or a merge) that
# does not subtract its maximum (or the log-sum-exp) returns inf or nan here.
LARGE = 500.0


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
    # Large scores: the same partials with log-sum-exps near 800 (exp(800) overflows float64).
    # Only the difference of the two lse decides the weights; the merged lse moves by 800.
    big_a, big_b = lse_a + 800.0, lse_b + 799.0
    expected_out, expected_lse = cp.merge(out_a, big_a, out_b, big_b)
    with forbid(*COURSE, exercise="write the merge yourself"):
        out, lse = call_learner(merge, out_a.clone(), big_a.clone(), out_b.clone(), big_b.clone(),
                                name="merge")
    finite = [torch.isfinite(t).all() for t in (out, lse[torch.isfinite(expected_lse)])
              if isinstance(t, torch.Tensor)] if isinstance(lse, torch.Tensor) else []
    if not all(finite):
        raise CheckFailed("merge returned inf or nan for partials whose lse is about 800: "
                          "exp(800) overflows float64 (its largest value is about exp(709)). "
                          "Never exponentiate an lse itself: weigh each part by "
                          "exp(lse_part - lse) with lse = logaddexp(lse_a, lse_b), or subtract "
                          "the larger lse first.")
    compare(lse, expected_lse, "merge's lse for partials with lse about 800", 1e-12, 1e-12)
    compare(out, expected_out, "merge's output for partials with lse about 800", 1e-12, 1e-12)
    passed("merge combines two partial attentions exactly, rows that saw no key included, "
           "and at log-sum-exps of 800.")


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

def _attention_inputs(seq_len, scale=1.0):
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 2, seq_len, 4, dtype=torch.float64, generator=g) for _ in range(3))
    return q * scale, k, v


def _attention_rank(rank, world_size, attention, seq_len):
    """(positions, output, bytes held at the peak, output at large scores) on this rank."""
    positions = cp.zigzag_positions(seq_len, rank, world_size)
    refused = dict(exercise="build ring attention from your merge and ring_hop")
    course = (cp.ring_attention, cp.RingAttention, cp.all_gather_attention, cp.dense_attention,
              cp._shift)
    outs, peak = [], None
    for scale in (1.0, LARGE):
        q, k, v = [t[:, :, positions].contiguous() for t in _attention_inputs(seq_len, scale)]
        with forbid(*course, **refused), PeakTracker([q, k, v, positions]) as held:
            outs.append(attention(q, k, v, positions))
        peak = held.peak - held.baseline if peak is None else peak
    return positions, outs[0], peak, outs[1]


def check_ring_attention(attention):
    """attention(q, k, v, positions) -> causal attention of this rank's queries over the whole
    sequence, with K/V (and their positions) passed around the ring and merged as they come."""
    peaks = {}
    for n in WORLD_SIZES:
        seq_len = 4 * n                       # 4 tokens per rank at every world size
        expected = cp.dense_attention(*_attention_inputs(seq_len), causal=True)
        results = run_learner(_attention_rank, n, attention, seq_len, name="ring attention",
                              trace=True, timeout=20)
        for rank, (positions, got, _, _) in enumerate(results):
            compare(got, expected[:, :, positions],
                    f"attention with world_size={n}, rank {rank} (tokens {positions.tolist()})",
                    atol=1e-10, rtol=1e-10)
        large = cp.dense_attention(*_attention_inputs(seq_len, LARGE), causal=True)
        for rank, (positions, _, _, got) in enumerate(results):
            if isinstance(got, torch.Tensor) and not torch.isfinite(got).all():
                raise CheckFailed(
                    f"with scores of about a thousand (world_size={n}, rank {rank}) your "
                    f"attention returned inf or nan: exp overflows float64 above 709. Keep a "
                    f"running maximum (or log-sum-exp) per query and exponentiate scores minus "
                    f"it, as the online softmax's merge does.")
            compare(got, large[:, :, positions], f"attention at scores of about a thousand, "
                    f"world_size={n}, rank {rank}", atol=1e-10, rtol=1e-10)
        peaks[n] = max(peak for _, _, peak, _ in results)
        t = results.trace
        sent = len(t.sends(0))
        # two runs (ordinary and large scores); K and V travel (and their positions, unless
        # you compute them): 2 or 3 tensors a hop
        if sent % (2 * (n - 1)) or sent // (2 * (n - 1)) not in (2, 3):
            raise CheckFailed(f"on {n} ranks rank 0 sent {sent // 2} messages per attention; "
                              f"the K/V blocks must travel n - 1 = {n - 1} hops, 2 or 3 tensors "
                              f"each (K, V and maybe their positions).")
        _check_ring_messages(t, n, sent, "ring attention")
    # The same 4 tokens per rank at every world size: an online ring holds one block in hand,
    # one arriving and the running output, however many ranks there are.
    small, big = min(WORLD_SIZES), max(WORLD_SIZES)
    block = 2 * 4 * 4 * 8                       # bytes of one K (or V) block: 2 heads × 4 × 4
    growth = (peaks[big] - peaks[small]) / block
    if growth > 0.5:
        raise CheckFailed(
            f"with the same 4 tokens per rank, your ring attention held {peaks[small]:,} bytes "
            f"at its peak on {small} ranks and {peaks[big]:,} on {big} — {growth:.1f} K/V "
            f"blocks more: it keeps what it has seen. Ring attention folds each visiting block "
            f"into a running output and log-sum-exp (the online softmax, your merge) and lets "
            f"it go; keeping every block for one softmax at the end holds the whole sequence's "
            f"K/V on every rank, which context parallelism exists to avoid.")
    passed(f"ring attention equals dense causal attention on {sizes_phrase(WORLD_SIZES)} ranks, "
           f"also at scores of about a thousand, with K/V blocks passed only to the right "
           f"neighbour and merged as they arrive (the same bytes held at {small} and {big} "
           f"ranks).")


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
        with forbid(*COURSE, exercise="write the backward ring yourself"):
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
        t = results.trace
        sent = len(t.sends(0))
        _check_ring_messages(t, n, sent, "ring attention's backward")
        if sent < 2 * n:
            raise CheckFailed(f"on {n} ranks rank 0 sent {sent} messages; a block's dK and dV "
                              f"must make N = {n} hops to come home (2 tensors a hop at least).")
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
