"""Links and fabrics: what a collective costs on a node's link, across NICs, in a cluster.

Link — a collective of S bytes on N ranks costs

    latency + steps · hop + bus bytes / bus bandwidth

  bus bytes are the ring's 2(N-1)/N·S for all_reduce ((N-1)/N·S for gathers and scatters) —
  nccl-tests' busbw, so `bandwidth` is directly the busbw nccl-tests prints for large
  messages; all_reduce inside an H100-class node uses NVLink SHARP (`nvls`). The latency part
  is NCCL's own model of its low-latency protocol (src/graph/tuning.cc): a base per collective
  plus a small cost per step; a small collective costs ≈ 10-15 µs inside a node and ≈ 25 µs
  across nodes, nearly flat in N — not 2(N-1)·α. Across nodes NCCL runs one ring per NIC, so a
  group with k members on each node reaches min(intra-node rate, k × NIC rate) (`Cluster`).
  Between about 1 and 256 MiB real busbw climbs more slowly than latency + bytes/B: NCCL
  engages fewer channels and switches protocol (LL, LL128, Simple) for smaller messages, and
  its pipeline does not fill. The bytes term is divided by the size ramp
  1 - exp(-(S/S0)^p) (`ramp`), S the message; FITTED to NVIDIA's DGX H100 nccl-tests sample
  (dgxc-benchmarking), held against Azure's and others' 8×A100 and 8×H200 tables.
  A point-to-point message (a pipeline stage's send) has its own rate (`p2p_bandwidth`): NCCL
  sends it over fewer channels than a collective's ring.
  Both are OFF in the presets, which keep the α-β line chapters 03, 05 and 07 teach and check
  learners' formulas against; `measured(link)` / `Cluster.measured()` turn them on (bench/
  fidelity.py reports both). Making them the default means teaching the ramp in those chapters.

Cluster — devices, the node's link, the NIC, GPUs per node, NICs per node and (optionally) how
many nodes exist. `PRESETS` holds calibrated clusters; `DATASHEET` the same hardware at its
datasheet rates (no launch floor, GEMMs at peak, line-rate links), to show the gap.
"""
import math
import numbers
from dataclasses import dataclass, replace

