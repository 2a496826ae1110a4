"""The communication of tensor parallelism, as autograd Functions that come in conjugate pairs.

Each Function is named for what it does in forward and in backward. Backward always does the
*conjugate* of forward, because that is what the chain rule asks for:

    forward                     backward                    used by
    identity                    all-reduce (sum)            column-parallel input   (Megatron's f)
    all-reduce (sum)            identity                    row-parallel output     (Megatron's g)
    all-gather along `dim`      split along `dim`           column output, gathered
    split along `dim`           all-gather along `dim`      row input, from a full tensor
    all-gather along `dim`      reduce-scatter along `dim`  sequence parallel: enter a TP region
    reduce-scatter along `dim`  all-gather along `dim`      sequence parallel: leave a TP region

Why: if every rank uses the same x and produces its own y_r, then dL/dx = Σ_r dL/dy_r · dy_r/dx,
a sum over ranks. If y = Σ_r z_r, then dL/dz_r = dL/dy on every rank, no communication.

Every function takes its process group explicitly. `count_comm()` records what was sent, so a
notebook can count the bytes of a layer and compare them with the formula.
"""
import contextlib

import torch
import torch.distributed as dist

from . import _argcheck as check

_logs = []


@contextlib.contextmanager
def count_comm():
    """Record every collective of this module while the block runs: [(op, pass, nbytes)].

    nbytes is the size S of the full tensor the collective is about: the all-reduced tensor, the
    gathered result, the input of a reduce-scatter. That is the S of the α-β model (chapter 03).
    """
    log = []
    _logs.append(log)
    try:
        yield log
    finally:
        _logs.remove(log)


def _record(op, direction, tensor):
    for log in _logs:
        log.append((op, direction, tensor.numel() * tensor.element_size()))


def _size(group):
    return dist.get_world_size(group)


def _all_reduce(x, group, direction):
    _record("all_reduce", direction, x)
    x = x.contiguous().clone()  # never reduce in place into a tensor autograd may still need
    dist.all_reduce(x, group=group)
    return x


def _all_gather(x, dim, group, direction):
    n = _size(group)
    parts = [torch.empty_like(x, memory_format=torch.contiguous_format) for _ in range(n)]
    dist.all_gather(parts, x.contiguous(), group=group)
    out = torch.cat(parts, dim=dim)
    _record("all_gather", direction, out)
    return out


def _split(x, dim, group):
    n, rank = _size(group), dist.get_rank(group)
    if x.shape[dim] % n:
        raise ValueError(f"cannot split dimension {dim} of size {x.shape[dim]} evenly across "
                         f"{n} tensor-parallel ranks; make it a multiple of {n}.")
    return x.chunk(n, dim=dim)[rank].contiguous()


def _reduce_scatter(x, dim, group, direction):
    n = _size(group)
    if x.shape[dim] % n:
        raise ValueError(f"cannot reduce-scatter dimension {dim} of size {x.shape[dim]} across "
                         f"{n} tensor-parallel ranks; make it a multiple of {n}.")
    _record("reduce_scatter", direction, x)
    parts = [p.contiguous() for p in x.chunk(n, dim=dim)]
    out = torch.empty_like(parts[0])
    dist.reduce_scatter(out, parts, group=group)
    return out


class IdentityFwdAllReduceBwd(torch.autograd.Function):
    """f: every rank gets the same x; each rank's gradient w.r.t. x is partial, so sum them."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return _all_reduce(grad, ctx.group, "backward"), None


class AllReduceFwdIdentityBwd(torch.autograd.Function):
    """g: the output is the sum of the ranks' partial outputs; each partial gets the whole grad."""

    @staticmethod
    def forward(ctx, x, group):
        return _all_reduce(x, group, "forward")

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class AllGatherFwdSplitBwd(torch.autograd.Function):
    """Rebuild the full tensor from the ranks' slices; each slice's gradient is its own slice."""

    @staticmethod
    def forward(ctx, x, dim, group):
        ctx.dim, ctx.group = dim, group
        return _all_gather(x, dim, group, "forward")

    @staticmethod
    def backward(ctx, grad):
        return _split(grad, ctx.dim, ctx.group), None, None


class SplitFwdAllGatherBwd(torch.autograd.Function):
    """Keep this rank's slice of a replicated tensor; the full gradient needs every slice's."""

    @staticmethod
    def forward(ctx, x, dim, group):
        ctx.dim, ctx.group = dim, group
        return _split(x, dim, group)

    @staticmethod
    def backward(ctx, grad):
        return _all_gather(grad, ctx.dim, ctx.group, "backward"), None, None


class AllGatherFwdReduceScatterBwd(torch.autograd.Function):
    """Sequence parallel, entering a TP region: the gradient of a gathered copy used by every
    rank is the sum over ranks, and each rank keeps only its own slice of that sum."""

    @staticmethod
    def forward(ctx, x, dim, group):
        ctx.dim, ctx.group = dim, group
        return _all_gather(x, dim, group, "forward")

    @staticmethod
    def backward(ctx, grad):
        return _reduce_scatter(grad, ctx.dim, ctx.group, "backward"), None, None


class ReduceScatterFwdAllGatherBwd(torch.autograd.Function):
    """Sequence parallel, leaving a TP region: sum the partial outputs but keep only a slice
    of the sequence; the gradient of that slice is needed, whole, by every rank's partial."""

    @staticmethod
    def forward(ctx, x, dim, group):
        ctx.dim, ctx.group = dim, group
        return _reduce_scatter(x, dim, group, "forward")

    @staticmethod
    def backward(ctx, grad):
        return _all_gather(grad, ctx.dim, ctx.group, "backward"), None, None


# ---- the functional names the layers use ---------------------------------------------------------

def identity_fwd_all_reduce_bwd(x, group):
    return IdentityFwdAllReduceBwd.apply(_checked(x, group), group)


def all_reduce_fwd_identity_bwd(x, group):
    return AllReduceFwdIdentityBwd.apply(_checked(x, group), group)


def all_gather_fwd_split_bwd(x, group, dim=-1):
    return AllGatherFwdSplitBwd.apply(_checked(x, group), dim, group)


def split_fwd_all_gather_bwd(x, group, dim=-1):
    return SplitFwdAllGatherBwd.apply(_checked(x, group), dim, group)


def all_gather_fwd_reduce_scatter_bwd(x, group, dim=1):
    return AllGatherFwdReduceScatterBwd.apply(_checked(x, group), dim, group)


def reduce_scatter_fwd_all_gather_bwd(x, group, dim=1):
    return ReduceScatterFwdAllGatherBwd.apply(_checked(x, group), dim, group)


def _checked(x, group):
    # inside autograd.Function a list or a mesh-dimension name fails as an AttributeError
    check.group(group)
    return check.tensor(x, "x")
