"""Checkers for workbook 11: each exercise fixes, or detects, one class of distributed bug.

Every checker runs the learner's code on real ranks at two or more world sizes or mesh shapes
(odd ones too) and proves it gives what one process gives, reads the run's trace to see that the
right ranks talked and that what travelled is what the answer needs, and refuses the course's own
detectors and loops (`distlab.debug`), the checkers' helpers and torch's object collectives (as
chapter 02's checkers do). A hang is caught by a short timeout and reported as one sentence naming
where the ranks were. Sizes and values a constant could match are drawn afresh at every check.
"""
import contextlib
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F

from .. import debug, models
from .. import trace as _trace
from ..debug_parallel import PIPE_WIDTH, SP_DIMS, pipe_stage as _pipe_stage, sp_data as _sp_data
from ..debug_parallel import sp_block_without_ln_sum as _sp_block_without_ln_sync
from ..launch import RankFailed, RunTimeout
from . import CheckFailed, compare, forbid, passed, run_learner, sizes_phrase
from .ch01 import learner_run, no_object_collectives

WORLD_SIZES = (2, 3)       # even and odd: what a fix must survive; 4 catches nothing 3 misses
TIMEOUT = 60


def _course_code():
    """The course's answers to this workbook's bugs: the detectors and the hand-written loop."""
    return (debug.average_gradients, debug.broadcast_parameters, debug.checksums,
            debug.replicas_out_of_sync, debug.sample_fingerprints, debug.duplicated_samples,
            debug.gradient_scale, debug.train_data_parallel, debug.reference, debug.problem,
            debug.contiguous_shard, models.regression_data, models.batches_of, models.make_mlp,
            models.train_reference)


@contextlib.contextmanager
def _refused(exercise, *helpers):
    """The course's code and this checker's data builders (`helpers`) refused; its
    answer-building helpers (_expected_*, _*reference*) the framework refuses by default; and
    torch's object collectives, as chapter 02's checkers refuse them."""
    with forbid(*_course_code(), *helpers, exercise=exercise), _no_object_collectives():
        yield


def _no_object_collectives():
    """torch's object collectives (all_gather_object, gather_object, broadcast_object_list,
    scatter_object_list) refused inside a rank: they pickle Python objects, send them as byte
    tensors and unpickle them, with a host sync each; what travelled is then a pickle, not the
    tensors the exercise is about, and no trace can say what it held."""
    return no_object_collectives(
        functions=(dist.all_gather_object, dist.gather_object, dist.broadcast_object_list,
                   dist.scatter_object_list),
        reason=lambda fn: (f"your function used dist.{fn.__name__}, which pickles Python objects "
                           f"into byte tensors; send the tensors themselves with tensor "
                           f"collectives (all_reduce, all_gather, broadcast)."))


def _run(fn, world_size, name, *args, **kwargs):
    try:
        return run_learner(fn, world_size, *args, name=name, timeout=TIMEOUT, **kwargs)
    except RunTimeout as e:
        where = "; ".join(line.strip() for line in str(e).splitlines()[1:1 + world_size])
        raise CheckFailed(f"{name} hung with world_size={world_size} ({where}): every rank must "
                          f"call the same collectives.") from None
    except RankFailed as e:
        if not e.peer_lost:
            raise
        # A rank that skipped the collective finished and closed its connections under the
        # ranks still waiting in it: a hang that ended early.
        raise CheckFailed(f"{name} with world_size={world_size}: rank {e.rank} waited in a "
                          f"collective that another rank never called (that rank finished and "
                          f"left): every rank must call the same collectives.") from None


def _traced(fn, world_size, name, *args, rule):
    return learner_run(fn, world_size, *args, name=name, timeout=TIMEOUT, hang_rule=rule)


# ---- exercise 1: logging without a hang: the mean loss and the worst rank ---------------------

REPORT_CASES = ("every rank's loss different", "a tie for the largest loss")


