"""Checkers for workbook 07: the column-parallel f pair, the row-parallel layer and the Megatron
MLP built from them, each run on real ranks (2, 3 and 4 of them) for several SGD steps and
compared with the dense layer in float64: the output, the input's gradient and the gradient of
every weight and bias shard.

They also judge the communication, from the run's trace: Megatron's pattern is exactly one
all-reduce of the input gradient in the column layer's backward, exactly one all-reduce of the
partial sums in the row layer's forward, nothing else. And the harness does what the chapter
forbids: the column check sums your Function's output with a residual branch, so autograd hands
both branches the SAME gradient tensor — a backward that all-reduces it in place changes the
residual branch's gradient too, and the check sees it.

Inputs and weights are small integers, so the numbers in a message can be read by eye.
"""
import inspect
import re

import torch
import torch.nn.functional as F

from .. import tensor_parallel as _tpm
from .. import tp_comm as _tp_comm
from .. import trace as _trace
from ..launch import RankFailed
from . import (expect_arguments, CheckFailed, UsedCourseCode, _not_written, compare, forbid, passed, run,
               sizes_phrase)

WORLD_SIZES = (2, 3, 4)
STEPS, LR = 3, 0.01
TOL = dict(atol=1e-9, rtol=1e-9)
TIMEOUT = 20  # a learner's deadlock is reported (with where each rank waits) within this


def _course_code():
    """What the workbook asks the learner to write: the course's versions are refused."""
    objs = [_tp_comm._all_reduce, _tp_comm.identity_fwd_all_reduce_bwd,
            _tp_comm.all_reduce_fwd_identity_bwd, _tpm.replicated,
            _tpm.ColumnParallelLinear, _tpm.RowParallelLinear, _tpm.ParallelMLP]
    for cls in (_tp_comm.IdentityFwdAllReduceBwd, _tp_comm.AllReduceFwdIdentityBwd):
        objs += [cls.forward, cls.backward]
    return objs


def _ints(shape, seed, low=-3, high=4):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(low, high, shape, generator=g).double()


def _run(rank_fn, ws, *args, name, is_function=False):
    """Run traced; the course's own code refused with its one sentence; a stub named (the
    Function whose forward or backward is still a stub, when that is where it raised)."""
    try:
        return run(rank_fn, ws, *args, timeout=TIMEOUT, trace=True)
    except RankFailed as e:
        if e.exc_type == "NotImplementedError":
            frames = re.findall(r"line \d+, in (\w+)", e.remote_traceback or "")
            if not is_function and frames and frames[-1] in ("forward", "backward"):
                raise _not_written(f"the {frames[-1]} of the autograd Function that {name} "
                                   f"uses") from None
            raise _not_written(name) from None
        if e.exc_type == UsedCourseCode.__name__:
            raise CheckFailed(str(e.exception or e).splitlines()[-1]) from None
        if e.exc_type == CheckFailed.__name__:
            raise CheckFailed(str(e.exception or e).splitlines()[-1]) from None
        raise


def _require_function_class(fn, example):
    name = getattr(fn, "__name__", repr(fn))
    if not (isinstance(fn, type) and issubclass(fn, torch.autograd.Function)):
        raise TypeError(f"the check needs your torch.autograd.Function class itself, e.g. "
                        f"{example}; got {fn!r}.")
    for method, wanted in (("forward", ("ctx", "x", "group")), ("backward", ("ctx", "grad"))):
        try:
            params = list(inspect.signature(getattr(fn, method)).parameters)
        except (TypeError, ValueError):
            continue
        if len(params) != len(wanted) and not any(
                p.kind == p.VAR_POSITIONAL for p in inspect.signature(
                    getattr(fn, method)).parameters.values()):
            raise TypeError(f"{name}.{method} should take ({', '.join(wanted)}) — a "
                            f"@staticmethod; it takes ({', '.join(params)}).")
    return name


def _require_callable(fn, n_args, example):
    return expect_arguments(fn, n_args, example, getattr(fn, "__name__", repr(fn)))


def _returned_tensor(out, like, what):
    """Inside a rank, before anything else happens: the learner's result has the right shape."""
    if not isinstance(out, torch.Tensor):
        raise CheckFailed(f"{what} should return a tensor; it returned {type(out).__name__}.")
    if tuple(out.shape) != tuple(like):
        raise CheckFailed(f"{what} returned shape {tuple(out.shape)}; expected {tuple(like)}.")
    if not out.requires_grad:
        raise CheckFailed(f"{what} returned a tensor autograd cannot differentiate (no grad_fn): "
                          f"no .detach(), no .data, no copy into a new tensor — return the "
                          f"result of your Function's apply or of torch operations.")
    return out


# ---- the structure, from the trace ----------------------------------------------------------

