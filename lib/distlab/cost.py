"""The α-β model of communication: how long should a collective take?

Sending one message of S bytes over a link costs  α + S·β :  α is the latency (seconds per
message: software, handshakes, the wire's delay) and β = 1/B the time per byte at bandwidth B.
A collective is a sequence of rounds; its time is the rounds on the critical path times α plus
the bytes on the critical path times β. So every formula here is a pair (messages, bytes):

    collective (N ranks, S bytes)      messages          bytes
    ring all-reduce                    2(N-1)            2(N-1)/N · S
    ring reduce-scatter / all-gather   N-1               (N-1)/N · S      (S: the full tensor)
    binomial-tree broadcast            ceil(log2 N)      ceil(log2 N) · S
    pipelined ring broadcast / reduce  N-1               S                (NCCL's broadcast)
    pipelined (double binary) tree     2·ceil(log2 N)    2 · S            (NCCL's tree all-reduce)
      all-reduce
    naive all-reduce (via one root)    2(N-1)            2(N-1) · S
    pairwise all-to-all                N-1               (N-1)/N · S      (S: what one rank sends)
    one send                           1                 S

The ring's bytes tend to 2S as N grows: adding ranks barely slows its β term, which is why data
parallelism scales; its α term, 2(N-1)·α, grows with every rank. No all-reduce can put fewer
than 2(N-1)/N · S bytes through some rank's port (`all_reduce_lower_bound`): the ring's bytes
are optimal. The naive root's bytes grow with N. The binomial tree wins on latency (log N
rounds) and loses on bandwidth (whole tensor each round), so it suits small messages. Cutting
the message into many pieces and streaming them (pipelining) keeps the few rounds and drops the
repeated bytes: a pipelined ring broadcast costs (N-1)·α + S/B — what NCCL's broadcast and
reduce run — and a pipelined (double binary) tree all-reduce 2·ceil(log2 N)·α + 2S/B, the
latency of a tree at N/(N-1) times the ring's bandwidth term (each GPU sends and receives 2S
on a tree, 2(N-1)/N·S on a ring: S. Jeaugey, NVIDIA/nccl#457; NCCL picks it across nodes for
small and medium all_reduces).
Both pipelined rows are the many-pieces limit: each extra piece adds one more α.

`fit` finds α and β from measured times; distlab.nccl_tests reads an nccl-tests log (your
cluster's `all_reduce_perf` output) into such measurements, a cluster to emulate with, and a
table of your busbw beside what the platform should reach.
`PRESETS` holds rough links for planning; distlab.hardware holds calibrated ones.
"""
import math
import numbers
import statistics
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class Link:
    """A link of latency `alpha` (seconds per message) and `bandwidth` (bytes per second)."""
    alpha: float
    bandwidth: float
    name: str = ""

    def __post_init__(self):
        # a fit can find no time per byte at all (B = inf); anything else must be a real rate
        for field_name, value, zero_ok in (("alpha", self.alpha, True),
                                           ("bandwidth", self.bandwidth, False)):
            ok = (isinstance(value, (int, float)) and not isinstance(value, bool)
                  and not math.isnan(value) and value >= 0 and (zero_ok or value > 0)
                  and (field_name == "bandwidth" or math.isfinite(value)))
            if not ok:
                need = "a finite number >= 0" if zero_ok else "a number > 0"
                raise ValueError(f"Link {self.name!r}: {field_name} must be {need}; "
                                 f"got {value!r}.")

    @property
    def beta(self):
        """Seconds per byte."""
        return 1.0 / self.bandwidth

    def __str__(self):
        label = f"{self.name}: " if self.name else ""
        return f"{label}α = {self.alpha * 1e6:.3g} µs, B = {self.bandwidth / 1e9:.3g} GB/s"


# Order-of-magnitude figures for planning (per direction, per GPU), not measurements. Real
# collectives reach a fraction of the nominal bandwidth; measure your own with `fit`.
PRESETS = {
    "nvlink4": Link(3e-6, 450e9, "NVLink 4 (H100 SXM, inside a node)"),
    "pcie4": Link(5e-6, 25e9, "PCIe Gen4 x16 (GPUs without NVLink, inside a node)"),
    "infiniband_ndr": Link(10e-6, 50e9, "InfiniBand NDR 400 Gb/s (between nodes)"),
    "ethernet_100g": Link(20e-6, 12.5e9, "100 Gb Ethernet (between nodes)"),
    "ethernet_10g": Link(50e-6, 1.25e9, "10 Gb Ethernet (between nodes)"),
}
INTRA_NODE = PRESETS["nvlink4"]
INTER_NODE = PRESETS["infiniband_ndr"]


