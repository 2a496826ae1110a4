"""Opening a profiler trace: the files of a folder or list, their JSON, and the header facts
(rank, clock base, the default group) every event is read against."""
import gzip
import json
import math
from pathlib import Path


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
    except (OSError, EOFError, ValueError) as e:
        reason = (str(e).splitlines() or [type(e).__name__])[0].rstrip(".")
        raise ValueError(f"{path} is not a JSON trace ({reason}).") from None
    if isinstance(doc, list):                     # the format's array form
        doc = dict(traceEvents=doc)
    if not isinstance(doc, dict) or not isinstance(doc.get("traceEvents"), list):
        raise ValueError(f"{path} is not a Chrome/Kineto trace (no traceEvents list).")
    if not isinstance(doc.get("distributedInfo", {}), (dict, type(None))):
        raise ValueError(f"{path} has a distributedInfo that is not a JSON object: pass a trace "
                         f"torch.profiler wrote.")
    # Events are read field by field below: an entry of another shape is not an event.
    doc["traceEvents"] = [dict(e, args=e["args"] if isinstance(e.get("args"), dict) else {})
                          for e in doc["traceEvents"] if isinstance(e, dict)]
    doc["_path"] = str(path)
    return doc


def _rank_of(doc, index):
    info = doc.get("distributedInfo") or {}
    rank = info.get("rank", index) if isinstance(info, dict) else index
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 0:
        raise ValueError(f"{doc['_path']} names rank {rank!r} in its distributedInfo; a rank is a "
                         f"whole number >= 0 (is this file a torch.profiler trace?).")
    return rank


def _base_us(doc):
    # Kineto: an event's absolute time is baseTimeNanoseconds + ts (in µs).
    base = doc.get("baseTimeNanoseconds", 0)
    if isinstance(base, bool) or not isinstance(base, (int, float)) or not math.isfinite(base):
        raise ValueError(f"{doc.get('_path', 'the trace')} has baseTimeNanoseconds {base!r}; "
                         f"torch.profiler writes a whole number of nanoseconds there.")
    return base / 1e3


def _finite(x):
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _slices(doc):
    return [e for e in doc["traceEvents"]
            if e.get("ph") == "X" and _finite(e.get("ts")) and isinstance(e.get("name", ""), str)
            and (_finite(e.get("dur")) and e["dur"] >= 0 if "dur" in e else True)
            and isinstance(e.get("pid"), int)]       # Kineto's own "Spans" rows are not the job's


def _t0(doc):
    xs = _slices(doc)
    return min((e["ts"] for e in xs), default=0.0) + _base_us(doc)


def _default_group(doc):
    info = doc.get("distributedInfo") or {}
    configs = info.get("pg_config") or []
    configs = [pg for pg in configs if isinstance(pg, dict)] if isinstance(configs, list) else []
    for pg in configs:
        if pg.get("pg_desc") == "default_pg" or len(configs) == 1:
            ranks, size = pg.get("ranks"), pg.get("pg_size", 0)
            if isinstance(ranks, list) and ranks and all(_whole(r) for r in ranks):
                return tuple(ranks)
            return tuple(range(size)) if _whole(size) and size > 0 else None
    world = info.get("world_size")
    return tuple(range(world)) if _whole(world) and world > 0 else None


def _whole(x):
    return isinstance(x, int) and not isinstance(x, bool)
