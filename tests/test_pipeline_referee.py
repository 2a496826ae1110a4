"""torch.distributed.pipelining as the referee of the course's schedules and simulator (pure: one
process, no process group; torch 2.13).

What torch has, and how it is read here without ranks:
- The one-stage schedules (ScheduleGPipe, Schedule1F1B) run their order in `_step_microbatches`;
  it is recorded with a stand-in stage whose forward/backward note what they were asked for (the
  truth of what torch runs). Their `pipeline_order` attribute is a description only, never run.
- The multi-stage schedules (ScheduleInterleaved1F1B, ScheduleLoopedBFS,
  ScheduleInterleavedZeroBubble, ScheduleZBVZeroBubble, ScheduleDualPipeV) build `pipeline_order`
  in their constructor from the stages' group_size / group_rank / num_stages alone: they are
  built for real with stand-in stages, which also runs torch's own validation and its lowering
  to send/recv (the order their runtime executes).
- `_add_send_recv` lowers a compute order to one with SEND/RECV actions, and
  `_simulate_comms_compute` dry-runs such an order in lock step.

Compared (the names map: torch's stage index s is the course's virtual stage, its rank and chunk
given by the placement, "loop" for the interleaved ones and "v" for ZB-V and DualPipeV; torch's
F/B/I/W are the course's; an OVERLAP_F_B pair is its forward, then its backward, as the course
writes DualPipeV's pairs):
1. The order of compute actions on every rank: equal for GPipe, 1F1B, interleaved 1F1B, ZB-H1
   (torch's ScheduleInterleavedZeroBubble with one stage per rank), ZB-V and DualPipeV. Where
   they differ by design (torch's interleaved 1F1B at v = 1, LoopedBFS), the test says how and
   compares what must agree: the actions, their validity, the micro-batches in flight. Where
   torch runs what the course refuses (interleaved with m not a multiple of p), the course's
   simulator runs torch's order.
2. The messages: torch's SEND/RECV lowering equals the course's `_messages` (who sends what to
   whom, in which order).
3. Deadlocks: on random per-rank orders both simulators call the same ones deadlocked.
4. Time. torch's simulator does not model durations: it counts lock-step steps, one action per
   rank per step, every action one step (F, B, I, W alike), and a SEND or a RECV takes a step
   of its rank like a forward does (a RECV may share its SEND's step). So its idle steps and the
   course's bubble are different numbers by construction, and no tolerance makes them one: at
   p=4, m=8 the course's bubble is 3/11 for GPipe and for 1F1B; torch takes 56 steps for GPipe
   (idle 8/28 of rank-steps) and 61 for 1F1B (21/61): the middle ranks pay a RECV and a SEND
   step for every action, and 1F1B's alternation leaves more of them waiting
   (`test_torchs_steps_are_not_the_course_bubble` pins these). What holds exactly: (a) torch's
   step for every action is at least its start in the course's timeline with unit actions and a
   message costing 1 (proved in `test_torch_steps_never_beat_the_course_timeline`); (b) for any
   durations, the course's timeline is the earliest one on the dependencies torch's lowering
   gives each action (its RECVs, and their SENDs' producers).

Found on the way (pinned below so that a change in torch shows): Schedule1F1B's descriptive
`pipeline_order` names forwards 1..m on the last rank (off by one: micro-batch m does not exist,
0 is never run); its runtime order is right and is the course's.
"""
from types import SimpleNamespace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.distributed.pipelining import schedules as S

from distlab import pipeline_schedules as ps

EXAMPLES = settings(max_examples=60, deadline=None)
EPS = 1e-9
KIND = {"F": S.F, "B": S.B, "I": S.I, "W": S.W}
COMPUTE = set(KIND.values())


# ---- reading torch's orders without ranks -------------------------------------------------------

def _stages(p, v):
    """Stand-ins for the v stages a rank holds: what the schedules' constructors read."""
    return [SimpleNamespace(group_size=p, group_rank=0, num_stages=p * v, submod=None,
                            stage_index=i, stage_index_to_group_rank=None) for i in range(v)]


def _multi(cls, p, m, v):
    """A multi-stage schedule built for real (its constructor validates and lowers the order)."""
    return cls(_stages(p, v), m)


