"""What the course puts in front of the learner: its real code (`show_source`), never a pasted
copy; a verdict against a tolerance (`agreement`); a table of numbers (`text_table`)."""
import inspect
import re
import textwrap


def source_of(obj, lines=None):
    """The source text of a function, class or module (optionally only `lines=(first, last)`,
    counted from 1 within the object's source)."""
    try:
        text = inspect.getsource(obj)
    except (TypeError, OSError) as e:
        raise TypeError(f"show_source can show functions, classes and modules of the course; "
                        f"{obj!r} has no source to show ({e}).") from None
    text = textwrap.dedent(text)
    if lines is not None:
        first, last = lines
        text = "\n".join(text.splitlines()[first - 1:last])
    return text.rstrip("\n")


def show_source(*objs, lines=None):
    """Display the source of each object, syntax highlighted in JupyterLab (plain text elsewhere)."""
    from IPython.display import Markdown, display
    for obj in objs:
        text = source_of(obj, lines)
        where = _location(obj)
        header = f"`{where}`\n\n" if where else ""
        display(Markdown(f"{header}```python\n{text}\n```"))


def _location(obj):
    module = inspect.getmodule(obj)
    if module is None or not module.__name__.startswith("distlab"):
        return ""
    name = getattr(obj, "__qualname__", None)
    return f"{module.__name__}.{name}" if name and not inspect.ismodule(obj) else module.__name__


def agreement(difference, tolerance):
    """'within 1e-12: True' when `difference` is at most `tolerance`, else 'NOT within 1e-12
    (differs by 3.1e-01)'. Equality is printed as a verdict against a stated tolerance, never as
    the round-off digits of the difference: another CPU, BLAS or thread count prints other digits,
    and stored notebook outputs must read the same on every machine."""
    difference, tolerance = float(difference), float(tolerance)
    if not tolerance > 0:
        raise ValueError(f"agreement needs a positive tolerance; got {tolerance!r}.")
    if difference <= tolerance:
        return f"within {tolerance:.0e}: True"
    return f"NOT within {tolerance:.0e} (differs by {difference:.1e})"


def text_table(rows, columns):
    """One header line and one line per row. `columns`: (header, format spec, value of a row)
    triples, or "|" between groups; each header takes its column's alignment and width."""
    def line(cells):
        return " ".join(cells)
    head, body = [], [[] for _ in rows]
    for column in columns:
        if column == "|":
            head.append("|")
            for cells in body:
                cells.append("|")
            continue
        header, spec, value = column
        head.append(format(header, re.match(r"[<>^]?\d*", spec).group()))
        for cells, row in zip(body, rows):
            cells.append(format(value(row), spec))
    return "\n".join([line(head)] + [line(cells) for cells in body])
