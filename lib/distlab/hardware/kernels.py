"""Fused attention as its own kind of kernel: what FlashAttention achieves, by device, sequence
length, head size, causal mask and direction.

A flash kernel is not a GEMM of depth head-dim: it streams K and V blocks past a resident Q
block, keeping the scores on chip, so its rate is set by how well it hides the softmax and the
block loads behind the tensor cores — it reaches 0.35-0.65 of peak on an H100 where a GEMM of
depth 128 would be charged ≈ 0.27. Its time is modeled as

    FLOPs / (peak · best · L / (L + L_half) · head(d))

with FLOPs counted as FlashAttention's authors count them (4·b·h·s_q·s_k·d forward, 2.5× that
backward, half of both when causal), L the key length, `best` the rate of long sequences at head
dim 128, L_half the key length at which a kernel reaches half of it (short sequences leave SMs
idle and pay each block's fixed cost), and head(d) = (d / (d + d_half)) / (128 / (128 + d_half))
the smaller rate of small heads. A causal kernel has its own `best` and L_half: at short lengths
most of its blocks straddle the diagonal and do masked work.

Which kernel runs: PyTorch's scaled_dot_product_attention picks FlashAttention-2 first on
A100 and H100 ("a fixed priority that puts FlashAttention first", huggingface/transformers#48163,
2026), so `FA2_*` are the devices' defaults; FlashAttention-3 (Hopper only, a separate package,
what Megatron/TransformerEngine and torchtitan's flex/FA3 paths can use) is `FA3_H100`:
`Device.with_attention(FA3_H100)`.
"""
from collections import namedtuple
from dataclasses import dataclass

# What the emulator knows of one attention call: query and key lengths, head size, batch×heads,
# causal, and whether it is the backward kernel.
AttentionShape = namedtuple("AttentionShape",
                            "q_len kv_len head_dim batch_heads causal backward")


@dataclass(frozen=True)
class AttentionKernel:
    """A fused attention kernel's rates as fractions of the device's dense bf16 peak:
    `fwd`/`bwd` for long non-causal sequences at head dim 128, `fwd_causal`/`bwd_causal` the same
    with a causal mask; `*_half` the key lengths at which each reaches half of that; `head_half`
    the head size at which a kernel would reach half its head-128 rate's asymptote."""
    name: str
    fwd: float
    fwd_half: float
    fwd_causal: float
    fwd_causal_half: float
    bwd: float
    bwd_half: float
    bwd_causal: float
    bwd_causal_half: float
    head_half: float
    source: str = ""

    def efficiency(self, kv_len, head_dim, causal=False, backward=False):
        """Achieved fraction of peak of one call (see the module docstring)."""
        if backward:
            best, half = (self.bwd_causal, self.bwd_causal_half) if causal \
                else (self.bwd, self.bwd_half)
        else:
            best, half = (self.fwd_causal, self.fwd_causal_half) if causal \
                else (self.fwd, self.fwd_half)
        length = kv_len / (kv_len + half)
        head = (head_dim / (head_dim + self.head_half)) / (128 / (128 + self.head_half))
        return min(1.0, best * length * head)


_H100_PEAK_TFLOPS = 989.0

# FlashAttention-2 on an H100 SXM5, bf16/fp16, head dim 128, batch × length = 16k tokens, hidden
# 2048: the FA2 bars of Shah et al. 2024 (FlashAttention-3, arXiv:2407.08608), Figures 5 and 6,
# TFLOP/s at lengths 512, 1k, 2k, 4k, 8k, 16k — forward 309, 350, 362, 368, 370, 370; forward
# causal 191, 260, 298, 319, 333, 335; backward 214, 260, 291, 310, 318, 322; backward at head
# dim 64: 198, 238, 264, 279, 287, 291. FITTED (calibration rows in bench/published.csv):
# forward best 372 and L_half 100, causal 345 and 400, backward 326 and 268, head_half 15 (the
# head-64 backward's asymptote 0.90 of head-128's). The causal backward is not in the paper: its
# best is the backward's scaled as the forward's causal/non-causal ratio, its L_half the
# forward's causal/non-causal ratio applied to the backward's (an ESTIMATE).
FA2_H100 = AttentionKernel(
    "FlashAttention-2 (H100)",
    fwd=372 / _H100_PEAK_TFLOPS, fwd_half=100,
    fwd_causal=345 / _H100_PEAK_TFLOPS, fwd_causal_half=400,
    bwd=326 / _H100_PEAK_TFLOPS, bwd_half=268,
    bwd_causal=326 * 345 / 372 / _H100_PEAK_TFLOPS, bwd_causal_half=268 * 4,
    head_half=15,
    source="FlashAttention-3 paper (arXiv:2407.08608) Figs. 5-6, FA2 bars on H100 SXM5")

# FlashAttention-3 on an H100 SXM5 (bf16): forward non-causal at head dim 128 from PyTorch's
# benchmark suite (pytorch/benchmark#2391, flash_v3 at (B, 16 heads, L, 128), B·L = 16k: 430,
# 517, 566, 590, 614, 621 TFLOP/s at 512 ... 16k): FITTED best 630, L_half 238. Causal and
# backward from the FA3 paper's own bars (arXiv:2407.08608, Figs. 5-6): causal forward 292 ...
# 616 → best 638, L_half 570; backward 316, 424, 501, 542, 559, 561 → best 575, L_half 400.
# Causal backward: as for FA2 (an ESTIMATE); head_half FA2's (an ESTIMATE).
FA3_H100 = AttentionKernel(
    "FlashAttention-3 (H100)",
    fwd=630 / _H100_PEAK_TFLOPS, fwd_half=238,
    fwd_causal=638 / _H100_PEAK_TFLOPS, fwd_causal_half=570,
    bwd=575 / _H100_PEAK_TFLOPS, bwd_half=400,
    bwd_causal=575 * 638 / 630 / _H100_PEAK_TFLOPS, bwd_causal_half=400 * 570 / 238,
    head_half=15,
    source="pytorch/benchmark#2391 (FA3 forward); FA3 paper Figs. 5-6 (causal, backward)")

# FlashAttention-2 on an A100 SXM 80GB: "reaching 50-73% of the theoretical maximum FLOPs/s on
# A100" (Dao 2023, FlashAttention-2, arXiv:2307.08691, abstract): the forward's best 0.73; the
# other rates and every L_half are the H100 FA2 curve's, scaled by 0.73 / (372/989) — an
# ESTIMATE (the shape of the curve from H100, its height from A100's stated maximum).
_A100_SCALE = 0.73 / (372 / _H100_PEAK_TFLOPS)
FA2_A100 = AttentionKernel(
    "FlashAttention-2 (A100)",
    fwd=0.73, fwd_half=100,
    fwd_causal=FA2_H100.fwd_causal * _A100_SCALE, fwd_causal_half=400,
    bwd=FA2_H100.bwd * _A100_SCALE, bwd_half=268,
    bwd_causal=FA2_H100.bwd_causal * _A100_SCALE, bwd_causal_half=268 * 4,
    head_half=15,
    source="FlashAttention-2 paper (arXiv:2307.08691): up to 73% of A100 peak; H100 FA2 shape")
