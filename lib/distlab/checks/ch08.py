"""Checkers for workbook 08: the interleaved 1F1B lists, the bubble of a pipeline whose last
stage is slow (predicted before it is simulated), and the number of micro-batches to choose.

None of the three answers is on the chapter's page: the chapter shows `one_f_one_b` and `zb_h1`
and only describes interleaving (its placement, warm-up depth, memory and bubble); its bubble
formulas assume equal stages.

- `check_interleaved`: the learner's lists for several (p, m, v) are judged by the checker's own
  simulator (`ch08_sim`, not the chapter's): every action once, each backward after its forward,
  messages received in the order they are sent, no deadlock (the waiting cycle is named), the
  memory of interleaved 1F1B (at most 2(p-1-r) + (v-1)p + 1 chunks held on rank r), and a bubble
  no larger than (p-1)/(vm+p-1); then the lists train a model on 3 real ranks, equal to one
  process in float64.
- `check_slow_stage_bubble`: the learner's formula bubble(p, m, k) for 1F1B when the last stage
  (LM head and loss) costs k times the others is compared with the simulated run and the closed
  form on a grid; a wrong formula is inverted into the step time it implies, and the message
  says which term is off: the per-micro-batch (steady-state) term or the fill/drain term.
- `check_choose_m`: the fewest micro-batches that divide the pipeline's samples, meet a bubble
  target and fit an activation budget, or None; compared with an exhaustive search.

The course's schedules and simulators, and this checker's own helpers, refuse to run inside the
learner's function - also when loaded again (`importlib.reload`, another module name): a call
into their files is caught by a trace hook, not only by name.
"""
import contextlib
import math
import numbers
import os
import sys

import torch
import torch.nn.functional as F

from .. import pipeline_parallel as pp
from .. import pipeline_schedules as ps
from ..models import batches_of, make_mlp, regression_data
from . import CheckFailed, UsedCourseCode, call_learner, compare, forbid, passed, run_learner
from . import ch08_sim as sim

SIZES = (16, 24, 24, 24, 24, 24, 24, 4)   # 13 layers: enough to cut into p * v = 6 pieces


# ---- refusing the course's answers, however they were loaded ----------------------------------

def _course_code():
    return [ps.gpipe, ps.one_f_one_b, ps.interleaved_1f1b, ps.zb_h1, ps.make_schedule,
            ps.simulate, ps.bubble_fraction, ps.theory_bubble, ps.zb_h1_bubble, ps.theory,
            sim.simulate, sim.bubble, _closed_form, _simulated_bubble, slow_stage_run, _best_m,
            _reference, pp.PipelineStage, pp.train]


# Names of the functions above, refused in any module loaded from these files (a reload or a
# copy under another module name has new code objects, which `forbid` cannot swap).
_REFUSED_NAMES = {"gpipe", "one_f_one_b", "interleaved_1f1b", "nth", "zb_h1", "make_schedule",
                  "simulate", "bubble_fraction", "theory_bubble", "zb_h1_bubble", "theory",
                  "bubble", "_closed_form", "_simulated_bubble", "_best_m", "_reference",
                  "_one_f_one_b_slow_last", "slow_stage_run", "train", "step"}
_COURSE_FILES = {os.path.realpath(f) for f in (sim.__file__, __file__)} | {
    # a course module that is a package counts with every file in it
    os.path.realpath(os.path.join(d, f)) for mod in (ps, pp)
    for d in getattr(mod, "__path__", []) for f in os.listdir(d) if f.endswith(".py")} | {
    os.path.realpath(mod.__file__) for mod in (ps, pp)}


@contextlib.contextmanager
def _refused(exercise):
    def tracer(frame, event, arg):
        code = frame.f_code
        if event == "call" and code.co_name in _REFUSED_NAMES and \
                os.path.realpath(code.co_filename) in _COURSE_FILES:
            raise UsedCourseCode(f"your function called the course's own {code.co_name} "
                                 f"(from {os.path.basename(code.co_filename)}); the exercise "
                                 f"is to {exercise}.")
        return None
    previous = sys.gettrace()
    with forbid(*_course_code(), exercise=exercise):
        sys.settrace(tracer)
        try:
            yield
        finally:
            sys.settrace(previous)


def _call(fn, name, exercise, *args):
    with _refused(exercise):
        return call_learner(fn, *args, name=name)


def _number(value, what):
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        value = value.item()
    if not isinstance(value, numbers.Real) or isinstance(value, bool):
        raise CheckFailed(f"{what} should be a number; got {type(value).__name__} {value!r}.")
    return float(value)


# ---- exercise 1: interleaved 1F1B ---------------------------------------------------------------