class _Recorder:
    """A one-stage schedule's stage that notes each forward / backward it is asked to run."""

    def __init__(self, r, p):
        self.stage_index, self.num_stages, self.group_size, self.group_rank = r, p, p, r
        self.submod, self.is_last, self.ops = None, r == p - 1, []

    def get_fwd_recv_ops(self, mb):
        return []
    get_fwd_send_ops = get_bwd_recv_ops = get_bwd_send_ops = get_fwd_recv_ops

    def forward_one_chunk(self, mb, *args, **kwargs):
        self.ops.append(ps.Action("F", mb))

    def backward_one_chunk(self, mb, **kwargs):
        self.ops.append(ps.Action("B", mb))

    def perform_reduce_grad(self, *args):
        pass


def _runtime_order(cls, p, m):
    """What ScheduleGPipe / Schedule1F1B run on each rank, and their descriptive pipeline_order."""
    ran, described = [], {}
    for r in range(p):
        stage = _Recorder(r, p)
        schedule = cls(stage, m)
        schedule._initialize_stage = lambda *args, **kwargs: None   # no tensors to shape
        schedule._step_microbatches()
        ran.append(stage.ops)
        described = schedule.pipeline_order           # the same on every rank
    return ran, described


def _placement_of(cls):
    return "v" if cls in (S.ScheduleZBVZeroBubble, S.ScheduleDualPipeV) else "loop"


def _as_course(order, p, placement):
    """torch's {rank: [_Action | None]} as the course's per-stage Action lists (None dropped,
    an OVERLAP_F_B pair as its sub-actions in order); also checks each stage sits where the
    course's placement puts it."""
    out = []
    for r in range(p):
        actions = []
        for a in filter(None, order[r]):
            for s in a.sub_actions if a.computation_type == S.OVERLAP_F_B else (a,):
                if s.computation_type not in COMPUTE:
                    continue                                # REDUCE_GRAD
                rank, chunk = ps.stage_of(s.stage_index, p, placement)
                assert rank == r, f"torch runs stage {s.stage_index} on rank {r}, not {rank}"
                actions.append(ps.Action(s.computation_type.value, s.microbatch_index, chunk))
        out.append(actions)
    return out


def _as_torch(schedule, p, placement):
    """The course's schedule as torch's compute-only {rank: [_Action]}."""
    return {r: [S._Action(ps.virtual_stage(r, a.chunk, p, placement), KIND[a.kind], a.mb)
                for a in actions] for r, actions in enumerate(schedule)}


def _lower(schedule, p, v, placement):
    """torch's lowering of the course's order to one with SEND/RECV, and its stage -> rank."""
    def rank(s):
        return ps.stage_of(s, p, placement)[0]
    return S._add_send_recv(_as_torch(schedule, p, placement), rank, p * v), rank


# ---- 1. the order of compute actions ------------------------------------------------------------

@pytest.mark.parametrize("p", [1, 2, 3, 4])
def test_one_stage_schedules_run_the_course_order(p):
    """GPipe at any m, 1F1B at m >= p (torch refuses fewer micro-batches than stages; the course
    runs them with a shorter warm-up): torch's runtime order is the course's, rank by rank."""
    for m in range(1, 2 * p + 3):
        ran, described = _runtime_order(S.ScheduleGPipe, p, m)
        assert ran == ps.gpipe(p, m), (p, m)
        assert _as_course(described, p, "loop") == ran, (p, m)
        if m < p:
            with pytest.raises(ValueError, match="must be greater than or equal to the number"):
                S.Schedule1F1B(_Recorder(0, p), m)
            continue
        ran, described = _runtime_order(S.Schedule1F1B, p, m)
        assert ran == ps.one_f_one_b(p, m), (p, m)
        listed = _as_course(described, p, "loop")
        assert listed[:-1] == ran[:-1], (p, m)
        # torch's description of the last rank is off by one in its forwards (not what it runs)
        assert listed[-1] == [ps.Action(a.kind, a.mb + (a.kind == "F")) for a in ran[-1]], (p, m)


# (torch class, chunks per rank, p, m, the course's generator or None) for equal orders
SAME = [(S.ScheduleInterleaved1F1B, v, p, m, ps.interleaved_1f1b)
        for v in (2, 3) for p, m in [(2, 2), (2, 6), (3, 3), (3, 6), (4, 8)]] + \
       [(S.ScheduleInterleavedZeroBubble, 1, p, m, ps.zb_h1)      # ZB-H1 = ZB1P on one chunk
        for p, m in [(2, 1), (2, 4), (3, 2), (3, 4), (3, 5), (4, 3), (4, 6), (4, 8)]] + \
       [(S.ScheduleZBVZeroBubble, 2, p, m, ps.zb_v)
        for p, m in [(2, 1), (2, 3), (2, 5), (3, 7)]] + \
       [(S.ScheduleDualPipeV, 2, p, m, ps.dualpipe_v) for p, m in [(2, 4), (2, 5), (3, 7)]]


