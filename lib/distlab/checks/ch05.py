"""Checkers for workbook 05: naive gradient averaging, bucketed all-reduce from autograd hooks,
DistributedSampler epochs, a scaled batch and learning rate, a DDP class, and a DDP script whose
bugs the learner finds and fixes.

Each runs the learner's code on real ranks, each rank on its own shard of a global batch, and
compares every rank's gradients with single-process gradients on the whole batch (float64, so a
real mistake cannot hide in rounding).
"""
import os
import tempfile

import torch
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
        _compare_step(got[s], expected[s], what, ws, rank, names, s)


def _compare_step(got, expected, what, ws, rank, names, s):
    for name, g, e in zip(names, got, expected):
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
        from . import forbid
        model, (x, y) = _model(), _data()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        grads = []
        for s in range(STEPS):
            xb = shard_batch(x[s * GLOBAL_BATCH:(s + 1) * GLOBAL_BATCH], rank, world_size)
            yb = shard_batch(y[s * GLOBAL_BATCH:(s + 1) * GLOBAL_BATCH], rank, world_size)
            opt.zero_grad()
            F.mse_loss(model(xb), yb).backward()
            with forbid(*_forbidden(), exercise="average the gradients yourself"):
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


def _forbidden():
    """The course's own data parallelism, refused inside the learner's function."""
    from .. import data_parallel
    return (data_parallel.BucketedDDP, data_parallel.average_gradients, _reference)


def check_bucketed_hooks(fn, world_sizes=(2, 3)):
    """fn(model, buckets, world_size) -> finish(); finish() after backward leaves averaged grads.

    Judged from the run's trace (so any way of calling all_reduce counts): one all_reduce per
    bucket per step carrying the whole bucket, launched from inside backward before backward
    produces the first gradient of the next bucket (real overlap), not waited for in the hook.
    """
    def learner(rank, world_size):
        from .. import _tracer
        from . import forbid
        events = _tracer._active.events            # this rank's communication, as it happens
        model, (x, y) = _model(), _data()
        buckets = _buckets_of(model)
        bucket_of = {id(p): k for k, b in enumerate(buckets) for p in b}
        step_log = {}

        # Registered before the learner's hooks, so it runs first for every parameter: when the
        # first gradient of bucket k+1 is ready, buckets 0..k must already have been launched.
        def gradient_ready(p):
            k = bucket_of[id(p)]
            if k not in step_log["first_grad"]:
                launched = [e for e in events[step_log["start"]:] if e["op"] == "all_reduce"]
                step_log["first_grad"][k] = len(launched)
        for p in model.parameters():
            p.register_post_accumulate_grad_hook(gradient_ready)

        with forbid(*_forbidden(), exercise="send the buckets from your own hooks"):
            finish = fn(model, buckets, world_size)
            if not callable(finish):
                return {"error": f"returned {type(finish).__name__}, not a finish() function"}
            opt = torch.optim.SGD(model.parameters(), lr=0.1)
            grads, params, steps = [], [], []
            for s in range(STEPS):
                xb = shard_batch(x[s * GLOBAL_BATCH:(s + 1) * GLOBAL_BATCH], rank, world_size)
                yb = shard_batch(y[s * GLOBAL_BATCH:(s + 1) * GLOBAL_BATCH], rank, world_size)
                opt.zero_grad()
                loss = F.mse_loss(model(xb), yb)
                step_log.update(start=len(events), first_grad={})
                loss.backward()
                in_backward = len(events)
                finish()
                mine = events[step_log["start"]:]
                steps.append(dict(
                    first_grad=dict(step_log["first_grad"]),
                    ops=[(e["op"], e["bytes"], e["native"], bool(e["async_op"]),
                          i < in_backward - step_log["start"]) for i, e in enumerate(mine)]))
                grads.append([p.grad.clone() for p in model.parameters()])
                opt.step()
                params.append([p.detach().clone() for p in model.parameters()])
        sizes = [sum(p.numel() * p.element_size() for p in b) for b in buckets]
        return {"grads": grads, "params": params, "steps": steps, "sizes": sizes}

    expected_grads, expected_params = _reference()
    for ws in world_sizes:
        got = run_learner(learner, ws, name="attach_bucket_hooks", timeout=60, trace=True)
        for rank in range(ws):
            r = got[rank]
            if "error" in r:
                raise CheckFailed(f"attach_bucket_hooks {r['error']}: it must return the function "
                                  f"that waits for the buckets.")
            for s, step in enumerate(r["steps"]):
                _judge_step(step, r["sizes"], ws, rank, s)
            _compare_steps(r["grads"], expected_grads, "the gradient", ws, rank, _names())
            _compare_steps(r["params"], expected_params, "the parameter after the step", ws, rank,
                           _names())
    passed(f"attach_bucket_hooks all-reduces one bucket at a time from inside backward, each "
           f"launched before backward reaches the next bucket, and every rank's gradients equal "
           f"one process's on the whole batch ({sizes_phrase(world_sizes)} ranks).")


