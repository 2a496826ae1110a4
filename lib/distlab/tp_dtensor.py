"""The same tensor-parallel block with torch's DTensor API: `parallelize_module` over a DeviceMesh.

ColwiseParallel shards a Linear's weight into contiguous row blocks. distlab.models.Block fuses
q, k and v into one `qkv` Linear [q; k; v], so a contiguous split would give rank 0 all of q and
none of v: the wrong heads. torchtitan writes q, k and v as three Linears for this reason, and
so does `SeparateQKVAttention` below, loaded with the fused block's weights (same numbers).
Its forward infers the number of heads from the tensor (view(b, t, -1, head_dim)), so on a rank
it runs n_heads/tp heads without being told.
"""
import copy

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput,
                                               RowwiseParallel, SequenceParallel,
                                               parallelize_module)


class SeparateQKVAttention(nn.Module):
    """distlab.models.Attention (or GroupedQueryAttention) with q, k, v as three Linears (same
    weights, same results)."""

    def __init__(self, attn):
        super().__init__()
        d = attn.proj.in_features
        self.head_dim = d // attn.n_heads
        kv = (getattr(attn, "n_kv_heads", None) or attn.n_heads) * self.head_dim
        dtype = attn.proj.weight.dtype
        self.q, self.k, self.v = (nn.Linear(d, width, dtype=dtype) for width in (d, kv, kv))
        with torch.no_grad():
            for lin, w, b in zip((self.q, self.k, self.v), attn.qkv.weight.split((d, kv, kv)),
                                 attn.qkv.bias.split((d, kv, kv))):
                lin.weight.copy_(w)
                lin.bias.copy_(b)
        for lin in (self.q, self.k, self.v):        # fresh Parameters: a frozen qkv stays so
            lin.weight.requires_grad_(attn.qkv.weight.requires_grad)
            lin.bias.requires_grad_(attn.qkv.bias.requires_grad)
        self.proj = copy.deepcopy(attn.proj)

    def forward(self, x):
        b, t, _ = x.shape
        q, k, v = (lin(x).view(b, t, -1, self.head_dim).transpose(1, 2)
                   for lin in (self.q, self.k, self.v))
        # grouped-query: this rank's query heads read its K/V heads in groups, as in the dense
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                           enable_gqa=q.shape[1] != k.shape[1])
        return self.proj(y.transpose(1, 2).reshape(b, t, -1))


def tp_plan(sequence_parallel=False):
    """The parallelize_module plan for a Block whose attention is SeparateQKVAttention."""
    if not sequence_parallel:
        return {"attn.q": ColwiseParallel(), "attn.k": ColwiseParallel(),
                "attn.v": ColwiseParallel(), "attn.proj": RowwiseParallel(),
                "mlp.fc1": ColwiseParallel(), "mlp.fc2": RowwiseParallel()}
    # LayerNorms see a slice of the sequence; each TP region gathers it at the door and
    # reduce-scatters its output back into slices.
    gather = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))
    return {"ln1": SequenceParallel(), "attn": gather,
            "attn.q": ColwiseParallel(), "attn.k": ColwiseParallel(), "attn.v": ColwiseParallel(),
            "attn.proj": RowwiseParallel(output_layouts=Shard(1)),
            "ln2": SequenceParallel(), "mlp": copy.deepcopy(gather),
            "mlp.fc1": ColwiseParallel(), "mlp.fc2": RowwiseParallel(output_layouts=Shard(1))}


def parallelize_block(block, mesh, sequence_parallel=False):
    """A tensor-parallel copy of distlab.models.Block `block`, made by torch's DTensor API."""
    kv_heads, tp = getattr(block.attn, "n_kv_heads", None), mesh.size()
    if kv_heads is not None and kv_heads % tp:
        raise ValueError(
            f"ColwiseParallel cuts k and v into {tp} contiguous blocks of rows, which would split "
            f"the block's {kv_heads} K/V heads; torch's plan needs a tp that divides "
            f"n_kv_heads. Past n_kv_heads, chapter 07's ParallelAttention splits each K/V head "
            f"and all-gathers it, as Megatron-LM does.")
    twin = copy.deepcopy(block)
    twin.attn = SeparateQKVAttention(block.attn)
    return parallelize_module(twin, mesh, tp_plan(sequence_parallel))


def local_grads(module):
    """{name: this rank's gradient shard} with the names and layout of distlab's ParallelBlock.

    Gradients DTensor left Partial (summed lazily, e.g. LayerNorm's under sequence parallel)
    are reduced first; q, k, v are stacked as ParallelBlock's `qkv` stacks them.
    """
    out = {}
    for name, p in module.named_parameters():
        g = p.grad
        if isinstance(g, DTensor):
            placements = [Replicate() if isinstance(pl, Partial) else pl for pl in g.placements]
            g = g.redistribute(g.device_mesh, placements).to_local()
        out[name] = g
    for kind in ("weight", "bias"):
        parts = [out.pop(f"attn.{z}.{kind}") for z in "qkv"]
        out[f"attn.qkv.{kind}"] = None if parts[0] is None else torch.cat(parts, dim=0)
    return out