def _phase_calls(trace, rank, phase):
    return [e for e in trace.comm(rank) if e["label"] and e["label"][0].startswith(phase)]


def _describe_calls(calls):
    if not calls:
        return "no collective"
    return ", ".join(f"{e['op']} of {e['bytes']} B" for e in calls)


def _check_structure(trace, ws, expected, context, rules):
    """expected: {phase: nbytes or None} — in each step's phase exactly one all_reduce of nbytes
    over all the ranks, or (None) no communication at all."""
    for rank in range(ws):
        for step in range(1, STEPS + 1):
            for phase, nbytes in expected.items():
                calls = _phase_calls(trace, rank, f"{phase} {step}")
                if nbytes is None:
                    ok = not calls
                else:
                    ok = (len(calls) == 1 and calls[0]["op"] == "all_reduce"
                          and calls[0]["bytes"] == nbytes
                          and len(calls[0]["group"] or ()) in (0, ws))
                if not ok:
                    raise CheckFailed(
                        f"{context}: in step {step}'s {phase}, rank {rank} made "
                        f"{_describe_calls(calls)} (from the run's trace); {rules[phase]}")


def _hint_if_scaled(got, expected, ws, what):
    """A sentence when `got` is `expected` times the number of ranks (a sum where none belongs)."""
    if got is not None and expected.abs().max() > 0 and torch.allclose(got, ws * expected):
        return f" ({what} is {ws}× the right one: {ws} = the number of ranks)"
    return ""


# ---- exercise 1: the column-parallel pair ---------------------------------------------------

def _column_rank(rank, ws, function):
    out_features, in_features, batch = 2 * ws, 3, 4
    w_full, b_full = _ints((out_features, in_features), 11 + ws), _ints((out_features,), 12 + ws)
    x, skip = _ints((batch, in_features), 13 + ws), _ints((batch, in_features), 14 + ws)
    weighting = _ints((batch, out_features), 15 + ws)
    mine = slice(rank * 2, rank * 2 + 2)
    w = w_full[mine].clone().requires_grad_()
    b = b_full[mine].clone().requires_grad_()
    wd, bd = w_full.clone().requires_grad_(), b_full.clone().requires_grad_()
    steps = []
    for step in range(1, STEPS + 1):
        xi, si = x.clone().requires_grad_(), skip.clone().requires_grad_()
        with _trace.span(f"forward {step}"):
            # A residual branch computed earlier in the forward; it joins your Function's output
            # in an add, so in backward autograd hands both branches the very same gradient
            # tensor, and runs your backward first (it was recorded last).
            residual = 2 * si
            with forbid(*_course_code(), exercise="write the Function yourself"):
                shared = function.apply(xi, None)
            _returned_tensor(shared, x.shape, f"{function.__name__}.apply(x, group)")
            y = F.linear(shared + residual, w, b)
        with _trace.span(f"backward {step}"):
            with forbid(*_course_code(), exercise="write the Function yourself"):
                (y * weighting[:, mine]).sum().backward()
        # the dense reference, in this process: the whole layer, no communication
        xd, sd = x.clone().requires_grad_(), skip.clone().requires_grad_()
        yd = F.linear(xd + 2 * sd, wd, bd)
        (yd * weighting).sum().backward()
        # The residual branch sees only this rank's own term of the gradient: the add hands it
        # the gradient of this rank's y (weighting · W_mine), before any sum over ranks.
        skip_expected = 2 * (weighting[:, mine] @ w.detach())
        steps.append(({"output": y.detach(), "input gradient": xi.grad,
                       "residual-branch gradient": si.grad, "weight-shard gradient": w.grad,
                       "bias-shard gradient": b.grad},
                      {"output": yd.detach()[:, mine], "input gradient": xd.grad,
                       "residual-branch gradient": skip_expected,
                       "weight-shard gradient": wd.grad[mine], "bias-shard gradient": bd.grad[mine]}))
        with torch.no_grad():
            for p, pd in ((w, wd), (b, bd)):
                p -= LR * p.grad
                pd -= LR * pd.grad
                p.grad, pd.grad = None, None
    return steps


def _compare_steps(results, ws, context, hints=lambda got, exp, what: ""):
    for rank, steps in enumerate(results):
        for step, (got, expected) in enumerate(steps, 1):
            for what in expected:
                where = f"{context} with {ws} ranks, rank {rank}, step {step}, {what}"
                if got[what] is None:
                    raise CheckFailed(f"{where}: none came back; is the output still connected "
                                      f"to autograd (no .detach(), no copy into a new tensor)?")
                try:
                    compare(got[what], expected[what], where, **TOL)
                except CheckFailed as e:
                    raise CheckFailed(str(e)[:-1] + hints(got[what], expected[what], what)
                                      + ".") from None