@pytest.mark.parametrize("cls, v, p, m, make", SAME,
                         ids=[f"{c.__name__}-v{v}-p{p}-m{m}" for c, v, p, m, _ in SAME])
def test_multi_stage_orders_are_the_course_orders(cls, v, p, m, make):
    ours = make(p, m, v) if make is ps.interleaved_1f1b else make(p, m)
    placement = ps.placement_of(ours)
    theirs = _multi(cls, p, m, v)
    assert theirs.stage_index_to_group_rank == \
        {s: ps.stage_of(s, p, placement)[0] for s in range(p * v)}
    assert _as_course(theirs.pipeline_order, p, placement) == [list(s) for s in ours]
    if cls is S.ScheduleDualPipeV:          # and the pairs DualPipe overlaps are the same
        pairs = []
        for r in range(p):
            pos, here = 0, set()
            for a in filter(None, theirs.pipeline_order[r]):
                if a.computation_type == S.OVERLAP_F_B:
                    here.add(pos)
                pos += len(a.sub_actions) if a.computation_type == S.OVERLAP_F_B else 1
            pairs.append(here)
        assert ours.pairs == pairs


@pytest.mark.parametrize("p, m, v", [(2, 3, 2), (3, 4, 2), (3, 5, 3), (4, 10, 2), (4, 6, 2)])
def test_interleaved_with_m_not_a_multiple_of_p(p, m, v):
    """torch's interleaved 1F1B runs in rounds of m // (m // p) micro-batches, so it takes some
    m that are not multiples of p; the course's refuses them. The course's simulator runs
    torch's order: valid, messages in order, no deadlock, every action once."""
    with pytest.raises(ValueError, match=f"must be a multiple of {p}; got m={m}"):
        ps.interleaved_1f1b(p, m, v)
    order = _as_course(_multi(S.ScheduleInterleaved1F1B, p, m, v).pipeline_order, p, "loop")
    timeline = ps.simulate(order, m, t_f=v, t_b=v)
    assert len(timeline) == 2 * m * p * v
    # its warm-up: (v - 1) rounds plus 2 per hop from the last rank, as torch's formula says,
    # then the first forward of the steady state before the first backward
    per_round = m // max(1, m // p)
    for r, actions in enumerate(order):
        ahead = next(i for i, a in enumerate(actions) if a.kind == "B")
        assert ahead == min((v - 1) * per_round + 2 * (p - 1 - r) + 1, m * v)


@pytest.mark.parametrize("p, m", [(2, 4), (3, 3), (3, 5), (4, 5), (4, 8)])
def test_where_torch_orders_differently(p, m):
    """Two legitimate differences, and what must still agree.

    torch's Interleaved1F1B with one stage per rank is a 1F1B whose warm-up is 2 (p - 1 - r)
    forwards (its multiply_factor of 2, meant for chunks), the course's 1F1B's is p - 1 - r:
    the same actions, both valid, but rank r holds min(2 (p - 1 - r) + 1, m) micro-batches where
    the course's holds min(p - r, m).
    torch's LoopedBFS with one stage per rank is GPipe running its backwards last-in first-out:
    the same actions, both valid, every rank holding all m micro-batches."""
    deep = _as_course(_multi(S.ScheduleInterleaved1F1B, p, m, 1).pipeline_order, p, "loop")
    ours = ps.one_f_one_b(p, m)
    bfs = _as_course(_multi(S.ScheduleLoopedBFS, p, m, 1).pipeline_order, p, "loop")
    gpipe = ps.gpipe(p, m)
    for r in range(p):
        assert sorted(deep[r]) == sorted(ours[r]) and sorted(bfs[r]) == sorted(gpipe[r])
        assert ps.peak_in_flight(deep[r]) == min(2 * (p - 1 - r) + 1, m)
        assert ps.peak_in_flight(ours[r]) == min(p - r, m)
        assert bfs[r][m:] == gpipe[r][m:][::-1] and bfs[r][:m] == gpipe[r][:m]
        assert ps.peak_in_flight(bfs[r]) == ps.peak_in_flight(gpipe[r]) == m
    for order in (deep, bfs):               # the course's checker and simulator accept both
        ps.validate(order, m)
        ps.check_message_order(order, p, 1)
        assert len(ps.simulate(order, m)) == 2 * m * p


