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
experts that are overloaded. Add `coef · aux` (coef ~ 0.01) to the training loss. Passing the
counts of a larger batch as `wanted` gives global-batch balancing (Qiu et al. 2025, "Demons in
the detail"): f over the whole step, P over this micro-batch, weighted by its share of the
step's tokens. A batch with no token has no balancing loss and no z-loss (0, not 0/0).

The modern refinements, each an option of the same layer:
- aux-loss-free balancing (DeepSeek-V3, Wang et al. 2024): a per-expert `selection_bias` added
  to the scores for the top-k choice only (the gates stay the router's probabilities), moved
  after each step by `rate · sign(mean load − load)` (`update_selection_bias`): no gradient;
- router z-loss (ST-MoE, Zoph et al. 2022): mean of logsumexp(logits)², kept small so that the
  router's logits stay in the range where a low-precision softmax is accurate (`z_loss`);
- shared experts and fine-grained experts (DeepSeekMoE, Dai et al. 2024): `n_shared` FFNs every
  token passes through, beside m× more, m× narrower routed experts with m× the top-k
  (`fine_grained`);
- expert-choice routing (Zhou et al. 2022): each expert takes its top-C tokens, so every expert
  is exactly full and a token gets 0..E experts (`router="expert_choice"`).
"""
import math
from typing import NamedTuple, Optional

import torch
import torch.nn as nn

from . import _argcheck as check
from ._moe_checks import (_check_bias_update, _check_experts, _check_layer, _check_route,
                          _check_tokens, _check_wanted)
from .models import FeedForward


class Routing(NamedTuple):
    """Where the tokens of one batch go. T tokens, E experts, k choices per token."""
    probs: torch.Tensor          # (T, E) router softmax
    experts: torch.Tensor        # (T, k) chosen experts, best first
    gates: torch.Tensor          # (T, k) their weights in the combination
    keep: torch.Tensor           # (T, k) False where the assignment was dropped (capacity)
    capacity: Optional[int]      # tokens one expert accepts (None: unlimited)
    logits: Optional[torch.Tensor] = None   # (T, E) the router's logits (for the z-loss)

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
    _check_experts(experts, n_experts)
    if capacity is None:
        return torch.ones_like(experts, dtype=torch.bool)
    by_priority = experts.t().reshape(-1)                       # slot-major: all 1st choices first
    one_hot = nn.functional.one_hot(by_priority, n_experts)
    position = (one_hot.cumsum(0) * one_hot).sum(-1) - 1       # place in its expert's queue
    return (position < capacity).reshape(experts.shape[1], -1).t()


def route(logits, top_k=1, capacity_factor=None, selection_bias=None):
    """Top-k routing of (T, E) router logits, with the capacity applied.

    selection_bias (E,): added to the probabilities for CHOOSING the experts only (DeepSeek-V3's
    aux-loss-free balancing); the gates are the router's own probabilities."""
    _check_route(logits, top_k, capacity_factor, selection_bias)
    n_experts = logits.shape[-1]
    if not 1 <= top_k <= n_experts:
        raise ValueError(f"top_k must be between 1 and the number of experts ({n_experts}); "
                         f"got {top_k}.")
    probs = logits.softmax(dim=-1)
    scores = probs if selection_bias is None else probs.detach() + selection_bias
    experts = scores.topk(top_k, dim=-1).indices
    gates = probs.gather(-1, experts)
    if top_k > 1:
        # Renormalise over the chosen experts (GShard, Mixtral): the k gates sum to 1.
        gates = gates / gates.sum(dim=-1, keepdim=True)
    capacity = expert_capacity(len(logits), n_experts, top_k, capacity_factor)
    return Routing(probs, experts, gates, capacity_keep(experts, n_experts, capacity), capacity,
                   logits)


def expert_choice_route(logits, capacity_factor=1.0):
    """Expert-choice routing (Zhou et al. 2022): every expert takes the C = ceil(factor · T / E)
    tokens that give it the highest probability. Every expert is exactly full (no dropping, no
    balancing loss needed); a token gets anywhere from 0 to E experts. The Routing lists all E
    experts per token, `keep` marks the ones that chose it, the gates are the probabilities.
    The choice looks at the whole batch: in a decoder a token's experts depend on later tokens,
    which is why autoregressive LLMs route by token choice."""
    n_tokens, n_experts = logits.shape
    probs = logits.softmax(dim=-1)
    capacity = min(n_tokens, expert_capacity(n_tokens, n_experts, 1, capacity_factor))
    chosen = probs.detach().topk(capacity, dim=0).indices             # (C, E): tokens per expert
    keep = torch.zeros(n_tokens, n_experts, dtype=torch.bool, device=logits.device)
    keep[chosen, torch.arange(n_experts, device=logits.device)] = True
    experts = torch.arange(n_experts, device=logits.device).expand(n_tokens, n_experts)
    return Routing(probs, experts, probs, keep, capacity, logits)


def load_balancing_loss(routing, wanted=None, share=1.0):
    """Switch Transformer's auxiliary loss E · Σ f_e P_e: 1 for a uniform load, up to E.

    wanted: the per-expert counts f is taken from (default: this batch's). Pass the counts of the
    whole global batch (summed over micro-batches and data-parallel ranks) for global-batch
    balancing; P stays this batch's mean probability, which carries the gradient, weighted by
    `share`: this batch's tokens over the mean part's (T_here · parts / T_all), so that the mean
    over the parts is the whole batch's loss however its tokens were split. A batch with no token
    adds 0: it has nothing to balance, and its mean probability would be 0/0."""
    if not len(routing.probs):
        return routing.probs.sum()                 # 0, and a zero gradient for the router
    _check_wanted(wanted, routing.n_experts)
    wanted = routing.wanted() if wanted is None else wanted
    f = wanted.to(routing.probs.dtype) / wanted.sum()
    p = routing.probs.mean(dim=0) * share
    return routing.n_experts * (f * p).sum()


def z_loss(logits, share=1.0):
    """ST-MoE's router z-loss (Zoph et al. 2022, eq. 5): mean over tokens of logsumexp(logits)².
    It is zero-gradient in the probabilities and only shrinks the logits' scale. `share` as in
    load_balancing_loss (this batch's part of a larger batch's mean); no token adds 0."""
    squares = check.floating(logits, "logits").logsumexp(dim=-1).square()
    return squares.mean() * share if len(squares) else squares.sum()


def update_selection_bias(bias, load, rate):
    """DeepSeek-V3's aux-loss-free update (§2.1.2): after a step, each expert's selection bias
    moves by `rate` towards balance: up when the expert got fewer than the mean, down when more.
    `load` is the step's load of every expert, counted over the whole batch (all ranks)."""
    _check_bias_update(bias, load, rate)
    load = load.to(bias.dtype)
    bias.add_(rate * torch.sign(load.mean() - load))
    return bias


def max_violation(load):
    """MaxVio (Wang et al. 2024): how far the busiest expert is above the mean, as a fraction:
    max(load) / mean(load) − 1. 0 is perfect balance; E − 1 is every token on one expert."""
    load = check.tensor(load, "load").to(torch.float64)
    if not len(load) or load.sum() <= 0:
        raise ValueError("max_violation needs the load of at least one expert and at least one "
                         f"assignment; got no load ({load.tolist()}).")
    return float(load.max() / load.mean() - 1)


class MoE(nn.Module):
    """Router + E expert FFNs; forward returns (output, auxiliary loss)."""

    def __init__(self, d_model=16, hidden=32, n_experts=4, top_k=1, capacity_factor=None,
                 n_shared=0, shared_hidden=None, router="token_choice"):
        super().__init__()
        if router not in ("token_choice", "expert_choice"):
            raise ValueError(f"router must be 'token_choice' or 'expert_choice'; got {router!r}.")
        _check_layer(d_model, hidden, n_experts, top_k, capacity_factor, n_shared)
        self.top_k, self.capacity_factor, self.router_kind = top_k, capacity_factor, router
        # A bias lets a router start skewed (the load-imbalance experiments set it); it is
        # zero-initialised so that a fresh router is fair.
        self.router = nn.Linear(d_model, n_experts)
        nn.init.zeros_(self.router.bias)
        self.experts = nn.ModuleList(FeedForward(d_model, hidden) for _ in range(n_experts))
        # Built after the routed experts, so that n_shared=0 draws the same weights as before.
        self.shared = nn.ModuleList(FeedForward(d_model, shared_hidden or hidden)
                                    for _ in range(n_shared))
        # Aux-loss-free balancing: moved by update_selection_bias, never by the optimizer.
        self.register_buffer("selection_bias", torch.zeros(n_experts))
        self.last_routing, self.z_loss, self.mean_probs = None, None, None

    @property
    def n_experts(self):
        return len(self.experts)

    def route(self, tokens):
        _check_tokens(tokens, self.router.in_features)
        logits = self.router(tokens)
        if self.router_kind == "expert_choice":
            routing = expert_choice_route(logits, self.capacity_factor or 1.0)
        else:
            bias = self.selection_bias if self.selection_bias.any() else None
            routing = route(logits, self.top_k, self.capacity_factor, bias)
        self.last_routing = Routing(*(t.detach() if torch.is_tensor(t) else t for t in routing))
        # Kept with their graph: the z-loss and global-batch balancing are added by the caller.
        self.z_loss, self.mean_probs = z_loss(logits), routing.probs.mean(dim=0)
        return routing

    def forward(self, x):
        tokens = _check_tokens(x, self.router.in_features).reshape(-1, x.shape[-1])
        routing = self.route(tokens)
        out = torch.zeros_like(tokens)
        for e, expert in enumerate(self.experts):
            token, slot = ((routing.experts == e) & routing.keep).nonzero(as_tuple=True)
            # Every expert runs, even on no tokens, so its gradient is zero rather than None.
            gate = routing.gates[token, slot].unsqueeze(-1)
            out = out.index_add(0, token, gate * expert(tokens[token]))
        for expert in self.shared:                  # every token, gate 1 (DeepSeekMoE)
            out = out + expert(tokens)
        return out.reshape(x.shape), load_balancing_loss(routing)


def fine_grained(d_model, hidden, n_experts, top_k, m, n_shared=0):
    """DeepSeekMoE's fine-grained segmentation of an (E experts of width h, top-k) layer: m·E
    experts of width h/m, top m·k, so parameters and FLOPs per token stay those of the coarse
    layer while a token picks among C(mE, mk) expert combinations instead of C(E, k). n_shared
    of the m·k active experts become shared ones (always on, also of width h/m), the rest stay
    routed: the FLOPs per token are unchanged."""
    m = check.whole(m, "m (experts per coarse expert)", at_least=1, example=4)
    if hidden % m:
        raise ValueError(f"the expert width {hidden} must split into m = {m} equal parts.")
    if not 0 <= n_shared < m * top_k:
        raise ValueError(f"n_shared must leave at least one routed expert of the {m * top_k} "
                         f"active ones; got {n_shared}.")
    return dict(d_model=d_model, hidden=hidden // m, n_experts=m * n_experts - n_shared,
                top_k=m * top_k - n_shared, n_shared=n_shared)


def make_moe(seed=0, dtype=torch.float32, **config):
    """An MoE layer with weights fixed by `seed` (same weights in every process)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return MoE(**config).to(dtype)


# ---- a small model around the layer, and its single-process training ------------------------------

class MoEModel(nn.Module):
    """Linear in → h + MoE(LayerNorm(h)) → Linear out: the smallest model with a real MoE block."""

    def __init__(self, in_dim=16, out_dim=4, d_model=16, hidden=32, n_experts=4, top_k=1,
                 capacity_factor=None, **moe_options):
        super().__init__()
        self.inp = nn.Linear(in_dim, d_model)
        self.norm = nn.LayerNorm(d_model)
        self.moe = MoE(d_model, hidden, n_experts, top_k, capacity_factor, **moe_options)
        self.head = nn.Linear(d_model, out_dim)

    def forward(self, x):
        h = self.inp(x)
        y, aux = self.moe(self.norm(h))
        return self.head(h + y), aux


def make_moe_model(seed=0, dtype=torch.float32, **config):
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return MoEModel(**config).to(dtype)


def shard_loss(model, x, y, aux_coef, z_coef=0.0):
    """Task loss + aux_coef · auxiliary loss (+ z_coef · router z-loss) of one shard (one rank's
    batch)."""
    out, aux = model(x)
    loss = nn.functional.mse_loss(out, y) + aux_coef * aux
    return loss + z_coef * model.moe.z_loss if z_coef else loss


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


def train_balancing(model, steps, aux_coef=0.0, z_coef=0.0, bias_rate=0.0, balance="micro",
                    lr=0.05):
    """SGD in one process with the balancing methods of the chapter, one at a time or together.

    steps: [[(x, y) of each micro-batch], ...]. The loss of a step is the mean over its
    micro-batches of  task + aux_coef · aux + z_coef · z-loss.  balance="micro": each micro-batch's
    aux loss counts its own choices (f); "global": f counts the whole step's choices (every
    micro-batch, as all-reducing the counts over the data-parallel ranks does), P stays the
    micro-batch's. bias_rate > 0: after each step the selection bias moves by the step's load
    (aux-loss-free balancing). Returns per step a dict: "load" (micro-batches × E, after
    dropping), "task" (mean task loss), "z" (mean z-loss), "bias" (the selection bias after it).
    """
    if balance not in ("micro", "global"):
        raise ValueError(f"balance must be 'micro' or 'global'; got {balance!r}.")
    moe, opt, history = model.moe, torch.optim.SGD(model.parameters(), lr=lr), []
    for shards in steps:
        opt.zero_grad()
        tasks, probs, wanted, zs, loads = [], [], [], [], []
        for x, y in shards:
            out, _ = model(x)
            tasks.append(nn.functional.mse_loss(out, y))
            probs.append(moe.mean_probs)
            wanted.append(moe.last_routing.wanted())
            zs.append(moe.z_loss)
            loads.append(moe.last_routing.load())
        total = torch.stack(wanted).sum(0)
        loss = 0.0
        for task, p, w, z in zip(tasks, probs, wanted, zs):
            f = (total if balance == "global" else w).to(p.dtype)
            aux = moe.n_experts * (f / f.sum() * p).sum()
            loss = loss + (task + aux_coef * aux + z_coef * z) / len(shards)
        loss.backward()
        opt.step()
        loads = torch.stack(loads)
        if bias_rate:
            with torch.no_grad():
                update_selection_bias(moe.selection_bias, loads.sum(0), bias_rate)
        history.append({"load": loads, "task": float(torch.stack(tasks).detach().mean()),
                        "z": float(torch.stack(zs).detach().mean()), "bias": moe.selection_bias.clone()})
    return history


def domain_steps(n_steps, n_domains=4, tokens=32, in_dim=16, out_dim=4, seed=0):
    """Training data where micro-batch m of every step comes from one domain m (as when each
    data-parallel rank reads one document, one language, one kind of code): inputs around the
    domain's own centre, targets from the domain's own function. Balancing each micro-batch then
    forbids an expert to specialise in a domain; balancing the whole batch allows it."""
    g = torch.Generator().manual_seed(seed)
    centres = 2 * torch.randn(n_domains, in_dim, generator=g)
    maps = torch.randn(n_domains, in_dim, out_dim, generator=g) / math.sqrt(in_dim)
    steps = []
    for _ in range(n_steps):
        shards = []
        for d in range(n_domains):
            x = centres[d] + torch.randn(tokens, in_dim, generator=g)
            shards.append((x, torch.tanh(x @ maps[d])))
        steps.append(shards)
    return steps
