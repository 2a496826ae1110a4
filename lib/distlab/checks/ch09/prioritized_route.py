"""Workbook 09, exercise 1: top-k routing with batch-prioritized capacity."""
import torch

from ... import moe as moe_lib
from ...moe import Routing
from .. import CheckFailed, compare, expect_arguments, passed, run_learner, sizes_phrase
from ._common import (LAYER_CASES, TIMEOUT, _called, _compare_ranks, _layer_versus_reference,
                      _refusing)
from ._references import (_capacity, _one_process_layer, _priority_order, _reference_route,
                          _skewed_layer, _tokens)


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