from ..cost import TERMS, check_size
from .devices import _GB, _US, Device, _positive


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
    ramp: tuple = None
    p2p_bandwidth: float = None

    def __post_init__(self):
        owner = f"Link {self.name!r}"
        if self.ramp is not None:
            ok = (isinstance(self.ramp, tuple) and len(self.ramp) == 2
                  and all(isinstance(v, (int, float)) and not isinstance(v, bool)
                          and math.isfinite(v) and v > 0 for v in self.ramp))
            if not ok:
                raise ValueError(f"{owner}: ramp must be (S0 bytes > 0, power > 0) or None; "
                                 f"got {self.ramp!r}.")
        _positive(owner, "p2p_bandwidth", self.p2p_bandwidth, allow_none=True)
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

    def filled(self, nbytes):
        """The fraction of its large-message rate a message of `nbytes` reaches (the ramp)."""
        if self.ramp is None or nbytes <= 0:
            return 1.0
        s0, power = self.ramp
        return max(1e-9, -math.expm1(-(nbytes / s0) ** power))

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
        check_size(f"Link.seconds({op!r})", nbytes, world_size)
        if op == "send":
            rate = self.p2p_bandwidth or self.bandwidth
            return self.alpha + nbytes / (rate * self.filled(nbytes))
        if world_size <= 1:
            return 0.0
        steps, volume = TERMS[_TERM[op]](nbytes, world_size)
        return self.latency + steps * self.hop + volume / (self.busbw(op) * self.filled(nbytes))

    def alpha_beta(self):
        """The link as chapter 03's α-β model sees a ring built from messages: α = a message's
        latency, B = its bandwidth (a distlab.cost.Link)."""
        from ..cost import Link as AlphaBeta
        return AlphaBeta(self.alpha, self.bandwidth, self.name)

    def ideal(self):
        """The same link at its line rate, with the same latencies. NVLink SHARP's all_reduce
        is scaled by the same ratio (line rate / achieved ring busbw): the datasheet twin is
        never slower than the calibrated link (an estimate: no datasheet states an NVLS rate)."""
        rate = self.datasheet or self.bandwidth
        nvls = self.nvls * rate / self.bandwidth if self.nvls else None
        return replace(self, name=f"{self.name} (datasheet)", bandwidth=rate, nvls=nvls,
                       ramp=None, p2p_bandwidth=None)

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
    inter steps on the network) and min(intra-node busbw, k × NIC busbw), k the NICs that the
    node with the fewest members can use (a ring crosses every node: its thinnest one sets
    the rate). `members`: how many of the group's ranks each node holds — a 4+1 group's tree
    climbs a chain of 4 inside node 0, whatever the average.

    An all_to_all is not a ring: each member's bytes for other nodes leave through the NICs its
    node gives it (`member_nics`: a node's NICs shared by its members), its bytes for its own
    node's members over NVLink (`intra_bandwidth`), both at once — the longer sets the time,
    on the slowest node. (DeepEP's kernels forward over NVLink to reach a NIC and get the same
    NIC rate.) `member_nic`: one NIC rate for every node, where `member_nics` is not given."""
    nodes: int = 1
    intra_hop: float = 0.0
    intra_bandwidth: float = None
    member_nic: float = None
    members: tuple = None
    member_nics: tuple = None

    def _members(self, world_size):
        """The group's members on each node, and each node's NIC rate per member."""
        if self.members is not None and sum(self.members) == world_size:
            nics = self.member_nics or (self.member_nic,) * len(self.members)
            return self.members, nics
        # no record of the group (a link built by hand): its ranks spread evenly
        return (max(1, world_size // self.nodes),) * self.nodes, (self.member_nic,) * self.nodes

    def seconds(self, op, nbytes, world_size):
        if op == "send" or op not in _TERM or world_size <= 1:
            return Link.seconds(self, op, nbytes, world_size)       # checks op and sizes
        check_size(f"Link.seconds({op!r})", nbytes, world_size)
        _, volume = TERMS[_TERM[op]](nbytes, world_size)
        members, nics = self._members(world_size)
        if _TERM[op] == "all_to_all" and all(nics):
            intra = self.intra_bandwidth or self.bandwidth
            steps_out = self.nodes - 1
            # grouped sends to every peer at once (NCCL's all_to_all): no ring of steps inside
            slowest = max(max(nbytes * (c - 1) / world_size / intra,
                              nbytes * (world_size - c) / world_size / nic)
                          for c, nic in zip(members, nics))
            return self.latency + steps_out * self.hop + slowest / self.filled(nbytes)
        if _TERM[op] == "ring_all_reduce":
            # NCCL's tree (low-latency protocol) for small all_reduces across nodes: up and down
            # the chain inside each node (the longest one waits last), and log2(nodes) network
            # hops each way.
            steps_in, steps_out = 2 * (max(members) - 1), 2 * math.ceil(math.log2(self.nodes))
        else:
            steps_out = self.nodes - 1
            steps_in = max(0, TERMS[_TERM[op]](nbytes, world_size)[0] - steps_out)
        return (self.latency + steps_in * self.intra_hop + steps_out * self.hop
                + volume / (self.bandwidth * self.filled(nbytes)))


# NVLink inside a node. Latency: NCCL's model of its low-latency (LL) protocol, NVIDIA/nccl
# src/graph/tuning.cc (2.19+): baseLat Ring/LL 6.6 µs, hwLat NVLink Ring/LL 0.6 µs per step —
# 8 GPUs: 6.6 + 14 · 0.6 = 15 µs for an all_reduce of a few bytes.
# Message latency: NCCL sendrecv of 1 KB between two H800s on NVLink ≈ 3.7 µs without CUDA
# graphs (NVIDIA/nccl#1984); 5 µs is an ESTIMATE that leaves room for a launch.
_NVL_LAT, _NVL_HOP, _NVL_P2P = 6.6 * _US, 0.6 * _US, 5 * _US
# The size ramp, FITTED (least squares on log busbw) to the 1-64 MiB rows of NVIDIA's own DGX H100
# all_reduce_perf sample (NVIDIA/dgxc-benchmarking nccl/README.md: 67.0 GB/s at 1 MiB ... 361.7 at
# 64 MiB; calibration rows in bench/published.csv): S0 = 26 MiB, power 0.38 (at 1 GiB the ramp
# costs 2 %, at 4 GiB 0.1 %: the large-message calibration rows keep their rates). Validation:
# Azure's 8×A100 and 8×H200 tables, stas00/ml-engineering's 8×H200. The same ramp on every link
# and for every collective is an ESTIMATE (measured here: all_reduce inside a node).
_RAMP = (26 * 2**20, 0.38)
# A message between two GPUs of a node: nccl-tests sendrecv_perf on 8 A100s (each sends to the
# next), 195.1 GB/s at 1 GiB (li-plus/playground cuda/nccl.md): NVLink 3's p2p rate, FITTED
# (calibration). NVLink 4: the same fraction of the ring's busbw (195 / 230 of 370 GB/s), an
# ESTIMATE.
_NVL3_P2P_BW, _NVL4_P2P_BW = 195 * _GB, 370 * 195 / 230 * _GB
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
_P2P_BW = {NVLINK3.name: _NVL3_P2P_BW, NVLINK4.name: _NVL4_P2P_BW}


def measured(link):
    """The link with NCCL's measured message-size ramp and, inside a node, its point-to-point
    rate (see the module docstring); an α-β cost.Link is returned as it is."""
    if not isinstance(link, Link):
        return link
    return replace(link, ramp=_RAMP, p2p_bandwidth=_P2P_BW.get(link.name, link.p2p_bandwidth))


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
        NCCL's cross-node latency and min(intra busbw, k × NIC busbw), with the members that
        each node actually holds (k: the NICs of the node with the fewest)."""
        ranks = list(ranks)
        bad = [r for r in ranks
               if not isinstance(r, numbers.Integral) or isinstance(r, bool) or r < 0]
        if not ranks or bad:
            raise ValueError(f"link_between needs the group's global ranks, at least one rank, "
                             f"each a whole number >= 0; got {bad[0] if bad else ranks!r}.")
        nodes = sorted({r // self.ranks_per_node for r in ranks})
        if self.inter is None or len(nodes) <= 1:
            return self.intra
        if self.nics_per_node is None:
            return self.inter          # the legacy model: one link's rate across nodes
        members = tuple(sum(1 for r in ranks if r // self.ranks_per_node == n) for n in nodes)
        k = min(min(members), self.nics_per_node)
        shape = (f"× {members[0]}" if len(set(members)) == 1
                 else f"of {'+'.join(map(str, members))} members")
        return GroupLink(
            f"{len(nodes)} nodes {shape} ({k} NIC{'s' if k > 1 else ''} each)",
            min(self.intra.bandwidth, k * self.inter.bandwidth), self.inter.latency,
            self.inter.hop, self.inter.p2p_latency, None, None, self.inter.source,
            ramp=self.inter.ramp, nodes=len(nodes), intra_hop=self.intra.hop, intra_bandwidth=self.intra.bandwidth,
            member_nic=min(min(c, self.nics_per_node) * self.inter.bandwidth / c for c in members),
            members=members,
            member_nics=tuple(min(c, self.nics_per_node) * self.inter.bandwidth / c
                              for c in members))

    def ideal(self):
        """The same cluster at datasheet rates (no launch floor, GEMMs at peak, line rate)."""
        return replace(self, name=f"{self.name} (datasheet)", device=self.device.ideal(),
                       intra=self.intra.ideal(),
                       inter=None if self.inter is None else self.inter.ideal())

    def with_mode(self, mode):
        """The same cluster with eager ("eager") or compiled/CUDA-graph ("graphs") launches."""
        return replace(self, device=self.device.with_mode(mode))

    def measured(self):
        """The same cluster with its links' measured message-size ramp and p2p rate
        (`fabric.measured`)."""
        return replace(self, name=f"{self.name} (measured link regimes)",
                       intra=measured(self.intra),
                       inter=None if self.inter is None else measured(self.inter))

    def __str__(self):
        links = f"{self.intra}"
        if self.inter is not None:
            per_node = f"{self.ranks_per_node} rank{'s' if self.ranks_per_node > 1 else ''}"
            n = self.nics_per_node
            nics = f", {n} NIC{'s' if n > 1 else ''}" if n else ""
            links = f"{per_node}{nics} per node; {self.intra}; {self.inter}"
        return f"{self.name} ({self.device.name}; {links})"
