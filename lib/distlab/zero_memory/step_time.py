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
