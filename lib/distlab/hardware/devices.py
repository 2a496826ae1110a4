"""Devices and their kernels: what one GPU achieves for an op, beside its datasheet.

Device — one op costs

    max(launch floor, FLOPs / (peak · gemm_efficiency(m, n, k)), bytes / achieved HBM bandwidth)

  The launch floor is what an eager PyTorch op costs however small: the host dispatches ops
  ahead of the GPU, so a stream of small ops runs at the dispatch rate and a big op at its
  kernel's rate (`mode="graphs"`: CUDA graphs / torch.compile, a smaller floor).
  gemm_efficiency(m, n, k) = best · P / (P + P_half) · k / (k + k_half), P = m·n output
  elements (batch·m·n for a batched matmul): a GEMM runs as tiles of its output, one per SM at a
  time, so a small output leaves SMs idle (P_half: the output size at which half of them work),
  and each tile pays a fixed prologue and epilogue beside its k-long loop of multiply-adds
  (k_half: the depth at which that fixed part is half the tile's time). `best` is the asymptote
  for a large, deep GEMM. Two shapes with the same FLOPs differ: 1024×1024×2048 reaches
  350 TFLOP/s on an H100, 2048×1024×2048 (twice the output tiles) 523 (OpenXLA's measured
  table). The emulator reads m, n, k from a matmul's arguments (`seconds(..., mnk=)`); an op
  with FLOPs but no matmul shape (attention, convolution) is charged as the square GEMM of the
  same FLOPs (m = n = k = d, 2·d³ = FLOPs), so that more FLOPs never cost less — except fused
  attention, which is its own kind of kernel (`kernels.AttentionKernel`: the emulator passes an
  `AttentionShape` where it would pass m, n, k). No shape exceeds the device's best measured
  matmul (`gemm_max`): the curve is smooth, real GEMMs stop at what the hardware sustains.
"""
import math
import numbers
from dataclasses import dataclass, replace

import torch

from .kernels import FA2_A100, FA2_H100, AttentionKernel, AttentionShape

_F32, _BF16, _F16, _F64 = torch.float32, torch.bfloat16, torch.float16, torch.float64
_FP8 = torch.float8_e4m3fn          # Hopper's FP8 tensor cores (e5m2 for gradients: same rate)
_FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
_US, _GB = 1e-6, 1e9


def _positive(owner, name, value, allow_zero=False, allow_none=False):
    """Refuse NaN, infinite, negative (and zero, unless allowed) numbers in one sentence."""
    if value is None and allow_none:
        return
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if not ok or value < 0 or (value == 0 and not allow_zero):
        need = "a finite number >= 0" if allow_zero else "a finite number > 0"
        raise ValueError(f"{owner}: {name} must be {need}; got {value!r}.")


