"""Cut the real GPU trace chapter 11 reads out of Holistic Trace Analysis' test data.

    .venv/bin/python tools/extract_gpu_trace.py HTA_CHECKOUT [--out tests/data/hta_resnet50_ddp]

The source is HTA's `tests/data/nccl_parser_config/nccl_data.json.gz` (facebookresearch/
HolisticTraceAnalysis, MIT licence): rank 0 of a two-GPU DistributedDataParallel job, torchvision's
ResNet-50 (25,557,032 parameters, the sum of its all-reduced buckets) on NVIDIA A100 SXM4 40 GB
("A100-PG509-200") with NCCL 2.17.1, three profiled steps, written by torch.profiler (Kineto).

What is kept, unchanged: every GPU event (kernels, copies, sets) with its stream, correlation
and, for NCCL kernels, the collective's name, element count, dtype and group; the CPU-side
ProfilerStep and `## forward/backward/optimizer ##` ranges; the file's header (distributedInfo,
one device's properties, baseTimeNanoseconds). What is dropped: CPU operators, runtime calls and
flows (90 % of the file; the chapter reads the GPU side). What is added: one `gpu_user_annotation`
per phase and step, spanning the kernels its CPU range launched (matched by correlation id to the
launching runtime call) — the projection Kineto itself writes for record_function ranges.
"""
import argparse
import gzip
import json
from pathlib import Path

SOURCE = "tests/data/nccl_parser_config/nccl_data.json.gz"
GPU = ("kernel", "gpu_memcpy", "gpu_memset")
PHASES = ("## forward ##", "## backward ##", "## optimizer ##")
KEEP_ARGS = ("stream", "correlation", "device", "Collective name", "In msg nelems",
             "Out msg nelems", "Group size", "dtype", "Process Group Ranks", "bytes")


def extract(doc):
    events = doc["traceEvents"]
    gpu = [e for e in events if e.get("cat") in GPU and e.get("ph") == "X"]
    for e in gpu:
        e["args"] = {k: v for k, v in e.get("args", {}).items() if k in KEEP_ARGS}
    launch = {e["args"]["correlation"]: e["ts"] for e in events
              if e.get("cat") == "cuda_runtime" and "correlation" in e.get("args", {})}
    ranges = [e for e in events if e.get("cat") == "user_annotation"
              and (e["name"].startswith("ProfilerStep") or e["name"] in PHASES)]
    # A phase name appears twice per step (main and autograd threads): keep the longest.
    longest = {}
    for e in ranges:
        step = next(s["name"] for s in ranges if s["name"].startswith("ProfilerStep")
                    and s["ts"] <= e["ts"] < s["ts"] + s["dur"])
        key = (step, e["name"])
        if key not in longest or e["dur"] > longest[key]["dur"]:
            longest[key] = e
    cpu = sorted(longest.values(), key=lambda e: e["ts"])
    projected = []
    for (step, name), r in sorted(longest.items(), key=lambda kv: kv[1]["ts"]):
        if name not in PHASES:
            continue
        mine = [k for k in gpu if r["ts"] <= launch.get(k["args"].get("correlation"), -1)
                < r["ts"] + r["dur"]]
        if mine:
            start = min(k["ts"] for k in mine)
            end = max(k["ts"] + k["dur"] for k in mine)
            projected.append(dict(ph="X", cat="gpu_user_annotation", name=name, pid=mine[0]["pid"],
                                  tid=mine[0]["tid"], ts=start, dur=end - start,
                                  args=dict(step=step, kernels=len(mine))))
    for e in cpu:
        e["args"] = {}
    head = {k: doc[k] for k in ("schemaVersion", "distributedInfo", "baseTimeNanoseconds",
                                "displayTimeUnit") if k in doc}
    head["deviceProperties"] = doc.get("deviceProperties", [])[:1]
    head["traceName"] = "rank0.pt.trace.json"
    return dict(head, traceEvents=cpu + projected + sorted(gpu, key=lambda e: e["ts"]))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("hta", help="a checkout of facebookresearch/HolisticTraceAnalysis")
    parser.add_argument("--out", default="tests/data/hta_resnet50_ddp")
    args = parser.parse_args()
    with gzip.open(Path(args.hta) / SOURCE, "rt") as f:
        doc = json.load(f)
    out = Path(args.out) / "rank0.pt.trace.json.gz"
    out.parent.mkdir(parents=True, exist_ok=True)
    with gzip.open(out, "wt") as f:
        json.dump(extract(doc), f, separators=(",", ":"))
    print(f"{out}: {out.stat().st_size / 1e3:.0f} kB")


if __name__ == "__main__":
    main()
