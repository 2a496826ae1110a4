"""A real-size layer on a laptop: one Llama-2 7B transformer block at 4k tokens, forward and
backward, tensor parallel over 2, 4 and 8 ranks, built on the `meta` device and timed under
emulation (distlab.emulate). Nothing is computed: every tensor has its real shape and dtype but
no memory, so a block whose activations and gradients take gigabytes runs in seconds on 2 cores.

The block (Llama 2, Touvron et al. 2023, table 1 and the released config of the 7B model:
hidden 4096, 32 heads of 128, SwiGLU with 11008 hidden units, RMSNorm, rotary embeddings,
no biases, bf16) is split with the course's own tensor-parallel layers
(distlab.tensor_parallel.ColumnParallelLinear / RowParallelLinear, Megatron's layout): q, k, v
and the SwiGLU's gate and up projections column-parallel, the attention output and down
projections row-parallel; attention runs on each rank's heads through FlashAttention's op
(aten._scaled_dot_product_flash_attention: what an H100 runs; torch's flop counter knows it;
F.scaled_dot_product_attention on meta tensors would be charged as the CPU's fused kernel, whose
FLOPs torch's counter does not count).

Then a data-parallel training step of a 1.26B-parameter Llama (TinyLlama-1.1B's shape) with
the course's BucketedDDP, its bucketed gradient all-reduces overlapping backward, and SGD: the
emulated step beside compute at the device's rate plus the whole all-reduce (no overlap). About
half of the emulated step is memory-bound work that this closed form leaves out: bucket copies,
the optimizer update and the gradients' accumulation move every parameter's bytes several times.

For each tensor-parallel degree it prints the emulated step time of the block, the FLOPs and
the bytes of collectives one rank issued (from the run's trace), and the ratio of the emulated
time to a closed form: the block's matmul and attention FLOPs at the device's modeled rate
(distlab.emulate's Device.seconds) plus the four all-reduces of the activations (two forward,
two backward) at the link's modeled time (comm_seconds). The emulated run also pays what the
closed form leaves out: the memory-bound ops (norms, rotary embeddings, SwiGLU's product,
residual adds, copies), each at its modeled time. The ratio grows with the degree because
tensor parallelism splits the matmuls but not those ops: the norms and residual adds work on the
whole (replicated) activations on every rank, which sequence parallelism would split. On the
legacy h100-nvlink preset this prints about 5.7 / 4.1 / 3.3 ms at tp 2 / 4 / 8, 1.7-2.3 times
the closed form.

    python bench/fullsize.py [--preset h100-nvlink] [--tp 2,4,8] [--tokens 4096] [--dp 2,8]
                             [--dp-tokens 2048]
"""
import argparse

import torch
import torch.nn as nn
import torch.nn.functional as F

import distlab
from distlab import trace
from distlab.emulate import comm_seconds, resolve
from distlab.tensor_parallel import ColumnParallelLinear, RowParallelLinear, per_rank

# Llama-2 7B (Touvron et al. 2023, "Llama 2: Open Foundation and Fine-Tuned Chat Models",
# table 1; config.json of meta-llama/Llama-2-7b-hf): one of its 32 blocks.
LLAMA2_7B = dict(hidden=4096, heads=32, ffn=11008, eps=1e-5, dtype=torch.bfloat16)


class Attention(nn.Module):
    def __init__(self, hidden, heads, group):
        super().__init__()
        self.local_heads, self.head_dim = per_rank(heads, group, "heads"), hidden // heads
        self.qkv = ColumnParallelLinear(hidden, 3 * hidden, group, bias=False, chunks=3,
                                        dtype=LLAMA2_7B["dtype"])
        self.out = RowParallelLinear(hidden, hidden, group, bias=False, dtype=LLAMA2_7B["dtype"])

    def forward(self, x, cos, sin):
        b, t, _ = x.shape
        q, k, v = (z.view(b, t, self.local_heads, self.head_dim).transpose(1, 2)
                   for z in self.qkv(x).chunk(3, dim=-1))
        q, k = _rotary(q, cos, sin), _rotary(k, cos, sin)
        if q.is_meta:     # FlashAttention, as on the GPU (the CPU has its own kernel for it)
            y = _flash(q, k, v)
        else:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(y.transpose(1, 2).reshape(b, t, self.local_heads * self.head_dim))


def _flash(q, k, v):
    # Looked up by name: cloudpickle cannot ship the `torch.ops` namespace with the function.
    aten = getattr(getattr(torch, "ops"), "aten")
    return getattr(aten, "_scaled_dot_product_flash_attention")(q, k, v, 0.0, True)[0]


