"""Unchanged on GPUs: the backend choice (CUDA mocked) and no hard-coded CUDA device anywhere."""
import json
import pathlib
import re
from unittest import mock

import pytest
import torch
import torch.distributed as dist

import distlab
from distlab.devices import choose_backend

ROOT = pathlib.Path(__file__).resolve().parents[1]
# .cuda(), "cuda:0" (any index), device="cuda" / torch.device("cuda") literals
HARD_CODED = re.compile(r"""\.cuda\(\s*\)|["']cuda:\d+["']|device\s*=\s*["']cuda["']|"""
                        r"""torch\.device\(\s*["']cuda["']\s*\)""")


@pytest.mark.parametrize("available, count, nccl, world_size, expected", [
    (True, 4, True, 4, "cpu:gloo,cuda:nccl"),    # one GPU per rank: NCCL, gloo for CPU tensors
    (True, 4, True, 1, "cpu:gloo,cuda:nccl"),
    (True, 2, True, 4, "gloo"),                  # fewer GPUs than ranks
    (False, 0, True, 2, "gloo"),                 # CPU-only machine
    (True, 4, False, 2, "gloo"),                 # a build without NCCL
])
def test_backend_choice(available, count, nccl, world_size, expected):
    with mock.patch.object(torch.cuda, "is_available", return_value=available), \
            mock.patch.object(torch.cuda, "device_count", return_value=count), \
            mock.patch.object(dist, "is_nccl_available", return_value=nccl):
        assert choose_backend(world_size) == expected


def test_composite_backend_needs_gpus_and_is_otherwise_accepted():
    with mock.patch.object(torch.cuda, "device_count", return_value=0):
        with pytest.raises(ValueError, match="'cpu:gloo,cuda:nccl' needs one GPU per rank"):
            distlab.run(lambda rank, world_size: rank, 2, backend="cpu:gloo,cuda:nccl")


def code_of(path):
    """(where, line) of the code in a .py file or in a notebook's code cells."""
    if path.suffix == ".py":
        for n, line in enumerate(path.read_text().splitlines(), 1):
            yield f"{path.relative_to(ROOT)}:{n}", line
        return
    for c, cell in enumerate(json.loads(path.read_text())["cells"]):
        if cell["cell_type"] == "code":
            for n, line in enumerate("".join(cell["source"]).splitlines(), 1):
                yield f"{path.relative_to(ROOT)} cell {c} line {n}", line


def test_no_code_hard_codes_a_cuda_device():
    files = sorted((ROOT / "lib").rglob("*.py")) + sorted((ROOT / "notebooks").glob("*.ipynb")) \
        + sorted((ROOT / "solutions").glob("*.ipynb"))
    assert files
    offenders = [f"{where}: {line.strip()}" for path in files for where, line in code_of(path)
                 if HARD_CODED.search(line.split("#")[0])]
    assert not offenders, ("use distlab.device() instead of a fixed CUDA device:\n"
                           + "\n".join(offenders))


@pytest.mark.parametrize("line, hard_coded", [
    ("x = x.cuda()", True), ("t = torch.ones(3, device='cuda')", True),
    ("d = torch.device(\"cuda\")", True), ("to('cuda:1')", True),
    ("x.to(distlab.device())", False), ("torch.cuda.is_available()", False),
])
def test_the_static_check_sees_what_it_should(line, hard_coded):
    assert bool(HARD_CODED.search(line)) == hard_coded


# ---- the GPU self-check (`make gpu-check`): its CPU paths ---------------------------------------

def test_gpu_check_without_a_gpu_says_so_lists_its_rows_and_exits_0():
    import os
    import subprocess
    import sys
    from distlab import gpu_check
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")     # no GPU, even on a machine that has one
    proc = subprocess.run([sys.executable, "-m", "distlab.gpu_check"], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("No GPU on this machine (torch.cuda.is_available() is False)")
    for strategy in gpu_check.STRATEGIES:
        for label in strategy.rows:
            assert label.split(" (")[0] in proc.stdout
    assert "GEMM efficiency, HBM bandwidth and the per-op floor" in proc.stdout


def _table_rows(out):
    """The rows of the printed table: the lines between the dashes and the blank line."""
    lines = out.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("-----")) + 1
    return lines[start:lines.index("", start)]


def test_gpu_check_cpu_table_runs_every_strategy_and_every_row_passes(capsys):
    from distlab import gpu_check
    code = gpu_check.main(["--cpu", "--no-hardware"])
    out = capsys.readouterr().out
    rows = _table_rows(out)
    expected = [label for strategy in gpu_check.STRATEGIES for label in strategy.rows]
    assert len(rows) == len(expected) == 23, out
    for row, label in zip(rows, expected):
        assert row.startswith(label.split(" (")[0]), row
        assert re.search(r"  2  +gloo  +cpu  +\d\.\de[-+]\d\d  +passed  +\d+\.\d{3}$", row), row
    assert "3D (dp=1 pp=2 tp=1)" in out and "4D (dp=1 cp=2 tp=1)" in out
    assert f"{len(expected)} of {len(expected)} passed." in out
    assert code == 0


def _wrong_and_right(rank, world_size, dev, row):
    x = torch.ones(3, device=dev)
    dist.all_reduce(x)
    row("right", lambda: (x - world_size).abs().max())
    row("wrong", lambda: (x - 1).abs().max())          # as if every rank had kept its own value


def _raises_on_rank_1(rank, world_size, dev, row):
    if rank == 1:
        raise ValueError("broken on purpose")
    row("never", lambda: 0.0)


def test_gpu_check_fails_a_row_that_differs_and_one_whose_rank_raises():
    from distlab import gpu_check
    lines = []
    Strategy = gpu_check.Strategy
    rows = gpu_check.run_checks(2, backend="gloo", timeout=60, out=lines.append, checks=[
        Strategy("compare", ("right", "wrong"), _wrong_and_right, 1e-5),
        Strategy("raise", ("raises",), _raises_on_rank_1, 1e-5),
        Strategy("too big", ("needs 64",), _raises_on_rank_1, 1e-5, needs=64)])
    assert [(r["strategy"], r["passed"]) for r in rows] == [
        ("right", True), ("wrong", False), ("raises", False), ("needs 64", None)]
    assert rows[1]["error"] == 1.0 and rows[1]["why"] == "error 1 > 1e-05"
    assert rows[2]["why"] == "rank 1 raised ValueError: broken on purpose"
    assert rows[3]["why"] == "skipped: needs 64 GPUs"
    assert "2 failed:" in lines[-3]
    assert lines[-1] == "  raises: rank 1 raised ValueError: broken on purpose"


def test_the_hardware_table_runs_on_the_cpu_and_knows_the_presets():
    from distlab import gpu_check, hardware
    lines = []
    rows = gpu_check.measure.report(out=lines.append, cpu=True)
    whats = [r["what"] for r in rows]
    assert whats[:2] == ["GEMM 128x128x128 float32", "GEMM 512x512x512 float32"]
    assert "memory copy (read + write)" in whats and whats[-1].startswith("eager op floor")
    assert all(r["measured"] > 0 and r["preset"] is None for r in rows)
    assert lines[0].startswith("Hardware on this CPU (no preset")
    assert gpu_check.measure.preset_for("NVIDIA H200") is hardware.H200
    assert gpu_check.measure.preset_for("NVIDIA H100 80GB HBM3") is hardware.H100
    assert gpu_check.measure.preset_for("NVIDIA A100-SXM4-80GB") is hardware.A100
    assert gpu_check.measure.preset_for("Tesla T4") is None