def _report_losses(world_size, seed):
    """Per case, every rank's loss: drawn afresh for each check, so no answer can be typed in."""
    g = torch.Generator().manual_seed(seed)
    distinct = (torch.randperm(10 * world_size, generator=g)[:world_size] + 1).double() / 4
    tie = distinct.clone()
    top = distinct.max() + 1
    tie[0] = tie[world_size - 1] = top      # rank 0 and the last share the largest loss
    return [distinct.tolist(), tie.tolist()]


def _expected_report(losses):
    worst = max(losses)
    return sum(losses) / len(losses), losses.index(worst)


def _report_on_ranks(rank, world_size, fn, cases):
    answers = []
    for losses in cases:
        loss = torch.tensor(losses[rank], dtype=torch.float64)
        with _refused("combine the ranks' losses yourself", _report_losses):
            got = fn(loss, rank, world_size)
        answers.append(_plain(got))
    return answers


def _plain(value):
    if isinstance(value, torch.Tensor):
        return value.item() if value.numel() == 1 else value.tolist()
    if isinstance(value, (tuple, list)):
        return [_plain(v) for v in value]
    return value


def check_loss_report(fn, seed=None):
    """fn(loss, rank, world_size) -> (mean loss, rank with the largest loss), on every rank."""
    name = getattr(fn, "__name__", "loss_report")
    seed = int.from_bytes(os.urandom(4), "little") if seed is None else seed
    for ws in WORLD_SIZES:
        cases = _report_losses(ws, seed + ws)
        got = _run(_report_on_ranks, ws, name, fn, cases)
        for case, losses in zip(REPORT_CASES, cases):
            mean, worst = _expected_report(losses)
            for rank in range(ws):
                answer = got[rank][REPORT_CASES.index(case)]
                where = f"{name} with world_size={ws}, case '{case}', rank {rank}"
                if not (isinstance(answer, (tuple, list)) and len(answer) == 2):
                    raise CheckFailed(f"{where}: return a pair (mean loss, worst rank); got "
                                      f"{answer!r}.")
                compare(answer[0], mean, f"{where}: the mean loss", 1e-12, 1e-12)
                if answer[1] != worst:
                    raise CheckFailed(
                        f"{where}: worst rank {answer[1]!r}, expected {worst} (the losses were "
                        f"{[round(v, 4) for v in losses]}; on a tie the lowest rank). Every rank "
                        f"must reach the same answer from the same collectives.")
    passed(f"{name} gives every rank the mean loss and the worst rank (ties included), on "
           f"{sizes_phrase(WORLD_SIZES)} ranks, without a hang.")


# ---- exercise 2: gradient accumulation whose last micro-batch is short --------------------------
#
# Each rank accumulates over ACC_MICRO micro-batches of its own; the last one is short, and the
# ranks' last micro-batches differ in size (the end of an epoch). Sizes are drawn afresh at every
# check, so no constant N or weight can match; one case keeps every rank's total equal (where a
# per-rank normalisation happens to be right) and one does not.

ACC_MICRO, ACC_STEPS = 3, 2
ACC_CASES = ("every rank's last micro-batch equally short", "the ranks' last micro-batches differ")


def _acc_sizes(world_size, seed):
    """Per case, per rank, its micro-batch sizes: full ones of `m` samples, then a short one."""
    g = torch.Generator().manual_seed(seed)
    m = int(torch.randint(4, 7, (), generator=g))
    same = int(torch.randint(1, m, (), generator=g))
    short = torch.randperm(m - 1, generator=g)[:world_size] + 1
    if world_size > m - 1:                      # more ranks than short sizes: repeat, not equal
        short = torch.arange(world_size) % (m - 1) + 1
    return [[[m] * (ACC_MICRO - 1) + [same] for _ in range(world_size)],
            [[m] * (ACC_MICRO - 1) + [int(short[r])] for r in range(world_size)]]


