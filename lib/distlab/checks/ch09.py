"""Checkers for workbook 09: the router's top-k gates, the Switch auxiliary loss, and the
dispatch plan and combine of an expert-parallel MoE layer.

The router and the loss are local arithmetic: they are called here on small, readable logits and
compared, value and gradient, with the course's layer. The dispatch plan and the combine are
first called on small cases here, then plugged into `ExpertParallelMoE` on real ranks, whose
every output and gradient is compared with the single-process `MoE` on the same tokens — and
whose trace must show expert parallelism's pattern: per forward, one all_to_all of the counts,
then exactly one all_to_all each way (dispatch, combine), and their two reverses in backward;
nothing from your function, which is local.

Calling the course's own function (`distlab.moe.route`, `load_balancing_loss`,
`distlab.expert_parallel.dispatch_plan`, `combine`) is refused: the exercise is to write it.
"""
import contextlib

import torch

from .. import expert_parallel as ep_lib
from .. import moe as moe_lib
from .. import trace as _trace
from ..moe import Routing, make_moe, route
from . import (expect_arguments, CheckFailed, UsedCourseCode, call_learner, compare, forbid, passed, run_learner,
               sizes_phrase)

D_MODEL = 8
TIMEOUT = 30  # a learner's deadlock is reported (with where each rank waits) within this
# (ep_size, n_experts, top_k, capacity_factor): odd sizes, top-2 and dropping included.
CASES = [(1, 4, 1, None), (2, 4, 1, 1.0), (3, 6, 2, None), (4, 8, 2, 0.75), (2, 2, 2, 0.5)]


def _course_code():
    return (moe_lib.route, moe_lib.load_balancing_loss, moe_lib.capacity_keep,
            ep_lib.dispatch_plan, ep_lib.combine)


@contextlib.contextmanager
def _refusing(what):
    """The course's functions refused while the learner's runs (in this process or a rank)."""
    with forbid(*_course_code(), exercise=f"write {what} yourself"):
        yield


def _called(fn, *args, name):
    """Call the learner's function here, on one process: it is local arithmetic."""
    try:
        with _refusing(name):
            return call_learner(fn, *args, name=name)
    except UsedCourseCode as e:
        raise CheckFailed(str(e)) from None
    except (ValueError, RuntimeError) as e:
        if "process group" not in str(e).lower():
            raise
        raise CheckFailed(f"{name} tried to communicate (torch.distributed: "
                          f"{str(e).splitlines()[0]}) when the check called it on its own; "
                          f"{name} is local arithmetic on this rank's own tensors — no "
                          f"collective belongs in it.") from None


def _require(fn, n_args, example):
    return expect_arguments(fn, n_args, example, getattr(fn, "__name__", repr(fn)))


def _routing(case, seed):
    ep_size, n_experts, top_k, capacity_factor = case
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(10, n_experts, generator=g, dtype=torch.float64)
    logits[:6, 0] += 3.0          # a crowd on expert 0, so capacity really drops some
    return route(logits, top_k, capacity_factor)


def _describe(case):
    ep_size, n_experts, top_k, capacity_factor = case
    return (f"ep_size={ep_size}, {n_experts} experts, top_k={top_k}, "
            f"capacity_factor={capacity_factor}")


# ---- exercise 1: the router's top-k gates -------------------------------------------------------

# Readable logits (no ties within a row): 4 tokens, 4 experts.
LOGITS = torch.tensor([[2.0, 0.0, 1.0, -1.0],
                       [0.0, 3.0, 1.0, 0.5],
                       [1.0, 1.5, -2.0, 2.5],
                       [-1.0, 0.0, 0.5, 1.0]], dtype=torch.float64)


