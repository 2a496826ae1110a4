"""Chapter 11's real GPU trace (tests/data/hta_resnet50_ddp): one step read for overlap, exposed
communication and gaps. The numbers must add up, match what the chapter says of the job, and
equal Holistic Trace Analysis' own, step by step."""
from pathlib import Path

import pytest

from distlab.viz.gpu_trace import _minus, annotated_step, hta_steps, read_step
from hta_referee import require_hta

DATA = Path(__file__).parent / "data" / "hta_resnet50_ddp"
SOURCE = Path(__file__).parent / "data" / "hta_resnet50_ddp_source"     # untouched


def total(xs):
    return sum(b - a for a, b in xs)


def test_minus_cuts_covered_parts_out():
    assert _minus([(0, 10)], [(2, 3), (5, 7)]) == [(0, 2), (3, 5), (7, 10)]
    assert _minus([(0, 10)], [(-1, 11)]) == []
    assert _minus([(0, 4), (3, 6)], [(1, 2), (8, 9)]) == [(0, 1), (2, 6)]
    assert _minus([(0, 1)], []) == [(0, 1)]


@pytest.mark.parametrize("step", ["ProfilerStep#4", "ProfilerStep#5", "ProfilerStep#6"])
def test_a_steps_numbers_add_up(step):
    s = read_step(DATA, step)
    assert s["overlapped"] <= s["comm_busy"] and s["overlapped"] <= s["compute_busy"]
    # HTA's temporal breakdown: compute, non-compute (communication and copies beside no compute)
    # and idle fill the step
    lo, hi = s["window"]
    comm = [(max(e["start"], lo), min(e["end"], hi)) for e in s["calls"]]
    alone = total(_minus(comm + s["copies"], s["compute"]))
    assert alone == pytest.approx(s["non_compute"], rel=1e-9)
    assert s["compute_busy"] + alone + s["idle"] == pytest.approx(s["span"], rel=1e-9)
    assert s["non_compute"] >= s["comm_busy"] - s["overlapped"]
    assert s["non_compute"] <= s["comm_busy"] - s["overlapped"] + total(s["copies"]) + 1e-12
    assert total(s["gaps"]) == pytest.approx(s["idle"], rel=1e-9)
    assert total(s["exposed_intervals"]) == pytest.approx(s["comm_busy"] - s["overlapped"], rel=1e-9)
    reduces = [e for e in s["calls"] if e["op"] == "all_reduce"]
    # every step all-reduces ResNet-50's gradients once, in DDP's five buckets
    assert len(reduces) == 5 and sum(e["bytes"] for e in reduces) == 25_557_032 * 4
    assert [e["op"] for e in s["calls"]].count("broadcast") == 2      # BatchNorm's buffers
    assert [n for n, _, _ in s["phases"]] == ["## forward ##", "## backward ##", "## optimizer ##"]


def test_copies_keep_the_gpu_busy():
    # Memcpy/Memset are busy time, neither compute nor communication (HTA's idle; Trace.overlap's).
    # Before, read_step billed step 5's copies as idle: 164.6 ms where HTA says 163.8.
    s = read_step(DATA, "ProfilerStep#5")
    assert len(s["copies"]) > 100 and 0.5e-3 < total(s["copies"]) < 1e-3
    assert total(s["gaps"]) == pytest.approx(s["idle"], rel=1e-9)
    assert not any(a < c < b or a < d < b for a, b in s["gaps"] for c, d in s["copies"])


def test_hta_gives_each_steps_numbers():
    # HTA's temporal breakdown and comm/comp overlap, run on each step's events (the kernels whose
    # launch started in its ProfilerStep range), against read_step's window. They agree to 1 µs:
    # the file keeps ns, and ts + dur rounds to about 1 ns on its clock, for ~1,250 events a step.
    # A copy billed as idle moves idle by 0.8 ms, HTA's default rounding to whole µs compute by 2 %.
    require_hta()
    theirs = hta_steps(DATA)
    assert sorted(theirs) == ["ProfilerStep#4", "ProfilerStep#5", "ProfilerStep#6"]
    for step, hta in theirs.items():
        s = read_step(DATA, step)
        ours = dict(span=s["span"], idle=s["idle"], compute=s["compute_busy"],
                    non_compute=s["non_compute"])
        for key, value in ours.items():
            assert value == pytest.approx(hta[key], abs=1e-6), (step, key)
        # HTA prints its overlap in percent, rounded to 0.01
        assert 100 * s["overlapped"] / s["comm_busy"] == pytest.approx(hta["overlap_pctg"],
                                                                       abs=0.0051), step
        # the chapter's reading: the GPU idles because the CPU launches too slowly, and HTA's
        # idle-time breakdown measures it (host wait: a kernel launched after its stream drained)
        for stream, waits in hta["idle_by_stream"].items():
            assert waits["host_wait"] > 0.95 * sum(waits.values()), (step, stream)


def test_what_the_chapter_says_of_step_5():
    s = read_step(DATA, "ProfilerStep#5")
    assert s["device"] == "NVIDIA A100-PG509-200" and s["nccl"] == "2.17.1"
    assert 0.70 < s["idle"] / s["span"] < 0.80                         # "about three quarters"
    assert s["overlapped"] / s["comm_busy"] < 0.2                       # "only a small part"
    big = max((e for e in s["calls"] if e["op"] == "all_reduce"), key=lambda e: e["bytes"])
    assert 10e9 < big["bytes"] / (big["end"] - big["start"]) < 14e9     # "about 12 GB/s"


def test_the_untouched_source_trace_gives_the_same_step():
    # HTA's own file, as Kineto wrote it: its GPU ranges carry no step (before: "no GPU ranges"),
    # so the steps come from its ProfilerStep ranges and the kernels each phase launched.
    cut, source = read_step(DATA, "ProfilerStep#5"), read_step(SOURCE, "ProfilerStep#5")
    assert [n for n, _, _ in source["phases"]] == [n for n, _, _ in cut["phases"]]
    for key in ("span", "idle", "overlapped", "comm_busy", "compute_busy"):
        assert source[key] == pytest.approx(cut[key], abs=1e-9), key
    assert [(e["op"], e["bytes"]) for e in source["calls"]] == \
        [(e["op"], e["bytes"]) for e in cut["calls"]]


def test_an_unknown_step_is_refused():
    with pytest.raises(ValueError, match="no GPU ranges.*its steps are ProfilerStep#4, ProfilerStep#5"):
        read_step(DATA, "ProfilerStep#99")


def test_the_picture_draws():
    import matplotlib
    matplotlib.use("Agg")
    fig = annotated_step(read_step(DATA, "ProfilerStep#5"))
    assert len(fig.axes) == 2