def _acc_data(sizes, step):
    """Every rank's micro-batches of one step, cut from one global batch in rank order."""
    total = sum(sum(s) for s in sizes)
    g = torch.Generator().manual_seed(1000 + 17 * step + total)
    x = torch.randn(total, 16, generator=g, dtype=torch.float64)
    y = torch.randn(total, 4, generator=g, dtype=torch.float64)
    out, at = [], 0
    for rank_sizes in sizes:
        mine = []
        for n in rank_sizes:
            mine.append((x[at:at + n], y[at:at + n]))
            at += n
        out.append(mine)
    return out


def _accumulation_reference(sizes):
    """One process: the gradient of the mean loss over every sample of every rank, per step, and
    the parameters after ACC_STEPS steps of SGD."""
    model, _ = debug.problem()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    grads = []
    for step in range(ACC_STEPS):
        x = torch.cat([xb for rank in _acc_data(sizes, step) for xb, _ in rank])
        y = torch.cat([yb for rank in _acc_data(sizes, step) for _, yb in rank])
        opt.zero_grad()
        F.mse_loss(model(x), y).backward()
        grads.append([p.grad.clone() for p in model.parameters()])
        opt.step()
    return grads, [p.detach().clone() for p in model.parameters()]


def _micro_grads(model, micro_batches):
    """This rank's gradient of each micro-batch's own mean loss (to explain a wrong answer)."""
    out = []
    for x, y in micro_batches:
        model.zero_grad()
        F.mse_loss(model(x), y).backward()
        out.append([p.grad.clone() for p in model.parameters()])
    model.zero_grad(set_to_none=True)
    return out


def _accumulate_on_ranks(rank, world_size, fn, cases):
    answers = []
    for sizes in cases:
        model, _ = debug.problem()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        steps = []
        for step in range(ACC_STEPS):
            micro = _acc_data(sizes, step)[rank]
            parts = _micro_grads(model, micro)
            opt.zero_grad(set_to_none=True)
            with _trace.span("fix"), _refused("weigh the micro-batches and combine the ranks' "
                                              "gradients yourself", _acc_data, _acc_sizes):
                fn(model, [(x.clone(), y.clone()) for x, y in micro])
            grads = [None if p.grad is None else p.grad.detach().clone()
                     for p in model.parameters()]
            steps.append({"grads": grads, "parts": parts})
            if any(g is None for g in grads):
                break
            opt.step()
        answers.append({"steps": steps, "params": [p.detach().clone() for p in model.parameters()]})
    return answers


