"""Checkers for workbook 09: capacity the chapter did not write, and the EP × DP gradient groups.

1. `check_prioritized_route`: top-k routing with batch-prioritized capacity (V-MoE's BPR: the
   most confident tokens are served first). Judged on this process on several shapes, including
   float32 logits of size ~100 that overflow a naive exp, then plugged into an expert-parallel
   layer on real ranks (EP 2 and 3): every rank's output and input gradient equal a one-process
   layer routed by this module's reference.
2. `check_group_capacity_keep`: the capacity counted over the whole EP group instead of per
   source rank, on real ranks at EP 2, 3 and 4 with uneven token counts: every rank's keep mask
   is compared element by element with one process on the concatenated batch, and the layer
   built on it equals that process (dropped tokens come back as zeros).
3. `check_reduce_moe_gradients`: gradient averaging on an (ep, dp) layout, EP groups strided
   across "nodes" (the chapter's mesh is (dp, ep)): every rank's gradients after the call are
   compared with one process's gradient of the global mean loss, at 4 and 6 ranks, both ways
   round; a wrong answer is named by the reduction it matches (wrong group, wrong divisor,
   none).

The references of this module are written here, never shown in a notebook. The course's own
`route`, `capacity_keep`, `reduce_gradients`, `ep_dp_mesh`, `distlab.debug`'s averaging, this
module's references and the helpers that build its data refuse to run inside the learner's
function (`forbid`).
"""
import contextlib
import math

import torch
import torch.distributed as dist

from .. import debug as _debug
from .. import expert_parallel as ep_lib
from .. import moe as moe_lib
from ..moe import Routing, make_moe, make_moe_model, shard_loss
from . import (CheckFailed, UsedCourseCode, call_learner, compare, expect_arguments, forbid,
               passed, run_learner, sizes_phrase)

D_MODEL = 8
TIMEOUT = 30  # a learner's deadlock is reported (with where each rank waits) within this


# ---- references (never displayed) ----------------------------------------------------------------

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


def _course_code():
    return (moe_lib.route, moe_lib.capacity_keep, moe_lib.expert_capacity,
            moe_lib.load_balancing_loss, ep_lib.reduce_gradients, ep_lib.ep_dp_mesh,
            ep_lib.dispatch_plan, _debug.average_gradients, _debug.broadcast_parameters,
            _reference_route, _group_reference, _queue_positions, _priority_order,
            _one_process_layer,
            # the checker's own data: the other ranks' tokens and choices rebuilt without a
            # message would pass the group capacity and the gradients without communicating
            _tokens, _group_case, _shard, _skewed_layer, _reference_grads)


@contextlib.contextmanager
def _refusing(what):
    with forbid(*_course_code(), exercise=f"write {what} yourself"):
        yield


def _called(fn, *args, name, what="the prioritized routing"):
    """Call the learner's local function here, in one process."""
    try:
        with _refusing(what):
            return call_learner(fn, *args, name=name)
    except UsedCourseCode as e:
        raise CheckFailed(str(e)) from None


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


@contextlib.contextmanager
def _layer_routes_with(route_fn):
    """Inside a rank: ExpertParallelMoE routes with `route_fn` (its module's `route` name)."""
    saved = ep_lib.route
    ep_lib.route = route_fn
    try:
        yield
    finally:
        ep_lib.route = saved


def _layer_versus_reference(moe, layer_route, tokens, reference_out):
    """Run the EP layer (routing through `layer_route`) on this rank's tokens; return
    (y, x.grad) and (reference y, reference x.grad)."""
    layer = ep_lib.ExpertParallelMoE(moe, None)
    x = tokens.clone().requires_grad_()
    with _layer_routes_with(layer_route):
        y, _ = layer(x)
    weights = torch.linspace(-1, 1, y.numel(), dtype=y.dtype).view_as(y)
    (y * weights).sum().backward()
    yr, gr = reference_out(weights)
    return (y.detach(), x.grad), (yr, gr)


def _compare_ranks(got, what, world_size):
    for rank, ((y, gx), (yr, gr)) in enumerate(got):
        where = f"{what}, EP={world_size}, rank {rank}"
        compare(y, yr, f"{where}: the layer's output", atol=1e-10, rtol=1e-9)
        compare(gx, gr, f"{where}: the gradient of the layer's input", atol=1e-10, rtol=1e-9)


