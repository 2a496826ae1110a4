"""Property-based tests of the pipeline schedules and the simulator (pure: no processes).

For every schedule generator and random (p, m, v): the order is valid by a checker written
here (not ps.validate), the simulator runs it without a deadlock and its timeline keeps every
dependency, and the bubble is at least the schedule's closed form. Orders no generator makes
(random executions of the pipeline) never deadlock the simulator either. Cases a schedule
cannot run, m < p among them, are refused in a sentence.
"""
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from distlab import pipeline_schedules as ps

EXAMPLES = settings(max_examples=40, deadline=None)
EPS = 1e-9

# name -> (generator, chunks per stage)
GENERATORS = {"GPipe": (ps.gpipe, 1), "1F1B": (ps.one_f_one_b, 1), "ZB-H1": (ps.zb_h1, 1),
              "ZB-V": (ps.zb_v, 2), "DualPipeV": (ps.dualpipe_v, 2), "DualPipe": (ps.dualpipe, 2)}


def _lanes(p, m, v, placement):
    """Every (micro-batch, virtual stage) the schedule must run, with the (stage, chunk) that
    holds it: each micro-batch crosses every piece once (in the dual placement on the copy of
    its direction)."""
    n = ps.n_pieces(p, v, placement)
    return {(mb, vs): ps.stage_of(vs, p, placement, ps.direction(mb, m))
            for mb in range(m) for vs in range(n)}


def _check_valid(schedule, p, m, v, placement):
    """Each (stage, micro-batch) op exactly once, F before its B (or I before W), on the stage
    that holds the piece; returns {(kind, mb, vs): stage}."""
    assert len(schedule) == p
    lanes = _lanes(p, m, v, placement)
    ops = {}
    for r, actions in enumerate(schedule):
        done = set()
        for a in actions:
            vs = ps.virtual_stage(r, a.chunk, p, placement)
            assert lanes.get((a.mb, vs)) == (r, a.chunk), f"stage {r} runs {a!r}, not its piece"
            key = (a.kind, a.mb, vs)
            assert key not in ops, f"{a!r} twice"
            needs = {"F": (), "B": ("F",), "I": ("F",), "W": ("I",)}[a.kind]
            assert all((k, a.mb, vs) in done for k in needs), f"stage {r}: {a!r} too early"
            done.add(key)
            ops[key] = r
    for (mb, vs), (r, c) in lanes.items():
        assert ("F", mb, vs) in ops, f"F{mb} of piece {vs} missing"
        split = ("I", mb, vs) in ops
        assert (("B", mb, vs) in ops) != split and split == (("W", mb, vs) in ops), \
            f"micro-batch {mb} of piece {vs}: one B, or one I and one W"
    return ops


def _check_timeline(timeline, schedule, p, m, v, placement):
    """The simulated times keep every dependency across stages, and each stage runs its list
    in order, one action at a time."""
    n = ps.n_pieces(p, v, placement)
    at = {}
    for e in timeline:
        vs = ps.virtual_stage(e["stage"], e["chunk"], p, placement)
        at[e["kind"], e["mb"], vs] = e
    for (kind, mb, vs), e in at.items():
        back = at.get(("B", mb, vs)) or at.get(("I", mb, vs))
        if kind == "F" and vs > 0:
            assert e["start"] >= at["F", mb, vs - 1]["end"] - EPS
        if kind in "BI":
            assert e["start"] >= at["F", mb, vs]["end"] - EPS
            if vs < n - 1:
                later = at.get(("B", mb, vs + 1)) or at.get(("I", mb, vs + 1))
                assert e["start"] >= later["end"] - EPS
        if kind == "W":
            assert e["start"] >= back["end"] - EPS
    for r in range(p):
        mine = [e for e in timeline if e["stage"] == r]
        assert [(e["kind"], e["mb"], e["chunk"]) for e in mine] == \
            [tuple(a) for a in schedule[r]]
        for a, b in zip(mine, mine[1:]):
            assert a["end"] <= b["start"] + EPS


def _run(schedule, p, m, v, placement, **times):
    _check_valid(schedule, p, m, v, placement)
    timeline = ps.simulate(schedule, m, **times)            # raises on a deadlock
    _check_timeline(timeline, schedule, p, m, v, placement)
    return timeline


def _times(draw, split):
    """A stage's F and B times, W no longer than the rest of B (nor than F), a message time."""
    t_f = draw(st.floats(0.1, 4.0))
    t_i = draw(st.floats(0.1, 4.0))
    t_w = draw(st.floats(0.05, min(t_f, t_i))) if split else t_i / 2
    return dict(t_f=t_f, t_b=t_i + t_w, t_w=t_w, comm=draw(st.sampled_from([0.0, 0.0, 0.3])))


