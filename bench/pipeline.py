"""Pipeline bubble measured under emulation against theory: GPipe, 1F1B, interleaved 1F1B, ZB-H1.

    .venv/bin/python bench/pipeline.py            # emulated (deterministic), ~2 minutes on 2 cores
    .venv/bin/python bench/pipeline.py --laptop   # also the real run on this machine's cores

Emulated section: p = 4 stages, m = 8 micro-batches on the "a100-nvlink" preset. The bubble
formulas assume that compute is all there is: a message between stages (α = 3 µs on NVLink plus
bytes / 300 GB/s) must be small against a stage's forward. So each stage holds two 4096-wide
Linear layers (64 MiB of weights each) and micro-batches are 8 samples: on an A100 a stage's
forward is memory-bound at ~68 µs (reading its weights), its backward ~4.6x that, and one message
~3.4 µs (5% of a forward). The first stage's input requires grad, so its backward does the same
work as the others' (the formulas assume equal stages). Bubble = 1 - busy / (p x span) from the
timeline every rank records on its virtual clock. Theory: (p-1)/(m+p-1) for GPipe and 1F1B,
(p-1)/(v m+p-1) for interleaved (v = 2); for ZB-H1 the simulator's bubble with the measured F, I
and W times and free messages (the closed form (p-1)/(3m+p-1) needs F = I = W; here W, which
writes and accumulates 64 MiB of weight gradient, is about twice F).

The --laptop section measures the same schedules for real on this machine's cores, with a small
model; with fewer cores than ranks the ranks share cores and the numbers are not a GPU's.
"""
import statistics
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

import distlab
from distlab import pipeline_parallel as pp
from distlab import pipeline_schedules as ps
from distlab.emulate import PRESETS, comm_seconds
from distlab.models import make_mlp

P, M, V = 4, 8, 2
WIDTH, LAYERS_PER_STAGE, MB = 4096, 2, 8
PRESET = "a100-nvlink"
SCHEDULES = [("GPipe", 1), ("1F1B", 1), ("interleaved 1F1B", V), ("ZB-H1", 1)]


def emulated_step(rank, world_size, name, v):
    """One step; this rank builds only its own chunks (the others' are shape-keeping stand-ins)."""
    n = world_size * v

    def piece(i):
        torch.manual_seed(i)
        layers = []
        for _ in range(LAYERS_PER_STAGE // v or 1):
            layers += [nn.Linear(WIDTH, WIDTH), nn.GELU()]
        return nn.Sequential(*layers)

    parts = [piece(i) if i % world_size == rank else nn.Identity() for i in range(n)]
    stage = pp.PipelineStage(parts, rank, world_size, (WIDTH,))
    g = torch.Generator().manual_seed(0)
    x = torch.randn(MB * M, WIDTH, generator=g).requires_grad_()   # equal work on stage 0
    y = torch.randn(MB * M, WIDTH, generator=g)
    schedule = ps.interleaved_1f1b(world_size, M, v) if v > 1 else ps.make_schedule(name,
                                                                                    world_size, M)
    stage.step(schedule[rank], x, y, M, F.mse_loss)
    return stage.timeline


def mean_time(timeline, kind):
    times = [e["end"] - e["start"] for e in timeline
             if e["kind"] == kind and e["stage"] > 0]
    return statistics.mean(times) if times else 0.0


def emulated():
    cluster = PRESETS[PRESET]
    message = comm_seconds("send", MB * WIDTH * 4, 2, cluster.intra)
    print(f"emulated: p={P}, m={M}, two {WIDTH}-wide Linear layers per stage, micro-batches of "
          f"{MB}; preset {cluster}; one message between stages: {message * 1e6:.2f} µs\n")
    print(f"{'schedule':>17} {'F µs':>6} {'B µs':>6} {'theory':>7} {'with messages':>14} "
          f"{'measured':>9} {'measured - theory':>18}")
    worst, bubbles = 0.0, {}
    for name, v in SCHEDULES:
        runs = distlab.run(emulated_step, P, name, v, emulate=PRESET, timeout=600)
        timeline = [e for rank in runs for e in rank]
        measured = ps.bubble_fraction(timeline)
        t_f, t_b, t_i, t_w = (v * mean_time(timeline, k) for k in "FBIW")   # per stage
        if name == "ZB-H1":
            t_b = t_i + t_w
        schedule = ps.interleaved_1f1b(P, M, v) if v > 1 else ps.make_schedule(name, P, M)
        model = ps.bubble_fraction(ps.simulate(schedule, M, t_f, t_b, t_w or None, comm=message))
        if name == "ZB-H1":
            # W (weight gradient, written and accumulated: memory-bound) is longer than F here,
            # so the closed form (F = I = W) does not apply: the simulator with the measured
            # F, I, W times and free messages is the theory.
            theory = ps.bubble_fraction(ps.simulate(schedule, M, t_f, t_b, t_w))
        else:
            theory = ps.theory(name, P, M, v)
        bubbles[name] = measured
        worst = max(worst, abs(measured - theory))
        print(f"{name:>17} {t_f * 1e6:>6.1f} {t_b * 1e6:>6.1f} {theory:>7.3f} {model:>14.3f} "
              f"{measured:>9.3f} {100 * (measured - theory):>+11.1f} points", flush=True)
    print(f"\nZB-H1 below 1F1B: {bubbles['ZB-H1'] < bubbles['1F1B']} "
          f"({bubbles['ZB-H1']:.3f} against {bubbles['1F1B']:.3f}). 'with messages': the "
          f"simulator with the measured times and one message per hop (it does not model that a "
          f"stage's forward and backward sends share its link).")
    print(f"max |measured - theory| bubble (emulated): {100 * worst:.1f} points")


def measure(rank, world_size, name, m, steps):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64 * m, 256, generator=g)
    y = torch.randn(64 * m, 256, generator=g)
    out = pp.train(rank, world_size, lambda p, mm: ps.make_schedule(name, p, mm),
                   make_mlp((256,) * 9, seed=0), [(x, y)] * steps, m, (256,))
    return [step["timeline"] for step in out[1:]]


def laptop(steps=4):
    print("\nmeasured on this machine (real time; ranks share its cores):")
    print(f"{'schedule':>8} {'p':>2} {'m':>2} {'theory':>7} {'measured':>9}")
    for name in ("GPipe", "1F1B", "ZB-H1"):
        for p, m in ((2, 8), (4, 8)):
            runs = distlab.run(measure, p, name, m, steps, timeout=300)
            measured = statistics.median(
                ps.bubble_fraction([e for rank in runs for e in rank[s]]) for s in range(steps - 1))
            print(f"{name:>8} {p:>2} {m:>2} {ps.theory(name, p, m):>7.3f} {measured:>9.3f}",
                  flush=True)


if __name__ == "__main__":
    if "--laptop" in sys.argv:
        laptop()
        print()
    emulated()
