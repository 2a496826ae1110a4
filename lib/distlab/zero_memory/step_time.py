"""ZeRO-3's time per block, closed form: its gathers, its compute, and what prefetch hides."""
import math

import torch

from .llama import LLAMA2_7B, llama_block_params


def zero3_block_seconds(cluster, world_size, tokens, shape=None, dtype=torch.bfloat16):
    """{"gather", "forward", "backward", "reduce_scatter"}: modeled seconds of one Llama block
    under ZeRO-3 on the first `world_size` ranks of `cluster` with `tokens` tokens per rank:
    its matmuls at the device's shape-dependent rate (Device.gemm_seconds), causal flash
    attention at the rate of its (s × s × head_dim) shape, backward twice the forward; the
    all-gather of its bf16 weights and the reduce-scatter of its bf16 gradient on the link the
    group sees (Cluster.link_between: one ring per NIC across nodes). The same formulas the
    emulator charges; elementwise work (norms, rotary, SiLU) is left out."""
    c = dict(LLAMA2_7B if shape is None else shape)
    h, a, f = c["hidden"], c["heads"], c["ffn"]
    dev = cluster.device
    mm = sum(dev.gemm_seconds(tokens, n, k, dtype) for n, k in
             ((3 * h, h), (h, h), (2 * f, h), (h, f)))
    d = h // a
    attn_flops = 4.0 * tokens * tokens * d * a * 0.5         # causal: half the s×s blocks
    attn = attn_flops / (dev.peak(dtype) * dev.gemm_efficiency(tokens, tokens, d, dtype, a))
    nbytes = torch.empty((), dtype=dtype).element_size() * llama_block_params(h, f)
    link = cluster.link_between(range(world_size))
    return {"gather": link.seconds("all_gather", nbytes, world_size),
            "forward": mm + attn, "backward": 2 * (mm + attn),
            "reduce_scatter": link.seconds("reduce_scatter", nbytes, world_size)}


def hiding_tokens(cluster, world_size, shape=None, dtype=torch.bfloat16):
    """The fewest tokens per rank (a power of two) at which one block's forward takes at least
    as long as its all-gather: from there on prefetching can hide ZeRO-3's gathers."""
    tokens = 64
    while tokens < 2 ** 20:
        t = zero3_block_seconds(cluster, world_size, tokens, shape, dtype)
        if t["forward"] >= t["gather"]:
            return tokens
        tokens *= 2
    return math.inf


def zero3_units_seconds(units, prefetch):
    """Modeled seconds of ZeRO-3's forward + backward over unequal units run in order, on one
    link per rank (memory.zero3_step_seconds for equal units generalised).

    units: dicts of seconds — "gather" (its weights' all-gather), "forward", "backward",
    "reduce_scatter" (its gradient, synchronous), and optionally "forward_after" /
    "backward_after": compute that runs after the unit and before the next unit's gather is
    asked for (attention between the q/k/v and output projections).
    Without prefetch nothing overlaps. With prefetch the next unit's gather (the previous one's
    in backward) runs on the link during this unit's compute; the reduce-scatter queues behind it.
    """
    n, total = len(units), 0.0
    get = lambda u, k: u.get(k, 0.0)     # noqa: E731
    for i, u in enumerate(units):            # forward
        compute = u["forward"] + get(u, "forward_after")
        if not prefetch:
            total += u["gather"] + compute
        else:
            total += (u["gather"] if i == 0 else 0.0)
            total += max(compute, units[i + 1]["gather"]) if i + 1 < n else compute
    for i in reversed(range(n)):             # backward
        u = units[i]
        if not prefetch:
            total += u["gather"] + u["backward"] + u["reduce_scatter"] + get(u, "backward_after")
        else:
            total += (u["gather"] if i == n - 1 else 0.0)
            behind = units[i - 1]["gather"] if i > 0 else 0.0
            total += max(u["backward"], behind) + u["reduce_scatter"] + get(u, "backward_after")
    return total


