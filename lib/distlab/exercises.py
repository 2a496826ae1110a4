"""Exercise workbooks are generated from their solutions: `python -m distlab.exercises`.

In solutions/*.ipynb the answer sits between `### BEGIN SOLUTION` and `### END SOLUTION`. The
exercise twin in exercises/ has each region replaced by a `raise NotImplementedError(...)` at the
same indentation, and every output cleared. `--check` reports stale or missing exercise files.

The workbooks carry nbgrader's cell metadata, so an instructor can grade them with nbgrader:
every cell with a solution region is a solution cell ("autograded answer"), every check cell
(`chNN.check_...(...)`) a locked, graded test cell worth `POINTS` points. `--nbgrader-source DIR`
writes the solutions with the same metadata: nbgrader's `source/` version of each workbook.
"""
import argparse
import copy
import re
import sys
from pathlib import Path

import nbformat

from ._stub import STUB      # in a leaf module: every checker rank reads it, without nbformat

BEGIN, END = "### BEGIN SOLUTION", "### END SOLUTION"


def strip_solutions(source, where="cell"):
    out, inside = [], False
    for number, line in enumerate(source.split("\n"), 1):
        marker = line.strip()
        if marker.startswith(BEGIN):
            if inside:
                raise ValueError(f"{where}, line {number}: {BEGIN} inside another solution region")
            inside = True
            indent = line[:len(line) - len(line.lstrip())]
            out += [f"{indent}# YOUR CODE HERE", f"{indent}{STUB}"]
        elif marker.startswith(END):
            if not inside:
                raise ValueError(f"{where}, line {number}: {END} without a {BEGIN} before it")
            inside = False
        elif not inside:
            out.append(line)
    if inside:
        raise ValueError(f"{where}: {BEGIN} is never closed by {END}")
    return "\n".join(out)


CHECK_CALL = re.compile(r"\b(ch\d\d)\.(check_\w+)\(")
DEFINES = re.compile(r"^(?:def|class)\s+(\w+)", re.MULTILINE)
POINTS = 1  # each check cell; edit in nbgrader's "Create Assignment" toolbar to weigh them
NBGRADER_SCHEMA = 3


def _unique(grade_id, taken):
    found, k = grade_id, 2
    while found in taken:
        found, k = f"{grade_id}-{k}", k + 1
    taken.add(found)
    return found


def add_nbgrader_metadata(nb, name="notebook"):
    """Mark solution cells and check cells for nbgrader (in place); returns nb.

    A cell with a solution region: {"solution": true, "grade": false, "locked": false}, named
    after what it defines. A check cell: {"grade": true, "points": POINTS, "locked": true},
    named after its checker. Other cells get no nbgrader metadata (nbgrader leaves them alone).
    """
    stem = Path(name).stem.split("_")[0]
    taken = set()
    for i, cell in enumerate(nb.cells):
        cell.metadata.pop("nbgrader", None)
        if cell.cell_type != "code":
            continue
        source = cell.source
        if BEGIN in source or STUB in source:
            defined = DEFINES.search(source)
            grade_id = f"{stem}-{defined.group(1) if defined else f'solution-cell{i}'}"
            meta = {"solution": True, "grade": False, "locked": False}
        elif CHECK_CALL.search(source):
            grade_id = f"{stem}-{CHECK_CALL.search(source).group(2)}"
            meta = {"solution": False, "grade": True, "locked": True, "points": POINTS}
        else:
            continue
        meta.update(grade_id=_unique(grade_id, taken), schema_version=NBGRADER_SCHEMA)
        cell.metadata["nbgrader"] = meta
    return nb


def make_exercise(nb, name="notebook"):
    nb = copy.deepcopy(nb)
    regions = 0
    for i, cell in enumerate(nb.cells):
        if cell.cell_type != "code":
            continue
        if BEGIN in cell.source:
            regions += cell.source.count(BEGIN)
            cell.source = strip_solutions(cell.source, f"{name}, cell {i}")
        cell.outputs = []
        cell.execution_count = None
    if regions == 0:
        raise ValueError(f"{name} has no {BEGIN} region: a workbook needs at least one exercise")
    return add_nbgrader_metadata(nb, name)


def nbgrader_source(nb, name="notebook"):
    """The solved workbook with nbgrader's metadata and no outputs: nbgrader's `source/`
    version, from which `nbgrader generate_assignment` makes the exercise itself."""
    make_exercise(nb, name)  # validates the markers
    nb = copy.deepcopy(nb)
    for cell in nb.cells:
        if cell.cell_type == "code":
            cell.outputs, cell.execution_count = [], None
    return add_nbgrader_metadata(nb, name)


def expected_exercises(solutions_dir):
    """{exercise file name: its text} for every workbook in solutions_dir."""
    texts = {}
    for path in sorted(Path(solutions_dir).glob("*.ipynb")):
        nb = nbformat.read(path, as_version=4)
        texts[path.name] = nbformat.writes(make_exercise(nb, path.name)) + "\n"
    return texts


def problems(solutions_dir, exercises_dir):
    found = []
    expected = expected_exercises(solutions_dir)
    for name, text in expected.items():
        target = Path(exercises_dir) / name
        if not target.exists():
            found.append(f"{target} is missing")
        elif target.read_text() != text:
            found.append(f"{target} differs from what solutions/{name} generates")
    for target in sorted(Path(exercises_dir).glob("*.ipynb")):
        if target.name not in expected:
            found.append(f"{target} has no solutions/{target.name}")
    return found


def generate(solutions_dir, exercises_dir):
    Path(exercises_dir).mkdir(exist_ok=True)
    for name, text in expected_exercises(solutions_dir).items():
        (Path(exercises_dir) / name).write_text(text)
    return sorted(expected_exercises(solutions_dir))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--solutions", default="solutions")
    parser.add_argument("--exercises", default="exercises")
    parser.add_argument("--check", action="store_true", help="only report stale files")
    parser.add_argument("--nbgrader-source", metavar="DIR",
                        help="write the solved workbooks with nbgrader metadata into DIR "
                             "(e.g. source/ps00 of an nbgrader course) and stop")
    args = parser.parse_args(argv)
    if args.nbgrader_source:
        target = Path(args.nbgrader_source)
        target.mkdir(parents=True, exist_ok=True)
        for path in sorted(Path(args.solutions).glob("*.ipynb")):
            nb = nbgrader_source(nbformat.read(path, as_version=4), path.name)
            nbformat.write(nb, target / path.name)
            print(f"wrote {target / path.name}")
        return 0
    if args.check:
        found = problems(args.solutions, args.exercises)
        for p in found:
            print(p)
        if found:
            print("Run `make exercises` to regenerate them.")
        return 1 if found else 0
    for name in generate(args.solutions, args.exercises):
        print(f"wrote {args.exercises}/{name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