INTERLEAVED_CASES = ((2, 4, 2), (3, 6, 2), (4, 8, 2), (4, 8, 4), (3, 6, 3), (5, 10, 2),
                     (4, 4, 2), (2, 2, 3), (3, 3, 1))


def _memory_limit(p, m, v, r):
    """Chunks rank r holds at most in interleaved 1F1B: its warm-up forwards, plus one."""
    return min(2 * (p - 1 - r) + (v - 1) * p + 1, m * v)


def _learner_lists(fn, p, m, v):
    schedule = []
    for r in range(p):
        actions = _call(fn, "interleaved_stage", "write the interleaved lists yourself",
                        p, m, v, r)
        if not isinstance(actions, (list, tuple)):
            raise CheckFailed(f"interleaved_stage({p}, {m}, {v}, {r}) should return a list of "
                              f"actions like ('F', 0, 1); got {type(actions).__name__}.")
        schedule.append(list(actions))
    return schedule


def _first_late(timeline, p, m, v):
    """The first action (in time) that starts later than in Megatron's interleaved 1F1B."""
    reference = sim.simulate(sim.normalize(ps.interleaved_1f1b(p, m, v)), m,
                             lambda r, a: (1.0 if a.kind == "F" else 2.0) / v, v)
    when = {(e["rank"], e["kind"], e["mb"], e["chunk"]): e["start"] for e in reference}
    late = [e for e in timeline if e["start"] > when[e["rank"], e["kind"], e["mb"], e["chunk"]]
            + 1e-9]
    e = min(late, key=lambda e: (e["start"], e["rank"]))
    return e, when[e["rank"], e["kind"], e["mb"], e["chunk"]]


def _judge_interleaved(schedule, p, m, v):
    case = f"with p={p}, m={m}, v={v}"
    try:
        steps = sim.normalize(schedule, p)
        sim.validate(steps, m, v)
        for r in range(p):
            held, limit = sim.peak_held(steps[r]), _memory_limit(p, m, v, r)
            if held > limit:
                raise CheckFailed(
                    f"{case}, rank {r} holds {held} chunks' activations at once; interleaved "
                    f"1F1B holds at most min(2(p-1-r) + (v-1)p + 1, mv) = {limit} on rank {r}: "
                    f"after its warm-up a rank alternates one forward and one backward, so it "
                    f"frees one chunk for each it adds.")
        # a chunk is 1/v of a stage: a forward costs 1/v, a backward 2/v
        timeline = sim.simulate(steps, m, lambda r, a: (1.0 if a.kind == "F" else 2.0) / v, v)
    except sim.ScheduleError as e:
        raise CheckFailed(f"{case}: {e}") from None
    got, best = sim.bubble(timeline, p), (p - 1) / (v * m + p - 1)
    if got > best + 1e-9:
        e, could = _first_late(timeline, p, m, v)
        a = sim.Step(e["kind"], e["mb"], e["chunk"])
        raise CheckFailed(
            f"{case}, your schedule's bubble is {got:.3f}; interleaved 1F1B reaches "
            f"(p-1)/(vm+p-1) = {best:.3f}. The first action to start late: rank {e['rank']}'s "
            f"step {e['step']} ({sim.describe(a, v)}) starts at {e['start'] * v:.3g} "
            f"chunk-forward times; in interleaved 1F1B it starts at {could * v:.3g} - a rank "
            f"idles whenever the next action on its list waits for an input while another it "
            f"could run is ready.")
    return timeline


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
    for step, exp in enumerate(expected):
        losses = [r[step]["loss"] for r in got if r[step]["loss"] is not None]
        compare(losses[0], exp["loss"], f"{context}, step {step}, the loss", atol=1e-10, rtol=1e-9)
        for rank, r in enumerate(got):
            for what in ("grads", "params"):
                for name, value in r[step][what].items():
                    label = "gradient of" if what == "grads" else "after the update,"
                    compare(value, exp[what][name], f"{context}, step {step}, rank {rank}, "
                            f"{label} {name}", atol=1e-10, rtol=1e-9)


def _train_with(rank, world_size, schedule, batches, m, v):
    return pp.train(rank, world_size, lambda p, mm: schedule, make_mlp(SIZES, seed=0), batches,
                    m, (SIZES[0],), v=v, dtype=torch.float64)


