"""A real job's torch.profiler traces in the course's Trace: its timeline, summary and overlap.

    t = distlab.profiler_trace.from_profiler("traces/")   # or [rank0.json, rank1.json, ...]
    distlab.viz.trace.timeline(t)
    print(t.summary())
    t.overlap(0)      # comm, overlapped, exposed, ratio, idle: the definitions of HTA

Input: one Kineto JSON file per rank, as torch writes them with
`profile(on_trace_ready=tensorboard_trace_handler(dir))` (`*.pt.trace.json`, gzipped or not) or
`prof.export_chrome_trace(path)`. The rank of each file is its `distributedInfo.rank` (torch
writes it when a process group exists), else its place in the list.

What becomes what. Two kinds of trace, read the way Holistic Trace Analysis (HTA) reads them:
- a GPU job (the file has GPU kernels): communication = the NCCL kernels (`nccl*Kernel*`, HTA's
  rule), from kernel start to end; compute = every other kernel except copies and syncs (HTA's
  rule); copies (Memcpy/Memset) count as busy for idle time, neither compute nor communication.
  The CPU side is not used: on a GPU it is launches, not work;
- a CPU job (gloo: no kernels): communication = gloo's own record of each transfer
  (`gloo:all_reduce` ... on its worker threads, `gloo:send`/`gloo:recv` on the caller's), paired
  with the `c10d::` call that launched it (op, bytes from the recorded shapes, peer and tag);
  compute = the time the ranks' threads spent in operators (`cpu_op`) outside communication
  calls, named after the `record_function` range around it (forward, backward, optimizer).
Times are seconds since the earliest event of all the files, so ranks line up (on one host they
share a clock; across hosts only as well as the hosts' clocks agree).

What a profiler trace does not say: how long the caller sat blocked waiting (torch records no
event for it on gloo, and on a GPU the host does not wait), so `waited` is 0 for every event;
read the exposed communication (`Trace.overlap`) instead: communication no compute hid.

Why not HTA itself: it analyses GPU kernels only (on a CPU trace its overlap is NaN) and pulls in
pandas, plotly and JupyterLab extras; this reader uses its definitions, and a test compares the
two on a GPU-shaped trace when HTA is installed.
"""
import gzip
import json
import re
from collections import defaultdict
from pathlib import Path

from ._tracer import _COLLECTIVES
from .chrome_trace import US
from .trace import _merged

NCCL_KERNEL = re.compile(r"^nccl.*Kernel")                       # HTA: is_comm_kernel
NOT_COMPUTE = re.compile(r"(^nccl.*Kernel)|(.*(Memcpy)|(Memset))|(.*Sync)")   # HTA: is_compute
GPU_CATS = ("kernel", "gpu_memcpy", "gpu_memset")
NCCL_OPS = dict(AllReduce="all_reduce", AllGather="all_gather", ReduceScatter="reduce_scatter",
                Broadcast="broadcast", Reduce="reduce", SendRecv="send_recv",
                AllToAll="all_to_all")
P2P = dict(send="send", recv="recv", recv_any_source="recv", recvAnySource="recv")
# The profiler's names of element types (record_shapes) -> torch's.
DTYPES = {"float": "float32", "double": "float64", "c10::Half": "float16",
          "c10::BFloat16": "bfloat16", "long int": "int64", "int": "int32", "short int": "int16",
          "signed char": "int8", "unsigned char": "uint8", "bool": "bool",
          "Float": "float32", "Double": "float64", "Half": "float16", "BFloat16": "bfloat16",
          "Long": "int64", "Int": "int32", "Byte": "uint8", "Char": "int8", "Bool": "bool"}
ITEMSIZE = dict(float32=4, float64=8, float16=2, bfloat16=2, int64=8, int32=4, int16=2,
                int8=1, uint8=1, bool=1)
# c10d method -> (argument whose recorded shape is the course's bytes, times the group size);
# the course's bytes are the FULL tensor for gathers and scatters (see distlab.trace).
BYTES_ARG = dict(allgather=(1, True), allgather_coalesced=(1, True),
                 reduce_scatter=(1, False), gather=(1, True), scatter=(0, True),
                 alltoall=(1, False), alltoall_base=(1, False), _reduce_scatter_base=(1, False),
                 reduce_scatter_tensor_coalesced=(1, False))