@dataclass(frozen=True)
class Device:
    """An accelerator. `flops`: datasheet dense peak FLOP/s per dtype; `memory_bandwidth`: the
    HBM bandwidth the model charges (achieved, for calibrated devices); `gemm_best`: the best
    achieved fraction of peak (the asymptote of large, deep matmuls); `tile_half`: the output
    size m·n at which a matmul reaches half of that; `k_half`: the inner dimension at which it
    does; `launch_floor`: seconds an eager op costs
    however small; `graph_floor`: the same under CUDA graphs / torch.compile; `mode`: "eager"
    or "graphs"; `datasheet_memory_bandwidth`: the HBM bandwidth on the datasheet;
    `gemm_max`: the best fraction of the 16-bit peak any measured matmul reached (a cap on the
    curve); `attention`: the fused attention kernel (None: attention charged as its scores'
    GEMM)."""
    name: str
    flops: dict
    memory_bandwidth: float
    gemm_best: float = 1.0
    tile_half: float = 0.0
    k_half: float = 0.0
    launch_floor: float = 0.0
    graph_floor: float = 0.0
    mode: str = "eager"
    datasheet_memory_bandwidth: float = None
    memory_bytes: float = None
    source: str = ""
    gemm_max: float = None
    attention: AttentionKernel = None
    fp8_best: float = None
    fp8_k_half: float = 0.0

    def __post_init__(self):
        owner = f"Device {self.name!r}"
        if not isinstance(self.flops, dict) or _F32 not in self.flops:
            raise ValueError(f"{owner}: flops must be a dict of peak FLOP/s per torch dtype, with "
                             f"torch.float32 in it; got {self.flops!r}.")
        for dtype, value in self.flops.items():
            _positive(owner, f"flops[{dtype}]", value)
        _positive(owner, "memory_bandwidth", self.memory_bandwidth)
        _positive(owner, "gemm_best", self.gemm_best)
        if self.gemm_best > 1:
            raise ValueError(f"{owner}: gemm_best is a fraction of peak, at most 1; "
                             f"got {self.gemm_best!r}.")
        _positive(owner, "tile_half", self.tile_half, allow_zero=True)
        _positive(owner, "k_half", self.k_half, allow_zero=True)
        _positive(owner, "launch_floor", self.launch_floor, allow_zero=True)
        _positive(owner, "graph_floor", self.graph_floor, allow_zero=True)
        _positive(owner, "datasheet_memory_bandwidth", self.datasheet_memory_bandwidth,
                  allow_none=True)
        _positive(owner, "memory_bytes", self.memory_bytes, allow_none=True)
        _positive(owner, "gemm_max", self.gemm_max, allow_none=True)
        _positive(owner, "fp8_best", self.fp8_best, allow_none=True)
        _positive(owner, "fp8_k_half", self.fp8_k_half, allow_zero=True)
        if self.fp8_best is not None and (self.fp8_best > 1 or _FP8 not in self.flops):
            raise ValueError(f"{owner}: fp8_best is a fraction of the FP8 peak, at most 1, and "
                             f"needs flops[torch.float8_e4m3fn]; got {self.fp8_best!r}.")
        if self.gemm_max is not None and self.gemm_max > 1:
            raise ValueError(f"{owner}: gemm_max is a fraction of peak, at most 1; "
                             f"got {self.gemm_max!r}.")
        if self.attention is not None and not isinstance(self.attention, AttentionKernel):
            raise ValueError(f"{owner}: attention must be a distlab.hardware.AttentionKernel or "
                             f"None; got {self.attention!r}.")
        if self.mode not in ("eager", "graphs"):
            raise ValueError(f"{owner}: mode must be 'eager' or 'graphs'; got {self.mode!r}.")

    # what the self-check prints beside its measurements
    def peak(self, dtype=_F32):
        """Datasheet dense peak FLOP/s for `dtype` (float32's for a dtype without its own)."""
        return self.flops.get(dtype, self.flops[_F32])

    @property
    def floor(self):
        """Seconds one op costs at least, in the device's mode."""
        return self.launch_floor if self.mode == "eager" else self.graph_floor

    def gemm_efficiency(self, m, n, k, dtype=_BF16, batch=1):
        """Achieved fraction of peak of a (batch ×) m×n×k matmul (the curve in the module
        docstring)."""
        for name, v in (("m", m), ("n", n), ("k", k), ("batch", batch)):
            _positive("gemm_efficiency", name, v)
        tiles = batch * m * n
        fill = tiles / (tiles + self.tile_half) if self.tile_half else 1.0
        if dtype in _FP8_DTYPES:
            if not self.has_fp8:
                raise ValueError(f"{self.name} has no FP8 tensor cores in this model (FP8 "
                                 f"matmuls need a Hopper-class part such as hardware.H100): "
                                 f"price this part in bfloat16.")
            # the same output tiles; an FP8 MMA consumes twice the depth per cycle, and a
            # fine-grained-scaled kernel promotes its partial sums every 128 of it: its own
            # asymptote and depth constant (DeepGEMM's table, below)
            depth = k / (k + self.fp8_k_half) if self.fp8_k_half else 1.0
            return self.fp8_best * fill * depth
        depth = k / (k + self.k_half) if self.k_half else 1.0
        eff = self.gemm_best * fill * depth
        if self.gemm_max is not None and dtype in (_BF16, _F16):
            eff = min(eff, self.gemm_max)
        return eff

    def gemm_seconds(self, m, n, k, dtype=_BF16, batch=1):
        """Modeled seconds of a (batch ×) m×n×k matmul in `dtype`, floor and memory traffic
        included."""
        for name, v in (("m", m), ("n", n), ("k", k), ("batch", batch)):
            _positive("gemm_seconds", name, v)
        itemsize = torch.empty((), dtype=dtype).element_size()
        return self.seconds(2.0 * batch * m * n * k,
                            itemsize * batch * (m * k + k * n + m * n), dtype, (m, n, k, batch))

    def seconds(self, flops, nbytes, dtype, mnk=None):
        """Modeled time of one operation: its kernel (arithmetic or memory traffic, whichever
        bounds it) or the launch floor, whichever is longer. `mnk`: (m, n, k) or (m, n, k,
        batch) of a matmul, or an AttentionShape for fused attention; without it an op with
        FLOPs is charged as a square GEMM."""
        for name, value in (("flops", flops), ("nbytes", nbytes)):
            if not (isinstance(value, numbers.Real) and not isinstance(value, bool)
                    and math.isfinite(value) and value >= 0):
                raise ValueError(f"Device.seconds: {name}, what the op computes or moves, must "
                                 f"be a finite number >= 0; got {value!r}.")
        compute = 0.0
        if flops:
            if mnk is None:
                # The square GEMM of the same FLOPs (2·d³ = FLOPs): its time grows with them.
                # A d read from FLOPs per byte let an op that computes more on the same bytes
                # cost less (its efficiency rose faster than its work); no bytes: the asymptote.
                d = max(1.0, (flops / 2.0) ** (1 / 3))      # at least a 1×1×1 GEMM
                eff = self.gemm_efficiency(d, d, d, dtype) if nbytes else self.gemm_best
            elif isinstance(mnk, AttentionShape):
                eff = self.attention_efficiency(mnk, dtype)
            else:
                eff = self.gemm_efficiency(*mnk[:3], dtype, *mnk[3:])
            compute = flops / (self.peak(dtype) * eff)
        return max(self.floor, compute, nbytes / self.memory_bandwidth)

    def attention_efficiency(self, shape, dtype=_BF16):
        """Achieved fraction of peak of one fused attention call (an AttentionShape): the
        device's attention kernel, or — without one (a datasheet twin, a device built by hand) —
        its scores' GEMM (q_len × kv_len × head_dim, batch × heads of them)."""
        if self.attention is None:
            return self.gemm_efficiency(shape.q_len, shape.kv_len, shape.head_dim, dtype,
                                        shape.batch_heads)
        return self.attention.efficiency(shape.kv_len, shape.head_dim, shape.causal,
                                         shape.backward)

    def with_attention(self, kernel):
        """The same device running another fused attention kernel (e.g. kernels.FA3_H100)."""
        return replace(self, attention=kernel)

    def at_clock(self, fraction):
        """The same part with its SMs clocked at `fraction` of the clock its peaks assume (a
        power- or thermally-limited part): every FLOP/s peak scales with the SM clock, HBM's
        bandwidth does not (its clock is separate)."""
        _positive(f"Device {self.name!r}", "the clock fraction", fraction)
        if fraction > 1:
            raise ValueError(f"Device {self.name!r}: the clock fraction is of the clock the peaks "
                             f"assume, at most 1; got {fraction!r}.")
        return replace(self, name=f"{self.name} at {fraction:.0%} clock",
                       flops={k: v * fraction for k, v in self.flops.items()})

    @property
    def has_fp8(self):
        """Whether the model prices FP8 matmuls on this part (a peak and a fitted curve)."""
        return self.fp8_best is not None and _FP8 in self.flops

    def ideal(self):
        """The same device at its datasheet: GEMMs at peak, datasheet HBM, no launch floor."""
        return replace(self, name=f"{self.name} (datasheet)", gemm_best=1.0, tile_half=0.0,
                       fp8_best=1.0 if self.has_fp8 else None, fp8_k_half=0.0,
                       k_half=0.0, gemm_max=None, attention=None,
                       launch_floor=0.0, graph_floor=0.0,
                       memory_bandwidth=self.datasheet_memory_bandwidth or self.memory_bandwidth)

    def with_mode(self, mode):
        """The same device with eager ("eager") or CUDA-graph/compiled ("graphs") launches."""
        return replace(self, mode=mode)


