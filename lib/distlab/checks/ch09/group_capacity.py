"""Workbook 09, exercise 2: the capacity of the whole EP group, on real subgroups."""
import torch
import torch.distributed as dist

from ... import moe as moe_lib
from ...moe import Routing
from .. import CheckFailed, expect_arguments, passed, run_learner
from ._common import (LAYER_CASES, LAYOUTS, TIMEOUT, _compare_ranks, _fresh_seed,
                      _layer_versus_reference, _layout_phrase, _my_group, _refusing,
                      _talked_outside)
from ._references import _capacity, _group_case, _group_reference, _skewed_layer, _tokens


GROUP_CASES = ((4, 1, 1.0), (6, 2, 1.0), (4, 2, 0.5), (5, 3, 1.25))   # (E, k, capacity factor)


def _group_keep_on_ranks(rank, world_size, fn, name, groups, seed):
    group, _ = _my_group(rank, groups)
    out = []
    for i, (n_experts, k, cf) in enumerate(GROUP_CASES):
        experts = _group_case(rank, n_experts, k, seed + 101 * i)
        with _refusing("the group capacity"):
            keep = fn(experts.clone(), n_experts, cf, group)
        out.append((experts, keep))
    return out


def _group_layers_on_ranks(rank, world_size, fn):
    return [_group_layer_on_ranks(rank, world_size, fn, cf, k) for k, cf in LAYER_CASES]


def _group_layer_on_ranks(rank, world_size, fn, cf, top_k):
    """The EP layer with the group capacity: every rank's slice of one process on all tokens."""
    n_experts = 2 * world_size
    moe = _skewed_layer(n_experts, top_k, cf)
    sizes = [6 + 2 * r for r in range(world_size)]
    all_tokens = [_tokens(r, sizes[r], seed=500) for r in range(world_size)]

    def learner_route(logits, k, factor):
        probs = torch.softmax(logits, dim=-1)
        gates, experts = probs.topk(k, dim=-1)
        if k > 1:
            gates = gates / gates.sum(dim=-1, keepdim=True)
        with _refusing("the group capacity"):
            keep = fn(experts.detach().clone(), n_experts, factor, dist.group.WORLD)
        if not torch.is_tensor(keep) or keep.shape != experts.shape:
            raise CheckFailed(f"{getattr(fn, '__name__', 'your function')} should return a "
                              f"{tuple(experts.shape)} boolean tensor; got {keep!r:.80}.")
        return Routing(probs, experts, gates, keep.bool(), None)

    def reference(weights):
        xs = [t.clone().requires_grad_() for t in all_tokens]
        y_all, _ = moe(torch.cat(xs))                     # the capacity of all the tokens
        y = y_all.split(sizes)[rank]
        (y * weights).sum().backward()
        return y.detach(), xs[rank].grad

    return _layer_versus_reference(moe, learner_route, all_tokens[rank], reference)


def _explain_group_keep(where, rank, t, slot, e, got, place, capacity, sizes):
    if got:
        return (f"{where}: rank {rank} kept its token {t}'s choice {slot + 1} (expert {e}), but "
                f"expert {e} holds {capacity} assignments for the whole group and this one is "
                f"number {place + 1} in the group's queue — every rank's first choices (the "
                f"group's first rank first, then the next, ...), then every rank's second "
                f"choices, each rank's tokens in order. Token counts this time: {sizes}.")
    return (f"{where}: rank {rank} dropped its token {t}'s choice {slot + 1} (expert {e}), but "
            f"it is number {place + 1} in expert {e}'s queue of the whole group and the "
            f"capacity is {capacity} — the group's queue: every rank's first choices (the "
            f"group's first rank first, then the next, ...), then every rank's second choices. "
            f"Token counts this time: {sizes}.")


