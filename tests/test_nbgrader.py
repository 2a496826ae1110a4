"""The workbooks grade with nbgrader itself: a solved workbook earns full marks, the shipped
stub earns zero (one small chapter, to keep it fast: nbgrader runs each notebook in a kernel)."""
import os
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest

from conftest import KERNEL_BORN_DEAD
from distlab.exercises import nbgrader_source

pytest.importorskip("nbgrader", reason="nbgrader is not installed: pip install -e '.[dev]' "
                                       "(or '.[grading]') to test the workbooks with it")

ROOT = Path(__file__).resolve().parent.parent
CHAPTER = "00_why_distributed.ipynb"
ASSIGNMENT = "ps00"


def nbgrader(course, *args):
    env = dict(os.environ, DISTLAB_NO_PROGRESS="1",
               # nbgrader runs `alembic` (its database migrations) from PATH: this environment's
               PATH=str(Path(sys.executable).parent) + os.pathsep + os.environ.get("PATH", ""))
    for attempt in range(3):
        done = subprocess.run([sys.executable, "-m", "nbgrader", *args, ASSIGNMENT,
                               f"--CourseDirectory.root={course}"],
                              cwd=course, env=env, capture_output=True, text=True, timeout=300)
        # A kernel that died at birth (a port taken between its choice and its bind: see
        # conftest.retry_kernel_start) is nbgrader's machine trouble, not a grade: run it again.
        if done.returncode == 0 or not any(s in done.stdout + done.stderr
                                           for s in KERNEL_BORN_DEAD):
            break
    assert done.returncode == 0, f"nbgrader {args[0]} failed:\n{done.stdout}\n{done.stderr}"
    return done


def graded_cells(nb):
    return [(c.metadata.nbgrader.grade_id, c.metadata.nbgrader.get("points"))
            for c in nb.cells if "nbgrader" in c.metadata]


@pytest.fixture(scope="module")
def course(tmp_path_factory):
    """An nbgrader course with chapter 00: the instructor's source, its release, two students."""
    course = tmp_path_factory.mktemp("course")
    solved = nbgrader_source(nbformat.read(ROOT / "solutions" / CHAPTER, as_version=4), CHAPTER)
    for folder, nb in [(course / "source" / ASSIGNMENT, solved),
                       (course / "submitted" / "solver" / ASSIGNMENT, solved),
                       (course / "submitted" / "stub" / ASSIGNMENT,
                        nbformat.read(ROOT / "exercises" / CHAPTER, as_version=4))]:
        folder.mkdir(parents=True)
        nbformat.write(nb, folder / CHAPTER)
    nbgrader(course, "generate_assignment", "--force")
    nbgrader(course, "autograde", "--create", "--force", "--ExecutePreprocessor.timeout=120")
    return course


def test_release_has_the_exercises_graded_cells(course):
    release = nbformat.read(course / "release" / ASSIGNMENT / CHAPTER, as_version=4)
    ours = nbformat.read(ROOT / "exercises" / CHAPTER, as_version=4)
    assert graded_cells(release) == graded_cells(ours)
    checks = [gid for gid, points in graded_cells(ours) if points]
    assert len(checks) >= 2, f"{CHAPTER}: expected graded check cells, found {checks}"
    assert not any("### BEGIN SOLUTION" in c.source for c in release.cells)


def test_solved_workbook_full_marks_and_stub_zero(course):
    from nbgrader.api import Gradebook
    with Gradebook(f"sqlite:///{course / 'gradebook.db'}") as gb:
        solver = gb.find_submission(ASSIGNMENT, "solver")
        stub = gb.find_submission(ASSIGNMENT, "stub")
        assert solver.max_score >= 2
        assert solver.score == solver.max_score, [
            (g.name, g.score, g.max_score) for g in solver.notebooks[0].grades]
        assert stub.score == 0, [(g.name, g.score) for g in stub.notebooks[0].grades]
        assert stub.max_score == solver.max_score
    # The stub's check cells failed with the workbook's own message, not a broken environment.
    graded = nbformat.read(course / "autograded" / "stub" / ASSIGNMENT / CHAPTER, as_version=4)
    errors = [o for c in graded.cells if c.metadata.get("nbgrader", {}).get("grade")
              for o in c.outputs if o.output_type == "error"]
    assert errors and all(e.ename == "NotImplementedError" for e in errors), [
        (e.ename, e.evalue) for e in errors]