def check_identity_all_reduce(learner_function, world_sizes=WORLD_SIZES):
    """learner_function: an autograd.Function, apply(x, group): identity forward, all-reduce
    backward. Used as the input of a column-parallel layer, the whole layer must equal dense."""
    name = _require_function_class(learner_function,
                                   "check_identity_all_reduce(IdentityAllReduce)")

    def hints(got, expected, what):
        if what == "residual-branch gradient":
            if got is not None and not torch.allclose(got, expected):
                return (" — your backward changed the gradient it was given: autograd handed "
                        "that same tensor to the residual branch, and dist.all_reduce works in "
                        "place; all-reduce a copy (grad.clone())")
        if what == "input gradient":
            return _hint_if_scaled(got, expected, ws, "the gradient") or (
                " — the input's gradient is the sum over ranks of each rank's own term "
                "(plus the residual branch's own term)")
        return ""

    for ws in world_sizes:
        results = _run(_column_rank, ws, learner_function, name=name, is_function=True)
        _compare_steps(results, ws, f"a column-parallel layer behind {name}", hints)
        _check_structure(
            results.trace, ws, {"forward": None, "backward": 4 * 3 * 8},
            f"{name} with {ws} ranks",
            {"forward": "f is the identity in forward: every rank already holds the whole x, "
                        "so it sends nothing.",
             "backward": "f's backward is exactly one all_reduce of the input's gradient "
                         "(4×3 float64 = 96 B) over the group — no other collective."})
    passed(f"{name} makes a column-parallel layer equal to the dense one for {STEPS} SGD steps — "
           f"output, input gradient, a residual branch's gradient, every weight and bias "
           f"shard's gradient — on {sizes_phrase(world_sizes)} ranks, with one all-reduce in "
           f"backward and none in forward.")


# ---- exercise 2: the row-parallel layer -------------------------------------------------------

def _row_rank(rank, ws, learner_fn):
    out_features, batch = 3, 4
    in_features = 2 * ws
    w_full, b_full = _ints((out_features, in_features), 21 + ws), _ints((out_features,), 22 + ws)
    x, weighting = _ints((batch, in_features), 23 + ws), _ints((batch, out_features), 24 + ws)
    mine = slice(rank * 2, rank * 2 + 2)
    w = w_full[:, mine].clone().requires_grad_()
    b = b_full.clone().requires_grad_()
    wd, bd = w_full.clone().requires_grad_(), b_full.clone().requires_grad_()
    steps = []
    for step in range(1, STEPS + 1):
        xs = x[:, mine].clone().requires_grad_()
        with _trace.span(f"forward {step}"):
            with forbid(*_course_code(), exercise="write the row-parallel layer yourself"):
                out = learner_fn(xs, w, b, None)
            _returned_tensor(out, (batch, out_features), learner_fn.__name__)
        with _trace.span(f"backward {step}"):
            with forbid(*_course_code(), exercise="write the row-parallel layer yourself"):
                (out * weighting).sum().backward()
        xd = x.clone().requires_grad_()
        yd = F.linear(xd, wd, bd)
        (yd * weighting).sum().backward()
        steps.append(({"output": out.detach(), "input-shard gradient": xs.grad,
                       "weight-shard gradient": w.grad, "bias gradient": b.grad},
                      {"output": yd.detach(), "input-shard gradient": xd.grad[:, mine],
                       "weight-shard gradient": wd.grad[:, mine], "bias gradient": bd.grad}))
        with torch.no_grad():
            for p, pd in ((w, wd), (b, bd)):
                p -= LR * p.grad
                pd -= LR * pd.grad
                p.grad, pd.grad = None, None
    return steps, b_full


def check_row_parallel_linear(learner_fn, world_sizes=WORLD_SIZES):
    """learner_fn(x_shard, weight_shard, bias, group) -> y, the dense layer's full output."""
    name = _require_callable(learner_fn, 4, "row_parallel_linear(x_shard, weight_shard, bias, "
                                            "group)")
    for ws in world_sizes:
        results = _run(_row_rank, ws, learner_fn, name=name)
        bias = results[0][1]

        def hints(got, expected, what, ws=ws):
            if what == "output" and torch.allclose(got, expected + (ws - 1) * bias):
                return (f" — the bias was counted {ws} times: add it once, after the sum over "
                        f"ranks")
            if what != "output":
                return _hint_if_scaled(got, expected, ws, "the gradient")
            return ""

        _check_structure(
            results.trace, ws, {"forward": 4 * 3 * 8, "backward": None},
            f"{name} with {ws} ranks",
            {"forward": "the row-parallel layer sums the ranks' partial outputs with exactly one "
                        "all_reduce (4×3 float64 = 96 B) — no other collective.",
             "backward": "the backward of that all-reduce is the identity (every partial sum "
                         "receives the whole output gradient), so it sends nothing."})
        _compare_steps([r[0] for r in results], ws, name, hints)
    passed(f"{name} equals the dense layer for {STEPS} SGD steps — output, input gradient, "
           f"weight and bias gradients — on {sizes_phrase(world_sizes)} ranks, with one "
           f"all-reduce in forward and none in backward.")