def _judge_step(step, sizes, ws, rank, s):
    where = f"with world_size={ws}, rank {rank}, step {s}"
    ops = step["ops"]
    if any(native for _, _, native, _, _ in ops):
        raise CheckFailed(
            f"{where}: the gradients were all-reduced from C++ (torch's DistributedDataParallel "
            f"or similar); the exercise is to send the buckets from your own hooks.")
    others = sorted({op for op, *_ in ops if op != "all_reduce"})
    if others:
        raise CheckFailed(f"{where} called {', '.join(others)}; averaging gradients needs only one "
                          f"all_reduce per bucket.")
    sent = [nbytes for _, nbytes, *_ in ops]
    if len(sent) != len(sizes):
        per_tensor = " (one per tensor? pack each bucket into one flat tensor)" \
            if len(sent) > len(sizes) else ""
        raise CheckFailed(
            f"{where} made {len(sent)} all_reduce calls; expected {len(sizes)}: one per bucket"
            f"{per_tensor}.")
    for k, (got_bytes, want) in enumerate(zip(sent, sizes)):
        if got_bytes != want:
            raise CheckFailed(
                f"{where}: all_reduce number {k} carried {got_bytes} bytes; bucket {k} holds "
                f"{want} bytes of gradients, sent in order, bucket 0 (the last layer) first.")
    if not any(during for *_, during in ops):
        raise CheckFailed(
            f"{where}: every all_reduce was launched after backward had finished, so nothing "
            f"overlaps: launch each bucket from the hook of its last gradient, so it travels "
            f"while backward computes the earlier layers; finish() only waits.")
    for k in range(len(sizes) - 1):
        launched = step["first_grad"].get(k + 1, 0)
        if launched < k + 1:
            raise CheckFailed(
                f"{where}: when backward produced the first gradient of bucket {k + 1}, only "
                f"{launched} bucket(s) had been launched: bucket {k} must leave as soon as its "
                f"own last gradient is ready, before backward moves on (that is the overlap).")
    for k, (_, _, _, _, during) in enumerate(ops):
        if not during and k < len(ops) - 1:
            raise CheckFailed(
                f"{where}: bucket {k}'s all_reduce was launched after backward had finished: "
                f"launch each bucket from the hook of its last gradient, so it travels while "
                f"backward computes the earlier layers; finish() only waits.")
    for k, (_, _, _, asynchronous, _) in enumerate(ops[:-1]):   # the last one: nothing to overlap
        if not asynchronous:
            raise CheckFailed(
                f"{where}: bucket {k}'s all_reduce was waited for at once, so backward stopped "
                f"until it arrived: pass async_op=True and wait for the handles in finish().")


# ---- exercise 3: DistributedSampler and set_epoch -------------------------------------------------

SAMPLES, EPOCHS = 12, 3          # 12 divides by 2 and 3: every sample exactly once per epoch


def _reference_epochs(dataset, epochs):
    """The indices this rank reads in each epoch (refused inside the learner's function)."""
    from torch.utils.data import DataLoader
    from torch.utils.data.distributed import DistributedSampler
    sampler = DistributedSampler(dataset, shuffle=True, seed=0)
    loader = DataLoader(dataset, batch_size=2, sampler=sampler)
    out = []
    for epoch in range(epochs):
        sampler.set_epoch(epoch)
        out.append([int(i) for (b,) in loader for i in b])
    return out


def _as_epochs(value, epochs):
    """The learner's answer as a list of lists of ints, or a sentence saying why it is not."""
    if not isinstance(value, (list, tuple)) or len(value) != epochs:
        return None, (f"returned {type(value).__name__}"
                      f"{f' of length {len(value)}' if isinstance(value, (list, tuple)) else ''};"
                      f" it must return one list of sample indices per epoch ({epochs} lists)")
    out = []
    for e, part in enumerate(value):
        if isinstance(part, torch.Tensor):
            part = part.reshape(-1).tolist()
        try:
            out.append([int(i) for i in part])
        except (TypeError, ValueError):
            return None, f"returned {type(part).__name__} for epoch {e}, not a list of indices"
    return out, None


