"""One title style on every page of the course and of the site built from it (`make book`).

The site's table of contents lists each notebook by its first heading, so a mixed style
("02 — …", "04 · … — workbook") reads as a mix of documents: a chapter is `# NN · Title`, a
workbook (solved or not) `# Workbook NN · Title`, NN the notebook's own file prefix.
"""
import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = sorted(p for d in ("notebooks", "solutions", "exercises") for p in (ROOT / d).glob("*.ipynb"))


def title(path):
    for cell in json.loads(path.read_text())["cells"]:
        if cell["cell_type"] == "markdown":
            return "".join(cell["source"]).lstrip().split("\n")[0]
    return ""


@pytest.mark.parametrize("path", PAGES, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_title_style(path):
    number = re.match(r"(\d\d[a-z]?)_", path.name).group(1)
    prefix = "# " if path.parent.name == "notebooks" else "# Workbook "
    pattern = re.escape(prefix + number) + r" · \S"
    assert re.match(pattern, title(path)), (
        f"{path.parent.name}/{path.name}: the first heading is {title(path)!r}; write it as "
        f"'{prefix}{number} · <Title>' so the site lists every page the same way")


def test_every_page_found():
    assert len(PAGES) >= 3 * 13
