"""Pipeline parallelism: schedules, simulator, and every schedule equal to one process."""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import distlab
from distlab import pipeline_parallel as pp
from distlab import pipeline_schedules as ps
from distlab.models import batches_of, make_mlp, regression_data

SIZES = (16,) + (24,) * 7 + (4,)        # 15 layers: up to 8 virtual stages
LR = 0.05


# ---- schedules and the simulator (no processes) ----------------------------------------------------

@pytest.mark.parametrize("p", [1, 2, 3, 4, 5])
@pytest.mark.parametrize("m", [1, 2, 3, 4, 7, 8])
def test_gpipe_and_1f1b_bubble_and_memory(p, m):
    for name in ("GPipe", "1F1B"):
        schedule = ps.make_schedule(name, p, m)
        timeline = ps.simulate(schedule, m)
        assert len(timeline) == 2 * p * m
        assert ps.bubble_fraction(timeline) == pytest.approx(ps.theory_bubble(p, m), abs=1e-12)
        held = [ps.peak_in_flight(s) for s in schedule]
        assert held == ([m] * p if name == "GPipe" else [min(p - r, m) for r in range(p)])


@pytest.mark.parametrize("p, m", [(2, 2), (2, 6), (3, 3), (3, 9), (4, 4), (4, 8)])
@pytest.mark.parametrize("v", [2, 3])
def test_interleaved_bubble_shrinks_by_v(p, m, v):
    schedule = ps.interleaved_1f1b(p, m, v)
    timeline = ps.simulate(schedule, m)
    assert ps.bubble_fraction(timeline) == pytest.approx(ps.theory_bubble(p, m, v), abs=1e-12)
    assert ps.bubble_fraction(timeline) < ps.theory_bubble(p, m)


@pytest.mark.parametrize("p, m", [(2, 1), (2, 5), (3, 4), (4, 4), (4, 8), (5, 7), (6, 7), (4, 2)])
def test_zb_h1_a_third_of_1f1b_idle_time_at_1f1b_peak_memory(p, m):
    zb = ps.zb_h1(p, m)
    assert {a.kind for s in zb for a in s} == {"F", "I", "W"}
    # Never more micro-batches on a stage than 1F1B's first stage holds: 1F1B's peak memory.
    ofob_peak = max(ps.peak_in_flight(s) for s in ps.one_f_one_b(p, m))
    assert max(ps.peak_in_flight(s) for s in zb) == ofob_peak == min(p, m)
    timeline = ps.simulate(zb, m, t_f=1, t_b=2, t_w=1)
    bubble = ps.bubble_fraction(timeline)
    if p > 1:
        assert bubble < ps.theory_bubble(p, m) - 0.01
    if m >= p:   # idle time per stage: p - 1 slots against 1F1B's 3 (p - 1)
        assert bubble == pytest.approx((p - 1) / (3 * m + p - 1), abs=1e-12)
        assert bubble == pytest.approx(ps.theory("ZB-H1", p, m), abs=1e-12)
        span = max(e["end"] for e in timeline)
        assert span * p - 3 * m * p == pytest.approx(p * (p - 1), abs=1e-9)
    # W no longer than F or I: the general formula holds too.
    if m >= p:
        t = ps.simulate(zb, m, t_f=1.5, t_b=2.5, t_w=1)
        assert ps.bubble_fraction(t) == pytest.approx(ps.zb_h1_bubble(p, m, 1.5, 1.5, 1),
                                                      abs=1e-12)


def test_zb_h1_at_p4_m8_delays_w_by_the_stage_index():
    zb = ps.zb_h1(4, 8)
    assert ps.bubble_fraction(ps.simulate(zb, 8, t_f=1, t_b=2, t_w=1)) == pytest.approx(1 / 9)
    assert [ps.peak_in_flight(s) for s in zb] == [4, 4, 4, 4]
    assert [repr(a) for a in zb[0][:7]] == ["F0", "F1", "F2", "F3", "I0", "W0", "F4"]
    for r, actions in enumerate(zb):    # W_j right after I_(j + r), the rest at the end
        order = [repr(a) for a in actions]
        for j in range(8 - r):
            assert order[order.index(f"I{j + r}") + 1] == f"W{j}"
        assert order[-r or len(order):] == [f"W{j}" for j in range(8 - r, 8)]


@pytest.mark.parametrize("p, v", [(2, 2), (4, 2), (4, 3), (3, 2)])
def test_interleaved_activation_memory(p, v):
    """Interleaving holds 1 + (p - 1)/(p v) times 1F1B's activations on the first stage."""
    m = 2 * p
    chunks = ps.peak_in_flight(ps.interleaved_1f1b(p, m, v)[0])   # each 1/v of a stage's
    assert (chunks / v) / p == pytest.approx(1 + (p - 1) / (p * v), abs=1e-12)


# ---- ZB-V and DualPipeV: two chunks per stage in a V -------------------------------------------

def _torch_order(cls, p, m):
    """torch.distributed.pipelining's action order for rank r of a V schedule, as our Actions:
    its stage index r is our chunk 0, 2p - 1 - r chunk 1; an overlapped pair is F, then B."""
    from torch.distributed.pipelining import schedules as S
    kinds = {S.FORWARD: "F", S.FULL_BACKWARD: "B", S.BACKWARD_INPUT: "I", S.BACKWARD_WEIGHT: "W"}
    o = object.__new__(cls)      # the order only: no stages, no process group
    o.pp_group_size, o._n_microbatches, o.num_stages, o._num_stages = p, m, 2 * p, 2 * p
    out = []
    for r in range(p):
        ops = []
        for a in o._calculate_single_rank_operations(r):
            for s in (() if a is None else a.sub_actions if a.computation_type == S.OVERLAP_F_B
                      else (a,)):
                ops.append(ps.Action(kinds[s.computation_type], s.microbatch_index,
                                     0 if s.stage_index == r else 1))
        out.append(ops)
    return out


def _torch_pairs(p, m):
    """Where torch's ScheduleDualPipeV runs an overlapped pair (OVERLAP_F_B), per rank: the
    position of its forward in the order above."""
    from torch.distributed.pipelining import schedules as S
    o = object.__new__(S.ScheduleDualPipeV)
    o.pp_group_size, o._n_microbatches, o.num_stages, o._num_stages = p, m, 2 * p, 2 * p
    out = []
    for r in range(p):
        pos, pairs = 0, set()
        for a in filter(None, o._calculate_single_rank_operations(r)):
            if a.computation_type == S.OVERLAP_F_B:
                pairs.add(pos)
            pos += len(a.sub_actions) if a.computation_type == S.OVERLAP_F_B else 1
        out.append(pairs)
    return out