def check_epoch_indices(fn, world_sizes=(2, 3)):
    """fn(dataset, epochs) -> for each epoch, the list of sample indices this rank read.

    The dataset is TensorDataset(torch.arange(12)): a sample's value is its index. Judged: every
    sample read exactly once per epoch across the ranks, each rank its equal share, a shuffled
    order that differs from epoch to epoch, and the same answer when the function runs again.
    """
    def learner(rank, world_size):
        from torch.utils.data import TensorDataset
        from . import forbid
        data = TensorDataset(torch.arange(SAMPLES))
        with forbid(_reference_epochs, exercise="build the loader and the epoch loop yourself"):
            first, again = fn(data, EPOCHS), fn(data, EPOCHS)
        first, error = _as_epochs(first, EPOCHS)
        if error:
            return {"error": error}
        return {"epochs": first, "again": _as_epochs(again, EPOCHS)[0]}

    for ws in world_sizes:
        got = run_learner(learner, ws, name="epoch_indices", timeout=60)
        for rank in range(ws):
            if "error" in got[rank]:
                raise CheckFailed(f"epoch_indices {got[rank]['error']} (rank {rank}).")
        _judge_epochs([g["epochs"] for g in got], [g["again"] for g in got], ws)
    passed(f"epoch_indices reads every sample exactly once per epoch, split across "
           f"{sizes_phrase(world_sizes)} ranks, shuffled differently every epoch and the same "
           f"when run again.")


def _judge_epochs(per_rank, again, ws):
    share = SAMPLES // ws
    where = f"with world_size={ws}"
    for e in range(EPOCHS):
        for rank in range(ws):
            read = per_rank[rank][e]
            if len(read) == SAMPLES and ws > 1:
                raise CheckFailed(
                    f"{where}, rank {rank} read all {SAMPLES} samples in epoch {e}: a plain "
                    f"DataLoader gives every rank the whole dataset; give it a DistributedSampler "
                    f"so each rank reads its {share}.")
            if len(read) != share:
                raise CheckFailed(
                    f"{where}, rank {rank} read {len(read)} samples in epoch {e}; {SAMPLES} samples "
                    f"over {ws} ranks is {share} per rank.")
        owners = {}
        for rank in range(ws):
            for i in per_rank[rank][e]:
                owners.setdefault(i, []).append(rank)
        twice = sorted(i for i, r in owners.items() if len(r) > 1)
        if twice:
            i = twice[0]
            missing = sorted(set(range(SAMPLES)) - set(owners))
            raise CheckFailed(
                f"{where}, in epoch {e} sample {i} was read by ranks {owners[i][0]} and "
                f"{owners[i][1]}{f' and sample {missing[0]} by none' if missing else ''}: the ranks "
                f"must split the SAME permutation, so use the same seed on every rank and let the "
                f"sampler take rank and world size from the process group.")
        outside = sorted(i for i in owners if not 0 <= i < SAMPLES)
        if outside:
            raise CheckFailed(f"{where}, epoch {e} holds index {outside[0]}, which is not a "
                              f"sample of the 12 (0..11): return the values read from the loader.")
    _judge_shuffling(per_rank, ws, SAMPLES, EPOCHS, f"{where}, ", "samples",
                     "pass shuffle=True to the sampler")
    for rank in range(ws):
        if again[rank] != per_rank[rank]:
            raise CheckFailed(
                f"{where}, rank {rank} read a different order when your function ran a second "
                f"time: seed the shuffle (the same seed on every rank) so a run can be repeated.")


# ---- exercise 4: global batch and learning rate -----------------------------------------------------

# (world size, per-rank batch, the recipe's batch, the recipe's lr): both give global batch 12 at lr 0.1,
# the trajectory of _reference(). The first splits the recipe's batch (lr unchanged), the second keeps
# the per-rank batch of the recipe and doubles the global batch (linear scaling doubles lr).
SCALING_CASES = ((3, 4, 12, 0.1), (2, 6, 6, 0.05))