# ---- 2. the messages ----------------------------------------------------------------------------

CASES = [("gpipe", ps.gpipe, 1, p, m) for p, m in [(2, 3), (4, 5)]] + \
        [("1f1b", ps.one_f_one_b, 1, p, m) for p, m in [(2, 1), (3, 5), (4, 8)]] + \
        [("interleaved", ps.interleaved_1f1b, v, p, m) for v, p, m in [(2, 2, 4), (3, 3, 6)]] + \
        [("zb_h1", ps.zb_h1, 1, p, m) for p, m in [(3, 2), (4, 7)]] + \
        [("zb_v", ps.zb_v, 2, p, m) for p, m in [(2, 3), (3, 6)]] + \
        [("dualpipe_v", ps.dualpipe_v, 2, p, m) for p, m in [(2, 4), (3, 7)]]


def _make(make, v, p, m):
    return make(p, m, v) if make is ps.interleaved_1f1b else make(p, m)


@pytest.mark.parametrize("name, make, v, p, m", CASES,
                         ids=[f"{n}-p{p}-m{m}" for n, _, _, p, m in CASES])
def test_torchs_send_recv_are_the_course_messages(name, make, v, p, m):
    """Per (sender, receiver, activation or gradient), the micro-batches and receiving virtual
    stages in order: torch's SEND actions in the sender's order and RECV actions in the
    receiver's order equal what the course's `_messages` says each stage sends and receives
    (for the course's own orders, which keep send order = receive order)."""
    schedule = _make(make, v, p, m)
    placement = ps.placement_of(schedule)
    lowered, rank = _lower(schedule, p, v, placement)
    sends, recvs = {}, {}
    for r, actions in lowered.items():
        for a in actions:
            s, t = a.stage_index, a.computation_type
            if t == S.SEND_F:
                sends.setdefault((r, rank(s + 1), "activation"), []).append((a.microbatch_index,
                                                                             s + 1))
            elif t == S.SEND_B:
                sends.setdefault((r, rank(s - 1), "gradient"), []).append((a.microbatch_index,
                                                                           s - 1))
            elif t == S.RECV_F:
                recvs.setdefault((rank(s - 1), r, "activation"), []).append((a.microbatch_index, s))
            elif t == S.RECV_B:
                recvs.setdefault((rank(s + 1), r, "gradient"), []).append((a.microbatch_index, s))
    assert (sends, recvs) == ps._messages(schedule, p, v, placement)


# ---- 3. deadlocks -------------------------------------------------------------------------------

@st.composite
def _random_orders(draw):
    """p stages, m micro-batches, one chunk: each stage runs its forwards in micro-batch order and
    its backwards (B, or I then W, chosen per stage and micro-batch) in micro-batch order,
    interleaved at random with each backward after its forward. Sends and receives then keep one
    order, so only a circular wait can stop a run."""
    p, m = draw(st.integers(2, 4)), draw(st.integers(1, 4))
    schedule = []
    for _ in range(p):
        split = [draw(st.booleans()) for _ in range(m)]
        f = b = 0
        actions, pending_w = [], []
        while f < m or b < m or pending_w:
            choices = (["F"] if f < m else []) + (["B"] if b < f else []) + \
                      (["W"] if pending_w else [])
            kind = draw(st.sampled_from(choices))
            if kind == "F":
                actions.append(ps.Action("F", f))
                f += 1
            elif kind == "B":
                actions.append(ps.Action("I" if split[b] else "B", b))
                if split[b]:
                    pending_w.append(b)
                b += 1
            else:
                actions.append(ps.Action("W", pending_w.pop(0)))
        schedule.append(actions)
    return p, m, schedule


def _course_verdict(schedule, m):
    try:
        ps.simulate(schedule, m, t_f=1, t_b=2, t_w=1)
    except ValueError as e:
        assert "deadlocks" in str(e), str(e)
        return "deadlock"
    return "runs"


def _torch_verdict(schedule, p):
    try:
        lowered, rank = _lower(schedule, p, 1, "loop")
    except AssertionError as e:
        assert "can't schedule sends/recvs" in str(e), str(e)
        return "deadlock"
    S._simulate_comms_compute(lowered, rank, p)             # raises if it does not progress
    return "runs"