# ---- every generator: valid, no deadlock, bubble at least its closed form ----------------------

@EXAMPLES
@given(name=st.sampled_from(list(GENERATORS)), p=st.integers(1, 6), m=st.integers(1, 14),
       data=st.data())
def test_every_generated_order_is_valid_and_runs(name, p, m, data):
    make, v = GENERATORS[name]
    try:
        schedule = make(p, m)
    except ValueError as e:                                  # refused: checked below
        assert (name, str(e)) == (name, _refusal(name, p, m)), str(e)
        return
    assert _refusal(name, p, m) is None, f"{name} ran p={p}, m={m}"
    placement = ps.placement_of(schedule)
    times = _times(data.draw, split=name not in ("GPipe", "1F1B"))
    timeline = _run(schedule, p, m, v, placement, **times)
    bound = _bound(name, p, m, times)
    if bound is not None:
        assert ps.bubble_fraction(timeline) >= bound - EPS


@EXAMPLES
@given(p=st.integers(1, 5), v=st.integers(1, 3), k=st.integers(1, 3), data=st.data())
def test_interleaved_orders_are_valid_and_run(p, v, k, data):
    m = k * p
    schedule = ps.interleaved_1f1b(p, m, v)
    times = _times(data.draw, split=False)
    timeline = _run(schedule, p, m, v, "loop", **times)
    assert ps.bubble_fraction(timeline) >= ps.theory_bubble(p, m, v) - EPS


def _refusal(name, p, m):
    """The sentence a generator must refuse (p, m) with, or None where it runs."""
    if name == "DualPipeV" and m < 2 * p:
        return (f"DualPipeV needs at least 2p = {2 * p} micro-batches (one per virtual stage, "
                f"so the two directions of the V both fill); got m={m}.")
    if name == "DualPipe" and (p % 2 or m % 2 or m < 2 * p):
        return (f"DualPipe needs an even number of stages and an even number of micro-batches, "
                f"at least 2p = {2 * p} (half enter at each end); got p={p}, m={m}.")
    return None


def _bound(name, p, m, times):
    """The closed form's idle fraction where the schedule has one for these times."""
    t_f, t_b, t_w = times["t_f"], times["t_b"], times["t_w"]
    if name in ("GPipe", "1F1B"):
        return ps.theory_bubble(p, m)
    if name == "ZB-H1" and m >= p:
        return ps.zb_h1_bubble(p, m, t_f, t_b - t_w, t_w)
    if name in ("ZB-V", "DualPipeV") and m >= 2 * p - 1 and t_f == t_b - t_w == t_w:
        return ps.zb_v_bubble(p, m)
    return None


@EXAMPLES
@given(name=st.sampled_from(["ZB-V", "DualPipeV"]), p=st.integers(1, 5), extra=st.integers(0, 6),
       scale=st.floats(0.1, 3.0), comm=st.sampled_from([0.0, 0.25]))
def test_v_schedules_bubble_at_least_zb_v_closed_form(name, p, extra, scale, comm):
    """F = I = W (the closed form's assumption), any unit, any message time."""
    m = 2 * p + extra
    timeline = _run(GENERATORS[name][0](p, m), p, m, 2, "v", t_f=scale, t_b=2 * scale,
                    t_w=scale, comm=comm)
    assert ps.bubble_fraction(timeline) >= ps.zb_v_bubble(p, m) - EPS


def _idle_per_stage(timeline):
    span = max(e["end"] for e in timeline) - min(e["start"] for e in timeline)
    return max(span - sum(e["end"] - e["start"] for e in timeline if e["stage"] == r)
               for r in {e["stage"] for e in timeline})


@EXAMPLES
@given(half=st.integers(1, 3), extra=st.integers(0, 3), t_f=st.floats(0.2, 3.0),
       w=st.floats(0.1, 1.0), hidden=st.floats(0.0, 1.0), comm=st.sampled_from([0.0, 0.25]))