# Datasheets (dense, no sparsity). A100: NVIDIA A100 Tensor Core GPU datasheet
# (nvidia.com/content/dam/en-zz/Solutions/Data-Center/a100/pdf/nvidia-a100-datasheet-us-nvidia-
# 1758950-r4-web.pdf): FP64 9.7, FP32 19.5, BF16/FP16 tensor 312 TFLOP/s, 80 GB HBM2e at
# 2,039 GB/s (SXM). H100 / H200: NVIDIA H100 and H200 datasheets (nvidia.com/en-us/data-center/
# h100, /h200): FP64 34, FP32 67, BF16/FP16 989 TFLOP/s dense (1,979 with sparsity), HBM3 80 GB
# at 3.35 TB/s (H100 SXM), HBM3e 141 GB at 4.8 TB/s (H200 SXM). Tabulated together in
# stas00/ml-engineering compute/accelerator/README.md ("TFLOPS comparison table").
_A100_PEAK = {_F32: 19.5e12, _BF16: 312e12, _F16: 312e12, _F64: 9.7e12}
# FP8 (E4M3 and E5M2, dense): 1,979 TFLOP/s on H100 and H200 SXM (the same datasheets; 3,958 with
# sparsity); the A100 has no FP8 tensor cores.
_H100_PEAK = {_F32: 67e12, _BF16: 989e12, _F16: 989e12, _F64: 34e12,
              _FP8: 1979e12, torch.float8_e5m2: 1979e12}

