"""Cut the real GPU trace chapter 11 reads out of Holistic Trace Analysis' test data.

    .venv/bin/python tools/extract_gpu_trace.py [SOURCE] [--out tests/data/hta_resnet50_ddp]

The source (default: its copy in tests/data/hta_resnet50_ddp_source; a checkout of HTA works too)
is HTA's `tests/data/nccl_parser_config/nccl_data.json.gz` (facebookresearch/
HolisticTraceAnalysis, MIT licence): rank 0 of a two-GPU DistributedDataParallel job, torchvision's
ResNet-50 (25,557,032 parameters, the sum of its all-reduced buckets) on NVIDIA A100 SXM4 40 GB
("A100-PG509-200") with NCCL 2.17.1, three profiled steps, written by torch.profiler (Kineto).

What is kept, unchanged: every GPU event (kernels, copies, sets) with its stream, correlation
and, for NCCL kernels, the collective's name, element count, dtype and group; the CPU-side
ProfilerStep and `## forward/backward/optimizer ##` ranges; the file's header (distributedInfo,
one device's properties, baseTimeNanoseconds); and the runtime call that launched each GPU event
(cudaLaunchKernel, cudaMemcpyAsync, ...: name, thread, ts, dur, correlation). HTA needs those:
it keeps a kernel only if a CPU event of the same correlation launched it, puts it in the step
that CPU event started in, and calls a gap "host wait" when the launch came after the previous
kernel ended. What is dropped: CPU operators, the runtime calls that launched nothing (stream
and event queries...), flows (most of the file; the chapter reads the GPU side). What is added: one `gpu_user_annotation`
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
COPY = "tests/data/hta_resnet50_ddp_source/nccl_data.json.gz"
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
    launched = {e["args"].get("correlation") for e in gpu}
    launches = [dict(ph="X", cat="cuda_runtime", name=e["name"], pid=e["pid"], tid=e["tid"],
                     ts=e["ts"], dur=e["dur"], args=dict(correlation=e["args"]["correlation"]))
                for e in doc["traceEvents"] if e.get("cat") == "cuda_runtime"
                and (e.get("args") or {}).get("correlation") in launched]
    head = {k: doc[k] for k in ("schemaVersion", "distributedInfo", "baseTimeNanoseconds",
                                "displayTimeUnit") if k in doc}
    head["deviceProperties"] = doc.get("deviceProperties", [])[:1]
    head["traceName"] = "rank0.pt.trace.json"
    return dict(head, traceEvents=cpu + projected + sorted(launches + gpu, key=lambda e: e["ts"]))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("source", nargs="?", default=COPY,
                        help="nccl_data.json.gz, or a checkout of facebookresearch/HolisticTraceAnalysis")
    parser.add_argument("--out", default="tests/data/hta_resnet50_ddp")
    args = parser.parse_args()
    source = Path(args.source)
    with gzip.open(source / SOURCE if source.is_dir() else source, "rt") as f:
        doc = json.load(f)
    out = Path(args.out) / "rank0.pt.trace.json.gz"
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out, "wb") as raw, gzip.GzipFile(fileobj=raw, mode="wb", mtime=0) as z:
        z.write(json.dumps(extract(doc), separators=(",", ":")).encode())   # same bytes each run
    print(f"{out}: {out.stat().st_size / 1e3:.0f} kB")


if __name__ == "__main__":
    main()
