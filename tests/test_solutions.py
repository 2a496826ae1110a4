"""The solved workbooks, run as nbval runs them, in one kernel instead of thirteen; the unsolved
ones after them in the same kernel, each check failing cleanly.

`make test` runs nbval on notebooks/; the workbooks' solutions are run here, one after another in
one kernel (conftest.run_in_one_kernel), and judged as nbval judges a notebook: no cell raises,
and every cell's outputs equal the stored ones after tests/sanitize.cfg's substitutions, streams
joined, except cells marked `# NBVAL_IGNORE_OUTPUT` (nbval's own comparison rules, from
nbval.plugin). A kernel per workbook cost ≈ 10 CPU-seconds each: 2 minutes of the suite's 2
cores. `make test-portable` still runs nbval itself on solutions/, one kernel each, under another
CPU's rounding.
"""
from collections import defaultdict
from pathlib import Path

import pytest

from conftest import run_in_one_kernel
from distlab.exercises import CHECK_CALL

nbval_plugin = pytest.importorskip("nbval.plugin")

ROOT = Path(__file__).resolve().parent.parent
SOLUTIONS = sorted((ROOT / "solutions").glob("*.ipynb"))
EXERCISES = sorted((ROOT / "exercises").glob("*.ipynb"))
# nbval's defaults (IPyNbFile.skip_compare, without --nbdime): what it never compares.
SKIP = ("metadata", "traceback", "prompt_number", "output_type", "name", "execution_count",
        "application/vnd.jupyter.widget-view+json", "image/png", "image/jpeg")


def sanitize_patterns():
    text = (ROOT / "tests" / "sanitize.cfg").read_text()
    return nbval_plugin.get_sanitize_patterns(text)


def comparable(outputs, patterns):
    """{key: [sanitized values]}: nbval's flattening of a cell's outputs (compare_outputs)."""
    import copy
    import re
    outputs = nbval_plugin.transform_streams_for_comparison(
        nbval_plugin.coalesce_streams(copy.deepcopy(list(outputs))))
    flat = defaultdict(list)

    def clean(value):
        if isinstance(value, str):
            for regex, replace in patterns:
                value = re.sub(regex, replace, value)
        return value

    for out in outputs:
        for key, value in out.items():
            if key in SKIP:
                continue
            if key == "data":
                for mime, data in value.items():
                    if mime not in SKIP:
                        flat[mime].append(clean(data))
            else:
                flat[key].append(clean(value))
    return dict(flat)


@pytest.fixture(scope="module")
def executed():
    """Every solved workbook, then every unsolved one, in ONE kernel (a kernel, torch's import
    and a forkserver are ≈ 13 CPU-seconds: the unsolved set once had a kernel of its own):
    {path: (its stored cells, its executed cells)}."""
    return run_in_one_kernel(SOLUTIONS + EXERCISES, timeout=300)


@pytest.mark.parametrize("path", SOLUTIONS, ids=[p.name for p in SOLUTIONS])
def test_solved_workbook_runs_and_matches_its_outputs(path, executed):
    stored, ran = executed[path]
    patterns = list(sanitize_patterns())
    for i, (before, after) in enumerate(zip(stored, ran)):
        if before.cell_type != "code":
            continue
        errors = [o for o in after.outputs if o.output_type == "error"]
        assert not errors, (f"{path.name}, cell {i} raised {errors[0].ename}: "
                            f"{errors[0].evalue}")
        markers = dict(nbval_plugin.find_comment_markers(before.source))
        if markers.get("check") is False:          # NBVAL_IGNORE_OUTPUT
            continue
        assert comparable(after.outputs, patterns) == comparable(before.outputs, patterns), (
            f"{path.name}, cell {i}: its outputs differ from the stored ones (run "
            f"`make regen NB=solutions/{path.name}` after a deliberate change)")


def test_the_comparison_sees_a_changed_output():
    import nbformat
    cell = nbformat.v4.new_code_cell("print(1)")
    cell.outputs = [nbformat.v4.new_output("stream", name="stdout", text="1\n")]
    other = [nbformat.v4.new_output("stream", name="stdout", text="2\n")]
    patterns = list(sanitize_patterns())
    assert comparable(cell.outputs, patterns) != comparable(other, patterns)
    moved = [nbformat.v4.new_output("stream", name="stdout", text="at 0x7f00dead1234\n")]
    again = [nbformat.v4.new_output("stream", name="stdout", text="at 0x7f00beef5678\n")]
    assert comparable(moved, patterns) == comparable(again, patterns)   # sanitize.cfg applies


@pytest.mark.parametrize("path", EXERCISES, ids=[p.name for p in EXERCISES])
def test_unsolved_exercises_fail_cleanly(path, executed):
    """Every check cell of an unsolved workbook raises a clear NotImplementedError, never hangs."""
    checks = 0
    for i, cell in enumerate(executed[path][1]):
        if cell.cell_type != "code":
            continue
        errors = [o for o in cell.outputs if o.output_type == "error"]
        for error in errors:
            assert error.ename == "NotImplementedError", (
                f"{path.name}, cell {i}: expected a NotImplementedError from an unsolved "
                f"exercise, got {error.ename}: {error.evalue}")
        if CHECK_CALL.search(cell.source):
            checks += 1
            assert errors, f"{path.name}, cell {i}: the check passed on an unsolved exercise"
            assert "is not written yet" in errors[0].evalue or "exercise:" in errors[0].evalue
    assert checks >= 1, f"{path.name} has no check cell (chNN.check_...(...))"
