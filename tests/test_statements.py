"""No exercise's statement or hints contain its answer's calls (issue 44 item 5).

An exercise, in a workbook (solutions/*.ipynb, see distlab.exercises): the markdown cell that
starts with "## Exercise", the markdown cells after it up to its first solution cell (its hints,
folded in <details>, and any further statement), and the code between `### BEGIN SOLUTION` and
`### END SOLUTION` in the code cells up to the next exercise.

The rule, decided here:
- THE ANSWER'S CALLS are found in the solution regions' AST: calls of `torch.*`, `torch.nn.*`,
  `F.*` (torch.nn.functional), `dist.*` (torch.distributed) and `distlab.*` however the module was
  aliased in the workbook's imports, and calls of a name imported from them (`from
  torch.distributed import all_gather`). Methods of the learner's own objects (`x.view`,
  `model.parameters()`, `work.wait()`) are not: they are how any code reads, not the answer.
  Trivial calls are not either — what every rank function uses whatever the exercise
  (`TRIVIAL`: a rank's and a group's size and position, tensor constructors, seeding, dtypes);
- AS CODE in the statement or the hints: inside a backticked span or a fenced code block, the
  call's name (its last dotted part) as a word followed by "(", or the whole span being that
  name (`all_reduce`, `dist.all_reduce`). Prose that names an idea ("an all-reduce") is fine.
The statement states the goal; the chapter teaches the calls; the learner chooses them.
"""
import ast
import re
from pathlib import Path

import nbformat
import pytest

from distlab.exercises import BEGIN, END

ROOT = Path(__file__).resolve().parent.parent
MODULES = {"torch", "torch.nn", "torch.nn.functional", "torch.distributed", "distlab"}
TRIVIAL = {"get_rank", "get_world_size", "get_group_rank", "get_global_rank", "get_process_group_ranks",
           "is_initialized", "tensor", "zeros", "ones", "empty", "full", "arange", "zeros_like",
           "ones_like", "empty_like", "full_like", "manual_seed", "Generator", "no_grad",
           "set_default_dtype", "get_default_dtype", "float32", "float64", "device", "Size",
           "is_tensor", "numel", "run", "run_learner"}
# Calls a statement must name because they are the exercise's material, not its answer:
# (workbook, start of the exercise's title) -> {call: why}. Nothing else is allowed.
MATERIAL = {
    ("10_", "Exercise 4"): {"layout.price": "the planner the exercise hands the learner, with the "
                                            "arguments that differ from the chapter's"},
    ("11_", "Exercise 2"): {"F.mse_loss": "the buggy loop the learner is asked to debug",
                            "dist.all_reduce": "the buggy loop the learner is asked to debug"},
}


def _aliases(nb):
    """{name in the workbook: module or 'module.function'} from every import in its code."""
    names = {}
    for cell in nb.cells:
        if cell.cell_type != "code":
            continue
        try:
            tree = ast.parse(cell.source)
        except SyntaxError:
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                for a in node.names:
                    if a.name.split(".")[0] in ("torch", "distlab"):
                        names[a.asname or a.name.split(".")[0]] = (
                            a.name if a.asname else a.name.split(".")[0])
            elif isinstance(node, ast.ImportFrom) and node.module and \
                    node.module.split(".")[0] in ("torch", "distlab"):
                for a in node.names:
                    names[a.asname or a.name] = f"{node.module}.{a.name}"
    return names


def _dotted(node):
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        return [node.id] + parts[::-1]
    return None


def _solution_code(source):
    out, inside = [], False
    for line in source.split("\n"):
        if line.strip().startswith(BEGIN):
            inside = True
        elif line.strip().startswith(END):
            inside = False
        elif inside:
            out.append(line)
    return "\n".join(out)


