"""Checkers for workbook 07: what the chapter describes but never displays.

1. `check_sequence_parallel_pair`: the two autograd Functions of sequence parallelism — all-gather
   along the sequence in forward / reduce-scatter in backward (entering a TP region) and its
   mirror (leaving one) — each run in a column- or row-parallel layer and both in a residual MLP,
   compared in float64 with the dense layer: outputs, the input's gradient, every weight shard's
   gradient. They run on real SUBGROUPS (`LAYOUTS`: 4 ranks as two groups of 2, 5 ranks as
   groups [1, 3] and [0, 2, 4]), each group on numbers of its own, so a Function that talks to
   the whole world is refused. From the run's trace, one traffic rule (`_check_traffic`): every
   collective and message on the group the Function was given, and each rank sending, in each
   phase, (N−1)/N of the sequence — what a ring all-gather or reduce-scatter sends: nothing sent
   where a sum over ranks must travel (a gradient kept locally) is refused, twice that (an
   all-reduce and a slice) too; one collective or a hand-written ring of send/recv are alike.
   What each Function saves for backward is measured: no more than this rank's own tokens.
   torch's differentiable collectives (`torch.distributed.nn.functional`, the autograd
   functional collectives) are refused: their backward is the exercise.
2. `check_vocab_parallel_cross_entropy`: each rank holds a vocabulary shard of the logits
   (uneven shards included); the per-token loss and the logit shard's gradient must equal dense
   `F.cross_entropy` in float64, with logits near 1000 (float64's exp overflows above 709: a
   missing max subtraction gives inf). On the same subgroups as 1. From the trace: what travels
   in forward is a few numbers per token on the group given, never a vocabulary's worth (an
   all-gather of the logits followed by a dense loss gives the right numbers: refused, with
   why), and the backward sends nothing.
3. `check_tp_comm_estimate` (predict, then run): the learner's formula for one transformer
   layer's TP communication (forward + backward; with or without sequence parallelism) on a
   calibrated preset, compared term by term (latency alone, bandwidth alone, each dtype) with the
   closed form the emulator charges, which names the term that is off; then with the course's
   ParallelBlock run emulated on meta tensors at real size, inside a node and across two.

Inputs are small integers wherever the numbers may reach a message, so they can be read by eye.
"""
import contextlib
import dataclasses
import io
import math
import re
import types

import torch
import torch.distributed as dist
import torch.nn.functional as F

from .. import cost as _cost
from .. import emulate as _emulate
from .. import hardware as _hardware
from .. import tensor_parallel as _tpm
from .. import tp_comm as _tp_comm
from .. import vocab_parallel as _vp
from .. import trace as _trace
from ..launch import RankFailed
from ..emulate import _MODEL
from . import (expect_arguments, learner_seconds, CheckFailed, UsedCourseCode, _not_written,
               _refusing_code, compare, forbid, passed, run, unsolved_stub)

TOL = dict(atol=1e-9, rtol=1e-9)
TIMEOUT = 30  # a learner's deadlock is reported (with where each rank waits) within this


def _course_code():
    """What the workbook asks the learner to write: the course's versions are refused."""
    objs = [_tp_comm._all_reduce, _tp_comm._all_gather, _tp_comm._reduce_scatter,
            _tp_comm._split, _tp_comm.all_gather_fwd_reduce_scatter_bwd,
            _tp_comm.reduce_scatter_fwd_all_gather_bwd, _tp_comm.all_gather_fwd_split_bwd,
            _tp_comm.split_fwd_all_gather_bwd, _tp_comm.identity_fwd_all_reduce_bwd,
            _tp_comm.all_reduce_fwd_identity_bwd, _tpm.replicated, _tpm.ColumnParallelLinear,
            _tpm.RowParallelLinear, _tpm.ParallelMLP, _tpm.ParallelBlock]
    for cls in (_tp_comm.AllGatherFwdReduceScatterBwd, _tp_comm.ReduceScatterFwdAllGatherBwd,
                _tp_comm.AllGatherFwdSplitBwd, _tp_comm.SplitFwdAllGatherBwd,
                _tp_comm.IdentityFwdAllReduceBwd, _tp_comm.AllReduceFwdIdentityBwd,
                _vp._VocabParallelCrossEntropy):
        objs += [cls.forward, cls.backward]
    # chapter 07 names the vocab-parallel module (its loss is exercise 2's answer)
    return objs + [_vp.vocab_parallel_cross_entropy, _vp.VocabParallelEmbedding.forward,
                   _vp.ParallelLMHead.forward]


def _ints(shape, seed, low=-3, high=4):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(low, high, shape, generator=g).double()


