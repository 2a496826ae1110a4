"""Checkers for workbook 09: capacity the chapter did not write, and a dispatch with static shapes.

1. `check_prioritized_route`: top-k routing with batch-prioritized capacity (V-MoE's BPR: the
   most confident tokens are served first). Judged on this process on several shapes, including
   float32 logits of size ~100 that overflow a naive exp, then plugged into an expert-parallel
   layer on real ranks (EP 2 and 3): every rank's output and input gradient equal a one-process
   layer routed by this module's reference.
2. `check_group_capacity_keep`: the capacity counted over the whole EP group instead of per
   source rank, on real subgroups side by side (3 ranks as one group; 4 as two groups of 2; 5 as
   {0, 2} and {1, 3, 4}) with uneven token counts drawn afresh per check: every rank's keep mask
   is compared element by element with one process on its group's concatenated batch, a
   collective that reaches past the group is named from the trace, and the layer built on it
   equals one process (dropped tokens come back as zeros).
3. `check_padded_dispatch`: the dispatch with static shapes (a padded buffer of `capacity` rows
   per expert and source rank, one exchange of one shape, as XLA and CUDA graphs want): every
   rank's received buffer is compared with the rows its group's sources hold (drawn afresh, so
   only rows that travelled can match), on the same subgroups, and every rank must send the same
   bytes whatever the routing (the chapter's uneven splits, padded on arrival, are refused).

The references of this module are written here, never shown in a notebook. The course's own
`route`, `capacity_keep`, `dispatch_plan`, `all_to_all`, the layer's group capacity, this
module's references and the helpers that build its data refuse to run inside the learner's
function (`forbid`).
"""
import contextlib
import math

import torch
import torch.distributed as dist

from .. import expert_parallel as ep_lib
from .. import moe as moe_lib
from ..moe import Routing, make_moe
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
            ep_lib.dispatch_plan, ep_lib.all_to_all,
            ep_lib.ExpertParallelMoE._route_with_group_capacity,
            _reference_route, _group_reference, _queue_positions, _priority_order,
            _one_process_layer, _dispatch_reference,
            # the checker's own data: the other ranks' inputs rebuilt without a message would
            # pass without communicating (they are also drawn afresh per check)
            _tokens, _group_case, _dispatch_case, _skewed_layer)


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


# ---- the groups every group-taking check runs on ------------------------------------------------
#
# A function given `group` must talk to that group only. Each layout below splits the world into
# EP groups that run at the same time on different tokens: four ranks as two groups of two, and
# five ranks as {0, 2} and {1, 3, 4} (a group whose ranks are not 0..k). A function that talks to
# the whole world mixes the groups' data, and the trace names the collective that did.

LAYOUTS = ((3, ((0, 1, 2),)), (4, ((0, 1), (2, 3))), (5, ((0, 2), (1, 3, 4))))


def _layout_phrase(layouts):
    return "; ".join(f"{ws} ranks as " + " and ".join(str(list(g)) for g in groups)
                     for ws, groups in layouts)


def _my_group(rank, groups):
    """Every rank creates every group, in the same order; (this rank's group, its ranks)."""
    made = [dist.new_group(list(ranks)) for ranks in groups]
    i = next(i for i, ranks in enumerate(groups) if rank in ranks)
    return made[i], groups[i]


def _fresh_seed():
    # Drawn per check: the other ranks' inputs cannot be rebuilt without a message.
    import secrets
    return secrets.randbelow(2 ** 31)


def _talked_outside(trace, groups, name):
    """A one-sentence refusal when a rank's collective or message reached past its group."""
    for ranks in groups:
        for rank in ranks:
            for event in trace.comm(rank):
                if event["peer"] is not None:
                    outside = event["peer"] not in ranks
                    reached = [event["peer"]]
                else:
                    outside = set(event["group"]) != set(ranks)
                    reached = list(event["group"])
                if outside:
                    return (f"{name}: rank {rank}'s {event['op']} reached ranks {reached}, but "
                            f"its group is {list(ranks)} (the others form another EP group "
                            f"with other tokens): pass the `group` you were given to every "
                            f"collective, and use ranks inside it.")
    return None


# ---- exercise 2: the capacity of the whole EP group ------------------------------------------------

GROUP_CASES = ((4, 1, 1.0), (6, 2, 1.0), (4, 2, 0.5), (5, 3, 1.25))   # (E, k, capacity factor)