def _tree_rounds(n):
    return math.ceil(math.log2(n)) if n > 1 else 0


# (messages, bytes) on the critical path of each collective, for N ranks and S bytes.
TERMS = {
    "ring_all_reduce": lambda s, n: (2 * (n - 1), 2 * (n - 1) / n * s),
    "ring_reduce_scatter": lambda s, n: (n - 1, (n - 1) / n * s),
    "ring_all_gather": lambda s, n: (n - 1, (n - 1) / n * s),
    "tree_broadcast": lambda s, n: (_tree_rounds(n), _tree_rounds(n) * s),
    "ring_broadcast": lambda s, n: (n - 1, s if n > 1 else 0.0),
    "ring_reduce": lambda s, n: (n - 1, s if n > 1 else 0.0),
    "tree_all_reduce": lambda s, n: (2 * _tree_rounds(n), 2 * s if n > 1 else 0.0),
    "naive_all_reduce": lambda s, n: (2 * (n - 1), 2 * (n - 1) * s),
    "all_to_all": lambda s, n: (n - 1, (n - 1) / n * s),
    "send": lambda s, n: (1, s),
}


def check_size(who, nbytes, world_size):
    """Refuse a size or a rank count no model can price (NaN, infinite, negative, a fraction
    of a rank) in one sentence, before it turns into a NaN or a negative time downstream."""
    if not _finite(nbytes) or nbytes < 0:
        raise ValueError(f"{who}: nbytes, the message's size in bytes (numel × element size), "
                         f"must be a finite number >= 0; got {nbytes!r}.")
    if not _finite(world_size) or world_size < 1 or world_size != int(world_size):
        raise ValueError(f"{who} needs world_size >= 1, a whole number of ranks (the group's "
                         f"size); got {world_size!r}.")


def _finite(x):
    return isinstance(x, numbers.Real) and not isinstance(x, bool) and math.isfinite(x)


def terms(collective, nbytes, world_size):
    """(messages, bytes) on the critical path: time = messages·α + bytes·β."""
    if collective not in TERMS:
        raise ValueError(f"unknown collective {collective!r}; the model knows {sorted(TERMS)}.")
    check_size(collective, nbytes, world_size)
    return TERMS[collective](nbytes, world_size)


def predict(collective, nbytes, world_size, link):
    """Modelled seconds for `collective` of `nbytes` bytes on `world_size` ranks over `link`:
    messages·α + bytes·β on an α-β Link; a calibrated distlab.hardware.Link charges its own
    model (latency floor, per-step cost, achieved bus bandwidth), except for the naive
    all-reduce, which no library runs: that one is charged α-β with the link's message cost."""
    messages, volume = terms(collective, nbytes, world_size)
    if hasattr(link, "seconds") and collective != "naive_all_reduce":
        return link.seconds(collective, nbytes, world_size)
    return messages * link.alpha + volume * link.beta


def ring_all_reduce_time(nbytes, world_size, link):
    """2(N-1)·α + 2(N-1)/N · S/B."""
    return predict("ring_all_reduce", nbytes, world_size, link)


def all_reduce_lower_bound(nbytes, world_size, bandwidth):
    """The fewest seconds any all-reduce of `nbytes` on `world_size` ranks can spend on bytes,
    with one port of `bandwidth` bytes/s per rank: 2(N-1)/N · S/B.

    Every element of the result combines N inputs: at least N-1 of them must travel to wherever
    they are combined, and the sum must then reach the N-1 other ranks, so at least 2(N-1)·S bytes
    cross the ranks' ports in all, and some port carries at least 1/N of them. The ring meets it."""
    check_size("all_reduce_lower_bound", nbytes, world_size)
    if not (_finite(bandwidth) or bandwidth == math.inf) or not bandwidth > 0:
        raise ValueError(f"all_reduce_lower_bound needs bandwidth > 0 in bytes/s; "
                         f"got {bandwidth!r}.")
    return 2 * (world_size - 1) / world_size * nbytes / bandwidth