def _run(rank_fn, ws, *args, name, is_function=False, **kw):
    """Run traced; the course's own code refused with its one sentence; a stub named (the
    Function whose forward or backward is still a stub, when that is where it raised); a
    backward that returns the wrong shape told so."""
    try:
        return run(rank_fn, ws, *args, timeout=TIMEOUT, trace=True, **kw)
    except RankFailed as e:
        said = (str(e.exception or e).splitlines() or [""])[-1]
        if e.exc_type == "NotImplementedError":
            frames = re.findall(r"line \d+, in (\w+)", e.remote_traceback or "")
            if not is_function and frames and frames[-1] in ("forward", "backward"):
                raise _not_written(f"the {frames[-1]} of the autograd Function that {name} "
                                   f"uses") from None
            raise _not_written(name) from None
        if e.exc_type in (UsedCourseCode.__name__, CheckFailed.__name__):
            raise CheckFailed(said) from None
        text = str(e.exception or e)
        if e.exc_type is None or "distributed_c10d.py" in (e.remote_traceback or ""):
            # gloo's own words (sizes that differ, "Connection closed by peer") name no cause a
            # learner can act on; in these checks it is a collective the ranks of a group did
            # not all call alike — most often one that ran over the whole world
            raise CheckFailed(
                f"a collective in {name} failed on rank {e.rank} ({_first_line(text)}): the ranks "
                f"of a group must call the same collectives with tensors of the same size, on the "
                f"group they were given — pass group=group to every collective and size every "
                f"buffer with dist.get_world_size(group), never the whole world's.") from None
        if e.exc_type == "RuntimeError" and "returned an invalid gradient" in text:
            found = re.search(r"Function (\w+?)Backward returned an invalid gradient at index "
                              r"(\d+) - got \[([\d, ]*)\] but expected shape compatible with "
                              r"\[([\d, ]*)\]", text)
            if found:
                fn, _, got, want = found.groups()
                raise CheckFailed(
                    f"{fn}.backward returned a gradient of shape ({got}) for an input of shape "
                    f"({want}): backward returns the gradient of forward's input, shaped like "
                    f"that input (here: the other collective of the pair).") from None
        raise


def _first_line(text):
    line = next((ln.strip() for ln in str(text).splitlines() if ln.strip()), "no message")
    return line if len(line) <= 120 else line[:117] + "..."


# ---- what the group-taking checks share: real subgroups, and one traffic rule ----------------

# (world size, its tensor-parallel groups): two groups of 2 on 4 ranks; on 5 ranks groups of 2 and
# 3 whose ranks are not 0..k. Each group gets numbers of its own, so a function that talks to the
# whole world (group=None, dist.get_world_size()) gets the wrong shapes or another group's sums.
LAYOUTS = ((4, ((0, 1), (2, 3))), (5, ((1, 3), (0, 2, 4))))


def _my_group(rank, layout):
    """Every rank creates every group (new_group is collective) and keeps its own: (group, its
    global ranks, the group's index, this rank's place in it)."""
    groups = [dist.new_group(list(ranks)) for ranks in layout]
    index = next(i for i, ranks in enumerate(layout) if rank in ranks)
    return groups[index], tuple(layout[index]), index, layout[index].index(rank)


def _group_of(rank, layout):
    return next(tuple(ranks) for ranks in layout if rank in ranks)


def _layouts_phrase(layouts):
    return ", and ".join(f"{ws} ranks as groups " + " and ".join(str(list(g)) for g in layout)
                         for ws, layout in layouts)


def _event_group(e, world_size):
    return tuple(e["group"]) if e["group"] else tuple(range(world_size))


def _off_group(calls, ranks, world_size):
    """The first call that left the group: a collective over other ranks, a message to a rank
    outside it."""
    for e in calls:
        if e["op"] in ("send", "recv"):
            if e["peer"] is not None and e["peer"] not in ranks:
                return e, f"a {e['op']} with rank {e['peer']}"
        elif sorted(_event_group(e, world_size)) != sorted(ranks):
            return e, f"a {e['op']} over ranks {list(_event_group(e, world_size))}"
    return None, ""


def _sent_bytes(calls, world_size):
    """The bytes this rank put on the wire in `calls`, one rule for every kind of call: a
    collective what its ring sends per rank (all-reduce 2(N−1)/N of the tensor, all-gather and
    reduce-scatter (N−1)/N of the whole one), a message its size (a recv is the peer's send)."""
    total = 0.0
    for e in calls:
        if e["op"] in ("recv", "barrier"):
            continue
        if e["op"] == "send":
            total += e["bytes"]
            continue
        n = len(_event_group(e, world_size))
        total += _cost.TERMS[_MODEL.get(e["op"], "send")](e["bytes"], n)[1] if n > 1 else 0
    return total


