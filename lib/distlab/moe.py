"""A mixture-of-experts layer in one process: the reference every expert-parallel run must equal.

    y, aux = moe(x)          x: (tokens, d_model) or (..., d_model); y has x's shape

For every token the ROUTER (a linear layer, then a softmax over the E experts) gives a probability
per expert; the token goes to its top-k experts (k = 1: Switch Transformer, k = 2: GShard/Mixtral)
and its output is the gate-weighted sum of those experts' outputs. Each expert is an ordinary
feed-forward network (`distlab.models.FeedForward`), so a token pays for k experts, not E.

Capacity. An expert accepts at most  capacity = ceil(capacity_factor · tokens · k / E)  tokens
per batch (None: no limit). Assignments compete in a fixed order — every token's first choice
before any second choice, and earlier tokens first — and the ones past the capacity are DROPPED:
that expert contributes nothing to that token. This layer returns zero for a token whose every
assignment was dropped; the caller's residual connection (h + moe(h)) then carries the token
through unchanged. Gates are not renormalised after dropping: a top-2 token that lost its second
choice keeps only its first expert's gate-weighted output.

Load balancing. The auxiliary loss of Switch Transformer,  aux = E · Σ_e f_e · P_e,  where f_e is
the fraction of assignments that chose expert e (before dropping) and P_e the mean router
probability of e. It is 1 when the load is uniform and grows as the router favours few experts;
f is a count (no gradient), so the gradient flows through P and lowers the probability of the
experts that are overloaded. Add `coef · aux` (coef ~ 0.01) to the training loss.
"""
import math
from typing import NamedTuple, Optional

import torch
import torch.nn as nn

from .models import FeedForward


class Routing(NamedTuple):
    """Where the tokens of one batch go. T tokens, E experts, k choices per token."""
    probs: torch.Tensor          # (T, E) router softmax
    experts: torch.Tensor        # (T, k) chosen experts, best first
    gates: torch.Tensor          # (T, k) their weights in the combination
    keep: torch.Tensor           # (T, k) False where the assignment was dropped (capacity)
    capacity: Optional[int]      # tokens one expert accepts (None: unlimited)

    @property
    def n_experts(self):
        return self.probs.shape[-1]

    def wanted(self):
        """(E,) assignments each expert was chosen for, before dropping."""
        return torch.bincount(self.experts.reshape(-1), minlength=self.n_experts)

    def load(self):
        """(E,) assignments each expert really processes, after dropping."""
        return torch.bincount(self.experts[self.keep], minlength=self.n_experts)

    def dropped_tokens(self):
        """How many tokens lost every one of their k assignments (the residual carries them)."""
        return int((~self.keep).all(dim=-1).sum())


def expert_capacity(n_tokens, n_experts, top_k, capacity_factor):
    if capacity_factor is None:
        return None
    return math.ceil(capacity_factor * n_tokens * top_k / n_experts)


def capacity_keep(experts, n_experts, capacity):
    """(T, k) mask of the assignments that fit: first choices before second ones, earlier tokens first."""
    if capacity is None:
        return torch.ones_like(experts, dtype=torch.bool)
    by_priority = experts.t().reshape(-1)                       # slot-major: all 1st choices first
    one_hot = nn.functional.one_hot(by_priority, n_experts)
    position = (one_hot.cumsum(0) * one_hot).sum(-1) - 1       # place in its expert's queue
    return (position < capacity).reshape(experts.shape[1], -1).t()


def route(logits, top_k=1, capacity_factor=None):
    """Top-k routing of (T, E) router logits, with the capacity applied."""
    n_experts = logits.shape[-1]
    if not 1 <= top_k <= n_experts:
        raise ValueError(f"top_k must be between 1 and the number of experts ({n_experts}); "
                         f"got {top_k}.")
    probs = logits.softmax(dim=-1)
    gates, experts = probs.topk(top_k, dim=-1)
    if top_k > 1:
        # Renormalise over the chosen experts (GShard, Mixtral): the k gates sum to 1.
        gates = gates / gates.sum(dim=-1, keepdim=True)
    capacity = expert_capacity(len(logits), n_experts, top_k, capacity_factor)
    return Routing(probs, experts, gates, capacity_keep(experts, n_experts, capacity), capacity)


