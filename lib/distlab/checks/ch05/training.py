"""Exercises 4 and 5 of workbook 05: scale the batch and the learning rate with the world size,
and write a whole DDP class with no_sync (gradient accumulation without communication)."""
import torch
import torch.nn.functional as F

from ... import models
from ...data_parallel import shard_batch
from .. import CheckFailed, _traffic, passed, run_learner, sizes_phrase
from ._common import (GLOBAL_BATCH, STEPS, _compare_step, _compare_steps, _data, _model, _names,
                      _reference, refused)
from ._wire import Handles, Wire, delivered, missing_gradient, never_waited_sentence


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
        from ... import _tracer
        events = _tracer._active.events
        model, (x, y) = _model(), _data()
        params = list(model.parameters())
        log = {"batches": [], "steps": []}
        cut = {"batches": 0, "sent": 0, "events": 0}
        model.register_forward_pre_hook(lambda m, args: log["batches"].append(len(args[0])))

        def before(opt, args, kwargs):
            mine = [p for g in opt.param_groups for p in g["params"] if any(p is q for q in params)]
            if mine:
                # what this rank computed and sent since the step before: every forward counts
                # (a rank that runs its own slice AND the others' slices computes the global
                # batch alone), and the values its all-reduces took in
                log["steps"].append(dict(
                    kind=type(opt).__name__, lr=[g["lr"] for g in opt.param_groups],
                    grads=[p.grad.clone() if p.grad is not None else None for p in params],
                    forward=log["batches"][cut["batches"]:], sent=wire.records[cut["sent"]:],
                    unwaited=len(Handles.unwaited(events[cut["events"]:]))))
                cut.update(batches=len(log["batches"]), sent=wire.mark(), events=len(events))

        def after(opt, args, kwargs):
            if log["steps"] and "params" not in log["steps"][-1]:
                log["steps"][-1]["params"] = [p.detach().clone() for p in params]
        handles = [register_optimizer_step_pre_hook(before), register_optimizer_step_post_hook(after)]
        wire = Wire()
        try:
            with refused("average the gradients yourself"), wire, \
                    Handles():
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
            if not any(_traffic.data_calls(step["sent"]) for step in log["steps"]):
                raise CheckFailed(
                    f"{where}, rank {rank} never reduced anything over the ranks: each rank must "
                    f"compute on its own slice only and average the gradients with all_reduce.")
            for s, step in enumerate(log["steps"]):
                if sum(step["forward"]) != per_rank:
                    raise CheckFailed(
                        f"{where}, rank {rank} ran forward on {sum(step['forward'])} samples "
                        f"({' + '.join(map(str, step['forward'])) or 'none'}) for step {s}; each "
                        f"rank computes only its own slice of per_rank_batch={per_rank} samples "
                        f"and gets the rest of the global batch's gradient from the all-reduce.")
                if step["unwaited"]:
                    raise CheckFailed(never_waited_sentence(f"{where}, rank {rank}, step {s}",
                                                            step["unwaited"]))
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
        for s in range(STEPS):
            missing = missing_gradient(delivered([g["steps"][s]["sent"] for g in got]),
                                       expected_grads[s], names)
            if missing:
                raise CheckFailed(
                    f"{where}, step {s}: the weights follow one process, but what the ranks' "
                    f"calls delivered does not hold the gradient of {missing} (times any "
                    f"factor): the ranks must all-reduce their own gradients — an all-reduce of "
                    f"the loss or of zeros, with the gradient computed some other way, does not "
                    f"count.")
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
        from ... import _tracer
        events = _tracer._active.events
        model = models.make_mlp(sizes=(16, 24, 20, 4), seed=3 + 100 * rank).double()
        (x, y), k = _data(), _micro_plan(world_size)
        log = {"steps": []}
        with refused("write the DDP class yourself"), \
                Wire() as wire, Handles():
            start = len(events)
            ddp = cls(model)
            log["construct"] = [(e["op"], e["native"]) for e in events[start:]]
            log["construct_sent"] = wire.records[:]
            log["init"] = [p.detach().clone() for p in model.parameters()]
            opt = torch.optim.SGD(model.parameters(), lr=0.1)
            for s in range(STEPS):
                xb = shard_batch(x[s * GLOBAL_BATCH:(s + 1) * GLOBAL_BATCH], rank, world_size)
                yb = shard_batch(y[s * GLOBAL_BATCH:(s + 1) * GLOBAL_BATCH], rank, world_size)
                opt.zero_grad()
                micro = []
                for i, (xm, ym) in enumerate(zip(xb.chunk(k), yb.chunk(k))):
                    inside = i < k - 1
                    begin, mark = len(events), wire.mark()
                    with ddp.no_sync() if inside else contextlib.nullcontext():
                        (F.mse_loss(ddp(xm), ym) / k).backward()
                    # what it sent by the one rule (a ring of send/recv counts as the
                    # all-reduce of the same bytes); whether C++ sent it, from the trace
                    micro.append((inside, [(c["op"], c["wire"]) for c in
                                           _traffic.data_calls(wire.records[mark:])],
                                  any(e["native"] for e in events[begin:])))
                    if not inside:
                        sent = wire.records[mark:]
                        unwaited = len(Handles.unwaited(events[begin:]))
                log["steps"].append(dict(
                    micro=micro, sent=sent, unwaited=unwaited,
                    grads=[p.grad.clone() if p.grad is not None else None
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
        missing = missing_gradient(delivered([g["construct_sent"] for g in got]), initial, names)
        if missing:
            raise CheckFailed(
                f"with world_size={ws}: after {name}(model) every rank holds rank 0's weights, "
                f"but what its calls delivered does not hold rank 0's {missing}: broadcast rank "
                f"0's parameters themselves — weights rebuilt from rank 0's seed do not count.")
        for s in range(STEPS):
            missing = missing_gradient(delivered([g["steps"][s]["sent"] for g in got]),
                                       expected_grads[s], names)
            if missing:
                raise CheckFailed(
                    f"with world_size={ws}, step {s}: the gradients are right, but what the "
                    f"synced backward's calls delivered does not hold the gradient of "
                    f"{missing} (times any factor): {name}'s hooks must all-reduce the "
                    f"accumulated gradients themselves — a decoy all-reduce does not count.")
    passed(f"{name} broadcasts rank 0's weights, sends nothing inside no_sync(), sends every "
           f"gradient once on the synced backward, and equals one process on the whole batch "
           f"({sizes_phrase(world_sizes)} ranks, {_micro_plan(world_sizes[-1])}+ micro-batches).")


def _judge_my_ddp(log, ws, rank, names, initial, name):
    where = f"with world_size={ws}, rank {rank}"
    if any(native for _, native in log["construct"]) or \
            any(native for st in log["steps"] for *_, native in st["micro"]):
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
        if step["unwaited"]:
            raise CheckFailed(never_waited_sentence(f"{where}, step {s}", step["unwaited"]))
        for i, (inside, ops, _) in enumerate(step["micro"]):
            if inside and ops:
                raise CheckFailed(
                    f"{where}, step {s}: the backward of micro-batch {i}, inside no_sync(), made "
                    f"{len(ops)} {ops[0][0]} call(s); inside no_sync() nothing is sent: the "
                    f"gradients only accumulate in p.grad until the next synced backward.")
            if not inside:
                # by the one rule: an all-reduce of every gradient once, or a ring of send/recv
                # of the same bytes (within one chunk: a ring's chunks need not be equal)
                grads = log["grad_bytes"]
                sent, want = sum(b for _, b in ops), _traffic.ring_share("all_reduce", grads, ws)
                if abs(sent - want) > grads / ws:
                    raise CheckFailed(
                        f"{where}, step {s}: the synced backward put {sent:,.0f} bytes on the "
                        f"wire; an all-reduce of the gradients ({grads:,} bytes) puts "
                        f"{want:,.0f} ({sent / want:.2g}×): every gradient is sent exactly once "
                        f"per step, on the backward outside no_sync().")
