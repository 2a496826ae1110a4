"""Checkers for workbook 07: the column-parallel f pair and the row-parallel layer, each run on
real ranks (2, 3 and 4 of them) and compared with the dense nn.Linear in float64: the output,
the input's gradient and the gradient of every weight and bias shard."""
import re

import torch
import torch.nn as nn

from .. import tp_comm
from ..launch import RankFailed
from . import run
from . import CheckFailed, _not_written, compare, passed, run_learner, sizes_phrase

WORLD_SIZES = (2, 3, 4)
TOL = dict(atol=1e-10, rtol=1e-9)


def _dense_case(ws, in_features, out_features):
    """A dense layer, an input and a random weighting of the output, the same on every rank."""
    g = torch.Generator().manual_seed(7 + ws)
    dense = nn.Linear(in_features, out_features, dtype=torch.float64)
    with torch.no_grad():
        dense.weight.copy_(torch.randn(dense.weight.shape, generator=g, dtype=torch.float64))
        dense.bias.copy_(torch.randn(dense.bias.shape, generator=g, dtype=torch.float64))
    x = torch.randn(5, in_features, generator=g, dtype=torch.float64, requires_grad=True)
    weighting = torch.randn(5, out_features, generator=g, dtype=torch.float64)
    y = dense(x)
    (y * weighting).sum().backward()  # a loss whose gradient differs in every element
    return dense, x, weighting, y.detach()


def _compare_all(got, expected, context):
    for what in expected:
        if got[what] is None:
            raise CheckFailed(f"{context}: no {what} came back; is the output still connected "
                              f"to autograd (no .detach(), no in-place copy into a new tensor)?")
        compare(got[what], expected[what], f"{context}, {what}", **TOL)


def _column_rank(rank, ws, learner_function):
    dense, x, weighting, y = _dense_case(ws, 3, 2 * ws)
    w = dense.weight.detach().chunk(ws)[rank].clone().requires_grad_()
    b = dense.bias.detach().chunk(ws)[rank].clone().requires_grad_()
    xi = x.detach().clone().requires_grad_()
    shared = learner_function.apply(xi, None)
    y_mine = torch.nn.functional.linear(shared, w, b)
    y_all = tp_comm.all_gather_fwd_split_bwd(y_mine, None, dim=-1)
    (y_all * weighting).sum().backward()
    return {"output": y_all.detach(), "input gradient": xi.grad,
            "weight-shard gradient": w.grad, "bias-shard gradient": b.grad}, {
        "output": y, "input gradient": x.grad,
        "weight-shard gradient": dense.weight.grad.chunk(ws)[rank],
        "bias-shard gradient": dense.bias.grad.chunk(ws)[rank]}


def check_identity_all_reduce(learner_function):
    """learner_function: an autograd.Function, apply(x, group): identity forward, all-reduce
    backward. Used as the input of a column-parallel layer, the whole layer must equal dense."""
    name = getattr(learner_function, "__name__", "your Function")
    if not hasattr(learner_function, "apply"):
        raise TypeError(f"the check needs your autograd.Function class itself, e.g. "
                        f"check_identity_all_reduce(IdentityAllReduce); got {learner_function!r}.")
    for ws in WORLD_SIZES:
        results = run_learner(_column_rank, ws, learner_function, name=name, timeout=60)
        for rank, (got, expected) in enumerate(results):
            _compare_all(got, expected, f"column-parallel layer using {name} with {ws} ranks, "
                                        f"rank {rank}")
    passed(f"{name} makes a column-parallel layer equal to the dense one — output, input "
           f"gradient and every weight and bias shard's gradient — on {sizes_phrase(WORLD_SIZES)} "
           f"ranks.")


def _row_rank(rank, ws, learner_fn):
    dense, x, weighting, y = _dense_case(ws, 2 * ws, 3)
    x_shard = x.detach().chunk(ws, dim=1)[rank].clone().requires_grad_()
    w = dense.weight.detach().chunk(ws, dim=1)[rank].clone().requires_grad_()
    b = dense.bias.detach().clone().requires_grad_()
    out = learner_fn(x_shard, w, b, None)
    if not isinstance(out, torch.Tensor):
        raise TypeError(f"row_parallel_linear should return a tensor; it returned "
                        f"{type(out).__name__}.")
    if out.requires_grad:
        (out * weighting).sum().backward()
    return {"output": out.detach(), "input-shard gradient": x_shard.grad,
            "weight-shard gradient": w.grad, "bias gradient": b.grad}, {
        "output": y, "input-shard gradient": x.grad.chunk(ws, dim=1)[rank],
        "weight-shard gradient": dense.weight.grad.chunk(ws, dim=1)[rank],
        "bias gradient": dense.bias.grad}


