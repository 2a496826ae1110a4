"""Workbook 06's checkers, each through the battery (tests/checker_battery.py): right answers
however written pass; wrong results, wrong communication (read from the trace: bytes, group,
values), the course's own code and decoys are refused in one sentence. Then chapter 06/06b's
models and the numbers their prose quotes."""
import re
import threading

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed import all_gather, reduce_scatter

from checker_battery import battery
from distlab import memory
from distlab.checks import CheckFailed, ch06
from distlab.sharding import chunk_bounds, gather_flat


# ---- exercise 1: a sharded step over one flat buffer, on a process group ------------------------

def flat_zero_step(params, flat_shard, optimizer, group):
    """The workbook's answer: list-form collectives on the group."""
    n = dist.get_world_size(group)
    grad = torch.cat([p.grad.reshape(-1) for p in params])
    total = grad.numel()
    c = -(-total // n)
    mine = torch.empty(c, dtype=grad.dtype)
    reduce_scatter(mine, list(F.pad(grad, (0, c * n - total)).split(c)), group=group)
    flat_shard.grad = mine[:flat_shard.numel()] / n
    optimizer.step()
    parts = [torch.empty(c, dtype=flat_shard.dtype) for _ in range(n)]
    all_gather(parts, F.pad(flat_shard.detach(), (0, c - flat_shard.numel())), group=group)
    for p, part in zip(params, torch.cat(parts)[:total].split([q.numel() for q in params])):
        p.data.copy_(part.view_as(p))


def flat_zero_step_single(params, flat_shard, optimizer, group):
    """Differently written: _single collectives, ReduceOp.AVG, a copy loop with offsets."""
    n = dist.get_world_size(group)
    total = sum(p.numel() for p in params)
    c = -(-total // n)
    buf = torch.zeros(c * n, dtype=params[0].dtype)
    at = 0
    for p in params:
        buf[at:at + p.numel()] = p.grad.reshape(-1)
        at += p.numel()
    out = torch.empty(c, dtype=buf.dtype)
    dist.reduce_scatter_single(out, buf, op=dist.ReduceOp.AVG, group=group)
    flat_shard.grad = out[:flat_shard.numel()].clone()
    optimizer.step()
    mine = torch.zeros(c, dtype=buf.dtype)
    mine[:flat_shard.numel()] = flat_shard.detach()
    dist.all_gather_single(buf, mine, group=group)
    at = 0
    for p in params:
        p.data.view(-1).copy_(buf[at:at + p.numel()])
        at += p.numel()


def flat_ring_of_messages(params, flat_shard, optimizer, group):
    """Differently written: a hand-written ring of messages on the group (batch_isend_irecv), the
    bytes of a reduce-scatter and an all-gather — priced by the checkers' one traffic rule like
    the collectives (a receive is the peer's send, not bytes this rank sent)."""
    ranks = dist.get_process_group_ranks(group)
    n, me = len(ranks), ranks.index(dist.get_rank())
    right, left = ranks[(me + 1) % n], ranks[(me - 1) % n]
    grad = torch.cat([p.grad.reshape(-1) for p in params])
    total = grad.numel()
    c = -(-total // n)

    def hop(send):
        got = torch.empty_like(send)
        for work in dist.batch_isend_irecv([dist.P2POp(dist.isend, send, right, group),
                                            dist.P2POp(dist.irecv, got, left, group)]):
            work.wait()
        return got
    chunks = [x.clone() for x in F.pad(grad, (0, c * n - total)).split(c)]
    for s in range(n - 1):                       # reduce-scatter: rank me ends with chunk me
        chunks[(me - s - 2) % n] += hop(chunks[(me - s - 1) % n])
    flat_shard.grad = chunks[me][:flat_shard.numel()] / n
    optimizer.step()
    parts = [None] * n
    parts[me] = F.pad(flat_shard.detach(), (0, c - flat_shard.numel()))
    for s in range(n - 1):                       # all-gather
        parts[(me - s - 1) % n] = hop(parts[(me - s) % n])
    for p, part in zip(params, torch.cat(parts)[:total].split([q.numel() for q in params])):
        p.data.copy_(part.view_as(p))


def flat_summed(params, flat_shard, optimizer, group):
    """Wrong: the sum, not the average (Adam nearly hides it; the tight comparison does not)."""
    n = dist.get_world_size(group)
    grad = torch.cat([p.grad.reshape(-1) for p in params])
    c = -(-grad.numel() // n)
    out = torch.empty(c, dtype=grad.dtype)
    dist.reduce_scatter_single(out, F.pad(grad, (0, c * n - grad.numel())), group=group)
    flat_shard.grad = out[:flat_shard.numel()].clone()
    optimizer.step()
    _flat_back(params, flat_shard, group, c, n)


def _flat_back(params, flat_shard, group, c, n, world=False):
    full = torch.empty(c * n, dtype=flat_shard.dtype)
    dist.all_gather_single(full, F.pad(flat_shard.detach(), (0, c - flat_shard.numel())),
                           group=None if world else group)
    total = sum(p.numel() for p in params)
    for p, part in zip(params, full[:total].split([q.numel() for q in params])):
        p.data.copy_(part.view_as(p))


def flat_global_rank(params, flat_shard, optimizer, group):
    """A decoy: right on the world group, but takes its offset from its WORLD rank, so on a
    subgroup whose ranks are not 0..k it updates another slice than the one it owns."""
    n = dist.get_world_size(group)
    grad = torch.cat([p.grad.reshape(-1) for p in params])
    total = grad.numel()
    c = -(-total // n)
    full = F.pad(grad, (0, c * n - total)).clone()
    dist.all_reduce(full, group=group)
    lo = min(dist.get_rank() * c, total - flat_shard.numel())
    flat_shard.grad = full[lo:lo + flat_shard.numel()] / n
    optimizer.step()
    _flat_back(params, flat_shard, group, c, n)


def flat_all_reduce(params, flat_shard, optimizer, group):
    """A decoy: reduce-scatters the real gradient (right values travel), but gets its slice from
    an all-reduce of the whole flat gradient too: 1.5x the bytes."""
    n, r = dist.get_world_size(group), dist.get_rank(group)
    grad = torch.cat([p.grad.reshape(-1) for p in params])
    total = grad.numel()
    c = -(-total // n)
    out = torch.empty(c, dtype=grad.dtype)
    dist.reduce_scatter_single(out, F.pad(grad, (0, c * n - total)), group=group)
    dist.all_reduce(grad, group=group)
    flat_shard.grad = grad[r * c:r * c + flat_shard.numel()] / n
    optimizer.step()
    _flat_back(params, flat_shard, group, c, n)


def flat_zeros_beside(params, flat_shard, optimizer, group):
    """A decoy: a reduce-scatter of zeros (the bytes the trace expects) beside the real
    exchange, which is an all-gather of every rank's whole gradient."""
    n, r = dist.get_world_size(group), dist.get_rank(group)
    grad = torch.cat([p.grad.reshape(-1) for p in params])
    total = grad.numel()
    c = -(-total // n)
    dist.reduce_scatter_single(torch.empty(c, dtype=grad.dtype),
                               torch.zeros(c * n, dtype=grad.dtype), group=group)
    every = torch.empty(n * total, dtype=grad.dtype)
    dist.all_gather_single(every, grad, group=group)
    mean = every.view(n, total).mean(0)
    flat_shard.grad = mean[r * c:r * c + flat_shard.numel()].clone()
    optimizer.step()
    _flat_back(params, flat_shard, group, c, n)


def flat_world_barrier(params, flat_shard, optimizer, group):
    """A cheat: the right step, then a barrier on the whole world where a group was given (in a
    job whose groups step at different times, it waits for ranks that never come)."""
    flat_zero_step_single(params, flat_shard, optimizer, group)
    dist.barrier()


def flat_course_gather(params, flat_shard, optimizer, group):
    """A cheat: the course's gather_flat."""
    n = dist.get_world_size(group)
    grad = torch.cat([p.grad.reshape(-1) for p in params])
    c = -(-grad.numel() // n)
    out = torch.empty(c, dtype=grad.dtype)
    dist.reduce_scatter_single(out, F.pad(grad, (0, c * n - grad.numel())),
                               op=dist.ReduceOp.AVG, group=group)
    flat_shard.grad = out[:flat_shard.numel()].clone()
    optimizer.step()
    gather_flat(flat_shard.detach(), grad.numel())


def test_flat_zero_step_battery():
    # the workbook's answer (flat_zero_step) runs in nbval of solutions/06; one 5-rank launch
    # per candidate here
    said = battery(ch06.check_flat_zero_step, require=("different", "wrong", "cheat", "decoy"),
                   different=[flat_zero_step_single, flat_ring_of_messages], wrong=[flat_summed],
                   cheat=[flat_world_barrier, flat_course_gather],
                   decoy=[flat_global_rank, flat_all_reduce, flat_zeros_beside])
    assert said["wrong"][0].startswith("flat_summed on the group [0, 2, 4], rank 0, after 3 "
                                       "steps, parameter net.0.weight")
    assert "a barrier ran on the ranks [0, 1, 2, 3, 4], not on the group it was given" in \
        said["cheat"][0]
    assert "course's own gather_flat" in said["cheat"][1]
    assert "on the group [0, 2, 4], rank 0" in said["decoy"][0]
    assert re.search(r"rank 0 sent [\d,]+ B \(all_gather [\d,]+ B, all_reduce [\d,]+ B, "
                     r"reduce_scatter [\d,]+ B; from the run's trace\), 1\.\d\d× the",
                     said["decoy"][1])
    assert re.search(r"on the group \[[\d, ]+\], rank \d: a reduce_scatter carried all zeros",
                     said["decoy"][2])


# ---- ZeRO-3: a layer's forward and backward ---------------------------------------------------

def _pad_gather(shard, numel, world):
    c = -(-numel // world)
    parts = [torch.empty(c, dtype=shard.dtype) for _ in range(world)]
    dist.all_gather(parts, F.pad(shard, (0, c - shard.numel())))
    return torch.cat(parts)[:numel]


def _pad_reduce(full, mine, world):
    c = -(-full.numel() // world)
    out = torch.empty(c, dtype=full.dtype)
    reduce_scatter(out, list(F.pad(full.reshape(-1), (0, c * world - full.numel())).split(c)))
    return out[:mine] / world


class ZeRO3Linear(torch.autograd.Function):
    """The workbook's answer: list-form all_gather / reduce_scatter of padded slices."""

    @staticmethod
    def forward(ctx, x, weight_shard, bias_shard, shape):
        world = dist.get_world_size()
        w = _pad_gather(weight_shard, shape[0] * shape[1], world).view(shape)
        b = _pad_gather(bias_shard, shape[0], world)
        ctx.save_for_backward(x, weight_shard)
        ctx.shape, ctx.bias_numel = shape, bias_shard.numel()
        return x @ w.t() + b

    @staticmethod
    def backward(ctx, grad_out):
        world = dist.get_world_size()
        x, weight_shard = ctx.saved_tensors
        w = _pad_gather(weight_shard, ctx.shape[0] * ctx.shape[1], world).view(ctx.shape)
        return (grad_out @ w, _pad_reduce(grad_out.t() @ x, weight_shard.numel(), world),
                _pad_reduce(grad_out.sum(0), ctx.bias_numel, world), None)


class ZeRO3LinearSingle(torch.autograd.Function):
    """Differently written: the _single collectives, ReduceOp.AVG, F.linear, the bias gathered
    again in backward too (FSDP gathers a whole unit), slices padded with torch.cat."""

    @staticmethod
    def _gather(shard, numel):
        world = dist.get_world_size()
        c = -(-numel // world)
        full = torch.empty(c * world, dtype=shard.dtype)
        dist.all_gather_single(full, torch.cat([shard, shard.new_zeros(c - shard.numel())]))
        return full[:numel]

    @staticmethod
    def _reduce(grad, keep):
        world = dist.get_world_size()
        flat = grad.reshape(-1)
        c = -(-flat.numel() // world)
        out = torch.empty(c, dtype=flat.dtype)
        dist.reduce_scatter_single(out, torch.cat([flat, flat.new_zeros(c * world - flat.numel())]),
                                   op=dist.ReduceOp.AVG)
        return out[:keep].clone()

    @staticmethod
    def forward(ctx, x, ws, bs, shape):
        ctx.save_for_backward(x, ws, bs)
        ctx.shape = shape
        return F.linear(x, ZeRO3LinearSingle._gather(ws, ws.new_empty(shape).numel()).view(shape),
                        ZeRO3LinearSingle._gather(bs, shape[0]))

    @staticmethod
    def backward(ctx, g):
        x, ws, bs = ctx.saved_tensors
        n = ctx.shape[0] * ctx.shape[1]
        w = ZeRO3LinearSingle._gather(ws, n).view(ctx.shape)
        ZeRO3LinearSingle._gather(bs, ctx.shape[0])          # not needed, but allowed
        return (g.mm(w), ZeRO3LinearSingle._reduce(g.t().mm(x), ws.numel()),
                ZeRO3LinearSingle._reduce(g.sum(0), bs.numel()), None)


class KeepsTheWeight(ZeRO3Linear):
    """Wrong structure with a decoy: keeps the gathered weight for backward and all-gathers
    zeros there, so the trace shows the backward gather ZeRO-3 needs."""

    @staticmethod
    def forward(ctx, x, weight_shard, bias_shard, shape):
        world = dist.get_world_size()
        w = _pad_gather(weight_shard, shape[0] * shape[1], world).view(shape)
        b = _pad_gather(bias_shard, shape[0], world)
        ctx.save_for_backward(x, w)
        ctx.shards = weight_shard.numel(), bias_shard.numel()
        return x @ w.t() + b

    @staticmethod
    def backward(ctx, grad_out):
        world = dist.get_world_size()
        x, w = ctx.saved_tensors
        _pad_gather(torch.zeros(ctx.shards[0], dtype=w.dtype), w.numel(), world)    # the decoy
        return (grad_out @ w, _pad_reduce(grad_out.t() @ x, ctx.shards[0], world),
                _pad_reduce(grad_out.sum(0), ctx.shards[1], world), None)


class DecoyReduceScatter(ZeRO3Linear):
    """A decoy of zeros: reduce-scatters zeros (the bytes the trace expects), and gets the
    gradient by an all-reduce of the full gradient."""

    @staticmethod
    def backward(ctx, grad_out):
        world, rank = dist.get_world_size(), dist.get_rank()
        x, weight_shard = ctx.saved_tensors
        w = _pad_gather(weight_shard, ctx.shape[0] * ctx.shape[1], world).view(ctx.shape)
        out = []
        for full, mine in ((grad_out.t() @ x, weight_shard.numel()),
                           (grad_out.sum(0), ctx.bias_numel)):
            _pad_reduce(torch.zeros_like(full), mine, world)
            full = full.reshape(-1).clone()
            dist.all_reduce(full)
            lo, hi = chunk_bounds(full.numel(), world, rank)
            out.append(full[lo:hi] / world)
        return (grad_out @ w, *out, None)


class AllReduceGradients(ZeRO3Linear):
    """Wrong structure: all-reduces the full gradients and keeps its slice (no decoy)."""

    @staticmethod
    def backward(ctx, grad_out):
        world, rank = dist.get_world_size(), dist.get_rank()
        x, weight_shard = ctx.saved_tensors
        w = _pad_gather(weight_shard, ctx.shape[0] * ctx.shape[1], world).view(ctx.shape)
        out = []
        for full in (grad_out.t() @ x, grad_out.sum(0)):
            full = full.reshape(-1).clone()
            dist.all_reduce(full)
            lo, hi = chunk_bounds(full.numel(), world, rank)
            out.append(full[lo:hi] / world)
        return (grad_out @ w, *out, None)


class CourseGather(ZeRO3Linear):
    """A cheat: the course's gather_flat."""

    @staticmethod
    def forward(ctx, x, weight_shard, bias_shard, shape):
        ctx.save_for_backward(x, weight_shard)
        ctx.shape, ctx.bias_numel = shape, bias_shard.numel()
        return x @ gather_flat(weight_shard, shape[0] * shape[1]).view(shape).t() + \
            gather_flat(bias_shard, shape[0])


class Unpadded(ZeRO3Linear):
    """Forgets the padding: the last rank's slice is shorter, and gloo fails."""

    @staticmethod
    def forward(ctx, x, weight_shard, bias_shard, shape):
        world = dist.get_world_size()
        parts = [torch.empty_like(weight_shard) for _ in range(world)]
        dist.all_gather(parts, weight_shard)
        return x @ torch.cat(parts)[:shape[0] * shape[1]].view(shape).t()


class LetGoLate(ZeRO3Linear):
    """Right, but another thread holds the gathered weight for 0.1 s after forward returns, as
    gloo's worker thread holds a finished all-gather's tensors a moment after wait() returns
    (the check once read 768 B of them on a loaded 2-core machine and called it kept)."""

    @staticmethod
    def forward(ctx, x, weight_shard, bias_shard, shape):
        world = dist.get_world_size()
        w = _pad_gather(weight_shard, shape[0] * shape[1], world).view(shape)
        held = [w]
        threading.Timer(0.1, held.clear).start()
        ctx.save_for_backward(x, weight_shard)
        ctx.shape, ctx.bias_numel = shape, bias_shard.numel()
        return x @ w.t() + _pad_gather(bias_shard, shape[0], world)


class ZeRO3LinearFlat(ZeRO3Linear):
    """Differently written and correct: ONE all-gather for the weight's and the bias's slices
    together (FSDP's flat parameter), each padded to its own ceil(numel / world)."""

    @staticmethod
    def forward(ctx, x, weight_shard, bias_shard, shape):
        world = dist.get_world_size()
        cw, cb = -(-shape[0] * shape[1] // world), -(-shape[0] // world)
        mine = torch.cat([F.pad(weight_shard, (0, cw - weight_shard.numel())),
                          F.pad(bias_shard, (0, cb - bias_shard.numel()))])
        parts = [torch.empty_like(mine) for _ in range(world)]
        dist.all_gather(parts, mine)
        w = torch.cat([p[:cw] for p in parts])[:shape[0] * shape[1]].view(shape)
        b = torch.cat([p[cw:] for p in parts])[:shape[0]]
        ctx.save_for_backward(x, weight_shard)
        ctx.shape, ctx.bias_numel = shape, bias_shard.numel()
        return x @ w.t() + b


def _at_2(check, fn):
    check(fn, world_sizes=(2,))


def test_zero3_layer_battery(capsys):
    ch06.check_zero3_layer(ZeRO3Linear, world_sizes=(3,))  # both sizes: nbval of the workbook
    said = battery(ch06.check_zero3_layer, call=_at_2,
                   correct=[LetGoLate], different=[ZeRO3LinearSingle, ZeRO3LinearFlat],
                   wrong=[KeepsTheWeight, AllReduceGradients], cheat=[CourseGather],
                   decoy=[DecoyReduceScatter])
    assert re.search(r"with world_size=2, rank 0: after layer 0's forward the rank still holds "
                     r"\d+ B it made during it — as much as the full 7×9 weight \(504 B in "
                     r"float64\)", said["wrong"][0])
    assert re.search(r"rank 0: the backward called all_reduce; .* an all-reduce leaves every "
                     r"rank the whole sum", said["wrong"][1])
    assert "your function called the course's own gather_flat; the exercise is to write the " \
        "ZeRO-3 layer yourself" in said["cheat"][0]
    assert "with world_size=2, rank 0: a reduce-scatter in the backward carried all zeros" in \
        said["decoy"][0]


def test_a_gloo_size_mismatch_is_explained():
    with pytest.raises(CheckFailed, match=r"with world_size=2, the ranks' (all_gather calls|"
                                          r"collectives) did not match .* pad each slice to "
                                          r"ceil\(numel / world_size\)"):
        ch06.check_zero3_layer(Unpadded)


# ---- exercise 3: the peak of ZeRO-3 without resharding after forward ---------------------------

def no_reshard_peak(units, world_size, states, flowing, loss, prefetch):
    """The workbook's answer: the turn, then backward from the last unit."""
    best, where = states + sum(u["weights"] + u["acts"] for u in units) + loss + flowing, None
    shards = 0.0
    for i in range(len(units) - 1, -1, -1):
        shards += units[i]["grad"] / world_size
        here = (states + shards + sum(u["acts"] for u in units[:i])
                + sum(u["weights"] for u in units[:i + 1]) + units[i]["grad"]
                + (flowing if i == 0 else 2 * flowing))
        if here > best:
            best, where = here, i
    return {"peak": best, "unit": where}


def no_reshard_every_moment(units, world_size, states, flowing, loss, prefetch):
    """Differently written: every moment in a dict, forward ones (with prefetch) included,
    cumulative sums, then the largest; extra keys."""
    import itertools
    w = list(itertools.accumulate(u["weights"] for u in units))
    a = [0.0] + list(itertools.accumulate(u["acts"] for u in units))
    n = len(units)
    moments = {}
    for i in range(n):
        moments[("f", i)] = states + a[i + 1] + w[i] + (units[i + 1]["weights"]
                                                        if prefetch and i + 1 < n else 0)
    moments[None] = states + a[n] + w[-1] + loss + flowing
    for i in range(n):
        shards = sum(u["grad"] for u in units[i:]) / world_size
        moments[i] = states + shards + a[i] + w[i] + units[i]["grad"] + flowing * (1 + (i > 0))
    key = max(moments, key=moments.get)
    return {"peak": moments[key], "unit": key, "all": moments}


def resharded_peak(units, world_size, states, flowing, loss, prefetch):
    """Wrong: the chapter's resharding step (only the unit's own weights in backward)."""
    best, where = states + sum(u["acts"] for u in units) + loss + flowing, None
    for i in range(len(units)):
        here = (states + sum(u["grad"] for u in units[i:]) / world_size
                + sum(u["acts"] for u in units[:i]) + units[i]["weights"] + units[i]["grad"]
                + (flowing if i == 0 else 2 * flowing))
        if here > best:
            best, where = here, i
    return {"peak": best, "unit": where}


def course_peak(units, world_size, states, flowing, loss, prefetch):
    """A cheat: the course's zero3_peak."""
    from distlab import zero_memory
    zero_memory.zero3_peak([dict(u, grad_shard=u["grad"] / world_size) for u in units], states)
    return {"peak": 0.0, "unit": None}


def largest_unit_only(units, world_size, states, flowing, loss, prefetch):
    """A decoy: compares the turn with the backward of the unit with the largest gradient only."""
    out = no_reshard_peak(units, world_size, states, flowing, loss, prefetch)
    i = max(range(len(units)), key=lambda k: units[k]["grad"])
    there = (states + sum(u["grad"] for u in units[i:]) / world_size
             + sum(u["acts"] for u in units[:i]) + sum(u["weights"] for u in units[:i + 1])
             + units[i]["grad"] + (flowing if i == 0 else 2 * flowing))
    turn = states + sum(u["weights"] + u["acts"] for u in units) + loss + flowing
    return {"peak": max(there, turn), "unit": out["unit"]}


def right_peak_wrong_moment(units, world_size, states, flowing, loss, prefetch):
    """A decoy: the right number, placed at the last unit's backward whatever the step."""
    return {"peak": no_reshard_peak(units, world_size, states, flowing, loss, prefetch)["peak"],
            "unit": len(units) - 1}


def test_no_reshard_peak_battery():
    said = battery(ch06.check_no_reshard_peak, correct=[no_reshard_peak],
                   different=[no_reshard_every_moment], wrong=[resharded_peak],
                   cheat=[course_peak], decoy=[largest_unit_only, right_peak_wrong_moment])
    assert "units 0.." in said["wrong"][0] or "every unit's weights" in said["wrong"][0]
    assert "course's own zero3_peak" in said["cheat"][0]
    assert "the peak is right but you place it at" in said["decoy"][1]


def test_no_reshard_cases_are_not_one_moment():
    # a constant or a "largest unit" rule cannot pass: the peaks fall at the turn, at the last
    # unit's backward and at an earlier one's, over world sizes 2, 3 and 5
    moments = [max(m, key=m.get) for m in (ch06._no_reshard_moments(*c)
                                           for c in ch06.NO_RESHARD_CASES)]
    kinds = {("turn" if k[0] == "turn" else "last" if k[1] == len(c[0]) - 1 else "earlier")
             for k, c in zip(moments, ch06.NO_RESHARD_CASES) if len(c[0]) > 1}
    assert kinds == {"turn", "last", "earlier"}
    assert {c[1] for c in ch06.NO_RESHARD_CASES} == {2, 3, 5}
    assert len({round(max(ch06._no_reshard_moments(*c).values()), 6)
                for c in ch06.NO_RESHARD_CASES}) == len(ch06.NO_RESHARD_CASES)


def test_stubs_are_reported_as_not_written():
    def stub(*args):
        raise NotImplementedError("exercise: replace this line with your code")

    class Stub(torch.autograd.Function):
        forward = staticmethod(lambda ctx, *args: stub())
        backward = staticmethod(lambda ctx, *args: stub())
    for check, fn in ((ch06.check_flat_zero_step, stub), (ch06.check_zero3_layer, Stub),
                      (ch06.check_no_reshard_peak, stub)):
        with pytest.raises(NotImplementedError, match="is not written yet"):
            check(fn)


# ---- the activation-memory model ----------------------------------------------------------------

@pytest.mark.parametrize("s, b, h, a", [(2048, 1, 4096, 32), (4096, 2, 12288, 96), (256, 1, 64, 4)])
def test_materialized_attention_is_korthikanti_eq1(s, b, h, a):
    assert memory.activation_bytes(s, b, h, 3, a, attention="materialized") == \
        pytest.approx(3 * s * b * h * (34 + 5 * a * s / h))
    # selective recomputation drops exactly the s×s term; full keeps the layer input, 2·s·b·h
    assert memory.activation_bytes(s, b, h, 3, a, "selective", "materialized") == 3 * 34 * s * b * h
    assert memory.activation_bytes(s, b, h, 3, a, True) == 3 * 2 * s * b * h
    assert memory.activation_bytes(s, b, h, 3, a, "full") == 3 * 2 * s * b * h


def test_flash_attention_stores_no_scores_and_selective_changes_nothing():
    s, b, h, a = 2048, 1, 4096, 32
    flash = memory.activation_bytes(s, b, h, 1, a)            # the default
    assert flash == 34 * s * b * h + 4 * a * s * b             # + one float32 log-sum-exp per row
    assert memory.activation_bytes(s, b, h, 1, a, "selective") == flash
    assert memory.per_gpu_bytes("GPT-3 175B", seq_len=2048)["activations"] == \
        96 * memory.activation_bytes(s, b, 12288, 1, 96)
    with pytest.raises(ValueError, match="attention must be one of"):
        memory.activation_bytes(s, b, h, 1, a, attention="sparse")
    with pytest.raises(ValueError, match="recompute must be one of"):
        memory.activation_bytes(s, b, h, 1, a, checkpointing="half")


def _saved_bytes(block, *args):
    weights = {p.untyped_storage().data_ptr() for p in block.parameters()}
    seen = {}

    def pack(t):
        key = t.untyped_storage().data_ptr()
        if key not in weights:
            seen[key] = t.untyped_storage().nbytes()
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        block(*args)
    return sum(seen.values())


def test_the_formula_matches_what_a_block_saves():
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from distlab import models
    s, b, h, a = 128, 2, 32, 4
    block = models.Block(h, a, 4 * h)
    x = torch.randn(b, s, h, requires_grad=True)
    ln_stats = 2 * 2 * s * b * 4                 # mean and 1/std of both LayerNorms, float32
    flash = _saved_bytes(block, x)
    assert flash == sum(memory.activation_breakdown(s, b, h, a, bytes_per_value=4,
                                                    dropout=False).values()) + ln_stats
    with sdpa_kernel(SDPBackend.MATH):   # the reference path stores the s×s softmax
        materialized = _saved_bytes(block, x)
    scores = memory.activation_breakdown(s, b, h, a, "materialized", bytes_per_value=4,
                                         dropout=False)["s×s attention scores"]
    assert scores == a * s * s * b * 4
    # it keeps no log-sum-exp, and may keep a scaled copy of Q and a transposed copy of K
    lse = 4 * a * s * b
    assert scores - lse <= materialized - flash <= scores - lse + 2 * s * b * h * 4


def test_zero3_prefetch_model():
    g, f, b, r = 3.0, 2.0, 4.0, 1.0
    assert memory.zero3_step_seconds(g, f, b, r, 4, False) == 4 * (2 * g + f + b + r)
    on = memory.zero3_step_seconds(g, f, b, r, 4, True)
    assert on == (g + 3 * g + f) + (g + 3 * (b + r) + b + r)
    # with free communication, prefetch or not, the step is its compute and reduce-scatters
    assert memory.zero3_step_seconds(0, f, b, r, 4, True) == \
        memory.zero3_step_seconds(0, f, b, r, 4, False) == 4 * (f + b + r)


# ---- ZeRO-3 prefetch ------------------------------------------------------------------------------

def _zero3_prefetch_run(rank, world_size, prefetch):
    from distlab import models
    from distlab.sharding import ZeRO
    model = models.make_mlp((5, 7, 6, 3), seed=1)
    x, y = models.regression_data(n=12, in_dim=5, out_dim=3, seed=2)
    zero = ZeRO(model, 3, optimizer="adam", lr=0.1, prefetch=prefetch)
    for _ in range(2):
        zero.zero_grad()
        F.mse_loss(model(x.chunk(world_size)[rank]), y.chunk(world_size)[rank]).backward()
        zero.step()
    return zero.full_parameters(), dict(zero.sent)


def test_zero3_prefetch_is_bit_identical_and_gathers_ahead():
    import distlab
    off = distlab.run(_zero3_prefetch_run, 3, False, trace=True)
    on = distlab.run(_zero3_prefetch_run, 3, True, trace=True)
    for rank in range(3):
        assert all(torch.equal(u, v) for u, v in zip(off[rank][0], on[rank][0]))
        assert off[rank][1] == on[rank][1]          # the same bytes, only earlier
    gathers = on.trace.comm(0, "all_gather")
    # per step: 3 layers x 2 tensors gathered in forward and again in backward; all but the
    # first layer in each direction are prefetched: launched async, waited for a layer later
    # (the trace marks async a call with other work between its launch and its wait, so a
    # layer's last tensor, waited right after the one before it, may read as not async)
    assert len(gathers) == 2 * 2 * 3 * 2 + 6        # + full_parameters() at the end
    assert sum(e["async_op"] for e in gathers) >= 2 * 2 * 2
    assert not any(e["async_op"] for e in off.trace.comm(0, "all_gather"))


def test_prefetch_needs_stage_3():
    import distlab

    def build(rank, world_size):
        from distlab import models
        from distlab.sharding import ZeRO
        try:
            ZeRO(models.make_mlp((2, 2), seed=0), 2, prefetch=True)
        except ValueError as e:
            return str(e)
    assert "only stage 3" in distlab.run(build, 2)[0]


# ---- peak memory and Llama's activations (distlab.zero_memory) --------------------------------

def _notebook(name):
    import pathlib

    import nbformat
    path = pathlib.Path(__file__).resolve().parent.parent / "notebooks" / name
    cells = nbformat.read(path, as_version=4).cells
    prose = "\n".join(c.source for c in cells if c.cell_type == "markdown")
    outputs = "\n".join(o.get("text", "") for c in cells if c.cell_type == "code"
                        for o in c.get("outputs", []))
    return " ".join(prose.split()), outputs


def test_llama_count_is_what_a_llama_block_saves():
    from distlab import zero_memory
    s, h, a, f = 64, 32, 4, 88
    for dtype in (torch.float32, torch.bfloat16):
        block = zero_memory.LlamaBlock(h, a, f, dtype=dtype)
        x = torch.randn(1, s, h, dtype=dtype, requires_grad=True)
        cos, sin = zero_memory.rotary_tables(s, h // a, dtype)
        tables = cos.untyped_storage().nbytes() + sin.untyped_storage().nbytes()
        counted = sum(zero_memory.llama_activations(s, 1, h, a, f, dtype.itemsize).values())
        assert _saved_bytes(block, x, cos, sin) - tables == counted
        for kv in (2, 1):           # grouped-query attention: K and V shrink, nothing repeated
            gqa = zero_memory.LlamaBlock(h, a, f, dtype=dtype, kv_heads=kv)
            counted = sum(zero_memory.llama_activations(s, 1, h, a, f, dtype.itemsize,
                                                        kv_heads=kv).values())
            assert _saved_bytes(gqa, x, cos, sin) - tables == counted
    # in bf16 at Llama-2 7B's shape: 32 + 8·ffn/hidden bytes per token and hidden unit
    L2 = zero_memory.LLAMA2_7B
    per = sum(zero_memory.llama_activations(4096, 1, L2["hidden"], L2["heads"], L2["ffn"]).values())
    assert per == 4096 * (L2["hidden"] * (32 + 8 * L2["ffn"] / L2["hidden"]) + 8 + 4 * L2["heads"])
    assert zero_memory.llama_activations(4096, 2, 4096, 32, 11008, recompute="full") == \
        {"block input (the rest is recomputed)": 2 * 4096 * 2 * 4096}
    with pytest.raises(ValueError, match="flash attention already recomputes"):
        zero_memory.llama_activations(4096, 1, 4096, 32, 11008, recompute="selective")


def test_the_fused_norm_keeps_its_input_in_its_dtype_and_rstd():
    # FusedRmsNormBackward0 saves input, weight (a parameter) and result1 (1/rms, float32 per
    # row): the two norms keep 2·(v·s·b·h + 4·s·b) instead of 2·(2·4·s·b·h + 4·s·b)
    from distlab import zero_memory
    s, b, h, a, f = 512, 2, 256, 4, 688
    for v in (2, 4):
        comp = zero_memory.llama_activations(s, b, h, a, f, v)
        fused = zero_memory.llama_activations(s, b, h, a, f, v, norm="fused")
        assert sum(comp.values()) - sum(fused.values()) == 2 * (2 * 4 - v) * s * b * h
        assert fused["RMSNorm (fused): input in its dtype, 1/rms in float32 (two norms)"] == \
            2 * (v * s * b * h + 4 * s * b)
    assert zero_memory.llama_activations(s, b, h, a, f, recompute="full", norm="fused") == \
        zero_memory.llama_activations(s, b, h, a, f, recompute="full")
    with pytest.raises(ValueError, match="norm must be one of"):
        zero_memory.llama_activations(s, b, h, a, f, norm="apex")


def test_zero3_peak_walks_the_moments():
    from distlab import zero_memory
    u = dict(weights=10.0, grad=10.0, grad_shard=5.0, acts=1.0)
    # no prefetch: backward of unit 0 = states + 2 shards + 10 + 10 + one flowing gradient
    off = zero_memory.zero3_peak([u, u], 100.0, False, flowing=0.5, loss=3.0)
    assert off["moment"] == "backward, unit 0" and off["peak"] == 100 + 10 + 10 + 10 + 0.5
    # prefetch: backward of unit 1 holds unit 0's weights too, one shard, unit 0's acts
    on = zero_memory.zero3_peak([u, u], 100.0, True, flowing=0.5, loss=3.0)
    assert on["moment"] == "backward, unit 1" and on["peak"] == 100 + 5 + 1 + 20 + 10 + 1.0
    # big activations: the last forward holds them all and its weights; a big loss, the turn
    big = dict(u, acts=50.0)
    last = zero_memory.zero3_peak([big, big], 100.0, True, flowing=0.5, loss=3.0)
    assert last["moment"] == "forward, unit 1" and last["peak"] == 100 + 100 + 10
    turn = zero_memory.zero3_peak([big, big], 100.0, True, flowing=0.5, loss=30.0)
    assert turn["moment"] == "the turn (loss backward)" and turn["peak"] == 100 + 100 + 30 + 0.5


def test_unequal_units_reduce_to_the_equal_layer_model():
    from distlab import zero_memory
    g, f, b, r = 3.0, 2.0, 4.0, 1.0
    units = [dict(gather=g, forward=f, backward=b, reduce_scatter=r)] * 4
    for prefetch in (False, True):
        assert zero_memory.zero3_units_seconds(units, prefetch) == \
            memory.zero3_step_seconds(g, f, b, r, 4, prefetch)
    # compute after a unit (attention) adds to its own span: hidden or not by the next gather
    u2 = [dict(gather=1.0, forward=1.0, backward=2.0, reduce_scatter=0.5, forward_after=3.0,
               backward_after=0.25), dict(gather=2.0, forward=1.0, backward=2.0,
                                          reduce_scatter=0.5)]
    assert zero_memory.zero3_units_seconds(u2, True) == \
        1.0 + max(4.0, 2.0) + 1.0 + 2.0 + (max(2.0, 1.0) + 0.5) + (2.0 + 0.5 + 0.25)


def test_peak_tracker_follows_frees_and_resizes():
    from distlab import zero_memory
    keep = torch.empty(1000)                     # 4000 B, held from the start
    with zero_memory.PeakTracker([keep]) as t:
        a = torch.empty(2000).add_(1)            # + 8000
        del a                                    # freed
        b = torch.zeros(500)                     # + 2000
        keep.untyped_storage().resize_(0)        # - 4000 (as ZeRO-3 frees a parameter)
        c = torch.ones(3000)                     # + 12000
        del b, c
    assert t.baseline == 4000 and t.peak == 14000


def _zero3_peak_run(rank, world_size, prefetch):
    from distlab import models, zero_memory
    from distlab.sharding import ZeRO
    d, tokens = 256, 16
    model = models.make_mlp((d,) * 4, seed=0)
    x, y = models.regression_data(n=tokens * world_size, in_dim=d, out_dim=d, seed=0)
    zero = ZeRO(model, 3, optimizer="adam", lr=1e-3, prefetch=prefetch)
    xs, ys = x.chunk(world_size)[rank].clone(), y.chunk(world_size)[rank].clone()
    for _ in range(2):
        zero.zero_grad()
        held = [*model.parameters(), *zero.shards, xs, ys,
                *(v for st in zero.optimizer.state.values() for v in st.values())]
        with zero_memory.PeakTracker(held) as t:
            F.mse_loss(model(xs), ys).backward()
        zero.step()
    return t.baseline, t.peak


def test_course_zero3_peak_is_the_count():
    # The course's ZeRO-3 gathers into the parameter itself and reduce-scatters from the
    # gradient itself (no extra full-size copies): its tracked peak is zero3_peak's.
    import distlab
    from distlab import zero_memory
    d, tokens = 256, 16
    w = (d * d + d) * 4
    units = [dict(weights=w, grad=w, grad_shard=w / 2, acts=tokens * d * 4)] * 3
    res = distlab.run(_zero3_peak_run, 2, True)
    for baseline, peak in res:
        model = zero_memory.zero3_peak(units, baseline, True, flowing=tokens * d * 4)
        assert abs(model["peak"] / peak - 1) < 0.002


def test_chapter_06_prose_numbers_are_computed():
    from distlab import hardware, zero_memory
    from distlab.emulate import PRESETS
    # the accounting and the peak are chapter 06's; prefetch and the published run, 06b's
    prose, outputs = _notebook("06_memory_and_zero.ipynb")
    prose_b, outputs_b = _notebook("06b_zero3_at_scale.ipynb")
    L2 = zero_memory.LLAMA2_7B
    h, a, f = L2["hidden"], L2["heads"], L2["ffn"]
    per = sum(zero_memory.llama_activations(2048, 1, h, a, f).values()) / (2048 * h)
    assert f"{per:.1f} bytes per token and hidden unit" in prose
    assert f"{per:.1f}·s·b·h for an eager Llama-2 7B block" in prose
    fused = sum(zero_memory.llama_activations(2048, 1, h, a, f, norm="fused").values()) / (2048 * h)
    assert per - fused == 12 and f"On a GPU, with the fused norm, it is {fused:.1f}" in prose
    assert f"{fused:.1f}·s·b·h on a GPU where `nn.RMSNorm` is fused" in prose

    def gb(x):
        return f"{x / memory.GB:.1f} GB"

    def steady(n, recompute):
        states = memory.model_state_bytes(zero_memory.llama_params(**L2), zero_stage=3,
                                          world_size=n)
        acts = L2["layers"] * sum(zero_memory.llama_activations(4096, 1, h, a, f,
                                                                recompute=recompute).values())
        return sum(states.values()) + acts
    p8, p8f = (zero_memory.llama_zero3_peak(8, 4096, recompute=r) for r in ("none", "full"))
    p64f = zero_memory.llama_zero3_peak(64, 4096, recompute="full")
    assert f"{p8['parts']['saved activations'] / memory.GB:.1f} GB of saved activations" in prose
    assert f"({p8['parts']['loss: logits and their gradient'] / memory.GB:.2f} GB)" in prose
    assert f"{gb(p8['peak'])} on 8 GPUs" in prose
    assert f"steady state ({gb(steady(8, 'none'))})" in prose
    assert p8["moment"] == "the turn (loss backward)" and p8["peak"] < steady(8, "none")
    assert f"peak is {gb(p8f['peak'])} against a steady {gb(steady(8, 'full'))[:-3]}" in prose
    assert f"on 64 GPUs {gb(p64f['peak'])} against {gb(steady(64, 'full'))[:-3]}" in prose
    assert f"{p64f['peak'] / steady(64, 'full'):.1f}× the steady state" in prose
    parts = p64f["parts"]
    for key in ("gathered weights", "full gradient before reduce-scatter", "recompute working set"):
        assert f"({parts[key] / memory.GB:.2f} GB)" in prose, key
    assert f"{gb(p64f['peak'])} at the peak, {gb(steady(64, 'full'))} at rest" in prose
    # the prefetch threshold and the links
    hide = {p: zero_memory.hiding_tokens(PRESETS[p], n)
            for p, n in (("h100-node", 8), ("h100-2x8", 16), ("h100-ib", 2), ("h100-cluster", 64))}
    assert hide["h100-node"] == hide["h100-2x8"] == hide["h100-cluster"] == 2048
    assert hide["h100-ib"] == 8192 and "needs 8192 tokens per GPU" in prose_b
    assert "hide from 2048 tokens per GPU on" in prose_b and "about 2048 tokens per GPU" in prose_b
    assert PRESETS["h100-2x8"].link_between(range(16)).bandwidth == 370e9 == \
        PRESETS["h100-node"].intra.bandwidth
    assert PRESETS["h100-ib"].link_between([0, 1]).bandwidth == 47e9
    assert "370 GB/s either way" in prose_b and "gets 47 GB/s" in prose_b
    # the published run beside the closed form
    llama3_8b = hardware.Transformer(32, 4096, 32, 14336, 128256, 8, True)
    titan = hardware.step_seconds(llama3_8b, PRESETS["a100-cluster"], 64, 64, 8192,
                                  recompute="selective-op", fsdp=True, fused=False)
    assert "2,973 tokens/s per GPU" in prose_b
    assert f"model {64 * 8192 / titan['step'] / 64:,.0f}" in outputs_b
    assert titan["dp"] < titan["step"]
    # the emulated and CPU numbers the prose quotes are the stored outputs (nbval re-runs them)
    import re
    ratios = re.findall(r"off/on: emulated (\d\.\d\d), closed form (\d\.\d\d)", outputs_b)
    assert len(ratios) == 2
    (e1, m1), (e2, m2) = ratios
    assert f"off/on {e1} against {m1} inside a node, {e2} against {m2} across nodes" in prose_b
    assert f"about {float(e1) - 1:.0%}".replace("%", " %") in prose_b
    assert outputs.count("within 2e-03: True") == 2 and "within 0.2 %" in prose
    assert outputs.count("NOT within 2e-03") == 2 and "tracked peak is higher" in prose


def test_the_widget_counts_llama_as_the_chapter_does():
    # memory_calculator draws memory.per_gpu_bytes: its Llama-2 presets count a Llama block
    # (zero_memory.llama_activations), the number chapter 06 prints for 32 blocks at seq 4096
    from distlab import zero_memory
    L2 = zero_memory.LLAMA2_7B
    h, a, f = L2["hidden"], L2["heads"], L2["ffn"]
    assert memory.LLAMA_FFN["Llama-2 7B"] == f
    for seq, recompute in ((4096, "none"), (2048, "full"), (4096, "full")):
        widget = memory.per_gpu_bytes("Llama-2 7B", zero_stage=3, world_size=8, seq_len=seq,
                                      checkpointing=recompute)["activations"]
        assert widget == 32 * sum(zero_memory.llama_activations(seq, 1, h, a, f,
                                                                recompute=recompute).values())
    widget = memory.per_gpu_bytes("Llama-2 7B", seq_len=4096)["activations"]
    _, outputs = _notebook("06_memory_and_zero.ipynb")
    assert (f"Llama-2 7B, 32 blocks, seq 4096, recompute none: activations "
            f"{widget / memory.GB:5.1f} GB") in outputs
    # not the GPT block's count any more (34·s·b·h + the log-sum-exp)
    assert widget != memory.activation_bytes(4096, 1, h, 32, a)
    # flash's selective changes nothing; materialized scores replace the log-sum-exp
    kw = dict(seq_len=2048, micro_batch=2)
    flash = memory.preset_activation_bytes("Llama-2 13B", **kw)
    assert memory.preset_activation_bytes("Llama-2 13B", checkpointing="selective",
                                          attention="materialized", **kw) == flash
    assert memory.preset_activation_bytes("Llama-2 13B", attention="materialized", **kw) == \
        flash + 40 * (2 * 40 * 2048 ** 2 * 2 - 4 * 40 * 2048 * 2)
    # the 70B preset is a Llama block with grouped-query attention (8 K/V heads), as the prose says
    assert memory.preset_activation_bytes("Llama-2 70B") == 80 * sum(
        zero_memory.llama_activations(2048, 1, 8192, 64, 28672, kv_heads=8).values())
    assert memory.preset_activation_bytes("Llama-2 70B") < 80 * sum(
        zero_memory.llama_activations(2048, 1, 8192, 64, 28672).values())
    prose, _ = _notebook("06_memory_and_zero.ipynb")
    assert "it counts the three Llama-2 models with Llama's own block" in prose
    assert "70B with its grouped-query attention, 8 K/V heads for 64 query heads" in prose
    with pytest.raises(ValueError, match="recompute must be one of"):
        memory.preset_activation_bytes("Llama-2 7B", checkpointing="half")
    # the step's peak the widget draws: where the course counts it, and only there
    kw = dict(precision="bf16-mixed", optimizer="adam", zero_stage=3, world_size=64,
              seq_len=4096, micro_batch=1, checkpointing="full", attention="flash")
    assert zero_memory.preset_zero3_peak("Llama-2 7B", **kw) == \
        zero_memory.llama_zero3_peak(64, 4096, recompute="full")["peak"]
    assert zero_memory.preset_zero3_peak("Llama-2 13B", **dict(kw, checkpointing="selective")) \
        == zero_memory.llama_zero3_peak(64, 4096, shape=zero_memory.LLAMA2_13B)["peak"]
    for model, change in (("GPT-3 175B", {}), ("Llama-2 70B", {}), ("Llama-2 7B", {"zero_stage": 2}),
                          ("Llama-2 7B", {"attention": "materialized"})):
        assert zero_memory.preset_zero3_peak(model, **dict(kw, **change)) is None
    assert "and the widget draws it, a dotted line, for ZeRO-3 of the Llama-2 7B and 13B" in prose


def test_bytes_per_parameter_conventions():
    from distlab import zero_memory
    got = {k: zero_memory.convention_bytes(k) for k in zero_memory.CONVENTIONS}
    assert got == {"ZeRO paper / distlab.memory": 16, "Megatron-LM (bf16)": 18,
                   "PyTorch AMP (torch.autocast)": 16, "FSDP2, bf16 params, fp32 reduce": 16}
    assert got["ZeRO paper / distlab.memory"] == sum(memory.bytes_per_parameter().values())
    prose, outputs = _notebook("06_memory_and_zero.ipynb")
    megatron = got["Megatron-LM (bf16)"]
    assert f"Megatron's {megatron} B/param is {(megatron / 16 - 1) * 100:.1f} % more" in prose
    for name, total in got.items():          # the table the chapter prints
        assert f"{name:32} {total:2} B/param" in outputs


def test_the_prefetch_figure_says_what_the_prose_says():
    import re
    prose, outputs = _notebook("06b_zero3_at_scale.ipynb")
    found = re.search(r"prefetch off -> on: forward (\d+\.\d) -> (\d+\.\d) ms, backward "
                      r"(\d+\.\d) -> (\d+\.\d) ms", outputs)
    f0, f1, b0, b1 = map(float, found.groups())
    assert f1 < f0 and b1 < b0 and f0 - f1 > b0 - b1        # "in backward the gain is smaller"
    assert "In backward the gain is smaller" in prose
    # the two halves add up to the emulated step the table above prints for h100-ib
    on = re.search(r"h100-ib   x2: prefetch off (\d+\.\d\d) ms, on (\d+\.\d\d) ms", outputs)
    assert abs(f0 + b0 - float(on.group(1))) < 0.15 and abs(f1 + b1 - float(on.group(2))) < 0.15


# ---- chapter 06b §5: HSDP priced (distlab.hsdp_cost) -----------------------------------------

def test_hsdp_cost_prices_what_each_layout_sends():
    import dataclasses
    from distlab import hsdp_cost
    from distlab.hardware import PRESETS
    eight = PRESETS["h100-cluster"]
    one = dataclasses.replace(eight, nics_per_node=1)
    p, units = 8e9, 10
    # one node: HSDP is FSDP, nothing on the network
    c = hsdp_cost.step_comm(eight, p, 1, units)
    assert c["fsdp"]["total"] == pytest.approx(c["hsdp"]["total"])
    assert c["fsdp"]["network"] == c["hsdp"]["network"] == 0
    for nodes in (2, 8):
        n = 8 * nodes
        c = hsdp_cost.step_comm(eight, p, nodes, units)
        # FSDP's ring edge out of a node: (N-1)/N of two bf16 gathers and a bf16 reduce-scatter
        assert c["fsdp"]["network_bytes"] == pytest.approx(6 * p * (n - 1) / n)
        # HSDP: 8 rings, each an all-reduce of 1/8 of the bf16 gradient over the nodes
        assert c["hsdp"]["network_bytes"] == pytest.approx(2 * (nodes - 1) / nodes * 2 * p)
        inside = hsdp_cost.step_comm(eight, p, 1, units)["fsdp"]["total"]
        assert c["hsdp"]["nvlink"] == pytest.approx(inside)
        # with one NIC a node the 8 replica groups share it: the all-reduce's bytes take 8x longer
        lat = units * eight.link_between(range(0, n, 8)).seconds("all_reduce", 0, nodes)
        slow = hsdp_cost.step_comm(one, p, nodes, units)["hsdp"]["all_reduce"] - lat
        assert slow == pytest.approx(8 * (c["hsdp"]["all_reduce"] - lat), rel=1e-9)
        # and FSDP's whole ring runs at one NIC's rate
        assert hsdp_cost.step_comm(one, p, nodes, units)["fsdp"]["total"] > 6 * c["fsdp"]["total"]
    held = hsdp_cost.state_bytes(p, 4)
    assert held == {"fsdp": pytest.approx(16 * p / 32), "hsdp": pytest.approx(16 * p / 8)}
    with pytest.raises(ValueError, match="nodes >= 1"):
        hsdp_cost.step_comm(eight, p, 0, units)


def test_06b_hsdp_prose_numbers_are_computed():
    """§5's reading quotes these: FSDP shorter than HSDP to 32 nodes on 8 NICs, longer at 128;
    with one NIC a node HSDP cuts the step by a quarter to a half; its gathers hide from ~1,900."""
    import dataclasses
    from distlab import hsdp_cost, zero_memory
    from distlab.hardware import H100, PRESETS
    l2 = zero_memory.LLAMA2_7B
    p = zero_memory.llama_params(**l2)
    rate = H100.peak(torch.bfloat16) * H100.gemm_efficiency(8192, 8192, 8192)
    eight = PRESETS["h100-cluster"]
    one = dataclasses.replace(eight, nics_per_node=1)
    nodes, units = (2, 8, 32, 128), l2["layers"] + 2
    rows8 = {r["nodes"]: r for r in hsdp_cost.table(eight, p, nodes, units, rate)}
    rows1 = {r["nodes"]: r for r in hsdp_cost.table(one, p, nodes, units, rate)}
    assert all(rows8[n]["fsdp_total"] < rows8[n]["hsdp_total"] for n in (2, 8, 32))
    assert rows8[128]["fsdp_total"] > rows8[128]["hsdp_total"]
    assert round(rows8[128]["fsdp_hide"], -2) == 4500
    assert all(0.25 < 1 - rows1[n]["hsdp_total"] / rows1[n]["fsdp_total"] < 0.55 for n in rows1)
    assert all(0.8 < rows1[n]["fsdp_total"] < 1.0 for n in rows1)
    assert all(16000 <= round(rows1[n]["fsdp_hide"], -3) <= 19000 for n in rows1)
    assert all(round(r["hsdp_hide"], -2) == 1900 for r in rows8.values())


def test_06b_offload_prose_numbers_are_computed():
    """§4's CPU-offload reading and the summary quote these: states 108/208 GB on one H100 (no
    fit), 13.5/26 GB on 8 and 1.7/3.3 GB on 64; 7B on 8 GPUs: 10 GB over PCIe in 0.18 s against
    0.47 s of compute, Adam 32.5 s (torch) and 4.8 s (DeepSpeed), about 70x and 10x the compute;
    on 64 GPUs 4.1 and 0.6 s. 12 bytes a parameter of the shard cross PCIe a step."""
    from distlab import hardware, offload_cost, zero_memory
    from distlab.hardware import PRESETS
    got = {}
    for name, shape in (("7B", zero_memory.LLAMA2_7B), ("13B", zero_memory.LLAMA2_13B)):
        model = hardware.Transformer(**shape, glu=True)
        for n in (1, 8, 64):
            cluster = PRESETS["h100-node" if n <= 8 else "h100-cluster"]
            compute = hardware.step_seconds(model, cluster, n, global_batch=n, seq_len=4096,
                                            recompute="full", fsdp=True, fused=False)["step"]
            got[name, n] = offload_cost.step(zero_memory.llama_params(**shape), n, compute)
    assert [round(got[m, n]["states_gb"], 1) for m in ("7B", "13B") for n in (8, 64)] == \
        [13.5, 1.7, 26.0, 3.3]
    assert round(got["7B", 1]["states_gb"]) == 108 and round(got["13B", 1]["states_gb"]) == 208
    assert [got[m, n]["fits"] for m in ("7B", "13B") for n in (1, 8, 64)] == [False, True, True] * 2
    r = got["7B", 8]
    assert round(r["pcie_gb"]) == 10 and round(r["pcie_s"], 2) == 0.18
    assert round(r["compute_s"], 2) == 0.47
    assert round(r["adam_torch_s"], 1) == 32.5 and round(r["adam_ds_s"], 1) == 4.8
    assert round(r["adam_torch_s"] / r["compute_s"], -1) == 70
    assert round(r["adam_ds_s"] / r["compute_s"], -1) == 10
    r64 = got["7B", 64]
    assert round(r64["adam_torch_s"], 1) == 4.1 and round(r64["adam_ds_s"], 1) == 0.6
    moved = offload_cost.pcie_bytes(8e9, 8)
    assert moved["h2d"] + moved["d2h"] == 12 * 8e9 / 8
