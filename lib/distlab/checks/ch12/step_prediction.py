"""Workbook 12, exercise 5 (predict, then run): one ring step, and where its hop hides."""
import contextlib
import io
import math

import torch

from ... import context_parallel as cp
from ... import cost as _cost
from ... import hardware as _hardware
from ... import trace as _trace
from .. import CheckFailed, call_learner, forbid, passed, run


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
