"""Checkers for chapter 02, the collectives.

Exercise 1 (predict an MoE dispatch) is a plain single-process function, compared with what the
real all-to-all gives on real ranks. The others run on real ranks, on SUBGROUPS: 4 ranks as two
groups of 2, and 5 ranks as groups {0, 2} and {1, 3, 4} (ranks that are not 0..k), so code that
talks to the whole world, or asks the world its size, gets other ranks' data and is refused.
Every rank's data is drawn afresh for each check and handed to that rank only: a right answer
proves that the data travelled. The trace then says on which group, by which calls and how many
bytes: reduce-scatter from all-to-all, an uneven all-gather without the object collectives, and a
broadcast whose gradient autograd sees.
"""
import random
import re

import torch
import torch.distributed as dist

from ..launch import RunTimeout
from . import (CheckFailed, RankFailed, _traffic, call_learner, compare, forbid, passed, run,
               run_learner)
from .ch01 import learner_run, no_object_collectives, refusing

TIMEOUT = 20  # a learner's hang is reported, with where each rank waits, within this

# (world size, the groups it is split into): every rank creates every group, in this order.
LAYOUTS = ((4, ((0, 1), (2, 3))), (5, ((0, 2), (1, 3, 4))))


def _layout_phrase():
    return " and ".join(f"{ws} ranks as groups " + ", ".join("{" + ", ".join(map(str, g)) + "}"
                                                             for g in groups)
                        for ws, groups in LAYOUTS)


def _my_group(rank, groups):
    """Every rank creates every group, in the same order; returns (its group, its ranks)."""
    made = [dist.new_group(list(g)) for g in groups]
    for g, ranks in zip(made, groups):
        if rank in ranks:
            return g, ranks
    raise AssertionError(f"rank {rank} is in no group of {groups}")


def _group_of(rank, groups):
    return next(g for g in groups if rank in g)


def _fresh_seed():
    return random.SystemRandom().randrange(1 << 30)


def _check_traffic(trace, world_size, groups, name, allowed=None, max_bytes=None):
    """Every message of every rank stays in its group: collectives on exactly that group, sends
    and receives with its members; `allowed` limits the collectives, `max_bytes(rank)` what the
    rank may put on the wire, counted by the checkers' one traffic rule (`_traffic`: a message
    its size, a collective its ring share, so send/recv of the same bytes count the same). At
    least one message per rank of a group of two or more."""
    for rank in range(world_size):
        ranks = _group_of(rank, groups)
        context = f"{name} with {world_size} ranks, rank {rank} (its group is {list(ranks)})"
        calls = _traffic.data_calls(_traffic.records(trace, rank))
        for c in calls:
            bad, _ = _traffic.off_group([c], ranks)
            if bad is not None and c["kind"] in _traffic.P2P:
                raise CheckFailed(f"{context}: its {c['op']} went to rank {c['peer']}, outside "
                                  f"the group; use the group you were given.")
            if bad is not None:
                raise CheckFailed(f"{context}: its {c['op']} ran over ranks {list(c['group'])}; "
                                  f"pass group= to every collective.")
            if allowed is not None and c["kind"] == "collective" and c["op"] not in allowed:
                raise CheckFailed(f"{context}: the values are right, but it called {c['op']}; "
                                  f"the exercise allows only {' and '.join(allowed)} (or "
                                  f"send/recv of the same bytes) and local arithmetic.")
        if len(ranks) > 1 and not calls:
            raise CheckFailed(f"{context}: the values are right without a message; they must "
                              f"travel from the other ranks.")
        sent = _traffic.wire(calls)
        if max_bytes is not None and sent > max_bytes(rank) + 1e-9:
            raise CheckFailed(f"{context}: the values are right, but it put {sent:g} bytes on "
                              f"the wire where {max_bytes(rank):g} (its own tensor, once, less "
                              f"the chunk it keeps) suffice.")


def _rank_failed_sentence(e, context):
    """gloo's own words, minus the C++ file name, for a collective gloo refused."""
    said = re.sub(r"\[[^\]]*\.(cc|cpp|h):\d+\] ", "", str(e).splitlines()[0])
    said = said.split(". ")[0].rstrip(".")
    return f"{context} failed: {said} (a collective needs the same shapes on every rank)."


