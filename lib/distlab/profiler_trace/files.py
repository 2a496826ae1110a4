"""Opening a profiler trace: the files of a folder or list, their JSON, and the header facts
(rank, clock base, the default group) every event is read against."""
import gzip
import json
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
    rank = info.get("rank", index) if isinstance(info, dict) else index
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 0:
        raise ValueError(f"{doc['_path']} names rank {rank!r} in its distributedInfo; a rank is a "
                         f"whole number >= 0 (is this file a torch.profiler trace?).")
    return rank


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


def _default_group(doc):
    configs = (doc.get("distributedInfo") or {}).get("pg_config") or []
    for pg in configs:
        if pg.get("pg_desc") == "default_pg" or len(configs) == 1:
            return tuple(pg.get("ranks") or range(pg.get("pg_size", 0)))
    world = (doc.get("distributedInfo") or {}).get("world_size")
    return tuple(range(world)) if world else None