def check_accumulation(fn, seed=None):
    """fn(model, micro_batches) on every rank: forward and backward over this rank's micro-batches
    [(x, y), ...] (the last one short), then every rank's .grad is the gradient of the mean
    F.mse_loss over every sample of every rank's micro-batches: what one process gets on them."""
    name = getattr(fn, "__name__", "accumulate")
    seed = int.from_bytes(os.urandom(4), "little") if seed is None else seed
    model, _ = debug.problem()
    nbytes = sum(p.numel() * p.element_size() for p in model.parameters())
    for ws in WORLD_SIZES:
        cases = _acc_sizes(ws, seed + ws)
        got = _traced(_accumulate_on_ranks, ws, name, fn, cases, rule="every rank must call "
                      "the same collectives on the same tensors, in the same order.")
        for rank in range(ws):
            for e in got.trace.comm(rank):
                if e["label"] == ["fix"] and tuple(e["group"]) != tuple(range(ws)):
                    raise CheckFailed(f"{name} with world_size={ws}: rank {rank}'s {e['op']} ran "
                                      f"over ranks {list(e['group'])}; every rank's samples are "
                                      f"part of the global batch: combine over all {ws} ranks.")
        for c, (label, sizes) in enumerate(zip(ACC_CASES, cases)):
            want_grads, want_params = _accumulation_reference(sizes)
            where = (f"{name} with world_size={ws}, case '{label}' (micro-batches "
                     f"{' | '.join('+'.join(map(str, s)) for s in sizes)})")
            for step in range(ACC_STEPS):
                for rank in range(ws):
                    mine = got[rank][c]["steps"][step]["grads"]
                    if any(g is None for g in mine):
                        raise CheckFailed(f"{where}: rank {rank} has no gradient after your "
                                          f"function: run forward and backward on every "
                                          f"micro-batch inside it.")
                    if all(_close(m, w) for m, w in zip(mine, want_grads[step])):
                        continue
                    _explain_accumulation(where, step, rank, mine, want_grads[step],
                                          [r[c]["steps"][step]["parts"] for r in got], sizes)
            for rank in range(ws):
                compare(got[rank][c]["params"], want_params, f"{where}: rank {rank}'s parameters "
                        f"after {ACC_STEPS} steps", 1e-10, 1e-9)
        for rank in range(ws):
            # what this rank put in: a gather's bytes are its output, every rank's share
            sent = sum(e["bytes"] / (ws if e["op"] in ("all_gather", "gather") else 1)
                       for e in got.trace.comm(rank)
                       if e["label"] == ["fix"] and e["op"] != "recv")
            calls = ACC_STEPS * len(ACC_CASES)
            if sent < nbytes * calls:
                raise CheckFailed(
                    f"{name} with world_size={ws}: rank {rank} sent {sent / calls:.0f} bytes a "
                    f"step; its gradients are {nbytes} bytes, and every rank's gradients are part "
                    f"of the answer: send the gradients (an all-reduce), not the samples or a "
                    f"copy.")
    passed(f"{name} gives every rank the global batch's gradient with a short last micro-batch "
           f"(sizes drawn afresh; equal and unequal totals per rank), at world sizes "
           f"{sizes_phrase(WORLD_SIZES)}: training equals one process.")


def _explain_accumulation(where, step, rank, mine, want, parts, sizes):
    head = f"{where}: rank {rank}'s gradient at step {step}"
    ws = len(sizes)
    # the bug the workbook shows: each micro-batch weighted 1/K, then the ranks averaged
    plain = [sum(sum(p[i] for p in rank_parts) / len(rank_parts) for rank_parts in parts) / ws
             for i in range(len(want))]
    if all(_close(m, p) for m, p in zip(mine, plain)):
        raise CheckFailed(f"{head} weighs every micro-batch alike (1/{ACC_MICRO}); each "
                          f"micro-batch's loss is the mean over ITS samples and the last is "
                          f"shorter: weigh micro-batch i by n_i / N, N = every rank's samples.")
    per_rank = [sum(sum(p[i] * n for p, n in zip(rank_parts, s)) / sum(s)
                    for rank_parts, s in zip(parts, sizes)) / ws for i in range(len(want))]
    if all(_close(m, p) for m, p in zip(mine, per_rank)):
        raise CheckFailed(f"{head} weighs the micro-batches within each rank but then averages "
                          f"the ranks alike; the ranks hold different numbers of samples: divide "
                          f"by the global count N, not by each rank's own.")
    summed = [sum(sum(p[i] for p in rank_parts) for rank_parts in parts)
              for i in range(len(want))]
    if all(_close(m, p) for m, p in zip(mine, summed)):
        raise CheckFailed(f"{head} is the plain sum of every micro-batch's gradient: weigh "
                          f"micro-batch i by n_i / N before adding.")
    scale = debug.gradient_scale(mine, want)
    raise CheckFailed(f"{head} is {scale:.4g}x the global batch's gradient, not equal to it: the "
                      f"answer is the sum over every micro-batch of every rank of n_i / N times "
                      f"its gradient.")


# ---- exercise 3: replicas that never were equal: parameters and buffers, one message a dtype -----