# The GEMM curve (best, tile_half, k_half): FITTED to three rows of OpenXLA's measured sm_90
# (H100 SXM) bf16 matmul table (tensorflow/tensorflow third_party/xla/xla/service/gpu/model/
# matmul_interpolator_data.h: 2048³ 632 TFLOP/s, 1024×2048×2048 524, 4096×4096×256 392), marked
# `calibration` in bench/published.csv: best 0.91, tile_half 1.05e6 output elements (≈ 32 output
# tiles of 128×256 — a quarter of the 132 SMs), k_half 296. The table's other shapes and the
# "Maximum Achievable Matmul FLOPS" (MAMF, bf16, v2) table in stas00/ml-engineering compute/
# accelerator/README.md (A100 SXM 271.2 of 312 TFLOP/s, H100 SXM 794.5 of 989, GH200 828.6 of 989)
# are validation rows. A100: no measured shape table was found; the same asymptote and k_half,
# tile_half scaled by SM count (108 / 132) — an ESTIMATE, held against A100's MAMF row only.
# H200: the same GH100 die, SM count and clocks as H100: the same curve (estimate). The same
# fractions are used for float32 and float64 (an estimate: the tables measure bf16).
_GEMM_BEST, _TILE_HALF, _K_HALF = 0.91, 1.05e6, 296
# HBM achieved: A100 80 GB measured 1.80 TB/s = 88 % of 2.04 (NVIDIA developer forum, "Trouble
# to reach peak bandwidth of A100", citing a GTC 2025 talk where no kernel exceeded ~90 %);
# H100 and H200 at the same 90 % of their datasheet: an ESTIMATE.
# Launch floor: an eager PyTorch op spends ~5-25 µs on the host before its kernel runs (Python,
# autograd, dispatcher, cudaLaunchKernel ~1-3 µs: jiahuanglin.xyz "From PyTorch op to kernel
# launch"); issue 27 quotes ≈ 10 µs: 10 µs is an ESTIMATE in that range. Under CUDA graphs the
# host cost goes, a kernel's own fixed cost stays: OpenXLA's smallest sm_90 matmuls take ≈ 6 µs
# (256×512×256: 11.5 TFLOP/s for 67 MFLOP), which includes a launch; 3 µs is an ESTIMATE.
_EAGER_FLOOR, _GRAPH_FLOOR = 10 * _US, 3 * _US
# The cap: the best bf16 matmul measured on each part, over every shape tried — "Maximum
# Achievable Matmul FLOPS" (MAMF, v2) in stas00/ml-engineering compute/accelerator/README.md:
# A100 SXM 271.2 of 312 TFLOP/s, H100 SXM 794.5 of 989, GH200 141GB 828.6 of 989 (the H200 SXM's
# die; its cap an ESTIMATE from the GH200's). These three rows set the cap: they are
# `calibration` rows in bench/published.csv (they were validation rows of the curve until the
# cap was fitted to them — issue 43: large H100 GEMMs came out at 855-888 TFLOP/s).
_MAMF = {"A100": 271.2 / 312, "H100": 794.5 / 989, "H200": 828.6 / 989}
# FP8 matmuls: the curve's asymptote and depth constant FITTED to two rows of DeepGEMM's measured
# table (deepseek-ai/DeepGEMM README.md, "Normal GEMMs for dense models", Feb. 2025 version: FP8
# with fine-grained 1×128 scaling, H800 with NVCC 12.8 — the H800 is an H100 SXM with fewer NVLinks:
# the same SMs and clocks): 4096×7168×16384 at 1,358 TFLOP/s and 4096×32768×512 at 590, marked
# `calibration` in bench/published.csv: best 0.743 of the 1,979 FP8 peak, k_half 755 (2.5× the
# bf16 curve's 296: an FP8 MMA consumes twice the depth per cycle and promotes every 128). The
# output-tile constant is the bf16 curve's (an ESTIMATE: the same tiles), held against the table's
# other shapes (`fit-check` rows: same source). cuBLAS's per-tensor-scaled FP8 (TransformerEngine,
# torchao) is not in the table: the same curve is used for it (an ESTIMATE).
_FP8_BEST, _FP8_K_HALF = 0.743, 755

