"""Exercise 2 of workbook 05: buckets rebuilt, after the first step, in the order the gradients
arrived (what torch's DDP does after its first iteration), on models whose forward uses their
layers in another order than they were registered.

Judged from the run's trace and from what each all-reduce carried (`_wire`): from the second step
on, which gradients each all-reduce carried (by their values), so the learner's buckets are read,
not assumed; each bucket within the cap (a gradient larger than the cap alone); no two
neighbouring buckets that would fit in one; the buckets following the arrival order, each launched
before backward produces the first gradient of the next one; every handle waited for; every
rank's gradients and weights equal to one process's, three steps in a row.
"""
import torch
import torch.nn as nn
import torch.nn.functional as F

from ... import models
from ...data_parallel import shard_batch
from .. import CheckFailed, passed, run_learner, sizes_phrase
from .. import _traffic
from ._common import GLOBAL_BATCH, _compare_step, refused, refuse_too
from ._wire import Handles, Wire, delivered, never_waited_sentence

STEPS = 3               # the first records the order; the next two send the rebuilt buckets

# Two models whose forward uses the layers in another order than they were registered: (name,
# widths in the order of use, the registration order, the order of use, a gain on the root).
MODELS = {
    "model 1": ((16, 24, 20, 12, 4), "abcd", "cadb", False),
    "model 2": ((16, 12, 28, 20, 4), "pqrs", "rpsq", True),
}
CASES = (("model 1", 4096), ("model 2", 2048), ("model 1", 2048), ("model 2", 4096))


class Permuted(nn.Module):
    """Layers registered in one order (`names`), applied in another (`use`); with `gain`, a
    parameter on the root module that scales the output (its gradient arrives first)."""

    def __init__(self, widths, names, use, gain, seed=3):
        super().__init__()
        torch.manual_seed(seed)
        layers = {name: nn.Linear(widths[i], widths[i + 1]) for i, name in enumerate(use)}
        self.blocks = nn.ModuleDict({name: layers[name] for name in names})
        self.use = use
        if gain:
            self.gain = nn.Parameter(torch.linspace(0.5, 1.5, widths[-1]))
        self.double()

    def forward(self, x):
        for i, name in enumerate(self.use):
            x = self.blocks[name](x)
            x = torch.tanh(x) if i < len(self.use) - 1 else x
        return x * self.gain if hasattr(self, "gain") else x


def _case_model(name):
    return Permuted(*MODELS[name])


def _case_data():
    x, y = models.regression_data(n=STEPS * GLOBAL_BATCH, seed=5)
    return x.double(), y.double()


def _case_reference(name):
    """Gradients of every step, and parameters after every step, trained in one process."""
    model, (x, y) = _case_model(name), _case_data()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    grads, params = [], []
    for s in range(STEPS):
        batch = slice(s * GLOBAL_BATCH, (s + 1) * GLOBAL_BATCH)
        opt.zero_grad()
        F.mse_loss(model(x[batch]), y[batch]).backward()
        grads.append([p.grad.clone() for p in model.parameters()])
        opt.step()
        params.append([p.detach().clone() for p in model.parameters()])
    return grads, params


refuse_too(_case_reference, _case_data, _case_model)


def _describe(name, cap):
    widths, names, use, gain = MODELS[name]
    root = ", and a gain on the root module" if gain else ""
    return (f"{name} (layers registered {', '.join(names)}, applied {', '.join(use)}{root}), "
            f"cap {cap} bytes")


