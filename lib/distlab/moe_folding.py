"""MoE parallel folding: the attention (dense) layers on one factorisation of the ranks, the MoE
layers on another, over the SAME ranks (Megatron-Core; Liu et al. 2025, "MoE Parallel Folding",
arXiv 2504.14960).

Attention uses tp × dp, experts etp × ep × edp, with tp·dp = etp·ep·edp = world size. The rank
order is Megatron-Core's (`megatron/core/parallel_state.py`, `initialize_model_parallel`, default
`order="tp-cp-ep-dp-pp"`): it builds two `RankGenerator`s with that order, one for attention with
ep = 1 and one for the experts with tp = etp and cp = 1, so

    attention:  rank = t + tp·d                  (tp fastest, then dp)
    experts:    rank = u + etp·(e + ep·f)        (etp fastest, then ep, then edp)

and lists a kind's groups as its `generate_masked_orthogonal_rank_groups` does: one group per
coordinate of the other axes, those counted fastest-first. (cp sits between tp and dp, and pp
after dp, in both; this module leaves them at 1.)

`folded_step` runs one such layout on real ranks: a tensor-parallel MLP with sequence parallelism
(chapter 07's layers) on tp, its gradients summed over dp; then chapter 09's expert-parallel
layer on ep, its experts' gradients summed over edp — against one process, two SGD steps.
"""
from collections import Counter
from dataclasses import dataclass

import torch
import torch.distributed as dist

from . import _argcheck as check

ATTENTION, EXPERTS = ("tp", "dp"), ("etp", "ep", "edp")     # each fastest-first


