"""ZeRO-3 against plain data parallelism and FSDP2: per-rank model-state bytes, and step time.

For 2 and 4 ranks, on the same MLP and data:
- bytes of weights + gradients + Adam states each rank holds after a step (measured on the real
  tensors), plain DDP vs our ZeRO-3, and their ratio (the model says 1/N);
- median step time of our ZeRO-3 vs torch's FSDP2 (fully_shard per Linear), and their ratio;
- last, ZeRO-3 with and without prefetch on the emulated a100-ethernet preset (2 ranks), beside
  the cost model (memory.zero3_step_seconds): the step-time ratio off/on.

    python bench/zero.py [--steps 20]
"""
import argparse
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

import distlab
from distlab import models
from distlab.sharding import ZeRO, measure_state_bytes

SIZES = (256, 1024, 1024, 1024, 256)
BATCH = 64


def batches(world_size, rank, steps):
    x, y = models.regression_data(n=BATCH * 4, in_dim=SIZES[0], out_dim=SIZES[-1], seed=0)
    return [(gx.chunk(world_size)[rank], gy.chunk(world_size)[rank])
            for gx, gy in models.batches_of(x, y, BATCH, steps)]


def timed_steps(step, data):
    times = []
    for x, y in data:
        dist.barrier()
        start = time.perf_counter()
        step(x, y)
        times.append(time.perf_counter() - start)
    return statistics.median(times[2:])  # the first steps warm up allocators and threads


def ddp_bytes(rank, world_size):
    model = models.make_mlp(SIZES, seed=0)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    for x, y in batches(world_size, rank, 1):
        F.mse_loss(model(x), y).backward()
        for p in model.parameters():
            dist.all_reduce(p.grad)
            p.grad /= world_size
        opt.step()
    params = list(model.parameters())
    return sum(measure_state_bytes(params, [p.grad for p in params], opt).values())


def zero3(rank, world_size, steps):
    model = models.make_mlp(SIZES, seed=0)
    zero = ZeRO(model, 3, optimizer="adam", lr=1e-3)

    def step(x, y):
        zero.zero_grad()
        F.mse_loss(model(x), y).backward()
        zero.step()

    seconds = timed_steps(step, batches(world_size, rank, steps))
    return sum(zero.state_bytes().values()), seconds


def fsdp2(rank, world_size, steps):
    from torch.distributed.fsdp import fully_shard
    model = models.make_mlp(SIZES, seed=0)
    for layer in model.net:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer)
    fully_shard(model)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)

    def step(x, y):
        opt.zero_grad()
        F.mse_loss(model(x), y).backward()
        opt.step()

    return timed_steps(step, batches(world_size, rank, steps))


PF_D, PF_LAYERS, PF_TOKENS, PF_PRESET = 256, 4, 4096, "a100-ethernet"


def zero3_emulated(rank, world_size, prefetch):
    model = models.make_mlp((PF_D,) * (PF_LAYERS + 1), seed=0)
    x, y = models.regression_data(n=PF_TOKENS * world_size, in_dim=PF_D, out_dim=PF_D, seed=0)
    zero = ZeRO(model, 3, optimizer="adam", lr=1e-3, prefetch=prefetch)
    start = distlab.trace.now()
    zero.zero_grad()
    F.mse_loss(model(x.chunk(world_size)[rank]), y.chunk(world_size)[rank]).backward()
    zero.step()
    return distlab.trace.now() - start, zero.full_parameters()


def prefetch_ratio():
    """(emulated off/on, model off/on, results bit-identical) for one ZeRO-3 step on 2 ranks."""
    from distlab import cost, memory
    from distlab.emulate import PRESETS
    runs = {p: distlab.run(zero3_emulated, 2, p, emulate=PF_PRESET, timeout=300)
            for p in (False, True)}
    same = all(torch.equal(u, v) for r in range(2)
               for u, v in zip(runs[False][r][1], runs[True][r][1]))
    cluster = PRESETS[PF_PRESET]
    link, peak = cluster.link_between([0, 1]), cluster.device.peak(torch.float32)
    g = sum(cost.predict("ring_all_gather", n * 4, 2, link) for n in (PF_D * PF_D, PF_D))
    r = sum(cost.predict("ring_reduce_scatter", n * 4, 2, link) for n in (PF_D * PF_D, PF_D))
    f = 2 * PF_TOKENS * PF_D * PF_D / peak
    model = [memory.zero3_step_seconds(g, f, 2 * f, r, PF_LAYERS, p) for p in (False, True)]
    emulated = [max(s for s, _ in runs[p]) for p in (False, True)]
    return emulated[0] / emulated[1], model[0] / model[1], same


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    n = sum(p.numel() for p in models.make_mlp(SIZES).parameters())
    print(f"MLP {SIZES}: {n:,} parameters, float32, Adam, global batch {BATCH}")
    print(f"{'ranks':>5} {'DDP bytes/rank':>15} {'ZeRO-3 bytes/rank':>18} {'ratio':>7} "
          f"{'ZeRO-3 step':>12} {'FSDP2 step':>11} {'ours/FSDP2':>11}")
    for ws in (2, 4):
        ddp = distlab.run(ddp_bytes, ws, timeout=300)[0]
        ours = distlab.run(zero3, ws, args.steps, timeout=300)
        theirs = distlab.run(fsdp2, ws, args.steps, timeout=300)
        ours_bytes = max(b for b, _ in ours)
        ours_s, theirs_s = max(s for _, s in ours), max(theirs)  # a step ends with its slowest rank
        print(f"{ws:>5} {ddp:>15,} {ours_bytes:>18,} {ours_bytes / ddp:>7.3f} "
              f"{ours_s * 1e3:>10.1f}ms {theirs_s * 1e3:>9.1f}ms {ours_s / theirs_s:>11.2f}")
    emulated, model, same = prefetch_ratio()
    print(f"ZeRO-3 prefetch off/on (emulated {PF_PRESET}, 2 ranks): measured {emulated:.2f}, "
          f"model {model:.2f}; parameters bit-identical: {same}")


if __name__ == "__main__":
    main()
