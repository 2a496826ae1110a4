"""Reading a real cluster: nccl-tests' `all_reduce_perf` output, turned into measurements for
`distlab.cost.fit`, into a cluster to emulate with, and into a table of your busbw beside what the
calibrated model of the platform (distlab.hardware) says it should reach.

    log = read_nccl_tests(open("all_reduce_perf.log").read())
    cluster = nccl_tests_cluster(log)          # distlab.run(..., emulate=cluster)
    print(busbw_table(log))

Kept apart from distlab.cost (the α-β model) and distlab.hardware (the calibrated presets), which
it joins: neither needs the other.
"""
import math
import re
from dataclasses import dataclass, replace

from . import hardware
from .cost import fit, predict, terms

# nccl-tests names its binaries after NCCL's collectives; the model's term for each.
_NCCL_TESTS = {"all_reduce": "ring_all_reduce", "all_gather": "ring_all_gather",
               "reduce_scatter": "ring_reduce_scatter", "alltoall": "all_to_all",
               "broadcast": "ring_broadcast", "sendrecv": "send"}


@dataclass
class NcclTestsLog:
    """What `read_nccl_tests` found: one row per size (out-of-place and in-place time in
    seconds, algbw and busbw in bytes/s), the ranks, nodes (distinct host names) and GPU name;
    `form` is the table's leading columns as the log printed them (the header differs between
    versions of nccl-tests: ("size", "count", "type", "redop", "root") today, no "root" before
    2.10, no "redop" at all in older all_gather_perf)."""
    collective: str
    world_size: int
    nodes: int
    gpu: str
    rows: list
    form: tuple = ()

    @property
    def measurements(self):
        """[(collective term, bytes, world_size, seconds)] for `fit`: the faster of out-of-place
        and in-place at each size (the slower one carries more of the machine's noise)."""
        return [(_NCCL_TESTS[self.collective], r["size"], self.world_size,
                 min(t for t in (r["time"], r["time_in_place"]) if t is not None))
                for r in self.rows if r["size"] > 0]


# mpirun's rank tags: "[0]" (MPICH, Intel MPI; also in mid-line where two ranks' output met)
# and Open MPI's --tag-output "[1,0]<stdout>:". Bus ids ("[0x1a]", "[0000:02:00]") do not match.
_TAG = re.compile(r"\[\d+(?:,\d+)*\](?:<std(?:out|err)>:)?")
_LEAD = ("size", "count", "type", "redop", "root")


def _number(token):
    try:
        x = float(token)
    except ValueError:
        return None
    return x if math.isfinite(x) else None


def _lead(words):
    """How many columns come before the time: size, count, type, then "redop" where the row has
    a word there, then "root" where the numbers after it are one more than whole halves of
    (time, algbw, busbw, error)."""
    lead = 3 + (_number(words[3]) is None)
    return lead + ((len(words) - lead) % 4 == 1)


def _row(words, lead):
    times = [_number(w) for w in words[lead:lead + 8]]
    if len(times) < 3 or None in times[:3] or times[0] <= 0:
        return None
    in_place = len(times) >= 7 and None not in times[4:7] and times[4] > 0
    return dict(size=int(words[0]), count=int(words[1]), type=words[2],
                redop=words[3] if lead > 3 else None,
                time=times[0] * 1e-6, algbw=times[1] * 1e9, busbw=times[2] * 1e9,
                time_in_place=times[4] * 1e-6 if in_place else None,
                algbw_in_place=times[5] * 1e9 if in_place else None,
                busbw_in_place=times[6] * 1e9 if in_place else None)