def check_scaled_training(fn, cases=SCALING_CASES):
    """fn(model, x, y, per_rank_batch, base_batch, base_lr, steps): train on this rank with SGD.

    x, y hold `steps` global batches in order. Judged per step: each rank's forward saw
    per_rank_batch samples, the gradient used by the step is the mean over the global batch, the
    optimizer's lr is base_lr scaled linearly by global / base batch, the gradients were reduced
    over the ranks (trace), and the weights follow one process on the global batch.
    """
    def learner(rank, world_size, per_rank, base_batch, base_lr):
        from torch.optim.optimizer import (register_optimizer_step_post_hook,
                                           register_optimizer_step_pre_hook)
        from .. import _tracer
        from . import forbid
        events = _tracer._active.events
        model, (x, y) = _model(), _data()
        params = list(model.parameters())
        log = {"batches": [], "steps": [], "ops": []}
        model.register_forward_pre_hook(lambda m, args: log["batches"].append(len(args[0])))

        def before(opt, args, kwargs):
            mine = [p for g in opt.param_groups for p in g["params"] if any(p is q for q in params)]
            if mine:
                log["steps"].append(dict(
                    kind=type(opt).__name__, lr=[g["lr"] for g in opt.param_groups],
                    grads=[p.grad.clone() if p.grad is not None else None for p in params]))

        def after(opt, args, kwargs):
            if log["steps"] and "params" not in log["steps"][-1]:
                log["steps"][-1]["params"] = [p.detach().clone() for p in params]
                log["steps"][-1]["ops"] = [(e["op"], e["native"]) for e in events]
        handles = [register_optimizer_step_pre_hook(before), register_optimizer_step_post_hook(after)]
        try:
            with forbid(*_forbidden(), exercise="average the gradients yourself"):
                fn(model, x, y, per_rank, base_batch, base_lr, STEPS)
        finally:
            for h in handles:
                h.remove()
        return log

    expected_grads, expected_params = _reference()
    names = _names()
    for ws, per_rank, base_batch, base_lr in cases:
        glob = per_rank * ws
        want_lr = base_lr * glob / base_batch
        where = (f"with world_size={ws}, per-rank batch {per_rank} and the recipe (batch "
                 f"{base_batch}, lr {base_lr})")
        got = run_learner(learner, ws, per_rank, base_batch, base_lr, name="train_scaled",
                          timeout=60, trace=True)
        for rank in range(ws):
            log = got[rank]
            big = [b for b in log["batches"] if b != per_rank]
            if big:
                raise CheckFailed(
                    f"{where}, rank {rank} ran forward on {big[0]} samples; each rank's batch is "
                    f"per_rank_batch={per_rank}, its own slice of the global batch of {glob}.")
            if len(log["steps"]) != STEPS:
                raise CheckFailed(f"{where}, rank {rank} took {len(log['steps'])} optimizer "
                                  f"steps; x holds {STEPS} global batches, one step each.")
            ops = log["steps"][-1]["ops"]
            if not any(op in ("all_reduce", "reduce_scatter", "allreduce") for op, _ in ops):
                raise CheckFailed(
                    f"{where}, rank {rank} never reduced anything over the ranks: each rank must "
                    f"compute on its own slice only and average the gradients with all_reduce.")
            for s, step in enumerate(log["steps"]):
                _compare_step(step["grads"], expected_grads[s], "the gradient the optimizer used",
                              ws, rank, names, s)
                if step["kind"] != "SGD":
                    raise CheckFailed(f"{where}, rank {rank} stepped with {step['kind']}; the "
                                      f"recipe is plain torch.optim.SGD.")
                if not all(abs(lr - want_lr) < 1e-12 for lr in step["lr"]):
                    raise CheckFailed(
                        f"{where}, rank {rank} used lr {step['lr'][0]:g} at step {s}: the global "
                        f"batch is {per_rank} × {ws} = {glob}, {glob / base_batch:g}× the recipe's "
                        f"{base_batch}, so linear scaling gives lr {want_lr:g}.")
            _compare_steps([st["params"] for st in log["steps"]], expected_params,
                           "the parameter after the step", ws, rank, names)
    passed(f"train_scaled gives each rank its slice, scales lr with the global batch and follows "
           f"one process on the global batch ({len(cases)} recipes).")


# ---- exercise 5: a whole DDP class with no_sync -----------------------------------------------------

def _micro_plan(ws):
    """(micro-batches per step) for a rank's slice of the global batch of 12."""
    return {2: 3, 3: 2}.get(ws, 1)