def check_top_k_gates(fn):
    """fn(logits, k) -> (experts, gates), both (T, k), best first; for k > 1 the gates are the
    chosen probabilities renormalised to sum to 1; for k = 1 the probability itself (Switch)."""
    name = _require(fn, 2, "top_k_gates(logits, k)")
    g = torch.Generator().manual_seed(5)
    cases = [(LOGITS, 1), (LOGITS, 2), (LOGITS, 3),
             (torch.randn(7, 6, generator=g, dtype=torch.float64), 2)]
    for logits, k in cases:
        where = f"{name} on {tuple(logits.shape)} logits with k={k}"
        ref = route(logits, k)
        mine = logits.clone().requires_grad_()
        got = _called(fn, mine, k, name=name)
        if not (isinstance(got, (tuple, list)) and len(got) == 2):
            raise CheckFailed(f"{where} should return (experts, gates); got "
                              f"{type(got).__name__}.")
        experts, gates = got
        if not torch.is_tensor(experts) or tuple(experts.shape) != (len(logits), k):
            raise CheckFailed(f"{where}: experts should be a ({len(logits)}, {k}) tensor of "
                              f"expert ids, best first; got {experts!r}.")
        compare(experts.long(), ref.experts, f"{where}, experts (best first)")
        if not torch.is_tensor(gates) or tuple(gates.shape) != (len(logits), k):
            raise CheckFailed(f"{where}: gates should be a ({len(logits)}, {k}) tensor; got "
                              f"{gates!r}.")
        sums = gates.detach().sum(-1)
        if k > 1 and not torch.allclose(sums, torch.ones_like(sums)):
            t = int((sums - 1).abs().argmax())
            raise CheckFailed(f"{where}: token {t}'s {k} gates sum to {sums[t].item():.4f}; "
                              f"renormalise them over the chosen experts so that they sum to 1 "
                              f"(divide by their sum), or the layer's output shrinks with how "
                              f"unsure the router is.")
        if k == 1 and torch.allclose(gates.detach(), torch.ones_like(gates)):
            raise CheckFailed(f"{where}: every gate is 1.0 — renormalising a single gate makes "
                              f"it 1 whatever the router said, so the task loss gives the router "
                              f"no gradient at all; with k=1 the gate is the probability itself "
                              f"(Switch Transformer).")
        compare(gates, ref.gates, f"{where}, gates", atol=1e-10, rtol=1e-9)
        if not gates.requires_grad:
            raise CheckFailed(f"{where}: the gates carry no gradient back to the logits (no "
                              f".detach(), no torch.no_grad()): the router learns through them.")
        weights = torch.arange(1.0, gates.numel() + 1, dtype=gates.dtype).view_as(gates)
        (gates * weights).sum().backward()
        ref_logits = logits.clone().requires_grad_()
        (route(ref_logits, k).gates * weights).sum().backward()
        compare(mine.grad, ref_logits.grad, f"{where}, gradient of the logits through the gates",
                atol=1e-10, rtol=1e-9)
    passed(f"{name} picks the top-k experts, best first, with gates renormalised over them for "
           f"k > 1 (the probability itself for k = 1) — values and gradients, k = 1, 2 and 3.")


# ---- exercise 2: the Switch auxiliary loss --------------------------------------------------------

def check_switch_aux_loss(fn):
    """fn(probs, experts) -> E · Σ_e f_e · P_e; probs (T, E) router softmax, experts (T, k)."""
    name = _require(fn, 2, "switch_aux_loss(probs, experts)")
    E = 4
    uniform = torch.full((8, E), 1 / E, dtype=torch.float64)
    balanced = torch.arange(8).remainder(E).view(8, 1)
    crowd = torch.tensor([[0.7, 0.1, 0.1, 0.1]] * 8, dtype=torch.float64)
    g = torch.Generator().manual_seed(9)
    cases = [("a uniform router with a balanced load (8 tokens, 4 experts, top-1)",
              uniform, balanced),
             ("every token on expert 0 with probability 0.7 (top-1)", crowd,
              torch.zeros(8, 1, dtype=torch.long))]
    for k, n_experts in ((1, 6), (2, 4), (2, 8)):
        logits = torch.randn(10, n_experts, generator=g, dtype=torch.float64)
        logits[:5, 1] += 2.0
        r = route(logits, k)
        cases.append((f"10 tokens, {n_experts} experts, top-{k}", r.probs.detach(), r.experts))
    for what, probs, experts in cases:
        k = experts.shape[1]
        ref_probs = probs.clone().requires_grad_()
        ref = moe_lib.load_balancing_loss(Routing(ref_probs, experts, None, None, None))
        mine = probs.clone().requires_grad_()
        got = _called(fn, mine, experts.clone(), name=name)
        where = f"{name} for {what}"
        if not torch.is_tensor(got) or got.numel() != 1:
            raise CheckFailed(f"{where} should return a one-element tensor; got {got!r}.")
        value, expected = got.reshape(()).item(), ref.item()
        if abs(value - expected) > 1e-9 * max(1, abs(expected)):
            hint = ""
            n_exp = probs.shape[1]
            for factor, why in ((1 / n_exp, f"multiply by E = {n_exp}: the scaling makes a "
                                             f"uniform load give 1 whatever the number of "
                                             f"experts"),
                                (k, f"f_e is the fraction of the T·k = {len(probs) * k} "
                                    f"assignments, not of the {len(probs)} tokens"),
                                (n_exp, "E appears once, not twice"),
                                (1 / k, f"f_e counts the assignments of all k = {k} slots")):
                if abs(value - factor * expected) <= 1e-9 * max(1, abs(expected)) and factor != 1:
                    hint = f" — {factor:g}× the right value: {why}"
                    break
            raise CheckFailed(f"{where}: expected {expected:.6g}, got {value:.6g}{hint}.")
        if not got.requires_grad:
            raise CheckFailed(f"{where}: the loss carries no gradient to the router's "
                              f"probabilities; P_e (their mean) must stay differentiable.")
        got.reshape(()).backward()
        ref.backward()
        try:
            compare(mine.grad, ref_probs.grad, f"{where}, gradient of the probabilities",
                    atol=1e-10, rtol=1e-9)
        except CheckFailed as e:
            raise CheckFailed(str(e)[:-1] + " — f_e is a count of choices: it carries no "
                              "gradient; only P_e (the mean probability) does.") from None
    passed(f"{name} gives E · Σ f_e · P_e — 1 for a uniform load, value and gradient, top-1 "
           f"and top-2, 4 to 8 experts.")


