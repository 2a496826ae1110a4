"""Our ring all-reduce (send/recv from Python) against torch's dist.all_reduce, 1 KB to 64 MB.

    python bench/collectives.py [--world-size 4] [--max-mb 64] [--repeats 5]

Prints, per message size, the median time per call of each (the slowest rank's, each call
starting after a barrier) and the ratio ours / torch's, then the α-β link fitted to each.
On a laptop the ranks share the CPU cores and the "network" is loopback, so these numbers are
about this machine, not about a cluster: see chapter 03.
"""
import argparse

import torch.distributed as dist

import distlab
from distlab import collectives, cost


def sizes_up_to(max_bytes):
    sizes, s = [], 1 << 10
    while s <= max_bytes:
        sizes.append(s)
        s *= 4
    return sizes


def bench_rank(rank, world_size, sizes, repeats):
    out = {}
    for name, fn in (("torch", dist.all_reduce), ("ours", collectives.ring_all_reduce)):
        small = [s for s in sizes if s < (8 << 20)]
        large = [s for s in sizes if s >= (8 << 20)]
        # Large messages are stable and slow: fewer repeats keep the whole run near a minute.
        out[name] = cost.measure(fn, small, repeats * 2) + cost.measure(fn, large, repeats)
    return out


def human(nbytes):
    for unit in ("B", "KB", "MB", "GB"):
        if nbytes < 1024 or unit == "GB":
            return f"{nbytes:g} {unit}"
        nbytes /= 1024


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=int, default=4)
    parser.add_argument("--max-mb", type=float, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    sizes = sizes_up_to(int(args.max_mb * (1 << 20)))
    results = distlab.run(bench_rank, args.world_size, sizes, args.repeats, timeout=900)
    times = results[0]
    print(f"all_reduce (sum, float32) on {args.world_size} ranks, backend {results.backend}")
    print(f"{'size':>8} | {'torch (ms)':>10} | {'ours (ms)':>10} | {'ours/torch':>10}")
    print("-" * 48)
    for size, theirs, ours in zip(sizes, times["torch"], times["ours"]):
        print(f"{human(size):>8} | {theirs * 1e3:10.3f} | {ours * 1e3:10.3f} | {ours / theirs:10.2f}")
    for name in ("torch", "ours"):
        link = cost.fit([("ring_all_reduce", s, args.world_size, t)
                         for s, t in zip(sizes, times[name])], name)
        print(f"fitted α-β model, {link}")


if __name__ == "__main__":
    main()
