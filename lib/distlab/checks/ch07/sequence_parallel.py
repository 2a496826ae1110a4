"""Workbook 07, exercise 1: the sequence-parallel pair of autograd Functions, on real subgroups."""
import contextlib
import math
import types

import torch
import torch.nn.functional as F

from ... import trace as _trace
from .. import CheckFailed, _not_written, forbid, passed, unsolved_stub
from ._common import TOL, _compare, _course_code, _ints, _returned_tensor, _run, _scaled
from ._functions import (_refuse_differentiable_collectives, _require_function_class,
                         _saved_for_backward)
from ._groups import (LAYOUTS, _describe_calls, _group_of, _layouts_phrase, _my_group, _off_group,
                      _phase_calls, _sent_bytes)


SP_LAYOUTS = LAYOUTS
SP_STEPS, LR = 2, 0.01
SP_PER, SP_BATCH, SP_WIDTH = 2, 2, 3       # tokens per rank, sequences, width of the activation


def _sp_rank(rank, ws, gather, scatter, layout):
    """Three harnesses, each against the dense layer in this process: (a) the gather in front of
    a column-parallel layer, (b) the scatter after a row-parallel one, (c) both around a residual
    MLP. The TP group is this rank's group of `layout`; each of its N ranks holds `per` tokens of
    a (b, t, d) activation: t = per · N. Each group has numbers of its own."""
    group, ranks, gi, r = _my_group(rank, layout)
    n = len(ranks)
    b, per, d, hidden = SP_BATCH, SP_PER, SP_WIDTH, 2 * n
    t, mine, cols = per * n, slice(r * per, r * per + per), slice(2 * r, 2 * r + 2)
    seed = 31 + 10 * n + 100 * gi
    x, h = _ints((b, t, d), seed), _ints((b, t, hidden), seed + 1)
    g1, g2 = _ints((b, t, hidden), seed + 2), _ints((b, t, d), seed + 3)     # loss weightings
    dense = {k: _ints(s, seed + 4 + i).requires_grad_() for i, (k, s) in enumerate(
        (("w1", (hidden, d)), ("w2", (d, hidden)), ("w3", (hidden, d)), ("w4", (d, hidden)))
    )}
    shard = {"w1": dense["w1"][cols], "w2": dense["w2"][:, cols], "w3": dense["w3"][cols],
             "w4": dense["w4"][:, cols]}
    shard = {k: v.detach().clone().requires_grad_() for k, v in shard.items()}
    gname, sname = gather.__name__, scatter.__name__

    def guarded():                    # the course's Functions and torch's differentiable ones
        stack = contextlib.ExitStack()
        stack.enter_context(forbid(*_course_code(), exercise="write the Function yourself"))
        stack.enter_context(_refuse_differentiable_collectives(
            "write the Function's forward and backward yourself"))
        return stack

    steps, saved = [], {gname: [0], sname: [0]}
    for step in range(1, SP_STEPS + 1):
        got, want = {}, {}
        # (a) entering a TP region: my tokens in, the whole sequence out, into my output features
        xi = x[:, mine].clone().requires_grad_()
        with _trace.span(f"gather forward {step}"):
            with guarded(), _saved_for_backward(saved[gname]):
                full = gather.apply(xi, group)
            _returned_tensor(full, (b, t, d), f"{gname}.apply(x, group) with x of shape "
                             f"{tuple(xi.shape)}", f" — the tokens of the {n} ranks of `group` "
                             f"(not of the whole world), gathered along the sequence (dim 1), in "
                             f"the group's rank order")
            y = F.linear(full, shard["w1"])
        with _trace.span(f"gather backward {step}"):
            with guarded():
                (y * g1[..., cols]).sum().backward()
        xd = x.clone().requires_grad_()
        (F.linear(xd, dense["w1"]) * g1).sum().backward()
        got["a"] = {"output": y.detach(), "gradient of this rank's tokens": xi.grad,
                    "weight-shard gradient": shard["w1"].grad}
        want["a"] = {"output": F.linear(x, dense["w1"].detach())[..., cols],
                     "gradient of this rank's tokens": xd.grad[:, mine],
                     "weight-shard gradient": dense["w1"].grad[cols]}
        own = (g1[..., cols] @ shard["w1"].detach())[:, mine]        # this rank's term alone
        # (b) leaving a TP region: a partial sum of the whole sequence in, my tokens summed out
        hi = h[..., cols].clone().requires_grad_()
        with _trace.span(f"scatter forward {step}"):
            partial = F.linear(hi, shard["w2"])
            with guarded(), _saved_for_backward(saved[sname]):
                out = scatter.apply(partial, group)
            _returned_tensor(out, (b, per, d), f"{sname}.apply(partial, group) with a partial "
                             f"sum of shape {tuple(partial.shape)}", f" — this rank's tokens "
                             f"(dim 1) of the sum over the {n} ranks of `group`")
        with _trace.span(f"scatter backward {step}"):
            with guarded():
                (out * g2[:, mine]).sum().backward()
        hd = h.clone().requires_grad_()
        yd = F.linear(hd, dense["w2"])
        (yd * g2).sum().backward()
        got["b"] = {"output": out.detach(), "input gradient": hi.grad,
                    "weight-shard gradient": shard["w2"].grad}
        want["b"] = {"output": yd.detach()[:, mine], "input gradient": hd.grad[..., cols],
                     "weight-shard gradient": dense["w2"].grad[:, cols]}
        # (c) both, around a residual MLP: x + fc2(gelu(fc1(x))), the loss of my tokens
        xi = x[:, mine].clone().requires_grad_()
        with _trace.span(f"mlp {step}"):
            with guarded():
                z = F.gelu(F.linear(gather.apply(xi, group), shard["w3"]))
                yc = xi + scatter.apply(F.linear(z, shard["w4"]), group)
                (yc ** 2).sum().backward()
        xd = x.clone().requires_grad_()
        ycd = xd + F.linear(F.gelu(F.linear(xd, dense["w3"])), dense["w4"])
        (ycd ** 2).sum().backward()
        got["c"] = {"output": yc.detach(), "gradient of this rank's tokens": xi.grad,
                    "fc1 weight-shard gradient": shard["w3"].grad,
                    "fc2 weight-shard gradient": shard["w4"].grad}
        want["c"] = {"output": ycd.detach()[:, mine], "gradient of this rank's tokens":
                     xd.grad[:, mine], "fc1 weight-shard gradient": dense["w3"].grad[cols],
                     "fc2 weight-shard gradient": dense["w4"].grad[:, cols]}
        steps.append((got, want, own))
        with torch.no_grad():
            for k in shard:
                shard[k] -= LR * shard[k].grad
                dense[k] -= LR * dense[k].grad
                shard[k].grad, dense[k].grad = None, None
    return steps, {k: v[0] / SP_STEPS for k, v in saved.items()}