def _rotary(x, cos, sin):
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class SwiGLU(nn.Module):
    def __init__(self, hidden, ffn, group):
        super().__init__()
        self.gate_up = ColumnParallelLinear(hidden, 2 * ffn, group, bias=False, chunks=2,
                                            dtype=LLAMA2_7B["dtype"])
        self.down = RowParallelLinear(ffn, hidden, group, bias=False, dtype=LLAMA2_7B["dtype"])

    def forward(self, x):
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        return self.down(F.silu(gate) * up)


class Block(nn.Module):
    """A Llama block, tensor parallel over `group`."""

    def __init__(self, hidden, heads, ffn, eps, dtype, group=None):
        super().__init__()
        self.norm1 = nn.RMSNorm(hidden, eps=eps, dtype=dtype)
        self.attn = Attention(hidden, heads, group)
        self.norm2 = nn.RMSNorm(hidden, eps=eps, dtype=dtype)
        self.mlp = SwiGLU(hidden, ffn, group)

    def forward(self, x, cos, sin):
        x = x + self.attn(self.norm1(x), cos, sin)
        return x + self.mlp(self.norm2(x))


def block_step(rank, world_size, config, tokens, device="meta"):
    """Build the block (this rank's shards) and its input on `device`, then one forward and
    backward inside the span "step"; returns the emulated seconds of the step."""
    config = dict(config)
    hidden, heads = config["hidden"], config["heads"]
    with torch.device(device):
        block = Block(**config)
        x = torch.randn(1, tokens, hidden, dtype=config["dtype"], requires_grad=True)
        angles = torch.randn(tokens, hidden // heads, dtype=config["dtype"])
        cos, sin = angles.cos(), angles.sin()
    start = trace.now()
    with trace.span("step"):
        y = block(x, cos, sin)
        y.backward(torch.ones_like(y))
    return trace.now() - start


def closed_form(config, tokens, tp, cluster):
    """(seconds, flops per rank) of the step by formula: matmul and attention FLOPs at the
    device's rate, and four all-reduces of the activations on the group's link."""
    d, f, dtype = config["hidden"], config["ffn"], config["dtype"]
    matmul = 2 * tokens * (4 * d * d + 3 * d * f) // tp            # q, k, v, out; gate, up, down
    # torch's flop counter for attention: q·kᵀ and p·v over the full square (4·t²·d) forward,
    # 2.5 times that backward (its flash backward formula).
    attention = 4 * tokens * tokens * d // tp
    flops = 3 * matmul + attention + 2.5 * attention
    nbytes = tokens * d * torch.finfo(dtype).bits // 8
    link = cluster.link_between(range(tp))
    seconds = cluster.device.seconds(flops, 0, dtype) + 4 * comm_seconds("all_reduce", nbytes,
                                                                          tp, link)
    return seconds, flops


def measure(tp, preset="h100-nvlink", config=LLAMA2_7B, tokens=4096, timeout=120):
    """One emulated run of the block at tensor-parallel degree `tp`: a dict of rank 0's step."""
    cluster = resolve(preset)
    results = distlab.run(block_step, tp, config, tokens, emulate=cluster, timeout=timeout)
    t = results.trace
    spans = [s for s in t.compute(0) if s["name"] == "step"]
    events = [e for e in t.comm(0) if e["label"] == ["step"]]
    formula, formula_flops = closed_form(config, tokens, tp, cluster)
    return dict(tp=tp, seconds=max(results), flops=sum(s["flops"] or 0 for s in spans),
                comm_bytes=sum(e["bytes"] for e in events), collectives=len(events),
                closed_form=formula, closed_form_flops=formula_flops,
                ratio=max(results) / formula, meta=t.meta)


# ---- a data-parallel step of a 1.2B model -----------------------------------------------------

# TinyLlama-1.1B's shape (Zhang et al. 2024, "TinyLlama: An Open-Source Small Language Model",
# table 1: 22 layers, hidden 2048, 32 heads, SwiGLU 5632, vocabulary 32000), with full
# multi-head attention instead of its 4 key/value heads: 1.26B parameters.
TINYLLAMA = dict(layers=22, hidden=2048, heads=32, ffn=5632, vocab=32000, eps=1e-5,
                 dtype=torch.bfloat16)


class Model(nn.Module):
    def __init__(self, layers, hidden, heads, ffn, vocab, eps, dtype, group):
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden, dtype=dtype)
        self.blocks = nn.ModuleList(Block(hidden, heads, ffn, eps, dtype, group)
                                    for _ in range(layers))
        self.norm = nn.RMSNorm(hidden, eps=eps, dtype=dtype)
        self.head = nn.Linear(hidden, vocab, bias=False, dtype=dtype)

    def forward(self, tokens, cos, sin):
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x, cos, sin)
        return self.head(self.norm(x))


