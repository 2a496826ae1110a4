"""Checkers for workbook 05: naive gradient averaging, and bucketed all-reduce from autograd hooks.

Both run the learner's code on real ranks, each rank on its own shard of a global batch, and
compare every rank's gradients with single-process gradients on the whole batch (float64, so a
real mistake cannot hide in rounding).
"""
import torch
import torch.distributed as dist
import torch.nn.functional as F

from .. import models
from ..data_parallel import shard_batch
from . import CheckFailed, compare, passed, run_learner, sizes_phrase

STEPS = 2
GLOBAL_BATCH = 12        # divides by 1, 2, 3 and 4


def _data():
    x, y = models.regression_data(n=STEPS * GLOBAL_BATCH, seed=5)
    return x.double(), y.double()


def _model():
    return models.make_mlp(sizes=(16, 24, 20, 4), seed=3).double()


def _reference():
    """Gradients of every step, and parameters after every step, trained in one process."""
    model, (x, y) = _model(), _data()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    grads, params = [], []
    for s in range(STEPS):
        opt.zero_grad()
        F.mse_loss(model(x[s * GLOBAL_BATCH:(s + 1) * GLOBAL_BATCH]),
                   y[s * GLOBAL_BATCH:(s + 1) * GLOBAL_BATCH]).backward()
        grads.append([p.grad.clone() for p in model.parameters()])
        opt.step()
        params.append([p.detach().clone() for p in model.parameters()])
    return grads, params


def _compare_steps(got, expected, what, ws, rank, names):
    for s in range(STEPS):
        for name, g, e in zip(names, got[s], expected[s]):
            if isinstance(g, torch.Tensor) and g.shape == e.shape and ws > 1 \
                    and torch.allclose(g, e * ws, rtol=1e-9, atol=1e-12) \
                    and not torch.allclose(g, e, rtol=1e-9, atol=1e-12):
                raise CheckFailed(
                    f"with world_size={ws}, rank {rank} has the SUM of the ranks' gradients of "
                    f"{name} at step {s}: divide by the world size to get their mean.")
            compare(g, e, f"with world_size={ws}, rank {rank}, step {s}, {what} of {name}",
                    atol=1e-10, rtol=1e-9)


def _names():
    return [n for n, _ in _model().named_parameters()]


def check_average_gradients(fn, world_sizes=(2, 3, 4)):
    """fn(model): after backward, replace every p.grad by its mean over the ranks."""
    def learner(rank, world_size):
        model, (x, y) = _model(), _data()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        grads = []
        for s in range(STEPS):
            xb = shard_batch(x[s * GLOBAL_BATCH:(s + 1) * GLOBAL_BATCH], rank, world_size)
            yb = shard_batch(y[s * GLOBAL_BATCH:(s + 1) * GLOBAL_BATCH], rank, world_size)
            opt.zero_grad()
            F.mse_loss(model(xb), yb).backward()
            fn(model)
            grads.append([p.grad.clone() if p.grad is not None else None
                          for p in model.parameters()])
            opt.step()
        return grads

    expected, _ = _reference()
    for ws in world_sizes:
        got = run_learner(learner, ws, name="average_gradients", timeout=120)
        for rank in range(ws):
            _compare_steps(got[rank], expected, "the gradient", ws, rank, _names())
    passed(f"average_gradients gives every rank the gradient of the whole batch, on "
           f"{sizes_phrase(world_sizes)} ranks, two steps in a row.")


def _buckets_of(model):
    # Reverse order (the order backward produces gradients), two tensors per bucket.
    params = list(model.parameters())[::-1]
    return [params[i:i + 2] for i in range(0, len(params), 2)]


def check_bucketed_hooks(fn, world_sizes=(2, 3)):
    """fn(model, buckets, world_size) -> finish(); finish() after backward leaves averaged grads."""
    def learner(rank, world_size):
        model, (x, y) = _model(), _data()
        buckets = _buckets_of(model)
        real_all_reduce = dist.all_reduce
        calls = {"during_backward": 0, "total": 0, "async": 0}
        in_backward = [False]

        def counting_all_reduce(*args, **kwargs):
            calls["total"] += 1
            calls["during_backward"] += in_backward[0]
            calls["async"] += bool(kwargs.get("async_op"))
            return real_all_reduce(*args, **kwargs)

        dist.all_reduce = counting_all_reduce
        try:
            finish = fn(model, buckets, world_size)
            if not callable(finish):
                return {"error": f"returned {type(finish).__name__}, not a finish() function"}
            opt = torch.optim.SGD(model.parameters(), lr=0.1)
            grads, params = [], []
            for s in range(STEPS):
                xb = shard_batch(x[s * GLOBAL_BATCH:(s + 1) * GLOBAL_BATCH], rank, world_size)
                yb = shard_batch(y[s * GLOBAL_BATCH:(s + 1) * GLOBAL_BATCH], rank, world_size)
                opt.zero_grad()
                loss = F.mse_loss(model(xb), yb)
                in_backward[0] = True
                loss.backward()
                in_backward[0] = False
                finish()
                grads.append([p.grad.clone() for p in model.parameters()])
                opt.step()
                params.append([p.detach().clone() for p in model.parameters()])
        finally:
            dist.all_reduce = real_all_reduce
        return {"grads": grads, "params": params, "calls": calls, "buckets": len(buckets)}

    expected_grads, expected_params = _reference()
    for ws in world_sizes:
        got = run_learner(learner, ws, name="attach_bucket_hooks", timeout=120)
        for rank in range(ws):
            r = got[rank]
            if "error" in r:
                raise CheckFailed(f"attach_bucket_hooks {r['error']}: it must return the function "
                                  f"that waits for the buckets.")
            expected_calls = STEPS * r["buckets"]
            if r["calls"]["total"] != expected_calls:
                raise CheckFailed(
                    f"with world_size={ws}, rank {rank} called dist.all_reduce "
                    f"{r['calls']['total']} times in {STEPS} steps; expected {expected_calls}: one "
                    f"per bucket per step ({r['buckets']} buckets).")
            if r["calls"]["during_backward"] != expected_calls:
                raise CheckFailed(
                    f"with world_size={ws}, rank {rank} launched only "
                    f"{r['calls']['during_backward']} of {expected_calls} all_reduces during "
                    f"backward: launch each bucket from the hook (async_op=True) so it overlaps "
                    f"the rest of backward, and only wait in finish().")
            if r["calls"]["async"] != expected_calls:
                raise CheckFailed(
                    f"with world_size={ws}, rank {rank} made {expected_calls - r['calls']['async']}"
                    f" of its {expected_calls} all_reduces blocking: pass async_op=True so backward "
                    f"goes on while the bucket travels, and wait for the handles in finish().")
            _compare_steps(r["grads"], expected_grads, "the gradient", ws, rank, _names())
            _compare_steps(r["params"], expected_params, "the parameter after the step", ws, rank,
                           _names())
    passed(f"attach_bucket_hooks all-reduces one bucket at a time from inside backward, and every "
           f"rank's gradients equal one process's on the whole batch ({sizes_phrase(world_sizes)} "
           f"ranks).")
