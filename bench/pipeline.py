"""Measured pipeline bubble vs the theory (p - 1) / (m + p - 1), for GPipe and 1F1B.

    .venv/bin/python bench/pipeline.py

Each micro-batch has the same size, so a step with m micro-batches does m times the work; the
model (8 Linear layers of width 256) is cut into p stages. The bubble is measured from the
timestamps every rank records: 1 - (time spent computing) / (p x the step's span). Run the same
on p GPUs to see the theory; on a laptop with fewer cores than ranks, ranks that compute at the
same time share a core, so busy time inflates and the measured bubble reads LOW (and send/recv
through the loopback adds gaps a GPU link would not).
"""
import os
import statistics

import torch

import distlab
from distlab import pipeline_parallel as pp
from distlab import pipeline_schedules as ps
from distlab.models import make_mlp

SIZES = (256,) * 9
MB = 64          # samples per micro-batch
STEPS = 4        # the first step is a warm-up and is not counted


def measure(rank, world_size, name, m):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(MB * m, SIZES[0], generator=g)
    y = torch.randn(MB * m, SIZES[-1], generator=g)
    out = pp.train(rank, world_size, lambda p, mm: ps.make_schedule(name, p, mm),
                   make_mlp(SIZES, seed=0), [(x, y)] * STEPS, m, (SIZES[0],))
    return [step["timeline"] for step in out[1:]]


def main():
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    print(f"{cores} cores, torch {torch.__version__}, backend gloo; bubble = idle share of "
          f"p x span (median of {STEPS - 1} steps)\n")
    print(f"{'schedule':>8} {'p':>2} {'m':>2} {'theory':>7} {'measured':>9} {'meas/theory':>11}")
    for name in ("GPipe", "1F1B"):
        for p in (2, 4):
            for m in (1, 4, 8):
                runs = distlab.run(measure, p, name, m, timeout=300)
                bubbles = [ps.bubble_fraction([e for rank in runs for e in rank[s]])
                           for s in range(STEPS - 1)]
                measured, theory = statistics.median(bubbles), ps.theory_bubble(p, m)
                print(f"{name:>8} {p:>2} {m:>2} {theory:>7.3f} {measured:>9.3f} "
                      f"{measured / theory:>11.2f}", flush=True)


if __name__ == "__main__":
    main()
