"""From a job's profiler files to the course's Trace, rank by rank."""
from .files import _base_us, _default_group, _files, _load, _rank_of, _slices, _t0
from .gloo import _cpu
from .gpu import GPU_CATS, _gpu


def from_profiler(paths):
    """A distlab Trace from torch.profiler traces: a folder of them, one file, or a list of
    files (one per rank)."""
    from ..trace import Trace
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