def _group_case(rank, n_experts, top_k, seed):
    """This rank's (T_r, k) chosen experts: 3 to 10 tokens, a crowd on one expert."""
    g = torch.Generator().manual_seed(seed + 7919 * rank)
    n = int(torch.randint(3, 11, (1,), generator=g))
    logits = torch.randn(n, n_experts, generator=g, dtype=torch.float64)
    logits[: n // 2 + 1, int(torch.randint(n_experts, (1,), generator=g))] += 3.0
    return logits.topk(top_k, dim=-1).indices


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


# ---- exercise 3: a dispatch with static shapes ------------------------------------------------------

DISPATCH_CASES = {4: (4, 1, 2, 5), 5: (6, 2, 3, 3)}     # world: (E, k, capacity per source, d)


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


def _dispatch_on_ranks(rank, world_size, fn, groups, seed):
    group, ranks = _my_group(rank, groups)
    n_experts, k, capacity, d = DISPATCH_CASES[world_size]
    x, experts, keep = _dispatch_case(rank, n_experts, k, capacity, d, seed)
    with _refusing("the static dispatch"):
        got = fn(x.clone(), experts.clone(), keep.clone(), n_experts, capacity, group)
    return (x, experts, keep), got


def _static_bytes(trace, groups):
    """(rank, bytes) of the ranks of one group that sent the most and the fewest bytes, or None
    when every rank of each group sent the same (the ranks' buffers have one shape)."""
    for ranks in groups:
        sent = {r: sum(e["bytes"] for e in trace.comm(r) if e["op"] != "recv") for r in ranks}
        if len(set(sent.values())) > 1:
            most, fewest = max(sent, key=sent.get), min(sent, key=sent.get)
            return (most, sent[most]), (fewest, sent[fewest])
    return None


def check_padded_dispatch(fn, layouts=LAYOUTS[1:]):
    """fn(x, experts, keep, n_experts, capacity, group) -> (N, E/N, capacity, d) on every rank of
    the group: [source rank, local expert, slot] holds the source's kept rows for that expert in
    token order, zeros after them; every rank sends the same bytes whatever the routing."""
    name = expect_arguments(fn, 6, "padded_dispatch(x, experts, keep, n_experts, capacity, "
                                   "group)")
    seed = _fresh_seed()
    for ws, groups in layouts:
        n_experts, k, capacity, d = DISPATCH_CASES[ws]
        got = run_learner(_dispatch_on_ranks, ws, fn, groups, seed, name=name, timeout=TIMEOUT,
                          trace=True, deadlock_rule="Every rank of the group must join the same "
                                                    "exchange, also a rank that sends no row.")
        outside = _talked_outside(got.trace, groups, name)
        if outside:
            raise CheckFailed(outside)
        for ranks in groups:
            expected = _dispatch_reference([got[r][0] for r in ranks], n_experts, capacity)
            n = len(ranks)
            for r, want in zip(ranks, expected):
                mine = got[r][1]
                where = (f"{name} on the group {list(ranks)} of {ws} ranks ({n_experts} experts, "
                         f"k={k}, capacity {capacity}, d={d}), rank {r}")
                if not torch.is_tensor(mine) or tuple(mine.shape) != tuple(want.shape):
                    raise CheckFailed(f"{where} should return a ({n}, {n_experts // n}, "
                                      f"{capacity}, {d}) tensor [source rank in the group, local "
                                      f"expert, slot, d]; got {mine!r:.80}.")
                bad = first_difference_at(mine, want)
                if bad is not None:
                    s, e, slot = bad
                    first = ranks.index(r) * (n_experts // n)
                    should = ("zeros (padding)" if not want[s, e, slot].any() else
                              f"that rank's {_nth(slot)} kept row for the expert, in token order")
                    holds = "zeros" if not mine[s, e, slot].any() else "another row"
                    raise CheckFailed(
                        f"{where}: slot {slot} of local expert {e} (global expert {first + e}) "
                        f"from the group's rank {s} (rank {ranks[s]}) should hold {should}; it "
                        f"holds {holds}.")
        uneven = _static_bytes(got.trace, groups)
        if uneven:
            (most, a), (fewest, b) = uneven
            raise CheckFailed(f"{name}: rank {most} sent {a} bytes and rank {fewest} {b}: the "
                              f"values are right, but a static dispatch sends the same padded "
                              f"buffer ({capacity} rows per expert per source) whatever the "
                              f"routing, so every exchange has one shape known in advance.")
    passed(f"{name} lays every kept row in its slot, zeros after, on subgroups side by side "
           f"({_layout_phrase(layouts)}), with tokens drawn afresh, and every rank sends the same "
           f"bytes whatever the routing.")


def _nth(i):
    return {0: "first", 1: "second", 2: "third"}.get(i, f"{i + 1}th")


def first_difference_at(got, want):
    """(source, expert, slot) of the first row that differs, or None."""
    diff = (got.to(want.dtype) - want).abs().amax(dim=-1) > 1e-12
    if not diff.any():
        return None
    return tuple(int(i) for i in diff.nonzero()[0])