def _stub_of(*functions):
    """Which Function (and which of its methods) is still a stub: each is asked on its own, in
    this process (a stub raises before it touches a process group)."""
    for cls in functions:
        for method, args in (("forward", (types.SimpleNamespace(), torch.zeros(1, 2, 1), None)),
                             ("backward", (types.SimpleNamespace(group=None),
                                           torch.zeros(1, 2, 1)))):
            try:
                getattr(cls, method)(*args)
            except NotImplementedError:
                return f"{cls.__name__}.{method}"
            except Exception:
                pass
    return " or ".join(cls.__name__ for cls in functions)


# phase: (the collective a ring would make, why that much must travel, why nothing is not enough)
_SP_RULES = {
    "gather forward": ("all_gather", "entering a TP region, every rank needs the whole sequence "
                       "of its group: each rank sends its tokens to the N−1 others, (N−1)/N of "
                       "the sequence on a ring (one all-gather)."),
    "gather backward": ("reduce_scatter", "every rank of the group used the gathered copy, so the "
                        "gradient of each token is a sum over the group's ranks, and each keeps "
                        "only its own tokens of that sum: one reduce-scatter, (N−1)/N of the "
                        "sequence per rank — an all-reduce and a slice give the same numbers for "
                        "twice the bytes, and a gradient kept locally is only this rank's term."),
    "scatter forward": ("reduce_scatter", "leaving a TP region, the group's partial sums are "
                        "added and each rank keeps its tokens: one reduce-scatter, (N−1)/N of the "
                        "sequence per rank — an all-reduce and a slice send twice the bytes."),
    "scatter backward": ("all_gather", "every rank's partial sum fed every token, so each needs "
                         "the gradient of its group's whole sequence: one all-gather, (N−1)/N of "
                         "it per rank."),
}


