"""Ring attention against dense attention: time and memory per rank, as ratios.

One causal attention layer (forward and backward) over a sequence of --seq tokens, 8 heads of
64, float32:
- dense: the whole sequence on one device (one rank);
- ring attention and all-gather K/V: the sequence split over --cp ranks (zig-zag).
Time is modeled on an emulated accelerator (--preset, default h100-ib: one H100 per node over
InfiniBand), so the ratios are those of the modeled hardware, not of this laptop. Memory is
what autograd keeps for backward on each rank, measured on the real tensors.

    python bench/context_parallel.py [--seq 2048] [--cp 4] [--preset h100-ib]
"""
import argparse

import torch

import distlab
from distlab import context_parallel as cp

HEADS, HEAD_DIM = 8, 64


def attention_step(rank, world_size, seq_len, kind):
    if kind == "dense":
        positions = torch.arange(seq_len)
    else:
        positions = cp.zigzag_positions(seq_len, rank, world_size)
    g = torch.Generator().manual_seed(rank)
    q, k, v = [torch.randn(1, HEADS, len(positions), HEAD_DIM, generator=g).requires_grad_()
               for _ in range(3)]
    saved = 0

    def pack(t):
        nonlocal saved
        saved += t.untyped_storage().nbytes()
        return t

    start = distlab.trace.now()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        if kind == "dense":
            out = cp.dense_attention(q, k, v, causal=True)
        elif kind == "ring":
            out = cp.ring_attention(q, k, v, positions, causal=True)
        else:
            out = cp.all_gather_attention(q, k, v, positions, causal=True)
    out.sum().backward()
    return distlab.trace.now() - start, saved


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--cp", type=int, default=4)
    parser.add_argument("--preset", default="h100-ib")
    args = parser.parse_args()
    runs = {kind: distlab.run(attention_step, 1 if kind == "dense" else args.cp, args.seq, kind,
                              emulate=args.preset, timeout=600)
            for kind in ("dense", "ring", "all_gather")}
    step = {kind: max(t for t, _ in r) for kind, r in runs.items()}
    memory = {kind: max(m for _, m in r) for kind, r in runs.items()}
    print(f"causal attention, {args.seq} tokens, {HEADS} heads of {HEAD_DIM}, float32, "
          f"forward + backward; cp = {args.cp}; time emulated on {args.preset}")
    for kind in runs:
        print(f"  {kind:<11} {step[kind] * 1e6:9.1f} µs   {memory[kind] / 2 ** 20:8.2f} MiB "
              f"saved for backward per rank")
    for kind in ("ring", "all_gather"):
        print(f"{kind} / dense: time {step[kind] / step['dense']:.2f}, memory per rank "
              f"{memory[kind] / memory['dense']:.3f}")


if __name__ == "__main__":
    main()
