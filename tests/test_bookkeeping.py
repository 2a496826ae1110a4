"""Issue 45: the bookkeeping and plotting that chapters 00 and 05b did in their cells lives in lib.
Each function prints what the chapter's cell stored (nbval holds the stored output equal to what
the notebook prints, so these tests hold the functions to the chapter): the hardware table of
chapter 00, 05b's weak-scaling lines and its bus bandwidths beside nccl-tests, and 05b's figure."""
import json
from pathlib import Path

import matplotlib
import pytest

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
NS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
CURVES = {   # chapter 05b's, §2
    "A100, overlap on": ("a100-node", "a100-cluster", 2048, True),
    "A100, overlap off": ("a100-node", "a100-cluster", 2048, False),
    "H100, overlap on": ("h100-node", "h100-cluster", 2048, True),
    "H100, 512 tokens per rank": ("h100-node", "h100-cluster", 512, True),
}


def stored_output(notebook, marker):
    """The stored text output of the code cell of notebooks/`notebook` whose source holds
    `marker` (exactly one must)."""
    cells = json.loads((ROOT / "notebooks" / notebook).read_text())["cells"]
    found = [c for c in cells if c["cell_type"] == "code" and marker in "".join(c["source"])]
    assert len(found) == 1, f"{len(found)} cells of {notebook} hold {marker!r}"
    return "".join("".join(o.get("text", "")) for o in found[0]["outputs"])


def test_chapter_00_prints_the_hardware_table_of_lib():
    from distlab import hardware as hw
    from distlab.hardware.overview import flop_per_byte, table
    text = table([(hw.A100, hw.NVLINK3, hw.IB_HDR), (hw.H100, hw.NVLINK4, hw.IB_NDR),
                  (hw.H200, hw.NVLINK4, hw.IB_NDR)])
    assert text + "\n" == stored_output("00_why_distributed.ipynb", "overview import table")
    # the ratios the prose quotes (tests/test_ch00.py), from the table's function: H100
    # ≈ 260, 2,100, 17,000
    _, (hbm, nvlink, nic) = flop_per_byte(hw.H100, hw.NVLINK4, hw.IB_NDR)
    assert (round(hbm, -1), round(nvlink, -2), round(nic, -3)) == (260, 2100, 17000)
    assert len(table([(hw.A100, hw.NVLINK3, hw.IB_HDR)]).splitlines()) == 3   # 2 headers, 1 row


def _speedup_cell():
    """05b's weak-scaling cell: its curve lines and its nccl-tests lines (the emulator's banner,
    printed where a run first used a preset, left out)."""
    lines = stored_output("05b_data_parallel_in_practice.ipynb", "weak_scaling(").splitlines()
    lines = [line for line in lines if not line.startswith("⏱ emulated")]
    return ([line for line in lines if ": speedup at " in line],
            [line for line in lines if line.startswith("all_reduce busbw")])


def test_05b_prints_the_bus_bandwidths_beside_nccl_tests():
    from distlab.viz.ddp import busbw_beside_nccl_tests
    _, stored = _speedup_cell()
    assert len(stored) == 2
    assert busbw_beside_nccl_tests(ROOT / "bench" / "published.csv").splitlines() == stored


def test_05b_weak_scaling_reuses_the_one_rank_runs_and_prints_the_stored_lines(monkeypatch):
    """Two real one-rank runs (A100, overlap on and off); the other curves' runs are stood in for
    by them, which checks that weak_scaling asks for the run the curve names."""
    import distlab
    from distlab import launch
    from distlab.data_parallel import gpt_step, predict_step, weak_scaling
    from distlab.emulate import PRESETS
    stored, _ = _speedup_cell()
    alone = {overlap: distlab.run(gpt_step, 1, overlap=overlap, emulate="a100-node")[0]
             for overlap in (True, False)}
    a100 = {k: v for k, v in CURVES.items() if k.startswith("A100")}
    said = []
    speedup, ones = weak_scaling(a100, NS, alone, "a100-node", say=said.append)
    assert said == stored[:2]
    assert ones == {"A100, overlap on": alone[True], "A100, overlap off": alone[False]}
    link = PRESETS["a100-cluster"].link_between(range(256))
    assert speedup["A100, overlap off"][-1] == pytest.approx(
        256 * alone[False][1] / predict_step(*alone[False], 256, link), rel=1e-12)
    assert speedup["A100, overlap on"][0] == pytest.approx(1.0)

    asked = []

    def run(fn, world_size, **kw):       # a run of any other preset or size: recorded, not run
        asked.append((fn, world_size, kw))
        return [alone[kw["overlap"]]]
    monkeypatch.setattr(launch, "run", run)
    h100 = {k: v for k, v in CURVES.items() if k.startswith("H100")}
    weak_scaling(h100, NS, alone, "a100-node", say=said.append)
    assert asked == [(gpt_step, 1, dict(tokens=2048, overlap=True, emulate="h100-node")),
                     (gpt_step, 1, dict(tokens=512, overlap=True, emulate="h100-node"))]
    assert said[2].startswith(" " * 10 + "H100, overlap on: speedup at 8, 16, 256 ranks: ")


def test_05b_figure_draws_each_curve_its_jitter_line_and_the_node_boundary():
    from distlab.data_parallel import jitter_efficiency
    from distlab.viz.ddp import scaling_efficiency
    speedup = {"A100, overlap on": list(NS), "A100, overlap off": [0.9 * n for n in NS],
               "H100, overlap on": list(NS)}
    ax = scaling_efficiency(NS, speedup, jitter=0.02, styles={"A100, overlap off": dict(ls="--")},
                            title="weak scaling")
    try:
        lines = ax.get_lines()
        first, off, h100, jitter, node = lines
        assert [line.get_label() for line in (first, off, h100)] == \
            [f"{label} (predicted)" for label in speedup]
        assert first.get_marker() == "o" and first.get_markerfacecolor() == "none"
        assert off.get_linestyle() == "--" and h100.get_linestyle() == "-"
        assert list(off.get_ydata()) == pytest.approx([0.9] * len(NS))
        assert jitter.get_label() == "overlap on, if each rank's step varied by 2 % (assumed)"
        assert list(jitter.get_ydata()) == [jitter_efficiency(n, 0.02) for n in NS]
        assert list(node.get_xdata()) == [8, 8]
        assert ax.get_xscale() == "log" and ax.get_ylim() == (0.75, 1.02)
        assert len(scaling_efficiency(NS, speedup).get_lines()) == 4     # no jitter asked
    finally:
        plt.close("all")
