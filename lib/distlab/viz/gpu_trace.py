"""One step of a real GPU job's profiler trace, read for overlap, exposed communication and gaps.

    step = read_step("tests/data/hta_resnet50_ddp", "ProfilerStep#5")
    annotated_step(step)

The step is the GPU side of a torch.profiler step: from the first kernel its forward launched to
the last its optimizer launched — the `gpu_user_annotation` ranges tagged with the step
(tools/extract_gpu_trace.py writes them), or in an untouched trace the kernels each CPU range
launched (distlab.profiler_trace.steps). The numbers use
Holistic Trace Analysis' definitions, as `Trace.overlap` does, inside that window: busy is any
kernel or copy (Memcpy/Memset), idle the rest; compute is every kernel but NCCL's and the copies;
non-compute is busy time without compute (HTA's temporal breakdown); overlap is the part of the
NCCL kernels' time that compute ran beside (HTA's get_comm_comp_overlap).
tests/test_gpu_trace.py holds them against HTA's own (`hta_steps`), step by step.
"""
import matplotlib.pyplot as plt
from matplotlib.patches import Patch

from ..profiler_trace import _files, _load, _read_rank, _subtract, _t0
from ..profiler_trace.steps import projected_phases
from ..trace import Trace, _intersection, _merged, _union
from .trace import COMM, COMPUTE, WAIT

PHASE_COLOURS = {"## forward ##": "#DCE6F2", "## backward ##": "#E8DCF2", "## optimizer ##": "#DFF2DC"}
IDLE = "#BBBBBB"
ROUNDING = "HTA_DISABLE_NS_ROUNDING"


def read_step(path, step):
    """The step's phases, kernels and NCCL calls (seconds from the trace's start), and its numbers."""
    files = _files(path)
    # On the file's own clock: baseTimeNanoseconds + ts is ~1.7e15 µs, where a float keeps only
    # 0.25 µs (a tenth of a short kernel); ts alone keeps the file's nanoseconds.
    doc = dict(_load(files[0]), baseTimeNanoseconds=0)
    origin = _t0(doc)
    tagged = [(e["name"], e["ts"], e["ts"] + e["dur"]) for e in doc["traceEvents"]
              if e.get("cat") == "gpu_user_annotation" and isinstance(e.get("args"), dict)
              and e["args"].get("step") == step]
    if not tagged:          # an untouched trace: project its CPU ranges onto the GPU ourselves
        tagged = [(p["name"], p["ts"], p["ts"] + p["dur"]) for p in projected_phases(doc)
                  if p["step"] == step]
    phases = [(name, (a - origin) / 1e6, (b - origin) / 1e6) for name, a, b in tagged]
    if not phases:
        steps = sorted({str(e.get("name")) for e in doc["traceEvents"]
                        if str(e.get("name", "")).startswith("ProfilerStep")})
        raise ValueError(f"{files[0]} has no GPU ranges for {step!r}: its steps are "
                         f"{', '.join(steps) or 'none (profile with schedule= and prof.step())'}.")
    lo, hi = min(a for _, a, _ in phases), max(b for _, _, b in phases)
    trace = Trace([_read_rank(doc, 0, origin)])

    def inside(xs):
        return [(max(a, lo), min(b, hi)) for a, b in xs if b > lo and a < hi]
    compute = inside((s["start"], s["end"]) for s in trace.compute(0))
    calls = [e for e in trace.comm(0) if lo <= e["start"] < hi]
    comm = inside((e["start"], e["end"]) for e in calls)
    # Memcpy/Memset keep the GPU busy (HTA's idle and Trace.overlap's), though neither compute
    # nor communication: leaving them out billed step 5's 0.8 ms of copies as idle.
    copies = inside(tuple(m) for m in trace._ranks[0]["memory"])
    busy = _union(compute + comm + copies)
    return dict(step=step, window=(lo, hi), phases=phases, compute=compute, calls=calls,
                copies=copies, exposed_intervals=_minus(comm, compute),
                gaps=_minus([(lo, hi)], compute + comm + copies),
                span=hi - lo, compute_busy=_union(compute), comm_busy=_union(comm),
                overlapped=_intersection(comm, compute), idle=(hi - lo) - busy,
                non_compute=busy - _union(compute),
                device=(doc.get("deviceProperties") or [{}])[0].get("name"),
                nccl=(doc.get("distributedInfo") or {}).get("nccl_version"))