# ---- exercise 1: batch-prioritized capacity --------------------------------------------------------

def _route_cases():
    g = torch.Generator().manual_seed(11)
    cases = []
    for T, E, k, cf in ((10, 4, 1, 1.0), (9, 6, 2, 1.0), (12, 8, 2, 0.5), (16, 4, 2, 1.25),
                        (7, 3, 3, None), (5, 5, 1, 0.4)):
        logits = torch.randn(T, E, generator=g, dtype=torch.float64)
        logits[: T // 2, 1] += 2.0                       # a crowd on expert 1
        cases.append((f"{T} tokens, {E} experts, k={k}, capacity_factor={cf}", logits, k, cf))
    # float32 logits near 100: a naive exp overflows (exp(89) is already inf); the spread of a
    # row stays small enough that no probability underflows to 0 (ties among the zeros would
    # make top-k's order arbitrary). Token 5 repeats token 1: a tie in priority.
    big = 100.0 + 5.0 * torch.randn(12, 4, generator=g, dtype=torch.float32)
    big[:8, 2] += 8.0
    big[5] = big[1]
    cases.append(("12 tokens, 4 experts, k=2, capacity_factor=1.0, float32 logits near 100",
                  big, 2, 1.0))
    # A tie that decides: expert 2 holds 2; token 4 is surest, tokens 1 and 3 tie for the other
    # place, and the earlier one (1) keeps it.
    tie = torch.tensor([[101, 100, 104, 100], [100, 102, 106, 101], [100, 100, 103, 101],
                        [100, 102, 106, 101], [100, 101, 110, 100], [105, 100, 101, 100],
                        [100, 104, 100, 101], [100, 101, 100, 103]], dtype=torch.float32)
    cases.append(("8 tokens, 4 experts, k=1, capacity_factor=1.0, float32 logits near 100, tokens "
                  "1 and 3 tied for expert 2's last place", tie, 1, 1.0))
    return cases


def _explain_keep(where, t, slot, got, probs, experts, position, capacity, order):
    e = int(experts[t, slot])
    place = int(position[t, slot])
    rank_in_order = order.tolist().index(t)
    ahead = [int(u) for u in order[:rank_in_order]]
    if got:
        return (f"{where}: token {t}'s choice {slot + 1} (expert {e}) was kept, but expert {e} "
                f"holds only {capacity} and this assignment is number {place + 1} in its queue: "
                f"every first choice goes before any second one, and inside a choice the tokens "
                f"with the higher top-1 probability first (tokens ahead of token {t}: "
                f"{ahead[:6]}{' …' if len(ahead) > 6 else ''}).")
    return (f"{where}: token {t}'s choice {slot + 1} (expert {e}) was dropped, but it is number "
            f"{place + 1} in expert {e}'s queue and the capacity is {capacity}: serve the slots "
            f"in turn and, inside a slot, the tokens by top-1 probability, highest first (ties: "
            f"the earlier token first).")


def _follows_token_order(fn, name):
    """Whether fn's keep is the chapter's rule (earlier tokens first) on every case."""
    for _, logits, k, cf in _route_cases():
        experts = _reference_route(logits, k, cf)[1]
        keep = _called(fn, logits.clone(), k, cf, name=name)[2]
        capacity = _capacity(len(logits), logits.shape[-1], k, cf)
        if not torch.equal(keep, moe_lib.capacity_keep(experts, logits.shape[-1], capacity)):
            return False
    return True


def _check_route_case(fn, name, what, logits, k, cf):
    where = f"{name} on {what}"
    probs, experts, gates, keep, capacity, position = _reference_route(logits.detach(), k, cf)
    mine = logits.clone().requires_grad_()
    got = _called(fn, mine, k, cf, name=name)
    if not (isinstance(got, (tuple, list)) and len(got) == 3):
        raise CheckFailed(f"{where} should return (experts, gates, keep); got "
                          f"{type(got).__name__}.")
    g_experts, g_gates, g_keep = got
    T = len(logits)
    for label, value in (("experts", g_experts), ("gates", g_gates), ("keep", g_keep)):
        if not torch.is_tensor(value) or tuple(value.shape) != (T, k):
            raise CheckFailed(f"{where}: {label} should be a ({T}, {k}) tensor; got "
                              f"{value!r:.80}.")
    if torch.isnan(g_gates.detach()).any():
        t = int(torch.isnan(g_gates.detach()).any(-1).nonzero()[0])
        raise CheckFailed(f"{where}: token {t}'s gates are nan: exp of a logit near "
                          f"{logits[t].abs().max().item():.0f} overflows float32 — subtract each "
                          f"row's largest logit before the exp (torch.softmax does).")
    compare(g_experts.long(), experts, f"{where}, experts (best first)")
    compare(g_gates, gates, f"{where}, gates (renormalised over the k chosen when k > 1)",
            atol=1e-6 if logits.dtype == torch.float32 else 1e-10, rtol=1e-6)
    if g_keep.dtype != torch.bool:
        raise CheckFailed(f"{where}: keep should be a boolean tensor; got {g_keep.dtype}.")
    bad = (g_keep != keep).nonzero()
    if len(bad):
        t, slot = (int(i) for i in bad[0])
        order = _priority_order(probs)
        if _follows_token_order(fn, name):
            raise CheckFailed(f"{where}: your keep is the chapter's rule (earlier tokens first); "
                              f"batch-prioritized routing serves the tokens by their top-1 "
                              f"probability, highest first — here token {t}'s choice {slot + 1} "
                              f"should be {'kept' if keep[t, slot] else 'dropped'}.")
        raise CheckFailed(_explain_keep(where, t, slot, bool(g_keep[t, slot]), probs, experts,
                                        position, capacity, order))
    if not g_gates.requires_grad:
        raise CheckFailed(f"{where}: the gates carry no gradient back to the logits (no "
                          f".detach(), no torch.no_grad()): the router learns through them.")
    weights = torch.arange(1.0, g_gates.numel() + 1, dtype=g_gates.dtype).view_as(g_gates)
    (g_gates * weights).sum().backward()
    ref_logits = logits.detach().clone().requires_grad_()
    (_reference_route(ref_logits, k, cf)[2] * weights).sum().backward()
    compare(mine.grad, ref_logits.grad, f"{where}, gradient of the logits through the gates",
            atol=1e-6 if logits.dtype == torch.float32 else 1e-10, rtol=1e-6)


LAYER_CASES = ((1, 1.0), (2, 0.75))      # (top_k, capacity_factor) of the layer runs


def _prioritized_on_ranks(rank, world_size, fn):
    return [_prioritized_layer(rank, world_size, fn, k, cf) for k, cf in LAYER_CASES]


def _prioritized_layer(rank, world_size, fn, top_k, capacity_factor):
    n_experts = 2 * world_size
    moe = _skewed_layer(n_experts, top_k, capacity_factor)
    tokens = _tokens(rank, 12)

    def learner_route(logits, k, cf):
        with _refusing("the prioritized routing"):
            experts, gates, keep = fn(logits, k, cf)
        probs = torch.softmax(logits, dim=-1)
        return Routing(probs, experts.long(), gates, keep.bool(),
                       _capacity(len(logits), n_experts, k, cf))

    def reference(weights):
        x = tokens.clone().requires_grad_()
        _, experts, gates, keep, _, _ = _reference_route(moe.router(x), top_k, capacity_factor)
        y = _one_process_layer(moe, x, (experts, gates, keep))
        (y * weights).sum().backward()
        return y.detach(), x.grad

    return _layer_versus_reference(moe, learner_route, tokens, reference)


def check_prioritized_route(fn, world_sizes=(2, 3)):
    """fn(logits, k, capacity_factor) -> (experts, gates, keep), each (T, k): top-k of the
    softmax (gates renormalised over the k when k > 1), keep False for the assignments past the
    capacity, the tokens served by top-1 probability (highest first), slot by slot."""
    name = expect_arguments(fn, 3, "prioritized_route(logits, k, capacity_factor)")
    for what, logits, k, cf in _route_cases():
        _check_route_case(fn, name, what, logits, k, cf)
    for ws in world_sizes:
        got = run_learner(_prioritized_on_ranks, ws, fn, name=name, timeout=TIMEOUT)
        for i, (top_k, cf) in enumerate(LAYER_CASES):
            _compare_ranks([cases[i] for cases in got], f"the expert-parallel layer routed by "
                           f"your {name} (top_k={top_k}, capacity_factor={cf})", ws)
    passed(f"{name} keeps the right assignments — slot by slot, most confident tokens first, "
           f"ties to the earlier token — on 8 cases including float32 logits near 100, gates "
           f"and their gradients too; the expert-parallel layer routed by it equals one process "
           f"at EP {sizes_phrase(world_sizes)}.")


# ---- exercise 2: the capacity of the whole EP group ------------------------------------------------

def _group_case(rank, world_size, n_experts, top_k, seed):
    """This rank's (T_r, k) chosen experts: uneven token counts, a crowd on expert 0."""
    n = 4 + 3 * ((rank + seed) % 3)                  # 4, 7 or 10 tokens: the ranks differ
    g = torch.Generator().manual_seed(1000 * seed + rank)
    logits = torch.randn(n, n_experts, generator=g, dtype=torch.float64)
    logits[: n // 2 + 1, 0] += 3.0
    return logits.topk(top_k, dim=-1).indices


GROUP_CASES = ((4, 1, 1.0), (6, 2, 1.0), (4, 2, 0.5), (5, 3, 1.25))   # (E, k, capacity factor)


def _group_keep_on_ranks(rank, world_size, fn, name):
    out = []
    for i, (n_experts, k, cf) in enumerate(GROUP_CASES):
        experts = _group_case(rank, world_size, n_experts, k, i)
        with _refusing("the group capacity"):
            keep = fn(experts.clone(), n_experts, cf, dist.group.WORLD)
        out.append((n_experts, k, cf, experts, keep))
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


def _explain_group_keep(name, ws, rank, t, slot, e, got, place, capacity, sizes):
    if got:
        return (f"{name} with EP={ws}: rank {rank} kept its token {t}'s choice {slot + 1} "
                f"(expert {e}), but expert {e} holds {capacity} assignments for the whole group "
                f"and this one is number {place + 1} in the group's queue — every rank's first "
                f"choices (rank 0 first, then rank 1, ...), then every rank's second choices, "
                f"each rank's tokens in order. Token counts this time: {sizes}.")
    return (f"{name} with EP={ws}: rank {rank} dropped its token {t}'s choice {slot + 1} (expert "
            f"{e}), but it is number {place + 1} in expert {e}'s queue of the whole group and "
            f"the capacity is {capacity} — the group's queue: every rank's first choices (rank 0 "
            f"first, then rank 1, ...), then every rank's second choices. "
            f"Token counts this time: {sizes}.")


def check_group_capacity_keep(fn, world_sizes=(2, 3, 4)):
    """fn(experts, n_experts, capacity_factor, group) -> keep (T, k) on every rank, the capacity
    ceil(factor · (all the group's tokens) · k / E) counted over the whole group's assignments:
    first choices before second ones, inside a choice rank 0's tokens first, then rank 1's, ..."""
    name = expect_arguments(fn, 4, "group_capacity_keep(experts, n_experts, capacity_factor, "
                                   "group)")
    for ws in world_sizes:
        got = run_learner(_group_keep_on_ranks, ws, fn, name, name=name, timeout=TIMEOUT,
                          deadlock_rule="Every rank must join the same collectives in the same "
                                        "order, also a rank whose tokens need no answer.")
        for case in range(len(GROUP_CASES)):
            n_experts, k, cf = got[0][case][:3]
            experts = [got[r][case][3] for r in range(ws)]
            capacity, keeps, positions = _group_reference(experts, n_experts, cf)
            sizes = [len(e) for e in experts]
            for rank in range(ws):
                mine = got[rank][case][4]
                where = (f"{name} with EP={ws}, {n_experts} experts, k={k}, "
                         f"capacity_factor={cf}, on rank {rank}")
                if not torch.is_tensor(mine) or tuple(mine.shape) != tuple(keeps[rank].shape):
                    raise CheckFailed(f"{where}: keep should be a {tuple(keeps[rank].shape)} "
                                      f"boolean tensor; got {mine!r:.80}.")
                if mine.dtype != torch.bool:
                    raise CheckFailed(f"{where}: keep should be a boolean tensor; got "
                                      f"{mine.dtype}.")
            mine = [got[r][case][4] for r in range(ws)]
            local = [moe_lib.capacity_keep(e, n_experts, _capacity(len(e), n_experts, k, cf))
                     for e in experts]
            wrong = [r for r in range(ws) if not torch.equal(mine[r], keeps[r])]
            if not wrong:
                continue
            if all(torch.equal(m, lo) for m, lo in zip(mine, local)):
                raise CheckFailed(
                    f"{name} with EP={ws}, {n_experts} experts, k={k}, capacity_factor={cf}: "
                    f"every rank applied the capacity to its own tokens only (GShard's "
                    f"per-group capacity, the chapter's layer), so an expert can receive {ws}× "
                    f"its capacity; here the capacity counts the whole group's tokens "
                    f"({sum(sizes)}: {capacity} per expert) and each rank needs what the ranks "
                    f"before it chose.")
            rank = wrong[0]
            t, slot = (int(i) for i in (mine[rank] != keeps[rank]).nonzero()[0])
            raise CheckFailed(_explain_group_keep(
                name, ws, rank, t, slot, int(experts[rank][t, slot]), bool(mine[rank][t, slot]),
                int(positions[rank][t, slot]), capacity, sizes))
    for ws in world_sizes[:2]:
        got = run_learner(_group_layers_on_ranks, ws, fn, name=name, timeout=TIMEOUT)
        for i, (top_k, cf) in enumerate(LAYER_CASES):
            _compare_ranks([cases[i] for cases in got], f"the expert-parallel layer with your "
                           f"{name} (top_k={top_k}, capacity_factor={cf})", ws)
    passed(f"{name} gives every rank the keep mask of one process on the whole group's tokens "
           f"(capacity of all the tokens, first choices first, then rank order) at EP "
           f"{sizes_phrase(world_sizes)} with uneven token counts; the layer built on it equals "
           f"that process, dropped tokens coming back as zeros.")


# ---- exercise 3: EP × DP gradients on an (ep, dp) layout ------------------------------------------

CONFIG = dict(d_model=D_MODEL, hidden=16, top_k=2, capacity_factor=1.0)
TOKENS = 6
AUX = 0.1


def _layout(world_size, ep):
    """(ep, dp) with EP outer: rank = e·dp + d. EP groups stride by dp, DP groups are runs."""
    dp = world_size // ep
    ep_groups = [[e * dp + d for e in range(ep)] for d in range(dp)]
    dp_groups = [[e * dp + d for d in range(dp)] for e in range(ep)]
    return dp, ep_groups, dp_groups


def _shard(rank):
    from ..models import regression_data
    x, y = regression_data(n=TOKENS, in_dim=16, out_dim=4, seed=40 + rank)
    return x.double(), y.double()


def _reduce_on_ranks(rank, world_size, fn, ep):
    dp, ep_groups, _ = _layout(world_size, ep)
    groups = [dist.new_group(ranks) for ranks in ep_groups]      # every rank, in the same order
    mine = next(g for g, ranks in zip(groups, ep_groups) if rank in ranks)
    model = make_moe_model(seed=3, dtype=torch.float64, n_experts=2 * ep, **CONFIG)
    model.moe = ep_lib.ExpertParallelMoE(model.moe, mine)
    shard_loss(model, *_shard(rank), aux_coef=AUX).backward()
    local = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    with _refusing("the gradient averaging"):
        fn(model, ep)
    reduced = {n: (None if p.grad is None else p.grad.detach().clone())
               for n, p in model.named_parameters()}
    return model.moe.first, local, reduced


def _global_name(name, first):
    """(its global name, its global expert index or None)."""
    global_name = ep_lib.global_name(name, first)
    expert = name.startswith("moe.experts.")
    return global_name, (int(global_name.split(".")[2]) if expert else None)


def _reference_grads(world_size, ep):
    model = make_moe_model(seed=3, dtype=torch.float64, n_experts=2 * ep, **CONFIG)
    loss = sum(shard_loss(model, *_shard(r), aux_coef=AUX) for r in range(world_size))
    (loss / world_size).backward()
    return {n: p.grad for n, p in model.named_parameters()}


def _which_reduction(got, local, rank, name, world_size, ep):
    """A phrase naming the (wrong) reduction `got` matches, or None."""
    dp, ep_groups, dp_groups = _layout(world_size, ep)
    groups = {"every rank": list(range(world_size)),
              "its DP group (the ranks that hold the same experts)":
                  next(g for g in dp_groups if rank in g),
              "its EP group (the ranks that hold different experts)":
                  next(g for g in ep_groups if rank in g),
              "this rank alone": [rank]}
    for label, ranks in groups.items():
        total = sum(local[r][name] for r in ranks)
        for divisor in sorted({world_size, len(ranks), dp, ep, 1}):
            if torch.allclose(got, total / divisor, atol=1e-12, rtol=1e-9):
                if ranks == [rank]:
                    return (f"this rank's own gradient"
                            f"{f' divided by {divisor}' if divisor != 1 else ''}: nothing from "
                            f"the other ranks was added to it")
                return f"the sum over {label}, ranks {ranks}, divided by {divisor}"
    # Another group (the chapter's layout on this one, say): try every set of ranks with this one.
    others = [r for r in range(world_size) if r != rank]
    same = next(g for g in dp_groups if rank in g)
    for mask in range(1, 2 ** len(others)):
        ranks = sorted([rank] + [r for i, r in enumerate(others) if mask >> i & 1])
        total = sum(local[r][name] for r in ranks)
        for divisor in sorted({world_size, len(ranks), dp, ep}):
            if torch.allclose(got, total / divisor, atol=1e-12, rtol=1e-9):
                strangers = ", ".join(str(r) for r in ranks if r not in same)
                several = "," in strangers
                return (f"the sum over ranks {ranks}, divided by {divisor} (rank"
                        f"{'s' if several else ''} {strangers} hold{'' if several else 's'} "
                        f"other experts)")
    return None


def check_reduce_moe_gradients(fn, layouts=((4, 2), (6, 3), (6, 2))):
    """fn(model, ep_size), called on every rank after backward, leaves every rank holding the
    gradient of the global mean loss, on the (ep, dp) layout rank = e·dp + d."""
    name = expect_arguments(fn, 2, "reduce_moe_gradients(model, ep_size)")
    for ws, ep in layouts:
        dp, ep_groups, dp_groups = _layout(ws, ep)
        got = run_learner(_reduce_on_ranks, ws, fn, ep, name=name, timeout=TIMEOUT,
                          deadlock_rule="dist.new_group must be called by every rank, for every "
                                        "group, in the same order — also for the groups a rank "
                                        "is not in.")
        reference = _reference_grads(ws, ep)
        local = [g[1] for g in got]
        for rank, (first, _, reduced) in enumerate(got):
            for pname, grad in reduced.items():
                global_name, expert = _global_name(pname, first)
                is_expert = expert is not None
                where = (f"{name} with ep={ep}, dp={dp} ({ws} ranks): rank {rank}'s gradient of "
                         f"{pname}" + (f" (its local expert, global expert {expert})"
                                       if is_expert else ""))
                if grad is None:
                    raise CheckFailed(f"{where} is None after your function; it was set by "
                                      f"backward.")
                expected = reference[global_name]
                if torch.allclose(grad, expected, atol=1e-12, rtol=1e-9):
                    continue
                matched = _which_reduction(grad, local, rank, pname, ws, ep)
                right = (f"an expert's gradient already holds its EP group's tokens (they came "
                         f"back through the all-to-all): sum it over the ranks that hold the same "
                         f"experts, ranks {next(g for g in dp_groups if rank in g)}, and divide "
                         f"by all {ws}" if is_expert else
                         f"a replicated parameter saw only this rank's tokens: sum it over all "
                         f"{ws} ranks and divide by {ws}")
                said = where
                try:
                    compare(grad, expected, where, atol=1e-12, rtol=1e-9)
                except CheckFailed as e:
                    said = str(e)[:-1]
                raise CheckFailed(f"{said}" + (f" — that is {matched}" if matched else "")
                                  + f"; {right}.")
    passed(f"{name} leaves every rank with the global gradient on (ep, dp) layouts ep×dp = "
           f"{', '.join(f'{ep}×{ws // ep}' for ws, ep in layouts)}: each expert averaged with "
           f"the ranks that hold it, everything else over every rank.")
