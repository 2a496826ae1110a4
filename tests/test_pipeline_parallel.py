"""Pipeline parallelism: schedules, simulator, and every schedule equal to one process."""
import pytest
import torch
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


@pytest.mark.parametrize("p, m", [(2, 1), (2, 5), (3, 4), (4, 4), (4, 8), (5, 7)])
def test_zero_bubble_beats_1f1b_at_the_same_memory(p, m):
    zb = ps.zero_bubble(p, m)
    assert {a.kind for s in zb for a in s} == {"F", "I", "W"}
    bubble = ps.bubble_fraction(ps.simulate(zb, m, t_f=1, t_b=2, t_w=1))
    assert bubble < ps.theory_bubble(p, m) - 0.01
    assert [ps.peak_in_flight(s) for s in zb] == [min(p - r, m) for r in range(p)]
    # Unlimited memory: every W can wait, and once m >= p the bubble falls to the forward +
    # input-grad ramp alone.
    if m < p:
        return
    free = ps.zero_bubble(p, m, max_in_flight=m)
    bubble = ps.bubble_fraction(ps.simulate(free, m, t_f=1, t_b=2, t_w=1))
    assert bubble == pytest.approx((p - 1) / (3 * m + p - 1), abs=1e-12)


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
    ("zero bubble", 2, 4, 24, 1), ("zero bubble", 3, 5, 23, 1), ("zero bubble", 4, 6, 24, 1),
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
        assert len(timeline) == (3 if name == "zero bubble" else 2) * m * v
        for a, b in zip(timeline, timeline[1:]):
            assert 0 <= a["start"] <= a["end"] <= b["start"]


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


@pytest.mark.parametrize("schedule_name", ["ScheduleInterleaved1F1B", "ScheduleZBVZeroBubble"])
def test_torch_pipelining_matches_the_reference(schedule_name):
    x, y = regression_data(24, SIZES[0], SIZES[-1], seed=1)
    m = 4
    got = distlab.run(_native, 2, schedule_name, (x, y), m, timeout=120)
    expected = _reference([(x, y)])[0]
    losses = [l for r in got for l in r[0]]
    assert len(losses) == m
    assert sum(losses) / m == pytest.approx(expected["loss"], rel=1e-12)
    for _, grads in got:
        for n, g in grads.items():
            torch.testing.assert_close(g, expected["grads"][n], rtol=1e-10, atol=1e-13)