def test_deadlock_examples():
    """Stage 0 waits for the gradient of micro-batch 0 before it sends micro-batch 1; stage 1
    wants micro-batch 1 before it sends that gradient: a circular wait for both simulators."""
    A = ps.Action
    stuck = [[A("F", 0), A("B", 0), A("F", 1), A("B", 1)],
             [A("F", 0), A("F", 1), A("B", 0), A("B", 1)]]
    assert _course_verdict(stuck, 2) == _torch_verdict(stuck, 2) == "deadlock"
    fine = [stuck[1], stuck[0]]
    assert _course_verdict(fine, 2) == _torch_verdict(fine, 2) == "runs"


@EXAMPLES
@given(case=_random_orders())
def test_both_simulators_call_the_same_orders_deadlocked(case):
    p, m, schedule = case
    assert _course_verdict(schedule, m) == _torch_verdict(schedule, p)


# ---- 4. time ------------------------------------------------------------------------------------

@pytest.mark.parametrize("name, make, v, p, m", CASES,
                         ids=[f"{n}-p{p}-m{m}" for n, _, _, p, m in CASES])
def test_torch_steps_never_beat_the_course_timeline(name, make, v, p, m):
    """torch's `_simulate_comms_compute` gives each rank one action per step, SEND and RECV
    included, every action one step (F, B, I and W alike). Each of its constraints is at least
    the course's with every compute action taking 1 and a message taking 1 (comm=1):
    - a rank runs its list in order, one step each: an action starts >= the previous one's end;
    - an input from another rank arrives by a RECV, which waits for the SEND (same step at the
      earliest), which is the step after the producing action: start >= producer's end + 1;
    - an input from the same rank (the V's turn, I before W) is earlier in the list.
    The course's simulator starts every action as early as these allow, so every action starts in
    torch at a step >= its course start, and torch's makespan >= the course's. The course's
    timeline is taken with durations below 1 only where it cannot say 1: its B is I + W, so in
    DualPipeV (which runs both B and I, W) B takes 1 and I, W 1/2 each, a relaxation that keeps
    the bound. Measured, the bound is loose by design (torch also spends steps on sends)."""
    schedule = _make(make, v, p, m)
    placement = ps.placement_of(schedule)
    lowered, rank = _lower(schedule, p, v, placement)
    steps = S._simulate_comms_compute(lowered, rank, p * v)
    start = {}
    for r, acts in steps.items():
        for i, a in enumerate(acts):
            if a is not None and a.computation_type in COMPUTE:
                start[a.computation_type.value, a.microbatch_index, a.stage_index] = i
    kinds = {a.kind for s in schedule for a in s}
    t_b, t_w = (2.0, 1.0) if kinds <= {"F", "I", "W"} else (1.0, 0.5)
    timeline = ps.simulate(schedule, m, t_f=v, t_b=t_b * v, t_w=t_w * v, comm=1.0)
    assert len(start) == len(timeline)
    for e in timeline:
        vs = ps.virtual_stage(e["stage"], e["chunk"], p, placement)
        assert start[e["kind"], e["mb"], vs] >= e["start"] - EPS, (e, start[e["kind"], e["mb"], vs])
    makespan = max(len(acts) for acts in steps.values())
    assert makespan >= max(e["end"] for e in timeline) - EPS


