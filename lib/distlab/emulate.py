"""The emulated accelerator: time that behaves like devices and links, on a laptop.

N ranks on 2 cores share the CPU, and loopback gloo is not a link, so wall-clock time on a laptop
says little about a cluster. Under `distlab.run(..., emulate="a100-nvlink")` every rank keeps a
VIRTUAL clock instead, advanced only by what a real accelerator would spend time on:

- compute: every tensor operation costs  max(FLOPs / peak FLOP/s, bytes touched / memory bandwidth)
  on the rank's modeled device (FLOPs as torch.utils.flop_counter counts them: matmuls,
  convolutions, attention);
- communication: each collective or message occupies the rank's link and completes at
  α + bytes/bandwidth per step of its algorithm (the α-β model of `distlab.cost`), starting when
  every participant has launched it and its link is free. Async handles complete at that modeled
  time: `wait()` moves the caller's clock forward only if the transfer is not done yet.

The real tensors still flow through gloo, so results are exact and identical to a plain run;
only time is modeled. The clocks are deterministic: an emulated timeline is the same on every
run and every machine. Host (Python) overhead costs nothing on the virtual clock.

Ranks agree on when a collective starts through the launcher's TCP store, outside the process
groups being traced. An async collective therefore waits on the host (not on the virtual clock)
until all its participants have launched it: code where a rank must receive something from a
peer before that peer launches an async collective it already launched would deadlock here.
"""
from dataclasses import dataclass, field

import torch

from .cost import TERMS, Link


@dataclass(frozen=True)
class Device:
    """An accelerator: peak FLOP/s per dtype and memory bandwidth (bytes/s)."""
    name: str
    flops: dict
    memory_bandwidth: float

    def peak(self, dtype):
        return self.flops.get(dtype, self.flops[torch.float32])

    def seconds(self, flops, nbytes, dtype):
        """Roofline time of one operation: bound by arithmetic or by memory traffic."""
        return max(flops / self.peak(dtype), nbytes / self.memory_bandwidth)