def check_my_ddp(cls, world_sizes=(2, 3)):
    """cls(module) -> a DDP wrapper: broadcasts rank 0's parameters at construction, averages
    gradients from hooks during backward (done when backward returns), and has no_sync().

    Each rank starts from DIFFERENT weights. Every step: k−1 micro-batches inside no_sync(), one
    outside, each loss divided by k. Judged from the trace: nothing sent inside no_sync(); the
    synced backward sends every gradient exactly once; weights equal rank 0's after
    construction and follow one process on the whole batch.
    """
    def learner(rank, world_size):
        import contextlib
        from .. import _tracer
        from . import forbid
        from ..data_parallel import broadcast_parameters
        events = _tracer._active.events
        model = models.make_mlp(sizes=(16, 24, 20, 4), seed=3 + 100 * rank).double()
        (x, y), k = _data(), _micro_plan(world_size)
        log = {"steps": []}
        with forbid(*_forbidden(), broadcast_parameters,
                    exercise="write the DDP class yourself"):
            start = len(events)
            ddp = cls(model)
            log["construct"] = [(e["op"], e["native"]) for e in events[start:]]
            log["init"] = [p.detach().clone() for p in model.parameters()]
            opt = torch.optim.SGD(model.parameters(), lr=0.1)
            for s in range(STEPS):
                xb = shard_batch(x[s * GLOBAL_BATCH:(s + 1) * GLOBAL_BATCH], rank, world_size)
                yb = shard_batch(y[s * GLOBAL_BATCH:(s + 1) * GLOBAL_BATCH], rank, world_size)
                opt.zero_grad()
                micro = []
                for i, (xm, ym) in enumerate(zip(xb.chunk(k), yb.chunk(k))):
                    inside = i < k - 1
                    begin = len(events)
                    with ddp.no_sync() if inside else contextlib.nullcontext():
                        (F.mse_loss(ddp(xm), ym) / k).backward()
                    micro.append((inside, [(e["op"], e["bytes"], e["native"])
                                           for e in events[begin:]]))
                log["steps"].append(dict(
                    micro=micro, grads=[p.grad.clone() if p.grad is not None else None
                                        for p in model.parameters()]))
                opt.step()
                log["steps"][-1]["params"] = [p.detach().clone() for p in model.parameters()]
        log["grad_bytes"] = sum(p.numel() * p.element_size() for p in model.parameters())
        return log

    expected_grads, expected_params = _reference()
    names = _names()
    initial = [p.detach() for p in _model().parameters()]
    name = getattr(cls, "__name__", "MyDDP")
    for ws in world_sizes:
        got = run_learner(learner, ws, name=name, timeout=60, trace=True)
        for rank in range(ws):                        # structure on every rank, then numbers
            _judge_my_ddp(got[rank], ws, rank, names, initial, name)
        for rank in range(ws):
            _compare_steps([s["grads"] for s in got[rank]["steps"]], expected_grads,
                           "the gradient when backward returned", ws, rank, names)
            _compare_steps([s["params"] for s in got[rank]["steps"]], expected_params,
                           "the parameter after the step", ws, rank, names)
    passed(f"{name} broadcasts rank 0's weights, sends nothing inside no_sync(), sends every "
           f"gradient once on the synced backward, and equals one process on the whole batch "
           f"({sizes_phrase(world_sizes)} ranks, {_micro_plan(world_sizes[-1])}+ micro-batches).")


def _judge_my_ddp(log, ws, rank, names, initial, name):
    where = f"with world_size={ws}, rank {rank}"
    every = log["construct"] + [(op, native) for st in log["steps"] for _, ops in st["micro"]
                                for op, _, native in ops]
    if any(native for _, native in every):
        raise CheckFailed(
            f"{where}: the gradients were sent from C++ (torch's DistributedDataParallel or "
            f"similar); the exercise is to write the hooks of {name} yourself.")
    for n, got, want in zip(names, log["init"], initial):
        if not torch.equal(got, want):
            raise CheckFailed(
                f"{where}: after {name}(model) the parameter {n} still differs from rank 0's "
                f"(each rank started from its own random weights): broadcast rank 0's parameters "
                f"in __init__.")
    for s, step in enumerate(log["steps"]):
        for i, (inside, ops) in enumerate(step["micro"]):
            if inside and ops:
                raise CheckFailed(
                    f"{where}, step {s}: the backward of micro-batch {i}, inside no_sync(), made "
                    f"{len(ops)} {ops[0][0]} call(s); inside no_sync() nothing is sent: the "
                    f"gradients only accumulate in p.grad until the next synced backward.")
            if not inside:
                others = sorted({op for op, _, _ in ops if op != "all_reduce"})
                if others:
                    raise CheckFailed(f"{where}, step {s}: the synced backward called "
                                      f"{', '.join(others)}; averaging needs only all_reduce.")
                sent = sum(b for _, b, _ in ops)
                if sent != log["grad_bytes"]:
                    times = sent / log["grad_bytes"]
                    raise CheckFailed(
                        f"{where}, step {s}: the synced backward all-reduced {sent} bytes; the "
                        f"gradients hold {log['grad_bytes']} bytes ({times:.2g}×): every gradient "
                        f"is sent exactly once per step, on the backward outside no_sync().")


# ---- exercise 6: find and fix the bugs of a DDP script -------------------------------------------

