"""Workbook 11, exercise 4: which rank's gradients differ, at which step, in which parameter."""
import torch
import torch.distributed as dist
import torch.nn.functional as F

from ... import debug
from ... import trace as _trace
from .. import CheckFailed, _traffic, passed, sizes_phrase
from ._common import WORLD_SIZES, _plain, _refused, _traced


# (name, [(step, rank, parameter, how)]): the damage done to one rank's averaged gradient
DIVERGENCE_CASES = (
    ("nothing differs", []),
    ("at step 2, the last rank's net.2.bias[1] off by 1e-12", [(2, -1, "net.2.bias", "nudge")]),
    ("at step 1, two elements of net.0.weight swapped on rank 1",
     [(1, 1, "net.0.weight", "swap")]),
    ("at step 0, rank 1's net.2.weight and the last rank's net.0.bias off",
     [(0, 1, "net.2.weight", "nudge"), (0, -1, "net.0.bias", "nudge")]),
)


def _expected_divergence(case, world_size):
    """[(step, expected answer)] up to the first step with damage (after it replicas drift)."""
    damage = DIVERGENCE_CASES[case][1]
    if not damage:
        return [(s, None) for s in range(4)]
    step = min(d[0] for d in damage)
    names = [n for n, _ in debug.problem()[0].named_parameters()]
    hit = [(names.index(p), r % world_size, p) for s, r, p, _ in damage if s == step]
    _, rank, param = min(hit)
    return [(s, None) for s in range(step)] + [(step, (rank, param))]


def _damage(model, step, rank, world_size, damage):
    with torch.no_grad():
        for s, r, pname, how in damage:
            if s != step or r % world_size != rank:
                continue
            g = dict(model.named_parameters())[pname].grad
            if how == "swap":
                g[0, 0], g[0, 1] = g[0, 1].clone(), g[0, 0].clone()
            else:
                g.view(-1)[min(1, g.numel() - 1)] += 1e-12


def _divergence_on_ranks(rank, world_size, fn):
    answers, sent = [], []
    for _, damage in DIVERGENCE_CASES:
        seen, step = [], [0]

        def average(model):
            for p in model.parameters():
                dist.all_reduce(p.grad, op=dist.ReduceOp.AVG)
            _damage(model, step[0], rank, world_size, damage)
            named = [(n, p.grad) for n, p in model.named_parameters()]
            with _trace.span("detector"), _refused("compare the ranks' gradients yourself"), \
                    _traffic.Carried() as carried:
                seen.append(_plain(fn(named)))
            # whether anything travelled: a call that is not only zeros
            sent.append(any(not _traffic.carried_nothing(c)
                            for c in _traffic.data_calls(carried.records)))
            step[0] += 1
        _train(rank, world_size, average)
        answers.append(seen)
    return {"answers": answers, "sent": sent}


def _train(rank, world_size, average):
    model, batches = debug.problem()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for x, y in batches:
        xs, ys = x.tensor_split(world_size)[rank], y.tensor_split(world_size)[rank]
        opt.zero_grad()
        F.mse_loss(model(xs), ys).backward()
        average(model)
        opt.step()


def check_first_divergence(fn):
    """fn([(name, grad), ...]) -> None when every rank holds the same gradients, else (rank,
    name): the first parameter that differs anywhere, and the lowest rank whose copy of it
    differs from rank 0's; the same answer on every rank."""
    name = getattr(fn, "__name__", "first_divergence")
    model, _ = debug.problem()
    nbytes = sum(p.numel() * p.element_size() for p in model.parameters())
    for ws in WORLD_SIZES:
        got = _traced(_divergence_on_ranks, ws, name, fn, rule="every rank must call the "
                      "detector's collectives, whatever it finds.")
        for case, (label, _) in enumerate(DIVERGENCE_CASES):
            for step, expected in _expected_divergence(case, ws):
                for rank in range(ws):
                    answer = got[rank]["answers"][case][step]
                    answer = tuple(answer) if isinstance(answer, list) else answer
                    if answer != expected:
                        raise CheckFailed(
                            f"{name} with world_size={ws}, case '{label}': at step {step} rank "
                            f"{rank} returned {answer!r}, expected {expected!r}"
                            + (" (a plain sum does not see two elements swapped; a sum weighted "
                               "by position does)" if "swapped" in label and answer is None
                               else "") + ".")
        calls = 4 * len(DIVERGENCE_CASES)
        for rank in range(ws):
            # by the one traffic rule: the bytes it put on the wire, a collective its ring share
            sent = _traffic.wire(_traffic.records(got.trace, rank, "detector"))
            if not all(got[rank]["sent"]):
                raise CheckFailed(
                    f"{name} with world_size={ws}: rank {rank} answered call "
                    f"{got[rank]['sent'].index(False)} of the detector without sending anything "
                    f"but zeros; no rank can know another's gradients unless something of them "
                    f"(checksums) travels.")
            if sent / calls > nbytes / 4:
                raise CheckFailed(
                    f"{name} with world_size={ws}: rank {rank} sent {sent / calls:.0f} bytes per "
                    f"call; the gradients themselves are {nbytes}. Send a few numbers per "
                    f"tensor (checksums), not the tensors.")
    passed(f"{name} names the rank and the parameter at the step where they first differ (1e-12 "
           f"and a swap included), the same on every rank, on {sizes_phrase(WORLD_SIZES)} ranks.")
