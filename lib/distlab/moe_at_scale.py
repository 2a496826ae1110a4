"""What production MoE layers add around expert parallelism (chapter 09, section 6):

- permute + grouped GEMM: the rows a rank received, sorted by local expert, each expert's group
  padded to a multiple of `align` rows, and every expert's matmul in ONE grouped GEMM
  (torch._grouped_mm, what torchtitan calls; its groups are aligned to 8 rows) instead of a loop
  of small matmuls;
- expert × tensor parallelism (EP × TP): each expert's hidden units split over a tp group — the
  first matrix by columns, the second by rows, as chapter 07's MLP — so that an expert larger
  than one GPU, or more GPUs than experts, still fit; the tp ranks hold the same tokens, route
  them alike, and sum their partial expert outputs with one all-reduce before the combine;
- the shared expert run while the dispatch all-to-all travels (DeepSeek-V3), timed at full size
  on meta tensors under the emulator.

Each is proven equal to one process in tests/test_expert_parallel.py (the first two on values; the
third changes only time, and is timed).
"""
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from .expert_parallel import MIXTRAL_8X7B, ExpertParallelMoE, SwiGLUExpert, skewed_rows

ALIGN = 8       # rows per group a grouped GEMM wants in bf16 (torchtitan's TOKEN_GROUP_ALIGN_SIZE_M)


# ---- permute + grouped GEMM --------------------------------------------------------------------------

def permute(expert_of_row, n_experts, align=ALIGN):
    """(index, offsets, padded): row `index[j]` goes to slot j of the permuted buffer (-1: a
    padding row), each expert's group padded to a multiple of `align`; offsets are the groups'
    cumulative ends, as a grouped GEMM takes them."""
    counts = torch.bincount(expert_of_row, minlength=n_experts)
    padded = (counts + align - 1) // align * align
    ends = padded.cumsum(0)
    index = torch.full((int(ends[-1]) if n_experts else 0,), -1, dtype=torch.long)
    by_expert = torch.argsort(expert_of_row, stable=True)
    starts = ends - padded
    place = torch.arange(len(by_expert)) - (counts.cumsum(0) - counts).repeat_interleave(counts)
    index[starts.repeat_interleave(counts) + place] = by_expert
    return index, ends.to(torch.int32), int(ends[-1] - counts.sum()) if n_experts else 0


def grouped_experts(rows, expert_of_row, experts, align=ALIGN):
    """Every local expert (chapter 07's FeedForward: fc2(gelu(fc1(x)))) on its rows at once:
    permute, two grouped GEMMs, un-permute. Returns (outputs in the rows' order, padding rows)."""
    index, ends, padding = permute(expert_of_row, len(experts), align)
    real = index >= 0
    permuted = rows.new_zeros(len(index), rows.shape[1])
    permuted[real] = rows[index[real]]
    sizes = torch.diff(ends, prepend=ends.new_zeros(1)).long()       # padded rows per expert
    group = torch.arange(len(experts)).repeat_interleave(sizes)
    w1 = torch.stack([e.fc1.weight for e in experts]).transpose(1, 2)     # (E, d, h)
    w2 = torch.stack([e.fc2.weight for e in experts]).transpose(1, 2)     # (E, h, d)
    b1 = torch.stack([e.fc1.bias for e in experts])
    b2 = torch.stack([e.fc2.bias for e in experts])
    hidden = F.gelu(torch._grouped_mm(permuted, w1, offs=ends) + b1[group])
    out = torch._grouped_mm(hidden, w2, offs=ends) + b2[group]
    back = rows.new_empty(rows.shape[0], out.shape[1])
    back[index[real]] = out[real]
    return back, padding


class GroupedExpertParallelMoE(ExpertParallelMoE):
    """The expert-parallel layer with its local experts run as one grouped GEMM."""

    def _run_local_experts(self, received, incoming):
        expert_of_row = torch.arange(self.n_local).repeat(self.ep_size)
        expert_of_row = expert_of_row.repeat_interleave(incoming.reshape(-1).cpu())
        out, self.stats_padding = grouped_experts(received, expert_of_row, self.experts)
        return out


