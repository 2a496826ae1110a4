"""Step time of our bucketed DDP against torch's DistributedDataParallel, and overlap on vs off.

Two parts:
1. measured on this machine: every variant trains the same MLP on the same data at the same
   bucket size on 2 ranks (gloo): forward, backward with gradient all-reduce, SGD step; median
   step times and ratios. On a 2-core machine the ranks share the cores with gloo's threads, so
   overlap can only hide what the cores are not already busy with: these ratios say little
   about a GPU cluster;
2. emulated on calibrated presets (distlab.emulate), overlap off against on:
   - the chapter's deep MLP (2.1 M parameters, fp32, 128 samples per rank) on `a100-node`:
     small matmuls and launch costs, so off/on is 1.00 — nothing to hide;
   - 2 of GPT-3 XL's blocks at real size on the meta device (distlab.data_parallel.gpt_step:
     hidden 2048, 2048 tokens per rank, bf16) on 16 ranks over two nodes (`a100-2x8`), beside
     distlab.data_parallel.predict_step's replay of a one-rank run (same link formulas: the
     agreement checks the code's critical path, not the hardware). The last line is
     `overlap off/on (emulated, 16 ranks, GPT-3 XL blocks): X, predicted Y`.

    python bench/ddp.py [--world-size 2] [--steps 20] [--bucket-mb 2] [--sizes 256,1024,1024,1024,256]
"""
import argparse
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel

import distlab
from distlab import emulate, models
from distlab.data_parallel import BucketedDDP, gpt_step, predict_step, shard_batch

VARIANTS = ("ours, overlap on", "ours, overlap off", "torch DDP")


def measure(rank, world_size, sizes, batch, steps, bucket_mb):
    x, y = models.regression_data(n=batch * world_size, in_dim=sizes[0], out_dim=sizes[-1], seed=0)
    x, y = shard_batch(x, rank, world_size), shard_batch(y, rank, world_size)
    times = {}
    for variant in VARIANTS:
        model = models.make_mlp(sizes, seed=0)
        if variant == "torch DDP":
            wrapped = DistributedDataParallel(model, bucket_cap_mb=bucket_mb)
        else:
            wrapped = BucketedDDP(model, bucket_cap_mb=bucket_mb, overlap=variant.endswith("on"))
        opt = torch.optim.SGD(wrapped.parameters(), lr=0.01)
        samples = []
        for step in range(steps + 3):           # the first steps warm up allocators and sockets
            dist.barrier()
            start = time.perf_counter()
            opt.zero_grad()
            F.mse_loss(wrapped(x), y).backward()
            opt.step()
            if step >= 3:
                samples.append(time.perf_counter() - start)
        times[variant] = statistics.median(samples)
        n_buckets = len(wrapped.buckets) if isinstance(wrapped, BucketedDDP) else None
        times.setdefault("buckets", n_buckets)
    return times


EMULATED_SIZES = (256,) + (512,) * 8 + (256,)      # the chapter's deep MLP: 2.1 M parameters
EMULATED_PRESET, EMULATED_BATCH, EMULATED_CAP_MB = "a100-node", 128, 2.0


def emulated_step(rank, world_size, overlap, steps=2):
    """Modeled seconds of forward + backward + gradient sync (the last of `steps`)."""
    model = models.make_mlp(EMULATED_SIZES, seed=0)
    ddp = BucketedDDP(model, bucket_cap_mb=EMULATED_CAP_MB, overlap=overlap)
    x, y = models.regression_data(n=EMULATED_BATCH, in_dim=EMULATED_SIZES[0],
                                  out_dim=EMULATED_SIZES[-1], seed=rank)
    for _ in range(steps):
        ddp.zero_grad()
        start = distlab.trace.now()
        F.mse_loss(ddp(x), y).backward()
        took = distlab.trace.now() - start
    return took


def emulated(world_size):
    cluster = emulate.PRESETS[EMULATED_PRESET]
    small = {overlap: max(distlab.run(emulated_step, world_size, overlap, emulate=EMULATED_PRESET,
                                      timeout=300)) for overlap in (False, True)}
    print(f"emulated on {cluster}: MLP {EMULATED_SIZES}, {EMULATED_BATCH} samples per rank, "
          f"{world_size} ranks, bucket_cap_mb={EMULATED_CAP_MB}; forward + backward + sync")
    for overlap in (False, True):
        print(f"  overlap {'on ' if overlap else 'off'}  emulated {small[overlap] * 1e6:8.1f} µs")
    print(f"overlap off/on (emulated, MLP): {small[False] / small[True]:.2f}")
    big_cluster = emulate.PRESETS["a100-2x8"]
    link = big_cluster.link_between(range(16))
    big, predicted = {}, {}
    for overlap in (False, True):
        big[overlap] = max(r[1] for r in distlab.run(gpt_step, 16, overlap=overlap,
                                                     emulate="a100-2x8", timeout=600))
        alone = distlab.run(gpt_step, 1, overlap=overlap, emulate="a100-2x8")[0]
        predicted[overlap] = predict_step(*alone, 16, link)
    print(f"emulated on {big_cluster}: 2 GPT-3 XL blocks at real size (meta tensors), 2048 tokens "
          f"per rank, bf16, 16 ranks, bucket_cap_mb=25")
    for overlap in (False, True):
        print(f"  overlap {'on ' if overlap else 'off'}  emulated {big[overlap] * 1e3:7.2f} ms, "
              f"predicted from one rank {predicted[overlap] * 1e3:7.2f} ms")
    print(f"overlap off/on (emulated, 16 ranks, GPT-3 XL blocks): {big[False] / big[True]:.2f}, "
          f"predicted {predicted[False] / predicted[True]:.2f}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--batch", type=int, default=64, help="samples per rank")
    parser.add_argument("--bucket-mb", type=float, default=2.0)
    parser.add_argument("--sizes", default="256,1024,1024,1024,256")
    args = parser.parse_args()
    sizes = tuple(int(s) for s in args.sizes.split(","))
    results = distlab.run(measure, args.world_size, sizes, args.batch, args.steps, args.bucket_mb,
                          timeout=600)
    # The slowest rank sets the step time.
    step = {v: max(r[v] for r in results) for v in VARIANTS}
    n_params = sum(p.numel() for p in models.make_mlp(sizes).parameters())
    print(f"MLP {sizes}: {n_params / 1e6:.2f}M parameters ({n_params * 4 / 2 ** 20:.1f} MiB of "
          f"fp32 gradients), {args.batch} samples per rank, {args.world_size} ranks, "
          f"bucket_cap_mb={args.bucket_mb} ({results[0]['buckets']} buckets), backend "
          f"{results.backend}, median of {args.steps} steps")
    for v in VARIANTS:
        print(f"  {v:<18} {step[v] * 1e3:8.1f} ms/step")
    print(f"ours (overlap on) / torch DDP     = {step[VARIANTS[0]] / step[VARIANTS[2]]:.2f}")
    print(f"overlap off / overlap on (ours)   = {step[VARIANTS[1]] / step[VARIANTS[0]]:.2f}")
    print()
    emulated(args.world_size)


if __name__ == "__main__":
    main()