def llama_zero3_units(cluster, world_size, tokens, blocks, shape=None, dtype=torch.bfloat16):
    """The units ZeRO (distlab.sharding) gathers for a stack of LlamaBlocks — every module with
    parameters: norm, q/k/v, output projection, norm, gate/up, down — as zero3_units_seconds
    wants them: matmuls at Device.gemm_seconds, causal flash attention at its (s × s × head_dim)
    rate after the q/k/v unit (forward) and the output projection's reduce-scatter (backward),
    backward twice the forward, gathers and reduce-scatters of bf16 tensors on the group's link.
    Elementwise work (norms' arithmetic, rotary, SiLU, residual adds) is left out."""
    c = dict(LLAMA2_7B if shape is None else shape)
    h, a, f = c["hidden"], c["heads"], c["ffn"]
    dev, link = cluster.device, cluster.link_between(range(world_size))
    item = torch.empty((), dtype=dtype).element_size()
    d = h // a
    attn = (2.0 * tokens * tokens * d * a
            / (dev.peak(dtype) * dev.gemm_efficiency(tokens, tokens, d, dtype, a)))

    def unit(n_out, n_in, matmul=True):
        nbytes = item * n_out * n_in
        fwd = dev.gemm_seconds(tokens, n_out, n_in, dtype) if matmul else 0.0
        return {"gather": link.seconds("all_gather", nbytes, world_size), "forward": fwd,
                "backward": 2 * fwd, "reduce_scatter": link.seconds("reduce_scatter", nbytes,
                                                                     world_size)}
    units = []
    for _ in range(blocks):
        qkv, out = unit(3 * h, h), unit(h, h)
        qkv["forward_after"] = attn                # causal: half of 4·s²·d·a FLOPs
        out["backward_after"] = 2 * attn
        units += [unit(h, 1, False), qkv, out, unit(h, 1, False), unit(2 * f, h), unit(h, f)]
    return units


# ---- when ZeRO-3 becomes communication-bound: one line, and the emulated check ------------------

def comm_bound_tokens(rate, busbw, world_size):
    """Tokens per GPU below which ZeRO-3 (FSDP) is communication-bound: its per-layer all-gather
    (and reduce-scatter) outlast the layer's compute, so prefetch cannot hide them.

    A layer of P parameters at T tokens per GPU costs 2·P·T FLOPs forward and 4·P·T backward,
    at the achieved rate `rate` (FLOP/s). Its bf16 weights (2P bytes) are all-gathered before
    the forward and again before the backward; each GPU receives (N−1)/N of them, at the bus
    bandwidth `busbw` (bytes/s): (N−1)/N · 2P / B per gather. Backward adds a reduce-scatter of
    the same bytes. So

        forward:  2·P·T / F  ≥  (N−1)/N · 2P / B
        backward: 4·P·T / F  ≥  2 · (N−1)/N · 2P / B      (gather + reduce-scatter)

    and both give the same crossover, P cancelling:

        T* = (N−1)/N · F / B   tokens per GPU.

    Below T* the link sets the pace; above it prefetch can hide every gather but the first.
    F is the rate the layer's matmuls achieve (smaller shapes lower it, which moves T* down);
    latency is left out (it matters only for small layers). Chapter 05b's DDP rule T ≳ F/B is
    the same inequality for one all-reduce (2(N−1)/N · 2P bytes) behind backward only."""
    for name, value in (("rate", rate), ("busbw", busbw)):
        if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
            raise ValueError(f"{name} must be a positive number (FLOP/s, bytes/s); got {value!r}.")
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a whole number >= 1; got {world_size!r}.")
    return (world_size - 1) / world_size * rate / busbw


def zero3_forward_seconds(rank, world_size, token_counts, width=4096, layers=4):
    """For each token count: this rank's emulated seconds of one forward through `layers`
    square bf16 Linear layers (width × width, no bias) under the course's ZeRO-3 with prefetch,
    on meta tensors — each layer one unit, so the closed form's P = width² exactly. Run it
    under `distlab.run(..., emulate=...)`."""
    from .. import trace
    from ..sharding import ZeRO
    out = []
    for tokens in token_counts:
        with torch.device("meta"):
            model = torch.nn.Sequential(*(torch.nn.Linear(width, width, bias=False,
                                                          dtype=torch.bfloat16)
                                          for _ in range(layers)))
            x = torch.empty(tokens, width, dtype=torch.bfloat16)
        ZeRO(model, 3, optimizer="sgd", lr=0.1, prefetch=True)
        torch.distributed.barrier()
        start = trace.now()
        model(x)
        out.append(trace.now() - start)
    return out
