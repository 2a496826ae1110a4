"""Exercises 1 and 2 of workbook 05: average the gradients by hand, then all-reduce them in
buckets launched from autograd hooks while backward still runs (judged from the trace: each bucket
launched as soon as its gradients exist, and in flight while backward goes on)."""
import torch
import torch.nn.functional as F

from ...data_parallel import shard_batch
from .. import CheckFailed, passed, run_learner, sizes_phrase
from ._common import (GLOBAL_BATCH, STEPS, _compare_steps, _data, _model, _names, _reference,
                      refused)
from ._wire import Handles, Wire, delivered, missing_gradient, never_waited_sentence


def check_average_gradients(fn, world_sizes=(2, 3, 4)):
    """fn(model): after backward, replace every p.grad by its mean over the ranks."""
    def learner(rank, world_size):
        from ... import _tracer
        events = _tracer._active.events
        model, (x, y) = _model(), _data()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        grads, sent, unwaited = [], [], []
        with Wire() as wire, Handles():
            for s in range(STEPS):
                xb = shard_batch(x[s * GLOBAL_BATCH:(s + 1) * GLOBAL_BATCH], rank, world_size)
                yb = shard_batch(y[s * GLOBAL_BATCH:(s + 1) * GLOBAL_BATCH], rank, world_size)
                opt.zero_grad()
                F.mse_loss(model(xb), yb).backward()
                start, mark = len(events), wire.mark()
                with refused("average the gradients yourself"):
                    fn(model)
                unwaited.append(len(Handles.unwaited(events[start:])))
                sent.append(wire.records[mark:])
                grads.append([p.grad.clone() if p.grad is not None else None
                              for p in model.parameters()])
                opt.step()
        return grads, sent, unwaited

    expected, _ = _reference()
    for ws in world_sizes:
        got = run_learner(learner, ws, name="average_gradients", timeout=120, trace=True)
        for rank in range(ws):
            for s, count in enumerate(got[rank][2]):
                if count:
                    raise CheckFailed(never_waited_sentence(
                        f"with world_size={ws}, rank {rank}, step {s}", count))
            _compare_steps(got[rank][0], expected, "the gradient", ws, rank, _names())
        _judge_carried([g[1] for g in got], expected, ws)
    passed(f"average_gradients gives every rank the gradient of the whole batch, on "
           f"{sizes_phrase(world_sizes)} ranks, two steps in a row.")


def _buckets_of(model):
    # Reverse order (the order backward produces gradients), two tensors per bucket.
    params = list(model.parameters())[::-1]
    return [params[i:i + 2] for i in range(0, len(params), 2)]


def check_bucketed_hooks(fn, world_sizes=(2, 3)):
    """fn(model, buckets, world_size) -> finish(); finish() after backward leaves averaged grads.

    Judged from the run's trace (so any way of calling all_reduce counts): one all_reduce per
    bucket per step carrying the whole bucket, launched from inside backward before backward
    produces the first gradient of the next bucket (real overlap), not waited for in the hook.
    """
    def learner(rank, world_size):
        from ... import _tracer
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

        with refused("send the buckets from your own hooks"), \
                Wire() as wire, Handles():
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
                mark = wire.mark()
                loss.backward()
                in_backward = len(events)
                finish()
                mine = events[step_log["start"]:]
                steps.append(dict(
                    sent=wire.records[mark:], unwaited=len(Handles.unwaited(mine)),
                    first_grad=dict(step_log["first_grad"]),
                    # a handle waited for through its future was asynchronous too
                    ops=[(e["op"], e["bytes"], e["native"],
                          bool(e["async_op"] or e.get("_waited_another_way")),
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
        _judge_carried([[st["sent"] for st in g["steps"]] for g in got], expected_grads, ws)
    passed(f"attach_bucket_hooks all-reduces one bucket at a time from inside backward, each "
           f"launched before backward reaches the next bucket, and every rank's gradients equal "
           f"one process's on the whole batch ({sizes_phrase(world_sizes)} ranks).")


def _judge_step(step, sizes, ws, rank, s):
    where = f"with world_size={ws}, rank {rank}, step {s}"
    ops = step["ops"]
    if step["unwaited"]:
        raise CheckFailed(never_waited_sentence(where, step["unwaited"]))
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


def _judge_carried(sent, expected, ws):
    """sent[rank][step]: that step's calls on that rank, with what each carried (`_wire`). Every
    rank already holds the right gradients; refuse a run whose calls did not carry them (a
    decoy), whichever way they went: all-reduces, an all-gather, a ring of send/recv."""
    names = _names()
    for s in range(STEPS):
        missing = missing_gradient(delivered([sent[r][s] for r in range(ws)]), expected[s], names)
        if missing:
            raise CheckFailed(
                f"with world_size={ws}, step {s}: every rank ends with the right gradients, but "
                f"what its calls delivered does not hold the gradient of {missing} (times any "
                f"factor): the all-reduce (or your messages) must carry the ranks' own gradients "
                f"— a decoy call, with the gradient computed some other way, does not count.")