@dataclass(frozen=True)
class Cluster:
    """Devices and links: `intra` joins ranks of one node, `inter` joins nodes."""
    name: str
    device: Device
    intra: Link
    inter: Link = None
    ranks_per_node: int = 8
    source: str = ""

    def link_between(self, ranks):
        """The slowest link a set of global ranks communicates over."""
        if self.inter is None or len({r // self.ranks_per_node for r in ranks}) <= 1:
            return self.intra
        return self.inter

    def __str__(self):
        links = f"{self.intra}"
        if self.inter is not None:
            per_node = f"{self.ranks_per_node} rank{'s' if self.ranks_per_node > 1 else ''}"
            links = f"{per_node} per node; {self.intra}; {self.inter}"
        return f"{self.name} ({self.device.name}; {links})"


# Datasheet peaks (dense, no sparsity) and nominal per-direction link rates: what the hardware
# can do at best. Real training reaches a fraction of them; the course uses them as a model.
_F32, _BF16, _F16, _F64 = torch.float32, torch.bfloat16, torch.float16, torch.float64
A100 = Device("NVIDIA A100 SXM 80GB", {_F32: 19.5e12, _BF16: 312e12, _F16: 312e12, _F64: 9.7e12},
              2.0e12)
H100 = Device("NVIDIA H100 SXM", {_F32: 67e12, _BF16: 989e12, _F16: 989e12, _F64: 34e12}, 3.35e12)
NVLINK3 = Link(3e-6, 300e9, "NVLink 3 (A100 SXM)")
NVLINK4 = Link(3e-6, 450e9, "NVLink 4 (H100 SXM)")
IB_NDR = Link(10e-6, 50e9, "InfiniBand NDR 400 Gb/s")
ETH_100G = Link(20e-6, 12.5e9, "100 Gb Ethernet")

PRESETS = {
    "a100-nvlink": Cluster(
        "A100 node", A100, NVLINK3, None, 8,
        "NVIDIA A100 datasheet: 19.5 TFLOP/s FP32, 312 TFLOP/s BF16, 2.0 TB/s HBM2e; "
        "NVLink 3: 600 GB/s per GPU both directions together (300 GB/s each way)."),
    "h100-nvlink": Cluster(
        "H100 node", H100, NVLINK4, None, 8,
        "NVIDIA H100 SXM datasheet: 67 TFLOP/s FP32, 989 TFLOP/s BF16 dense, 3.35 TB/s HBM3; "
        "NVLink 4: 900 GB/s per GPU both directions together (450 GB/s each way)."),
    "h100-ib": Cluster(
        "H100s, one per node, over InfiniBand", H100, NVLINK4, IB_NDR, 1,
        "as h100-nvlink, with every rank on its own node: one 400 Gb/s NDR port (50 GB/s) per GPU."),
    "h100-2nodes": Cluster(
        "two H100 nodes", H100, NVLINK4, IB_NDR, 4,
        "as h100-nvlink inside a node; nodes of 4 ranks joined by 400 Gb/s InfiniBand NDR."),
    "a100-ethernet": Cluster(
        "A100s, one per node, over 100 Gb Ethernet", A100, NVLINK3, ETH_100G, 1,
        "as a100-nvlink, with every rank on its own node behind one 100 Gb/s Ethernet port."),
}


def resolve(emulate):
    """A Cluster from what a learner passes: a preset name, a Cluster, or None/False."""
    if emulate is None or emulate is False:
        return None
    if isinstance(emulate, Cluster):
        return emulate
    if isinstance(emulate, str) and emulate in PRESETS:
        return PRESETS[emulate]
    raise ValueError(
        f"emulate must be the name of a preset ({', '.join(sorted(PRESETS))}) or a "
        f"distlab.emulate.Cluster; got {emulate!r}.")


# ---- the cost of one communication on the modeled link --------------------------------------------

# Which α-β term of distlab.cost models each collective (the algorithms NCCL uses for large
# messages: rings, and a binomial tree for one-to-all / all-to-one).
_MODEL = {"all_reduce": "ring_all_reduce", "all_gather": "ring_all_gather",
          "reduce_scatter": "ring_reduce_scatter", "broadcast": "tree_broadcast",
          "reduce": "tree_broadcast", "all_to_all": "all_to_all", "gather": "ring_all_gather",
          "scatter": "ring_all_gather", "barrier": "ring_all_reduce", "send": "send"}


def comm_seconds(op, nbytes, world_size, link):
    """Modeled seconds of `op` moving `nbytes` (the full tensor for gathers and scatters)."""
    if world_size <= 1 and op != "send":
        return 0.0
    messages, volume = TERMS[_MODEL[op]](nbytes, world_size)
    return messages * link.alpha + volume / link.bandwidth


# ---- the rank's side: a virtual clock and a link that serialises transfers -----------------------

@dataclass
class Clock:
    """One rank's virtual time (seconds) and when its link is next free."""
    cluster: Cluster
    store: object                       # a store shared by the ranks, to agree on start times
    rank: int
    store_world_size: int = 1
    now: float = 0.0
    link_free: float = 0.0
    _seq: dict = field(default_factory=dict)

    def compute(self, flops, nbytes, dtype):
        self.now += self.cluster.device.seconds(flops, nbytes, dtype)

    def _next(self, key):
        n = self._seq.get(key, 0)
        self._seq[key] = n + 1
        return n

    def collective(self, op, nbytes, ranks, group_name):
        """(start, done) of a collective this rank launches now, agreed with its peers."""
        ready = max(self.now, self.link_free)
        key = f"c/{group_name}/{self._next(('c', group_name))}"
        if len(ranks) > 1:
            self.store.set(f"{key}/{self.rank}", repr(ready))
            ready = max(float(v) for v in self.store.multi_get([f"{key}/{r}" for r in ranks]))
        done = ready + comm_seconds(op, nbytes, len(ranks), self.cluster.link_between(ranks))
        self.link_free = done
        return ready, done

    def unsynchronised(self, op, nbytes):
        """(start, done) of a collective whose peers cannot be asked (issued from C++): the
        whole world, starting when this rank's link is free."""
        start = max(self.now, self.link_free)
        world = self.store_world_size
        self.link_free = start + comm_seconds(op, nbytes, world,
                                              self.cluster.link_between(range(world)))
        return start, self.link_free

    def send(self, nbytes, dst, tag):
        """(start, arrival) of a message to global rank `dst`; the receiver learns the arrival."""
        start = max(self.now, self.link_free)
        arrival = start + comm_seconds("send", nbytes, 2,
                                       self.cluster.link_between((self.rank, dst)))
        self.link_free = arrival
        key = f"p/{self.rank}/{dst}/{tag}/{self._next(('p', self.rank, dst, tag))}"
        self.store.set(key, repr(arrival))
        return start, arrival

    def arrival(self, src, tag):
        """When the next message from global rank `src` with `tag` arrives (waits for its send)."""
        key = f"p/{src}/{self.rank}/{tag}/{self._next(('p', src, self.rank, tag))}"
        value = float(self.store.get(key))
        self.store.delete_key(key)
        return value


def describe(cluster):
    """The one line every emulated output carries."""
    return f"⏱ emulated: {cluster}. Times are modeled, not measured on this machine."


_announced = None


def announce(cluster):
    """Print describe(cluster) once per notebook cell and cluster (every time outside a
    notebook): a cell that runs a sweep of emulated runs says it once, not once per run."""
    global _announced
    try:
        from IPython import get_ipython
        shell = get_ipython()
    except ImportError:
        shell = None
    cell = None
    if shell is not None:
        # One execute request per cell; nbval runs cells without history, so the execution
        # count does not tell cells apart, but the request's message id does.
        header = getattr(shell, "parent_header", None) or {}
        cell = header.get("header", {}).get("msg_id") or (id(shell), shell.execution_count)
    if cell is None or _announced != (cell, cluster):
        print(describe(cluster))
        _announced = (cell, cluster)
