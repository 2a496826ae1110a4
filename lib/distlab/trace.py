"""What every rank did: `distlab.run(fn, n, trace=True)` returns a Trace with its results.

    results = distlab.run(fn, 4, trace=True)            # or emulate="a100-nvlink" (traced too)
    t = results.trace
    t.comm(rank=2)           # rank 2's collectives and messages, in the order it issued them
    t.sends(rank=2)          # [(peer, bytes), ...] of its point-to-point sends
    t.matrix()               # bytes sent from each rank to each rank by point-to-point calls
    print(t.summary())       # per rank: compute, communication, time waited, messages, bytes
    distlab.viz.trace.timeline(t)   # a per-rank timeline of compute / communication / waiting
    t.overlap(rank=0)        # communication hidden behind compute, exposed, idle (HTA's terms)
    t.to_chrome("run.json")  # open in https://ui.perfetto.dev or chrome://tracing

A real job's torch.profiler traces come back as a Trace too:
`distlab.profiler_trace.from_profiler("traces/")`.

Each communication event is a dict: `op` (all_reduce, all_gather, reduce_scatter, broadcast,
reduce, all_to_all, gather, scatter, barrier, send, recv), `group` (the global ranks of its
process group), `peer` (global rank, for send/recv), `tag`, `bytes` (for a collective the tensor
its model needs: the full one for gathers and scatters; for a message its size), `dtype`,
`launch` (when the rank called it), `start` and `end` (when the transfer ran), `waited` (how long
the caller was blocked in it), `async_op` (the caller did something else before waiting),
`native` (issued from C++, e.g. torch's DDP: recorded, but neither its peer nor its wait is
seen), and `label` (the enclosing `span`). Compute spans have `name`, `start`, `end`, `flops`.

Times are seconds since the rank started its function: measured on this machine, or modeled on
the emulated accelerator (`trace.emulated` is then the distlab.emulate.Cluster).

Inside a rank, mark what the timeline should name:

    with distlab.trace.span("forward"):  ...      # a named compute span
    distlab.trace.compute(seconds=0.004)          # compute of known modeled length (a straggler)
    distlab.trace.now()                           # this rank's clock (virtual under emulation)

Under emulation the model and its inputs may live on the `meta` device (full size, no values;
see distlab.emulate): code that needs a value then raises distlab.trace.MetaValueError.
"""
import contextlib
import math
import numbers
import time
from collections import defaultdict

import torch

from . import _argcheck as check
from . import _tracer
from ._tracer import MetaValueError  # noqa: F401  (public: distlab.trace.MetaValueError)
from .emulate import describe


# the ops a communication event can name (a profiler trace may add others, which it then holds)
OPS = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "reduce", "all_to_all",
       "gather", "scatter", "barrier", "send", "recv")


# ---- inside a rank ------------------------------------------------------------------------------

def now():
    """Seconds on this rank's clock: the virtual clock under emulation, else the wall clock."""
    rec = _tracer._active
    return rec.now() if rec is not None else time.perf_counter()


@contextlib.contextmanager
def span(name):
    """Name the compute inside this block in the trace (under emulation its ops are timed)."""
    if not isinstance(name, str):
        raise TypeError(f"distlab.trace.span(name) names the span with a string, like "
                        f"'forward'; got {name!r}.")
    rec = _tracer._active
    if rec is None:
        yield
        return
    started = rec.span_enter(name)
    try:
        yield
    finally:
        rec.span_exit(name, started)


def compute(seconds, name="compute"):
    """Spend `seconds` of compute: modeled on the virtual clock, slept otherwise."""
    seconds = _seconds(seconds)
    rec = _tracer._active
    if rec is None:
        time.sleep(seconds)
    else:
        rec.modeled_compute(seconds, name)