def _check_traffic(trace, ws, layout, names):
    """One rule for every phase, however the bytes are sent (one collective, a list form, a
    hand-written ring of send/recv): every call on the rank's own group, and (N−1)/N of the
    sequence sent per rank — not nothing, not twice that."""
    for rank in range(ws):
        ranks = _group_of(rank, layout)
        n = len(ranks)
        S = SP_BATCH * SP_PER * n * SP_WIDTH * 8
        expected = (n - 1) / n * S
        where = f"on {_layouts_phrase([(ws, layout)])}"
        for step in range(1, SP_STEPS + 1):
            for phase, (op, why) in _SP_RULES.items():
                who = names[0] if phase.startswith("gather") else names[1]
                calls = _phase_calls(trace, rank, f"{phase} {step}")
                head = f"{who} {where}, in step {step}'s {phase.split()[1]}: rank {rank}"
                bad, what = _off_group(calls, ranks, ws)
                if bad is not None:
                    raise CheckFailed(
                        f"{head} made {what} (from the run's trace), outside its tensor-parallel "
                        f"group {list(ranks)}: pass the `group` it was given to every collective "
                        f"(without it a collective runs over the whole world).")
                sent = _sent_bytes(calls, ws)
                if sent == 0:
                    made = f" although it called {_describe_calls(calls)}" if calls else ""
                    raise CheckFailed(f"{head} sent nothing (from the run's trace){made}; {why}")
                if not math.isclose(sent, expected, rel_tol=1e-9):
                    raise CheckFailed(
                        f"{head} sent {sent:,.0f} B ({_describe_calls(calls)}, from the run's "
                        f"trace), {sent / expected:.3g}× the {expected:,.0f} B a ring {op} sends "
                        f"(N = {n}); {why}")


def _check_saved(saved, names, ws, layout):
    """Sequence parallelism keeps only a rank's own tokens: its Functions save no more."""
    for rank, per_function in enumerate(saved):
        n = len(_group_of(rank, layout))
        limit = SP_BATCH * SP_PER * SP_WIDTH * 8
        for who in names:
            if per_function[who] > limit:
                raise CheckFailed(
                    f"{who} on {_layouts_phrase([(ws, layout)])}: rank {rank}'s forward saved "
                    f"{per_function[who]:,.0f} B for backward, more than its own tokens "
                    f"({limit:,} B; the whole sequence is {n * limit:,} B) — sequence "
                    f"parallelism exists so that a rank keeps only its tokens, and this "
                    f"Function's backward needs nothing from forward but the group (keep it in "
                    f"ctx).")


def check_sequence_parallel_pair(gather_function, scatter_function, layouts=SP_LAYOUTS):
    """gather_function: an autograd.Function, apply(x, group): all-gather along dim 1 (the
    sequence) in forward, reduce-scatter along dim 1 in backward. scatter_function: the mirror,
    apply(partial, group): reduce-scatter along dim 1 in forward, all-gather in backward.
    `layouts`: [(world size, its groups)], run in turn."""
    names = (_require_function_class(gather_function, "AllGatherSequence"),
             _require_function_class(scatter_function, "ReduceScatterSequence"))
    stub = unsolved_stub(*(getattr(cls, m) for cls in (gather_function, scatter_function)
                           for m in ("forward", "backward")))
    if stub is not None:                 # named at once, without launching ranks to find it
        raise _not_written(stub.__qualname__)
    labels = {"a": f"{names[0]} in front of a column-parallel layer",
              "b": f"{names[1]} after a row-parallel layer",
              "c": f"a residual MLP between {names[0]} and {names[1]}"}
    for ws, layout in layouts:
        try:
            results = _run(_sp_rank, ws, gather_function, scatter_function, layout,
                           name=f"{names[0]} or {names[1]}", is_function=True)
        except NotImplementedError:
            raise _not_written(_stub_of(gather_function, scatter_function)) from None
        for rank, (steps, _) in enumerate(results):
            n = len(_group_of(rank, layout))
            for step, (got, want, own) in enumerate(steps, 1):
                for part in "abc":
                    def hint(what, value, part=part):
                        if part == "a" and what.startswith("gradient") and torch.allclose(
                                value, own, **TOL):
                            return (" — that is only this rank's own term: every rank of the "
                                    "group used the gathered copy of these tokens, so their "
                                    "gradient is the sum over the group of each rank's gradient "
                                    "for them (sum, then keep this rank's tokens)")
                        if _scaled(value, want[part][what], n):
                            return (f" ({what} is {n}× the right one: {n} = the number of "
                                    f"ranks in the group)")
                        return ""
                    _compare(got[part], want[part],
                             f"{labels[part]} on {_layouts_phrase([(ws, layout)])}, rank {rank} "
                             f"(group {list(_group_of(rank, layout))}), step {step}", hint)
        _check_traffic(results.trace, ws, layout, names)
        _check_saved([saved for _, saved in results], names, ws, layout)
    passed(f"{names[0]} and {names[1]} make a column-parallel layer, a row-parallel layer and a "
           f"residual MLP equal to the dense ones for {SP_STEPS} SGD steps — outputs, the "
           f"gradient of each rank's tokens, every weight shard's gradient — on "
           f"{_layouts_phrase(layouts)}, each group on its own numbers; every rank sent "
           f"(N−1)/N of the sequence in each direction on its own group, as a ring all-gather "
           f"and reduce-scatter do, and saved nothing for backward beyond its own tokens.")