def _bn_model(rank):
    """A model with buffers (BatchNorm's running statistics, an int64 counter), initialised and
    run differently on every rank: the bug of seeding each rank with its own rank."""
    with torch.random.fork_rng():               # the caller's random stream stays its own
        torch.manual_seed(rank)
        model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.BatchNorm1d(8),
                                    torch.nn.ReLU(), torch.nn.Linear(8, 3))
    g = torch.Generator().manual_seed(100 + rank)
    with torch.no_grad():
        for _ in range(rank + 1):               # running stats and their count differ too
            model(torch.randn(5, 6, generator=g))
    return model


def _sync_on_ranks(rank, world_size, fn):
    model = _bn_model(rank)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with _trace.span("fix"), _refused("broadcast rank 0's state yourself", _bn_model):
        fn(model)
    return {"before": before, "after": {k: v.clone() for k, v in model.state_dict().items()}}


def check_sync_state(fn):
    """fn(model) -> None: afterwards every rank holds rank 0's parameters AND buffers, sent in
    one broadcast per dtype."""
    name = getattr(fn, "__name__", "sync_state")
    for ws in WORLD_SIZES:
        got = _traced(_sync_on_ranks, ws, name, fn, rule="every rank must call the same "
                      "broadcasts, in the same order, with tensors of the same size.")
        want = got[0]["before"]         # rank 0's state before the fix: what everyone must hold
        dtypes = sorted({str(v.dtype).replace("torch.", "") for v in want.values()})
        for rank in range(ws):
            for key, value in want.items():
                mine = got[rank]["after"].get(key)
                if mine is None or mine.dtype != value.dtype or not torch.equal(mine, value):
                    kind = "parameter" if key.endswith(("weight", "bias")) else "buffer"
                    extra = ("" if kind == "parameter" else " Buffers are state too: DDP "
                             "broadcasts them with the parameters.")
                    raise CheckFailed(f"{name} with world_size={ws}: rank {rank}'s {kind} {key} "
                                      f"is not rank 0's.{extra}")
        for rank in range(ws):
            calls = [e for e in got.trace.comm(rank) if e["label"] == ["fix"]]
            others = sorted({e["op"] for e in calls if e["op"] != "broadcast"})
            if others:
                raise CheckFailed(f"{name} with world_size={ws}: rank {rank} called "
                                  f"{', '.join(others)}; rank 0's state needs only broadcasts.")
            sent = sum(e["bytes"] for e in calls)
            state = sum(v.numel() * v.element_size() for v in want.values())
            if sent < state:
                raise CheckFailed(
                    f"{name} with world_size={ws}: rank {rank} took part in broadcasts of "
                    f"{sent} bytes; rank 0's state is {state} bytes, and all of it must travel "
                    f"from rank 0 (rebuilding it locally copies rank 0's recipe, not its state).")
            if len(calls) > len(dtypes):
                raise CheckFailed(
                    f"{name} with world_size={ws}: rank {rank} made {len(calls)} broadcasts, one "
                    f"per tensor; the state holds {len(want)} tensors of {len(dtypes)} dtypes "
                    f"({', '.join(dtypes)}): flatten the tensors of each dtype into one buffer "
                    f"and broadcast that ({len(dtypes)} messages, each paying the latency once).")
    dtypes = sorted({str(v.dtype) for v in _bn_model(0).state_dict().values()})
    passed(f"{name} gives every rank rank 0's parameters and buffers in {len(dtypes)} broadcasts "
           f"(one per dtype), on {sizes_phrase(WORLD_SIZES)} ranks.")