def from_profiler(paths):
    """A distlab Trace from torch.profiler traces: a folder of them, one file, or a list of
    files (one per rank)."""
    from .trace import Trace
    files = _files(paths)
    docs = [_load(f) for f in files]
    ranks = [_rank_of(doc, i) for i, doc in enumerate(docs)]
    if sorted(ranks) != list(range(len(docs))):
        raise ValueError(f"the traces name ranks {sorted(ranks)}; from_profiler needs one file "
                         f"per rank 0..{len(docs) - 1} (pass each rank's file once).")
    origin = min(_t0(doc) for doc in docs)
    per_rank = [None] * len(docs)
    for doc, rank in zip(docs, ranks):
        per_rank[rank] = _read_rank(doc, rank, origin)
    trace = Trace(per_rank)
    gpu = any(r["gpu"] for r in per_rank)
    trace.source = "torch.profiler trace" + (" (GPU kernels)" if gpu else " (CPU, gloo)")
    return trace


def _files(paths):
    if isinstance(paths, (str, Path)):
        p = Path(paths)
        if p.is_dir():
            found = sorted(list(p.glob("*.json")) + list(p.glob("*.json.gz")))
            if not found:
                raise ValueError(f"{p} holds no profiler traces (*.json or *.json.gz).")
            return found
        paths = [p]
    files = [Path(p) for p in paths]
    missing = [str(f) for f in files if not f.is_file()]
    if missing:
        raise ValueError(f"no such trace file: {', '.join(missing)}.")
    if not files:
        raise ValueError("from_profiler needs at least one trace file.")
    return files


def _load(path):
    opener = gzip.open if str(path).endswith(".gz") else open
    try:
        with opener(path, "rt") as f:
            doc = json.load(f)
    except (OSError, ValueError) as e:
        raise ValueError(f"{path} is not a JSON trace ({e}).") from None
    if isinstance(doc, list):                     # the format's array form
        doc = dict(traceEvents=doc)
    if not isinstance(doc, dict) or not isinstance(doc.get("traceEvents"), list):
        raise ValueError(f"{path} is not a Chrome/Kineto trace (no traceEvents list).")
    doc["_path"] = str(path)
    return doc


def _rank_of(doc, index):
    info = doc.get("distributedInfo") or {}
    return info.get("rank", index)


def _base_us(doc):
    # Kineto: an event's absolute time is baseTimeNanoseconds + ts (in µs).
    return doc.get("baseTimeNanoseconds", 0) / 1e3


def _slices(doc):
    return [e for e in doc["traceEvents"]
            if e.get("ph") == "X" and isinstance(e.get("ts"), (int, float))
            and isinstance(e.get("pid"), int)]       # Kineto's own "Spans" rows are not the job's


def _t0(doc):
    xs = _slices(doc)
    return min((e["ts"] for e in xs), default=0.0) + _base_us(doc)


def _read_rank(doc, rank, origin):
    base = _base_us(doc)

    def sec(ts):
        return (ts + base - origin) / 1e6

    xs = _slices(doc)
    group = _default_group(doc)
    gpu = [e for e in xs if e.get("cat") in GPU_CATS]
    if gpu:
        events, spans, memory = _gpu(gpu, group, sec)
    else:
        events, spans, memory = _cpu(doc, xs, group, sec)
    ends = [e["end"] for e in events if e["end"] is not None] + [s["end"] for s in spans]
    ends += [b for _, b in memory]
    return dict(rank=rank, events=events, spans=spans, memory=memory, gpu=bool(gpu),
                end=max(ends, default=0.0))


def _default_group(doc):
    configs = (doc.get("distributedInfo") or {}).get("pg_config") or []
    for pg in configs:
        if pg.get("pg_desc") == "default_pg" or len(configs) == 1:
            return tuple(pg.get("ranks") or range(pg.get("pg_size", 0)))
    world = (doc.get("distributedInfo") or {}).get("world_size")
    return tuple(range(world)) if world else None


