"""The built site (`make book`) in headless Chromium: no code cell or output is cut off at the
content width (docs/_static/distlab.css wraps them). Builds the site first when it is missing
or older than a notebook. Run by `make test-browser` only (tests/browser/conftest.py)."""
import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent.parent
SITE = ROOT / "docs" / "_build" / "html"
_spec = importlib.util.spec_from_file_location("screenshot_trace",
                                               ROOT / "tools" / "screenshot_trace.py")
shot = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(shot)

PAGES = ["notebooks/05_data_parallel.html", "notebooks/10_3d_parallelism.html",
         "exercises/03_collectives_from_scratch.html"]


def _site():
    sources = [*ROOT.glob("notebooks/*.ipynb"), *ROOT.glob("exercises/*.ipynb"),
               ROOT / "docs" / "conf.py", ROOT / "docs" / "_static" / "distlab.css"]
    built = SITE / "README.html"
    if not built.exists() or built.stat().st_mtime < max(p.stat().st_mtime for p in sources):
        subprocess.run([sys.executable, "-m", "sphinx", "-b", "html", "-c", "docs", "-q",
                        str(ROOT), str(SITE)], check=True, cwd=ROOT)
    return SITE


@pytest.mark.parametrize("page", PAGES)
def test_no_code_is_clipped(page):
    playwright = pytest.importorskip("playwright.sync_api")
    site = _site()
    with playwright.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=shot.chromium(), args=shot.CHROMIUM_ARGS,
                                    headless=True)
        view = browser.new_page(viewport={"width": 1280, "height": 900})
        view.goto((site / page).as_uri())
        clipped = view.evaluate("""() => [...document.querySelectorAll(
                "div.cell_input pre, div.cell_output pre")]
            .filter(e => e.scrollWidth > e.clientWidth + 1)
            .map(e => e.textContent.split('\\n').sort((a, b) => b.length - a.length)[0])""")
        blocks = view.evaluate("document.querySelectorAll('div.cell_input pre').length")
        browser.close()
    assert blocks > 5, f"{page}: no code cells found: is it a chapter page?"
    assert not clipped, f"{page}: {len(clipped)} code blocks run past the page, e.g. {clipped[0]!r}"
