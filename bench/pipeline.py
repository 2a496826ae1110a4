"""Pipeline bubble at real size under emulation against theory: GPipe, 1F1B, interleaved 1F1B, ZB-H1,
ZB-V, DualPipeV and the bidirectional DualPipe (their F-B pairs run one after the other: no overlap
is modeled; DualPipe holds every stage's blocks twice, so it has no closed form here: "—").

    .venv/bin/python bench/pipeline.py            # emulated (deterministic), ~1 minute on 2 cores
    .venv/bin/python bench/pipeline.py --laptop   # also the real run on this machine's cores

Emulated section: p = 4 stages, m = 8 micro-batches of one 4096-token sequence; each stage is
`BLOCKS` Llama-2 7B blocks (distlab.pipeline_parallel.LlamaBlock, bf16) built on the meta device
(shapes, no values), on the calibrated "h100-node" preset (stage boundaries on NVLink) and on
"h100-ib" (one H100 per node: every boundary crosses InfiniBand NDR). Bubble = 1 - busy /
(p x span) from the timeline every rank records on its virtual clock. Beside it: the closed form
((p-1)/(m+p-1), (p-1)/(v m+p-1) interleaved, (p-1)/(3m+p-1) for ZB-H1 with F = I = W), ZB-H1's
closed form with the measured F, I, W ((p-1)(F+I-W) idle per stage), and the simulator with the
measured times and one message per hop. The simulator and the emulator share formulas (action
times, message cost): their agreement checks the code's critical path, not the hardware.

The --laptop section measures the same schedules for real on this machine's cores, with a small
model; with fewer cores than ranks the ranks share cores and the numbers are not a GPU's.
"""
import statistics
import sys

import torch

import distlab
from distlab import pipeline_parallel as pp
from distlab import pipeline_schedules as ps
from distlab.models import make_mlp

P, M, V, TOKENS, BLOCKS = 4, 8, 2, 4096, 2
PRESETS = ("h100-node", "h100-ib")
SCHEDULES = [("GPipe", 1), ("1F1B", 1), ("interleaved 1F1B", V), ("ZB-H1", 1), ("ZB-V", 2),
             ("DualPipeV", 2), ("DualPipe", 1)]


def mean_time(timeline, kind):
    times = [e["end"] - e["start"] for e in timeline
             if e["kind"] == kind and e["stage"] > 0]
    return statistics.mean(times) if times else 0.0


def emulated():
    activation = TOKENS * pp.LLAMA2_7B["hidden"] * 2
    print(f"emulated: p={P}, m={M}, {BLOCKS} Llama-2 7B blocks per stage, micro-batches of one "
          f"{TOKENS}-token sequence, bf16, meta tensors\n")
    print(f"{'preset':>10} {'schedule':>17} {'F ms':>6} {'B ms':>6} {'closed':>7} "
          f"{'closed (meas.)':>14} {'sim + msgs':>10} {'emulated':>9}")
    for preset in PRESETS:
        message = pp.message_seconds(preset, activation)
        for name, v in SCHEDULES:
            runs = distlab.run(pp.real_size_step, P, name, M, BLOCKS, TOKENS, v, emulate=preset,
                               timeout=600)
            timeline = [e for rank in runs for e in rank]
            t_f, t_b, t_i, t_w = (v * mean_time(timeline, k) for k in "FBIW")   # per stage
            schedule = ps.dualpipe(P, M) if name == "DualPipe" else \
                ps.V_SCHEDULES[name](P, M) if name in ps.V_SCHEDULES else \
                ps.interleaved_1f1b(P, M, v) if v > 1 else ps.make_schedule(name, P, M)
            closed = None if name == "DualPipe" else \
                ps.zb_v_bubble(P, M) if name == "DualPipeV" else ps.theory(name, P, M, v)
            if name == "ZB-H1":
                t_b = t_i + t_w
                measured_form = ps.zb_h1_bubble(P, M, t_f, t_i, t_w)
            elif name in ps.V_SCHEDULES or name == "DualPipe":   # no closed form at unequal F, I, W
                t_b = t_i + t_w
                measured_form = closed
            else:
                measured_form = closed
            model = ps.bubble_fraction(ps.simulate(schedule, M, t_f, t_b, t_w or None,
                                                   comm=message))
            shown = [("—" if c is None else f"{c:.3f}") for c in (closed, measured_form)]
            print(f"{preset:>10} {name:>17} {t_f * 1e3:>6.2f} {t_b * 1e3:>6.2f} {shown[0]:>7} "
                  f"{shown[1]:>14} {model:>10.3f} {ps.bubble_fraction(timeline):>9.3f}",
                  flush=True)
        print(f"{'':>10} one message between stages: {message * 1e6:.0f} µs\n")


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