# ---- exercise 4: which rank's gradients differ, at which step, in which parameter ---------------

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
    answers = []
    for _, damage in DIVERGENCE_CASES:
        seen, step = [], [0]

        def average(model):
            for p in model.parameters():
                dist.all_reduce(p.grad, op=dist.ReduceOp.AVG)
            _damage(model, step[0], rank, world_size, damage)
            named = [(n, p.grad) for n, p in model.named_parameters()]
            with _trace.span("detector"), _refused("compare the ranks' gradients yourself"):
                seen.append(_plain(fn(named)))
            step[0] += 1
        _train(rank, world_size, average)
        answers.append(seen)
    return answers


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
                    answer = got[rank][case][step]
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
            sent = sum(e["bytes"] for e in got.trace.comm(rank) if e["label"] == ["detector"])
            if sent / calls > nbytes / 4:
                raise CheckFailed(
                    f"{name} with world_size={ws}: rank {rank} sent {sent / calls:.0f} bytes per "
                    f"call; the gradients themselves are {nbytes}. Send a few numbers per "
                    f"tensor (checksums), not the tensors.")
    passed(f"{name} names the rank and the parameter at the step where they first differ (1e-12 "
           f"and a swap included), the same on every rank, on {sizes_phrase(WORLD_SIZES)} ranks.")


# ---- exercise 5: a pipeline on a (dp, pp) mesh: forward and backward ----------------------------
#
# The mesh order is the other one than chapter 10's: stages vary fastest, rank = replica * pp +
# stage. Shapes (dp, pp): one with replicas and one with three stages, so that a peer that is
# right on one shape only (rank ± dp, rank ± 2) fails on the other.

PIPE_SHAPES = ((2, 2), (1, 3))
PIPE_ROWS = 2                                 # PIPE_WIDTH: debug_parallel's stages'


def _pipe_input(replica):
    g = torch.Generator().manual_seed(20 + replica)
    return torch.randn(PIPE_ROWS, PIPE_WIDTH, generator=g, dtype=torch.float64)


def _pipe_expected(replica, pp):
    """Each stage's gradients and the loss, in one process: loss = sum of the last output²."""
    stages = [_pipe_stage(s) for s in range(pp)]
    x = _pipe_input(replica)
    for s in stages:
        x = s(x)
    loss = x.pow(2).sum()
    loss.backward()
    return loss.item(), [[p.grad.clone() for p in s.parameters()] for s in stages]


def _pipeline_on_ranks(rank, world_size, pp, dp, fn):
    replica, stage = divmod(rank, pp)
    x = _pipe_input(replica) if stage == 0 else torch.zeros(PIPE_ROWS, PIPE_WIDTH,
                                                            dtype=torch.float64)
    module = _pipe_stage(stage)
    with _refused("send the activations and gradients yourself", _pipe_stage, _pipe_input):
        loss = fn(x, module, rank, pp, dp)
    grads = [None if p.grad is None else p.grad.clone() for p in module.parameters()]
    return {"loss": _plain(loss), "grads": grads}