# The script runs on 4 ranks standing in for 2 nodes of 2 processes: each rank's environment says
# what torchrun would set there (RANK = GROUP_RANK × 2 + LOCAL_RANK), so LOCAL_RANK repeats.
NODES, PER_NODE = 2, 2
SEQUENCES, MAX_TOKENS, SCRIPT_EPOCHS, SCRIPT_LR = 16, 4, 2, 0.1


def _token_data():
    """16 sequences of 4 positions, of which the first 1..4 are real tokens (float64)."""
    g = torch.Generator().manual_seed(11)
    x = torch.randn(SEQUENCES, MAX_TOKENS, 4, generator=g, dtype=torch.float64)
    y = torch.tanh(x @ torch.randn(4, 2, generator=g, dtype=torch.float64))
    lengths = torch.randint(1, MAX_TOKENS + 1, (SEQUENCES,), generator=g)
    return x, y, torch.arange(MAX_TOKENS) < lengths[:, None]


def _token_model():
    return models.make_mlp(sizes=(4, 8, 2), seed=4).double()


class Sequences(torch.utils.data.Dataset):
    """(x, y, mask) of one sequence per item; remembers which items this rank read, in order."""

    def __init__(self, x, y, mask):
        self.x, self.y, self.mask, self.read = x, y, mask, []

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        self.read.append(int(i))
        return self.x[i], self.y[i], self.mask[i]


def _token_reference(step_reads):
    """One process, step by step, on the global batch (every sequence any rank read for that
    step): the squared error summed over the batch's real tokens, divided by their number.
    Returns per step the gradient, the parameters after SGD, and the gradient the ranks would get
    if each took the mean over its own tokens and DDP averaged those means."""
    model, (x, y, mask) = _token_model(), _token_data()
    params = list(model.parameters())
    opt = torch.optim.SGD(params, lr=SCRIPT_LR)
    out = []
    for per_rank in step_reads:
        def loss_of(ids):
            ids = torch.tensor(sorted(ids), dtype=torch.long)
            return (model(x[ids]) - y[ids]).pow(2).sum(-1)[mask[ids]].mean()
        own_means = [torch.autograd.grad(loss_of(ids), params) for ids in per_rank]
        local = [sum(g) / len(own_means) for g in zip(*own_means)]
        opt.zero_grad()
        loss_of([i for ids in per_rank for i in ids]).backward()
        grads = [p.grad.clone() for p in params]
        opt.step()
        out.append(dict(grads=grads, local=local, params=[p.detach().clone() for p in params],
                        tokens=[int(mask[sorted(ids)].sum()) for ids in per_rank]))
    return out


