"""Reading a distlab export (`to_chrome`) back into a Trace."""
import json

from ..chrome_trace import US


def from_chrome(path):
    """The Trace a distlab export (`to_chrome`) holds: its events, spans and clocks, in seconds."""
    from ..trace import Trace
    with open(path) as f:
        doc = json.load(f)
    info = doc.get("otherData", {}).get("distlab") if isinstance(doc, dict) else None
    if info is None:
        raise ValueError(f"{path} was not written by distlab's to_chrome (no otherData.distlab); "
                         f"for a torch.profiler trace use distlab.profiler_trace.from_profiler.")
    n = info["world_size"]
    per_rank = [dict(rank=r, events=[], spans=[], memory=[], end=info["rank_ends_us"][r] / US)
                for r in range(n)]
    for ev in doc["traceEvents"]:
        if ev.get("ph") != "X":
            continue
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