@pytest.mark.parametrize("p", [1, 2, 3, 4, 5])
def test_v_schedules_are_torchs_and_never_deadlock(p):
    from torch.distributed.pipelining import schedules as S
    for m in range(1, 3 * p + 2):
        zb = ps.zb_v(p, m)
        assert zb.placement == "v" and [list(s) for s in zb] == \
            _torch_order(S.ScheduleZBVZeroBubble, p, m), (p, m)
        timeline = ps.simulate(zb, m, t_f=1, t_b=2, t_w=1)      # raises on a deadlock
        assert len(timeline) == 3 * 2 * m * p
        if m >= 2 * p - 1:      # F = I = W: (p - 1) chunk forwards idle, half of ZB-H1's
            assert ps.bubble_fraction(timeline) == pytest.approx(ps.zb_v_bubble(p, m), abs=1e-12)
            assert ps.zb_v_bubble(p, m) == pytest.approx((p - 1) / (6 * m + p - 1))
            assert ps.theory("ZB-V", p, m) == ps.zb_v_bubble(p, m)
            # 2p chunks of half a stage: p micro-batches, 1F1B's first stage's peak
            assert max(ps.peak_in_flight(s) for s in zb) == 2 * p
        if m >= 2 * p:
            dp = ps.dualpipe_v(p, m)
            assert [list(s) for s in dp] == _torch_order(S.ScheduleDualPipeV, p, m), (p, m)
            assert dp.pairs == _torch_pairs(p, m), (p, m)     # its OVERLAP_F_B actions
            timeline = ps.simulate(dp, m, t_f=1, t_b=2, t_w=1)
            assert ps.bubble_fraction(timeline) == pytest.approx(ps.zb_v_bubble(p, m), abs=1e-12)
            assert [ps.peak_in_flight(s) for s in dp] == [2 * p + 1] * p    # one chunk more
        else:
            with pytest.raises(ValueError, match=f"needs at least 2p = {2 * p} micro-batches"):
                ps.dualpipe_v(p, m)


def _idle_per_stage(timeline):
    span = max(e["end"] for e in timeline) - min(e["start"] for e in timeline)
    return max(span - sum(e["end"] - e["start"] for e in timeline if e["stage"] == r)
               for r in {e["stage"] for e in timeline})


# a chunk's F (= its I), W, and F&B (from F + W: no overlap, down to max(F, B): all of it hidden)
@pytest.mark.parametrize("p, m, t_f, t_w, t_fb", [(2, 4, 1.0, 1.0, 3.0), (3, 7, 1.7, 0.6, 3.5),
                                                  (4, 8, 1.0, 0.5, 2.1), (5, 12, 2.0, 1.3, 4.4),
                                                  (6, 13, 0.8, 0.8, 2.4)])
def test_dualpipe_formula_is_the_simulator_with_pairs_as_units(p, m, t_f, t_w, t_fb):
    """The DeepSeek-V3 report's DualPipe idle time (p/2 - 1)(F&B + B - 3W), p counting stages,
    is what the simulator finds for DualPipeV on p ranks (2p stages) and for the bidirectional
    DualPipe on 2p ranks when each F&B pair runs as one unit and I = F (W no longer than F)."""
    t_b = t_f + t_w                                            # B = I + W, I = F
    formula = ps.dualpipe_bubble(2 * p, t_f, t_b, t_w, t_fb)
    v = ps.simulate(ps.dualpipe_v(p, m), m, 2 * t_f, 2 * t_b, 2 * t_w, t_fb=2 * t_fb)
    assert _idle_per_stage(v) == pytest.approx(formula, rel=1e-9)
    dual = ps.simulate(ps.dualpipe(2 * p, 2 * m), 2 * m, t_f, t_b, t_w, t_fb=t_fb)
    assert _idle_per_stage(dual) == pytest.approx(formula, rel=1e-9)
    if t_fb == t_f + t_b:                  # each pair apart idles less: by (p - 1) F at F = W
        apart = ps.simulate(ps.dualpipe_v(p, m), m, 2 * t_f, 2 * t_b, 2 * t_w)
        assert _idle_per_stage(apart) == pytest.approx((p - 1) * (t_f + t_f - t_w), rel=1e-9)


def test_dualpipe_formula_assumes_input_gradient_equal_to_forward():
    """With I != F the report's formula is not the simulated ramp, even with the pairs as units:
    at the chapter's ratio I = 1.43 F it is above, with I < F below."""
    for t_i, above in ((1.43, True), (0.8, False)):
        t_f, t_w = 1.0, 0.76
        t_b = t_i + t_w
        unit = ps.simulate(ps.dualpipe_v(4, 8), 8, 2 * t_f, 2 * t_b, 2 * t_w,
                           t_fb=2 * (t_f + t_b))
        formula = ps.dualpipe_bubble(8, t_f, t_b, t_w)
        assert (formula > 1.05 * _idle_per_stage(unit)) if above else \
            (formula < 0.95 * _idle_per_stage(unit))


