"""Step time of our bucketed DDP against torch's DistributedDataParallel, and overlap on vs off.

Two parts:
1. measured on this machine: every variant trains the same MLP on the same data at the same
   bucket size on 2 ranks (gloo): forward, backward with gradient all-reduce, SGD step; median
   step times and ratios. On a 2-core machine the ranks share the cores with gloo's threads, so
   overlap can only hide what the cores are not already busy with: these ratios say little
   about a GPU cluster;
2. emulated (distlab.emulate, preset a100-nvlink, fp32): the chapter's deep MLP at 128 samples
   per rank, where backward compute and the gradient all-reduce take about the same modeled
   time, overlap off against on, beside distlab.cost.ddp_step_time's prediction. The last line is
   `overlap off/on (emulated): measured X, model Y`.

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
from distlab import cost, emulate, models
from distlab.data_parallel import BucketedDDP, shard_batch

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
EMULATED_PRESET, EMULATED_BATCH, EMULATED_CAP_MB = "a100-nvlink", 128, 2.0


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
    numels = [p.numel() for p in models.make_mlp(EMULATED_SIZES).parameters()]
    measured, model = {}, {}
    for overlap in (False, True):
        steps = distlab.run(emulated_step, world_size, overlap, emulate=EMULATED_PRESET, timeout=300)
        measured[overlap] = max(steps)
        model[overlap] = cost.ddp_step_time(
            numels, EMULATED_BATCH, world_size, cluster.device.peak(torch.float32),
            cluster.device.memory_bandwidth, cluster.link_between(range(world_size)),
            EMULATED_CAP_MB * 2 ** 20, overlap=overlap)["step"]
    print(f"emulated on {cluster}: MLP {EMULATED_SIZES}, {EMULATED_BATCH} samples per rank, "
          f"{world_size} ranks, bucket_cap_mb={EMULATED_CAP_MB}; forward + backward + sync")
    for overlap in (False, True):
        print(f"  overlap {'on ' if overlap else 'off'}  emulated {measured[overlap] * 1e6:7.1f} µs, "
              f"model {model[overlap] * 1e6:7.1f} µs")
    print(f"overlap off/on (emulated): measured {measured[False] / measured[True]:.2f}, "
          f"model {model[False] / model[True]:.2f}")


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