# ---- exercise 3: the dispatch plan ----------------------------------------------------------------

def _check_plan_case(fn, case, seed):
    ep_size, n_experts, _, _ = case
    r = _routing(case, seed)
    where = f"dispatch_plan with {_describe(case)}"
    got = _called(fn, r.experts.clone(), r.keep.clone(), n_experts, ep_size,
                  name="dispatch_plan")
    if not (isinstance(got, (tuple, list)) and len(got) == 2):
        raise CheckFailed(f"{where} should return (order, send_splits); got {type(got).__name__}.")
    order, splits = got
    ref_order, ref_splits = ep_lib.dispatch_plan(r.experts, r.keep, n_experts, ep_size)
    if torch.is_tensor(splits):
        splits = splits.tolist()
    compare(list(splits), ref_splits, f"{where}: send_splits")
    if not torch.is_tensor(order) or order.dtype not in (torch.int64, torch.int32):
        raise CheckFailed(f"{where}: order should be a tensor of integer indices into the "
                          f"flattened (tokens·k) assignments; got {order!r}.")
    order = order.long().reshape(-1)
    if sorted(order.tolist()) != sorted(ref_order.tolist()):
        missing = sorted(set(ref_order.tolist()) - set(order.tolist()))
        extra = sorted(set(order.tolist()) - set(ref_order.tolist()))
        raise CheckFailed(f"{where}: order must list each kept assignment once; missing "
                          f"{missing[:5]}, unexpected {extra[:5]} (a dropped assignment is sent "
                          f"nowhere).")
    experts = r.experts.reshape(-1)[order]
    bad = (experts[1:] < experts[:-1]).nonzero()
    if len(bad):
        i = int(bad[0])
        raise CheckFailed(f"{where}: order sends assignment {int(order[i])} (expert "
                          f"{int(experts[i])}) before assignment {int(order[i + 1])} (expert "
                          f"{int(experts[i + 1])}); sort the kept assignments by expert, so that "
                          f"each rank's rows are one contiguous run.")


def _tokens(rank):
    g = torch.Generator().manual_seed(300 + rank)
    return torch.randn(12, D_MODEL, generator=g, dtype=torch.float64)


def _layer(world_size, top_k, capacity_factor):
    moe = make_moe(seed=4, dtype=torch.float64, d_model=D_MODEL, hidden=16,
                   n_experts=2 * world_size, top_k=top_k, capacity_factor=capacity_factor)
    with torch.no_grad():
        moe.router.bias[0] = 1.5      # uneven loads: uneven splits, and some dropping
    return moe


LEARNER_SPAN = "your function"


def _labelled(fn, what):
    """The learner's function, run inside a trace span (its communication shows under that
    label) with the course's own version refused."""
    def wrapped(*args):
        with _trace.span(LEARNER_SPAN), _refusing(what):
            return fn(*args)
    return wrapped


def _in_the_layer(rank, world_size, plan, combine, learner):
    """On every rank: (got, expected) outputs and gradients, EP layer vs the one-process layer."""
    results = []
    if learner == "plan":
        plan = _labelled(plan, "the dispatch plan")
    else:
        combine = _labelled(combine, "the combine")
    for case, (top_k, capacity_factor) in enumerate([(1, None), (2, 1.0)]):
        moe = _layer(world_size, top_k, capacity_factor)
        layer = ep_lib.ExpertParallelMoE(moe, None, plan=plan, combine=combine)
        x = _tokens(rank).requires_grad_()
        with _trace.span(f"forward {case}"):
            y, _ = layer(x)
        weights = torch.linspace(-1, 1, y.numel(), dtype=y.dtype).view_as(y)
        with _trace.span(f"backward {case}"):
            (y * weights).sum().backward()
        xr = _tokens(rank).requires_grad_()
        yr, _ = moe(xr)
        (yr * weights).sum().backward()
        results.append(((top_k, capacity_factor), (y.detach(), x.grad), (yr.detach(), xr.grad)))
    return results