# ---- exercise 1: predict an MoE dispatch ------------------------------------------------------

# (world size, tokens per rank, destinations): "sorted" already sorted and the same number to every
# rank (the obvious case), "random" any order, "skewed" a rank that gets nothing, one that gets most.
DISPATCH_CASES = ((2, (4, 4), "sorted"), (3, (5, 0, 7), "random"), (4, (6, 3, 5, 4), "skewed"),
                  (4, (8, 8, 8, 8), "sorted"), (3, (6, 6, 6), "random"))


def dispatch_inputs(case):
    """(tokens, dest): per rank, its tokens (values that say where they were born) and the rank
    each token goes to."""
    ws, counts, kind = case
    g = torch.Generator().manual_seed(ws * 100 + sum(counts))
    tokens, dest = [], []
    for r, n in enumerate(counts):
        tokens.append(torch.arange(float(n)) + 100 * (r + 1))
        if kind == "sorted":
            d = torch.arange(ws).repeat_interleave(n // ws)
        elif kind == "skewed":
            d = torch.where(torch.rand(n, generator=g) < 0.7, torch.tensor(ws - 1),
                            torch.randint(0, ws - 2, (n,), generator=g))
        else:
            d = torch.randint(0, ws, (n,), generator=g)
        dest.append(d)
    return tokens, dest


def _real_dispatch(rank, world_size, cases):
    """What the ranks really receive: each sorts its tokens by destination (stable), tells every
    rank how many it sends, and all_to_all_single moves them."""
    out = []
    for case in cases:
        tokens, dest = dispatch_inputs(case)
        t, d = tokens[rank], dest[rank]
        order = torch.argsort(d, stable=True)
        send_counts = torch.bincount(d, minlength=world_size)
        recv_counts = torch.empty_like(send_counts)
        dist.all_to_all_single(recv_counts, send_counts)
        received = torch.empty(int(recv_counts.sum()))
        dist.all_to_all_single(received, t[order], recv_counts.tolist(), send_counts.tolist())
        out.append(received)
    return out


_REAL = {}


def real_dispatch(world_size):
    """{case: [what each rank received]} for the cases of this world size, run once per process."""
    if world_size not in _REAL:
        cases = [c for c in DISPATCH_CASES if c[0] == world_size]
        per_rank = run(_real_dispatch, world_size, cases, timeout=60)
        _REAL[world_size] = {case: [per_rank[r][i] for r in range(world_size)]
                             for i, case in enumerate(cases)}
    return _REAL[world_size]


def check_predict_dispatch(fn):
    """fn(tokens, dest) -> per rank, the tokens it receives: from rank 0 first, then rank 1, ...,
    each sender's tokens in their original order."""
    name = getattr(fn, "__name__", "predict_dispatch")
    for case in DISPATCH_CASES:
        ws, counts, kind = case
        tokens, dest = dispatch_inputs(case)
        with refusing(real_dispatch, _real_dispatch, dispatch_inputs,
                      exercise="predict the dispatch by reasoning about the data, in one process"):
            got = call_learner(fn, [t.clone() for t in tokens], [d.clone() for d in dest],
                               name=name)
        expected = real_dispatch(ws)[case]
        context = f"{name} with {ws} ranks holding {', '.join(map(str, counts))} tokens ({kind})"
        if not isinstance(got, (list, tuple)) or len(got) != ws:
            raise CheckFailed(f"{context}: return a list of {ws} tensors, one per rank; got "
                              f"{type(got).__name__}"
                              f"{f' of {len(got)}' if isinstance(got, (list, tuple)) else ''}.")
        for rank in range(ws):
            compare(got[rank], expected[rank], f"{context}, what rank {rank} receives",
                    atol=0, rtol=0)
    passed(f"{name} predicts what every rank receives in {len(DISPATCH_CASES)} dispatches on 2 to "
           f"4 ranks (uneven, empty and skewed included), checked against the real all-to-all.")


# ---- exercise 2: reduce_scatter built from all_to_all ------------------------------------------

def _draw(world_size, groups, seed, per_chunks=(1, 3)):
    """Per rank, per chunk size: a tensor of len(group) * per_chunk small integers (as floats)."""
    g = torch.Generator().manual_seed(seed)
    return [[torch.randint(-50, 50, (len(_group_of(r, groups)) * k,), generator=g).float()
             for k in per_chunks] for r in range(world_size)]


def _reduce_scatter_on_ranks(rank, world_size, fn, groups, xs):
    from ..collectives import ring_all_reduce, ring_reduce_scatter
    group, _ = _my_group(rank, groups)
    mine = xs[rank]
    del xs
    with forbid(ring_reduce_scatter, ring_all_reduce, _draw,
                exercise="build reduce_scatter from all_to_all yourself"):
        return [fn(x.clone(), group) for x in mine]


def check_reduce_scatter_from_all_to_all(fn):
    """fn(x, group) runs on every rank of `group` with its 1-D tensor; returns this rank's chunk of
    the group's sum, built with all_to_all and local arithmetic only."""
    name = getattr(fn, "__name__", "reduce_scatter_from_all_to_all")
    for ws, groups in LAYOUTS:
        xs = _draw(ws, groups, _fresh_seed())
        got = learner_run(_reduce_scatter_on_ranks, ws, fn, groups, xs, name=name,
                          hang_rule="every rank of a group must call the same all_to_all, on "
                          "that group, with tensors of the same size.")
        for rank in range(ws):
            ranks = _group_of(rank, groups)
            me = ranks.index(rank)
            for i, x in enumerate(xs[rank]):
                total = sum(xs[r][i] for r in ranks)
                compare(got[rank][i], total.chunk(len(ranks))[me],
                        f"{name} with {ws} ranks, rank {rank} (group {list(ranks)}, x of "
                        f"{x.numel()} elements)", atol=0, rtol=0)
        # what a rank must send: the other members' chunks of its x, once
        _check_traffic(got.trace, ws, groups, name, allowed=("all_to_all",),
                       max_bytes=lambda r: sum(x.numel() * x.element_size() for x in xs[r])
                       * (len(_group_of(r, groups)) - 1) / len(_group_of(r, groups)))
    passed(f"{name} gives every rank its chunk of its group's sum ({_layout_phrase()}), with "
           f"all_to_all on the group and a local sum.")


# ---- exercise 3: all_gather for tensors of different lengths ----------------------------------

def _uneven_draw(world_size, groups, seed):
    """Per rank a 1-D tensor of its own length: every group has one empty rank or one of length 1,
    and its longest rank is not its last."""
    rng = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    lengths = [rng.randrange(1, 8) for _ in range(world_size)]
    for ranks in groups:
        lengths[ranks[0]] = max(lengths[r] for r in ranks) + rng.randrange(1, 3)
        lengths[ranks[-1]] = rng.choice((0, 1))
    return [torch.randn(n, generator=g) for n in lengths]


def _run_uneven(rank, world_size, fn, groups, inputs):
    group, _ = _my_group(rank, groups)
    mine = inputs[rank].clone()
    del inputs
    with forbid(_uneven_draw, exercise="write the uneven all-gather yourself"), \
            no_object_collectives("gather the tensors themselves with tensor collectives (share "
                                  "the lengths, pad, all_gather, trim)"):
        return fn(mine, group)


def check_all_gather_uneven(fn):
    """fn(tensor, group) runs on every rank; returns the list of every group member's 1-D tensor,
    in group order."""
    name = getattr(fn, "__name__", "all_gather_uneven")
    for ws, groups in LAYOUTS:
        inputs = _uneven_draw(ws, groups, _fresh_seed())
        lengths = ", ".join(str(t.numel()) for t in inputs)
        context = f"{name} with {ws} ranks (lengths {lengths} by rank)"
        try:
            got = run_learner(_run_uneven, ws, fn, groups, inputs, name=name, timeout=TIMEOUT,
                              trace=True)
        except RunTimeout as e:
            stuck = "; ".join(line.strip() for line in str(e).splitlines()[1:1 + ws])
            raise CheckFailed(f"{context} hung: {stuck} (a collective needs the same shapes on "
                              f"every rank of its group).") from None
        except RankFailed as e:
            if e.exc_type is None:   # gloo itself aborted the process on mismatched sizes
                died = str(e).splitlines()[0].rstrip(".")
                raise CheckFailed(f"{context} failed: {died} (gloo aborts when the sizes of a "
                                  f"collective differ between ranks: a collective needs the same "
                                  f"shapes on every rank).") from None
            if e.exc_type != "RuntimeError":
                raise  # a bug in the learner's own Python: their traceback says more than we can
            raise CheckFailed(_rank_failed_sentence(e, context)) from None
        for rank in range(ws):
            ranks = _group_of(rank, groups)
            compare(got[rank], [inputs[r] for r in ranks],
                    f"{context}, rank {rank} (group {list(ranks)})", atol=0, rtol=0)
        _check_traffic(got.trace, ws, groups, name)
    passed(f"{name} gathers tensors of different lengths, an empty one too, within each group "
           f"({_layout_phrase()}).")


# ---- exercise 4: a broadcast that autograd sees ------------------------------------------------

# For each layout, the source of each group: a global rank, never always the group's first.
SOURCES = {4: {(0, 1): 1, (2, 3): 2}, 5: {(0, 2): 2, (1, 3, 4): 3}}
N = 3


def _broadcast_draw(world_size, seed):
    """Per rank: its x, and the weights it applies to the broadcast result in its loss."""
    g = torch.Generator().manual_seed(seed)
    return [(torch.randint(-9, 10, (N,), generator=g).double(),
             torch.randint(1, 10, (N,), generator=g).double()) for _ in range(world_size)]


def _torch_broadcast_autograd():
    import torch.distributed.nn.functional as F
    return (F.broadcast, F._Broadcast.forward, F._Broadcast.backward)


def _broadcast_grad_on_ranks(rank, world_size, fn, groups, drawn):
    from ..collectives import tree_broadcast
    group, ranks = _my_group(rank, groups)
    src = SOURCES[world_size][ranks]
    x, weights = drawn[rank]
    del drawn
    x = x.clone().requires_grad_()
    with forbid(*_torch_broadcast_autograd(), tree_broadcast, _broadcast_draw,
                exercise="write the broadcast's backward yourself, as a torch.autograd.Function"):
        y = fn(x, src, group)
        if not isinstance(y, torch.Tensor):
            return "not a tensor", repr(y)
        if not y.requires_grad:
            return "no graph", None
        (y * weights).sum().backward()
    return y.detach(), x.grad


def check_broadcast_with_grad(fn):
    """fn(x, src, group) on every rank of `group` -> src's x, differentiable: the gradient of src's
    x is the sum of every group member's gradient of the result; the others' x get zeros."""
    name = getattr(fn, "__name__", "broadcast_with_grad")
    for ws, groups in LAYOUTS:
        drawn = _broadcast_draw(ws, _fresh_seed())
        got = learner_run(_broadcast_grad_on_ranks, ws, fn, groups, drawn, name=name,
                          hang_rule="every rank of a group must call the same collectives, on "
                          "that group, in forward and in backward.")
        for rank, (y, grad) in enumerate(got):
            ranks = _group_of(rank, groups)
            src = SOURCES[ws][ranks]
            context = f"{name} with {ws} ranks, group {list(ranks)}, src={src}"
            if isinstance(y, str) and y == "not a tensor":
                raise CheckFailed(f"{context}: rank {rank} got {grad} back; return a tensor.")
            if isinstance(y, str) and y == "no graph":
                raise CheckFailed(f"{context}: rank {rank}'s result does not require grad, so "
                                  f"autograd cannot reach x: dist.broadcast works in place, "
                                  f"outside autograd's graph; wrap it in a torch.autograd."
                                  f"Function whose backward you write.")
            compare(y, drawn[src][0], f"{context}, rank {rank}'s result")
            if grad is None:
                raise CheckFailed(f"{context}: rank {rank}'s x.grad is None; backward must "
                                  f"return a gradient for x on every rank (zeros where x was "
                                  f"not used).")
            expected = (sum(drawn[r][1] for r in ranks) if rank == src
                        else torch.zeros(N, dtype=torch.float64))
            why = ("the sum of every group member's gradient of the result" if rank == src
                   else f"zeros: only rank {src}'s x reached the result")
            compare(grad, expected, f"{context}, rank {rank}'s x.grad (should be {why})")
        _check_traffic(got.trace, ws, groups, name)
    passed(f"{name} broadcasts within each group and sends the gradients back to its source "
           f"({_layout_phrase()}; sources 1, 2, 2 and 3).")