def _event(op, start, end, launch=None, **fields):
    e = dict(kind="comm", op=op, method=op, group=None, peer=None, tag=None, bytes=0,
             dtype=None, launch=start if launch is None else launch, start=start, end=end,
             waited=0.0, async_op=True, native=False, label=None)
    e.update(fields)
    return e


# ---- GPU jobs: kernels ------------------------------------------------------------------------------

def _gpu(kernels, group, sec):
    events, spans, memory = [], [], []
    for k in sorted(kernels, key=lambda k: k["ts"]):
        start, end = sec(k["ts"]), sec(k["ts"] + k.get("dur", 0))
        name, args = k.get("name", ""), k.get("args") or {}
        if NCCL_KERNEL.match(name):
            events.append(_nccl_event(name, args, start, end, group))
        elif not NOT_COMPUTE.match(name):
            spans.append(dict(kind="compute", name=_short_kernel(name), start=start, end=end,
                              flops=None))
        else:
            memory.append((start, end))          # copies, sets, syncs: busy, not compute
    for i, e in enumerate(events):
        e["seq"] = i
    return events, spans, memory


def _nccl_event(name, args, start, end, group):
    m = re.match(r"nccl(?:Dev)?Kernel_([A-Za-z]+)", name)
    op = NCCL_OPS.get(m.group(1), m.group(1).lower()) if m else "nccl"
    if args.get("Collective name"):
        op = _op_of_method(args["Collective name"]) or op
    dtype = DTYPES.get(args.get("dtype"), args.get("dtype"))
    elements = max(_int(args.get("In msg nelems")), _int(args.get("Out msg nelems")))
    ranks = args.get("Process Group Ranks")
    if isinstance(ranks, str):
        try:
            ranks = json.loads(ranks)
        except ValueError:
            ranks = None
    return _event(op, start, end, bytes=elements * ITEMSIZE.get(dtype, 0), dtype=dtype,
                  group=tuple(ranks) if ranks else group)


def _int(x):
    try:
        return int(x)
    except (TypeError, ValueError):
        return 0


def _short_kernel(name):
    return name.split("(")[0].split("<")[0][:60] or "kernel"


def _op_of_method(method):
    """The course's op name of a c10d method or collective name ("allreduce_", "_allgather_base")."""
    method = method.removeprefix("c10d::")
    for m in (method, method.rstrip("_"), method.rstrip("_").lstrip("_")):
        if m in P2P:
            return P2P[m]
        if m in _COLLECTIVES:
            return _COLLECTIVES[m][0]
    return None


# ---- CPU jobs: gloo ---------------------------------------------------------------------------------

def _cpu(doc, xs, group, sec):
    names = _thread_names(doc)
    transfers = [e for e in xs if e["name"].startswith("gloo:")]
    launches = [e for e in xs if e["name"].startswith("c10d::")]
    workers = {tid for tid, name in names.items() if "gloo" in name}
    events = _pair(launches, transfers, group, sec)
    comm_by_thread = defaultdict(list)
    for e in transfers + launches:
        comm_by_thread[e["tid"]].append((e["ts"], e["ts"] + e.get("dur", 0)))
    spans = []
    ops_by_thread = defaultdict(list)
    for e in xs:
        if e.get("cat") == "cpu_op" and e["tid"] not in workers and not _is_comm(e["name"]):
            ops_by_thread[e["tid"]].append((e["ts"], e["ts"] + e.get("dur", 0)))
    for tid, ops in sorted(ops_by_thread.items()):
        ranges = [e for e in xs if e["tid"] == tid and e.get("cat") == "user_annotation"
                  and not _is_comm(e["name"]) and not e["name"].startswith("ProfilerStep")]
        for a, b in _subtract(_merged(ops), _merged(comm_by_thread[tid])):
            for piece in _cut(a, b, ranges):
                spans.append(dict(kind="compute", name=_name_at(piece, ranges),
                                  start=sec(piece[0]), end=sec(piece[1]), flops=None))
    spans.sort(key=lambda s: s["start"])
    return events, spans, []