def check_arrival_buckets(fn, world_sizes=(2, 3)):
    """fn(model, world_size, cap_bytes) -> finish(); finish() after every backward leaves the
    averaged gradients; from the second step on, the gradients travel in buckets formed in the
    order they arrived in the first step, each launched as soon as its last gradient exists."""
    def learner(rank, world_size):
        from ... import _tracer
        events = _tracer._active.events            # this rank's communication, as it happens
        x, y = _case_data()
        out = []
        with Wire() as wire, Handles():
            for name, cap in CASES:
                model = _case_model(name)
                names = [n for n, _ in model.named_parameters()]
                log = {"start": 0, "arrived": []}

                # Registered before the learner's hooks, so it runs first for every parameter:
                # how many all-reduces had left when this gradient came into being.
                def arrived(p, n):
                    launched = sum(e["op"] == "all_reduce" for e in events[log["start"]:])
                    log["arrived"].append((n, launched))
                for n, p in model.named_parameters():
                    p.register_post_accumulate_grad_hook(lambda p, n=n: arrived(p, n))

                with refused("rebuild the buckets in the order the gradients arrived"):
                    finish = fn(model, world_size, cap)
                    if not callable(finish):
                        return {"error": f"returned {type(finish).__name__}, not a finish() "
                                         f"function"}
                    opt = torch.optim.SGD(model.parameters(), lr=0.1)
                    steps = []
                    for s in range(STEPS):
                        batch = slice(s * GLOBAL_BATCH, (s + 1) * GLOBAL_BATCH)
                        xb, yb = shard_batch(x[batch], rank, world_size), \
                            shard_batch(y[batch], rank, world_size)
                        opt.zero_grad()
                        loss = F.mse_loss(model(xb), yb)
                        log.update(start=len(events), arrived=[])
                        mark = wire.mark()
                        loss.backward()
                        in_backward = len(events) - log["start"]
                        finish()
                        mine = events[log["start"]:]
                        steps.append(dict(
                            sent=wire.records[mark:], unwaited=len(Handles.unwaited(mine)),
                            arrived=list(log["arrived"]),
                            native=any(e["native"] for e in mine),
                            # (bytes, asynchronous, launched inside backward) per all-reduce
                            reduces=[(e["bytes"], bool(e["async_op"]
                                                       or e.get("_waited_another_way")),
                                      i < in_backward)
                                     for i, e in enumerate(mine) if e["op"] == "all_reduce"],
                            grads=[p.grad.clone() if p.grad is not None else None
                                   for p in model.parameters()]))
                        opt.step()
                        steps[-1]["params"] = [p.detach().clone() for p in model.parameters()]
                sizes = {n: p.numel() * p.element_size() for n, p in model.named_parameters()}
                out.append(dict(steps=steps, names=names, sizes=sizes))
        return {"cases": out}

    references = {name: _case_reference(name) for name in MODELS}
    for ws in world_sizes:
        got = run_learner(learner, ws, name="arrival_order_buckets", timeout=60, trace=True)
        for r in got:
            if "error" in r:
                raise CheckFailed(f"arrival_order_buckets {r['error']}: it must return the "
                                  f"function that finishes each step.")
        for c, (name, cap) in enumerate(CASES):
            expected_grads, expected_params = references[name]
            _judge_case([g["cases"][c] for g in got], expected_grads, expected_params, ws,
                        _describe(name, cap), cap)
    passed(f"arrival_order_buckets sends, from the second step on, buckets within the cap formed "
           f"in the order the gradients arrived, each launched before backward produces the next "
           f"bucket's first gradient, and every rank's gradients equal one process's on the whole "
           f"batch (two models whose layers run out of registration order, two caps, "
           f"{sizes_phrase(world_sizes)} ranks, three steps).")


def _judge_case(per_rank, expected_grads, expected_params, ws, case, cap):
    names, sizes = per_rank[0]["names"], per_rank[0]["sizes"]
    for s in range(STEPS):
        where = f"with world_size={ws}, {case}, step {s}"
        for rank, r in enumerate(per_rank):
            step = r["steps"][s]
            if step["unwaited"]:
                raise CheckFailed(never_waited_sentence(f"{where}, rank {rank}",
                                                        step["unwaited"]))
            if step["native"]:
                raise CheckFailed(
                    f"{where}: the gradients were all-reduced from C++ (torch's "
                    f"DistributedDataParallel or similar); the exercise is to form and send the "
                    f"buckets yourself.")
            _compare_step(step["grads"], expected_grads[s], "the gradient", ws, rank, names, s)
        sent = [r["steps"][s]["sent"] for r in per_rank]
        missing = _traffic.missing(delivered(sent), expected_grads[s], names)
        if missing:
            raise CheckFailed(
                f"{where}: every rank ends with the right gradients, but what its calls delivered "
                f"does not hold the gradient of {missing} (times any factor): the all-reduces "
                f"must carry the ranks' own gradients — a decoy call, with the gradient computed "
                f"some other way, does not count.")
        if s:                               # the first step only records the order
            carried = _carried(sent, expected_grads[s], names, where)
            for rank, r in enumerate(per_rank):
                _judge_buckets(r["steps"][s], carried, names, sizes, cap, f"{where}, rank {rank}")
        for rank, r in enumerate(per_rank):
            _compare_step(r["steps"][s]["params"], expected_params[s],
                          "the parameter after the step", ws, rank, names, s)


def _ordinal(i):
    return {1: "1st", 2: "2nd", 3: "3rd"}.get(i, f"{i}th")