def read_nccl_tests(text, collective="all_reduce", world_size=None):
    """Parse the output of nccl-tests (`all_reduce_perf -b 8 -e 8G -f 2 -g 1`, one process per GPU
    or one per node) into an NcclTestsLog: the standard table

        size  count  type  redop  root  time  algbw  busbw  #wrong  time  algbw  busbw  #wrong

    (out-of-place, then in-place; older versions have no `root` column and print an `error`
    column instead of `#wrong`, older all_gather_perf no `redop` either), times in µs and
    bandwidths in GB/s as nccl-tests prints them, with or without mpirun's rank tags.
    The ranks are counted from the "#  Rank ... on HOST device ..." lines (or pass world_size).
    """
    if collective not in _NCCL_TESTS:
        raise ValueError(f"collective must be one of {sorted(_NCCL_TESTS)}; got {collective!r}.")
    if isinstance(text, bytes):
        text = text.decode("utf-8", errors="replace")
    if not isinstance(text, str) or not text.strip():
        raise ValueError("read_nccl_tests needs the text nccl-tests printed (a str); got "
                         f"{'nothing' if not text else type(text).__name__}.")
    ranks, hosts, gpu, rows, form = set(), set(), "", [], ()
    for raw in text.splitlines():
        line = _TAG.sub(" ", raw).strip()
        if line.startswith("#"):
            words = line.lstrip("#").split()
            if len(words) > 1 and words[0] == "Rank" and "on" in words and "device" in words \
                    and words.index("on") + 1 < len(words):
                ranks.add((words[1], words[words.index("on") + 1]))
                hosts.add(words[words.index("on") + 1])
                if "]" in line:
                    gpu = line[line.rindex("]") + 1:].strip() or gpu
            elif words[:2] == ["size", "count"] and "time" in words:
                form = tuple(words[:words.index("time")])
            continue
        words = line.split()
        if len(words) < 7 or not all(w.isascii() and w.isdigit() for w in words[:2]):
            continue
        lead = len(form) if form[:3] == _LEAD[:3] and set(form) <= set(_LEAD) else _lead(words)
        row = _row(words, lead)
        if row is not None:
            rows.append(row)
            form = form or _LEAD[:lead]
    if not rows:
        raise ValueError("no nccl-tests table found: expected lines of 'size count type [redop] "
                         "[root] time algbw busbw #wrong time algbw busbw #wrong'.")
    n = world_size or len(ranks)
    if not n:
        raise ValueError("the log lists no '#  Rank N ... on HOST device ...' lines: pass "
                         "world_size= (the number of GPUs the test ran on).")
    return NcclTestsLog(collective, n, max(1, len(hosts)), gpu, rows, form)


def _platform(log, device=None):
    """The calibrated cluster of the log's platform: its GPU on one node, or on many."""
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
            cluster = replace(cluster, device=hardware.H200)
    if device is not None:
        cluster = replace(cluster, device=device)
    return cluster


def nccl_tests_cluster(log, device=None, name=None):
    """A distlab.emulate.Cluster that reproduces the log: its fitted latency floor and busbw
    (fit(..., latency="floor") on every size), on the log's GPU (or `device`)."""
    if isinstance(log, str):
        log = read_nccl_tests(log)
    if log.world_size < 2:
        raise ValueError("a one-GPU nccl-tests log measures no link (nothing leaves the GPU): "
                         "run it on two GPUs or more to fit a cluster.")
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
    if log.world_size == 1:
        # One rank sends nothing: busbw is 0 by definition and no link has a time to predict.
        head = [f"{log.collective} on 1 × {log.gpu or platform.device.name} vs {platform.name}"
                f" — one GPU: no link, busbw 0 by definition",
                f"{'size':>12} {'your busbw':>11} {'expected':>9}",
                f"{'(B)':>12} {'(GB/s)':>11} {'(GB/s)':>9}"]
        return "\n".join(head + [f"{r['size']:>12} {r['busbw'] / 1e9:>11.2f} {'—':>9}"
                                  for r in log.rows if r["size"] > 0])
    if log.nodes > 1:
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
        model = predict(term, r["size"], log.world_size, link)
        expected = volume / model if model > 0 else 0.0
        ratio = f"{yours / expected:6.2f}" if expected > 0 else f"{'':>6}"
        lines.append(f"{r['size']:>12} {yours / 1e9:>11.2f} {expected / 1e9:>9.2f} {ratio}")
    return "\n".join(lines)
