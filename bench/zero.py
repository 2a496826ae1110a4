"""ZeRO-3 against plain data parallelism and FSDP2: per-rank model-state bytes, and step time.

For 2 and 4 ranks, on the same MLP and data:
- bytes of weights + gradients + Adam states each rank holds after a step (measured on the real
  tensors), plain DDP vs our ZeRO-3, and their ratio (the model says 1/N);
- median step time of our ZeRO-3 vs torch's FSDP2 (fully_shard per Linear), and their ratio;
- last, ZeRO-3 with and without prefetch on two Llama-2 7B blocks (meta tensors) under the
  emulated h100-node and h100-ib presets (2 ranks), beside the closed form
  (zero_memory.zero3_units_seconds): the step-time ratio off/on, emulated — not measured.

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


PF_BLOCKS, PF_TOKENS, PF_PRESETS = 2, 2048, ("h100-node", "h100-ib")


def zero3_emulated(rank, world_size, tokens):
    """Emulated seconds of one forward + backward of PF_BLOCKS Llama-2 7B blocks (meta tensors,
    bf16) under our ZeRO-3, prefetch off then on."""
    from distlab import zero_memory
    c, seconds = zero_memory.LLAMA2_7B, []
    for prefetch in (False, True):
        with torch.device("meta"):
            blocks = torch.nn.ModuleList(zero_memory.LlamaBlock(c["hidden"], c["heads"], c["ffn"],
                                                                dtype=torch.bfloat16)
                                         for _ in range(PF_BLOCKS))
            x = torch.randn(1, tokens, c["hidden"], dtype=torch.bfloat16, requires_grad=True)
            cos, sin = zero_memory.rotary_tables(tokens, c["hidden"] // c["heads"], torch.bfloat16)
        ZeRO(blocks, 3, optimizer="adam", prefetch=prefetch)
        start = distlab.trace.now()
        y = x
        for block in blocks:
            y = block(y, cos, sin)
        y.backward(torch.ones_like(y))
        seconds.append(distlab.trace.now() - start)
    return seconds


def prefetch_ratio(preset):
    """(emulated off/on, closed form off/on) of one ZeRO-3 step of Llama-2 7B blocks on 2 ranks
    of `preset` (chapter 06's lesson). The two share their formulas: the agreement checks the
    code's critical path (which gather waits for which compute), not the hardware."""
    from distlab import zero_memory
    from distlab.emulate import PRESETS
    res = distlab.run(zero3_emulated, 2, PF_TOKENS, emulate=preset, timeout=300)
    off, on = (max(r[i] for r in res) for i in (0, 1))
    units = zero_memory.llama_zero3_units(PRESETS[preset], 2, PF_TOKENS, PF_BLOCKS)
    m_off, m_on = (zero_memory.zero3_units_seconds(units, p) for p in (False, True))
    return off / on, m_off / m_on


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
    for preset in PF_PRESETS:
        emulated, model = prefetch_ratio(preset)
        print(f"ZeRO-3 prefetch off/on, {PF_BLOCKS} Llama-2 7B blocks, {PF_TOKENS} tokens/rank "
              f"(meta tensors, emulated {preset}, 2 ranks): emulated {emulated:.2f}, "
              f"closed form {model:.2f}")


if __name__ == "__main__":
    main()