def _seconds(x):
    """`x` as a float: any real number (numpy's too, a 0-d tensor), finite and not negative, or
    a sentence (a NaN or an infinity would poison the virtual clock of every rank it waits for)."""
    value = x
    if isinstance(x, torch.Tensor) and x.dim() == 0 and x.device.type != "meta" \
            and not x.is_complex() and x.dtype != torch.bool:
        from torch.utils._python_dispatch import _disable_current_modes
        with _disable_current_modes():      # reading the number is not compute of the rank's
            value = x.item()
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"distlab.trace.compute(seconds) needs a number of seconds, like 0.004; "
                        f"got {x!r} (a {type(x).__name__}).")
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"distlab.trace.compute(seconds) needs a finite, non-negative number of "
                         f"seconds, like 0.004; got {x!r}.")
    return float(value)


def completed_at(work):
    """When a traced Work handle's transfer completed (modeled under emulation); None if not
    traced or not known yet (a measured transfer is known once waited for). Under emulation
    asking learns the peers' start times: it waits on the host until they launched it."""
    event = getattr(work, "_event", None)
    if event is None:
        return None
    if event.get("end") is None and work._recorder.clock is not None:
        return work._recorder.completion(event)
    return event.get("end")


def emulated():
    """The Cluster this rank runs on, or None when time is not emulated."""
    rec = _tracer._active
    return None if rec is None or rec.clock is None else rec.clock.cluster


# ---- in the notebook: what came back ------------------------------------------------------------

