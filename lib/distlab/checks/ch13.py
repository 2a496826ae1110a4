"""Checkers for workbook 13: the break-even H of DiLoCo with overlap, top-k compression with error
feedback, and healing a newcomer from a donor over a subgroup (judged by the checkers' one traffic
rule, `_traffic`: every call on the group, and the donor's state among what the calls delivered,
whether broadcast or sent as messages)."""
import math
from fractions import Fraction

import torch
import torch.distributed as dist

from .. import across_sites as _sites
from .. import fault_tolerance as _ft
from . import CheckFailed, _traffic, call_learner, compare, forbid, passed
from .ch01 import learner_run, no_object_collectives, refusing


# ---- exercise 1: the smallest H that keeps a utilisation, with overlap --------------------------

# (compute_s, sync_s, utilisation, overlap_steps): none at an exact boundary, where float rounding
# of a correct formula could go either way.
BREAK_EVEN_CASES = [(4.66, 16.3, 0.9, 0), (1.0, 30.0, 0.85, 5), (2.0, 5.0, 0.95, 3),
                    (1.0, 2.5, 0.5, 4), (3.0, 1.0, 0.5, 0), (0.7, 0.0, 0.99, 0),
                    (0.69, 13.0, 0.8, 2)]


def _reference_break_even(compute, sync, utilisation, overlap):
    c, s, u = Fraction(compute), Fraction(sync), Fraction(utilisation)
    exposed = max(Fraction(0), s - overlap * c)
    h = max(1, overlap)
    if exposed:
        h = max(h, math.ceil(exposed * u / (c * (1 - u))))
    return h


def _utilisation(compute, sync, overlap, h):
    return compute / (compute + max(0.0, sync - overlap * compute) / h)


def check_break_even_H(fn):
    """fn(compute_s, sync_s, utilisation, overlap_steps) -> the smallest whole H."""
    name = getattr(fn, "__name__", "break_even_H")
    for compute, sync, u, tau in BREAK_EVEN_CASES:
        context = (f"{name}(compute_s={compute}, sync_s={sync}, utilisation={u}, "
                   f"overlap_steps={tau})")
        with refusing(_sites.break_even_H, _sites.link_for, exercise="solve for H yourself"):
            got = call_learner(fn, compute, sync, u, tau, name=name)
        expected = _reference_break_even(compute, sync, u, tau)
        if isinstance(got, bool) or not isinstance(got, int):
            if isinstance(got, float) and got.is_integer():
                got = int(got)
            else:
                raise CheckFailed(f"{context} returned {got!r}: H is a whole number of inner "
                                  f"steps (the smallest one that is enough).")
        if got == expected:
            continue
        if got < max(1, tau):
            why = (f"fewer inner steps than the {tau} the sync overlaps: it cannot hide behind "
                   f"steps that are not there" if tau else "H is at least 1")
        elif got < expected:
            why = (f"at H={got} the utilisation is {_utilisation(compute, sync, tau, got):.4f}, "
                   f"below {u}")
        else:
            why = (f"H={got - 1} already keeps "
                   f"{_utilisation(compute, sync, tau, got - 1):.4f} ≥ {u}: not the smallest")
        raise CheckFailed(f"{context}: expected H = {expected}, got {got} ({why}).")
    passed(f"{name} finds the smallest H on {len(BREAK_EVEN_CASES)} links, with and without "
           f"overlap: a sync fully hidden, partly hidden, and no sync at all.")


# ---- exercise 2: top-k sparsification with error feedback --------------------------------------

def _draw(shape, seed, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g, dtype=dtype)


def _reference_topk(grad, error, k):
    corrected = grad + error
    sent = torch.zeros_like(corrected)
    idx = corrected.reshape(-1).abs().topk(k).indices
    sent.reshape(-1)[idx] = corrected.reshape(-1)[idx]
    return sent, corrected - sent


