"""A run's trace in the Chrome trace event format: open it in https://ui.perfetto.dev or
chrome://tracing, the viewers engineers use for torch.profiler traces of a real job.

    results = distlab.run(fn, 4, trace=True)      # or emulate="h100-nvlink"
    results.trace.to_chrome("run.json")           # = distlab.chrome_trace.to_chrome(trace, path)

What the file holds (the format: "Trace Event Format", Google, the JSON Object form:
https://docs.google.com/document/d/1CvAClvFfyA5R-PhYUmn5OOQtYMH4h6I0nSsKchNAySU):
- one process per rank (`pid` = rank, named "rank r" by a `process_name` metadata event);
- threads: "compute" (the rank's compute spans), "communication" (every collective and message,
  while its transfer runs), "blocked waiting" (when the caller sat blocked in it), and for a GPU
  job's profiler trace "copies" (memcpy/memset: busy, neither compute nor communication). Slices that
  overlap without nesting (async transfers in flight together) get a second lane of their kind,
  because one thread's slices must nest;
- every collective and message is a complete slice (`ph: "X"`) named after its op, with op,
  group, peer, tag, bytes, dtype, waited, launch and the enclosing span as args;
- a flow arrow (`ph: "s"` on the send, `ph: "f"` on its recv) from each send to the recv that
  received it: the k-th send from a to b with tag t is the k-th recv on b from a with tag t, the
  order point-to-point messages keep between two ranks;
- timestamps in µs (the format's unit): measured on this machine from when each rank started its
  function (ranks start within a few ms of each other, so arrows between ranks are only roughly
  aligned), or modeled under emulation. An emulated run says so in its process names, in every
  slice's args and in `otherData`, with the cluster it was modeled on.

`distlab.profiler_trace.from_chrome(path)` reads such a file back into a Trace (the round
trip the tests check), beside the reader of torch.profiler traces.
"""
import json
from collections import defaultdict

US = 1e6            # the format's timestamps are microseconds; the course's trace holds seconds
COMPUTE, COMM, WAIT, COPY = "compute", "communication", "blocked waiting", "copies"
_THREADS = (COMPUTE, COMM, WAIT, COPY)
_LANES = 100        # lanes of one kind sort together: see _tid
_FLOW = dict(cat="p2p", name="message")


def to_chrome(trace, path):
    """Write `trace` (a distlab Trace) to `path` as Chrome trace event JSON; returns the path."""
    doc = chrome_events(trace)
    with open(path, "w") as f:
        json.dump(doc, f, indent=None, separators=(",", ":"))
        f.write("\n")
    return path


def chrome_events(trace):
    """The Chrome trace document of `trace` as a dict: {"traceEvents": [...], ...}."""
    if not hasattr(trace, "world_size") or not hasattr(trace, "comm"):
        raise TypeError(f"to_chrome needs a distlab Trace (results.trace of a run with "
                        f"trace=True); got {type(trace).__name__}.")
    cluster = trace.emulated
    clock = "modeled" if cluster is not None else getattr(trace, "source", None) or "measured"
    events, lanes_used = [], defaultdict(set)
    for r in range(trace.world_size):
        for kind, slices in ((COMPUTE, _compute_slices(trace, r, clock)),
                             (COMM, _comm_slices(trace, r, clock)),
                             (WAIT, _wait_slices(trace, r, clock)),
                             (COPY, _copy_slices(trace, r, clock))):
            for lane, s in _lanes(slices):
                s.update(pid=r, tid=_tid(trace.world_size, r, kind, lane))
                lanes_used[r].add((kind, lane))
                events.append(s)
    events += _flows(trace, events)
    meta = []
    for r in range(trace.world_size):
        name = f"rank {r}" + (f" (emulated on {cluster.name})" if cluster is not None else "")
        meta.append(dict(ph="M", name="process_name", pid=r, tid=0, args=dict(name=name)))
        meta.append(dict(ph="M", name="process_sort_index", pid=r, tid=0,
                         args=dict(sort_index=r)))
        if cluster is not None:
            meta.append(dict(ph="M", name="process_labels", pid=r, tid=0,
                             args=dict(labels="emulated: times are modeled, not measured")))
        for kind in _THREADS:       # every rank names the first three, used or not: the same rows
            lanes = sorted(lane for k, lane in lanes_used[r] if k == kind)
            if not lanes and kind != COPY:       # copies only where the trace has them (GPUs)
                lanes = [0]
            for lane in lanes:
                tid = _tid(trace.world_size, r, kind, lane)
                label = kind if lane == 0 else f"{kind} ({lane + 1})"
                meta.append(dict(ph="M", name="thread_name", pid=r, tid=tid,
                                 args=dict(name=label)))
                meta.append(dict(ph="M", name="thread_sort_index", pid=r, tid=tid,
                                 args=dict(sort_index=tid)))
    origin = ("the earliest event of the profiler traces" if getattr(trace, "source", None)
              else "when each rank started its function")
    other = dict(world_size=trace.world_size, clock=clock,
                 emulated=cluster is not None, time_origin=origin,
                 rank_ends_us=[_us(trace.end(r)) for r in range(trace.world_size)])
    if cluster is not None:
        from .emulate import describe
        other.update(cluster=cluster.name, description=describe(cluster).lstrip("⏱ "))
    return dict(traceEvents=meta + events, displayTimeUnit="ms",
                otherData=dict(producer="distlab", distlab=other))


