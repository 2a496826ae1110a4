"""Exercises are generated from solutions, stay in sync, and their stubs fail cleanly."""
import re
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient
from nbclient.exceptions import CellTimeoutError

from distlab.exercises import make_exercise, problems, strip_solutions

ROOT = Path(__file__).resolve().parent.parent
CHECK_CALL = re.compile(r"\bch\d\d\.check_\w+\(")


def test_strip_solutions_keeps_indentation_and_the_rest():
    source = ("def f(x):\n    y = 1\n    ### BEGIN SOLUTION\n    return x + y\n"
              "    ### END SOLUTION\n\nprint('after')")
    assert strip_solutions(source) == (
        "def f(x):\n    y = 1\n    # YOUR CODE HERE\n"
        '    raise NotImplementedError("exercise: replace this line with your code")\n'
        "\nprint('after')")


@pytest.mark.parametrize("source, phrase", [
    ("### BEGIN SOLUTION\nx = 1", "never closed"),
    ("x = 1\n### END SOLUTION", "without a ### BEGIN SOLUTION"),
    ("### BEGIN SOLUTION\n### BEGIN SOLUTION\n### END SOLUTION", "inside another"),
])
def test_broken_markers_are_reported(source, phrase):
    with pytest.raises(ValueError, match=phrase):
        strip_solutions(source)


def test_exercise_cells_lose_their_outputs():
    nb = nbformat.v4.new_notebook()
    cell = nbformat.v4.new_code_cell("### BEGIN SOLUTION\nx = 1\n### END SOLUTION")
    cell.outputs = [nbformat.v4.new_output("stream", text="1\n")]
    cell.execution_count = 3
    nb.cells = [cell]
    out = make_exercise(nb)
    assert out.cells[0].outputs == [] and out.cells[0].execution_count is None
    assert nb.cells[0].execution_count == 3  # the solution itself is untouched


def test_exercises_are_up_to_date():
    found = problems(ROOT / "solutions", ROOT / "exercises")
    assert not found, "\n".join(found) + "\nRun `make exercises`."


EXERCISES = sorted((ROOT / "exercises").glob("*.ipynb"))


@pytest.mark.parametrize("path", EXERCISES, ids=[p.name for p in EXERCISES])
def test_unsolved_exercises_fail_cleanly(path):
    """Every check cell of an unsolved workbook raises a clear NotImplementedError, never hangs."""
    nb = nbformat.read(path, as_version=4)
    client = NotebookClient(nb, timeout=120, kernel_name="python3", allow_errors=True,
                            resources={"metadata": {"path": str(path.parent)}})
    try:
        client.execute()
    except CellTimeoutError as e:  # pragma: no cover - the failure we guard against
        pytest.fail(f"{path.name}: a cell hung instead of failing cleanly: {e}")
    checks = 0
    for i, cell in enumerate(nb.cells):
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
