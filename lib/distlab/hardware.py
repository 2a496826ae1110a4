"""A calibrated model of GPUs and their links: what real hardware ACHIEVES, beside its datasheet.

The emulated accelerator (`distlab.emulate`) and the cost model charge time with the numbers
here. Datasheet peaks are what the hardware can never quite do; the course's performance
lessons need what it does. So every device and link carries both, and every constant below
names where it comes from (a vendor datasheet, a measurement published by NVIDIA's NCCL
maintainers, a published table of measured matmuls). Where a number is an estimate, its comment
says so. `bench/fidelity.py` holds the model against published measurements.

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
  same FLOPs and bytes (d = 3·itemsize·FLOPs / (2·bytes); m = n = k = d).

Link — a collective of S bytes on N ranks costs

    latency + steps · hop + bus bytes / bus bandwidth

  bus bytes are the ring's 2(N-1)/N·S for all_reduce ((N-1)/N·S for gathers and scatters) —
  nccl-tests' busbw, so `bandwidth` is directly the busbw nccl-tests prints for large
  messages; all_reduce inside an H100-class node uses NVLink SHARP (`nvls`). The latency part
  is NCCL's own model of its low-latency protocol (src/graph/tuning.cc): a base per collective
  plus a small cost per step; a small collective costs ≈ 10-15 µs inside a node and ≈ 25 µs
  across nodes, nearly flat in N — not 2(N-1)·α. Across nodes NCCL runs one ring per NIC, so a
  group with k members on each node reaches min(intra-node rate, k × NIC rate) (`Cluster`).
  What this misses (listed in bench/fidelity.py): the protocol switch between 64 KiB and
  64 MiB, where real busbw climbs more slowly than latency + bytes/B.

Cluster — devices, the node's link, the NIC, GPUs per node, NICs per node and (optionally) how
many nodes exist. `PRESETS` holds calibrated clusters; `DATASHEET` the same hardware at its
datasheet rates (no launch floor, GEMMs at peak, line-rate links), to show the gap.
"""
import math
from dataclasses import dataclass, replace

import torch

from .cost import TERMS

_F32, _BF16, _F16, _F64 = torch.float32, torch.bfloat16, torch.float16, torch.float64
_US, _GB = 1e-6, 1e9


def _positive(owner, name, value, allow_zero=False, allow_none=False):
    """Refuse NaN, infinite, negative (and zero, unless allowed) numbers in one sentence."""
    if value is None and allow_none:
        return
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if not ok or value < 0 or (value == 0 and not allow_zero):
        need = "a finite number >= 0" if allow_zero else "a finite number > 0"
        raise ValueError(f"{owner}: {name} must be {need}; got {value!r}.")