# ---- expert × tensor parallelism ---------------------------------------------------------------------

class CopyToTP(torch.autograd.Function):
    """forward: identity (every tp rank holds the same rows); backward: all-reduce over tp —
    each rank's shard of fc1 gives only its part of the rows' gradient (chapter 07's f)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class SumOverTP(torch.autograd.Function):
    """forward: all-reduce the partial expert outputs over tp; backward: identity (each tp rank
    already holds the whole gradient of the summed output: chapter 07's g)."""

    @staticmethod
    def forward(ctx, x, group):
        x = x.clone()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def ep_tp_groups(ep, tp):
    """(this rank's EP group, its TP group) with rank = e·tp + t: the tp ranks of one expert
    shard are neighbours (inside a node), the EP group strides over them. Every rank builds
    every group, in the same order."""
    rank = dist.get_rank()
    if ep * tp != dist.get_world_size():
        raise ValueError(f"ep × tp = {ep} × {tp} needs {ep * tp} ranks; this run has "
                         f"{dist.get_world_size()}.")
    ep_groups = [dist.new_group([e * tp + t for e in range(ep)]) for t in range(tp)]
    tp_groups = [dist.new_group([e * tp + t for t in range(tp)]) for e in range(ep)]
    return ep_groups[rank % tp], tp_groups[rank // tp]


class ExpertTensorParallelMoE(ExpertParallelMoE):
    """EP over `group`, and each local expert's hidden units split over `tp_group`: this rank
    keeps fc1's rows [t·h/tp, (t+1)·h/tp) (with their bias) and the same columns of fc2; fc2's
    bias is added once, after the sum. Every tp rank brings the same tokens."""

    def __init__(self, moe, group, tp_group):
        super().__init__(moe, group)
        self.tp_group = tp_group
        tp, t = dist.get_world_size(tp_group), dist.get_rank(tp_group)
        hidden = self.experts[0].fc1.out_features
        if hidden % tp:
            raise ValueError(f"an expert's {hidden} hidden units do not split over tp = {tp}.")
        part = slice(t * hidden // tp, (t + 1) * hidden // tp)
        for expert in self.experts:
            with torch.no_grad():
                expert.fc1.weight = nn.Parameter(expert.fc1.weight[part].clone())
                expert.fc1.bias = nn.Parameter(expert.fc1.bias[part].clone())
                expert.fc2.weight = nn.Parameter(expert.fc2.weight[:, part].clone())
            expert.fc1.out_features = expert.fc2.in_features = hidden // tp

    def _run_local_experts(self, received, incoming):
        expert_of_row = torch.arange(self.n_local).repeat(self.ep_size)
        expert_of_row = expert_of_row.repeat_interleave(incoming.reshape(-1).cpu())
        out = received.new_zeros(received.shape)
        for e, expert in enumerate(self.experts):
            rows = (expert_of_row == e).nonzero().squeeze(1)
            mine = CopyToTP.apply(received[rows], self.tp_group)
            partial = F.linear(F.gelu(expert.fc1(mine)), expert.fc2.weight)
            out = out.index_add(0, rows, SumOverTP.apply(partial, self.tp_group) + expert.fc2.bias)
        return out


# ---- the shared expert while the dispatch travels (full size, meta tensors, emulated) -----------------

def shared_overlap_step(rank, world_size, overlap, tokens=8192, config=MIXTRAL_8X7B):
    """One layer's forward on meta tensors: a Mixtral-8x7B-sized routed expert per rank (balanced
    fixed routing) plus one shared expert of the same width on every token. With `overlap`, the
    dispatch all-to-all is launched asynchronously and the shared expert runs while it travels.
    Returns (layer seconds, dispatch seconds alone) on this rank's virtual clock."""
    from . import trace
    rows = skewed_rows(tokens, config["top_k"], config["n_experts"], 1.0)
    rows = rows[:world_size] if world_size < len(rows) else rows
    send, recv = rows, [rows[rank]] * world_size
    d = config["d_model"]
    with torch.device("meta"):
        routed, shared = SwiGLUExpert(**config), SwiGLUExpert(**config)
        x = torch.empty(tokens, d, dtype=config["dtype"])
        outgoing = torch.empty(sum(send), d, dtype=config["dtype"])
        arrived = torch.empty(sum(recv), d, dtype=config["dtype"])
        back = torch.empty(sum(send), d, dtype=config["dtype"])
    dist.barrier()
    t0 = trace.now()
    dist.all_to_all_single(arrived, outgoing, recv, send)
    dispatch = trace.now() - t0
    dist.barrier()
    start = trace.now()
    if overlap:
        work = dist.all_to_all_single(arrived, outgoing, recv, send, async_op=True)
        common = shared(x)
        work.wait()
    else:
        dist.all_to_all_single(arrived, outgoing, recv, send)
        common = shared(x)
    dist.all_to_all_single(back, routed(arrived), send, recv)
    del common
    return trace.now() - start, dispatch


# ---- when the all-to-all stops hiding: one line, and the emulated check ---------------------------

def comm_bound_width(rate, busbw, ep, top_k=None):
    """The expert width f (a SwiGLU's hidden size) below which an expert-parallel layer's
    all-to-all outlasts the compute that could hide it. Tokens per GPU and the model width d
    cancel.

    A SwiGLU of width f costs 6·d·f FLOPs per row forward (three d × f matmuls), at the
    achieved rate C. An all-to-all of R rows of d bf16 values sends (ep−1)/ep of them off the
    rank (balanced routing), (ep−1)/ep · 2·R·d bytes at the bus bandwidth B. With T tokens:

    - `top_k=None`, the routed experts against dispatch + combine: k·T rows computed, two
      all-to-alls of k·T rows each: 2·(ep−1)/ep·2kTd / B against 6kTdf / C, so
          f* = 2(ep−1)/ep · C / (3B)                              (top-k cancels too);
    - `top_k=k`, a shared expert (T rows) computed while the dispatch (k·T rows) travels, as
      DeepSeek-V3 overlaps them: (ep−1)/ep·2kTd / B against 6Tdf / C, so
          f* = (ep−1)/ep · k · C / (3B).

    Above f* the compute lasts longer and can hide the exchange (if the code overlaps them);
    below, the layer is communication-bound. Latency and GEMM efficiency at small row counts
    (which depend on T and k) are left out; imbalance makes the busiest rank's share larger."""
    if isinstance(ep, bool) or not isinstance(ep, int) or ep < 1:
        raise ValueError(f"ep must be a whole number >= 1; got {ep!r}.")
    if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 1):
        raise ValueError(f"top_k must be None or a whole number >= 1; got {top_k!r}.")
    for name, value in (("rate", rate), ("busbw", busbw)):
        if not (isinstance(value, (int, float)) and value == value and 0 < value < float("inf")):
            raise ValueError(f"{name} must be a positive number (FLOP/s, bytes/s); got {value!r}.")
    rows = 2 if top_k is None else top_k
    return (ep - 1) / ep * rows * rate / (3 * busbw)


def shared_hiding_step(rank, world_size, widths, tokens=8192, d_model=4096, top_k=2):
    """For each shared-expert width: this rank's emulated seconds of (the dispatch alone, the
    shared expert alone, the dispatch launched asynchronously with the shared expert run while
    it travels), on meta tensors: `tokens` tokens of `d_model`, `top_k` rows each, spread evenly
    over the ranks (balanced routing)."""
    from . import trace
    per_peer = tokens * top_k // world_size
    splits = [per_peer] * world_size
    out = []
    for ffn in widths:
        with torch.device("meta"):
            shared = SwiGLUExpert(d_model, ffn)
            x = torch.empty(tokens, d_model, dtype=torch.bfloat16)
            rows = torch.empty(per_peer * world_size, d_model, dtype=torch.bfloat16)
            arrived = torch.empty_like(rows)
        times = []
        for part in ("dispatch", "shared", "overlapped"):
            dist.barrier()
            start = trace.now()
            if part != "shared":
                work = dist.all_to_all_single(arrived, rows, splits, splits, async_op=True)
            if part != "dispatch":
                shared(x)
            if part != "shared":
                work.wait()
            times.append(trace.now() - start)
        out.append(tuple(times))
    return out
