"""The α-β model of communication: how long should a collective take?

Sending one message of S bytes over a link costs  α + S·β :  α is the latency (seconds per
message: software, handshakes, the wire's delay) and β = 1/B the time per byte at bandwidth B.
A collective is a sequence of rounds; its time is the rounds on the critical path times α plus
the bytes on the critical path times β. So every formula here is a pair (messages, bytes):

    collective (N ranks, S bytes)      messages          bytes
    ring all-reduce                    2(N-1)            2(N-1)/N · S
    ring reduce-scatter / all-gather   N-1               (N-1)/N · S      (S: the full tensor)
    binomial-tree broadcast            ceil(log2 N)      ceil(log2 N) · S
    naive all-reduce (via one root)    2(N-1)            2(N-1) · S
    pairwise all-to-all                N-1               (N-1)/N · S      (S: what one rank sends)
    one send                           1                 S

The ring's bytes tend to 2S as N grows: adding ranks barely slows it, which is why data
parallelism scales. The naive root's bytes grow with N. The tree wins on latency (log N rounds)
and loses on bandwidth (whole tensor each round), so it suits small messages.

`fit` finds α and β from measured times; `read_nccl_tests` reads an nccl-tests log (your
cluster's `all_reduce_perf` output) into measurements, `nccl_tests_cluster` turns it into a
cluster to emulate with, and `busbw_table` sets your busbw beside what the platform should reach.
`PRESETS` holds rough links for planning; distlab.hardware holds calibrated ones.
"""
import math
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
    "naive_all_reduce": lambda s, n: (2 * (n - 1), 2 * (n - 1) * s),
    "all_to_all": lambda s, n: (n - 1, (n - 1) / n * s),
    "send": lambda s, n: (1, s),
}


def terms(collective, nbytes, world_size):
    """(messages, bytes) on the critical path: time = messages·α + bytes·β."""
    if collective not in TERMS:
        raise ValueError(f"unknown collective {collective!r}; the model knows {sorted(TERMS)}.")
    if world_size < 1 or nbytes < 0:
        raise ValueError(f"need world_size >= 1 and nbytes >= 0; got {world_size} and {nbytes}.")
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


def bus_bandwidth(collective, nbytes, world_size, seconds):
    """Bytes on the critical path per second: comparable across N (nccl-tests calls it busbw)."""
    return terms(collective, nbytes, world_size)[1] / seconds


