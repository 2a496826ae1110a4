"""Exercises are generated from solutions, stay in sync, and their stubs fail cleanly."""
import re
from pathlib import Path

import nbformat
import pytest

from conftest import retry_kernel_start
from distlab.exercises import CHECK_CALL, make_exercise, problems, strip_solutions

ROOT = Path(__file__).resolve().parent.parent


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


# The unsolved workbooks run in the solved ones' kernel: tests/test_solutions.py
# (test_unsolved_exercises_fail_cleanly), one kernel for both sets.


# Every workbook from 02 on, and how many exercises each has: every exercise carries two folded
# hints (a general one, then a more specific one) between its statement and its code.
HINTED = {"00_why_distributed.ipynb": 3, "01_processes_and_ranks.ipynb": 5,
          "02_collectives.ipynb": 4, "03_collectives_from_scratch.ipynb": 3,
          "04_device_meshes.ipynb": 3, "05_data_parallel.ipynb": 7,
          "06_memory_and_zero.ipynb": 3,
          "07_tensor_parallel.ipynb": 3, "08_pipeline_parallel.ipynb": 3,
          "09_expert_parallel.ipynb": 3,
          "10_3d_parallelism.ipynb": 5, "11_debugging.ipynb": 6,
          "12_context_parallelism.ipynb": 6, "13_slow_links_and_failures.ipynb": 3}


def test_every_workbook_is_hinted():
    books = {p.name for p in (ROOT / "solutions").glob("*.ipynb")}
    assert books == set(HINTED)


FOLDED_HINT = re.compile(r"^<details>\s*<summary>(?:<b>)?Hint", re.M)   # one per hint, one or two a cell


@pytest.mark.parametrize("name, exercises", HINTED.items(), ids=list(HINTED))
def test_every_exercise_has_three_folded_hints(name, exercises):
    cells = nbformat.read(ROOT / "solutions" / name, as_version=4).cells
    starts = [i for i, c in enumerate(cells) if c.source.startswith("## Exercise")]
    assert len(starts) == exercises
    for i in starts:
        hints = 0
        for c in cells[i + 1:]:
            if c.cell_type == "code":
                break
            hints += len(FOLDED_HINT.findall(c.source))
        # issue 44: three rungs (a question, the step, the formula; never the code)
        assert hints == 3, f"{name}, {cells[i].source.splitlines()[0]}: {hints} folded hints"


@pytest.mark.parametrize("path", EXERCISES, ids=[p.name for p in EXERCISES])
def test_workbooks_carry_nbgrader_metadata(path):
    """Every stub cell is an nbgrader solution cell, every check cell a locked graded cell with
    points, grade ids unique: what `nbgrader generate_assignment` / `autograde` need."""
    nb = nbformat.read(path, as_version=4)
    ids = []
    for i, cell in enumerate(nb.cells):
        meta = cell.metadata.get("nbgrader")
        if cell.cell_type != "code":
            assert meta is None, f"{path.name}, cell {i}: a markdown cell marked for nbgrader"
            continue
        if "NotImplementedError(\"exercise:" in cell.source:
            assert meta and meta["solution"] and not meta["grade"] and not meta["locked"], (
                f"{path.name}, cell {i}: an exercise cell that nbgrader does not see as a solution")
        elif CHECK_CALL.search(cell.source):
            assert meta and meta["grade"] and meta["locked"] and meta["points"] > 0, (
                f"{path.name}, cell {i}: a check cell that nbgrader would not grade")
        else:
            assert meta is None, f"{path.name}, cell {i}: marked for nbgrader but neither kind"
            continue
        assert meta["schema_version"] == 3
        ids.append(meta["grade_id"])
    assert len(ids) == len(set(ids)), f"{path.name}: duplicate grade ids {sorted(ids)}"


def test_nbgrader_source_keeps_the_answers():
    from distlab.exercises import nbgrader_source
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell("def f(x):\n    ### BEGIN SOLUTION\n    return x\n"
                                          "    ### END SOLUTION"),
                nbformat.v4.new_code_cell("ch99.check_f(f)"),
                nbformat.v4.new_code_cell("ch99.check_f(f)")]
    out = nbgrader_source(nb, "99_x.ipynb")
    assert "return x" in out.cells[0].source
    assert [c.metadata.nbgrader.grade_id for c in out.cells] == [
        "99-f", "99-check_f", "99-check_f-2"]
    assert out.cells[1].metadata.nbgrader.points == 1


def test_a_kernel_that_dies_at_birth_is_started_again():
    """The test run's own guard (conftest.retry_kernel_start): a kernel killed by a port taken
    from under it is started again, twice at most; any other failure is not retried."""
    calls = []

    def dies(times, message="Kernel died before replying to kernel_info"):
        def start():
            calls.append(1)
            if len(calls) <= times:
                raise RuntimeError(message)
            return "kernel"
        return start

    assert retry_kernel_start(dies(2))() == "kernel" and len(calls) == 3
    calls.clear()
    with pytest.raises(RuntimeError, match="died"):
        retry_kernel_start(dies(3))()
    assert len(calls) == 3
    calls.clear()
    with pytest.raises(RuntimeError, match="something else"):
        retry_kernel_start(dies(1, "something else"))()
    assert len(calls) == 1


def test_every_workbook_checker_has_its_battery():
    """Issue 44: every checker a workbook calls is proven, in these tests, against a wrong, a
    cheating, a decoy and a differently-written correct answer (tests/checker_battery.py) — a new
    exercise cannot land with a checker only its own solution has seen."""
    called = set()
    for path in sorted((ROOT / "solutions").glob("*.ipynb")):
        for cell in nbformat.read(path, as_version=4).cells:
            if cell.cell_type == "code":
                called |= set(re.findall(r"\b(ch\d\d)\.(check_\w+)\(", cell.source))
    assert len(called) >= 50
    tests = "\n".join(p.read_text() for p in (ROOT / "tests").glob("test_*.py"))
    lacking = {}
    for chapter, check in sorted(called):
        kinds = set()
        for use in re.finditer(rf"battery\(\s*(?:lambda[^:]*:\s*)?{chapter}\.{check}\b", tests):
            call = tests[use.start():tests.find("\n\n", use.start())]
            kinds |= set(re.findall(r"\b(wrong|cheat|decoy|different)=\[", call))
        if kinds != {"wrong", "cheat", "decoy", "different"}:
            lacking[f"{chapter}.{check}"] = sorted({"wrong", "cheat", "decoy", "different"} - kinds)
    assert not lacking, f"checkers whose battery lacks these kinds of answer: {lacking}"