def _is_comm(name):
    return name.startswith(("c10d::", "gloo:", "nccl:", "record_param_comms"))


def _thread_names(doc):
    names = defaultdict(str)
    for e in doc["traceEvents"]:
        if e.get("ph") == "M" and e.get("name") == "thread_name":
            names[e.get("tid")] += " " + str((e.get("args") or {}).get("name", ""))
    return names


def _pair(launches, transfers, group, sec):
    """One event per communication call: each gloo transfer (in the order they started) with the
    earliest unpaired c10d launch before it that has a tensor of its size (gloo runs its work in
    launch order, on two worker threads, so sizes tell apart two calls in flight together)."""
    launches = sorted(launches, key=lambda e: e["ts"])
    paired, events = [None] * len(transfers), []
    used = set()
    transfers = sorted(transfers, key=lambda e: e["ts"])
    for i, t in enumerate(transfers):
        size = _numels(t)
        before = [j for j, l in enumerate(launches) if j not in used and l["ts"] <= t["ts"]]
        same = [j for j in before if size & _numels(launches[j])]
        pick = (same or before or [None])[0]
        if pick is not None:
            used.add(pick)
            paired[i] = launches[pick]
    for t, launch in zip(transfers, paired):
        events.append(_gloo_event(t, launch, group, sec))
    for j, launch in enumerate(launches):          # launched, its transfer not in the trace
        if j not in used:
            e = _gloo_event(None, launch, group, sec)
            if e is not None:
                events.append(e)
    events.sort(key=lambda e: e["launch"])
    for i, e in enumerate(events):
        e["seq"] = i
    return events


def _numels(e):
    """The element counts of the tensors an event recorded (record_shapes), as a set."""
    out = set()

    def walk(dims):
        if isinstance(dims, list) and dims and all(isinstance(d, int) for d in dims):
            n = 1
            for d in dims:
                n *= d
            out.add(n)
        elif isinstance(dims, list):
            for d in dims:
                walk(d)
    walk((e.get("args") or {}).get("Input Dims", []))
    return out


def _arg_bytes(args, index, itemsize):
    dims = (args.get("Input Dims") or [])
    if index >= len(dims):
        return 0
    types = args.get("Input type") or []
    kind = types[index] if index < len(types) else ""
    size = ITEMSIZE.get(DTYPES.get(kind), itemsize)

    def numel(d):
        if isinstance(d, list) and d and all(isinstance(x, int) for x in d):
            n = 1
            for x in d:
                n *= x
            return n
        if isinstance(d, list):
            return sum(numel(x) for x in d)
        return 0
    return numel(dims[index]) * size


def _gloo_event(transfer, launch, group, sec):
    t_args = (transfer or {}).get("args") or {}
    l_args = (launch or {}).get("args") or {}
    types = t_args.get("Input type") or []
    dtype = DTYPES.get(types[0]) if types else None
    method = launch["name"].removeprefix("c10d::") if launch else None
    op = (_op_of_method(method) if method else None) or \
        (_op_of_method(transfer["name"].removeprefix("gloo:")) if transfer else None)
    if op is None:
        if transfer is None:
            return None                  # a c10d call that is not communication (e.g. a wait)
        op = transfer["name"].removeprefix("gloo:")
    n = len(group) if group else 1
    itemsize = ITEMSIZE.get(dtype, 4)
    nbytes = 0
    if launch is not None:
        index, times_n = BYTES_ARG.get(method.rstrip("_"), (0, False))
        nbytes = _arg_bytes(l_args, index, itemsize) * (n if times_n else 1)
        if nbytes == 0:      # the argument is a list of lists: its shapes are not recorded
            nbytes = _arg_bytes(l_args, 1 - index, itemsize) * (1 if times_n else n)
    if nbytes == 0 and transfer is not None:
        nbytes = _arg_bytes(t_args, 0, itemsize)
    if op == "barrier":
        nbytes = 4                                     # as distlab.trace records a barrier
    peer = tag = None
    if op in ("send", "recv") and launch is not None:
        concrete = l_args.get("Concrete Inputs") or []
        scalars = [_int(c) if str(c).lstrip("-").isdigit() else None for c in concrete[2:]]
        if method.rstrip("_") == "recv_any_source":
            tag = scalars[0] if scalars else None
        elif len(scalars) >= 2:
            peer, tag = scalars[0], scalars[1]
            if peer is not None and group and peer < len(group):
                peer = group[peer]
    start = sec(transfer["ts"]) if transfer else None
    end = sec(transfer["ts"] + transfer.get("dur", 0)) if transfer else None
    return _event(op, start, end, launch=sec(launch["ts"]) if launch else start,
                  method=method or op, group=group, peer=peer, tag=tag, bytes=nbytes,
                  dtype=dtype)


