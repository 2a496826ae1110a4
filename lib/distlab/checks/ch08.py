"""Checkers for workbook 08: a 1F1B action list, and the send/recv of one pipeline step.

- `check_one_f_one_b`: the learner's lists are simulated for several (p, m) (no deadlock,
  messages received in the order they are sent, at most p - r micro-batches held, the bubble
  (p-1)/(m+p-1)), compared with 1F1B's order action by action, then run on 3 real ranks and
  compared with single-process training. The course's schedules (`distlab.pipeline_schedules`)
  refuse to run inside the learner's function.
- `check_pipeline_step`: the learner's step runs on 3 and 4 real ranks, traced: the loss and
  every gradient must equal one process's, AND the trace must show a pipeline - no collective,
  and rank r sends exactly its activation to rank r+1 and its input's gradient to rank r-1.
  The course's pipeline code refuses to run inside it; a deadlock is reported within TIMEOUT s
  with where each rank waits.
"""
import torch
import torch.nn.functional as F

from .. import pipeline_parallel as pp
from .. import pipeline_schedules as ps
from ..models import batches_of, make_mlp, regression_data
from . import (CheckFailed, UsedCourseCode, call_learner, compare, forbid, passed, run_learner,
               sizes_phrase)

TIMEOUT = 20       # a learner's deadlock is reported, with where each rank waits, within this
PIPELINE_RULE = ("in a pipeline, rank r only sends its output to rank r+1 and its input's "
                 "gradient to rank r-1, with send/recv")
DEADLOCK_RULE = ("Every recv needs a matching send: rank r first receives its input from r-1 "
                 "(rank 0 reads x), sends its output to r+1, then receives the gradient from "
                 "r+1 and sends its input's gradient to r-1; a rank that waits for a gradient "
                 "before it has sent its output waits forever.")


def _course_schedules():
    return [ps.gpipe, ps.one_f_one_b, ps.interleaved_1f1b, ps.zb_h1, ps.make_schedule]


def _course_pipeline():
    return _course_schedules() + [pp.PipelineStage, pp.train, _reference]

SIZES = (16, 24, 24, 24, 4)          # 7 layers: enough to cut into 2, 3 or 4 stages


def _reference(batches, sizes=SIZES, lr=0.05):
    """Single-process float64 training: the loss, gradients and parameters of every step."""
    model = make_mlp(sizes, seed=0).double()
    out = []
    for x, y in batches:
        model.zero_grad()
        loss = F.mse_loss(model(x.double()), y.double())
        loss.backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        with torch.no_grad():
            for p in model.parameters():
                p.add_(p.grad, alpha=-lr)
        out.append(dict(loss=loss.item(), grads=grads,
                        params={n: p.detach().clone() for n, p in model.named_parameters()}))
    return out


def _compare_runs(got, expected, context):
    """got: per rank, per step dicts from pipeline_parallel.train; expected: _reference."""
    for step, exp in enumerate(expected):
        losses = [r[step]["loss"] for r in got if r[step]["loss"] is not None]
        compare(losses[0], exp["loss"], f"{context}, step {step}, the loss", atol=1e-10, rtol=1e-9)
        for rank, r in enumerate(got):
            for what in ("grads", "params"):
                for name, value in r[step][what].items():
                    label = "gradient of" if what == "grads" else "after the update,"
                    compare(value, exp[what][name], f"{context}, step {step}, rank {rank}, "
                            f"{label} {name}", atol=1e-10, rtol=1e-9)


# ---- exercise 1: the 1F1B action list of one stage ------------------------------------------------

def _learner_schedule(fn, p, m):
    schedule = []
    for r in range(p):
        try:
            with forbid(*_course_schedules(), exercise="write the 1F1B list yourself"):
                actions = call_learner(fn, p, m, r, name="one_f_one_b_stage")
        except UsedCourseCode as e:
            raise CheckFailed(str(e)) from None
        if not isinstance(actions, (list, tuple)):
            raise CheckFailed(f"one_f_one_b_stage({p}, {m}, {r}) should return a list of "
                              f"actions like ('F', 0); got {type(actions).__name__}.")
        schedule.append(list(actions))
    return schedule


def _check_order(got, expected, p, m):
    """1F1B's order, action by action: say where the first difference is and what 1F1B does."""
    for r, (mine, ref) in enumerate(zip(got, expected)):
        for k, (a, b) in enumerate(zip(mine, ref)):
            if (a.kind, a.mb) != (b.kind, b.mb):
                warmup = min(p - 1 - r, m)
                raise CheckFailed(
                    f"with p={p}, m={m}, stage {r}'s action {k} is {a!r}; 1F1B runs {b!r} there "
                    f"(stage {r} runs {warmup} warm-up forward{'s' if warmup != 1 else ''}, then "
                    f"alternates one forward and one backward, then the remaining backwards).")
        if len(mine) != len(ref):
            raise CheckFailed(f"with p={p}, m={m}, stage {r} runs {len(mine)} actions; 1F1B "
                              f"runs {len(ref)} (one F and one B per micro-batch).")


def _train_with(rank, world_size, schedule, batches, m):
    return pp.train(rank, world_size, lambda p, mm: schedule, make_mlp(SIZES, seed=0), batches,
                    m, (SIZES[0],), dtype=torch.float64)