def dp_step(rank, world_size, config, tokens, bucket_mb=25.0, device="meta"):
    """One data-parallel training step (forward, backward with the course's BucketedDDP
    overlapping its bucketed all-reduces, SGD) of `tokens` tokens per rank."""
    from distlab.data_parallel import BucketedDDP
    config = dict(config)
    # Every rank is its own tensor-parallel group of one: the blocks' layers stay whole.
    alone = [torch.distributed.new_group([r]) for r in range(world_size)][rank]
    with torch.device(device):
        model = Model(**config, group=alone)
        ids = torch.randint(config["vocab"], (1, tokens))
        angles = torch.randn(tokens, config["hidden"] // config["heads"], dtype=config["dtype"])
        cos, sin = angles.cos(), angles.sin()
    ddp = BucketedDDP(model, bucket_cap_mb=bucket_mb)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    start = trace.now()
    with trace.span("step"):
        logits = ddp(ids, cos, sin)
        loss = F.cross_entropy(logits.flatten(0, 1).float(), ids.flatten())
        loss.backward()
        opt.step()
    return trace.now() - start, sum(p.numel() for p in model.parameters())


def measure_dp(world_size, preset="h100-nvlink", config=TINYLLAMA, tokens=2048, timeout=120):
    """An emulated data-parallel step: rank 0's numbers beside the closed form (compute at the
    device's rate + the gradient all-reduce, unhidden: an upper bound of the overlapped step)."""
    cluster = resolve(preset)
    results = distlab.run(dp_step, world_size, config, tokens, emulate=cluster, timeout=timeout)
    seconds, params = max(r[0] for r in results), results[0][1]
    t = results.trace
    flops = sum(s["flops"] or 0 for s in t.compute(0) if s["name"] == "step")
    # The data-parallel all-reduces (the blocks' tensor-parallel ones run in groups of one).
    events = [e for e in t.comm(0) if e["label"] == ["step"] and len(e["group"]) == world_size]
    grad_bytes = params * torch.finfo(config["dtype"]).bits // 8
    compute = cluster.device.seconds(flops, 0, config["dtype"])
    comm = comm_seconds("all_reduce", grad_bytes, world_size,
                        cluster.link_between(range(world_size)))
    return dict(world_size=world_size, params=params, seconds=seconds, flops=flops,
                comm_bytes=sum(e["bytes"] for e in events), buckets=len(events),
                compute=compute, comm=comm, ratio=seconds / (compute + comm), meta=t.meta)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="h100-nvlink")
    parser.add_argument("--tp", default="2,4,8")
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--dp", default="2,8")
    parser.add_argument("--dp-tokens", type=int, default=2048)
    args = parser.parse_args()
    print(f"Llama-2 7B block, {args.tokens} tokens, bf16, forward + backward on the meta device "
          f"(emulated on {args.preset}; no values computed)")
    print(f"{'tp':>3} {'step (emulated)':>16} {'TFLOP/rank':>11} {'comm MB/rank':>13} "
          f"{'closed form':>12} {'emulated/closed':>16}")
    for tp in (int(n) for n in args.tp.split(",")):
        r = measure(tp, args.preset, tokens=args.tokens)
        print(f"{tp:>3} {r['seconds'] * 1e3:>13.2f} ms {r['flops'] / 1e12:>11.2f} "
              f"{r['comm_bytes'] / 1e6:>13.1f} {r['closed_form'] * 1e3:>9.2f} ms "
              f"{r['ratio']:>16.2f}")
        if abs(r["flops"] - r["closed_form_flops"]) > 1e-6 * r["flops"]:
            print(f"    FLOPs: the trace counts {r['flops']:.4g}, the formula "
                  f"{r['closed_form_flops']:.4g}")
    print()
    print(f"Data-parallel step of a {TINYLLAMA['layers']}-layer Llama (TinyLlama-1.1B's shape, "
          f"full attention heads), {args.dp_tokens} tokens per rank, bf16, the course's "
          f"BucketedDDP (emulated on {args.preset}; no values computed)")
    print(f"{'dp':>3} {'params':>8} {'step (emulated)':>16} {'TFLOP/rank':>11} "
          f"{'all-reduced GB':>15} {'buckets':>8} {'compute + comm':>15} {'emulated/closed':>16}")
    for dp in (int(n) for n in args.dp.split(",")):
        r = measure_dp(dp, args.preset, tokens=args.dp_tokens)
        print(f"{dp:>3} {r['params'] / 1e9:>7.2f}B {r['seconds'] * 1e3:>13.1f} ms "
              f"{r['flops'] / 1e12:>11.1f} {r['comm_bytes'] / 1e9:>15.2f} {r['buckets']:>8} "
              f"{(r['compute'] + r['comm']) * 1e3:>12.1f} ms {r['ratio']:>16.2f}")


if __name__ == "__main__":
    main()