def check_row_parallel_linear(learner_fn):
    """learner_fn(x_shard, weight_shard, bias, group) -> y, the dense layer's full output."""
    name = getattr(learner_fn, "__name__", "your function")
    for ws in WORLD_SIZES:
        results = run_learner(_row_rank, ws, learner_fn, name=name, timeout=60)
        for rank, (got, expected) in enumerate(results):
            _compare_all(got, expected, f"{name} with {ws} ranks, rank {rank}")
    passed(f"{name} equals the dense layer — output, input gradient, weight and bias gradients "
           f"— on {sizes_phrase(WORLD_SIZES)} ranks.")


def _mlp_rank(rank, ws, function, row_fn):
    from ..models import make_gpt
    dense = make_gpt(d_model=12, n_heads=2, seed=0).blocks[0].mlp.double()   # 12 -> 48 -> 12
    x = torch.randn(2, 3, 12, dtype=torch.float64, generator=torch.Generator().manual_seed(ws))
    xd = x.clone().requires_grad_()
    y = dense(xd)
    (y ** 2).sum().backward()
    shard = lambda t, dim=0: t.detach().chunk(ws, dim=dim)[rank].clone().requires_grad_()
    w1, b1, w2 = shard(dense.fc1.weight), shard(dense.fc1.bias), shard(dense.fc2.weight, 1)
    b2 = dense.fc2.bias.detach().clone().requires_grad_()
    xt = x.clone().requires_grad_()
    hidden = torch.nn.functional.gelu(torch.nn.functional.linear(function.apply(xt, None), w1, b1))
    out = row_fn(hidden, w2, b2, None)
    (out ** 2).sum().backward()
    return {"output": out.detach(), "input gradient": xt.grad, "fc1 weight-shard gradient": w1.grad,
            "fc1 bias-shard gradient": b1.grad, "fc2 weight-shard gradient": w2.grad,
            "fc2 bias gradient": b2.grad}, {
        "output": y.detach(), "input gradient": xd.grad,
        "fc1 weight-shard gradient": dense.fc1.weight.grad.chunk(ws)[rank],
        "fc1 bias-shard gradient": dense.fc1.bias.grad.chunk(ws)[rank],
        "fc2 weight-shard gradient": dense.fc2.weight.grad.chunk(ws, dim=1)[rank],
        "fc2 bias gradient": dense.fc2.bias.grad}


def check_megatron_mlp(learner_function, learner_row_fn):
    """The tiny GPT's MLP as fc1 column-parallel (behind learner_function) → GELU → fc2 through
    learner_row_fn, against the dense MLP."""
    names = (getattr(learner_function, "__name__", "your Function"),
             getattr(learner_row_fn, "__name__", "your row-parallel function"))
    if not hasattr(learner_function, "apply") or not callable(learner_row_fn):
        raise TypeError(f"the check needs your autograd.Function class and your row-parallel "
                        f"function, in that order, e.g. check_megatron_mlp(IdentityAllReduce, "
                        f"row_parallel_linear); got {learner_function!r}, {learner_row_fn!r}.")
    for ws in WORLD_SIZES:
        try:
            results = run(_mlp_rank, ws, learner_function, learner_row_fn, timeout=60)
        except RankFailed as e:
            if e.exc_type != "NotImplementedError":
                raise
            # The innermost frame says whose stub it was: the Function's forward/backward or not.
            frames = re.findall(r"line \d+, in (\w+)", e.remote_traceback)
            culprit = names[0] if frames and frames[-1] in ("forward", "backward") else names[1]
            raise _not_written(culprit) from None
        for rank, (got, expected) in enumerate(results):
            _compare_all(got, expected, f"Megatron MLP with {ws} ranks, rank {rank}")
    passed(f"your Megatron MLP ({names[0]} → fc1 → GELU → {names[1]}) equals the dense MLP, "
           f"every gradient included, on {sizes_phrase(WORLD_SIZES)} ranks.")