def bus_bandwidth(collective, nbytes, world_size, seconds):
    """Bytes on the critical path per second: comparable across N (nccl-tests calls it busbw)."""
    if not _finite(seconds) or seconds <= 0:
        raise ValueError(f"bus_bandwidth: seconds, the measured time of one call, must be a "
                         f"finite number > 0; got {seconds!r}.")
    return terms(collective, nbytes, world_size)[1] / seconds


def fit(measurements, name="fitted", latency="per-message"):
    """The Link that best explains `measurements`: [(collective, nbytes, world_size, seconds)].

    Least squares on the relative error: times span several orders of magnitude, and absolute
    errors would let the largest message decide everything (and α come out as noise). α and B
    are kept non-negative: a model with negative latency explains nothing.

    latency="per-message" fits time = messages·α + bytes/B (the α-β model: our own rings, built
    from messages); latency="floor" fits time = α + bytes/B, one latency per call whatever the
    number of ranks — what NCCL's collectives look like (nccl-tests logs, `distlab.nccl_tests.read_nccl_tests`).
    """
    if latency not in ("per-message", "floor"):
        raise ValueError(f"latency must be 'per-message' or 'floor'; got {latency!r}.")
    rows, times = [], []
    for collective, nbytes, world_size, seconds in measurements:
        m, b = terms(collective, nbytes, world_size)
        if not (isinstance(seconds, (int, float)) and math.isfinite(seconds)) or seconds <= 0:
            raise ValueError(f"measured times must be positive; got {seconds} s.")
        if m == 0 and b == 0:
            continue  # one rank communicates nothing: it says nothing about the link
        if latency == "floor":
            m = 1
        rows.append((m / seconds, b / seconds))
        times.append(1.0)
    if len(rows) < 2:
        raise ValueError("fit needs at least two measurements with communication in them.")
    a = torch.tensor(rows, dtype=torch.float64)
    y = torch.tensor(times, dtype=torch.float64)
    # Scale the columns so that α (~1e-5) and β (~1e-9) are solved on equal terms.
    scale = a.abs().max(dim=0).values.clamp_min(1e-300)
    if torch.linalg.matrix_rank(a / scale) < 2:
        raise ValueError("fit needs measurements at different sizes to tell α from β.")
    alpha, beta = (torch.linalg.lstsq(a / scale, y.unsqueeze(1)).solution.squeeze(1) / scale).tolist()
    if alpha < 0 or beta <= 0:
        # One parameter alone on the boundary: refit the other with least squares.
        col = 1 if alpha < 0 else 0
        x = a[:, col]
        best = float((x @ y) / (x @ x))
        alpha, beta = (0.0, best) if col == 1 else (best, 0.0)
    return Link(alpha, 1.0 / beta if beta > 0 else math.inf, name)


def relative_errors(measurements, link):
    """(predicted - measured) / measured for each measurement."""
    return [(predict(c, s, n, link) - t) / t for c, s, n, t in measurements]


# ---- measuring, inside a rank ---------------------------------------------------------------------

def measure(collective_fn, sizes, repeats=5, group=None, dtype=torch.float32, device=None):
    """Seconds per call of `collective_fn(tensor)` for each size in bytes; call on every rank.

    Each repetition starts together (a barrier) and counts the slowest rank, which is when the
    collective is done; the median over repetitions resists the odd hiccup of a busy machine.
    """
    if device is None:
        from .devices import device as rank_device
        device = rank_device()
    itemsize = torch.empty((), dtype=dtype).element_size()
    out = []
    for nbytes in sizes:
        tensor = torch.zeros(max(1, nbytes // itemsize), dtype=dtype, device=device)
        collective_fn(tensor)  # warm-up: first-use costs (connections, allocations) are not α
        times = []
        for _ in range(repeats):
            dist.barrier(group=group)
            _sync(tensor)
            start = time.perf_counter()
            collective_fn(tensor)
            _sync(tensor)
            elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64, device=device)
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX, group=group)
            times.append(elapsed.item())
        out.append(statistics.median(times))
    return out


def _sync(tensor):
    if tensor.is_cuda:
        torch.cuda.synchronize(tensor.device)