# torch's differentiable collectives: their backward is what the exercises ask for
_TORCH_DIFFERENTIABLE = (
    ("torch.distributed.nn.functional", ("all_gather", "reduce_scatter", "all_reduce",
                                         "all_to_all", "all_to_all_single", "_all_gather_base",
                                         "broadcast", "reduce", "gather", "scatter")),
    ("torch.distributed._functional_collectives", (
        "all_gather_tensor_autograd", "reduce_scatter_tensor_autograd",
        "all_gather_single_autograd", "reduce_scatter_single_autograd",
        "all_to_all_single_autograd")))


@contextlib.contextmanager
def _refuse_differentiable_collectives(exercise):
    """Inside a rank: torch's autograd-aware collectives raise the check's sentence, however
    they were imported (their code is swapped, as `forbid` does for the course's own)."""
    import importlib
    saved = []
    for module_name, names in _TORCH_DIFFERENTIABLE:
        try:
            module = importlib.import_module(module_name)
        except ImportError:
            continue
        for n in names:
            fn = getattr(module, n, None)
            code = getattr(fn, "__code__", None)
            if code is None:
                continue
            message = (f"your code called torch's differentiable {module_name}.{n}, whose "
                       f"backward torch wrote; the exercise is to {exercise}, with the plain "
                       f"collectives of torch.distributed.")
            saved.append((fn, code))
            fn.__code__ = _refusing_code(message, code.co_freevars)
    try:
        yield
    finally:
        for fn, code in reversed(saved):
            fn.__code__ = code


@contextlib.contextmanager
def _saved_for_backward(counter):
    """Count the bytes autograd saves for backward inside the block (each storage once)."""
    seen = set()

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in seen:
            seen.add(storage.data_ptr())
            counter[0] += storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        yield


def _require_function_class(fn, example):
    name = getattr(fn, "__name__", repr(fn))
    if not (isinstance(fn, type) and issubclass(fn, torch.autograd.Function)):
        raise TypeError(f"the check needs your torch.autograd.Function class itself, e.g. "
                        f"{example}; got {fn!r}.")
    import inspect
    for method, wanted in (("forward", ("ctx", "x", "group")), ("backward", ("ctx", "grad"))):
        try:
            params = inspect.signature(getattr(fn, method)).parameters
        except (TypeError, ValueError):
            continue
        if len(params) != len(wanted) and not any(p.kind == p.VAR_POSITIONAL
                                                  for p in params.values()):
            raise TypeError(f"{name}.{method} should take ({', '.join(wanted)}) — a "
                            f"@staticmethod; it takes ({', '.join(params)}).")
    return name


def _returned_tensor(out, like, what, hint=""):
    """Inside a rank, before anything else happens: the learner's result has the right shape."""
    if not isinstance(out, torch.Tensor):
        raise CheckFailed(f"{what} should return a tensor; it returned {type(out).__name__}.")
    if tuple(out.shape) != tuple(like):
        raise CheckFailed(f"{what} returned shape {tuple(out.shape)}; expected {tuple(like)}"
                          f"{hint}.")
    if not out.requires_grad:
        raise CheckFailed(f"{what} returned a tensor autograd cannot differentiate (no grad_fn): "
                          f"no .detach(), no .data, no copy into a new tensor — return the "
                          f"result of your Function's apply or of torch operations.")
    return out


def _describe_calls(calls):
    if not calls:
        return "no communication"
    return ", ".join(f"{e['op']} of {e['bytes']:,} B" for e in calls)


def _phase_calls(trace, rank, phase):
    return [e for e in trace.comm(rank) if e["label"] and e["label"][0] == phase]


def _scaled(got, expected, ws):
    return (got is not None and expected.abs().max() > 0
            and torch.allclose(got, ws * expected, **TOL))


def _compare(got, expected, where, hint=lambda got, exp: ""):
    for what in expected:
        if got[what] is None:
            raise CheckFailed(f"{where}, {what}: none came back; is the output still connected "
                              f"to autograd (no .detach(), no copy into a new tensor)?")
        try:
            compare(got[what], expected[what], f"{where}, {what}", **TOL)
        except CheckFailed as e:
            raise CheckFailed(str(e)[:-1] + hint(what, got[what]) + ".") from None


# ---- exercise 1: the sequence-parallel pair -----------------------------------------------------

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


# ---- exercise 2: vocab-parallel cross-entropy ---------------------------------------------------