def check_interleaved(fn, cases=INTERLEAVED_CASES, run=(3, 6, 2)):
    """fn(p, m, v, rank) -> rank's interleaved 1F1B actions; simulated, then trained on ranks."""
    for p, m, v in cases:
        _judge_interleaved(_learner_lists(fn, p, m, v), p, m, v)
    if run is None:          # (the tests' shortcut for wrong answers: no ranks to start)
        return
    p, m, v = run
    schedule = _learner_lists(fn, p, m, v)
    x, y = regression_data(36, SIZES[0], SIZES[-1], seed=3)
    batches = batches_of(x, y, 18, 2)
    got = run_learner(_train_with, p, schedule, batches, m, v, name="interleaved_stage",
                      timeout=120)
    _compare_runs(got, _reference(batches), f"running your schedule on {p} ranks with v={v}")
    passed(f"your interleaved lists run without deadlock for (p, m, v) in {list(cases)}, hold no "
           f"more than 2(p-1-r) + (v-1)p + 1 chunks on rank r, reach the bubble (p-1)/(vm+p-1), "
           f"and train exactly like one process on {p} real ranks with v={v}.")


# ---- exercise 2: the bubble when the last stage is slow -----------------------------------

def _one_f_one_b_slow_last(p, m):
    """The 1F1B lists, written here so the check never runs the learner's or the chapter's."""
    lists = []
    for r in range(p):
        ahead, steps, f = p - 1 - r, [], 0
        for b in range(m):
            while f < m and f <= b + ahead:
                steps.append(sim.Step("F", f, 0))
                f += 1
            steps.append(sim.Step("B", b, 0))
        lists.append(steps)
    return lists


def slow_stage_run(p, m, k):
    """The simulated 1F1B run with a slow last stage, as rows for distlab.viz.pipeline.gantt (for
    the workbook, after the check: the run the prediction was about)."""
    timeline = sim.simulate(_one_f_one_b_slow_last(p, m), m,
                            lambda r, a: (1.0 if a.kind == "F" else 2.0) * (k if r == p - 1 else 1))
    return [dict(e, stage=e["rank"]) for e in timeline]


def _simulated_bubble(p, m, k):
    """1F1B with F = 1, B = 2 on every stage, k times that on the last one."""
    return sim.bubble(slow_stage_run(p, m, k), p)


def _closed_form(p, m, k):
    """Step time (p-1) + m k stage-times (fill and drain through the other stages, then the
    slow stage busy without pause); work m (p - 1 + k)."""
    return 1 - m * (p - 1 + k) / (p * (p - 1 + m * k))


SLOW_CASES = [(p, m, k) for k in (1.0, 2.0, 1.5, 3.0) for p in (2, 3, 4, 5, 8)
              for m in (1, 2, 4, 8, 16)]


def _implied_step(fn, p, m, k):
    """The step time (in stage-times) a bubble b implies: the work m (p-1+k) over p (1-b)."""
    b = _number(_call(fn, "slow_stage_bubble", "work the bubble out yourself", p, m, k),
                f"slow_stage_bubble({p}, {m}, {k:g})")
    return m * (p - 1 + k) / (p * (1 - b)) if b < 1 else math.inf


def _which_term(fn, p, k):
    """Fit the learner's implied step time T(m) = ramp + m * per_mb between m = 8 and m = 16."""
    t8, t16 = _implied_step(fn, p, 8, k), _implied_step(fn, p, 16, k)
    if not (math.isfinite(t8) and math.isfinite(t16)):
        return []
    per_mb = (t16 - t8) / 8
    ramp = t8 - 8 * per_mb
    wrong = []
    if not math.isclose(per_mb, k, rel_tol=1e-6, abs_tol=1e-9):
        mean = (p - 1 + k) / p
        like = (" - the mean stage's cost, as if the work spread evenly over the stages"
                if math.isclose(per_mb, mean, rel_tol=1e-6) else "")
        wrong.append(f"the steady-state term is off: your formula implies each extra "
                     f"micro-batch adds {per_mb:.4g} stage-times to the step{like}; it adds k = "
                     f"{k:g}: once the pipeline is full it runs at its slowest stage's pace, and "
                     f"the last stage never waits")
    if not math.isclose(ramp, p - 1, rel_tol=1e-6, abs_tol=1e-6):
        wrong.append(f"the fill/drain term is off: your formula implies {ramp:.4g} stage-times "
                     f"of fill and drain; it is p - 1 = {p - 1}: the first micro-batch's forward "
                     f"and the last one's backward each cross the p - 1 other stages once, at "
                     f"their own cost (the slow stage's k is all in the steady part)")
    return wrong