def test_dualpipe_idle_at_least_the_reports_formula(half, extra, t_f, w, hidden, comm):
    """Pairs run as units, I = F and W <= F (the formula's assumptions): each stage idles at
    least (p/2 - 1)(F&B + B - 3W), for DualPipe on 2k ranks and DualPipeV on k."""
    p, t_w = 2 * half, w * t_f
    m = 2 * p + 2 * extra
    t_b = t_f + t_w
    t_fb = t_f + t_b - hidden * min(t_f, t_b)           # the overlap hides up to the shorter
    formula = ps.dualpipe_bubble(p, t_f, t_b, t_w, t_fb)
    dual = ps.dualpipe(p, m)
    _check_valid(dual, p, m, 2, "dual")
    timeline = ps.simulate(dual, m, t_f, t_b, t_w, comm=comm, t_fb=t_fb)
    assert _idle_per_stage(timeline) >= formula - EPS
    v = ps.dualpipe_v(half, m // 2)
    timeline = ps.simulate(v, m // 2, 2 * t_f, 2 * t_b, 2 * t_w, comm=comm, t_fb=2 * t_fb)
    assert _idle_per_stage(timeline) >= formula - EPS


# ---- m < p, and what a schedule cannot run --------------------------------------------------------

@pytest.mark.parametrize("p, m", [(4, 1), (4, 3), (5, 2), (6, 5)])
def test_fewer_micro_batches_than_stages(p, m):
    """GPipe, 1F1B, ZB-H1 and ZB-V run m < p (a deeper bubble); interleaved 1F1B, DualPipeV and
    DualPipe refuse it in a sentence that says what they need."""
    for name in ("GPipe", "1F1B", "ZB-H1", "ZB-V"):
        make, v = GENERATORS[name]
        schedule = make(p, m)
        timeline = _run(schedule, p, m, v, ps.placement_of(schedule))
        if name in ("GPipe", "1F1B"):
            assert ps.bubble_fraction(timeline) == pytest.approx(ps.theory_bubble(p, m))
    with pytest.raises(ValueError, match=rf"^interleaved 1F1B sends micro-batches round in "
                                         rf"groups of p={p}, so m must be a multiple of {p}; "
                                         rf"got m={m}\.$"):
        ps.interleaved_1f1b(p, m, 2)
    for name in ("DualPipeV", "DualPipe"):
        with pytest.raises(ValueError) as e:
            GENERATORS[name][0](p, m)
        assert str(e.value) == _refusal(name, p, m)


# ---- orders no generator makes: random executions never deadlock the simulator ------------------

def _random_execution(rnd, p, m, v, placement):
    """Per-stage lists from one random run of the pipeline: at each step any action whose
    inputs exist runs, a receiver taking each link's messages in the order they were sent (as
    send/recv pair them); each backward is whole (B) or split (I, later W) at random."""
    n = ps.n_pieces(p, v, placement)
    lanes = _lanes(p, m, v, placement)
    split = {lane: rnd.random() < 0.5 for lane in lanes}
    todo = {(k, mb, vs) for (mb, vs) in lanes
            for k in (("F", "I", "W") if split[mb, vs] else ("F", "B"))}
    done, links = set(), {}
    schedule = [[] for _ in range(p)]

    def holder(mb, vs):
        return lanes[mb, vs][0]

    def head(src, dst, what, message):
        queue = links.get((src, dst, what), [])
        return src == dst or (queue and queue[0] == message)

    def ready(kind, mb, vs):
        r = holder(mb, vs)
        if kind == "F":
            return vs == 0 or (("F", mb, vs - 1) in done and
                               head(holder(mb, vs - 1), r, "act", (mb, vs)))
        if kind in "BI":
            if ("F", mb, vs) not in done:
                return False
            if vs == n - 1:
                return True
            after = ("B", mb, vs + 1) in done or ("I", mb, vs + 1) in done
            return after and head(holder(mb, vs + 1), r, "grad", (mb, vs))
        return ("I", mb, vs) in done

    while todo:
        kind, mb, vs = rnd.choice(sorted(a for a in todo if ready(*a)))
        r = holder(mb, vs)
        if kind == "F" and vs > 0 and holder(mb, vs - 1) != r:
            links[holder(mb, vs - 1), r, "act"].pop(0)
        if kind in "BI" and vs < n - 1 and holder(mb, vs + 1) != r:
            links[holder(mb, vs + 1), r, "grad"].pop(0)
        if kind == "F" and vs < n - 1 and holder(mb, vs + 1) != r:
            links.setdefault((r, holder(mb, vs + 1), "act"), []).append((mb, vs + 1))
        if kind in "BI" and vs > 0 and holder(mb, vs - 1) != r:
            links.setdefault((r, holder(mb, vs - 1), "grad"), []).append((mb, vs - 1))
        todo.remove((kind, mb, vs))
        done.add((kind, mb, vs))
        schedule[r].append(ps.Action(kind, mb, lanes[mb, vs][1]))
    return ps.Schedule(schedule, placement)


@EXAMPLES
@given(placement=st.sampled_from(["loop", "v", "dual"]), p=st.integers(1, 4),
       m=st.integers(1, 6), v=st.integers(1, 3), rnd=st.randoms(use_true_random=False),
       data=st.data())
def test_random_runnable_orders_never_deadlock(placement, p, m, v, rnd, data):
    if placement == "v":
        v = 2
    if placement == "dual":
        p, m, v = 2 * ((p + 1) // 2), 2 * ((m + 1) // 2), 2
    schedule = _random_execution(rnd, p, m, v, placement)
    _run(schedule, p, m, v, placement, **_times(data.draw, split=True))