def _judge_group_keep(got, groups, name, ws):
    for case, (n_experts, k, cf) in enumerate(GROUP_CASES):
        for ranks in groups:
            experts = [got[r][case][0] for r in ranks]
            mine = [got[r][case][1] for r in ranks]
            capacity, keeps, positions = _group_reference(experts, n_experts, cf)
            sizes = [len(e) for e in experts]
            where = (f"{name} on the group {list(ranks)} of {ws} ranks, {n_experts} experts, "
                     f"k={k}, capacity_factor={cf}")
            for r, m, expected in zip(ranks, mine, keeps):
                if not torch.is_tensor(m) or tuple(m.shape) != tuple(expected.shape):
                    raise CheckFailed(f"{where}: rank {r}'s keep should be a "
                                      f"{tuple(expected.shape)} boolean tensor; got {m!r:.80}.")
                if m.dtype != torch.bool:
                    raise CheckFailed(f"{where}: keep should be a boolean tensor; got "
                                      f"{m.dtype}.")
            wrong = [i for i in range(len(ranks)) if not torch.equal(mine[i], keeps[i])]
            if not wrong:
                continue
            local = [moe_lib.capacity_keep(e, n_experts, _capacity(len(e), n_experts, k, cf))
                     for e in experts]
            if len(ranks) > 1 and all(torch.equal(m, lo) for m, lo in zip(mine, local)):
                raise CheckFailed(
                    f"{where}: every rank applied the capacity to its own tokens only (GShard's "
                    f"per-group capacity, the chapter's layer), so an expert can receive "
                    f"{len(ranks)}× its capacity; here the capacity counts the whole group's "
                    f"tokens ({sum(sizes)}: {capacity} per expert) and each rank needs what the "
                    f"ranks before it chose.")
            i = wrong[0]
            t, slot = (int(j) for j in (mine[i] != keeps[i]).nonzero()[0])
            raise CheckFailed(_explain_group_keep(
                where, ranks[i], t, slot, int(experts[i][t, slot]), bool(mine[i][t, slot]),
                int(positions[i][t, slot]), capacity, sizes))


def check_group_capacity_keep(fn, layouts=LAYOUTS, layer_sizes=(3,)):
    """fn(experts, n_experts, capacity_factor, group) -> keep (T, k) on every rank, the capacity
    ceil(factor · (all the group's tokens) · k / E) counted over the whole group's assignments:
    first choices before second ones, inside a choice the group's first rank's tokens first, ...
    Run on real subgroups side by side (two groups of 2; {0, 2} and {1, 3, 4}) with inputs drawn
    afresh per check, so that only what travelled inside the group can give the right mask."""
    name = expect_arguments(fn, 4, "group_capacity_keep(experts, n_experts, capacity_factor, "
                                   "group)")
    seed = _fresh_seed()
    for ws, groups in layouts:
        got = run_learner(_group_keep_on_ranks, ws, fn, name, groups, seed, name=name,
                          timeout=TIMEOUT, trace=True,
                          deadlock_rule="Every rank must join the same collectives in the same "
                                        "order, also a rank whose tokens need no answer.")
        outside = _talked_outside(got.trace, groups, name)
        if outside:
            raise CheckFailed(outside)
        _judge_group_keep(got, groups, name, ws)
    for ws in layer_sizes:
        got = run_learner(_group_layers_on_ranks, ws, fn, name=name, timeout=TIMEOUT)
        for i, (top_k, cf) in enumerate(LAYER_CASES):
            _compare_ranks([cases[i] for cases in got], f"the expert-parallel layer with your "
                           f"{name} (top_k={top_k}, capacity_factor={cf})", ws)
    passed(f"{name} gives every rank the keep mask of one process on its group's tokens "
           f"(capacity of all the group's tokens, first choices first, then rank order) on "
           f"subgroups side by side ({_layout_phrase(layouts)}), with uneven token counts drawn "
           f"afresh; the layer built on it equals that process, dropped tokens coming back as "
           f"zeros.")
