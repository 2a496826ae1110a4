"""Checkers for workbook 08: a 1F1B action list, and the send/recv of one pipeline step."""
import torch
import torch.nn.functional as F

from .. import pipeline_parallel as pp
from .. import pipeline_schedules as ps
from ..models import batches_of, make_mlp, regression_data
from . import CheckFailed, call_learner, compare, passed, run_learner, sizes_phrase

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
        actions = call_learner(fn, p, m, r, name="one_f_one_b_stage")
        if not isinstance(actions, (list, tuple)):
            raise CheckFailed(f"one_f_one_b_stage({p}, {m}, {r}) should return a list of "
                              f"actions like ('F', 0); got {type(actions).__name__}.")
        schedule.append(list(actions))
    return schedule


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
        compare(ps.bubble_fraction(timeline), ps.theory_bubble(p, m),
                f"with p={p}, m={m}, the simulated bubble fraction", atol=1e-9, rtol=1e-9)
    # The same lists, run for real: send/recv must pair up and training must equal one process.
    schedule = _learner_schedule(fn, run_p, run_m)
    x, y = regression_data(40, SIZES[0], SIZES[-1], seed=3)
    batches = batches_of(x, y, 23, 2)      # 23 samples: micro-batches of unequal sizes
    got = run_learner(_train_with, run_p, schedule, batches, run_m, name="one_f_one_b_stage",
                      timeout=120)
    _compare_runs(got, _reference(batches), f"running your schedule on {run_p} ranks")
    passed(f"your 1F1B lists are valid for (p, m) in {list(cases)}, hold at most p - stage "
           f"micro-batches, reach the bubble (p-1)/(m+p-1), and train exactly like one process "
           f"on {run_p} real ranks.")


# ---- exercise 2: the send/recv of one pipeline step ------------------------------------------------

def _step_on_rank(rank, world_size, fn, batch):
    x, y = batch
    parts = pp.split_model(make_mlp(SIZES, seed=0).double().net, world_size)
    shapes = pp._output_shapes(parts, (SIZES[0],), torch.float64)
    in_shape = None if rank == 0 else (len(x), *shapes[rank - 1])
    stage = parts[rank]
    loss = fn(stage, x.double(), y.double(), rank, world_size, in_shape)
    if isinstance(loss, torch.Tensor):
        loss = loss.item()
    grads = {f"net.{n}": (p.grad.clone() if p.grad is not None else None)
             for n, p in stage.named_parameters()}
    return loss, grads


def check_pipeline_step(fn, world_sizes=(2, 3, 4)):
    """fn(stage, x, y, rank, world_size, in_shape) -> loss on the last rank; grads in .grad."""
    x, y = regression_data(12, SIZES[0], SIZES[-1], seed=5)
    expected = _reference([(x, y)])[0]
    for ws in world_sizes:
        got = run_learner(_step_on_rank, ws, fn, (x, y), name="pipeline_step", timeout=120)
        loss = got[ws - 1][0]
        if loss is None:
            raise CheckFailed(f"with world_size={ws}, the last rank returned None: it computes "
                              f"the loss and should return it.")
        compare(loss, expected["loss"], f"with world_size={ws}, the loss on rank {ws - 1}",
                atol=1e-10, rtol=1e-9)
        for rank, (_, grads) in enumerate(got):
            for name, g in grads.items():
                if g is None:
                    raise CheckFailed(f"with world_size={ws}, rank {rank} has no gradient for "
                                      f"{name}: did its backward run?")
                compare(g, expected["grads"][name],
                        f"with world_size={ws}, rank {rank}, gradient of {name}",
                        atol=1e-10, rtol=1e-9)
    passed(f"pipeline_step passes activations forward and gradients backward correctly on "
           f"{sizes_phrase(world_sizes)} ranks: the loss and every gradient equal one process's.")
