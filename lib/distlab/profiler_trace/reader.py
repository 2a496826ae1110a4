"""From a job's profiler files to the course's Trace, rank by rank."""
from .files import _base_us, _files, _load, _rank_of, _slices, _t0
from .gloo import _cpu
from .groups import Groups
from .gpu import GPU_CATS, _gpu


# More ranks than any job runs (the largest reported are ~100k GPUs): a number past it is a
# damaged distributedInfo, and a Trace of that many empty ranks would take the memory with it.
MAX_RANKS = 1 << 17


def from_profiler(paths):
    """A distlab Trace from torch.profiler traces: a folder of them, one file, or a list of
    files (one per rank). The ranks are the files' own (distributedInfo.rank), so one rank's
    file of a big job reads alone: the Trace has the job's world size, and the ranks without a
    file are empty (`trace.ranks_read` lists those with one)."""
    from ..trace import Trace
    files = _files(paths)
    docs = [_load(f) for f in files]
    ranks = [_rank_of(doc, i) for i, doc in enumerate(docs)]
    seen = {}
    for f, rank in zip(files, ranks):
        if rank in seen:
            raise ValueError(f"{seen[rank].name} and {f.name} are both rank {rank}: "
                             f"from_profiler needs one file per rank (pass each rank's file once).")
        seen[rank] = f
    world = max([max(ranks) + 1] + [_world_of(doc) for doc in docs])
    if world > MAX_RANKS:
        raise ValueError(f"the distributedInfo of {files[0].name} names a job of {world:,} ranks, "
                         f"more than the {MAX_RANKS:,} this reader takes: is it damaged? Pass the "
                         f"files torch.profiler wrote.")
    origin = min(_t0(doc) for doc in docs)
    per_rank = [dict(rank=r, events=[], spans=[], memory=[], gpu=False, end=0.0)
                for r in range(world)]
    for doc, rank in zip(docs, ranks):
        try:
            per_rank[rank] = _read_rank(doc, rank, origin)
        except (KeyError, TypeError, AttributeError, IndexError, OverflowError) as e:
            # The last guard: a field of a shape torch never writes, met deep in the reading.
            raise ValueError(f"{doc['_path']} does not read as a torch.profiler trace (a field "
                             f"of an unexpected shape: {type(e).__name__} {e}); pass the file "
                             f"torch wrote (export_chrome_trace or tensorboard_trace_handler)."
                             ) from None
    trace = Trace(per_rank)
    trace.ranks_read = sorted(ranks)
    gpu = any(r["gpu"] for r in per_rank)
    trace.source = "torch.profiler trace" + (" (GPU kernels)" if gpu else " (CPU, gloo)")
    if len(ranks) < world:
        trace.source += f", the files of {len(ranks)} of its {world} ranks"
    return trace


def _world_of(doc):
    world = (doc.get("distributedInfo") or {}).get("world_size")
    return world if isinstance(world, int) and not isinstance(world, bool) and world > 0 else 0


def _read_rank(doc, rank, origin):
    base = _base_us(doc)

    def sec(ts):
        return (ts + base - origin) / 1e6

    xs = _slices(doc)
    groups = Groups(doc, rank)
    gpu = [e for e in xs if e.get("cat") in GPU_CATS]
    if gpu:
        events, spans, memory = _gpu(gpu, groups, sec)
    else:
        events, spans, memory = _cpu(doc, xs, groups, sec)
    ends = [e["end"] for e in events if e["end"] is not None] + [s["end"] for s in spans]
    ends += [b for _, b in memory]
    return dict(rank=rank, events=events, spans=spans, memory=memory, gpu=bool(gpu),
                end=max(ends, default=0.0))