def check_pipeline_step(fn):
    """fn(x, stage, rank, pp, dp) -> the loss on the last stage: forward through every stage of
    this replica, then backward, leaving each stage's gradients in its parameters."""
    name = getattr(fn, "__name__", "pipeline_step")
    for dp, pp in PIPE_SHAPES:
        where = f"with dp={dp} replicas x pp={pp} stages"
        got = _traced(_pipeline_on_ranks, pp * dp, name, pp, dp, fn,
                      rule="stage s of replica d is rank d*pp + s: the next stage is one rank "
                      "on, within the replica; the last stage sends nothing forward and the "
                      "first nothing back.")
        for rank in range(pp * dp):
            replica, stage = divmod(rank, pp)
            for e in got.trace.comm(rank):
                if e["op"] not in ("send", "recv"):
                    raise CheckFailed(f"{name} {where}: rank {rank} called {e['op']}; a pipeline "
                                      f"only sends and receives between neighbouring stages.")
                allowed = {rank + 1} if stage < pp - 1 else set()
                allowed |= {rank - 1} if stage > 0 else set()
                if e["peer"] not in allowed:
                    to = "to" if e["op"] == "send" else "from"
                    raise CheckFailed(
                        f"{name} {where}: rank {rank} (replica {replica}, stage {stage}) "
                        f"{'sent' if e['op'] == 'send' else 'received'} {e['bytes']} bytes "
                        f"{to} rank {e['peer']}, which is replica {e['peer'] // pp}'s stage "
                        f"{e['peer'] % pp}; rank = replica*pp + stage, so its neighbours are "
                        f"{sorted(allowed) or 'none'}.")
            sends = [e for e in got.trace.comm(rank) if e["op"] == "send"]
            needed = (stage < pp - 1) + (stage > 0)
            if len(sends) != needed:
                raise CheckFailed(
                    f"{name} {where}: rank {rank} (stage {stage}) sent {len(sends)} messages; it "
                    f"sends its activation forward{' and' if needed == 2 else ''}"
                    f"{' its input gradient back' if stage > 0 else ''}: {needed}.")
        for replica in range(dp):
            loss, grads = _pipe_expected(replica, pp)
            last = replica * pp + pp - 1
            compare(got[last]["loss"], loss, f"{name} {where}: replica {replica}'s loss on its "
                    f"last stage (rank {last})", 1e-12, 1e-10)
            for stage in range(pp):
                rank = replica * pp + stage
                mine = got[rank]["grads"]
                if any(g is None for g in mine):
                    raise CheckFailed(f"{name} {where}: rank {rank} (stage {stage}) has no "
                                      f"gradient: run backward on every stage, from the gradient "
                                      f"the next stage sends back.")
                compare(mine, grads[stage], f"{name} {where}: rank {rank} (replica {replica}, "
                        f"stage {stage})'s gradients [weight, bias]", 1e-12, 1e-10)
    passed(f"{name} runs forward and backward through the stages of each replica on "
           f"{' and '.join(f'dp={dp} x pp={pp}' for dp, pp in PIPE_SHAPES)}: every gradient "
           f"equals one process's.")


# ---- exercise 6: sequence parallel's LayerNorm gradients, on a dp x tp mesh ---------------------

