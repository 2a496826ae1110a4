"""Reading a distlab export (`to_chrome`) back into a Trace."""
import json

from ..chrome_trace import US


def from_chrome(path):
    """The Trace a distlab export (`to_chrome`) holds: its events, spans and clocks, in seconds."""
    try:
        with open(path, encoding="utf-8") as f:
            doc = json.load(f)
    except (OSError, ValueError) as e:
        reason = (str(e).splitlines() or [type(e).__name__])[0].rstrip(".")
        raise ValueError(f"{path} is not a JSON trace ({reason}).") from None
    other = doc.get("otherData") if isinstance(doc, dict) else None
    info = other.get("distlab") if isinstance(other, dict) else None
    if info is None:
        raise ValueError(f"{path} was not written by distlab's to_chrome (no otherData.distlab); "
                         f"for a torch.profiler trace use distlab.profiler_trace.from_profiler.")
    try:
        return _read(doc, info)
    except (KeyError, TypeError, AttributeError, IndexError, ValueError, OverflowError) as e:
        raise ValueError(f"{path} is not a complete distlab export (a field missing or of an "
                         f"unexpected shape: {type(e).__name__} {e}); write it again with "
                         f"to_chrome.") from None


def _read(doc, info):
    from ..trace import Trace
    n = info["world_size"]
    per_rank = [dict(rank=r, events=[], spans=[], memory=[], end=info["rank_ends_us"][r] / US)
                for r in range(n)]
    for ev in doc["traceEvents"]:
        if ev.get("ph") != "X":
            continue
        if not isinstance(ev["pid"], int) or not 0 <= ev["pid"] < n:
            raise IndexError(f"pid {ev['pid']!r} is no rank of {n}")
        r, a = per_rank[ev["pid"]], ev["args"]
        start, end = ev["ts"] / US, (ev["ts"] + ev["dur"]) / US
        if ev["cat"] == "copy":
            r["memory"].append((start, end))
        elif ev["cat"] == "compute":
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
        from ..emulate import PRESETS
        cluster = next((c for c in PRESETS.values() if c.name == info.get("cluster")), None)
        if cluster is None:         # a Cluster of the learner's own: its name is all we have
            source = f"modeled on {info.get('cluster')}"
    trace = Trace(per_rank, cluster)
    trace.source = source
    return trace
