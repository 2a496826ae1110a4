"""The emulated clock under patterns that must not change results: async collectives on two
groups launched in different orders on different ranks (issue 26), and handles asked whether
they are done."""
import pytest
import torch
import torch.distributed as dist

import distlab
from distlab import trace
from distlab.emulate import PRESETS, comm_seconds

A100 = PRESETS["a100-nvlink"]
N = 250_000                                  # 1 MB of float32 per all_reduce


def _two_groups_crossed(rank, world_size, late):
    """Rank 0 launches on group a then b; rank 1 on b, then (`late` s later) on a."""
    a, b = dist.new_group([0, 1]), dist.new_group([0, 1])
    x = torch.full((N,), float(rank + 1))
    y = torch.full((N,), 10.0 * (rank + 1))
    if rank == 0:
        wa = dist.all_reduce(x, group=a, async_op=True)
        wb = dist.all_reduce(y, group=b, async_op=True)
    else:
        wb = dist.all_reduce(y, group=b, async_op=True)
        if late:
            trace.compute(late)
        wa = dist.all_reduce(x, group=a, async_op=True)
    wa.wait()
    wb.wait()
    return x, y, trace.now()


@pytest.mark.parametrize("late", [0.0, 1e-3])
def test_async_collectives_launched_in_crossed_orders_run_under_emulation(late):
    plain = distlab.run(_two_groups_crossed, 2, late, timeout=20)
    emulated = distlab.run(_two_groups_crossed, 2, late, emulate=A100, timeout=20)
    for p, e in zip(plain, emulated):
        assert torch.equal(p[0], e[0]) and torch.equal(p[1], e[1])
    assert torch.equal(emulated[0][0], torch.full((N,), 3.0))

    c = comm_seconds("all_reduce", N * 4, 2, A100.intra)
    t = emulated.trace
    t0 = t.comm(0)[0]["launch"]                       # both ranks launch at t0 (after filling)
    assert t.comm(1)[0]["launch"] == t0
    # The ranks' links disagree on the order: both take them by when the last member launched
    # them (a at t0 + late), ties by rank 0's order (a first).
    if not late:
        expected = {"a": (t0, t0 + c), "b": (t0 + c, t0 + 2 * c)}
    else:
        expected = {"b": (t0, t0 + c), "a": (t0 + late, t0 + late + c)}
    for r, order in ((0, "ab"), (1, "ba")):
        for name, e in zip(order, t.comm(r, op="all_reduce")):
            assert (e["start"], e["end"]) == pytest.approx(expected[name], rel=1e-12), (r, name)
    end = max(v[1] for v in expected.values())
    assert [e[2] for e in emulated] == pytest.approx([end, end], rel=1e-12)


def _poll(rank, world_size, compute_s):
    t = torch.ones(N)
    work = dist.all_reduce(t, async_op=True)
    trace.compute(compute_s)
    done = work.is_completed()
    work.wait()
    return done, trace.completed_at(work), t[0].item()


def test_is_completed_and_completed_at_answer_on_the_virtual_clock():
    c = comm_seconds("all_reduce", N * 4, 2, A100.intra)
    early = distlab.run(_poll, 2, c / 2, emulate=A100, timeout=20)
    late = distlab.run(_poll, 2, 2 * c, emulate=A100, timeout=20)
    assert [r[0] for r in early] == [False, False] and [r[0] for r in late] == [True, True]
    launched = early.trace.comm(0)[0]["launch"]
    assert early[0][1] == pytest.approx(launched + c, rel=1e-12)
    assert [r[2] for r in early + late] == [2.0] * 4


def _never_waited(rank, world_size):
    t = torch.ones(N)
    dist.all_reduce(t, async_op=True)        # dropped: the run's end still learns its times
    return trace.now()


def test_a_transfer_never_waited_for_gets_its_times_at_the_end_of_the_run():
    results = distlab.run(_never_waited, 2, emulate=A100, timeout=20)
    event = results.trace.comm(1)[0]
    c = comm_seconds("all_reduce", N * 4, 2, A100.intra)
    assert event["end"] - event["start"] == pytest.approx(c, rel=1e-12)
