"""Make the small real torch.profiler trace the course ships in tests/data/profiler_ddp/.

    .venv/bin/python tools/make_profiler_trace.py [--out tests/data/profiler_ddp]

Two ranks (gloo, this machine's CPU) train the course's MLP with torch's DistributedDataParallel,
in small buckets so that several gradient all-reduces run while backward is still computing.
torch.profiler records one steady step per rank (schedule: one step skipped, one warm-up, one
recorded) and writes it with `tensorboard_trace_handler`, the way a real job does; each rank's
file is then renamed rank<r>.pt.trace.json (the handler adds a host name and a time stamp).

Only one thing is changed in the files torch wrote: `traceName`, an absolute path on the machine
that made them, becomes the file's own name. Every event is kept as torch wrote it. The two files
together stay under 300 KB (the recorded step is one small MLP step); the script says their sizes.
"""
import argparse
import json
import os
from pathlib import Path

import distlab
from distlab import debug

SIZES = (16, 256, 256, 256, 256, 4)  # five layers: a bucket per 256x256 layer, four in all
BUCKET_MB = 0.25                    # 64k float32 gradients per bucket: one hidden layer each


def profiled_ddp(rank, world_size, out):
    from torch.profiler import ProfilerActivity, profile, schedule, tensorboard_trace_handler
    # The chapter's annotated step (forward / backward / optimizer ranges), already settled.
    step = debug.annotated_ddp_step(rank, SIZES, batch=64, bucket_cap_mb=BUCKET_MB)
    handler = tensorboard_trace_handler(out, worker_name=f"rank{rank}")
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True,
                 schedule=schedule(wait=1, warmup=1, active=1), on_trace_ready=handler) as prof:
        for _ in range(3):
            step()
            prof.step()


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(Path(__file__).resolve().parent.parent
                                             / "tests" / "data" / "profiler_ddp"))
    out = Path(parser.parse_args().out)
    out.mkdir(parents=True, exist_ok=True)
    for old in out.glob("rank*.json"):
        old.unlink()
    distlab.run(profiled_ddp, 2, str(out), timeout=300)
    for rank in range(2):
        written = sorted(out.glob(f"rank{rank}.*.pt.trace.json"))
        if len(written) != 1:
            raise SystemExit(f"expected one trace of rank {rank} in {out}, found {written}")
        final = out / f"rank{rank}.pt.trace.json"
        with open(written[0]) as f:
            doc = json.load(f)
        doc["traceName"] = final.name          # not the absolute path of this machine
        with open(final, "w") as f:
            json.dump(doc, f, separators=(",", ":"))
        os.unlink(written[0])
        print(f"{final}: {final.stat().st_size / 1e3:.0f} KB, "
              f"{len(doc['traceEvents'])} events")


if __name__ == "__main__":
    main()