def _tid(world_size, rank, kind, lane):
    """A thread id unique in the whole file, never 0 and never a rank's pid: Perfetto's JSON
    importer reads tid 0 as the process's main thread (tid = pid), so a "compute" thread 0
    would merge with rank 1's thread 1 and be drawn as rank r's "main thread". Counted from
    1000 · world_size up: (rank, kind, lane) in that order, so a rank's rows sort compute,
    communication, blocked waiting."""
    return 1000 * (world_size + rank) + _THREADS.index(kind) * _LANES + lane


def _us(seconds):
    return round(seconds * US, 3)          # ns resolution: more digits are noise


def _compute_slices(trace, rank, clock):
    out = []
    for s in trace.compute(rank):
        args = dict(clock=clock)
        if s.get("flops") is not None:
            args["flops"] = s["flops"]
        out.append(dict(ph="X", cat="compute", name=s["name"], ts=_us(s["start"]),
                        dur=_us(max(0.0, s["end"] - s["start"])), args=args))
    return out


def _window(e):
    """(start, end) in seconds of a communication event's slice. A call whose transfer was never
    seen (issued from C++ in a measured run, or never waited for) is a zero-length slice at its
    launch: it still shows where it was issued."""
    start = e["start"] if e["start"] is not None else e["launch"]
    end = e["end"] if e["end"] is not None else start
    return start, max(start, end)


def _comm_slices(trace, rank, clock):
    out = []
    for e in trace.comm(rank):
        start, end = _window(e)
        args = dict(op=e["op"], group=list(e["group"]) if e["group"] is not None else None,
                    bytes=e["bytes"], dtype=e["dtype"], waited_us=_us(e["waited"]),
                    launch_us=_us(e["launch"]), async_op=e["async_op"], native=e["native"],
                    label=e["label"][-1] if e["label"] else None, seq=e["seq"], clock=clock)
        if e["op"] in ("send", "recv"):
            args.update(peer=e["peer"], tag=e["tag"])
        if e["start"] is None or e["end"] is None:
            args["transfer_seen"] = False
        out.append(dict(ph="X", cat="comm", name=e["op"], ts=_us(start),
                        dur=_us(end - start), args=args))
    return out


def _wait_slices(trace, rank, clock):
    out = []
    for e in trace.comm(rank):
        if e["waited"] > 0 and e["end"] is not None:
            out.append(dict(ph="X", cat="wait", name=f"wait {e['op']}",
                            ts=_us(e["end"] - e["waited"]), dur=_us(e["waited"]),
                            args=dict(op=e["op"], seq=e["seq"], clock=clock)))
    return out


def _copy_slices(trace, rank, clock):
    """A GPU job's memcpy/memset intervals: neither compute nor communication, but busy time, so
    the idle time read back from the file is the idle time of the trace."""
    return [dict(ph="X", cat="copy", name="copy", ts=_us(a), dur=_us(max(0.0, b - a)),
                 args=dict(clock=clock))
            for a, b in _copies(trace, rank)]


def _copies(trace, rank):
    # The trace keeps no accessor for them: they only come from profiler traces of GPU jobs.
    ranks = getattr(trace, "_ranks", None) or []
    return [tuple(m) for m in ranks[rank].get("memory", ())] if rank < len(ranks) else []


def _lanes(slices):
    """[(lane, slice)]: each slice on the first lane where it nests (inside the slice open
    there, or after it ended). The format wants one thread's complete events to nest; two async
    transfers in flight together would not, so the second gets its own lane."""
    stacks, out = [], []
    for s in sorted(slices, key=lambda s: (s["ts"], -s["dur"])):
        end = s["ts"] + s["dur"]
        for lane, stack in enumerate(stacks + [[]]):
            while stack and stack[-1] <= s["ts"]:
                stack.pop()
            if not stack or end <= stack[-1]:
                break
        if lane == len(stacks):
            stacks.append([])
        stacks[lane].append(end)
        out.append((lane, s))
    return out


def _flows(trace, slices):
    """A flow arrow from each send's slice to its recv's slice."""
    by_seq = {(s["pid"], s["args"]["seq"]): s for s in slices if s["cat"] == "comm"}
    recvs = defaultdict(list)          # (src, dst, tag) -> the recv events on dst, in order
    for e in trace.comm(op="recv"):
        recvs[(e["peer"], e["rank"], e["tag"])].append(e)
    flows, used = [], defaultdict(int)
    for e in trace.comm(op="send"):
        key = (e["rank"], e["peer"], e["tag"])
        k = used[key]
        if k >= len(recvs[key]):
            continue                    # never received in this run (or sent to itself)
        used[key] += 1
        src, dst = by_seq[(e["rank"], e["seq"])], by_seq[(e["peer"], recvs[key][k]["seq"])]
        fid = len(flows) // 2 + 1
        # "s" binds to the slice open on its thread at its ts, "f" with bp="e" to the slice
        # enclosing its ts: the arrow leaves just after the send began and lands just before
        # the recv ended, a hair inside each slice so that it binds to it.
        flows.append(dict(ph="s", id=fid, pid=src["pid"], tid=src["tid"],
                          ts=_inside(src, end=False), **_FLOW))
        flows.append(dict(ph="f", bp="e", id=fid, pid=dst["pid"], tid=dst["tid"],
                          ts=_inside(dst, end=True), **_FLOW))
    return flows


def _inside(s, end):
    hair = min(0.001, s["dur"] / 2)                  # 1 ns, or half of a shorter slice
    return round(s["ts"] + s["dur"] - hair if end else s["ts"] + hair, 3)
