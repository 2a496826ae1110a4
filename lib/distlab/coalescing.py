"""Coalescing: many small collectives as one, because every collective pays a fixed latency.

Three ways to all-gather N tensors (chapter 02):
- `gather_each`: one `all_gather_single` per tensor, N calls, N latencies;
- `gather_packed`: FSDP2's way (torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py:
  `foreach_all_gather` copies a parameter group's shards into this rank's slice of one flat
  buffer, issues ONE all-gather, and `foreach_all_gather_copy_out` views the result as
  (world_size, -1) and splits it along dim 1 back into parameters);
- `gather_coalesced`: the same N calls inside torch's private `dist._coalescing_manager`, which
  records `all_reduce`, `all_gather_single` and `reduce_scatter_single` calls and issues them as
  one `*_coalesced` call on the process group when the block ends. On NCCL that call puts the N
  collectives in one NCCL group (ProcessGroupNCCL::collectiveCoalesced); gloo flattens a
  coalesced all-reduce or all-gather into one operation. Any other collective in the block is
  not recorded: it runs at once, one call each.

`price` says what the difference costs on a modelled link (distlab.hardware).
"""
import math

import torch
import torch.distributed as dist

# Llama 3 (and 3.1) 8B's decoder layer, the 9 tensors FSDP2 all-gathers as one group: hidden
# 4096, 8 key/value heads of 128, SwiGLU feed-forward 14,336, no biases (Meta's config.json, as
# tabulated in oumi's configs/recipes/llama3_1/README.md; torchtitan's llama3 "8B" ModelArgs
# give the same).
LLAMA3_8B_LAYER = {"attention_norm": (4096,), "wq": (4096, 4096), "wk": (1024, 4096),
                   "wv": (1024, 4096), "wo": (4096, 4096), "ffn_norm": (4096,),
                   "w1": (14336, 4096), "w2": (4096, 14336), "w3": (14336, 4096)}


def _check(tensors):
    if not isinstance(tensors, (list, tuple)) or not tensors \
            or not all(isinstance(t, torch.Tensor) for t in tensors):
        raise TypeError("pass a non-empty list of tensors, one per parameter shard; got "
                        f"{type(tensors).__name__}.")
    dtypes = {t.dtype for t in tensors}
    if len(dtypes) > 1:
        # FSDP2 views mixed dtypes as bytes (uint8) to pack them; this teaching version does not
        raise TypeError(f"one flat buffer holds one dtype; got {sorted(map(str, dtypes))}. "
                        "Pack each dtype separately (FSDP2 views them all as uint8 bytes).")


def _gathered(t, world_size):
    """The shape all_gather_single gives: the pieces concatenated along dim 0."""
    return (world_size * t.shape[0], *t.shape[1:]) if t.dim() else (world_size,)


def gather_each(tensors, group=None):
    """All-gather every tensor with its own collective: N tensors, N calls."""
    _check(tensors)
    world_size = dist.get_world_size(group)
    outs = [t.new_empty(_gathered(t, world_size)) for t in tensors]
    for out, t in zip(outs, tensors):
        dist.all_gather_single(out, t.contiguous(), group=group)
    return outs


def gather_packed(tensors, group=None):
    """All-gather every tensor with ONE collective on a flat buffer, as FSDP2 does."""
    _check(tensors)
    world_size, rank = dist.get_world_size(group), dist.get_rank(group)
    sizes = [t.numel() for t in tensors]
    total = sum(sizes)
    flat = tensors[0].new_empty(world_size * total)
    # copy-in: this rank's tensors, back to back, straight into its own slice of the output,
    # so the all-gather needs no separate input buffer
    mine = flat.narrow(0, rank * total, total)
    for slot, t in zip(mine.split(sizes), tensors):
        slot.copy_(t.reshape(-1))
    dist.all_gather_single(flat, mine, group=group)
    # copy-out: row r of the (world_size, total) view is what rank r packed; the columns of
    # tensor i hold piece r of that tensor in every row
    rows = flat.view(world_size, total).split(sizes, dim=1)
    return [r.reshape(_gathered(t, world_size)) for r, t in zip(rows, tensors)]


def gather_coalesced(tensors, group=None):
    """N all_gather_single calls inside torch's _coalescing_manager: issued as one call."""
    _check(tensors)
    world_size = dist.get_world_size(group)
    outs = [t.new_empty(_gathered(t, world_size)) for t in tensors]
    with dist._coalescing_manager(group):
        for out, t in zip(outs, tensors):
            dist.all_gather_single(out, t.contiguous(), group=group)
    return outs


def nbytes(shapes, dtype=torch.bfloat16):
    """Bytes of each tensor of `shapes` (a dict name -> shape) in `dtype`."""
    size = torch.empty((), dtype=dtype).element_size()
    return {name: math.prod(shape) * size for name, shape in shapes.items()}


def price(sizes, world_size, link, op="all_gather"):
    """Modelled seconds of one `op` per size (N latencies) and of one `op` on their sum, on a
    distlab.hardware Link. Sizes are the full tensors' bytes, as Link.seconds takes them."""
    sizes = list(sizes)
    each = sum(link.seconds(op, n, world_size) for n in sizes)
    return each, link.seconds(op, sum(sizes), world_size)