# ---- intervals ------------------------------------------------------------------------------------

def _subtract(xs, ys):
    """Merged intervals xs minus merged intervals ys."""
    out = []
    for a, b in xs:
        for c, d in ys:
            if d <= a or c >= b:
                continue
            if c > a:
                out.append((a, c))
            a = max(a, d)
            if a >= b:
                break
        if a < b:
            out.append((a, b))
    return out


def _cut(a, b, ranges):
    """[a, b] cut where a record_function range begins or ends inside it."""
    points = sorted({p for r in ranges for p in (r["ts"], r["ts"] + r.get("dur", 0))
                     if a < p < b})
    edges = [a] + points + [b]
    return list(zip(edges, edges[1:]))


def _name_at(piece, ranges):
    """The innermost record_function range around the piece, or "compute"."""
    mid = (piece[0] + piece[1]) / 2
    around = [r for r in ranges if r["ts"] <= mid <= r["ts"] + r.get("dur", 0)]
    return min(around, key=lambda r: r.get("dur", 0))["name"] if around else "compute"


# ---- reading a distlab export back ----------------------------------------------------------------

def from_chrome(path):
    """The Trace a distlab export (`to_chrome`) holds: its events, spans and clocks, in seconds."""
    from .trace import Trace
    with open(path) as f:
        doc = json.load(f)
    info = doc.get("otherData", {}).get("distlab") if isinstance(doc, dict) else None
    if info is None:
        raise ValueError(f"{path} was not written by distlab's to_chrome (no otherData.distlab); "
                         f"for a torch.profiler trace use distlab.profiler_trace.from_profiler.")
    n = info["world_size"]
    per_rank = [dict(rank=r, events=[], spans=[], end=info["rank_ends_us"][r] / US)
                for r in range(n)]
    for ev in doc["traceEvents"]:
        if ev.get("ph") != "X":
            continue
        r, a = per_rank[ev["pid"]], ev["args"]
        start, end = ev["ts"] / US, (ev["ts"] + ev["dur"]) / US
        if ev["cat"] == "compute":
            r["spans"].append(dict(kind="compute", name=ev["name"], start=start, end=end,
                                   flops=a.get("flops")))
        elif ev["cat"] == "comm":
            seen = a.get("transfer_seen", True)
            r["events"].append(dict(
                kind="comm", op=a["op"], method=a["op"],
                group=tuple(a["group"]) if a["group"] is not None else None,
                peer=a.get("peer"), tag=a.get("tag"), bytes=a["bytes"], dtype=a["dtype"],
                launch=a["launch_us"] / US, start=start if seen else None,
                end=end if seen else None, waited=a["waited_us"] / US, async_op=a["async_op"],
                native=a["native"], label=[a["label"]] if a["label"] else None, seq=a["seq"]))
    for r in per_rank:
        r["events"].sort(key=lambda e: e["seq"])
        r["spans"].sort(key=lambda s: (s["start"], -s["end"]))
    cluster, source = None, None
    if info.get("emulated"):
        from .emulate import PRESETS
        cluster = next((c for c in PRESETS.values() if c.name == info.get("cluster")), None)
        if cluster is None:         # a Cluster of the learner's own: its name is all we have
            source = f"modeled on {info.get('cluster')}"
    trace = Trace(per_rank, cluster)
    trace.source = source
    return trace
