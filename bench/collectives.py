"""Our ring all-reduce (send/recv from Python) against torch's dist.all_reduce, 1 KB to 64 MB,
then the same ring on an emulated link, fitted.

    python bench/collectives.py [--world-size 4] [--max-mb 64] [--repeats 5]
                                [--preset a100-ethernet] [--emulated-only]

Measured: per message size, the median time per call of each (the slowest rank's, each call
starting after a barrier) and the ratio ours / torch's, then the α-β link fitted to each.
On a laptop the ranks share the CPU cores and the "network" is loopback, so these numbers are
about this machine, not about a cluster: see chapter 03.

Emulated: our ring on a modeled cluster (distlab.run(..., emulate=preset)), timed on the ranks'
virtual clocks, and the α-β link `cost.fit` finds from those times against the preset's own.
The last line reads `emulated link fit: alpha error X%, bandwidth error Y%`.
"""
import argparse

import torch
import torch.distributed as dist

import distlab
from distlab import collectives, cost, emulate

# 4 KB to 16 MB: on the default preset (a message: α = 10 µs, 10 GB/s achieved; N·α·B = 0.4 MB at
# 4 ranks) both the latency floor and the bandwidth slope.
EMULATED_SIZES = [4 << 10, 16 << 10, 64 << 10, 256 << 10, 1 << 20, 4 << 20, 16 << 20]


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


def emulated_rank(rank, world_size, sizes):
    """Modeled seconds of our ring all-reduce per size, on this rank's virtual clock."""
    out = []
    for nbytes in sizes:
        x = torch.ones(nbytes // 4)
        dist.barrier()
        began = distlab.trace.now()
        collectives.ring_all_reduce(x)
        out.append(distlab.trace.now() - began)
    return out


def emulated_fit(world_size, preset):
    """Print the emulated times beside the α-β model of the preset's message, what is left over
    (the ring's own ops on the emulated GPU, each at least its launch floor), and the fit's
    errors (the last line). The emulator and the model share their formulas: agreement checks
    the fitting method and the ring's critical path, not hardware."""
    cluster = emulate.resolve(preset)
    link = cluster.link_between(range(world_size))
    # our ring is built from messages: its model is α-β with the link's message latency, not the
    # calibrated link's model of NCCL's all_reduce
    message = link.alpha_beta() if hasattr(link, "alpha_beta") else link
    results = distlab.run(emulated_rank, world_size, EMULATED_SIZES, emulate=cluster, timeout=300)
    seconds = [max(r[i] for r in results) for i in range(len(EMULATED_SIZES))]
    print(f"\nemulated: our ring all-reduce on {world_size} ranks, message {message}")
    print(f"{'size':>8} | {'emulated (µs)':>13} | {'α-β (µs)':>10} | {'left over':>9}")
    print("-" * 50)
    for size, t in zip(EMULATED_SIZES, seconds):
        model = cost.predict("ring_all_reduce", size, world_size, message)
        print(f"{human(size):>8} | {t * 1e6:13.1f} | {model * 1e6:10.1f} | {(t - model) * 1e6:9.1f}")
    print(f"(the GPU's launch floor: {cluster.device.floor * 1e6:.0f} µs per op; the ring runs a "
          f"buffer allocation and N-1 additions)")
    fitted = cost.fit([("ring_all_reduce", s, world_size, t)
                       for s, t in zip(EMULATED_SIZES, seconds)], "fitted")
    print(f"fitted α-β model, {fitted} (message: {message})")
    alpha_error = abs(fitted.alpha - message.alpha) / message.alpha
    bandwidth_error = abs(fitted.bandwidth - message.bandwidth) / message.bandwidth
    print(f"emulated link fit: alpha error {alpha_error:.1%} (the ops above), "
          f"bandwidth error {bandwidth_error:.1%}")


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
    parser.add_argument("--preset", default="a100-ethernet", choices=sorted(emulate.PRESETS))
    parser.add_argument("--emulated-only", action="store_true",
                        help="skip the (slow, noisy) measurement on this machine")
    args = parser.parse_args()
    if not args.emulated_only:
        measured(args)
    emulated_fit(args.world_size, args.preset)


def measured(args):
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
