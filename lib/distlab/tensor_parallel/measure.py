"""Comparing a tensor-parallel module with its dense model, and measuring what it saves."""
import torch
import torch.distributed as dist
import torch.nn as nn

from .. import _argcheck as check
from .layers import per_rank


def dense_shards(tp_module, dense_module, grads=False):
    """{name: this rank's shard of the dense module's parameter (or its .grad: None where the
    dense one has none, a frozen parameter's)} for every parameter of `tp_module`; the names are
    the same in both modules."""
    out = {}
    for name, _ in tp_module.named_parameters():
        owner, _, attr = name.rpartition(".")
        full = getattr(dense_module.get_submodule(owner), attr)
        full = full.grad if grads else full.detach()
        sub = tp_module.get_submodule(owner)
        out[name] = sub.shard_of(full) if hasattr(sub, "shard_of") and full is not None else full
    return out


def sequence_slice(x, group, dim=1):
    """Rank r's slice of a full tensor along the sequence (a plain slice: no communication)."""
    n = per_rank(check.tensor(x, "x").shape[dim], group, "seq_len")
    return x.narrow(dim, dist.get_rank(group) * n, n)


def saved_activation_bytes(fn, *args):
    """(result, bytes) of `fn(*args)`, bytes = the tensors autograd saved for backward, each
    storage counted once and parameters left out (they are weights, not activations)."""
    params, seen = set(), set()
    for a in args:
        if isinstance(a, nn.Module):
            params |= {p.untyped_storage().data_ptr() for p in a.parameters()}
    total = 0

    def pack(t):
        nonlocal total
        ptr = t.untyped_storage().data_ptr()
        if ptr not in params and ptr not in seen:
            seen.add(ptr)
            total += t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        result = fn(*args)
    return result, total