def _one_topk(fn, name, grad, error, k, context):
    kept = grad.clone(), error.clone()
    got = call_learner(fn, grad, error, k, name=name)
    if not torch.equal(grad, kept[0]) or not torch.equal(error, kept[1]):
        raise CheckFailed(f"{context}: {name} changed its input `grad` or `error` in place; the "
                          f"caller still needs them — return new tensors.")
    if not (isinstance(got, (tuple, list)) and len(got) == 2
            and all(isinstance(t, torch.Tensor) for t in got)):
        raise CheckFailed(f"{context}: {name} must return (sent, new_error), two tensors; got "
                          f"{type(got).__name__}.")
    sent, new_error = got
    for label, t in (("sent", sent), ("new_error", new_error)):
        if tuple(t.shape) != tuple(grad.shape):
            raise CheckFailed(f"{context}: {label} has shape {tuple(t.shape)}, the gradient "
                              f"{tuple(grad.shape)}.")
    nonzero = int((sent != 0).sum())
    if nonzero > k:
        raise CheckFailed(f"{context}: sent holds {nonzero} non-zero values; top-{k} sends {k} "
                          f"(the rest waits in the error buffer).")
    expected_sent, expected_error = _reference_topk(grad, error, k)
    ignoring, _ = _reference_topk(grad, torch.zeros_like(error), k)
    if not torch.allclose(sent, expected_sent, atol=1e-12, rtol=0):
        if error.abs().sum() > 0 and torch.allclose(sent, ignoring, atol=1e-12, rtol=0):
            raise CheckFailed(f"{context}: sent is the top {k} of the gradient alone; error "
                              f"feedback first adds the error buffer, then picks the top {k} of "
                              f"the sum.")
        compare(sent, expected_sent, f"{context}, sent", atol=1e-12, rtol=0)
    if not torch.allclose(new_error, expected_error, atol=1e-12, rtol=0):
        if torch.allclose(new_error, grad - sent, atol=1e-12, rtol=0):
            raise CheckFailed(f"{context}: new_error is grad − sent, which forgets the old error "
                              f"buffer: what was held back must stay held back (grad + error − "
                              f"sent).")
        compare(new_error, expected_error, f"{context}, new_error", atol=1e-12, rtol=0)
    return sent, new_error


def check_topk_feedback(fn):
    """fn(grad, error, k) -> (sent, new_error): a matrix and a vector, each over several steps."""
    name = getattr(fn, "__name__", "topk_feedback")
    for shape, k, seed in (((6, 5), 4, 1), ((17,), 3, 2)):
        common = _draw(shape, seed)
        error = 0.3 * _draw(shape, seed + 50)           # not zero: the first step tests it too
        start, total_grad, total_sent = error.clone(), torch.zeros(shape, dtype=torch.float64), \
            torch.zeros(shape, dtype=torch.float64)
        for step in range(6):
            grad = common + 0.5 * _draw(shape, 100 * seed + step)
            context = f"{name} on a {'x'.join(map(str, shape))} gradient with k={k}, step {step}"
            sent, error = _one_topk(fn, name, grad, error, k, context)
            total_grad, total_sent = total_grad + grad, total_sent + sent
        # the identity error feedback guarantees: what was not sent is exactly what is held
        compare(total_grad + start - total_sent, error,
                f"{name} on a {'x'.join(map(str, shape))} gradient after 6 steps: the sum of the "
                f"gradients (plus the first buffer) minus the sum sent", atol=1e-10, rtol=0)
    passed(f"{name} sends the top k of gradient + error and keeps the rest, on a matrix and a "
           f"vector over 6 steps: the accumulated gap equals the error buffer.")


# ---- exercise 3: heal a newcomer from a donor over a subgroup -----------------------------------

# (world size, members of the group in rank order, donor's global rank, the newcomer's rank):
# the donor is never the group's first member, and a rank outside the group keeps its own state.
HEAL_LAYOUTS = [(4, (1, 2, 3), 2, 3), (3, (0, 2), 2, 0)]


