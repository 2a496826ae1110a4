"""Workbook 09's references and the data its checks build: never displayed, refused to learners."""
import math

import torch

from ... import moe as moe_lib
from ...moe import make_moe


D_MODEL = 8


def _capacity(n_tokens, n_experts, top_k, capacity_factor):
    if capacity_factor is None:
        return None
    return math.ceil(capacity_factor * n_tokens * top_k / n_experts)


def _priority_order(probs):
    """Tokens by their top-1 probability, highest first; ties: the earlier token first."""
    return torch.sort(probs.max(dim=-1).values, descending=True, stable=True).indices


def _queue_positions(experts, order, n_experts):
    """(T, k) place of each assignment in its expert's queue, when the slots are served in turn
    (all first choices, then all second ones, ...) and inside a slot the tokens in `order`."""
    T, k = experts.shape
    position = torch.empty_like(experts)
    filled = torch.zeros(n_experts, dtype=torch.long)
    for slot in range(k):
        for t in order.tolist():
            e = int(experts[t, slot])
            position[t, slot] = filled[e]
            filled[e] += 1
    return position


def _reference_route(logits, top_k, capacity_factor):
    """Batch-prioritized top-k routing: (probs, experts, gates, keep, capacity, position)."""
    probs = torch.softmax(logits, dim=-1)
    gates, experts = probs.topk(top_k, dim=-1)
    if top_k > 1:
        gates = gates / gates.sum(dim=-1, keepdim=True)
    capacity = _capacity(len(logits), logits.shape[-1], top_k, capacity_factor)
    position = _queue_positions(experts, _priority_order(probs.detach()), logits.shape[-1])
    keep = torch.ones_like(experts, dtype=torch.bool) if capacity is None else position < capacity
    return probs, experts, gates, keep, capacity, position


def _group_reference(experts_of_ranks, n_experts, capacity_factor):
    """Keep masks per rank when the capacity counts the whole group: one process on the
    concatenated batch (rank 0's tokens first), every first choice before any second one."""
    experts = torch.cat(experts_of_ranks)
    k = experts.shape[1]
    capacity = _capacity(len(experts), n_experts, k, capacity_factor)
    position = _queue_positions(experts, torch.arange(len(experts)), n_experts)
    keep = position < capacity
    sizes = [len(e) for e in experts_of_ranks]
    return capacity, list(keep.split(sizes)), list(position.split(sizes))


def _one_process_layer(moe, x, routing):
    """The MoE layer in one process with a given routing: (output, gradient-carrying)."""
    out = torch.zeros_like(x)
    experts, gates, keep = routing
    for e, expert in enumerate(moe.experts):
        token, slot = ((experts == e) & keep).nonzero(as_tuple=True)
        out = out.index_add(0, token, gates[token, slot].unsqueeze(-1) * expert(x[token]))
    return out


def _tokens(rank, n, seed=300):
    g = torch.Generator().manual_seed(seed + rank)
    return torch.randn(n, D_MODEL, generator=g, dtype=torch.float64)


def _skewed_layer(n_experts, top_k, capacity_factor):
    moe = make_moe(seed=4, dtype=torch.float64, d_model=D_MODEL, hidden=16,
                   n_experts=n_experts, top_k=top_k, capacity_factor=capacity_factor)
    with torch.no_grad():
        moe.router.bias[0] = 1.5      # a crowd on expert 0: uneven splits, and drops
    return moe


def _group_case(rank, n_experts, top_k, seed):
    """This rank's (T_r, k) chosen experts: 3 to 10 tokens, a crowd on one expert."""
    g = torch.Generator().manual_seed(seed + 7919 * rank)
    n = int(torch.randint(3, 11, (1,), generator=g))
    logits = torch.randn(n, n_experts, generator=g, dtype=torch.float64)
    logits[: n // 2 + 1, int(torch.randint(n_experts, (1,), generator=g))] += 3.0
    return logits.topk(top_k, dim=-1).indices


def _dispatch_case(rank, n_experts, top_k, capacity, d, seed):
    """This rank's tokens, chosen experts and keep (per-source capacity, the chapter's rule)."""
    g = torch.Generator().manual_seed(seed + 104729 * rank)
    n = int(torch.randint(2, 9, (1,), generator=g))
    x = torch.randn(n, d, generator=g, dtype=torch.float64)
    logits = torch.randn(n, n_experts, generator=g, dtype=torch.float64)
    logits[: (n + 1) // 2, rank % n_experts] += 2.5           # a crowd: drops, uneven rows
    experts = logits.topk(top_k, dim=-1).indices
    keep = moe_lib.capacity_keep(experts, n_experts, capacity)
    return x, experts, keep


def _dispatch_reference(inputs, n_experts, capacity):
    """What each rank of a group must hold: [source, local expert, slot, d], zeros as padding."""
    n = len(inputs)
    local = n_experts // n
    d = inputs[0][0].shape[1]
    out = [torch.zeros(n, local, capacity, d, dtype=torch.float64) for _ in range(n)]
    for source, (x, experts, keep) in enumerate(inputs):
        for e in range(n_experts):
            token = ((experts == e) & keep).any(dim=1).nonzero().squeeze(1)
            out[e // local][source, e % local, :len(token)] = x[token]
    return out