def fit(measurements, name="fitted", latency="per-message"):
    """The Link that best explains `measurements`: [(collective, nbytes, world_size, seconds)].

    Least squares on the relative error: times span several orders of magnitude, and absolute
    errors would let the largest message decide everything (and α come out as noise). α and B
    are kept non-negative: a model with negative latency explains nothing.

    latency="per-message" fits time = messages·α + bytes/B (the α-β model: our own rings, built
    from messages); latency="floor" fits time = α + bytes/B, one latency per call whatever the
    number of ranks — what NCCL's collectives look like (nccl-tests logs, `read_nccl_tests`).
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


# ---- the step time of data parallelism (chapter 05) -----------------------------------------------

def ddp_step_time(tensor_numels, batch, world_size, peak_flops, memory_bandwidth, link,
                  bucket_cap_bytes=25 * 2 ** 20, overlap=True, bytes_per_element=4):
    """Modeled seconds of one data-parallel step of an MLP: forward, backward and the bucketed
    gradient all-reduce (the optimizer step is left out).

    tensor_numels: the parameter tensors' sizes in forward order (weight, bias, weight, ...); a
    tensor of n elements costs 2·batch·n FLOPs forward and 4·batch·n backward (a Linear layer's
    matmuls; biases are negligible). Backward produces the gradients in reverse order; they fill
    buckets of at least `bucket_cap_bytes`, as BucketedDDP and torch's DDP do. Each bucket is
    copied into one buffer and divided by N (two passes over its bytes, read and written, at
    `memory_bandwidth`, on the compute stream), then ring-all-reduced over `link`, one bucket at a
    time on the link. With `overlap`, a bucket leaves as soon as its last gradient is ready and
    backward goes on; without, every bucket waits for the end of backward. At the end the
    averaged values are copied back (one pass).

    Returns {"forward", "backward", "comm", "exposed", "step"}: seconds of forward and backward
    compute, of all-reduce in flight, of all-reduce NOT hidden behind compute, and the step.
    """
    numels = list(tensor_numels)
    forward = sum(2 * batch * n for n in numels) / peak_flops
    # Buckets in the order backward fills them (reverse), closed once they reach the cap.
    buckets, current, size = [], [], 0
    for i in reversed(range(len(numels))):
        current.append(i)
        size += numels[i] * bytes_per_element
        if size >= bucket_cap_bytes:
            buckets.append(current)
            current, size = [], 0
    if current:
        buckets.append(current)

    def pack(nbytes):
        return 2 * 2 * nbytes / memory_bandwidth   # copy in, divide: each reads and writes

    t, link_free, comm = 0.0, 0.0, 0.0
    backward = 0.0
    launches = []
    for members in buckets:
        spent = sum(4 * batch * numels[i] for i in members) / peak_flops
        t += spent
        backward += spent
        nbytes = sum(numels[i] for i in members) * bytes_per_element
        launches.append(nbytes)
        if overlap:
            t += pack(nbytes)
            start = max(t, link_free)
            link_free = start + predict("ring_all_reduce", nbytes, world_size, link)
            comm += link_free - start
    if not overlap:
        for nbytes in launches:
            t += pack(nbytes)
            start = max(t, link_free)
            link_free = start + predict("ring_all_reduce", nbytes, world_size, link)
            comm += link_free - start
    synced = max(t, link_free) + 2 * sum(launches) / memory_bandwidth   # copy back
    exposed = max(0.0, link_free - t)
    return dict(forward=forward, backward=backward, comm=comm, exposed=exposed,
                step=forward + synced)


# ---- reading a real cluster: nccl-tests' all_reduce_perf ------------------------------------------

# nccl-tests names its binaries after NCCL's collectives; the model's term for each.
_NCCL_TESTS = {"all_reduce": "ring_all_reduce", "all_gather": "ring_all_gather",
               "reduce_scatter": "ring_reduce_scatter", "alltoall": "all_to_all",
               "broadcast": "tree_broadcast", "sendrecv": "send"}


@dataclass
class NcclTestsLog:
    """What `read_nccl_tests` found: one row per size (out-of-place and in-place time in
    seconds, algbw and busbw in bytes/s), the ranks, nodes (distinct host names) and GPU name."""
    collective: str
    world_size: int
    nodes: int
    gpu: str
    rows: list

    @property
    def measurements(self):
        """[(collective term, bytes, world_size, seconds)] for `fit`: the faster of out-of-place
        and in-place at each size (the slower one carries more of the machine's noise)."""
        return [(_NCCL_TESTS[self.collective], r["size"], self.world_size,
                 min(t for t in (r["time"], r["time_in_place"]) if t is not None))
                for r in self.rows if r["size"] > 0]


def _number(token):
    try:
        return float(token)
    except ValueError:
        return None


def read_nccl_tests(text, collective="all_reduce", world_size=None):
    """Parse the output of nccl-tests (`all_reduce_perf -b 8 -e 8G -f 2 -g 1`, one process per GPU
    or one per node) into an NcclTestsLog: the standard table

        size  count  type  redop  root  time  algbw  busbw  #wrong  time  algbw  busbw  #wrong

    (out-of-place, then in-place; older versions have no `root` column and print an `error`
    column instead of `#wrong`), times in µs and bandwidths in GB/s as nccl-tests prints them.
    The ranks are counted from the "#  Rank ... on HOST device ..." lines (or pass world_size).
    """
    if collective not in _NCCL_TESTS:
        raise ValueError(f"collective must be one of {sorted(_NCCL_TESTS)}; got {collective!r}.")
    if not isinstance(text, str) or not text.strip():
        raise ValueError("read_nccl_tests needs the text nccl-tests printed; got nothing.")
    ranks, hosts, gpu, rows = set(), set(), "", []
    for raw in text.splitlines():
        line = raw.strip()
        while line.startswith("[") and "]" in line[:8]:       # mpirun's "[0]" tags
            line = line[line.index("]") + 1:].strip()
        if line.startswith("#"):
            words = line.lstrip("#").split()
            if len(words) > 1 and words[0] == "Rank" and "on" in words and "device" in words:
                ranks.add((words[1], words[words.index("on") + 1]))
                hosts.add(words[words.index("on") + 1])
                if "]" in line:
                    gpu = line[line.rindex("]") + 1:].strip() or gpu
            continue
        words = line.split()
        if len(words) < 8 or not words[0].isdigit() or not words[1].isdigit():
            continue
        rest = words[4:]                       # after size, count, type, redop
        if len(rest) >= 9:
            rest = rest[1:]                    # the root column (-1 for all_reduce)
        times = [_number(w) for w in rest[:8]]
        if len(times) < 3 or times[0] is None or times[0] <= 0:
            continue
        in_place = times[4] if len(times) >= 8 and times[4] is not None and times[4] > 0 else None
        rows.append(dict(size=int(words[0]), count=int(words[1]), type=words[2], redop=words[3],
                         time=times[0] * 1e-6, algbw=times[1] * 1e9, busbw=times[2] * 1e9,
                         time_in_place=None if in_place is None else in_place * 1e-6,
                         algbw_in_place=None if in_place is None else times[5] * 1e9,
                         busbw_in_place=None if in_place is None else times[6] * 1e9))
    if not rows:
        raise ValueError("no nccl-tests table found: expected lines of 'size count type redop "
                         "[root] time algbw busbw #wrong time algbw busbw #wrong'.")
    n = world_size or len(ranks)
    if not n:
        raise ValueError("the log lists no '#  Rank N ... on HOST device ...' lines: pass "
                         "world_size= (the number of GPUs the test ran on).")
    return NcclTestsLog(collective, n, max(1, len(hosts)), gpu, rows)


def _platform(log, device=None):
    """The calibrated cluster of the log's platform: its GPU on one node, or on many."""
    from . import hardware
    name = (log.gpu or "").upper()
    kind = "h200" if "H200" in name else "h100" if ("H100" in name or "H800" in name) \
        else "a100" if ("A100" in name or "A800" in name) else None
    if device is None and kind is None:
        raise ValueError(f"cannot tell the platform from the GPU name {log.gpu!r}: pass "
                         f"device=distlab.hardware.A100 (or H100, H200).")
    kind = kind or "h100"
    if log.nodes == 1:
        cluster = hardware.PRESETS[f"{kind}-node"]
    else:
        cluster = hardware.PRESETS["a100-cluster" if kind == "a100" else "h100-cluster"]
        if kind == "h200":
            from dataclasses import replace
            cluster = replace(cluster, device=hardware.H200)
    if device is not None:
        from dataclasses import replace
        cluster = replace(cluster, device=device)
    return cluster


def nccl_tests_cluster(log, device=None, name=None):
    """A distlab.emulate.Cluster that reproduces the log: its fitted latency floor and busbw
    (fit(..., latency="floor") on every size), on the log's GPU (or `device`)."""
    from dataclasses import replace
    from . import hardware
    if isinstance(log, str):
        log = read_nccl_tests(log)
    link = fit(log.measurements, name or "your cluster", latency="floor")
    platform = _platform(log, device)
    label = name or f"your cluster ({log.world_size} × {log.gpu or platform.device.name})"
    bandwidth = link.bandwidth if math.isfinite(link.bandwidth) else platform.intra.bandwidth
    per_node = max(1, log.world_size // log.nodes)
    if log.nodes == 1:
        intra = hardware.Link(f"{label}: fitted", bandwidth, link.alpha, 0.0,
                              platform.intra.p2p_latency, None, platform.intra.datasheet,
                              "fitted to an nccl-tests log")
        return hardware.Cluster(label, platform.device, intra, None, per_node,
                                "fitted to an nccl-tests log", nodes=1)
    # Across nodes: one NIC's share of the busbw, and the latency that makes the logged group
    # take the fitted floor.
    probe = replace(platform, ranks_per_node=per_node, nics_per_node=per_node)
    group = probe.link_between(range(log.world_size))
    steps_cost = group.seconds("all_reduce", 0, log.world_size) - group.latency
    nic = hardware.Link(f"{label}: fitted NIC", bandwidth / per_node,
                        max(0.0, link.alpha - steps_cost), platform.inter.hop,
                        platform.inter.p2p_latency, None, platform.inter.datasheet,
                        "fitted to an nccl-tests log")
    return hardware.Cluster(label, platform.device, platform.intra, nic, per_node,
                            "fitted to an nccl-tests log", nics_per_node=per_node,
                            nodes=log.nodes)


def busbw_table(log, device=None):
    """Your busbw beside what the calibrated model of the platform should reach, per size."""
    if isinstance(log, str):
        log = read_nccl_tests(log)
    platform = _platform(log, device)
    if log.nodes > 1:
        from dataclasses import replace
        per_node = max(1, log.world_size // log.nodes)
        platform = replace(platform, ranks_per_node=per_node, nics_per_node=per_node)
    link = platform.link_between(range(log.world_size))
    term = _NCCL_TESTS[log.collective]
    lines = [f"{log.collective} on {log.world_size} × {log.gpu or platform.device.name}"
             f" ({log.nodes} node{'s' if log.nodes > 1 else ''}) vs {platform.name}",
             f"{'size':>12} {'your busbw':>11} {'expected':>9} {'ratio':>6}",
             f"{'(B)':>12} {'(GB/s)':>11} {'(GB/s)':>9}"]
    for r in log.rows:
        if r["size"] == 0:
            continue
        volume = terms(term, r["size"], log.world_size)[1]
        # from the times: the printed busbw has two decimals, nothing for small sizes
        yours = volume / min(t for t in (r["time"], r["time_in_place"]) if t is not None)
        expected = volume / predict(term, r["size"], log.world_size, link)
        ratio = f"{yours / expected:6.2f}" if expected > 0 else f"{'':>6}"
        lines.append(f"{r['size']:>12} {yours / 1e9:>11.2f} {expected / 1e9:>9.2f} {ratio}")
    return "\n".join(lines)