A100 = Device("NVIDIA A100 SXM 80GB", _A100_PEAK, 1.80e12, gemm_best=_GEMM_BEST,
              tile_half=_TILE_HALF * 108 / 132, k_half=_K_HALF, launch_floor=_EAGER_FLOOR, graph_floor=_GRAPH_FLOOR,
              datasheet_memory_bandwidth=2.039e12, memory_bytes=80e9,
              gemm_max=_MAMF["A100"], attention=FA2_A100,
              source="A100 datasheet; GEMM curve OpenXLA sm_90 (estimate); HBM 1.80 TB/s measured")
H100 = Device("NVIDIA H100 SXM", _H100_PEAK, 0.90 * 3.35e12, gemm_best=_GEMM_BEST,
              tile_half=_TILE_HALF, k_half=_K_HALF, launch_floor=_EAGER_FLOOR, graph_floor=_GRAPH_FLOOR,
              datasheet_memory_bandwidth=3.35e12, memory_bytes=80e9,
              fp8_best=_FP8_BEST, fp8_k_half=_FP8_K_HALF,
              gemm_max=_MAMF["H100"], attention=FA2_H100,
              source="H100 datasheet; GEMM curve fitted to OpenXLA sm_90")
H200 = Device("NVIDIA H200 SXM", _H100_PEAK, 0.90 * 4.8e12, gemm_best=_GEMM_BEST,
              tile_half=_TILE_HALF, k_half=_K_HALF, launch_floor=_EAGER_FLOOR, graph_floor=_GRAPH_FLOOR,
              datasheet_memory_bandwidth=4.8e12, memory_bytes=141e9,
              fp8_best=_FP8_BEST, fp8_k_half=_FP8_K_HALF,
              gemm_max=_MAMF["H200"], attention=FA2_H100,
              source="H200 datasheet; H100's GEMM curve and attention kernel (same die)")
# The H100s of torchtitan's published H100 runs (Meta's Grand Teton hosts): "96GB HBM2e with
# 2.4 TB/sec peak memory bandwidth", "the default 500W power limit" (pytorch/torchtitan
# benchmarks/llama3_h100_202412_torchtitan.md). HBM at the same 90 % of its datasheet (an
# ESTIMATE); the power limit lowers sustained clocks by an amount no source states: the SXM
# part's peak and GEMM curve are kept, so this part's compute is modeled optimistic.
H100_GRAND_TETON = replace(H100, name="NVIDIA H100 96GB HBM2e, 500 W (Grand Teton)",
                           memory_bandwidth=0.90 * 2.4e12, datasheet_memory_bandwidth=2.4e12,
                           memory_bytes=96e9,
                           source="torchtitan's H100 benchmark hosts: HBM2e 2.4 TB/s, 500 W")