# (tokens, vocabulary, logit offset) per group size: vocabularies that split unevenly (13 on 2,
# 20 on 3 as 7/7/6) and logits near 1000, where float64's exp overflows (above 709).
VOCAB_CASES = {2: ((4, 13, 0.0), (6, 16, 1000.0)), 3: ((5, 20, 1000.0), (3, 16, 0.0))}
VOCAB_LAYOUTS = LAYOUTS
PER_TOKEN = 3    # numbers per token a rank may send in forward: max, sum of exps, target logit


def _vocab_shards(vocab, ws):
    """[(start, size)] per rank: the first vocab % ws ranks hold one entry more."""
    sizes = [vocab // ws + (r < vocab % ws) for r in range(ws)]
    return [(sum(sizes[:r]), sizes[r]) for r in range(ws)]


def _reference_logits(tokens, vocab, offset, ws, seed):
    """Logits (small integers + offset), targets that hit the first and last entry and both sides
    of every shard boundary, and a weighting of the per-token losses."""
    g = torch.Generator().manual_seed(seed)
    z = offset + torch.randint(-12, 13, (tokens, vocab), generator=g).double()
    edges = [0, vocab - 1] + [s + d for s, _ in _vocab_shards(vocab, ws)[1:] for d in (-1, 0)]
    target = torch.tensor([edges[i % len(edges)] for i in range(tokens)])
    weighting = torch.randint(1, 4, (tokens,), generator=g).double()
    return z, target, weighting


def _vocab_rank(rank, ws, fn, name, layout):
    """The cases of this rank's group size, on its group; each group has logits of its own."""
    group, ranks, gi, r = _my_group(rank, layout)
    n = len(ranks)
    out = []
    for c, (tokens, vocab, offset) in enumerate(VOCAB_CASES[n]):
        z, target, weighting = _reference_logits(tokens, vocab, offset, n,
                                                 50 + 10 * n + c + 100 * gi)
        start, size = _vocab_shards(vocab, n)[r]
        shard = z[:, start:start + size].clone().requires_grad_()
        with _trace.span(f"forward {c}"):
            with forbid(*_course_code(), exercise="write the loss yourself"):
                loss = fn(shard, target.clone(), start, group)
            _returned_tensor(loss, (tokens,), f"{name}(logits_shard, target, vocab_start, group)",
                             " — one loss per token, the same on every rank (no mean, no sum)")
        with _trace.span(f"backward {c}"):
            with forbid(*_course_code(), exercise="write the loss yourself"):
                (loss * weighting).sum().backward()
        zd = z.clone().requires_grad_()
        dense = F.cross_entropy(zd, target, reduction="none")
        (dense * weighting).sum().backward()
        onehot = F.one_hot(target, vocab).double()[:, start:start + size] * weighting[:, None]
        out.append(({"per-token loss": loss.detach(), "logit-shard gradient": shard.grad},
                    {"per-token loss": dense.detach(),
                     "logit-shard gradient": zd.grad[:, start:start + size]}, onehot))
    return out


def _vocab_where(ranks, c):
    n = len(ranks)
    tokens, vocab, offset = VOCAB_CASES[n][c]
    split = "/".join(str(s) for _, s in _vocab_shards(vocab, n))
    return (f"{tokens} tokens, a vocabulary of {vocab} split {split} over the group "
            f"{list(ranks)}, logits "
            f"{'near ' + format(offset, 'g') if offset else 'between -12 and 12'}")


def _check_vocab_structure(trace, ws, layout, name):
    for rank in range(ws):
        ranks = _group_of(rank, layout)
        n = len(ranks)
        for c, (tokens, vocab, _) in enumerate(VOCAB_CASES[n]):
            limit = PER_TOKEN * tokens * 8
            calls = _phase_calls(trace, rank, f"forward {c}")
            bad, what = _off_group(calls + _phase_calls(trace, rank, f"backward {c}"), ranks, ws)
            if bad is not None:
                raise CheckFailed(
                    f"{name} ({_vocab_where(ranks, c)}): rank {rank} made {what} (from the run's "
                    f"trace), outside its tensor-parallel group {list(ranks)}: pass the `group` "
                    f"it was given to every collective (without it a collective runs over the "
                    f"whole world).")
            # what this rank contributes: an all-gather's trace bytes are the gathered result
            sent = [(e, e["bytes"] // n if e["op"] in ("all_gather", "gather") else e["bytes"])
                    for e in calls if e["op"] not in ("recv", "barrier")]
            worst = max(sent, key=lambda s: s[1], default=None)
            total = sum(s for _, s in sent)
            if worst is not None and (worst[1] > limit or total > limit + tokens * 8):
                per_token = total / (tokens * 8)
                whole = (" — a vocabulary shard's worth, the logits themselves"
                         if per_token >= 0.9 * vocab / n else "")
                raise CheckFailed(
                    f"{name} ({_vocab_where(ranks, c)}): in forward, rank {rank} made "
                    f"{_describe_calls(calls)} (from the run's trace), {per_token:.3g} numbers of 8 "
                    f"bytes per token{whole}. Vocab parallelism exists so that no rank ever "
                    f"holds the (tokens × vocabulary) logits — at a 128k vocabulary and 8k tokens "
                    f"that is 4 GiB in float32 — so what travels must be a few numbers per token "
                    f"whatever the vocabulary (the max, the sum of exps, the target's logit: at "
                    f"most {PER_TOKEN} × {tokens} tokens × 8 B = {limit} B here).")
            back = _phase_calls(trace, rank, f"backward {c}")
            if back:
                raise CheckFailed(
                    f"{name} ({_vocab_where(ranks, c)}): in backward, rank {rank} made "
                    f"{_describe_calls(back)} (from the run's trace); the gradient of a logit is "
                    f"local — (softmax − one-hot of the target) × the incoming gradient, from "
                    f"the max and the sum of exps the forward already has — so the backward "
                    f"sends nothing.")


def check_vocab_parallel_cross_entropy(fn, layouts=VOCAB_LAYOUTS):
    """fn(logits_shard, target, vocab_start, group) -> the per-token cross-entropy (tokens,),
    the same on every rank; logits_shard (tokens, my vocabulary entries) holds the entries
    vocab_start ... vocab_start + logits_shard.shape[1] - 1."""
    name = expect_arguments(fn, 4, "vocab_parallel_cross_entropy(logits_shard, target, "
                                   "vocab_start, group)")
    # an autograd Function the function names, still a stub: named at once, without launching
    code = getattr(fn, "__code__", None)
    used = [getattr(fn, "__globals__", {}).get(n) for n in (code.co_names if code else ())]
    stub = unsolved_stub(*(getattr(c, m) for c in used if isinstance(c, type) and issubclass(
        c, torch.autograd.Function) for m in ("forward", "backward")))
    if stub is not None:
        raise _not_written(f"{stub.__qualname__}, which {name} uses,")
    for ws, layout in layouts:
        results = _run(_vocab_rank, ws, fn, name, layout, name=name)
        for rank, cases in enumerate(results):
            ranks = _group_of(rank, layout)
            n = len(ranks)
            for c, (got, want, onehot) in enumerate(cases):
                offset = VOCAB_CASES[n][c][2]

                def hint(what, value, want=want, onehot=onehot, offset=offset):
                    if not torch.isfinite(value).all():
                        return (f" — not a number: exp of a logit near {offset:g} overflows "
                                f"(float64's exp does above 709); subtract the max over the "
                                f"WHOLE vocabulary (an all-reduce with op=MAX) before exp"
                                if offset else " — not a number")
                    if what == "per-token loss":
                        return (" — the loss is log Σ_v exp(z_v − M) + M − z_target, the sum "
                                "over every rank's shard, M the max over them all, z_target "
                                "from the rank whose shard holds the target")
                    if _scaled(value, want[what], n):
                        return (f" (the gradient is {n}× the right one: every rank computed "
                                f"the same loss, so nothing is summed over ranks in backward)")
                    if torch.allclose(value, want[what] + onehot, **TOL):
                        return (" — the −1 at the target is missing: it belongs to the rank "
                                "whose shard holds the target (softmax − one-hot)")
                    return (" — the gradient of a logit is (softmax_v − [v = target]) × the "
                            "incoming gradient of its token's loss")
                _compare(got, want, f"{name} ({_vocab_where(ranks, c)}), rank {rank}", hint)
        _check_vocab_structure(results.trace, ws, layout, name)
    passed(f"{name} equals dense F.cross_entropy in float64 — every per-token loss and every "
           f"logit shard's gradient — on {_layouts_phrase(layouts)}, each group on logits of its "
           f"own, vocabularies split unevenly, logits near 1000; in forward it sent at most "
           f"{PER_TOKEN} numbers per token (never the logits), on its own group, in backward "
           f"nothing.")


# ---- exercise 3: predict, then run — one layer's TP communication -------------------------------

OPS = ("all_reduce", "all_gather", "reduce_scatter")


@dataclasses.dataclass(frozen=True)
class TPLink:
    """What nccl-tests would tell you about the link `tp` GPUs share: `latency[op]`, the seconds
    of a collective of a few bytes on them; `busbw[op]`, the bus bandwidth (bytes/s) of a large
    one — the bytes each rank sends on a ring divided by the time."""
    name: str
    tp: int
    latency: types.MappingProxyType
    busbw: types.MappingProxyType

    def __repr__(self):
        lat = ", ".join(f"{op} {self.latency[op] * 1e6:.3g} µs" for op in OPS)
        bw = ", ".join(f"{op} {self.busbw[op] / 1e9:.3g} GB/s" for op in OPS)
        return f"TPLink({self.name}, tp={self.tp}: latency {lat}; busbw {bw})"


def _cluster(preset):
    return preset if isinstance(preset, _hardware.Cluster) else _emulate.resolve(preset)


def tp_link(preset, tp):
    """The TPLink of the first `tp` GPUs of a preset (a name of distlab.emulate.PRESETS or a
    Cluster): the numbers the emulator charges their collectives with."""
    link = _cluster(preset).link_between(range(tp))
    return TPLink(f"{getattr(preset, 'name', preset)}: {link.name}", tp,
                  types.MappingProxyType({op: link.seconds(op, 0, tp) for op in OPS}),
                  types.MappingProxyType({op: link.busbw(op) for op in OPS}))


def _layer_ops(sp):
    """One layer's collectives, forward + backward: {op: count}."""
    return {"all_gather": 4, "reduce_scatter": 4} if sp else {"all_reduce": 4}


def _reference_layer_seconds(hidden, tokens, tp, dtype, sp, preset):
    """The closed form the emulator charges: each collective on the calibrated link's model."""
    link = _cluster(preset).link_between(range(tp))
    nbytes = tokens * hidden * torch.empty((), dtype=dtype).element_size()
    return sum(n * link.seconds(op, nbytes, tp) for op, n in _layer_ops(sp).items())


def _isolated(facts, latency=True, bandwidth=True):
    return dataclasses.replace(
        facts, latency=types.MappingProxyType(
            {op: facts.latency[op] if latency else 0.0 for op in OPS}),
        busbw=types.MappingProxyType({op: facts.busbw[op] if bandwidth else math.inf
                                      for op in OPS}))


ESTIMATE_CASES = [  # (hidden, tokens, tp, dtype, preset): in a node, across nodes, latency-bound
    (4096, 4096, 8, torch.bfloat16, "h100-node"), (8192, 8192, 16, torch.bfloat16, "h100-2x8"),
    (5120, 2048, 4, torch.float32, "a100-node"), (4096, 4096, 16, torch.bfloat16, "a100-2x8"),
    (1024, 128, 8, torch.bfloat16, "h100-node")]
# The run: the course's ParallelBlock at real size on meta tensors, 4 ranks in one H100 node and
# 4 ranks across two (two GPUs and two NICs per node: h100-2x8's parts, a node shape chosen so a
# 4-rank group spans nodes at the cost of 4 processes, not 16).
RUN_SHAPE = dict(hidden=4096, heads=32, tokens=4096)
RUN_TP = 4


def _run_clusters():
    two = dataclasses.replace(_hardware.PRESETS["h100-2x8"], ranks_per_node=2, nics_per_node=2,
                              name="two H100 nodes (2 GPUs, 2 NDR NICs each)")
    return [("h100-node", _hardware.PRESETS["h100-node"]), ("h100 2 nodes × 2", two)]


def _reference_layer_run(rank, ws, hidden, heads, tokens):
    """Forward + backward of one ParallelBlock (TP, then TP + SP) on meta tensors, bf16."""
    for sp in (False, True):
        with torch.device("meta"):
            block = _tpm.ParallelBlock(hidden, heads, 4 * hidden, None, sp, dtype=torch.bfloat16)
            x = torch.randn(1, tokens // ws if sp else tokens, hidden, dtype=torch.bfloat16,
                            requires_grad=True)
        with _trace.span(f"layer sp={sp}"):
            y = block(x)
            y.backward(torch.ones_like(y))
    return None


_RUNS = {}


def _emulated_layers():
    """{(cluster label, sp): (seconds of the activation collectives on rank 0's critical path,
    [their ops])} — run once per process: the run does not depend on the learner."""
    if not _RUNS:
        s = RUN_SHAPE
        nbytes = s["tokens"] * s["hidden"] * 2
        for label, cluster in _run_clusters():
            with contextlib.redirect_stdout(io.StringIO()):
                res = run(_reference_layer_run, RUN_TP, s["hidden"], s["heads"], s["tokens"],
                          emulate=cluster, timeout=300)
            for sp in (False, True):
                # the activations' collectives: the replicated LayerNorm and bias gradients (SP)
                # are all-reduced too, a few KiB each, not what the layer's formula counts
                calls = [e for e in res.trace.comm(0) if e["label"] == [f"layer sp={sp}"]
                         and e["bytes"] == nbytes]
                _RUNS[label, sp] = (sum(e["end"] - e["launch"] for e in calls),
                                    sorted(e["op"] for e in calls), cluster)
    return _RUNS


def _estimate(fn, name, *args):
    return learner_seconds(fn, name, *args,
                           refused=(_cost.predict, _cost.terms, _cost.ring_all_reduce_time,
                                    _emulate.comm_seconds, _hardware.Link.seconds,
                                    _hardware.GroupLink.seconds, _tpm.tp_block_seconds,
                                    _hardware.step_seconds))


def _dtype_name(dtype):
    return str(dtype).replace("torch.", "")


def _close(a, b, rel=1e-6):
    return math.isclose(a, b, rel_tol=rel, abs_tol=1e-15)


def _near(q, target):
    return math.isclose(q, target, rel_tol=1e-3)


def _why_bandwidth(q, tp, sp, esize, facts, name, dtype, case):
    """A sentence naming what makes the bandwidth term q× the layer's, or a generic one."""
    ring = (tp - 1) / tp * (1 if sp else 2)
    coll = ("an all-gather or reduce-scatter moves (N-1)/N·S per rank" if sp else
            "an all-reduce moves 2(N-1)/N·S per rank (a reduce-scatter, then an all-gather)")
    if _near(q, 1 / ring):
        return (f"misses the ring's factor: {coll} = {ring:.4g}·S at N = {tp}, not S")
    if sp and _near(q, 2):
        return ("counts an all-reduce's 2(N-1)/N for each all-gather and reduce-scatter: "
                "each moves (N-1)/N·S per rank, half an all-reduce")
    if not sp and _near(q, 0.5):
        return ("counts (N-1)/N for each all-reduce: it is a reduce-scatter plus an all-gather, "
                "2(N-1)/N·S per rank")
    for wrong in (1, 2, 4, 8, 16, 32):
        if wrong != esize and _near(q, wrong / esize):
            return (f"has the bytes per element wrong: {_dtype_name(dtype)} is {esize} byte"
                    f"{'s' if esize > 1 else ''} per element, and your term is {q:.4g}× the "
                    f"layer's (S = tokens × hidden × {esize} B)")
    for op, other in ((o, p) for o in OPS for p in OPS if o != p):
        if facts.busbw[op] != facts.busbw[other] and _near(q, facts.busbw[op] / facts.busbw[other]):
            return (f"divides by another collective's bus bandwidth: each collective at its own "
                    f"link.busbw[op] (inside an H100 node all_reduce runs NVLink SHARP, "
                    f"{facts.busbw['all_reduce'] / 1e9:.0f} GB/s, the gathers and scatters "
                    f"{facts.busbw['all_gather'] / 1e9:.0f})")
    n_true = 8 if sp else 4
    for k in range(1, 17):
        if k != n_true and _near(q, k / n_true):
            return (f"counts {k} collectives' bytes where a layer makes {n_true}: "
                    f"{'4 all-gathers + 4 reduce-scatters' if sp else '4 all-reduces'} (forward: "
                    f"after attention and after the MLP; backward: into each of their inputs)")
    return f"is {q:.4g}× the layer's"


def check_tp_comm_estimate(fn, cases=ESTIMATE_CASES):
    """fn(hidden, tokens, tp, dtype, sequence_parallel, link) -> seconds of one transformer
    layer's tensor-parallel communication, forward + backward, on the TPLink `link`."""
    name = expect_arguments(fn, 6, "layer_comm_seconds(hidden, tokens, tp, dtype, "
                                   "sequence_parallel, link)")
    for hidden, tokens, tp, dtype, preset in cases:
        facts = tp_link(preset, tp)
        esize = torch.empty((), dtype=dtype).element_size()
        S = tokens * hidden * esize
        for sp in (False, True):
            ops = _layer_ops(sp)
            where = (f"{name}(hidden={hidden}, tokens={tokens}, tp={tp}, {_dtype_name(dtype)}, "
                     f"sequence_parallel={sp}) on {preset}")
            want_lat = sum(n * facts.latency[op] for op, n in ops.items())
            got_lat = _estimate(fn, name, hidden, tokens, tp, dtype, sp,
                                _isolated(facts, bandwidth=False))
            if not _close(got_lat, want_lat):
                one = facts.latency[next(iter(ops))]
                count = ("4 all-gathers + 4 reduce-scatters" if sp else "4 all-reduces")
                if got_lat == 0:
                    why = (f"misses the latency: each collective costs its link.latency[op] "
                           f"however small ({one * 1e6:.3g} µs here), and a layer makes {count}")
                elif _near(got_lat / one, round(got_lat / one)) and round(got_lat / one) != sum(
                        ops.values()):
                    why = (f"counts {round(got_lat / one)} collectives' latencies where a layer "
                           f"makes {sum(ops.values())}: {count} (forward: after attention and "
                           f"after the MLP; backward: into each of their inputs)")
                else:
                    why = (f"has the latency term wrong: yours is {got_lat * 1e6:.4g} µs, the "
                           f"layer's {want_lat * 1e6:.4g} µs = {count} × link.latency[op]")
                raise CheckFailed(f"{where}: your estimate {why}. (Checked with every bus "
                                  f"bandwidth infinite.)")
            want_bw = sum(n * _cost.TERMS["ring_" + op](S, tp)[1] / facts.busbw[op]
                          for op, n in ops.items())
            got_bw = _estimate(fn, name, hidden, tokens, tp, dtype, sp,
                               _isolated(facts, latency=False))
            if not _close(got_bw, want_bw):
                if got_bw == 0:
                    why = "misses the bandwidth term: bytes take time on the link"
                else:
                    other = torch.float32 if esize != 4 else torch.bfloat16
                    got_other = _estimate(fn, name, hidden, tokens, tp, other, sp,
                                          _isolated(facts, latency=False))
                    if _close(got_other, got_bw):
                        why = (f"does not change with the dtype: S = tokens × hidden × bytes per "
                               f"element ({_dtype_name(dtype)} {esize} B, {_dtype_name(other)} "
                               f"{torch.empty((), dtype=other).element_size()} B)")
                    else:
                        why = _why_bandwidth(got_bw / want_bw, tp, sp, esize, facts, name,
                                             dtype, where)
                raise CheckFailed(f"{where}: your estimate's bandwidth term {why}. It counts "
                                  f"{got_bw * 1e6:.4g} µs, the layer pays {want_bw * 1e6:.4g} µs. "
                                  f"(Checked with every latency 0.)")
            got = _estimate(fn, name, hidden, tokens, tp, dtype, sp, facts)
            want = _reference_layer_seconds(hidden, tokens, tp, dtype, sp, preset)
            if not _close(want, want_lat + want_bw):
                raise RuntimeError("the check's closed form no longer matches the emulator's "
                                   "link model — a bug in the course, not in your formula.")
            if not _close(got, want):
                raise CheckFailed(f"{where}: your estimate is {got * 1e6:.4g} µs, the closed "
                                  f"form {want * 1e6:.4g} µs, although each term alone is right: "
                                  f"the terms add (latency terms + bandwidth terms).")
    lines = []
    s = RUN_SHAPE
    for (label, sp), (emulated, ops, cluster) in _emulated_layers().items():
        closed = _reference_layer_seconds(s["hidden"], s["tokens"], RUN_TP, torch.bfloat16, sp,
                                          cluster)
        expect = sorted(op for op, n in _layer_ops(sp).items() for _ in range(n))
        if ops != expect or not math.isclose(closed, emulated, rel_tol=0.01):
            raise RuntimeError(f"the emulated ParallelBlock on {label} made {ops} in "
                               f"{emulated * 1e6:.4g} µs against the closed form's "
                               f"{closed * 1e6:.4g} µs — a bug in the course, not in your "
                               f"formula.")
        guess = _estimate(fn, name, s["hidden"], s["tokens"], RUN_TP, torch.bfloat16, sp,
                          tp_link(cluster, RUN_TP))
        if not math.isclose(guess, emulated, rel_tol=0.01):
            raise CheckFailed(f"{name} for the emulated ParallelBlock on {label} (tp={RUN_TP}, "
                              f"sequence_parallel={sp}): your estimate is {guess * 1e6:.4g} µs, "
                              f"the run's collectives took {emulated * 1e6:.4g} µs.")
        lines.append(f"   {label:>16}, {'TP + SP' if sp else 'TP':>7}: yours {guess * 1e6:7.1f} "
                     f"µs, closed form {closed * 1e6:7.1f}, emulated {emulated * 1e6:7.1f} "
                     f"({len(ops)} collectives)")
    passed(f"{name} matches the closed form term by term (latency alone, bandwidth alone, each "
           f"dtype) on {len(cases)} shapes × TP and TP + SP, from 1 to 2 nodes, and the "
           f"course's ParallelBlock (hidden {s['hidden']}, {s['tokens']} tokens, bf16, meta "
           f"tensors) emulated at tp={RUN_TP} within 1 % (times modeled, not measured: the "
           f"emulator charges the same link formulas, so the agreement checks which collectives "
           f"the layer makes and of what size, not the hardware):\n" + "\n".join(lines))