def _carried(sent, expected, names, where):
    """The names of the gradients each all-reduce of the step carried, read from what the k-th
    all-reduce of every rank delivered (so the learner's buckets are read, not assumed)."""
    reduces = [[c for c in calls if c["op"] == "all_reduce"] for calls in sent]
    if len({len(r) for r in reduces}) != 1:
        raise CheckFailed(f"{where}: the ranks made different numbers of all-reduces; every rank "
                          f"must send the same buckets in the same order.")
    grads, carried = dict(zip(names, expected)), []
    for k in range(len(reduces[0])):
        pieces = delivered([[calls[k]] for calls in reduces])
        index = _traffic._index(pieces) if pieces else None
        carried.append([n for n in names if pieces and
                        _traffic.holds(pieces, grads[n], _index_=index)])
    return carried


def _judge_buckets(step, carried, names, sizes, cap, where):
    """One rank's step after the first: the gradients each all-reduce carried (`_carried`), then
    the cap, the arrival order, the overlap and the fill."""
    if len(carried) != len(step["reduces"]):
        raise CheckFailed(f"{where}: the trace and the values of the all-reduces disagree; send "
                          f"every bucket with one all-reduce of its flat gradients.")
    bucket_of = {}
    for k, bucket in enumerate(carried):
        for n in bucket:
            bucket_of.setdefault(n, k)
    lost = [n for n in names if n not in bucket_of]
    if lost:
        raise CheckFailed(
            f"{where}: the gradient of {lost[0]} travelled in no all-reduce of this step: from the "
            f"second step on, every gradient leaves in the all-reduce of its bucket.")
    for k, ((nbytes, _, _), bucket) in enumerate(zip(step["reduces"], carried)):
        own = [n for n in bucket if bucket_of[n] == k]
        if nbytes != sum(sizes[n] for n in own):
            raise CheckFailed(
                f"{where}: all-reduce number {k} carried {nbytes} bytes, but the gradients in it "
                f"({', '.join(own) or 'none'}) hold {sum(sizes[n] for n in own)}: each "
                f"all-reduce carries exactly its bucket's gradients, once.")
        if len(own) > 1 and nbytes > cap:
            raise CheckFailed(
                f"{where}: bucket {k} ({', '.join(own)}) holds {nbytes} bytes, over the cap of "
                f"{cap}: close a bucket before a gradient would take it over the cap (a gradient "
                f"larger than the cap travels alone).")
    order = [n for n, _ in step["arrived"]]
    position = {n: i for i, n in enumerate(order)}
    spans = [sorted(position[n] for n in names if bucket_of[n] == k)
             for k in range(len(carried))]
    for k in range(len(spans) - 1):
        last, first = spans[k][-1], spans[k + 1][0]
        if last > first:
            raise CheckFailed(
                f"{where}: all-reduce {k} waited for {order[last]}, whose gradient arrived "
                f"{_ordinal(last + 1)} of {len(order)}, but {order[first]}, carried by the next "
                f"all-reduce, had arrived {_ordinal(first + 1)}: a bucket that holds a late "
                f"gradient keeps the early ones waiting, so nothing overlaps — form the buckets, "
                f"and send them, in the order the gradients arrived in the first step, not in the "
                f"order of the parameters.")
    for k in range(len(spans) - 1):
        _, launched = step["arrived"][spans[k + 1][0]]
        if launched < k + 1:
            if not step["reduces"][k][2]:
                raise CheckFailed(
                    f"{where}: bucket {k}'s all-reduce was launched after backward had finished, "
                    f"so nothing overlaps: send each bucket as soon as its last gradient exists, "
                    f"while backward computes the rest.")
            raise CheckFailed(
                f"{where}: when backward produced {order[spans[k + 1][0]]}, the first gradient of "
                f"bucket {k + 1}, bucket {k} had not been launched: each bucket leaves as soon as "
                f"its own last gradient exists (that is the overlap).")
    for k, (_, asynchronous, _) in enumerate(step["reduces"][:-1]):
        if not asynchronous:
            raise CheckFailed(
                f"{where}: bucket {k}'s all-reduce was waited for at once, so backward stopped "
                f"until it arrived: let it travel and wait for it only when the step finishes.")
    for k in range(len(carried) - 1):
        both = step["reduces"][k][0] + step["reduces"][k + 1][0]
        if both <= cap:
            raise CheckFailed(
                f"{where}: buckets {k} and {k + 1} hold {both} bytes together, within the cap of "
                f"{cap}: one all-reduce could carry both (each pays its latency) — fill a bucket "
                f"until the next gradient would take it over the cap.")