def check_slow_stage_bubble(fn, cases=SLOW_CASES):
    """fn(p, m, k) -> the bubble fraction of 1F1B whose last stage costs k times the others."""
    for p, m, k in cases:
        truth = _simulated_bubble(p, m, k)
        assert math.isclose(truth, _closed_form(p, m, k), abs_tol=1e-12)   # the checker's own proof
        b = _number(_call(fn, "slow_stage_bubble", "work the bubble out yourself", p, m, k),
                    f"slow_stage_bubble({p}, {m}, {k:g})")
        if math.isclose(b, truth, rel_tol=1e-6, abs_tol=1e-9):
            continue
        case = (f"with p={p}, m={m}, k={k:g}, your formula gives {b:.4f}; the simulated 1F1B run "
                f"idles {truth:.4f} of the time (closed form {_closed_form(p, m, k):.4f})")
        if k == 1:
            case += f", and with equal stages that is the chapter's (p-1)/(m+p-1)"
        if not 0 <= b < 1:
            raise CheckFailed(f"{case}: a bubble is a share of the ranks' time, between 0 and 1.")
        wrong = _which_term(fn, p, k)
        raise CheckFailed(f"{case}; " + ("; ".join(wrong) if wrong else
                                         "your formula is off at this m only") + ".")
    passed(f"your formula matches the simulated 1F1B run and the closed form on {len(cases)} "
           f"cases (p up to 8, m up to 16, the last stage 1 to 3 times slower).")


# ---- exercise 3: choosing m --------------------------------------------------------------------

CHOOSE_CASES = [  # p, k, gbs, dp, target, budget (samples of activations on rank 0)
    (4, 1.0, 512, 4, 0.2, 128), (4, 2.0, 512, 4, 0.45, 128), (4, 2.0, 512, 4, 0.2, 128),
    (8, 1.5, 1024, 2, 0.35, 512), (8, 1.5, 1024, 2, 0.35, 32), (3, 1.0, 96, 2, 0.25, 48),
    (3, 1.0, 96, 2, 0.01, 48), (5, 3.0, 600, 5, 0.6, 60), (2, 1.0, 64, 8, 0.34, 8),
    (4, 1.0, 512, 4, 0.2, 10), (5, 1.25, 960, 3, 0.3, 40)]


def _fits(p, m, n, budget):
    return min(p, m) * n / m <= budget + 1e-9


def _best_m(p, k, gbs, dp, target, budget):
    n = gbs // dp
    for m in range(1, n + 1):
        if n % m == 0 and _closed_form(p, m, k) <= target + 1e-12 and _fits(p, m, n, budget):
            return m
    return None


def check_choose_m(fn, cases=CHOOSE_CASES):
    """fn(p, k, gbs, dp, target, budget) -> the fewest micro-batches that meet both, or None."""
    for p, k, gbs, dp, target, budget in cases:
        n = gbs // dp
        got = _call(fn, "choose_m", "choose m yourself", p, k, gbs, dp, target, budget)
        best = _best_m(p, k, gbs, dp, target, budget)
        case = (f"with p={p}, k={k:g}, gbs={gbs}, dp={dp} ({n} samples per pipeline), target "
                f"bubble {target:g}, budget {budget} samples on rank 0")
        if got is None and best is None:
            continue
        if got is None:
            raise CheckFailed(f"{case}: you returned None, but m={best} (micro-batches of "
                              f"{n // best}) meets both: bubble {_closed_form(p, best, k):.3f}, "
                              f"rank 0 holds {min(p, best) * n // best} samples.")
        if isinstance(got, bool) or not isinstance(got, numbers.Integral):
            raise CheckFailed(f"{case}: choose_m should return a whole number of micro-batches "
                              f"or None; got {type(got).__name__} {got!r}.")
        got = int(got)
        if got < 1 or n % got:
            raise CheckFailed(f"{case}: m={got} does not cut the {n} samples of a pipeline into "
                              f"equal micro-batches (m must divide gbs / dp = {n}).")
        bubble = _closed_form(p, got, k)
        if bubble > target + 1e-12:
            raise CheckFailed(f"{case}: m={got} leaves a bubble of {bubble:.3f}, above the "
                              f"target {target:g} (the last stage's k counts: use your "
                              f"slow_stage_bubble).")
        if not _fits(p, got, n, budget):
            raise CheckFailed(f"{case}: with m={got} rank 0 holds min(p, m) = {min(p, got)} "
                              f"micro-batches of {n // got} samples = {min(p, got) * n // got}, "
                              f"above the budget of {budget}.")
        if best is not None and got != best:
            raise CheckFailed(f"{case}: m={got} works, but m={best} does too with fewer, larger "
                              f"micro-batches ({n // best} samples each - bigger matrix products "
                              f"use the GPU better): return the fewest.")
        assert best is not None
    passed(f"choose_m picks the fewest micro-batches meeting the bubble target and the memory "
           f"budget (or None) in all {len(cases)} cases.")
