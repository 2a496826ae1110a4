"""A CPU job's trace (gloo): each transfer paired with the c10d call that launched it, and the
compute the ranks' threads did outside communication."""
from collections import defaultdict

from ..trace import _merged
from .intervals import _cut, _name_at, _subtract
from .records import DTYPES, ITEMSIZE, _event, _int, _op_of_method

# c10d method -> (argument whose recorded shape is the course's bytes, times the group size);
# the course's bytes are the FULL tensor for gathers and scatters (see distlab.trace).
BYTES_ARG = dict(allgather=(1, True), allgather_coalesced=(1, True),
                 reduce_scatter=(1, False), gather=(1, True), scatter=(0, True),
                 alltoall=(1, False), alltoall_base=(1, False), _reduce_scatter_base=(1, False),
                 reduce_scatter_tensor_coalesced=(1, False))


def _cpu(doc, xs, groups, sec):
    names = _thread_names(doc)
    transfers = [e for e in xs if e["name"].startswith("gloo:")]
    launches = [e for e in xs if e["name"].startswith("c10d::")]
    workers = {tid for tid, name in names.items() if "gloo" in name}
    events = _pair(launches, transfers, groups, sec)
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


def _pair(launches, transfers, groups, sec):
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
        events.append(_gloo_event(t, launch, groups, sec))
    for j, launch in enumerate(launches):          # launched, its transfer not in the trace
        if j not in used:
            e = _gloo_event(None, launch, groups, sec)
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


def _gloo_event(transfer, launch, groups, sec):
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
    group = groups.of(l_args)
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
            peer, tag = groups.peer(l_args, scalars[0]), scalars[1]
    start = sec(transfer["ts"]) if transfer else None
    end = sec(transfer["ts"] + transfer.get("dur", 0)) if transfer else None
    return _event(op, start, end, launch=sec(launch["ts"]) if launch else start,
                  method=method or op, group=group, peer=peer, tag=tag, bytes=nbytes,
                  dtype=dtype)