def check_one_f_one_b(fn, cases=((2, 4), (3, 5), (4, 4), (4, 2), (3, 1)), run_p=3, run_m=5):
    """fn(p, m, stage) -> that stage's 1F1B actions; simulated on several (p, m), then run."""
    for p, m in cases:
        schedule = _learner_schedule(fn, p, m)
        try:
            timeline = ps.simulate(schedule, m)
        except ValueError as e:
            raise CheckFailed(f"with p={p} stages and m={m} micro-batches: {e}") from None
        for r in range(p):
            held = ps.peak_in_flight(schedule[r])
            if held > min(p - r, m):
                raise CheckFailed(
                    f"with p={p}, m={m}, stage {r} holds {held} micro-batches' activations at "
                    f"once; 1F1B holds at most p - stage = {min(p - r, m)} (start the backwards "
                    f"sooner).")
        _check_order(ps.normalize(schedule), ps.one_f_one_b(p, m), p, m)
        compare(ps.bubble_fraction(timeline), ps.theory_bubble(p, m),
                f"with p={p}, m={m}, the simulated bubble fraction", atol=1e-9, rtol=1e-9)
    # The same lists, run for real: send/recv must pair up and training must equal one process.
    schedule = _learner_schedule(fn, run_p, run_m)
    x, y = regression_data(40, SIZES[0], SIZES[-1], seed=3)
    batches = batches_of(x, y, 23, 2)      # 23 samples: micro-batches of unequal sizes
    got = run_learner(_train_with, run_p, schedule, batches, run_m, name="one_f_one_b_stage",
                      timeout=120)
    _compare_runs(got, _reference(batches), f"running your schedule on {run_p} ranks")
    passed(f"your 1F1B lists are valid for (p, m) in {list(cases)}, follow 1F1B's order, hold at "
           f"most p - stage micro-batches, reach the bubble (p-1)/(m+p-1), and train exactly like "
           f"one process on {run_p} real ranks.")


# ---- exercise 2: the send/recv of one pipeline step ------------------------------------------------

def _step_on_rank(rank, world_size, fn, batch):
    x, y = batch
    parts = pp.split_model(make_mlp(SIZES, seed=0).double().net, world_size)
    shapes = pp._output_shapes(parts, (SIZES[0],), torch.float64)
    in_shape = None if rank == 0 else (len(x), *shapes[rank - 1])
    stage = parts[rank]
    with forbid(*_course_pipeline(), exercise="write the pipeline's send/recv yourself"):
        loss = fn(stage, x.double(), y.double(), rank, world_size, in_shape)
    if isinstance(loss, torch.Tensor):
        loss = loss.item()
    grads = {f"net.{n}": (p.grad.clone() if p.grad is not None else None)
             for n, p in stage.named_parameters()}
    return loss, grads, shapes


def _run_step(fn, world_size, batch):
    """The learner's step with its trace; course code and deadlocks become one sentence."""
    return run_learner(_step_on_rank, world_size, fn, batch, name="pipeline_step",
                       timeout=TIMEOUT, trace=True, deadlock_rule=DEADLOCK_RULE)


def _size(nbytes):
    return f"{nbytes} B" if nbytes < 1024 else f"{nbytes / 1024:.1f} KiB"


def _check_messages(trace, world_size, batch_size, shapes):
    """From the trace: no collective; rank r sends one activation to r+1, one gradient to r-1."""
    for rank in range(world_size):
        for e in trace.comm(rank):
            if e["op"] not in ("send", "recv"):
                raise CheckFailed(f"with world_size={world_size}, rank {rank} called {e['op']} "
                                  f"(the run's trace shows it); {PIPELINE_RULE} - no collective.")
        sends = trace.sends(rank)
        expected = []
        if rank < world_size - 1:     # its output: batch x width at the cut, float64
            expected.append((rank + 1, batch_size * _numel(shapes[rank]) * 8))
        if rank > 0:                  # its input's gradient: the shape it received
            expected.append((rank - 1, batch_size * _numel(shapes[rank - 1]) * 8))
        for peer, nbytes in sends:
            if peer not in (rank - 1, rank + 1):
                raise CheckFailed(f"with world_size={world_size}, rank {rank} sent "
                                  f"{_size(nbytes)} to rank {peer}; {PIPELINE_RULE}.")
        if sorted(sends) != sorted(expected):
            want = " and ".join(f"{_size(b)} to rank {p}" for p, b in expected)
            got = " and ".join(f"{_size(b)} to rank {p}" for p, b in sends) or "nothing"
            raise CheckFailed(f"with world_size={world_size}, rank {rank} sent {got}; one step "
                              f"of a pipeline sends {want} ({PIPELINE_RULE}, one message each "
                              f"way per step).")


def _numel(shape):
    n = 1
    for d in shape:
        n *= d
    return n


def check_pipeline_step(fn, world_sizes=(3, 4)):
    """fn(stage, x, y, rank, world_size, in_shape) -> loss on the last rank; grads in .grad."""
    x, y = regression_data(12, SIZES[0], SIZES[-1], seed=5)
    expected = _reference([(x, y)])[0]
    for ws in world_sizes:
        got = _run_step(fn, ws, (x, y))
        loss = got[ws - 1][0]
        if loss is None:
            raise CheckFailed(f"with world_size={ws}, the last rank returned None: it computes "
                              f"the loss and should return it.")
        compare(loss, expected["loss"], f"with world_size={ws}, the loss on rank {ws - 1}",
                atol=1e-10, rtol=1e-9)
        for rank, (_, grads, _) in enumerate(got):
            for name, g in grads.items():
                if g is None:
                    raise CheckFailed(f"with world_size={ws}, rank {rank} has no gradient for "
                                      f"{name}: did its backward run?")
                compare(g, expected["grads"][name],
                        f"with world_size={ws}, rank {rank}, gradient of {name}",
                        atol=1e-10, rtol=1e-9)
        _check_messages(got.trace, ws, len(x), got[0][2])
    passed(f"pipeline_step passes activations forward and gradients backward correctly on "
           f"{sizes_phrase(world_sizes)} ranks: the loss and every gradient equal one process's, "
           f"and the trace shows each rank sending only its activation to the next rank and its "
           f"input's gradient to the previous one.")