SP_CASES = ((2, 2), (3, 1))                 # (tp, dp): replicas of a tp group; an odd tp
def _sp_groups(rank, tp, dp):
    """Ranks on a (dp, tp) mesh, tp fastest: rank = replica * tp + t."""
    tps = [dist.new_group(list(range(d * tp, (d + 1) * tp))) for d in range(dp)]
    dps = [dist.new_group(list(range(t, tp * dp, tp))) for t in range(tp)]
    return tps[rank // tp], dps[rank % tp]


def _sp_on_ranks(rank, world_size, tp, dp, fn):
    from ..models import Block
    from ..tensor_parallel import dense_shards, sequence_slice
    dense = _seeded_block(Block)
    mean, own = {}, {}
    for replica in range(dp):       # the dense gradient of the mean loss over the replicas
        dense.zero_grad(set_to_none=True)
        x, w = _sp_data(replica)
        (dense(x) * w).sum().backward()
        for n, p in dense.named_parameters():
            mean[n] = mean.get(n, 0) + p.grad / dp
            if replica == rank // tp:
                own[n] = p.grad.clone()
    tp_group, dp_group = _sp_groups(rank, tp, dp)
    block = _sp_block_without_ln_sync().from_dense(dense, tp_group, sequence_parallel=True)
    x, w = _sp_data(rank // tp)
    out = block(sequence_slice(x, tp_group))
    (out * sequence_slice(w, tp_group)).sum().backward()
    with _trace.span("fix"), _refused("sum and average the right gradients yourself",
                                         _seeded_block, _sp_data):
        fn(block, tp_group, dp_group)
    shards = {}
    for grads in (mean, own):       # what this rank's shard should hold; and its replica's alone
        for n, p in dense.named_parameters():
            p.grad = grads[n]
        shards[id(grads)] = dense_shards(block, dense, grads=True)
    expected, alone = shards[id(mean)], shards[id(own)]
    return {n: (p.grad.detach().clone(), expected[n].clone(), alone[n].clone())
            for n, p in block.named_parameters()}


def _seeded_block(Block):
    torch.manual_seed(0)
    return Block(SP_DIMS["d_model"], SP_DIMS["n_heads"], SP_DIMS["hidden"]).double()


def check_sequence_parallel_grads(fn):
    """fn(block, tp_group, dp_group) after backward: every gradient of the sequence-parallel block
    equals the dense block's gradient of the mean loss over the dp replicas (its shard)."""
    name = getattr(fn, "__name__", "sync_grads")
    for tp, dp in SP_CASES:
        where = f"with tp={tp} x dp={dp}"
        got = _traced(_sp_on_ranks, tp * dp, name, tp, dp, fn,
                      rule="every rank of a group must all-reduce the same gradients in the "
                      "same order.")
        for rank in range(tp * dp):
            tp_group = tuple(range(rank // tp * tp, (rank // tp + 1) * tp))
            dp_group = tuple(range(rank % tp, tp * dp, tp))
            for e in got.trace.comm(rank):
                if e["label"] == ["fix"] and e["group"] not in (tp_group, dp_group):
                    raise CheckFailed(
                        f"{name} {where}: rank {rank}'s {e['op']} ran over ranks "
                        f"{list(e['group'])}; a LayerNorm's partial gradients live in ONE tp "
                        f"group (ranks {list(tp_group)}), and replicas of a shard in one dp group "
                        f"(ranks {list(dp_group)}).")
            for pname, (mine, expected, alone) in got[rank].items():
                if not torch.allclose(mine, expected, atol=1e-10, rtol=1e-9):
                    _explain_sp(name, where, rank, pname, mine, expected, alone, tp, dp)
    passed(f"{name} sums the LayerNorms' gradients over tp, averages every gradient over dp and "
           f"leaves the tp shards whole: every gradient equals the dense block's, "
           f"{' and '.join(f'tp={t} x dp={d}' for t, d in SP_CASES)}.")


def _close(a, b):
    return torch.allclose(a, b, atol=1e-10, rtol=1e-9)


def _explain_sp(name, where, rank, pname, mine, expected, alone, tp, dp):
    head = f"{name} {where}: rank {rank}'s {pname} gradient"
    ln = pname.startswith(("ln1.", "ln2."))
    if dp > 1 and (_close(mine, alone) or (ln and _close(mine * tp, alone))):
        raise CheckFailed(f"{head} is its own replica's only: average every gradient over the dp "
                          f"group too (each replica saw different data).")
    if dp > 1 and _close(mine, expected * dp):
        raise CheckFailed(f"{head} is {dp}x the dense one: over the dp group average (divide by "
                          f"{dp}), do not sum.")
    if not ln:
        if pname.endswith(("proj.bias", "fc2.bias")):
            raise CheckFailed(
                f"{head} is wrong: the row-parallel biases already sum their gradient over the "
                f"tp group inside backward (sequence parallel's `replicated`); summing again "
                f"counts it twice. Over tp, sum only the LayerNorm gradients.")
        raise CheckFailed(
            f"{head} is wrong: it belongs to a tensor-parallel shard, and each tp rank's is the "
            f"gradient of a different slice of the matrix, already complete; reducing shard "
            f"gradients over tp mixes slices. Over tp, sum only the LayerNorm gradients.")
    if _close(mine * tp, expected):
        raise CheckFailed(f"{head} is 1/{tp} of the dense one: over tp the ranks' parts must be "
                          f"summed, not averaged (each saw a different 1/{tp} of the tokens).")
    scale = (mine.norm() / expected.norm()).item()
    if scale > 1:
        raise CheckFailed(f"{head} is {scale:.2g} times the dense one's norm: it was added up "
                          f"more than once; sum it once over tp, then average over dp.")
    raise CheckFailed(f"{head} is {scale:.2g} times the dense one's norm: each rank's LayerNorm "
                      f"saw only its 1/{tp} of the sequence, so its gradient is a partial sum; "
                      f"all-reduce (sum) it over the tp group.")