def _check_ep_structure(trace, ws, name):
    """Per forward: counts, dispatch, combine = 3 all_to_alls; per backward: the two reverses;
    the learner's (local) function: nothing."""
    for rank in range(ws):
        mine = [e for e in trace.comm(rank) if e["label"] == [LEARNER_SPAN]]
        if mine:
            calls = f"{mine[0]['op']} of {mine[0]['bytes']} B" + (
                f", {len(mine)} collectives in all" if len(mine) > 1 else "")
            raise CheckFailed(
                f"with EP={ws}, rank {rank}'s {name} communicated ({calls}; from the run's "
                f"trace); {name} is local arithmetic on this rank's own tokens — the layer's "
                f"all_to_alls carry everything between ranks (one of the counts, then exactly "
                f"one each way for the rows).")
        for case in (0, 1):
            for phase, wanted in (("forward", 3), ("backward", 2)):
                calls = [e for e in trace.comm(rank) if e["label"] == [f"{phase} {case}"]]
                ops = [e["op"] for e in calls]
                if ops != ["all_to_all"] * wanted:
                    raise CheckFailed(
                        f"with EP={ws}, rank {rank}'s layer {phase} made {ops or 'no collective'} "
                        f"(from the run's trace); expert parallelism makes "
                        f"{'the counts, the dispatch and the combine: 3 all_to_alls' if wanted == 3 else 'the two reverse all_to_alls'} — "
                        f"exactly one each way for the rows.")


def _check_in_the_layer(name, plan, combine, world_sizes, learner):
    for ws in world_sizes:
        got = run_learner(_in_the_layer, ws, plan, combine, learner, name=name,
                          timeout=TIMEOUT, trace=True)
        _check_ep_structure(got.trace, ws, name)
        for rank, cases in enumerate(got):
            for (top_k, cf), (y, gx), (yr, gr) in cases:
                where = (f"the expert-parallel layer using your {name}, EP={ws}, top_k={top_k}, "
                         f"capacity_factor={cf}, rank {rank}")
                compare(y, yr, f"{where}: output", atol=1e-10, rtol=1e-9)
                compare(gx, gr, f"{where}: gradient of the input", atol=1e-10, rtol=1e-9)


def check_dispatch_plan(fn, world_sizes=(2, 3)):
    """fn(experts, keep, n_experts, ep_size) -> (order, send_splits)."""
    _require(fn, 4, "dispatch_plan(experts, keep, n_experts, ep_size)")
    for i, case in enumerate(CASES):
        _check_plan_case(fn, case, seed=10 + i)
    _check_in_the_layer("dispatch_plan", fn, ep_lib.combine, world_sizes, "plan")
    passed(f"dispatch_plan sorts the kept assignments by expert and counts the rows for each "
           f"rank; the layer built on it equals one process at EP {sizes_phrase(world_sizes)}, "
           f"top-1 and top-2, with dropping — one all_to_all each way, as the trace shows.")


def check_combine(fn, world_sizes=(2, 4)):
    """fn(expert_out, token, gate, n_tokens) -> (n_tokens, d) outputs."""
    _require(fn, 4, "combine(expert_out, token, gate, n_tokens)")
    g = torch.Generator().manual_seed(2)
    for n_rows, n_tokens in [(7, 5), (0, 3), (12, 4)]:
        rows = torch.randn(n_rows, D_MODEL, generator=g, dtype=torch.float64)
        token = torch.randint(0, n_tokens, (n_rows,), generator=g)
        gate = torch.rand(n_rows, generator=g, dtype=torch.float64)
        expected = ep_lib.combine(rows, token, gate, n_tokens)
        got = _called(fn, rows.clone(), token.clone(), gate.clone(), n_tokens, name="combine")
        compare(got, expected, f"combine of {n_rows} rows into {n_tokens} tokens",
                atol=1e-12, rtol=1e-12)
    _check_in_the_layer("combine", ep_lib.dispatch_plan, fn, world_sizes, "combine")
    passed(f"combine puts every gate-weighted row back on its token; the layer built on it "
           f"equals one process at EP {sizes_phrase(world_sizes)}, top-1 and top-2, with "
           f"dropping — one all_to_all each way, as the trace shows.")