def _orthogonal(sizes, axis):
    """Megatron's masked orthogonal groups: the groups along `axis` of a grid whose axes `sizes`
    (name → size, fastest first) are laid out over ranks 0.. in that order."""
    names = list(sizes)
    stride, s = {}, 1
    for n in names:
        stride[n], s = s, s * sizes[n]
    others = [n for n in names if n != axis]
    groups = []
    for index in range(s // sizes[axis]):
        base, rest = 0, index
        for n in others:                      # the group's index, decomposed fastest-first
            base, rest = base + (rest % sizes[n]) * stride[n], rest // sizes[n]
        groups.append([base + i * stride[axis] for i in range(sizes[axis])])
    return groups


@dataclass(frozen=True)
class Folding:
    """Every rank's groups of both factorisations: `groups[kind]` for kind in tp, dp, etp, ep,
    edp is the list of that kind's groups (lists of global ranks)."""
    world_size: int
    sizes: dict
    groups: dict

    def of(self, rank):
        """{kind: the group of that kind holding `rank`}."""
        check.rank_in(rank, self.world_size)
        return {k: next(g for g in gs if rank in g) for k, gs in self.groups.items()}

    def kinds(self, ranks):
        """The kinds whose groups include exactly `ranks` ("world" for all of them)."""
        ranks = sorted(ranks)
        found = [k for k, gs in self.groups.items() if ranks in gs and len(ranks) > 1]
        return found or (["world"] if ranks == list(range(self.world_size)) else ["other"])

    def table(self):
        """One line per rank: its groups in both factorisations."""
        kinds = (*ATTENTION, *EXPERTS)
        cells = [[str(self.of(r)[k]).replace(" ", "") for k in kinds] for r in range(self.world_size)]
        width = [max(len(f"{k} = {self.sizes[k]}"), *(len(c[i]) for c in cells)) + 2
                 for i, k in enumerate(kinds)]
        lines = ["rank" + "".join(f"{f'{k} = {self.sizes[k]}':>{w}}" for k, w in zip(kinds, width))]
        lines += [f"{r:>4}" + "".join(f"{c:>{w}}" for c, w in zip(row, width))
                  for r, row in enumerate(cells)]
        return "\n".join(lines)


def folding_groups(world_size, *, tp, dp, etp, ep, edp):
    """Both factorisations of `world_size` ranks: attention tp × dp, experts etp × ep × edp, in
    Megatron-Core's rank order (tp fastest; etp fastest, then ep)."""
    world_size = check.whole(world_size, "world_size", at_least=1)
    sizes = {k: check.whole(v, k, at_least=1)
             for k, v in dict(tp=tp, dp=dp, etp=etp, ep=ep, edp=edp).items()}
    for names in (ATTENTION, EXPERTS):
        product = 1
        for n in names:
            product *= sizes[n]
        if product != world_size:
            which = "attention's" if names == ATTENTION else "the experts'"
            raise ValueError(f"{which} {' × '.join(names)} = "
                             f"{' × '.join(str(sizes[n]) for n in names)} = {product} does not "
                             f"multiply to the world size {world_size}.")
    groups = {}
    for names in (ATTENTION, EXPERTS):
        grid = {n: sizes[n] for n in names}
        groups.update({n: _orthogonal(grid, n) for n in names})
    return Folding(world_size, sizes, groups)


def build_groups(folding):
    """Inside a rank: create every group of both factorisations (every rank, the same order, as
    `new_group` requires) and return {kind: this rank's ProcessGroup}."""
    made = {kind: [(g, dist.new_group(g)) for g in gs] for kind, gs in folding.groups.items()}
    rank = dist.get_rank()
    return {kind: next(pg for g, pg in pairs if rank in g) for kind, pairs in made.items()}


def comm_by_kind(trace, folding, span=None):
    """{kind of group: (the distinct groups it used, Counter of ops)} over every rank's
    collectives in a run's trace (inside the trace.span named `span`, if given); a group two
    kinds share (tp = ep, say) counts for both."""
    out = {}
    for e in trace.comm():
        if span is not None and span not in (e["label"] or ()):
            continue
        for kind in folding.kinds(e["group"]):
            groups, ops = out.setdefault(kind, ([], Counter()))
            if sorted(e["group"]) not in groups:
                groups.append(sorted(e["group"]))
            ops[e["op"]] += 1
    return {k: (sorted(gs), ops) for k, (gs, ops) in out.items()}


# ---- one layout on real ranks, against one process ----------------------------------------------

def _sum_grads(params, group):
    """One all-reduce of the parameters' gradients, flattened together (a bucket)."""
    grads = [p.grad for p in params]
    flat = torch.cat([x.reshape(-1) for x in grads])
    dist.all_reduce(flat, group=group)
    for x, new in zip(grads, flat.split([x.numel() for x in grads])):
        x.copy_(new.view_as(x))


def folded_step(rank, world_size, folding, steps=2, tokens=8, d_model=8, hidden=16, n_experts=8,
                lr=0.1):
    """`steps` SGD steps of dense MLP (attention's layout) → MoE (the experts' layout), float64.
    Returns the largest difference, over every step, between this rank's output, loss and every
    gradient (dense shards, router, local experts) and one process's."""
    from .models import FeedForward
    from .moe import make_moe
    from .expert_parallel import ExpertParallelMoE
    from .tensor_parallel import ParallelMLP
    if folding.sizes["etp"] != 1:
        raise ValueError("folded_step runs the experts unsplit (etp = 1); chapter 09b's "
                         "ExpertTensorParallelMoE is the layer for etp > 1.")
    tp, dp = folding.sizes["tp"], folding.sizes["dp"]
    g = build_groups(folding)
    t, d = rank % tp, rank // tp                              # attention: rank = t + tp·d
    torch.manual_seed(0)
    dense = FeedForward(d_model, hidden).double()
    moe = make_moe(seed=1, dtype=torch.float64, d_model=d_model, hidden=hidden,
                   n_experts=n_experts, top_k=2, capacity_factor=None)
    mlp = ParallelMLP.from_dense(dense, g["tp"], sequence_parallel=True)
    layer = ExpertParallelMoE(moe, group=g["ep"])

    def batch(step, dp_rank):                                # dp rank d's tokens at this step
        gen = torch.Generator().manual_seed(1000 * step + dp_rank)
        return torch.randn(1, tokens * tp, d_model, generator=gen, dtype=torch.float64)

    worst = 0.0
    for step in range(steps):
        # one process: every dp rank's batch through the dense layer, then each token slice that
        # a rank holds (sequence parallel) through the MoE layer, the losses summed
        for p in (*dense.parameters(), *moe.parameters(), *mlp.parameters(), *layer.parameters()):
            p.grad = None
        ref_y, ref_loss = None, 0.0
        for dd in range(dp):
            slices = dense(batch(step, dd))[0].chunk(tp)
            for tt, h in enumerate(slices):
                y, aux = moe(h)
                loss = y.square().sum() + aux
                ref_loss = ref_loss + loss
                if (tt, dd) == (t, d):
                    ref_y, mine_ref = y.detach(), loss.detach()
        ref_loss.backward()
        # this rank: its dp batch's sequence slice, tp's MLP, then ep's MoE on the same ranks
        x = batch(step, d).chunk(tp, dim=1)[t]
        y, aux = layer(mlp(x)[0])
        loss = y.square().sum() + aux
        loss.backward()
        _sum_grads(mlp.parameters(), g["dp"])                # attention's layout: over dp
        _sum_grads(layer.router.parameters(), g["tp"])       # replicated, saw a token slice:
        _sum_grads(layer.router.parameters(), g["dp"])       # over tp (sequence parallel), dp
        _sum_grads(layer.experts.parameters(), g["edp"])     # the experts' layout: over edp
        diffs = [y.detach() - ref_y, loss.detach() - mine_ref,
                 mlp.fc1.weight.grad - mlp.fc1.shard_of(dense.fc1.weight.grad),
                 mlp.fc1.bias.grad - mlp.fc1.shard_of(dense.fc1.bias.grad),
                 mlp.fc2.weight.grad - mlp.fc2.shard_of(dense.fc2.weight.grad),
                 mlp.fc2.bias.grad - dense.fc2.bias.grad]
        diffs += [p.grad - q.grad for p, q in zip(layer.router.parameters(), moe.router.parameters())]
        for i, expert in enumerate(layer.experts):
            diffs += [p.grad - q.grad for p, q in zip(expert.parameters(),
                                                      moe.experts[layer.first + i].parameters())]
        worst = max([worst] + [float(x.abs().max()) for x in diffs])
        with torch.no_grad():                                # SGD on both sides
            for p in (*mlp.parameters(), *layer.parameters(), *dense.parameters(),
                      *moe.parameters()):
                if p.grad is not None:
                    p -= lr * p.grad
    return worst