# ---- together: the Megatron MLP ----------------------------------------------------------------

def _mlp_rank(rank, ws, function, row_fn):
    from ..models import make_gpt
    dense = make_gpt(d_model=12, n_heads=2, seed=0).blocks[0].mlp.double()   # 12 -> 48 -> 12
    x = torch.randn(2, 3, 12, dtype=torch.float64, generator=torch.Generator().manual_seed(ws))
    shard = lambda t, dim=0: t.detach().chunk(ws, dim=dim)[rank].clone().requires_grad_()
    w1, b1, w2 = shard(dense.fc1.weight), shard(dense.fc1.bias), shard(dense.fc2.weight, 1)
    b2 = dense.fc2.bias.detach().clone().requires_grad_()
    steps = []
    for step in range(1, STEPS + 1):
        xd = x.clone().requires_grad_()
        y = xd + dense(xd)                                    # a residual block
        (y ** 2).sum().backward()
        xt = x.clone().requires_grad_()
        with forbid(*_course_code(), exercise="build the MLP from your own two pieces"):
            with _trace.span(f"forward {step}"):
                h = F.gelu(F.linear(function.apply(xt, None), w1, b1))
                out = row_fn(h, w2, b2, None)
                _returned_tensor(out, x.shape, row_fn.__name__)
                out = xt + out
            with _trace.span(f"backward {step}"):
                (out ** 2).sum().backward()
        steps.append(({"output": out.detach(), "input gradient": xt.grad,
                       "fc1 weight-shard gradient": w1.grad, "fc1 bias-shard gradient": b1.grad,
                       "fc2 weight-shard gradient": w2.grad, "fc2 bias gradient": b2.grad}, {
            "output": y.detach(), "input gradient": xd.grad,
            "fc1 weight-shard gradient": dense.fc1.weight.grad.chunk(ws)[rank],
            "fc1 bias-shard gradient": dense.fc1.bias.grad.chunk(ws)[rank],
            "fc2 weight-shard gradient": dense.fc2.weight.grad.chunk(ws, dim=1)[rank],
            "fc2 bias gradient": dense.fc2.bias.grad}))
        with torch.no_grad():
            for p in (w1, b1, w2, b2, *dense.parameters()):
                p -= LR * p.grad
                p.grad = None
    return steps


def check_megatron_mlp(learner_function, learner_row_fn, world_sizes=WORLD_SIZES):
    """The tiny GPT's MLP as fc1 column-parallel (behind learner_function) → GELU → fc2 through
    learner_row_fn, in a residual block, against the dense MLP."""
    if not (isinstance(learner_function, type) and callable(learner_row_fn)):
        raise TypeError(f"the check needs your autograd.Function class and your row-parallel "
                        f"function, in that order, e.g. check_megatron_mlp(IdentityAllReduce, "
                        f"row_parallel_linear); got {learner_function!r}, {learner_row_fn!r}.")
    names = (_require_function_class(learner_function, "IdentityAllReduce"),
             _require_callable(learner_row_fn, 4, "row_parallel_linear(x_shard, weight_shard, "
                                                   "bias, group)"))
    S = 2 * 3 * 12 * 8
    for ws in world_sizes:
        try:
            results = _run(_mlp_rank, ws, learner_function, learner_row_fn, name=names[1])
        except NotImplementedError:
            # Whose stub was it? Ask each piece on its own.
            try:
                learner_function.backward(None, torch.zeros(1))
            except NotImplementedError:
                raise _not_written(names[0]) from None
            except Exception:
                pass
            try:
                learner_function.forward(type("ctx", (), {})(), torch.zeros(1), None)
            except NotImplementedError:
                raise _not_written(names[0]) from None
            except Exception:
                pass
            raise
        _check_structure(
            results.trace, ws, {"forward": S, "backward": S},
            f"the Megatron MLP ({names[0]} → fc1 → GELU → {names[1]}) with {ws} ranks",
            {"forward": f"Megatron's MLP makes exactly one all_reduce in forward, fc2's partial "
                        f"sums (2×3×12 float64 = {S} B).",
             "backward": f"Megatron's MLP makes exactly one all_reduce in backward, fc1's input "
                         f"gradient ({S} B)."})
        _compare_steps(results, ws, "the Megatron MLP")
    passed(f"your Megatron MLP ({names[0]} → fc1 → GELU → {names[1]}) in a residual block equals "
           f"the dense one for {STEPS} SGD steps, every gradient included, on "
           f"{sizes_phrase(world_sizes)} ranks — one all-reduce forward, one backward.")