@pytest.mark.parametrize("p, m", [(2, 4), (2, 6), (4, 8), (4, 10), (6, 12), (8, 20)])
def test_dualpipe_is_dualpipe_v_mirrored(p, m):
    """The bidirectional DualPipe: the first half of the micro-batches on chunk 0 from stage 0,
    the second on chunk 1 from stage p - 1; stages r and p - 1 - r run DualPipeV's rank
    min(r, p - 1 - r) lists (p/2 ranks, m/2 micro-batches), directions swapped in the second
    half; every (micro-batch, piece) gets F, and B or I then W, exactly once, after its inputs;
    its timeline is DualPipeV's rank for rank, with or without pairs as units."""
    dual, half = ps.dualpipe(p, m), ps.dualpipe_v(p // 2, m // 2)
    assert dual.placement == "dual" and len(dual) == p
    for r, actions in enumerate(dual):
        h, flip = min(r, p - 1 - r), int(r >= p // 2)
        assert [(a.kind, a.mb - (m // 2) * a.chunk, a.chunk ^ flip) for a in actions] == \
            [tuple(a) for a in half[h]]
        assert all(a.chunk == (a.mb >= m // 2) for a in actions)
        assert dual.pairs[r] == half.pairs[h]
    for t_fb in (None, 3.0, 2.4):
        t = ps.simulate(dual, m, t_f=1, t_b=2, t_w=1, t_fb=t_fb)
        tv = ps.simulate(half, m // 2, t_f=2, t_b=4, t_w=2, t_fb=None if t_fb is None else 2 * t_fb)
        end = {r: max(e["end"] for e in t if e["stage"] == r) for r in range(p)}
        end_v = {r: max(e["end"] for e in tv if e["stage"] == r) for r in range(p // 2)}
        assert all(end[r] == pytest.approx(end_v[min(r, p - 1 - r)]) for r in range(p))
        # each piece of each micro-batch: F after the piece before, B (or I) after the piece
        # after, W after I; each once
        at = {}
        for e in t:
            vs = ps.virtual_stage(e["stage"], e["chunk"], p, "dual")
            key = (e["kind"], e["mb"], vs)
            assert key not in at
            at[key] = e
        for mb in range(m):
            for vs in range(p):
                f = at["F", mb, vs]
                back = at.get(("B", mb, vs)) or at["I", mb, vs]
                assert ("B", mb, vs) in at or at["W", mb, vs]["start"] >= back["end"] - 1e-12
                assert back["start"] >= f["end"] - 1e-12
                if vs > 0:
                    assert f["start"] >= at["F", mb, vs - 1]["end"] - 1e-12
                if vs < p - 1:
                    nxt = at.get(("B", mb, vs + 1)) or at["I", mb, vs + 1]
                    assert back["start"] >= nxt["end"] - 1e-12
    assert [ps.peak_in_flight(a) for a in dual] == [p + 1] * p       # the report's PP + 1
    for bad in ((3, 6), (4, 7), (4, 6)):
        with pytest.raises(ValueError, match="DualPipe needs an even number of stages"):
            ps.dualpipe(*bad)


def test_v_placement_everywhere():
    assert [ps.virtual_stage(r, c, 3, "v") for r in range(3) for c in (0, 1)] == [0, 5, 1, 4, 2, 3]
    assert all(ps.stage_of(ps.virtual_stage(r, c, 4, pl), 4, pl, c) == (r, c)
               for r in range(4) for c in (0, 1) for pl in ps.PLACEMENTS)
    # the last stage turns around without a message: at once, even with messages costing 10
    t = ps.simulate(ps.zb_v(2, 3), 3, comm=10)
    at = {(e["stage"], e["kind"], e["mb"], e["chunk"]): e for e in t}
    assert at[1, "F", 0, 1]["start"] == at[1, "F", 0, 0]["end"]
    assert at[0, "F", 0, 1]["start"] == at[1, "F", 0, 1]["end"] + 10
    # the same lists read in the loop placement are another pipeline, whose order is wrong
    with pytest.raises(ValueError):
        ps.simulate([list(s) for s in ps.zb_v(3, 5)], 5)
    with pytest.raises(ValueError, match="V placement holds exactly 2 chunks"):
        ps.simulate(ps.one_f_one_b(2, 2), 2, placement="v")
    with pytest.raises(ValueError, match="placement must be one of"):
        ps.Schedule([[]], "w")
    # DualPipe's idle time, from the DeepSeek-V3 report's table 2, at F&B = F + B
    assert ps.dualpipe_bubble(8, 1, 2, 1) == 3 * (1 + 2 + 2 - 3)
    assert ps.dualpipe_bubble(8, 1, 2, 1, t_fb=2.5) == 3 * (2.5 + 2 - 3)


def test_simulator_timing_follows_dependencies():
    timeline = ps.simulate(ps.one_f_one_b(2, 2), 2, t_f=1, t_b=2, comm=0.5)
    at = {(e["stage"], e["kind"], e["mb"]): (e["start"], e["end"]) for e in timeline}
    assert at[1, "F", 0] == (1.5, 2.5)          # after stage 0's forward plus one message
    assert at[1, "B", 0] == (2.5, 4.5)          # the last stage turns around at once
    assert at[0, "B", 0] == (5.0, 7.0)          # waits for the gradient message


def test_bad_schedules_are_explained():
    with pytest.raises(ValueError, match="deadlocks: stage 0 waits at B0, stage 1 waits at F1"):
        ps.simulate([[("F", 0), ("B", 0), ("F", 1), ("B", 1)],
                     [("F", 0), ("F", 1), ("B", 0), ("B", 1)]], 2)
    with pytest.raises(ValueError, match="different order than they are sent"):
        ps.simulate([[("F", 1), ("F", 0), ("B", 0), ("B", 1)],
                     [("F", 0), ("B", 0), ("F", 1), ("B", 1)]], 2)
    with pytest.raises(ValueError, match="stage 1 never runs B"):
        ps.simulate([[("F", 0), ("B", 0)], [("F", 0)]], 1)
    with pytest.raises(ValueError, match="before its forward"):
        ps.simulate([[("B", 0), ("F", 0)]], 1)
    with pytest.raises(ValueError, match="m must be a multiple of 4; got m=6"):
        ps.interleaved_1f1b(4, 6)
    with pytest.raises(ValueError, match="cannot cut a batch of 5 samples into 6"):
        pp.micro_batch_sizes(5, 6)
    with pytest.raises(ValueError, match="every stage needs at least one layer"):
        pp.split_model(make_mlp((4, 4, 4)).net, 4)
    assert pp.micro_batch_sizes(10, 4) == [3, 3, 2, 2]


# ---- real runs: every schedule equals single-process training ---------------------------------------

def _reference(batches):
    model = make_mlp(SIZES, seed=0).double()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    out = []
    for x, y in batches:
        opt.zero_grad()
        loss = F.mse_loss(model(x.double()), y.double())
        loss.backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        opt.step()
        out.append(dict(loss=loss.item(), grads=grads,
                        params={n: p.detach().clone() for n, p in model.named_parameters()}))
    return out


def _train(rank, world_size, name, batches, m, v):
    def schedule(p, m):
        return ps.interleaved_1f1b(p, m, v) if v > 1 else ps.make_schedule(name, p, m)
    return pp.train(rank, world_size, schedule, make_mlp(SIZES, seed=0), batches, m, (SIZES[0],),
                    v=v, lr=LR, dtype=torch.float64)


CASES = [  # schedule, stages, micro-batches, batch size, chunks per stage
    ("GPipe", 2, 4, 24, 1), ("GPipe", 4, 5, 23, 1), ("GPipe", 3, 3, 20, 1),
    ("1F1B", 2, 3, 24, 1), ("1F1B", 3, 5, 23, 1), ("1F1B", 4, 8, 24, 1), ("1F1B", 4, 2, 9, 1),
    ("interleaved 1F1B", 2, 4, 22, 2), ("interleaved 1F1B", 4, 4, 24, 2),
    ("interleaved 1F1B", 3, 3, 17, 2),
    ("ZB-H1", 2, 4, 24, 1), ("ZB-H1", 3, 5, 23, 1), ("ZB-H1", 4, 6, 24, 1),
]


@pytest.mark.parametrize("name, p, m, batch, v", CASES,
                         ids=[f"{c[0]}-p{c[1]}-m{c[2]}-b{c[3]}" for c in CASES])
def test_schedule_equals_one_process(name, p, m, batch, v):
    x, y = regression_data(64, SIZES[0], SIZES[-1], seed=1)
    batches = batches_of(x, y, batch, 3)
    got = distlab.run(_train, p, name, batches, m, v, timeout=120)
    expected = _reference(batches)
    names = {n for r in got for n in r[0]["grads"]}
    assert names == set(expected[0]["grads"])          # every parameter lives on exactly one rank
    assert sum(len(r[0]["grads"]) for r in got) == len(names)
    for step, exp in enumerate(expected):
        losses = [r[step]["loss"] for r in got if r[step]["loss"] is not None]
        assert len(losses) == 1
        assert losses[0] == pytest.approx(exp["loss"], rel=1e-12, abs=1e-14)
        for r in got:
            for n, g in r[step]["grads"].items():
                torch.testing.assert_close(g, exp["grads"][n], rtol=1e-12, atol=1e-14)
            for n, w in r[step]["params"].items():
                torch.testing.assert_close(w, exp["params"][n], rtol=1e-12, atol=1e-14)
    for r in got:   # the recorded timeline: every action once, in order, never overlapping
        timeline = r[-1]["timeline"]
        assert len(timeline) == (3 if name == "ZB-H1" else 2) * m * v
        for a, b in zip(timeline, timeline[1:]):
            assert 0 <= a["start"] <= a["end"] <= b["start"]


def _train_v(rank, world_size, batches, ms):
    return {name: pp.train(rank, world_size, make, make_mlp(SIZES, seed=0), batches, ms[name],
                           (SIZES[0],), v=2, lr=LR, dtype=torch.float64)
            for name, make in ps.V_SCHEDULES.items()}


@pytest.mark.parametrize("p, ms", [(2, {"ZB-V": 2, "DualPipeV": 5}),
                                   (3, {"ZB-V": 4, "DualPipeV": 6})])
def test_v_schedules_equal_one_process(p, ms):
    """ZB-V (also with fewer micro-batches than its pattern: m < 2p - 1) and DualPipeV, in the V
    placement over send/recv, train exactly like one process: one launch per world size."""
    x, y = regression_data(64, SIZES[0], SIZES[-1], seed=1)
    batches = batches_of(x, y, 23, 2)            # 23 samples: unequal micro-batches
    got = distlab.run(_train_v, p, batches, ms, timeout=120)
    expected = _reference(batches)
    for name, make in ps.V_SCHEDULES.items():
        _assert_matches_reference(name, [r[name] for r in got], expected)
        schedule = make(p, ms[name])
        for rank, r in enumerate(got):
            timeline = r[name][-1]["timeline"]
            assert [(e["kind"], e["mb"], e["chunk"]) for e in timeline] == \
                [tuple(a) for a in schedule[rank]]
            assert r[name][-1]["peak_in_flight"] == max(
                ps.peak_in_flight(schedule[rank][:i + 1]) for i in range(len(schedule[rank])))


def _train_dual(rank, world_size, batches, m):
    return pp.train(rank, world_size, ps.dualpipe, make_mlp(SIZES, seed=0), batches, m,
                    (SIZES[0],), lr=LR, dtype=torch.float64)


@pytest.mark.parametrize("p, m", [(2, 4), (4, 8)])
def test_dualpipe_equal_one_process(p, m):
    """The bidirectional DualPipe over send/recv, every piece held by two ranks whose gradients
    are summed before the step: losses (on both ends), gradients and weights (both copies) equal
    to one process's in float64, over unequal micro-batches; the ranks ran the schedule's order."""
    x, y = regression_data(64, SIZES[0], SIZES[-1], seed=1)
    batches = batches_of(x, y, 23, 2)
    got = distlab.run(_train_dual, p, batches, m, timeout=120)
    expected = _reference(batches)
    names = sorted(n for r in got for n in r[0]["grads"])
    assert names == sorted(2 * list(expected[0]["grads"]))          # each piece twice
    for step, exp in enumerate(expected):
        losses = [r[step]["loss"] for r in got if r[step]["loss"] is not None]
        assert len(losses) == 2 and losses[0] == losses[1]           # stages 0 and p - 1
        assert losses[0] == pytest.approx(exp["loss"], rel=1e-12, abs=1e-14)
        for r in got:
            for what in ("grads", "params"):
                for n, t in r[step][what].items():
                    torch.testing.assert_close(t, exp[what][n], rtol=1e-12, atol=1e-14,
                                               msg=f"DualPipe step {step}: {what} of {n}")
    schedule = ps.dualpipe(p, m)
    for rank, r in enumerate(got):
        assert [(e["kind"], e["mb"], e["chunk"]) for e in r[-1]["timeline"]] == \
            [tuple(a) for a in schedule[rank]]


def _peaks(rank, world_size, name, m):
    x, y = regression_data(32, SIZES[0], SIZES[-1], seed=2)
    out = pp.train(rank, world_size, lambda p, mm: ps.make_schedule(name, p, mm),
                   make_mlp(SIZES, seed=0), [(x, y)], m, (SIZES[0],))
    return out[0]["peak_in_flight"], out[0]["peak_bytes"]


def test_measured_activation_memory_gpipe_vs_1f1b():
    m = 8
    gpipe = distlab.run(_peaks, 4, "GPipe", m, timeout=120)
    ofob = distlab.run(_peaks, 4, "1F1B", m, timeout=120)
    assert [g[0] for g in gpipe] == [m] * 4
    assert [o[0] for o in ofob] == [4, 3, 2, 1]
    for r in range(4):    # activation bytes scale with the micro-batches held
        assert ofob[r][1] * m == pytest.approx(gpipe[r][1] * (4 - r), rel=0.05)


def _too_many_microbatches(rank, world_size):
    x, y = regression_data(4, SIZES[0], SIZES[-1])
    pp.train(rank, world_size, ps.one_f_one_b, make_mlp(SIZES), [(x, y)], 6, (SIZES[0],))


def test_too_many_microbatches_is_one_sentence():
    with pytest.raises(distlab.RankFailed, match="cannot cut a batch of 4 samples into 6 micro"):
        distlab.run(_too_many_microbatches, 2, timeout=120)


class _Boom(nn.Module):
    """Raises in training (the shapes' dry run at construction has no autograd)."""

    def forward(self, x):
        if torch.is_grad_enabled():
            raise RuntimeError("boom")
        return x


def _raises_in_a_schedule(rank, world_size):
    x, y = regression_data(4, 8, 8)
    model = nn.Module()
    model.net = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8), _Boom(), nn.Linear(8, 8))
    pp.train(rank, world_size, ps.zb_v, model, [(x, y)], 2, (8,), v=2)


def test_an_error_inside_a_schedule_names_its_stage_and_action():
    """Stage 1 raises in its first forward of chunk 1 (virtual stage 2); stage 0 waits for its
    messages. The learner gets stage 1's error, where it happened, and stage 0 is stopped at
    once (not a RunTimeout after the 60 s)."""
    with pytest.raises(distlab.RankFailed, match="rank 1 raised RuntimeError: boom") as e:
        distlab.run(_raises_in_a_schedule, 2, timeout=60)
    assert "stage 1 raised this in F0.1 (virtual stage 2)" in str(e.value)


# ---- every schedule at odd sizes, and with stages that hold no parameters ------------------------

def _schedule_and_v(name, p, m):
    schedule = ps.SCHEDULES[name](p, m)
    return schedule, 1 + max(a.chunk for stage in schedule for a in stage)


def _assert_matches_reference(name, got, expected):
    """Loss on exactly one rank, every parameter on exactly one rank, grads and weights equal."""
    names = [n for r in got for n in r[0]["grads"]]
    assert sorted(names) == sorted(expected[0]["grads"]), name
    for step, exp in enumerate(expected):
        where = f"{name}, step {step}"
        losses = [r[step]["loss"] for r in got if r[step]["loss"] is not None]
        assert len(losses) == 1, where
        assert losses[0] == pytest.approx(exp["loss"], rel=1e-12, abs=1e-14), where
        for r in got:
            for n, g in r[step]["grads"].items():
                torch.testing.assert_close(g, exp["grads"][n], rtol=1e-12, atol=1e-14,
                                           msg=f"{where}: gradient of {n}")
                torch.testing.assert_close(r[step]["params"][n], exp["params"][n], rtol=1e-12,
                                           atol=1e-14, msg=f"{where}: {n}")


def _micro_batches(p):
    return p if p > 1 else 3       # a multiple of p (interleaved), and more than one


def _every_schedule(rank, world_size, batches, make_model):
    m = _micro_batches(world_size)
    out = {}
    for name in ps.SCHEDULES:
        _, v = _schedule_and_v(name, world_size, m)
        out[name] = pp.train(rank, world_size, lambda p, mm, name=name: ps.SCHEDULES[name](p, mm),
                             make_model(world_size * v), batches, m, (SIZES[0],), v=v, lr=LR,
                             dtype=torch.float64)
    return out


def _mlp(n_pieces):
    return make_mlp(SIZES, seed=0)


@pytest.mark.parametrize("p", [1, 5, 6])
def test_every_schedule_equals_one_process_at_1_5_and_6_stages(p):
    # 23 samples: the micro-batches are unequal at every p here.
    x, y = regression_data(64, SIZES[0], SIZES[-1], seed=1)
    batches = batches_of(x, y, 23, 2)
    expected = _reference(batches)
    results = distlab.run(_every_schedule, p, batches, _mlp, timeout=120)
    for name in ps.SCHEDULES:
        _assert_matches_reference(name, [r[name] for r in results], expected)


class _Net(nn.Module):
    """Flatten, then Linear and GELU in turn: pieces 0 (Flatten) and 2, 4, ... (GELU) hold no
    parameters, so the first stage and a middle stage of a one-layer-per-piece cut have none."""

    def __init__(self, n_pieces):
        super().__init__()
        widths = [SIZES[0]] + [12] * (n_pieces // 2 - 1) + [SIZES[-1]]
        layers = [nn.Flatten()]
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)     # the same weights in every process
            for i, (a, b) in enumerate(zip(widths, widths[1:])):
                layers += [nn.GELU()] if i else []
                layers.append(nn.Linear(a, b))
        self.net = nn.Sequential(*layers)

    def forward(self, x):
        return self.net(x)


def test_stages_without_parameters_work_in_every_schedule():
    p = 4
    x, y = regression_data(24, SIZES[0], SIZES[-1], seed=1)
    x = x.view(24, 2, SIZES[0] // 2)                 # (2, 8) samples: the first piece flattens
    batches = [(x, y)]
    results = distlab.run(_every_schedule, p, batches, _Net, timeout=120)
    for name in ps.SCHEDULES:
        _, v = _schedule_and_v(name, p, _micro_batches(p))
        model = _Net(p * v).double()
        assert len(model.net) == p * v and not list(model.net[0].parameters())
        assert not list(model.net[2].parameters())  # a middle stage without parameters
        opt = torch.optim.SGD(model.parameters(), lr=LR)
        loss = F.mse_loss(model(x.double()), y.double())
        loss.backward()
        grads = {f"net.{n}": q.grad.clone() for n, q in model.net.named_parameters()}
        opt.step()
        params = {f"net.{n}": q.detach().clone() for n, q in model.net.named_parameters()}
        _assert_matches_reference(name, [r[name] for r in results],
                                  [dict(loss=loss.item(), grads=grads, params=params)])


# ---- every stage talks to the right neighbours (no processes: a recording transport) ----------------

def _expected_messages(actions, rank, p, v, placement="loop"):
    """What stage `rank` must send and receive, in order, computed from the schedule alone."""
    n, out = p * v, []
    for a in actions:
        vs = ps.virtual_stage(rank, a.chunk, p, placement)
        prev = ps.stage_of(vs - 1, p, placement)[0] if vs > 0 else rank
        nxt = ps.stage_of(vs + 1, p, placement)[0] if vs < n - 1 else rank
        if a.kind == "F":
            out += [("recv", prev, 0)] if prev != rank else []
            out += [("send", nxt, 0)] if nxt != rank else []
        elif a.kind in "BI":
            out += [("recv", nxt, 1)] if nxt != rank else []
            out += [("send", prev, 1)] if prev != rank else []
    return out


class _Recorder:
    """Stands in for send/recv: records the peer, returns zeros, never waits."""

    def __init__(self):
        self.messages = []

    def recv(self, tensor, src=None, group=None, tag=0):
        self.messages.append(("recv", src, tag))
        tensor.zero_()

    def isend(self, tensor, dst=None, group=None, tag=0):
        self.messages.append(("send", dst, tag))
        return type("Done", (), {"wait": lambda self: None})()


@pytest.mark.parametrize("p", [3, 4])
def test_every_stage_sends_to_and_receives_from_its_neighbours(p, monkeypatch):
    """A wrong neighbour would make the real run hang; recorded here, it fails in a second.
    An odd and an even number of stages (the real runs above go to 5 and 6)."""
    x, y = regression_data(2 * p, SIZES[0], SIZES[-1], seed=1)
    monkeypatch.setattr(pp.stage, "_common_clock", lambda group: 0.0)
    for name in list(ps.SCHEDULES) + list(ps.V_SCHEDULES):
        m = 2 * p if name in ps.V_SCHEDULES else p
        schedule = (ps.V_SCHEDULES.get(name) or ps.SCHEDULES[name])(p, m)
        v = 1 + max(a.chunk for stage in schedule for a in stage)
        placement = ps.placement_of(schedule)
        parts = pp.split_model(make_mlp(SIZES, seed=0).net, p * v)
        for rank in range(p):
            recorder = _Recorder()
            monkeypatch.setattr(pp.dist, "recv", recorder.recv)
            monkeypatch.setattr(pp.dist, "isend", recorder.isend)
            stage = pp.PipelineStage(parts, rank, p, (SIZES[0],), placement=placement)
            stage.step(schedule[rank], x, y, m, F.mse_loss)
            expected = _expected_messages(schedule[rank], rank, p, v, placement)
            assert recorder.messages == expected, \
                f"{name}, p={p}: stage {rank} talked to the wrong stages (or tags)"


# ---- torch.distributed.pipelining gives the same loss ----------------------------------------------

def _native(rank, world_size, schedule_name, batch, m):
    from torch.distributed.pipelining import PipelineStage, schedules
    x, y = batch
    parts = pp.split_model(make_mlp(SIZES, seed=0).double().net, 2 * world_size)
    v_shape = schedule_name in ("ScheduleZBVZeroBubble", "ScheduleDualPipeV")
    mine = [rank, 2 * world_size - 1 - rank] if v_shape else [rank, rank + world_size]
    stages = [PipelineStage(parts[i], i, 2 * world_size, torch.device("cpu")) for i in mine]
    schedule = getattr(schedules, schedule_name)(stages, m, loss_fn=F.mse_loss)
    losses = []
    kwargs = {}
    if 0 in mine:
        kwargs["args"] = (x.double(),)
    if 2 * world_size - 1 in mine:
        kwargs.update(target=y.double(), losses=losses)
    schedule.step(*kwargs.pop("args", ()), **kwargs)
    grads = {f"net.{n}": p.grad.clone() for s in stages for n, p in s.submod.named_parameters()}
    return [l.item() for l in losses], grads


@pytest.mark.parametrize("schedule_name, p", [("ScheduleInterleaved1F1B", 2),
                                               ("ScheduleInterleaved1F1B", 3),
                                               ("ScheduleZBVZeroBubble", 3)])
def test_torch_pipelining_matches_the_reference(schedule_name, p):
    x, y = regression_data(24, SIZES[0], SIZES[-1], seed=1)
    m = 2 * p
    got = distlab.run(_native, p, schedule_name, (x, y), m, timeout=120)
    expected = _reference([(x, y)])[0]
    losses = [l for r in got for l in r[0]]
    assert len(losses) == m
    assert sum(losses) / m == pytest.approx(expected["loss"], rel=1e-12)
    for _, grads in got:
        for n, g in grads.items():
            torch.testing.assert_close(g, expected["grads"][n], rtol=1e-10, atol=1e-13)


def test_split_backward_per_layer_equals_the_full_backward():
    """ZB's I then W, split per layer (I stops at each weight's layer output, W one product per
    layer), gives the full backward's input and weight gradients - also through a module that
    returns a tuple, whose weights W reaches by walking the graph again."""
    import torch.nn as nn
    from distlab.pipeline_parallel import _vjp_root, _weight_gradients, _weight_inputs

    class Pair(nn.Module):                     # owns a weight, returns a tuple: not recorded
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.eye(5, dtype=torch.float64) + 0.1)

        def forward(self, x):
            return x @ self.w, x

    class First(nn.Module):
        def __init__(self):
            super().__init__()
            self.pair = Pair()
            self.scale = nn.Parameter(torch.linspace(0.5, 1.5, 5, dtype=torch.float64))

        def forward(self, x):
            y, skip = self.pair(x)
            return y * self.scale + skip

    torch.manual_seed(0)
    part = nn.Sequential(First(), nn.GELU(), nn.Linear(5, 3, dtype=torch.float64))
    x = torch.randn(4, 5, dtype=torch.float64, requires_grad=True)
    grad = torch.randn(4, 3, dtype=torch.float64)
    _vjp_root(part(x), grad).backward()
    full = [q.grad.clone() for q in part.parameters()] + [x.grad.clone()]
    for q in part.parameters():
        q.grad = None
    x.grad = None
    with _weight_inputs(part) as layers:
        out = part(x)
    s = {"out": out, "grad": grad, "layers": layers}
    got = torch.autograd.grad(_vjp_root(out, grad), [x] + [o for _, o in layers],
                              retain_graph=True)
    s["layer_grads"] = list(got[1:])
    assert len(layers) == 2                    # First (its scale) and the last Linear
    _weight_gradients(part, s)
    split = [q.grad for q in part.parameters()] + [got[0]]
    assert all(torch.allclose(a, b, atol=1e-12, rtol=0) for a, b in zip(full, split))


def _dual_real_size(rank, world_size, m):
    return pp.real_size_step(rank, world_size, "DualPipe", m, blocks_per_stage=1, tokens=1024)


def test_dualpipe_at_real_size_is_the_simulators_schedule():
    """DualPipe of Llama-2 7B blocks on meta tensors under emulation: every rank holds pieces r
    and p - 1 - r and runs the schedule's order; the emulated bubble is the simulator's with the
    emulated action times and one message per hop (bench/pipeline.py prints both at full size)."""
    p, m, preset = 4, 8, "h100-node"
    runs = distlab.run(_dual_real_size, p, m, emulate=preset, timeout=180)
    schedule = ps.dualpipe(p, m)
    for rank, timeline in enumerate(runs):
        assert [(e["kind"], e["mb"], e["chunk"]) for e in timeline] == \
            [tuple(a) for a in schedule[rank]]
    events = [e for timeline in runs for e in timeline]
    mean = {k: sum(e["end"] - e["start"] for e in events if e["kind"] == k) /
            sum(e["kind"] == k for e in events) for k in "FIW"}
    message = pp.message_seconds(preset, 1024 * pp.LLAMA2_7B["hidden"] * 2)
    simulated = ps.simulate(schedule, m, mean["F"], mean["I"] + mean["W"], mean["W"],
                            comm=message)
    assert ps.bubble_fraction(events) == pytest.approx(ps.bubble_fraction(simulated), abs=0.01)
    assert 0 < ps.bubble_fraction(events) < ps.bubble_fraction(
        ps.simulate(ps.dualpipe_v(p, m), m, mean["F"] / 2, (mean["I"] + mean["W"]) / 2,
                    mean["W"] / 2, comm=message))


# ---- a layer used twice, a weight tied inside a stage, a frozen layer ------------------------------

class _Twice(nn.Module):
    """One Linear applied twice: its weight's gradient has two products, one per use."""

    def __init__(self, d):
        super().__init__()
        self.lin = nn.Linear(d, d)

    def forward(self, x):
        return self.lin(torch.tanh(self.lin(x)))


class _Tied(nn.Module):
    """Two Linears sharing one weight (tying inside a stage); the second one's bias frozen."""

    def __init__(self, d):
        super().__init__()
        self.a, self.b = nn.Linear(d, d), nn.Linear(d, d)
        self.b.weight = self.a.weight
        self.b.bias.requires_grad_(False)

    def forward(self, x):
        return self.b(F.gelu(self.a(x)))


def _split_backward(part, x, grad):
    """ZB's I then W on one piece, as PipelineStage runs them: x's gradient and .grad."""
    from distlab.pipeline_parallel import _input_gradients, _weight_gradients, _weight_inputs
    from distlab.pipeline_parallel.stage import _StageInput
    anchor = torch.zeros((), dtype=x.dtype, requires_grad=True)
    box = {"t": x.detach()}
    with _weight_inputs(part) as layers:
        out = part(_StageInput.apply(anchor, box))
    s = {"anchor": anchor, "out": out, "grad": grad, "layers": layers}
    _input_gradients(s)
    _weight_gradients(part, s)
    return box["grad"]


def test_split_backward_is_exact_with_a_layer_used_twice_and_a_tied_weight():
    """I's gradients at the layer outputs are totals; W must take each use's own product only
    (walking from the second use back into the first counted the first twice)."""
    from distlab.pipeline_parallel import _vjp_root
    torch.manual_seed(0)
    part = nn.Sequential(nn.Linear(5, 6), nn.ReLU(inplace=True), _Twice(6), _Tied(6),
                         nn.Linear(6, 3)).double()     # ReLU overwrites a recorded output
    part[4].weight.requires_grad_(False)
    x = torch.randn(4, 5, dtype=torch.float64, requires_grad=True)
    grad = torch.randn(4, 3, dtype=torch.float64)
    _vjp_root(part(x), grad).backward()
    full = {n: q.grad for n, q in part.named_parameters()}
    full_x = x.grad
    for q in part.parameters():
        q.grad = None
    x = x.detach().requires_grad_()
    split_x = _split_backward(part, x, grad)
    torch.testing.assert_close(split_x, full_x, rtol=1e-12, atol=1e-14)
    for n, q in part.named_parameters():
        assert (q.grad is None) == (full[n] is None), n
        torch.testing.assert_close(q.grad, full[n], rtol=1e-12, atol=1e-14,
                                   msg=lambda m, n=n: f"{n}: {m}")


class _SharedNet(nn.Module):
    """Every piece of a 2-, 4- or 6-way cut holds a layer used twice or a tied weight; a frozen
    Linear and a frozen bias (their gradients stay None, as in one process)."""

    def __init__(self):
        super().__init__()
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            frozen = nn.Linear(8, 8).requires_grad_(False)
            self.net = nn.Sequential(nn.Linear(SIZES[0], 8), _Twice(8), _Tied(8), frozen,
                                     _Twice(8), _Tied(8), nn.Linear(8, SIZES[-1]))

    def forward(self, x):
        return self.net(x)


class _ReluLinear(nn.Sequential):
    """ReLU(inplace=True) then a Linear: a stage that begins here begins with an in-place op on
    the input it received (or took from its other chunk at the V's turn)."""

    def __init__(self, d):
        super().__init__(nn.ReLU(inplace=True), nn.Linear(d, d))


class _AcrossNet(nn.Module):
    """Weights shared ACROSS stages: the layer at net.1 used again at net.5, net.4's weight tied
    to net.2's; every piece but the first begins with ReLU(inplace=True). Cut in 2, 3, 4 or 6
    pieces (p = 2, 3; loop, V and dual) the two uses land on two stages, on two chunks of one
    stage, or in one piece."""

    def __init__(self):
        super().__init__()
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(1)
            b, c, d, e = (_ReluLinear(8) for _ in range(4))
            e[1].weight = c[1].weight
            self.net = nn.Sequential(nn.Linear(SIZES[0], 8), b, c, d, e, b,
                                     nn.Linear(8, SIZES[-1]))

    def forward(self, x):
        return self.net(x)


# every schedule generator, and its chunks per stage
_ALL = {"GPipe": (ps.gpipe, 1), "1F1B": (ps.one_f_one_b, 1), "ZB-H1": (ps.zb_h1, 1),
        "interleaved 1F1B": (lambda p, m: ps.interleaved_1f1b(p, m, 2), 2),
        "ZB-V": (ps.zb_v, 2), "DualPipeV": (ps.dualpipe_v, 2), "DualPipe": (ps.dualpipe, 1)}


def _shared_and_frozen(rank, world_size, batches, m):
    runs = [{name: pp.train(rank, world_size, make, net(), batches, m, (SIZES[0],), v=v,
                            lr=LR, dtype=torch.float64)
             for name, (make, v) in _ALL.items() if name != "DualPipe" or world_size % 2 == 0}
            for net in (_SharedNet, _AcrossNet)]
    net = _AcrossNet()              # each rank builds it apart (+ rank): the copies start equal
    with torch.no_grad():
        for q in net.parameters():
            q.add_(rank)
    stage = pp.PipelineStage(pp.split_model(net.net, world_size), rank, world_size, (SIZES[0],))
    return runs + [{f"net.{n}": q.detach().clone() for c in stage.chunks.values()
                    for n, q in c.named_parameters()}]


def _one_process(model, batches):
    """Loss, every gradient and every weight after each SGD step, by every name (a shared
    weight under each of its names)."""
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    expected = []
    for bx, by in batches:
        opt.zero_grad(set_to_none=True)
        loss = F.mse_loss(model(bx.double()), by.double())
        loss.backward()
        every = list(model.net.named_parameters(remove_duplicate=False))
        grads = {f"net.{n}": None if q.grad is None else q.grad.clone() for n, q in every}
        opt.step()
        expected.append(dict(loss=loss.item(), grads=grads,
                             params={f"net.{n}": q.detach().clone() for n, q in every}))
    return expected


@pytest.mark.parametrize("p", [2, 3])
def test_every_schedule_is_exact_with_shared_and_frozen_weights(p):
    """A layer used twice and a weight tied inside a stage (the split backward's W counted the
    first use twice), a frozen layer through train (it cloned a None gradient), and DualPipe's
    summed copies (a frozen gradient became zeros): every schedule equals one process in
    float64 - loss, every gradient with its None-ness, every weight after each step. The same
    launch trains _AcrossNet (weights shared across stages, stages that begin in place)."""
    x, y = regression_data(64, SIZES[0], SIZES[-1], seed=1)
    batches = batches_of(x, y, 23, 2)                      # unequal micro-batches
    model = _SharedNet().double()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    expected = []
    for bx, by in batches:
        opt.zero_grad(set_to_none=True)
        loss = F.mse_loss(model(bx.double()), by.double())
        loss.backward()
        grads = {f"net.{n}": None if q.grad is None else q.grad.clone()
                 for n, q in model.net.named_parameters()}
        opt.step()
        expected.append(dict(loss=loss.item(), grads=grads, params={
            f"net.{n}": q.detach().clone() for n, q in model.net.named_parameters()}))
    assert sum(g is None for g in expected[0]["grads"].values()) == 4     # frozen: 2 + 2 biases
    launched = distlab.run(_shared_and_frozen, p, batches, 2 * p, timeout=120)
    got = [r[0] for r in launched]
    _check_across([r[1] for r in launched], _one_process(_AcrossNet().double(), batches), p)
    # net.5 (net.1 again) lands on stage 1 (p=2) or 2 (p=3); net.4.1.weight (net.2's) on
    # stage 1 at p=2: those copies take stage 0's values, every other weight stays its own
    base = dict(_AcrossNet().net.named_parameters(prefix="net", remove_duplicate=False))
    for rank, r in enumerate(launched):
        for n, q in r[2].items():
            lowest = n.startswith("net.5.") or (n == "net.4.1.weight" and p == 2)
            torch.testing.assert_close(q, base[n].detach() + (0 if lowest else rank),
                                       msg=lambda m, n=n: f"rank {rank}, {n}: {m}")
    for name in got[0]:
        copies = 2 if name == "DualPipe" else 1                # DualPipe holds every piece twice
        names = sorted(n for r in got for n in r[name][0]["grads"])
        assert names == sorted(copies * list(expected[0]["grads"])), name
        for step, exp in enumerate(expected):
            where = f"{name} at p={p}, step {step}"
            losses = [r[name][step]["loss"] for r in got if r[name][step]["loss"] is not None]
            assert len(losses) == copies, where
            for loss in losses:
                assert loss == pytest.approx(exp["loss"], rel=1e-12, abs=1e-14), where
            for r in got:
                for n, g in r[name][step]["grads"].items():
                    assert (g is None) == (exp["grads"][n] is None), \
                        f"{where}: gradient of {n} is {g!r:.20}, one process's {exp['grads'][n]!r:.20}"
                    torch.testing.assert_close(g, exp["grads"][n], rtol=1e-12, atol=1e-14,
                                               msg=lambda m, n=n: f"{where}: gradient of {n}: {m}")
                    torch.testing.assert_close(r[name][step]["params"][n], exp["params"][n],
                                               rtol=1e-12, atol=1e-14,
                                               msg=lambda m, n=n: f"{where}: {n}: {m}")


def _check_across(got, expected, p):
    """_AcrossNet under every schedule: a weight on two stages is two copies whose gradients
    were never summed (each trained on its own use's share), and a stage beginning with
    ReLU(inplace=True) raised torch's 'a leaf Variable that requires grad is being used in an
    in-place operation' (interleaved 1F1B, ZB-V, DualPipeV at p = 2). Every copy must hold the
    summed gradient and the same weights as one process, loss and None-ness included."""
    one = {n for n in expected[0]["grads"]}
    for name in got[0]:
        held = {n for r in got for n in r[name][0]["grads"]}
        # every parameter of one process is held (a tie inside a piece shows its first name)
        assert {"net.0.weight", "net.1.1.weight", "net.2.1.weight", "net.6.bias"} <= held <= one
        for step, exp in enumerate(expected):
            where = f"_AcrossNet, {name} at p={p}, step {step}"
            losses = [r[name][step]["loss"] for r in got if r[name][step]["loss"] is not None]
            assert losses and all(x == pytest.approx(exp["loss"], rel=1e-12) for x in losses), \
                where
            for r in got:
                for n, g in r[name][step]["grads"].items():
                    torch.testing.assert_close(g, exp["grads"][n], rtol=1e-12, atol=1e-14,
                                               msg=lambda m, n=n: f"{where}: gradient of {n}: {m}")
                    torch.testing.assert_close(r[name][step]["params"][n], exp["params"][n],
                                               rtol=1e-12, atol=1e-14,
                                               msg=lambda m, n=n: f"{where}: {n}: {m}")


# ---- looped BFS, steps back to back, and a schedule under ZeRO-3 (chapter 08b, §1 and §3) -------

@pytest.mark.parametrize("p, m, v", [(2, 3, 2), (3, 5, 2), (4, 8, 2), (4, 6, 3), (2, 2, 2)])
def test_looped_bfs_bubble_memory_and_order(p, m, v):
    """Breadth-first: every micro-batch through a chunk before the next chunk; interleaving's
    bubble (p-1)/(vm+p-1) with F = 1, B = 2 once m >= p, and GPipe's memory (all m·v chunks held)."""
    s = ps.looped_bfs(p, m, v)
    assert ps.bubble_fraction(ps.simulate(s, m)) == pytest.approx(ps.theory_bubble(p, m, v))
    assert all(ps.peak_in_flight(a) == m * v for a in s)
    forwards = [(a.chunk, a.mb) for a in s[0] if a.kind == "F"]
    assert forwards == sorted(forwards)
    backwards = [(a.chunk, a.mb) for a in s[0] if a.kind == "B"]
    assert backwards == sorted(backwards, reverse=True)


def test_steps_back_to_back_reach_zb_v_authors_zero_only_under_their_conditions():
    """ZB-V's authors' bubble 0 (F = I = W): the period of steps run with no barrier between
    them, once m >= 2p - 1; one synchronous step keeps (p-1)/(6m+p-1). ZB-H1 and 1F1B keep
    their bubble either way; unequal times leave ZB-V a few per cent."""
    for p in (2, 4):
        for m in (2 * p - 1, 3 * p):
            s = ps.zb_v(p, m)
            assert ps.steady_bubble(s, m, 1, 2, 1) == pytest.approx(0, abs=1e-12), (p, m)
            assert ps.bubble_fraction(ps.simulate(s, m, 1, 2, 1)) == pytest.approx(
                ps.zb_v_bubble(p, m))
        for make in (ps.zb_h1, ps.one_f_one_b):
            s = make(p, 2 * p)
            assert ps.steady_bubble(s, 2 * p, 1, 2, 1) == pytest.approx(
                ps.bubble_fraction(ps.simulate(s, 2 * p, 1, 2, 1)))
    assert ps.steady_bubble(ps.zb_v(4, 6), 6, 1, 2, 1) > 0.01              # m < 2p - 1
    assert 0.03 < ps.steady_bubble(ps.zb_v(4, 8), 8, 1, 2.19, 0.76) < 0.15  # I = 1.43 F
    two = ps.back_to_back(ps.zb_v(2, 3), 3, 2)
    assert two.placement == "v" and [a.mb for a in two[0] if a.kind == "F"][-1] == 5
    with pytest.raises(ValueError, match="steps >= 2"):
        ps.steady_bubble(ps.zb_v(2, 3), 3, steps=1)


def test_parameter_gathers_under_zero3():
    """Gathers of a chunk's parameters per step on one stage: 2m per chunk freed after every
    action; once per chunk kept the whole step (v chunks held); looped BFS 2v - 1 runs of one
    chunk; 1F1B with one chunk: once, held throughout."""
    p, m = 4, 8
    assert ps.parameter_gathers(ps.one_f_one_b(p, m)[0], "every action") == (2 * m, 1)
    assert ps.parameter_gathers(ps.one_f_one_b(p, m)[0], "while in use") == (1, 1)
    for v in (2, 3):
        bfs = ps.looped_bfs(p, m, v)[0]
        assert ps.parameter_gathers(bfs, "while in use") == (2 * v - 1, 1)
        assert ps.parameter_gathers(bfs, "whole step") == (v, v)
        inter = ps.interleaved_1f1b(p, m, v)[0]
        assert ps.parameter_gathers(inter, "every action") == (2 * m * v, 1)
        assert ps.parameter_gathers(inter, "while in use")[0] > 2 * v - 1
    with pytest.raises(ValueError, match="policy must be one of"):
        ps.parameter_gathers(bfs, "sometimes")