# ---- devices -------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Device:
    """An accelerator. `flops`: datasheet dense peak FLOP/s per dtype; `memory_bandwidth`: the
    HBM bandwidth the model charges (achieved, for calibrated devices); `gemm_best`: the best
    achieved fraction of peak (the asymptote of large, deep matmuls); `tile_half`: the output
    size m·n at which a matmul reaches half of that; `k_half`: the inner dimension at which it
    does; `launch_floor`: seconds an eager op costs
    however small; `graph_floor`: the same under CUDA graphs / torch.compile; `mode`: "eager"
    or "graphs"; `datasheet_memory_bandwidth`: the HBM bandwidth on the datasheet."""
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
        depth = k / (k + self.k_half) if self.k_half else 1.0
        return self.gemm_best * fill * depth

    def gemm_seconds(self, m, n, k, dtype=_BF16, batch=1):
        """Modeled seconds of a (batch ×) m×n×k matmul in `dtype`, floor and memory traffic
        included."""
        itemsize = torch.empty((), dtype=dtype).element_size()
        return self.seconds(2.0 * batch * m * n * k,
                            itemsize * batch * (m * k + k * n + m * n), dtype, (m, n, k, batch))

    def seconds(self, flops, nbytes, dtype, mnk=None):
        """Modeled time of one operation: its kernel (arithmetic or memory traffic, whichever
        bounds it) or the launch floor, whichever is longer. `mnk`: (m, n, k) or (m, n, k,
        batch) of a matmul; without it an op with FLOPs is charged as a square GEMM."""
        compute = 0.0
        if flops:
            if mnk is None:
                itemsize = torch.empty((), dtype=dtype).element_size() if dtype is not None else 4
                d = 3.0 * itemsize * flops / (2.0 * nbytes) if nbytes else math.inf
                eff = (self.gemm_best if d == math.inf or d <= 0
                       else self.gemm_efficiency(d, d, d, dtype))
            else:
                eff = self.gemm_efficiency(*mnk[:3], dtype, *mnk[3:])
            compute = flops / (self.peak(dtype) * eff)
        return max(self.floor, compute, nbytes / self.memory_bandwidth)

    def ideal(self):
        """The same device at its datasheet: GEMMs at peak, datasheet HBM, no launch floor."""
        return replace(self, name=f"{self.name} (datasheet)", gemm_best=1.0, tile_half=0.0,
                       k_half=0.0,
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
_H100_PEAK = {_F32: 67e12, _BF16: 989e12, _F16: 989e12, _F64: 34e12}

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

A100 = Device("NVIDIA A100 SXM 80GB", _A100_PEAK, 1.80e12, gemm_best=_GEMM_BEST,
              tile_half=_TILE_HALF * 108 / 132, k_half=_K_HALF, launch_floor=_EAGER_FLOOR, graph_floor=_GRAPH_FLOOR,
              datasheet_memory_bandwidth=2.039e12, memory_bytes=80e9,
              source="A100 datasheet; GEMM curve OpenXLA sm_90 (estimate); HBM 1.80 TB/s measured")
H100 = Device("NVIDIA H100 SXM", _H100_PEAK, 0.90 * 3.35e12, gemm_best=_GEMM_BEST,
              tile_half=_TILE_HALF, k_half=_K_HALF, launch_floor=_EAGER_FLOOR, graph_floor=_GRAPH_FLOOR,
              datasheet_memory_bandwidth=3.35e12, memory_bytes=80e9,
              source="H100 datasheet; GEMM curve fitted to OpenXLA sm_90")
H200 = Device("NVIDIA H200 SXM", _H100_PEAK, 0.90 * 4.8e12, gemm_best=_GEMM_BEST,
              tile_half=_TILE_HALF, k_half=_K_HALF, launch_floor=_EAGER_FLOOR, graph_floor=_GRAPH_FLOOR,
              datasheet_memory_bandwidth=4.8e12, memory_bytes=141e9,
              source="H200 datasheet; H100's GEMM curve (same die)")


# ---- links ---------------------------------------------------------------------------------------

# The collectives' step counts and bus bytes come from cost.TERMS: rings, NCCL's broadcast and
# reduce included (pipelined rings: N-1 steps, S bus bytes, so nccl-tests' busbw = algbw for them;
# NVIDIA/nccl#358: broadcast is a ring; #317: tuning.cc offers the tree to all_reduce only).
_TERM = {"all_reduce": "ring_all_reduce", "all_gather": "ring_all_gather",
         "reduce_scatter": "ring_reduce_scatter", "broadcast": "ring_broadcast",
         "reduce": "ring_reduce", "all_to_all": "all_to_all", "gather": "ring_all_gather",
         "scatter": "ring_all_gather", "barrier": "ring_all_reduce", "send": "send"}
# cost.predict's names map onto the same ops
_TERM.update({v: v for v in TERMS})


@dataclass(frozen=True)
class Link:
    """A link. `bandwidth`: bus bandwidth of ring algorithms and of a message (bytes/s, per GPU);
    `latency`: seconds a collective costs however small (the base of NCCL's model); `hop`:
    seconds per step of the algorithm on this link; `p2p_latency`: a message's latency (default
    `latency`); `nvls`: all_reduce bus bandwidth with NVLink SHARP, if the link has it;
    `datasheet`: line rate per direction (bytes/s), to show the gap."""
    name: str
    bandwidth: float
    latency: float = 0.0
    hop: float = 0.0
    p2p_latency: float = None
    nvls: float = None
    datasheet: float = None
    source: str = ""

    def __post_init__(self):
        owner = f"Link {self.name!r}"
        _positive(owner, "bandwidth", self.bandwidth)
        _positive(owner, "latency", self.latency, allow_zero=True)
        _positive(owner, "hop", self.hop, allow_zero=True)
        _positive(owner, "p2p_latency", self.p2p_latency, allow_zero=True, allow_none=True)
        _positive(owner, "nvls", self.nvls, allow_none=True)
        _positive(owner, "datasheet", self.datasheet, allow_none=True)

    # the α-β view (chapter 03): α = the cost of one message, B = its bandwidth
    @property
    def alpha(self):
        return self.p2p_latency if self.p2p_latency is not None else self.latency + self.hop

    @property
    def beta(self):
        return 1.0 / self.bandwidth

    def busbw(self, op="all_reduce"):
        """Achieved bus bandwidth of `op` for large messages on this link. An all_reduce (also
        cost's "ring_all_reduce": NCCL's all_reduce, whatever algorithm it picks) uses NVLink
        SHARP where the link has it."""
        return self.nvls if (op in ("all_reduce", "ring_all_reduce") and self.nvls) \
            else self.bandwidth

    def seconds(self, op, nbytes, world_size):
        """Modeled seconds of `op` (a collective, "send", or a cost.TERMS name) moving `nbytes`
        (the full tensor for gathers and scatters) among `world_size` ranks on this link."""
        if op not in _TERM:
            raise ValueError(f"unknown collective {op!r}; the model knows {sorted(_TERM)}.")
        if op == "send":
            return self.alpha + nbytes / self.bandwidth
        if world_size <= 1:
            return 0.0
        steps, volume = TERMS[_TERM[op]](nbytes, world_size)
        return self.latency + steps * self.hop + volume / self.busbw(op)

    def alpha_beta(self):
        """The link as chapter 03's α-β model sees a ring built from messages: α = a message's
        latency, B = its bandwidth (a distlab.cost.Link)."""
        from .cost import Link as AlphaBeta
        return AlphaBeta(self.alpha, self.bandwidth, self.name)

    def ideal(self):
        """The same link at its line rate, with the same latencies. NVLink SHARP's all_reduce
        is scaled by the same ratio (line rate / achieved ring busbw): the datasheet twin is
        never slower than the calibrated link (an estimate: no datasheet states an NVLS rate)."""
        rate = self.datasheet or self.bandwidth
        nvls = self.nvls * rate / self.bandwidth if self.nvls else None
        return replace(self, name=f"{self.name} (datasheet)", bandwidth=rate, nvls=nvls)

    def __str__(self):
        rate = f"busbw {self.bandwidth / _GB:.3g} GB/s"
        if self.nvls:
            rate += f" (all_reduce {self.nvls / _GB:.3g} with NVLS)"
        lat = f"latency {self.latency / _US:.3g} µs + {self.hop / _US:.3g} µs/step"
        if self.p2p_latency is not None:
            lat += f", message {self.p2p_latency / _US:.3g} µs"
        return f"{self.name}: {rate}, {lat}"


@dataclass(frozen=True)
class GroupLink(Link):
    """What a group that spans nodes sees: NCCL's cross-node latency (intra steps on NVLink,
    inter steps on the network) and min(intra-node busbw, k × NIC busbw), k members per node.

    An all_to_all is not a ring: each member's bytes for other nodes leave through the NICs its
    node gives it (`member_nic`: k NICs shared by the node's members), its bytes for its own
    node's members over NVLink (`intra_bandwidth`), both at once — the longer sets the time.
    (DeepEP's kernels forward over NVLink to reach a NIC and get the same NIC rate.)"""
    nodes: int = 1
    intra_hop: float = 0.0
    intra_bandwidth: float = None
    member_nic: float = None

    def seconds(self, op, nbytes, world_size):
        if op not in _TERM:
            raise ValueError(f"unknown collective {op!r}; the model knows {sorted(_TERM)}.")
        if op == "send" or world_size <= 1:
            return Link.seconds(self, op, nbytes, world_size)
        _, volume = TERMS[_TERM[op]](nbytes, world_size)
        per_node = max(1, world_size // self.nodes)
        if _TERM[op] == "all_to_all" and self.member_nic:
            local = nbytes * (per_node - 1) / world_size
            remote = nbytes * (world_size - per_node) / world_size
            steps_out = self.nodes - 1
            # grouped sends to every peer at once (NCCL's all_to_all): no ring of steps inside
            return (self.latency + steps_out * self.hop + max(local / (self.intra_bandwidth or self.bandwidth),
                          remote / self.member_nic))
        if _TERM[op] == "ring_all_reduce":
            # NCCL's tree (low-latency protocol) for small all_reduces across nodes: up and down
            # the chain inside each node, and log2(nodes) network hops each way.
            steps_in, steps_out = 2 * (per_node - 1), 2 * math.ceil(math.log2(self.nodes))
        else:
            steps_out = self.nodes - 1
            steps_in = max(0, TERMS[_TERM[op]](nbytes, world_size)[0] - steps_out)
        return (self.latency + steps_in * self.intra_hop + steps_out * self.hop
                + volume / self.bandwidth)


# NVLink inside a node. Latency: NCCL's model of its low-latency (LL) protocol, NVIDIA/nccl
# src/graph/tuning.cc (2.19+): baseLat Ring/LL 6.6 µs, hwLat NVLink Ring/LL 0.6 µs per step —
# 8 GPUs: 6.6 + 14 · 0.6 = 15 µs for an all_reduce of a few bytes.
# Message latency: NCCL sendrecv of 1 KB between two H800s on NVLink ≈ 3.7 µs without CUDA
# graphs (NVIDIA/nccl#1984); 5 µs is an ESTIMATE that leaves room for a launch.
_NVL_LAT, _NVL_HOP, _NVL_P2P = 6.6 * _US, 0.6 * _US, 5 * _US
# A100 NVLink 3: 600 GB/s both directions, 300 per direction (A100 datasheet). Achieved
# all_reduce busbw on 8 A100 SXM: 232.5 GB/s (NVIDIA/nccl-tests#175, a single DGX-class node);
# NCCL's own tuning model caps Ampere busbw at 235 GB/s (tuning.cc, 2.8: "if (compCap80) busBw
# = std::min(busBw, 235.0f)"). 230 GB/s.
NVLINK3 = Link("NVLink 3 (A100 SXM)", 230 * _GB, _NVL_LAT, _NVL_HOP, _NVL_P2P,
               datasheet=300 * _GB, source="nccl-tests#175: 232.5 GB/s on 8 A100")
# H100 / H200 NVLink 4: 900 GB/s both directions, 450 per direction (datasheets). "With the
# protocol overhead (~20%) NCCL can get an effective NVLink bandwidth of 370GB/s ... NCCL_ALGO=
# RING"; "On 8 GPUs, you should reach a peak busBw of ~480GB/s" with NVLink SHARP (S. Jeaugey,
# NCCL maintainer, NVIDIA/nccl-tests#212). 476 GB/s "in the expected range for H100" (D. Addison,
# nccl-tests#290).
NVLINK4 = Link("NVLink 4 (H100/H200 SXM)", 370 * _GB, _NVL_LAT, _NVL_HOP, _NVL_P2P,
               nvls=480 * _GB, datasheet=450 * _GB,
               source="nccl-tests#212 (sjeaugey): ring 370 GB/s, NVLS ~480 GB/s")
# Network, one NIC. Latency: tuning.cc hwLat NET Tree/LL 5.0 µs per network step, the same
# 6.6 µs base; a message across the network: 10 µs is an ESTIMATE (NVLink's 5 µs plus one
# network hop). Rates: InfiniBand NDR 400 Gb/s = 50 GB/s line rate; "For NDR @ 400Gbps you should
# see 46-48GB/s per NIC" (AddyLaddy, NCCL team, nccl-tests#290): 47 GB/s. HDR 200 Gb/s = 25 GB/s;
# "you should get ... 24GB/s inter-node" with one HDR NIC (sjeaugey, NVIDIA/nccl#412).
# 100 Gb Ethernet (RoCE) = 12.5 GB/s; 8 × 100 Gb/s NICs reached ≈ 600 Gb/s busbw, "a bit low"
# per the maintainers (NVIDIA/nccl#495): 10 GB/s per NIC is an ESTIMATE from that.
_NET_LAT, _NET_HOP, _NET_P2P = 6.6 * _US, 5.0 * _US, 10 * _US
IB_NDR = Link("InfiniBand NDR 400 Gb/s (one NIC)", 47 * _GB, _NET_LAT, _NET_HOP, _NET_P2P,
              datasheet=50 * _GB, source="nccl-tests#290: 46-48 GB/s per NDR NIC")
IB_HDR = Link("InfiniBand HDR 200 Gb/s (one NIC)", 24 * _GB, _NET_LAT, _NET_HOP, _NET_P2P,
              datasheet=25 * _GB, source="NVIDIA/nccl#412: 24 GB/s per HDR NIC")
ETH_100G = Link("100 Gb Ethernet (one NIC)", 10 * _GB, _NET_LAT, _NET_HOP, _NET_P2P,
                datasheet=12.5 * _GB, source="NVIDIA/nccl#495 (estimate: ~9.4 GB/s per NIC)")


# ---- clusters ------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Cluster:
    """Devices and links: `intra` joins ranks of one node, `inter` is ONE NIC between nodes.
    `ranks_per_node` ranks (GPUs) per node, `nics_per_node` NICs per node (None: the legacy
    model, where a cross-node group runs at one `inter` link's rate), `nodes`: how many nodes
    the cluster has (None: as many as a run needs)."""
    name: str
    device: Device
    intra: Link
    inter: Link = None
    ranks_per_node: int = 8
    source: str = ""
    nics_per_node: int = None
    nodes: int = None

    def __post_init__(self):
        owner = f"Cluster {self.name!r}"
        if not isinstance(self.device, Device):
            raise ValueError(f"{owner}: device must be a distlab.hardware.Device; "
                             f"got {self.device!r}.")
        for name in ("intra", "inter"):
            link = getattr(self, name)
            if name == "inter" and link is None:
                continue
            # a calibrated hardware.Link, or an α-β cost.Link (the datasheet presets)
            if not (hasattr(link, "bandwidth") and hasattr(link, "alpha")):
                raise ValueError(f"{owner}: {name} must be a distlab.hardware.Link or a "
                                 f"distlab.cost.Link; got {link!r}.")
        for name in ("ranks_per_node", "nics_per_node", "nodes"):
            value = getattr(self, name)
            if value is None and name != "ranks_per_node":
                continue
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{owner}: {name} must be a whole number >= 1; got {value!r}.")

    @property
    def max_ranks(self):
        """How many ranks the cluster can hold (None: no limit)."""
        if self.nodes is None:
            return None if self.inter is not None else self.ranks_per_node
        return self.nodes * self.ranks_per_node

    def check_world_size(self, world_size):
        """Refuse more ranks than the emulated cluster has GPUs, in one sentence."""
        limit = self.max_ranks
        if limit is not None and world_size > limit:
            where = (f"one node of {self.ranks_per_node} GPUs" if limit == self.ranks_per_node
                     else f"{limit // self.ranks_per_node} nodes of {self.ranks_per_node} GPUs")
            raise ValueError(f"the emulated cluster {self.name!r} has {limit} GPUs ({where}); "
                             f"world_size={world_size} needs more — pick a preset with more "
                             f"nodes or build a distlab.emulate.Cluster with nodes=.")

    def link_between(self, ranks):
        """The link a set of global ranks communicates over: the node's, or — across nodes —
        NCCL's cross-node latency and min(intra busbw, k × NIC busbw), k members per node."""
        ranks = list(ranks)
        nodes = {r // self.ranks_per_node for r in ranks}
        if self.inter is None or len(nodes) <= 1:
            return self.intra
        if self.nics_per_node is None:
            return self.inter          # the legacy model: one link's rate across nodes
        per_node = max(sum(1 for r in ranks if r // self.ranks_per_node == n) for n in nodes)
        k = min(per_node, self.nics_per_node)
        return GroupLink(
            f"{len(nodes)} nodes × {per_node} ({k} NIC{'s' if k > 1 else ''} each)",
            min(self.intra.bandwidth, k * self.inter.bandwidth), self.inter.latency,
            self.inter.hop, self.inter.p2p_latency, None, None, self.inter.source,
            nodes=len(nodes), intra_hop=self.intra.hop, intra_bandwidth=self.intra.bandwidth,
            member_nic=k * self.inter.bandwidth / per_node)

    def ideal(self):
        """The same cluster at datasheet rates (no launch floor, GEMMs at peak, line rate)."""
        return replace(self, name=f"{self.name} (datasheet)", device=self.device.ideal(),
                       intra=self.intra.ideal(),
                       inter=None if self.inter is None else self.inter.ideal())

    def with_mode(self, mode):
        """The same cluster with eager ("eager") or compiled/CUDA-graph ("graphs") launches."""
        return replace(self, device=self.device.with_mode(mode))

    def __str__(self):
        links = f"{self.intra}"
        if self.inter is not None:
            per_node = f"{self.ranks_per_node} rank{'s' if self.ranks_per_node > 1 else ''}"
            n = self.nics_per_node
            nics = f", {n} NIC{'s' if n > 1 else ''}" if n else ""
            links = f"{per_node}{nics} per node; {self.intra}; {self.inter}"
        return f"{self.name} ({self.device.name}; {links})"


def _node(name, device, intra, source):
    return Cluster(name, device, intra, None, 8, source, nodes=1)


def _multi(name, device, intra, nic, per_node, nics, source, nodes=None):
    return Cluster(name, device, intra, nic, per_node, source, nics_per_node=nics, nodes=nodes)


# Calibrated clusters: real node shapes (8 GPUs and 8 NICs per node: DGX A100 has 8 HDR
# 200 Gb/s HCAs for compute, DGX H100 8 ConnectX-7 NDR 400 Gb/s — NVIDIA DGX user guides).
PRESETS = {
    "a100-node": _node("one A100 node (8 GPUs, NVLink 3)", A100, NVLINK3,
                       "8 × A100 SXM 80 GB with NVSwitch"),
    "h100-node": _node("one H100 node (8 GPUs, NVLink 4)", H100, NVLINK4,
                       "8 × H100 SXM with NVSwitch"),
    "h200-node": _node("one H200 node (8 GPUs, NVLink 4)", H200, NVLINK4,
                       "8 × H200 SXM with NVSwitch"),
    "a100-2x8": _multi("two A100 nodes (8 GPUs, 8 HDR NICs each)", A100, NVLINK3, IB_HDR, 8, 8,
                       "2 × DGX A100: 8 HDR 200 Gb/s NICs per node", nodes=2),
    "h100-2x8": _multi("two H100 nodes (8 GPUs, 8 NDR NICs each)", H100, NVLINK4, IB_NDR, 8, 8,
                       "2 × DGX H100: 8 NDR 400 Gb/s NICs per node", nodes=2),
    "a100-cluster": _multi("A100 nodes (8 GPUs, 8 HDR NICs each)", A100, NVLINK3, IB_HDR, 8, 8,
                           "DGX A100 SuperPOD-like: any number of nodes"),
    "h100-cluster": _multi("H100 nodes (8 GPUs, 8 NDR NICs each)", H100, NVLINK4, IB_NDR, 8, 8,
                           "DGX H100 SuperPOD-like: any number of nodes"),
}
DATASHEET = {f"{name}-datasheet": cluster.ideal() for name, cluster in PRESETS.items()}


# ---- a training step at full size (validated in bench/fidelity.py) ------------------------------

@dataclass(frozen=True)
class Transformer:
    """A decoder-only transformer's shape: layers, hidden size, heads, feed-forward size
    (`ffn`; `glu` for SwiGLU's three matrices), vocabulary, key/value heads (GQA)."""
    layers: int
    hidden: int
    heads: int
    ffn: int
    vocab: int
    kv_heads: int = None
    glu: bool = False

    def params(self):
        h, kv = self.hidden, (self.kv_heads or self.heads) * self.hidden // self.heads
        attn = h * h * 2 + 2 * h * kv
        mlp = (3 if self.glu else 2) * h * self.ffn
        return self.layers * (attn + mlp) + 2 * self.vocab * h


# Kernels in a training loop keep less than their isolated benchmark: sustained power and clocks,
# NCCL kernels occupying SMs while communication overlaps, caches shared with other work. ONE
# factor, FITTED to two end-to-end rows marked `calibration` in bench/published.csv (Megatron-LM
# 1.7B and 145.6B, Narayanan et al. 2021 Table 1: geometric-mean ratio 1.00 at 0.96) and held
# against the other published training runs there (validation rows: other sizes and layouts,
# and torchtitan's FSDP runs, another code base).
SUSTAINED = 0.96


def step_seconds(model, cluster, n_gpus, global_batch, seq_len, tp=1, pp=1, micro_batch=1,
                 recompute="full", flash=True, dtype=_BF16, overlap_dp=False, fsdp=False,
                 fused=True, sustained=None):
    """Modeled seconds of one training step of `model` on `n_gpus` of `cluster` under
    (dp, tp, pp) with 1F1B: every GEMM at the device's shape-dependent efficiency, elementwise
    work at HBM speed, tensor-parallel all-reduces on the critical path, the pipeline bubble,
    stage-to-stage messages, and the data-parallel gradient reduction (exposed unless
    `overlap_dp`). `fsdp`: ZeRO-3 / FSDP over dp instead — bf16 weights all-gathered for
    forward and again for backward, fp32 gradients reduce-scattered, all of it prefetched
    behind compute (the step is the longer of the two).
    recompute: "none"; "selective" (Korthikanti et al.: only the attention core, which flash
    attention recomputes anyway); "selective-op" (torchtitan's op-level policy: every other
    matmul and all elementwise ops recomputed); "full" (the whole forward again).
    fused: the elementwise work in fused kernels (Megatron-LM: fused LayerNorm, bias-GeLU,
    softmax) — Korthikanti's 34·s·b·h stored bytes written once and read once per layer,
    68·s·b·h; unfused eager PyTorch (fused=False) reads and writes each intermediate: counted
    from torchtitan's Llama layer (RMSNorm in float32: cast, pow, mean, mul, cast, weight ≈ 18
    passes over s·b·h bf16 values, twice; RoPE through complex float32 ≈ 10; SwiGLU ≈ 5 of the
    feed-forward width; two residual adds ≈ 6): ≈ 70 passes of 2·s·b·h bytes, 140·s·b·h.
    sustained: the fraction of the benchmark rates (MAMF GEMMs, HBM copies) that kernels keep
    inside a training loop (SUSTAINED by default; 1: the benchmarks' rates).
    A small model, not a simulator: bench/fidelity.py says how small."""
    dev, h, s, b = cluster.device, model.hidden, seq_len, micro_batch
    dp = n_gpus // (tp * pp)
    m = global_batch // (dp * b)                      # micro-batches per pipeline
    t = b * s                                         # tokens per micro-batch
    kv = (model.kv_heads or model.heads) * h // model.heads
    per_layer = [(t, h, (h + 2 * kv) // tp), (t, h // tp, h)]          # QKV, output projection
    per_layer += [(t, h, model.ffn // tp)] * (2 if model.glu else 1) + [(t, model.ffn // tp, h)]
    item = torch.empty((), dtype=dtype).element_size()

    def gemm(mm, kk, nn):           # (tokens, in features, out features): m × k by k × n
        return dev.seconds(2.0 * mm * nn * kk, item * (mm * kk + kk * nn + mm * nn), dtype,
                           (mm, nn, kk))

    layer_fwd = sum(gemm(*g) for g in per_layer)
    # attention scores: causal flash attention computes half of the s×s blocks
    heads = model.heads // tp
    attn_flops = 4.0 * b * heads * s * s * (h // model.heads) * (0.5 if flash else 1.0)
    head_dim = h // model.heads
    layer_fwd += attn_flops / (dev.peak(dtype) * dev.gemm_efficiency(s, s, head_dim, dtype, b * heads))
    # elementwise work (norms, residuals, activation, dropout; softmax when not flash): each
    # of Korthikanti et al.'s 34·s·b·h stored bytes written once and read once
    per_token = 68 if fused else 140
    elementwise = per_token * t * h / tp + (0 if flash else 2 * 5 * heads * s * s * b)
    elementwise /= dev.memory_bandwidth
    # forward-like passes over the layer: forward, backward (twice forward's work), recompute
    if recompute not in ("none", "selective", "selective-op", "full"):
        raise ValueError(f"recompute must be 'none', 'selective', 'selective-op' or 'full'; "
                         f"got {recompute!r}.")
    gemm_passes = {"none": 3, "selective": 3, "selective-op": 3.5, "full": 4}[recompute]
    other_passes = {"none": 3, "selective": 3, "selective-op": 4, "full": 4}[recompute]
    passes = 4 if recompute == "full" else 3         # tensor-parallel all-reduce passes
    layers_per_stage = model.layers / pp
    compute = m * layers_per_stage * (gemm_passes * layer_fwd + other_passes * elementwise)
    compute /= SUSTAINED if sustained is None else sustained
    # vocabulary: the LM head on the last stage (fwd + bwd), vocab-parallel over tp
    compute += m * 3 * gemm(t, h, model.vocab // tp)
    bubble = compute * (pp - 1) / m
    tp_link = cluster.link_between(range(tp))
    tp_per_layer = (2 * passes - 2) if tp > 1 else 0          # 2 per forward-like pass
    tp_comm = m * layers_per_stage * tp_per_layer * tp_link.seconds("all_reduce", item * t * h, tp)
    pp_link = cluster.link_between([0, tp * (n_gpus // (tp * pp))]) if pp > 1 else None
    pp_comm = 0.0 if pp == 1 else (m + pp - 1) * 2 * pp_link.seconds("send", item * t * h / tp, 2)
    # a data-parallel group strides by tp·pp: its members sit on different nodes once tp·pp
    # fills a node, one per node
    dp_ranks = [i * tp * pp for i in range(dp)]
    dp_link = cluster.link_between(dp_ranks)
    grads = item * model.params() / (tp * pp)
    dp_comm = 0.0 if dp == 1 else dp_link.seconds("all_reduce", grads, dp)
    if fsdp and dp > 1:
        weights = item * model.params() / (tp * pp)
        dp_comm = (2 * dp_link.seconds("all_gather", weights, dp)
                   + dp_link.seconds("reduce_scatter", 2 * weights, dp))
        busy = compute + bubble + tp_comm + pp_comm
        return dict(step=max(busy, dp_comm), compute=compute, bubble=bubble, tp=tp_comm,
                    pp=pp_comm, dp=dp_comm, micro_batches=m, dp_size=dp)
    exposed_dp = 0.0 if overlap_dp else dp_comm
    return dict(step=compute + bubble + tp_comm + pp_comm + exposed_dp, compute=compute,
                bubble=bubble, tp=tp_comm, pp=pp_comm, dp=dp_comm, micro_batches=m, dp_size=dp)


# The course's first presets, by name, on the calibrated model (distlab.emulate's names
# 'a100-nvlink', 'h100-nvlink', 'h100-ib', 'h100-2nodes' and 'a100-ethernet'):
# the same node shapes, achieved rates, NCCL's latencies, one NIC per GPU across nodes.
CALIBRATED_LEGACY = {
    "a100-nvlink": _node("A100 node", A100, NVLINK3, "calibrated: see distlab.hardware"),
    "h100-nvlink": _node("H100 node", H100, NVLINK4, "calibrated: see distlab.hardware"),
    "h100-ib": _multi("H100s, one per node, over InfiniBand", H100, NVLINK4, IB_NDR, 1, 1,
                      "calibrated: one NDR 400 Gb/s NIC per GPU"),
    "h100-2nodes": _multi("two H100 nodes", H100, NVLINK4, IB_NDR, 4, 4,
                          "calibrated: nodes of 4 H100s, one NDR NIC per GPU", nodes=2),
    "a100-ethernet": _multi("A100s, one per node, over 100 Gb Ethernet", A100, NVLINK3, ETH_100G,
                            1, 1, "calibrated: one 100 Gb/s Ethernet NIC per GPU"),
}