def answer_calls(code, aliases):
    """The dotted names of the torch/distlab calls `code` makes (see the module's rule)."""
    import textwrap
    try:
        tree = ast.parse(textwrap.dedent(code))
    except SyntaxError:
        return set()
    found = set()
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        path = _dotted(node.func)
        if not path or path[0] not in aliases:
            continue
        target = aliases[path[0]]
        root = target.split(".")[0]
        if len(path) == 1 and target.rsplit(".", 1)[0] not in MODULES | {root}:
            continue
        name = path[-1] if len(path) > 1 else target.rsplit(".", 1)[-1]
        if name in TRIVIAL or name.startswith("check_"):
            continue
        found.add(".".join(path))
    return found


CODE_SPAN = re.compile(r"```.*?```|`[^`\n]+`", re.S)


def named_as_code(text, call):
    """The first backticked span or code block of `text` that names `call`, else None."""
    name = call.rsplit(".", 1)[-1]
    word = re.compile(rf"(?<![\w.]){re.escape(name)}\s*\(|(?<=\.){re.escape(name)}\s*\(")
    for m in CODE_SPAN.finditer(text):
        span = m.group(0).strip("`").strip()
        if word.search(span) or span in (name, call) or span.endswith("." + name):
            return m.group(0)
    return None


def exercises():
    """[(workbook, title, statement + hints text, the answer's calls)] of every exercise."""
    out = []
    for path in sorted((ROOT / "solutions").glob("*.ipynb")):
        nb = nbformat.read(path, as_version=4)
        aliases = _aliases(nb)
        current = None
        for cell in nb.cells:
            if cell.cell_type == "markdown" and cell.source.startswith("## Exercise"):
                current = dict(book=path.name, title=cell.source.splitlines()[0][3:],
                               text=[cell.source], code=[], solved=False)
                out.append(current)
            elif current is None:
                continue
            elif cell.cell_type == "markdown" and not current["solved"]:
                current["text"].append(cell.source)
            elif cell.cell_type == "markdown" and cell.source.startswith("## "):
                current = None
            elif cell.cell_type == "code" and BEGIN in cell.source:
                current["solved"] = True
                current["code"].append(_solution_code(cell.source))
        for ex in out:
            if ex["book"] == path.name and "calls" not in ex:
                ex["calls"] = set().union(*(answer_calls(c, aliases) for c in ex["code"]))
    return [(e["book"], e["title"], "\n\n".join(e["text"]), e["calls"]) for e in out]


def offenders(text, calls):
    return sorted((call, span) for call in calls for span in [named_as_code(text, call)] if span)


EXERCISES = exercises()


def _param(book, title, text, calls):
    allowed = next((set(v) for (b, t), v in MATERIAL.items()
                    if book.startswith(b) and title.startswith(t)), set())
    return pytest.param(book, title, text, calls, allowed, id=f"{book[:2]}-{title[:40]}")


@pytest.mark.parametrize("book, title, text, calls, allowed",
                         [_param(*e) for e in EXERCISES])
def test_no_statement_names_its_answers_calls(book, title, text, calls, allowed):
    material = {a.rsplit(".", 1)[-1] for a in allowed}       # however the module is aliased
    found = [(c, span) for c, span in offenders(text, calls)
             if c.rsplit(".", 1)[-1] not in material]
    assert not found, (f"{book}, {title}: the statement or its hints name the answer's calls as "
                       f"code: " + "; ".join(f"{c} in {s}" for c, s in found)
                       + " — state the goal instead; the chapter teaches the calls.")


def test_the_rule_finds_calls_and_names():
    code = "t = dist.all_reduce(x, group=g)\ny = torch.cat([a, b])\nr = dist.get_rank(g)\nx.view(2)"
    calls = answer_calls(code, {"dist": "torch.distributed", "torch": "torch"})
    assert calls == {"dist.all_reduce", "torch.cat"}
    assert named_as_code("sum them with `dist.all_reduce`", "dist.all_reduce")
    assert named_as_code("```\nall_reduce(t)\n```", "dist.all_reduce")
    assert not named_as_code("an all-reduce of the gradients", "dist.all_reduce")
    assert not named_as_code("write `bidirectional_all_reduce(tensor, group)`", "dist.all_reduce")
    assert len(EXERCISES) >= 20
