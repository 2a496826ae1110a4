"""Ring attention against dense attention at full size: time and memory per rank, as ratios.

One causal attention layer (forward and backward) of Llama-2 7B's shape (32 heads of 128, bf16)
over one sequence of --seq tokens, on meta tensors (full size, nothing computed):
- dense: the whole sequence on one device (one rank, one flash kernel);
- ring attention and all-gather K/V: the sequence split over --cp ranks (zig-zag).
Time is modeled on an emulated accelerator (--preset, default h100-ib: one H100 per node over
InfiniBand), so the ratios are those of the calibrated model, not of this laptop; beside them
the block length above which the ring's hops hide (context_parallel.overlap_block_length).
Memory is what autograd keeps for backward on each rank (the shapes of the saved tensors).

    python bench/context_parallel.py [--seq 131072] [--cp 4] [--preset h100-ib]
"""
import argparse

import torch

import distlab
from distlab import context_parallel as cp

HEADS, HEAD_DIM = 32, 128


def attention_step(rank, world_size, seq_len, kind):
    if kind == "dense":
        positions = torch.arange(seq_len)
    else:
        positions = cp.zigzag_positions(seq_len, rank, world_size)
    with torch.device("meta"):
        q, k, v = [torch.empty(1, HEADS, len(positions), HEAD_DIM, dtype=torch.bfloat16,
                               requires_grad=True) for _ in range(3)]
    saved = 0

    def pack(t):
        nonlocal saved
        saved += t.numel() * t.element_size()
        return t

    start = distlab.trace.now()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        if kind == "dense":
            out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        elif kind == "ring":
            out = cp.ring_attention(q, k, v, positions, causal=True)
        else:
            out = cp.all_gather_attention(q, k, v, positions, causal=True)
    out.backward(torch.ones_like(out))
    return distlab.trace.now() - start, saved


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int, default=131_072)
    parser.add_argument("--cp", type=int, default=4)
    parser.add_argument("--preset", default="h100-ib")
    args = parser.parse_args()
    runs = {kind: distlab.run(attention_step, 1 if kind == "dense" else args.cp, args.seq, kind,
                              emulate=args.preset, timeout=600)
            for kind in ("dense", "ring", "all_gather")}
    step = {kind: max(t for t, _ in r) for kind, r in runs.items()}
    memory = {kind: max(m for _, m in r) for kind, r in runs.items()}
    cluster = distlab.emulate.PRESETS[args.preset]
    crossover = cp.overlap_block_length(cluster.device, cluster.link_between(range(args.cp)),
                                        HEADS, HEAD_DIM)
    print(f"causal attention, {args.seq:,} tokens, {HEADS} heads of {HEAD_DIM}, bf16, forward + "
          f"backward; cp = {args.cp} ({args.seq // args.cp:,} tokens per rank; the hops hide "
          f"from {crossover:,}); time emulated on {args.preset}")
    for kind in runs:
        print(f"  {kind:<11} {step[kind] * 1e3:9.2f} ms   {memory[kind] / 2 ** 20:9.1f} MiB "
              f"saved for backward per rank")
    for kind in ("ring", "all_gather"):
        print(f"{kind} / dense: time {step[kind] / step['dense']:.3f} (ideal 1/{args.cp} = "
              f"{1 / args.cp:.3f}), memory per rank {memory[kind] / memory['dense']:.3f}")


if __name__ == "__main__":
    main()