def load_balancing_loss(routing):
    """Switch Transformer's auxiliary loss E · Σ f_e P_e: 1 for a uniform load, up to E."""
    f = routing.wanted().to(routing.probs.dtype) / routing.experts.numel()
    p = routing.probs.mean(dim=0)
    return routing.n_experts * (f * p).sum()


class MoE(nn.Module):
    """Router + E expert FFNs; forward returns (output, auxiliary loss)."""

    def __init__(self, d_model=16, hidden=32, n_experts=4, top_k=1, capacity_factor=None):
        super().__init__()
        self.top_k, self.capacity_factor = top_k, capacity_factor
        # A bias lets a router start skewed (the load-imbalance experiments set it); it is
        # zero-initialised so that a fresh router is fair.
        self.router = nn.Linear(d_model, n_experts)
        nn.init.zeros_(self.router.bias)
        self.experts = nn.ModuleList(FeedForward(d_model, hidden) for _ in range(n_experts))
        self.last_routing = None

    @property
    def n_experts(self):
        return len(self.experts)

    def route(self, tokens):
        routing = route(self.router(tokens), self.top_k, self.capacity_factor)
        self.last_routing = Routing(*(t.detach() if torch.is_tensor(t) else t for t in routing))
        return routing

    def forward(self, x):
        tokens = x.reshape(-1, x.shape[-1])
        routing = self.route(tokens)
        out = torch.zeros_like(tokens)
        for e, expert in enumerate(self.experts):
            token, slot = ((routing.experts == e) & routing.keep).nonzero(as_tuple=True)
            # Every expert runs, even on no tokens, so its gradient is zero rather than None.
            gate = routing.gates[token, slot].unsqueeze(-1)
            out = out.index_add(0, token, gate * expert(tokens[token]))
        return out.reshape(x.shape), load_balancing_loss(routing)


def make_moe(seed=0, dtype=torch.float32, **config):
    """An MoE layer with weights fixed by `seed` (same weights in every process)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return MoE(**config).to(dtype)


# ---- a small model around the layer, and its single-process training ------------------------------

class MoEModel(nn.Module):
    """Linear in → h + MoE(LayerNorm(h)) → Linear out: the smallest model with a real MoE block."""

    def __init__(self, in_dim=16, out_dim=4, d_model=16, hidden=32, n_experts=4, top_k=1,
                 capacity_factor=None):
        super().__init__()
        self.inp = nn.Linear(in_dim, d_model)
        self.norm = nn.LayerNorm(d_model)
        self.moe = MoE(d_model, hidden, n_experts, top_k, capacity_factor)
        self.head = nn.Linear(d_model, out_dim)

    def forward(self, x):
        h = self.inp(x)
        y, aux = self.moe(self.norm(h))
        return self.head(h + y), aux


def make_moe_model(seed=0, dtype=torch.float32, **config):
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return MoEModel(**config).to(dtype)


def shard_loss(model, x, y, aux_coef):
    """Task loss + aux_coef · auxiliary loss of one shard (one rank's batch)."""
    out, aux = model(x)
    return nn.functional.mse_loss(out, y) + aux_coef * aux


def train_moe_reference(model, steps, aux_coef=0.01, lr=0.05):
    """SGD in one process. steps: [[(x, y) of each shard], ...] — one list of shards per step.

    The loss of a step is the mean over its shards of `shard_loss`. Routing, capacity and the
    auxiliary loss are computed per shard, exactly as each rank computes them on its own batch.
    Returns [(loss, expert load of every shard)] per step.
    """
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    history = []
    for shards in steps:
        opt.zero_grad()
        loss, loads = 0.0, []
        for x, y in shards:
            loss = loss + shard_loss(model, x, y, aux_coef) / len(shards)
            loads.append(model.moe.last_routing.load())
        loss.backward()
        opt.step()
        history.append((loss.item(), torch.stack(loads)))
    return history