def hta_steps(path):
    """Holistic Trace Analysis' own numbers for each step of the trace at `path`, in seconds:
    {"ProfilerStep#N": its temporal breakdown (`span` from the step's first kernel to its last,
    `idle`, `compute`, `non_compute`), its communication/computation `overlap_pctg` (rounded to
    0.01 as HTA rounds it) and its idle-time breakdown per CUDA stream, `idle_by_stream`:
    {stream: {host_wait, kernel_wait, other}}}.

    HTA puts a kernel in the step whose ProfilerStep range its launching runtime call started in
    (why tools/extract_gpu_trace.py keeps those calls); its analyses run as they are, on one
    step's events at a time. It reads the timestamps to the nanosecond (HTA_DISABLE_NS_ROUNDING=1):
    by default it rounds each event inward to whole µs, which takes 2 % off this trace's compute.
    Needs the [hta] extra (`make test` installs it; `pip install -e '.[hta]'`)."""
    import copy
    import logging
    import os
    import warnings

    from hta.trace_analysis import TraceAnalysis
    file = _files(path)[0].resolve()
    log, before = logging.getLogger("hta"), os.environ.get(ROUNDING)
    level = log.level
    log.setLevel(logging.ERROR)           # its parse timings would print in the notebook
    os.environ[ROUNDING] = "1"
    out = {}
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")   # pandas' deprecations inside HTA
            analysis = TraceAnalysis(trace_files={0: str(file)}, trace_dir=str(file.parent),
                                     include_last_profiler_step=True)
            whole, trace = analysis.t.get_trace(0), analysis.t
            for number in analysis.t.get_iterations(0):
                analysis.t = copy.copy(trace)
                analysis.t.traces = {0: whole[whole["iteration"].eq(number)]}
                temporal = analysis.get_temporal_breakdown(visualize=False).iloc[0]
                overlap = analysis.get_comm_comp_overlap(visualize=False).iloc[0]
                idle, _ = analysis.get_idle_time_breakdown(visualize=False)
                streams = {}
                for row in idle.itertuples():
                    waits = streams.setdefault(int(row.stream),
                                               dict(host_wait=0.0, kernel_wait=0.0, other=0.0))
                    waits[row.idle_category] = float(row.idle_time) / 1e6
                out[f"ProfilerStep#{number}"] = dict(
                    span=float(temporal["kernel_time(us)"]) / 1e6,
                    idle=float(temporal["idle_time(us)"]) / 1e6,
                    compute=float(temporal["compute_time(us)"]) / 1e6,
                    non_compute=float(temporal["non_compute_time(us)"]) / 1e6,
                    overlap_pctg=float(overlap["comp_comm_overlap_pctg"]), idle_by_stream=streams)
    finally:
        log.setLevel(level)
        if before is None:
            del os.environ[ROUNDING]
        else:
            os.environ[ROUNDING] = before
    return out


def _minus(xs, ys):
    """The parts of intervals xs that no interval of ys covers."""
    return _subtract(_merged(xs), _merged(ys))


def annotated_step(step, zoom=None):
    """Two panels: the whole step, then `zoom` (default: the span of its all-reduces), each with
    the phases, the compute stream, the NCCL stream (exposed time in red) and the GPU's idle gaps."""
    lo, hi = step["window"]
    if zoom is None:
        reduces = [e for e in step["calls"] if e["op"] == "all_reduce"]
        zoom = (min(e["start"] for e in reduces) - 1e-3, max(e["end"] for e in reduces) + 1e-3)
    fig, axes = plt.subplots(2, 1, figsize=(11, 5.6))
    for ax, (a, b), labels in ((axes[0], (lo, hi), False), (axes[1], zoom, True)):
        _panel(ax, step, a, b, labels)
    axes[0].set_title(f"one DDP step of ResNet-50 on 2 × {step['device']} (rank 0; NCCL {step['nccl']})"
                      " — a real torch.profiler trace", fontsize=10)
    axes[0].axvspan((zoom[0] - lo) * 1e3, (zoom[1] - lo) * 1e3, color="black", alpha=0.06, lw=0)
    axes[1].set_title("zoom: the backward's gradient buckets", fontsize=10)
    handles = [Patch(color=COMPUTE, label="compute kernels"), Patch(color=COMM, label="NCCL kernel, hidden by compute"),
               Patch(color=WAIT, label="NCCL kernel, exposed (nothing else ran)"),
               Patch(color=IDLE, label="GPU idle: no kernel at all")]
    handles += [Patch(color=c, label=n.strip("# ")) for n, c in PHASE_COLOURS.items()]
    fig.legend(handles=handles, loc="lower center", ncol=4, fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, 0.09, 1, 1))
    return fig


def _panel(ax, step, a, b, labels):
    lo = step["window"][0]

    def bars(y, xs, colour, h=0.6):
        xs = [(max(s, a), min(e, b)) for s, e in xs if e > a and s < b]
        ax.broken_barh([((s - lo) * 1e3, (e - s) * 1e3) for s, e in xs], (y - h / 2, h),
                       color=colour, lw=0)
    for name, s, e in step["phases"]:
        if e > a and s < b:
            ax.axvspan((max(s, a) - lo) * 1e3, (min(e, b) - lo) * 1e3,
                        color=PHASE_COLOURS.get(name, "#EEEEEE"), lw=0)
    bars(0, step["compute"], COMPUTE)
    bars(1, [(e["start"], e["end"]) for e in step["calls"]], COMM)
    bars(1, step["exposed_intervals"], WAIT)
    bars(2, step["gaps"], IDLE)
    if labels:
        for e in step["calls"]:
            if e["op"] == "all_reduce" and a <= e["start"] < b:
                ax.text((e["start"] - lo) * 1e3, 1.45, f"{e['bytes'] / 1e6:.1f} MB", fontsize=8)
    ax.set_yticks([0, 1, 2], ["compute\nstream", "NCCL\nstream", "GPU idle"], fontsize=8)
    ax.set_ylim(2.6, -0.6)
    ax.set_xlim((a - lo) * 1e3, (b - lo) * 1e3)
    ax.set_xlabel("ms from the step's first kernel", fontsize=8)
    ax.tick_params(labelsize=8)