def _torch_inputs(lowered, p, v, placement):
    """From torch's lowering: what each compute action waits for. A RECV of (stage, micro-batch)
    feeds that stage's forward (RECV_F) or backward (RECV_B) of the micro-batch, and comes from
    the compute action its SEND follows; where two stages share a rank (the V's turn) torch's
    readiness rule reads the neighbour stage's action on the rank itself.
    Returns {(kind, mb, stage): [(producer key, remote)]} in the course's kinds."""
    def key(a):
        return a.computation_type.value, a.microbatch_index, a.stage_index
    made_by, feeds = {}, {}
    for acts in lowered.values():
        last = None
        for a in acts:
            if a.computation_type in COMPUTE:
                last = a
            elif a.computation_type in (S.SEND_F, S.SEND_B):
                assert (last.stage_index, last.microbatch_index) == \
                    (a.stage_index, a.microbatch_index), f"{a} does not follow its action"
                made_by[a.computation_type, a.stage_index, a.microbatch_index] = key(last)
    inputs = {}
    for acts in lowered.values():
        for a in acts:
            t, s, mb = a.computation_type, a.stage_index, a.microbatch_index
            if t == S.RECV_F:
                feeds.setdefault(("F", mb, s), []).append((made_by[S.SEND_F, s - 1, mb], True))
            elif t == S.RECV_B:
                feeds.setdefault(("B", mb, s), []).append((made_by[S.SEND_B, s + 1, mb], True))
    n = p * v
    rank = {s: ps.stage_of(s, p, placement)[0] for s in range(n)}
    for acts in lowered.values():
        for a in acts:
            if a.computation_type not in COMPUTE:
                continue
            k = key(a)
            got = list(feeds.get(("B" if k[0] in "BI" else k[0], k[1], k[2]), []))
            s = k[2]
            if k[0] == "F" and s > 0 and rank[s - 1] == rank[s]:
                got.append((("F", k[1], s - 1), False))
            if k[0] in "BI" and s < n - 1 and rank[s + 1] == rank[s]:
                got.append((next(kk for kk in (("B", k[1], s + 1), ("I", k[1], s + 1))
                                 if any(key(b) == kk for b in lowered[rank[s]])), False))
            inputs[k] = got
    return inputs


@settings(max_examples=30, deadline=None)
@given(case=st.sampled_from(CASES), t_f=st.floats(0.1, 3.0), t_i=st.floats(0.1, 3.0),
       w=st.floats(0.05, 1.0), comm=st.sampled_from([0.0, 0.5, 1.7]))
def test_the_course_timeline_is_the_earliest_on_torchs_dependencies(case, t_f, t_i, w, comm):
    """Durations free (torch's simulator has none to compare): every action of the course's
    timeline starts exactly when the later of two things happens, the end of the stage's previous
    action and the arrival of each input torch's lowering says it waits for (its end, plus the
    message time when a RECV carries it). Too early breaks a dependency, too late is a wait
    nothing explains."""
    name, make, v, p, m = case
    schedule = _make(make, v, p, m)
    placement = ps.placement_of(schedule)
    lowered, _ = _lower(schedule, p, v, placement)
    inputs = _torch_inputs(lowered, p, v, placement)
    t_w = w * min(t_f, t_i)
    timeline = ps.simulate(schedule, m, t_f=t_f, t_b=t_i + t_w, t_w=t_w, comm=comm)
    end, free = {}, {}
    for e in timeline:
        end[e["kind"], e["mb"], ps.virtual_stage(e["stage"], e["chunk"], p, placement)] = e["end"]
    assert set(end) == set(inputs)
    for e in sorted(timeline, key=lambda e: e["start"]):
        k = e["kind"], e["mb"], ps.virtual_stage(e["stage"], e["chunk"], p, placement)
        ready = max([free.get(e["stage"], 0.0)] +
                    [end[b] + (comm if remote else 0.0) for b, remote in inputs[k]])
        assert e["start"] == pytest.approx(ready, abs=1e-9), (k, e["start"], ready)
        free[e["stage"]] = e["end"]


def test_torchs_steps_are_not_the_course_bubble():
    """The numbers of the module doc: torch's lock-step count at p=4, m=8 (steps, and per rank
    the steps it computes, sends or receives, and idles) against the course's bubble."""
    p, m = 4, 8
    for make, makespan, idle in ((ps.gpipe, 56, [24, 8, 8, 24]),
                                 (ps.one_f_one_b, 61, [29, 13, 13, 29])):
        schedule = make(p, m)
        lowered, rank = _lower(schedule, p, 1, "loop")
        steps = S._simulate_comms_compute(lowered, rank, p)
        assert max(len(acts) for acts in steps.values()) == makespan
        busy = [[a for a in steps[r] if a is not None] for r in range(p)]
        assert [sum(a.computation_type in COMPUTE for a in b) for b in busy] == [2 * m] * p
        assert [sum(a.computation_type not in COMPUTE for a in b) for b in busy] == \
            [2 * m, 4 * m, 4 * m, 2 * m]                    # a RECV and a SEND per message
        assert [makespan - len(b) for b in busy] == idle
        timeline = ps.simulate(schedule, m, t_f=1, t_b=1)
        assert ps.bubble_fraction(timeline) == pytest.approx(ps.theory_bubble(p, m)) == 3 / 11
