"""Column- and row-parallel linear layers, and the replicated parameter: the pieces every
tensor-parallel module is built from."""
import math

import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.distributed as dist

from .. import _argcheck as check
from ..tp_comm import (all_gather_fwd_reduce_scatter_bwd, all_gather_fwd_split_bwd,
                       all_reduce_fwd_identity_bwd, identity_fwd_all_reduce_bwd,
                       reduce_scatter_fwd_all_gather_bwd, split_fwd_all_gather_bwd)


def per_rank(n, group, what):
    """n // tp, or a clear error when the ranks of `group` cannot share n evenly."""
    tp = dist.get_world_size(group)
    if n % tp:
        raise ValueError(f"{what} = {n} does not split evenly across {tp} tensor-parallel ranks; "
                         f"choose a multiple of {tp}.")
    return n // tp


class ColumnParallelLinear(nn.Module):
    """y = x Wᵀ + b, W (out × in) split by rows = output features; rank r holds out/tp of them.

    Every rank needs the whole x, so x enters through identity-forward / all-reduce-backward
    (or, sequence parallel, through all-gather / reduce-scatter along the sequence).
    `chunks`: the output is `chunks` stacked matrices (q, k, v) split one by one, so each rank
    gets its slice of every one of them, not a contiguous third of the stack; or a tuple of
    their sizes when they differ (grouped-query attention's q, k, v: (d, kv, kv)).
    `local_sizes`: the sizes of this rank's slices, in the same order.
    """

    def __init__(self, in_features, out_features, group=None, bias=True, gather_output=False,
                 sequence_parallel=False, chunks=1, dtype=None):
        super().__init__()
        in_features, out_features = _check_sizes(in_features, out_features, group)
        equal = isinstance(chunks, int)
        sizes = (out_features // chunks,) * chunks if equal else tuple(chunks)
        if (equal and out_features % chunks) or sum(sizes) != out_features:
            raise ValueError(f"out_features={out_features} is not {chunks} stacked matrices.")
        if gather_output and len(sizes) > 1:
            raise ValueError("gather_output would interleave the stacked matrices; gather each "
                             "one separately instead.")
        self.group, self.chunks, self.sizes = group, len(sizes), sizes
        self.tp, self.rank = dist.get_world_size(group), dist.get_rank(group)
        what = ("out_features" if len(sizes) == 1 else f"out_features / {chunks}" if equal
                else "out_features of a stacked matrix")
        self.local_sizes = tuple(per_rank(n, group, what) for n in sizes)
        local = sum(self.local_sizes)
        self.in_features, self.out_features = in_features, out_features
        self.gather_output, self.sequence_parallel = gather_output, sequence_parallel
        self.weight = nn.Parameter(torch.empty(local, in_features, dtype=dtype))
        self.bias = nn.Parameter(torch.empty(local, dtype=dtype)) if bias else None
        _reset(self, in_features)

    def shard_of(self, full):
        """This rank's shard of a full (out × in) weight or (out,) bias — or of its gradient."""
        parts = full.split(self.sizes, dim=0)
        return torch.cat([p.chunk(self.tp, dim=0)[self.rank] for p in parts], dim=0)

    @classmethod
    def from_dense(cls, linear, group=None, **kw):
        check.instance(linear, nn.Linear, f"{cls.__name__}.from_dense's layer", "an nn.Linear")
        layer = cls(linear.in_features, linear.out_features, group, linear.bias is not None,
                    dtype=linear.weight.dtype, **kw)
        _copy_shards(layer, linear)
        # shards live where the dense layer lived
        return match_dense(layer.to(linear.weight.device), linear, f"{cls.__name__}.from_dense")

    def forward(self, x):
        _check_input(self, x, self.in_features)
        if self.sequence_parallel:
            x = all_gather_fwd_reduce_scatter_bwd(x, self.group, dim=1)
        else:
            x = identity_fwd_all_reduce_bwd(x, self.group)
        y = F.linear(x, self.weight, self.bias)
        return all_gather_fwd_split_bwd(y, self.group, dim=-1) if self.gather_output else y


class RowParallelLinear(nn.Module):
    """y = x Wᵀ + b, W split by columns = input features; rank r holds in/tp of them.

    Rank r multiplies its slice of x's features by its slice of W: a partial sum of the full y.
    The partials are all-reduced (or, sequence parallel, reduce-scattered along the sequence).
    The bias is replicated and added once, after the sum.
    """

    def __init__(self, in_features, out_features, group=None, bias=True, input_is_parallel=True,
                 sequence_parallel=False, dtype=None):
        super().__init__()
        in_features, out_features = _check_sizes(in_features, out_features, group)
        self.group = group
        self.tp, self.rank = dist.get_world_size(group), dist.get_rank(group)
        local = per_rank(in_features, group, "in_features")
        self.in_features, self.out_features = in_features, out_features
        self.input_is_parallel, self.sequence_parallel = input_is_parallel, sequence_parallel
        self.weight = nn.Parameter(torch.empty(out_features, local, dtype=dtype))
        self.bias = nn.Parameter(torch.empty(out_features, dtype=dtype)) if bias else None
        _reset(self, in_features)

    def shard_of(self, full):
        return full.chunk(self.tp, dim=1)[self.rank] if full.dim() == 2 else full

    @classmethod
    def from_dense(cls, linear, group=None, **kw):
        check.instance(linear, nn.Linear, f"{cls.__name__}.from_dense's layer", "an nn.Linear")
        layer = cls(linear.in_features, linear.out_features, group, linear.bias is not None,
                    dtype=linear.weight.dtype, **kw)
        _copy_shards(layer, linear)
        # shards live where the dense layer lived
        return match_dense(layer.to(linear.weight.device), linear, f"{cls.__name__}.from_dense")

    def forward(self, x):
        _check_input(self, x, self.in_features // (self.tp if self.input_is_parallel else 1))
        if not self.input_is_parallel:
            x = split_fwd_all_gather_bwd(x, self.group, dim=-1)
        partial = F.linear(x, self.weight)
        if self.sequence_parallel:
            y = reduce_scatter_fwd_all_gather_bwd(partial, self.group, dim=1)
        else:
            y = all_reduce_fwd_identity_bwd(partial, self.group)
        if self.bias is None:
            return y
        # Sequence parallel: each rank's bias gradient covers only its part of the sequence.
        return y + (replicated(self.bias, self.group) if self.sequence_parallel else self.bias)


def _check_sizes(in_features, out_features, group):
    check.group(group)
    return (check.whole(in_features, "in_features", at_least=1),
            check.whole(out_features, "out_features", at_least=1))


def _check_input(layer, x, width):
    # sequence parallel gathers or scatters dim 1, so x needs a sequence dimension there
    sp = layer.sequence_parallel
    check.features(x, width, "x", layer.weight, at_least_dims=3 if sp else 1,
                   shape_hint="(batch, tokens, features)" if sp else "(..., features)")


def replicated(param, group):
    """A parameter every rank holds whole but uses on different data: sum its gradient."""
    return identity_fwd_all_reduce_bwd(param, group)


def _reset(layer, fan_in):
    # nn.Linear's init, with the FULL fan-in: a shard has the statistics of the dense layer.
    bound = 1 / math.sqrt(fan_in)
    with torch.no_grad():
        for p in (layer.weight, layer.bias):
            if p is not None:
                p.uniform_(-bound, bound)


def _copy_shards(layer, dense):
    with torch.no_grad():
        layer.weight.copy_(layer.shard_of(dense.weight))
        if layer.bias is not None:
            layer.bias.copy_(layer.shard_of(dense.bias))


def match_dense(tp, dense, who):
    """`tp` (built by `who` from `dense`, same parameter names) with what the dense module says
    beyond the values: which parameters are frozen, and which names share one Parameter.

    Fresh Parameters forget both: a frozen layer would train, and a tie would become two
    parameters, each trained on its own use's gradient. A tie is kept where every rank holds the
    whole parameter under each name (a LayerNorm's weight used twice: the uses' gradients add up
    in the one Parameter on every rank); a tie of a parameter split across ranks is refused."""
    uses = {}
    for name, p in dense.named_parameters(remove_duplicate=False):
        uses.setdefault(id(p), []).append(name)
    for names in (n for n in uses.values() if len(n) > 1):
        split = [n for n in names if tp.get_parameter(n).shape != dense.get_parameter(n).shape]
        if split:
            raise ValueError(f"{who} cannot keep {' and '.join(names)} tied: tensor parallelism "
                             f"splits {split[0]} across ranks; untie them (give each its own "
                             f"nn.Parameter) or leave them out of the tensor-parallel module.")
        whole = tp.get_parameter(names[0])
        for name in names[1:]:
            owner, _, attr = name.rpartition(".")
            setattr(tp.get_submodule(owner), attr, whole)
    for name, p in tp.named_parameters():
        p.requires_grad_(dense.get_parameter(name).requires_grad)
    return tp