def _model_and_optimizer(seed, steps):
    """A small float64 MLP and its SGD-with-momentum optimizer after `steps` steps of its own."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.Tanh(),
                                torch.nn.Linear(6, 3)).double()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for s in range(steps):
        x = _draw((5, 4), 1000 * seed + s)
        opt.zero_grad()
        model(x).pow(2).mean().backward()
        opt.step()
    return model, opt


def _state(model, opt):
    params = [p.detach().clone() for p in model.parameters()]
    momenta = [opt.state[p].get("momentum_buffer") if p in opt.state else None
               for p in model.parameters()]
    return params, [m.detach().clone() if m is not None else None for m in momenta]


def _heal_on_ranks(rank, world_size, fn, members, donor, newcomer):
    members_group = dist.new_group(list(members))     # every rank creates it, in the same order
    if rank not in members:
        model, opt = _model_and_optimizer(50 + rank, 3)
        return _state(model, opt)
    # survivors trained (the donor the longest); the newcomer is fresh: no momentum yet
    model, opt = _model_and_optimizer(10 + rank, 0 if rank == newcomer else 2 + rank)
    with forbid(_ft._heal, _model_and_optimizer, _draw, exercise="send the donor's state "
                "yourself"), \
            no_object_collectives("send the donor's tensors themselves (broadcast or send/recv)"), \
            _traffic.Carried() as carried:
        fn(model, opt, members_group, donor)
    return (*_state(model, opt), carried.records)


def check_heal(fn):
    """fn(model, optimizer, group, donor): run by every member of `group`; afterwards each holds
    the donor's parameters and momentum buffers. Two layouts, the donor not the group's first.
    Judged by the one traffic rule too: every call of a member on the group (collectives) or
    with its members (messages), and the donor's state among what the calls delivered — so a
    broadcast and messages from the donor pass alike, and a call of zeros beside the donor's
    state rebuilt from its recipe does not."""
    name = getattr(fn, "__name__", "heal")
    rule = ("only the group's members call heal, so every collective must run on `group`, "
            "with the donor given by its global rank.")
    for world, members, donor, newcomer in HEAL_LAYOUTS:
        got = learner_run(_heal_on_ranks, world, fn, members, donor, newcomer, name=name,
                          hang_rule=rule)
        model, opt = _model_and_optimizer(10 + donor, 2 + donor)
        want_params, want_momenta = _state(model, opt)
        where = f"{name} with {world} ranks, group {list(members)}, donor rank {donor}"
        for rank in range(world):
            params, momenta = got[rank][:2]
            if rank not in members:
                keep_params, keep_momenta = _state(*_model_and_optimizer(50 + rank, 3))
                compare(params, keep_params, f"{where}: rank {rank}, outside the group, "
                        f"parameters", atol=0, rtol=0)
                if got.trace.comm(rank):
                    raise CheckFailed(f"{where}: rank {rank}, outside the group, took part in "
                                      f"{len(got.trace.comm(rank))} collective(s); {rule}")
                continue
            compare(params, want_params, f"{where}: rank {rank}'s parameters after heal",
                    atol=0, rtol=0)
            missing = [i for i, m in enumerate(momenta) if m is None]
            if missing:
                raise CheckFailed(f"{where}: rank {rank} has no momentum buffer for parameter "
                                  f"{missing[0]} after heal; its next step would differ from "
                                  f"the donor's (send the optimizer's momentum too).")
            compare(momenta, want_momenta, f"{where}: rank {rank}'s momentum buffers after heal",
                    atol=0, rtol=0)
        _judge_heal_traffic(got, members, donor, want_params + want_momenta, where, rule)
    passed(f"{name} copies the donor's parameters and momentum to every member of the group "
           f"(3 of 4 ranks, and 2 of 3 with the donor last), and leaves the rank outside alone.")


def _judge_heal_traffic(got, members, donor, state, where, rule):
    """Every member's calls on the group (`_traffic.off_group`), and the donor's parameters and
    momenta among what they delivered (`_traffic.delivered`, `holds`), however they travelled."""
    for rank in members:
        bad, what = _traffic.off_group(_traffic.data_calls(_traffic.records(got.trace, rank)),
                                       members)
        if bad is not None:
            raise CheckFailed(f"{where}: rank {rank} made {what}, outside the group; {rule}")
    n = len(state) // 2
    names = [f"parameter {i}" for i in range(n)] + [f"momentum buffer {i}" for i in range(n)]
    missing = _traffic.missing(_traffic.delivered({r: got[r][2] for r in members}), state, names)
    if missing:
        raise CheckFailed(f"{where}: every member holds the donor's state, but what their calls "
                          f"delivered does not hold the donor's {missing}: send the donor's own "
                          f"tensors — a state rebuilt from the donor's recipe beside a call of "
                          f"zeros (or of anything else) does not count.")