def check_ddp_script(fn):
    """fn(model, dataset, epochs, ckpt_path): one rank of a DDP training script, started as
    torchrun starts it (RANK, WORLD_SIZE, LOCAL_RANK in the environment; the group is up).

    Run on 4 ranks as 2 nodes × 2 processes. Judged on what the ranks did: which sequences each
    read (every one exactly once per epoch across the ranks, a new order every epoch), the
    gradient the optimizer used and the weights after every step against one process on the
    global batch (the loss averaged over the global batch's tokens, float64), that gradients
    travelled (trace), and who printed and who wrote the checkpoint (global rank 0 only).
    """
    name = getattr(fn, "__name__", "your script")
    ws = NODES * PER_NODE

    def learner(rank, world_size, path):
        import contextlib
        import io
        from torch.optim.optimizer import (register_optimizer_step_post_hook,
                                           register_optimizer_step_pre_hook)
        from .. import _tracer
        from . import forbid
        os.environ.update(LOCAL_RANK=str(rank % PER_NODE), LOCAL_WORLD_SIZE=str(PER_NODE),
                          GROUP_RANK=str(rank // PER_NODE), GROUP_WORLD_SIZE=str(NODES))
        events = _tracer._active.events
        model, data = _token_model(), Sequences(*_token_data())
        params = list(model.parameters())
        log = {"steps": [], "saved": 0}
        seen = {"read": 0, "events": 0}

        def before(opt, args, kwargs):
            if any(p is q for g in opt.param_groups for p in g["params"] for q in params):
                log["steps"].append(dict(
                    read=data.read[seen["read"]:], kind=type(opt).__name__,
                    lr=[g["lr"] for g in opt.param_groups],
                    grads=[p.grad.detach().cpu().clone() if p.grad is not None else None
                           for p in params],
                    reduced=sum(e["bytes"] for e in events[seen["events"]:]
                                if e["op"] in ("all_reduce", "reduce_scatter"))))
                seen.update(read=len(data.read), events=len(events))

        def after(opt, args, kwargs):
            if log["steps"] and "params" not in log["steps"][-1]:
                log["steps"][-1]["params"] = [p.detach().cpu().clone() for p in params]

        real_save = torch.save

        def save(*args, **kwargs):
            log["saved"] += 1
            return real_save(*args, **kwargs)

        printed = io.StringIO()
        handles = [register_optimizer_step_pre_hook(before),
                   register_optimizer_step_post_hook(after)]
        torch.save = torch.serialization.save = save
        try:
            with forbid(_token_reference, *_forbidden(), exercise="fix the script yourself"), \
                    contextlib.redirect_stdout(printed):
                fn(model, data, SCRIPT_EPOCHS, path)
        finally:
            torch.save = torch.serialization.save = real_save
            for h in handles:
                h.remove()
        log.update(read=list(data.read), printed=printed.getvalue(),
                   final=[p.detach().cpu().clone() for p in params],
                   grad_bytes=sum(p.numel() * p.element_size() for p in params))
        return log

    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "checkpoint.pt")
        got = run_learner(learner, ws, path, name=name, timeout=30, trace=True,
                          deadlock_rule="Every rank must make the same collective calls in the "
                                        "same order: a collective under `if rank == 0:` waits "
                                        "forever for the ranks that skipped it.")
        _judge_reads([g["read"] for g in got], ws)
        _judge_script_steps(got, ws)
        _judge_reports(got, path, ws)
    passed(f"{name} reads every sequence once per epoch in a new order across 2 nodes × 2 ranks, "
           f"trains exactly like one process on the global batch, and only global rank 0 prints "
           f"and saves the checkpoint.")


def _node(rank):
    return f"local rank {rank % PER_NODE} of node {rank // PER_NODE}"


def _judge_reads(reads, ws):
    share = SEQUENCES // ws
    for rank, read in enumerate(reads):
        if len(read) == SEQUENCES * SCRIPT_EPOCHS:
            raise CheckFailed(
                f"rank {rank} read all {SEQUENCES} sequences in every epoch: each rank must read "
                f"only its {share}, through a DistributedSampler.")
        if len(read) != share * SCRIPT_EPOCHS:
            raise CheckFailed(
                f"rank {rank} read {len(read)} sequences in {SCRIPT_EPOCHS} epochs; {SEQUENCES} "
                f"sequences over {ws} ranks is {share} per rank per epoch.")
    epochs = [[read[e * share:(e + 1) * share] for e in range(SCRIPT_EPOCHS)] for read in reads]
    for e in range(SCRIPT_EPOCHS):
        owners = {}
        for rank in range(ws):
            for i in epochs[rank][e]:
                owners.setdefault(i, []).append(rank)
        missing = sorted(set(range(SEQUENCES)) - set(owners))
        never = f", and sequences {missing} were read by no rank" if missing else ""
        for a in range(ws):
            for b in range(a + 1, ws):
                if sorted(epochs[a][e]) == sorted(epochs[b][e]) and a % PER_NODE == b % PER_NODE:
                    raise CheckFailed(
                        f"in epoch {e}, ranks {a} and {b} ({_node(a)} and {_node(b)}) trained on "
                        f"the same sequences {sorted(epochs[a][e])}{never}: the sampler needs the "
                        f"global rank (RANK), not LOCAL_RANK, which repeats on every node.")
        twice = sorted(i for i, r in owners.items() if len(r) > 1)
        if twice:
            i = twice[0]
            raise CheckFailed(
                f"in epoch {e}, sequence {i} was read by ranks {owners[i][0]} and {owners[i][1]}"
                f"{never}: the ranks must split one permutation, each with its own global rank "
                f"and the same seed.")
    _judge_shuffling(epochs, ws, SEQUENCES, SCRIPT_EPOCHS, "", "sequences",
                     "the sampler shuffles by default")


def _judge_shuffling(per_rank, ws, n, epochs, where, noun, fix):
    """per_rank[r][e]: the indices rank r read in epoch e. Refuses an unshuffled first epoch and
    an epoch that repeats the one before (the missing set_epoch)."""
    unshuffled = [list(range(rank, n, ws)) for rank in range(ws)]
    if all(per_rank[r][0] == unshuffled[r] for r in range(ws)):
        raise CheckFailed(f"{where}epoch 0 reads the {noun} in order ({unshuffled[0]} on rank 0): "
                          f"nothing was shuffled; {fix}.")
    for e in range(1, epochs):
        if all(per_rank[r][e] == per_rank[r][e - 1] for r in range(ws)):
            raise CheckFailed(
                f"{where}epoch {e} repeats epoch {e - 1}'s order on every rank "
                f"({per_rank[0][e]} on rank 0): call sampler.set_epoch(epoch) at the start of each "
                f"epoch, or the sampler shuffles with the same seed every time.")


def _judge_script_steps(got, ws):
    counts = {len(g["steps"]) for g in got}
    if counts == {0}:
        raise CheckFailed("no rank took an optimizer step: the script must train.")
    if len(counts) > 1:
        raise CheckFailed(f"the ranks took different numbers of optimizer steps "
                          f"({[len(g['steps']) for g in got]}); each step is one global batch.")
    steps = [[g["steps"][s]["read"] for g in got] for s in range(counts.pop())]
    if sum(len(ids) for step in steps for ids in step) != SEQUENCES * SCRIPT_EPOCHS:
        raise CheckFailed("some sequences were read after the last optimizer step: every batch "
                          "read must be trained on.")
    expected = _token_reference(steps)
    names = [n for n, _ in _token_model().named_parameters()]
    for s, want in enumerate(expected):
        for rank in range(ws):
            step = got[rank]["steps"][s]
            if step["reduced"] < got[rank]["grad_bytes"]:
                raise CheckFailed(
                    f"rank {rank} took step {s} after all-reducing {step['reduced']} bytes; its "
                    f"gradients hold {got[rank]['grad_bytes']} bytes: wrap the model in "
                    f"DistributedDataParallel (or all-reduce every gradient) before the optimizer "
                    f"steps.")
            where = f"at step {s}, rank {rank}"
            for n, g, e, local in zip(names, step["grads"], want["grads"], want["local"]):
                if isinstance(g, torch.Tensor) and g.shape == e.shape and not _same(g, e):
                    if _same(g, local):
                        raise CheckFailed(
                            f"{where}: the gradient of {n} is the average of each rank's mean "
                            f"over its own tokens, but the ranks held {want['tokens']} of the "
                            f"{sum(want['tokens'])} tokens, so a token counts more on a rank with "
                            f"fewer: divide each rank's summed token loss by the global token "
                            f"count (all_reduce it) and multiply by the world size DDP divides "
                            f"by.")
                    if _same(g * ws, e):
                        raise CheckFailed(
                            f"{where}: the gradient of {n} is one process's divided by {ws}: DDP "
                            f"averages the ranks' gradients, so multiply the loss (summed tokens "
                            f"/ global token count) by the world size.")
                compare(g, e, f"{where}, the gradient of {n} (one process on the global batch's "
                              f"{sum(want['tokens'])} tokens)", atol=1e-12, rtol=1e-9)
            if step["kind"] != "SGD" or any(abs(lr - SCRIPT_LR) > 1e-12 for lr in step["lr"]):
                raise CheckFailed(f"{where} stepped with {step['kind']} at lr {step['lr'][0]:g}; "
                                  f"the script's optimizer is SGD at lr {SCRIPT_LR}: keep it.")
            for n, p, e in zip(names, step["params"], want["params"]):
                compare(p, e, f"{where}, the parameter {n} after the step", atol=1e-12,
                        rtol=1e-9)


def _same(a, b):
    return torch.allclose(a, b, rtol=1e-9, atol=1e-12)


def _judge_reports(got, path, ws):
    for what, said in (("printed", [bool(g["printed"].strip()) for g in got]),
                       ("wrote the checkpoint", [g["saved"] > 0 for g in got])):
        who = [r for r in range(ws) if said[r]]
        if who == [0]:
            continue
        if not who or 0 not in who:
            how = " with torch.save" if what == "wrote the checkpoint" else ""
            raise CheckFailed(f"rank 0 never {what}{how}: the script reports from global rank 0.")
        other = who[1]
        if all(r % PER_NODE == 0 for r in who):
            why = f"rank {other} is {_node(other)}, so `local_rank == 0` is true once per node"
        else:
            why = f"rank {other} ran it too"
        raise CheckFailed(
            f"ranks {sizes_phrase(who)} {what}: {why}; only global rank 0 (RANK) should.")
    if not os.path.exists(path):
        raise CheckFailed(f"rank 0 called torch.save, but not with the path it was given "
                          f"({path}).")
    state = torch.load(path, map_location="cpu")
    values = list(state.values()) if isinstance(state, dict) else None
    final = got[0]["final"]
    if values is None or len(values) != len(final) or not all(
            isinstance(v, torch.Tensor) and v.shape == f.shape and _same(v.double(), f)
            for v, f in zip(values, final)):
        raise CheckFailed("the checkpoint does not hold the trained weights: save the model's "
                          "state_dict() (ddp.module.state_dict()) after the last epoch.")