class Trace:
    """The events of every rank of one run, in rank order."""

    def __init__(self, per_rank, emulated=None):
        self.world_size = len(per_rank)
        self.emulated = emulated
        # Emulated on meta tensors (full size, no values): see distlab._tracer.
        self.meta = any(r.get("meta") for r in per_rank if r)
        self._ranks = per_rank          # [{"rank", "events", "spans", "end"}] in rank order

    # -- selecting -----------------------------------------------------------------------------
    def comm(self, rank=None, op=None):
        """Communication events (of one rank, of one op), in the order they were issued."""
        ranks = range(self.world_size) if rank is None else [self._rank(rank)]
        self._check_op(op)
        return [dict(e, rank=r) for r in ranks for e in self._ranks[r]["events"]
                if op is None or e["op"] == op]

    def compute(self, rank=None):
        ranks = range(self.world_size) if rank is None else [self._rank(rank)]
        return [dict(s, rank=r) for r in ranks for s in self._ranks[r]["spans"]]

    def sends(self, rank):
        """[(peer, bytes), ...]: the point-to-point messages `rank` sent, in order."""
        return [(e["peer"], e["bytes"]) for e in self._ranks[self._rank(rank)]["events"]
                if e["op"] == "send"]

    def ops(self, rank=None):
        """The names of the ops a rank issued, in order (e.g. ['all_reduce', 'all_reduce'])."""
        return [e["op"] for e in self.comm(rank)]

    def matrix(self):
        """bytes[src][dst] sent by point-to-point calls (collectives are not split into messages)."""
        m = [[0] * self.world_size for _ in range(self.world_size)]
        for e in self.comm(op="send"):
            if e["peer"] is not None:        # a profiler trace may not tell a send's peer
                m[e["rank"]][e["peer"]] += e["bytes"]
        return m

    # -- time ------------------------------------------------------------------------------------
    def end(self, rank=None):
        """When the rank (or the slowest rank) finished its function."""
        if rank is not None:
            return self._ranks[self._rank(rank)]["end"]
        return max(r["end"] for r in self._ranks)

    def totals(self, rank):
        """Seconds of compute, of communication in flight, and of waiting; messages and bytes."""
        rank = self._rank(rank)
        events = self._ranks[rank]["events"]
        return dict(
            compute=sum(s["end"] - s["start"] for s in self._ranks[rank]["spans"]),
            comm=_union([(e["start"], e["end"]) for e in events
                         if e["start"] is not None and e["end"] is not None]),
            waited=sum(e["waited"] for e in events),
            calls=len(events),
            sent=sum(e["bytes"] for e in events if e["op"] == "send"),
            end=self._ranks[rank]["end"])

    def summary(self):
        """A per-rank table: compute, communication, waited, calls, bytes sent by messages."""
        unit, scale = _unit(self.end())
        lines = []
        if self.emulated is not None:
            lines.append(describe(self.emulated, self.meta))
        lines.append(f"rank  {'compute':>10} {'comm':>10} {'waited':>10} {'end':>10}  calls  "
                     f"p2p bytes sent   ({unit})")
        for r in range(self.world_size):
            t = self.totals(r)
            lines.append(f"{r:>4}  {t['compute'] * scale:>10.3f} {t['comm'] * scale:>10.3f} "
                         f"{t['waited'] * scale:>10.3f} {t['end'] * scale:>10.3f}  "
                         f"{t['calls']:>5}  {t['sent']:>15,}")
        return "\n".join(lines)

    def counts(self):
        """{op: number of calls} over all ranks."""
        out = defaultdict(int)
        for e in self.comm():
            out[e["op"]] += 1
        return dict(out)

    def overlap(self, rank):
        """How much of the rank's communication its compute hid, with the definitions of
        Holistic Trace Analysis (HTA, get_comm_comp_overlap / get_temporal_breakdown), so the
        numbers compare with HTA's on a GPU job: seconds of `comm` (the union of transfers in
        flight), `overlapped` (of those, while compute ran), `exposed` (comm - overlapped),
        `ratio` (overlapped / comm; None without comm), and `idle` (neither compute, nor
        communication, nor a copy, between the first and the last of them)."""
        r = self._ranks[self._rank(rank)]
        comm = [(e["start"], e["end"]) for e in r["events"]
                if e["start"] is not None and e["end"] is not None]
        compute = [(s["start"], s["end"]) for s in r["spans"]]
        busy = comm + compute + [tuple(m) for m in r.get("memory", ())]
        in_flight, hidden = _union(comm), _intersection(comm, compute)
        window = max(b for _, b in busy) - min(a for a, _ in busy) if busy else 0.0
        return dict(comm=in_flight, overlapped=hidden, exposed=in_flight - hidden,
                    ratio=hidden / in_flight if in_flight > 0 else None,
                    idle=window - _union(busy))

    def _rank(self, rank):
        # a negative rank would silently read the ranks from the end, as a list index does
        return check.rank_in(rank, self.world_size)

    def _check_op(self, op):
        # a misspelt op ("allreduce") would select nothing without a word
        if op is None or any(e["op"] == op for r in self._ranks for e in r["events"]):
            return
        if op not in OPS:
            raise ValueError(f"op {op!r} is not an op the trace records; it records "
                             f"{', '.join(OPS)}.")

    def to_chrome(self, path):
        """Write the run in the Chrome trace event format, for https://ui.perfetto.dev or
        chrome://tracing (see distlab.chrome_trace); returns the path."""
        from .chrome_trace import to_chrome
        return to_chrome(self, path)

    save = to_chrome

    def __repr__(self):
        kind = f"emulated on {self.emulated.name}" if self.emulated is not None else "measured"
        return (f"<Trace of {self.world_size} ranks, {len(self.comm())} communication calls, "
                f"{kind}>")


def _union(intervals):
    """Total length covered by possibly overlapping intervals."""
    total, reach = 0.0, None
    for a, b in sorted(intervals):
        if reach is None or a > reach:
            total += b - a
            reach = b
        elif b > reach:
            total += b - reach
            reach = b
    return total


def _merged(intervals):
    out = []
    for a, b in sorted(intervals):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return out


def _intersection(xs, ys):
    """Total length covered by both sets of intervals (each set may overlap itself)."""
    xs, ys, total, i, j = _merged(xs), _merged(ys), 0.0, 0, 0
    while i < len(xs) and j < len(ys):
        total += max(0.0, min(xs[i][1], ys[j][1]) - max(xs[i][0], ys[j][0]))
        if xs[i][1] < ys[j][1]:
            i += 1
        else:
            j += 1
    return total


def _unit(seconds):
    if seconds >= 1:
        return "s", 1.0
    if seconds >= 1e-3:
        return "ms", 1e3
    return "µs", 1e6
