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
launching runtime call: distlab.profiler_trace.steps, which `viz.gpu_trace.read_step` also uses on
an untouched trace).
"""
import argparse
import gzip
import json
from pathlib import Path

from distlab.profiler_trace.steps import GPU, projected_phases, step_ranges

SOURCE = "tests/data/nccl_parser_config/nccl_data.json.gz"
KEEP_ARGS = ("stream", "correlation", "device", "Collective name", "In msg nelems",
             "Out msg nelems", "Group size", "dtype", "Process Group Ranks", "bytes")


def extract(doc):
    projected = [dict(ph="X", cat="gpu_user_annotation", name=p["name"], pid=p["pid"],
                      tid=p["tid"], ts=p["ts"], dur=p["dur"],
                      args=dict(step=p["step"], kernels=p["kernels"]))
                 for p in projected_phases(doc)]        # before the copies' args are cut
    cpu = step_ranges(doc)
    gpu = [e for e in doc["traceEvents"] if e.get("cat") in GPU and e.get("ph") == "X"]
    for e in gpu:
        e["args"] = {k: v for k, v in e.get("args", {}).items() if k in KEEP_ARGS}
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
