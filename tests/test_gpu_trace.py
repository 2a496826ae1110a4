"""Chapter 11's real GPU trace (tests/data/hta_resnet50_ddp): one step read for overlap, exposed
communication and gaps. The numbers must add up, and match what the chapter says of the job."""
from pathlib import Path

import pytest

from distlab.viz.gpu_trace import _minus, annotated_step, read_step

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
    busy = s["compute_busy"] + s["comm_busy"] - s["overlapped"]
    assert busy + s["idle"] == pytest.approx(s["span"], rel=1e-9)
    assert total(s["gaps"]) == pytest.approx(s["idle"], rel=1e-9)
    assert total(s["exposed_intervals"]) == pytest.approx(s["comm_busy"] - s["overlapped"], rel=1e-9)
    reduces = [e for e in s["calls"] if e["op"] == "all_reduce"]
    # every step all-reduces ResNet-50's gradients once, in DDP's five buckets
    assert len(reduces) == 5 and sum(e["bytes"] for e in reduces) == 25_557_032 * 4
    assert [e["op"] for e in s["calls"]].count("broadcast") == 2      # BatchNorm's buffers
    assert [n for n, _, _ in s["phases"]] == ["## forward ##", "## backward ##", "## optimizer ##"]


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
