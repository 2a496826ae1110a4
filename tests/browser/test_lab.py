"""Chapters 04, 06 and 08 in JupyterLab, in a real headless Chromium.

Opened as stored, without running a cell: the widget views are drawn from the widget state saved
in the notebook (tools/regen.py keeps it) where the notebook is trusted, and the stored picture
of the default view where it is not (a fresh clone) -- never "Error displaying widget".
Then run all cells: every widget renders (no "Error displaying widget", no plain-text widget
repr), and moving one control of each course widget changes what it shows. On failure a
screenshot of the page is saved under screenshots/ (and on success one of each widget,
NN_name-widget.png and NN_name-stored.png, for a person to look at).

    make test-browser        (DISTLAB_CHROMIUM=/path/to/chrome to choose the browser)

The notebooks are copied to a temporary folder first: JupyterLab autosaves, and the stored
outputs in notebooks/ must stay those of tools/regen.py. The server gets its own Jupyter data
folder there too (the notebook-trust database and its key), so signing the copies as trusted
touches nothing of the user's.

Waits are generous (a slow 2-core machine starts a kernel in tens of seconds) and explicit: each
step waits for what it needs to see (a kernel's idle status, every prompt numbered, every widget
drawn with its pictures loaded), never for a fixed time.
"""
import json
import os
import shutil
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import nbformat
import pytest
from nbformat.sign import NotebookNotary

from distlab.launch import _free_port as free_port

playwright = pytest.importorskip("playwright.sync_api", reason="pip install -e '.[browser]'")

ROOT = Path(__file__).resolve().parents[2]
SHOTS = Path(__file__).resolve().parent / "screenshots"
TOKEN = "distlab-browser-test"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                 "--disable-background-networking", "--disable-extensions",
                 "--disable-component-update", "--no-first-run"]
CHAPTERS = ("04_device_meshes", "06_memory_and_zero", "08_pipeline_parallel")
WIDGET_VIEW = "application/vnd.jupyter.widget-view+json"
KERNEL_START_MS = 180_000  # a cold kernel on a busy 2-core machine
WIDGET_REPRS = ("MeshExplorer(", "interactive(children=", "VBox(children=", "HBox(children=",
                "IntSlider(", "Dropdown(")


def chromium_path():
    """Playwright's own Chromium where `playwright install chromium` worked, else Debian's."""
    if os.environ.get("DISTLAB_CHROMIUM"):
        return os.environ["DISTLAB_CHROMIUM"]
    with playwright.sync_playwright() as p:
        own = p.chromium.executable_path
    if own and Path(own).exists():
        return None  # playwright's default
    for name in ("chromium", "chromium-browser", "google-chrome"):
        found = shutil.which(name)
        if found:
            return found
    pytest.skip("no Chromium: `playwright install chromium` or `apt-get install chromium`")


def widget_cells(name):
    """The indices of the cells whose stored outputs show a widget view."""
    nb = nbformat.read(ROOT / "notebooks" / f"{name}.ipynb", as_version=4)
    return [i for i, cell in enumerate(nb.cells)
            if any(WIDGET_VIEW in out.get("data", {}) for out in cell.get("outputs", []))]


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    """A JupyterLab server on loopback over copies of the chapters; yields its base URL.

    notebooks/: without outputs, to run. trusted/ and untrusted/: as stored, signed as trusted
    (JupyterLab then draws widget views) or not (it shows their stored picture instead)."""
    work = tmp_path_factory.mktemp("lab")
    for folder in ("notebooks", "trusted", "untrusted", "data"):
        (work / folder).mkdir()
    notary = NotebookNotary(data_dir=str(work / "data"))
    for name in CHAPTERS:
        for folder in ("trusted", "untrusted"):
            shutil.copy(ROOT / "notebooks" / f"{name}.ipynb", work / folder)
        notary.sign(nbformat.read(work / "trusted" / f"{name}.ipynb", as_version=4))
        # Without their stored outputs: what the test sees is what this run drew, and a cell
        # counts as run once its prompt has a number.
        nb = nbformat.read(ROOT / "notebooks" / f"{name}.ipynb", as_version=4)
        for cell in nb.cells:
            if cell.cell_type == "code":
                cell.outputs, cell.execution_count = [], None
        nbformat.write(nb, work / "notebooks" / f"{name}.ipynb")
    # Every cell in the page (no windowing: the test reads all prompts), no news pop-up.
    for plugin, settings in [("notebook-extension/tracker", '{"windowingMode": "none"}'),
                             ("apputils-extension/notification", '{"fetchNews": "false"}')]:
        path = work / "settings" / "@jupyterlab" / f"{plugin}.jupyterlab-settings"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(settings)
    port = free_port()
    env = dict(os.environ, JUPYTER_CONFIG_DIR=str(work / "config"),
               JUPYTER_DATA_DIR=str(work / "data"),
               JUPYTERLAB_SETTINGS_DIR=str(work / "settings"),
               JUPYTERLAB_WORKSPACES_DIR=str(work / "workspaces"),
               PATH=str(Path(sys.executable).parent) + os.pathsep + os.environ.get("PATH", ""))
    cmd = [sys.executable, "-m", "jupyter", "lab", "--no-browser", f"--port={port}",
           "--ip=127.0.0.1", f"--IdentityProvider.token={TOKEN}", f"--notebook-dir={work}",
           "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate",
           "--LabApp.news_url=", "--ServerApp.disable_check_xsrf=False"]
    if os.geteuid() == 0:
        cmd.append("--allow-root")
    log = open(work / "lab.log", "w")
    server = subprocess.Popen(cmd, cwd=work, env=env, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        until = time.monotonic() + 90
        while True:
            try:
                urllib.request.urlopen(f"{url}/api/status?token={TOKEN}", timeout=2)
                break
            except OSError:
                if server.poll() is not None or time.monotonic() > until:
                    pytest.fail(f"JupyterLab did not start:\n{(work / 'lab.log').read_text()}")
                time.sleep(0.5)
        yield url
    finally:
        server.terminate()
        try:
            server.wait(20)
        except subprocess.TimeoutExpired:
            server.kill()
        log.close()


@pytest.fixture(scope="module")
def browser():
    path = chromium_path()
    with playwright.sync_playwright() as p:
        try:
            b = p.chromium.launch(executable_path=path, args=CHROMIUM_ARGS, headless=True)
        except playwright.Error as e:  # the machine's browser, not the course
            pytest.skip(f"Chromium ({path or 'playwright'}) did not start: "
                        f"{str(e).splitlines()[0]}")
        yield b
        b.close()


PANEL = ".jp-NotebookPanel:not(.lm-mod-hidden)"  # the notebook in front
PROMPTS = ("[...document.querySelectorAll('" + PANEL + " .jp-CodeCell .jp-InputArea-prompt')]"
           ".map(p => p.textContent.trim())")


def wait_prompts(page, condition, timeout):
    """Wait until `condition` (JS, over `prompts`: the code cells' prompts) holds."""
    page.wait_for_function(f"() => {{ const prompts = {PROMPTS}; return {condition}; }}",
                           timeout=timeout, polling=500)


def api(url, path, method="GET"):
    request = urllib.request.Request(f"{url}{path}", method=method,
                                     headers={"Authorization": f"token {TOKEN}"})
    with urllib.request.urlopen(request, timeout=30) as response:
        body = response.read()
    return json.loads(body) if body else None


def shut_down_kernels(url):
    """End every session (and its kernel): the next chapter gets the machine's cores."""
    try:
        for session in api(url, "/api/sessions"):
            api(url, f"/api/sessions/{session['id']}", method="DELETE")
    except OSError as e:  # clean-up only: never hide the test's own failure
        print(f"could not shut the kernels down: {e}")


def open_notebook(page, url, path):
    # ?reset: a fresh workspace (no tab of an earlier test restored beside this one)
    page.goto(f"{url}/lab/tree/{path}?reset&token={TOKEN}")
    page.wait_for_selector(".jp-Notebook .jp-Cell", timeout=90_000)
    # The kernel is up when the status bar says so ("Python 3 (ipykernel) | Idle").
    page.wait_for_function(
        "() => /\\|\\s*Idle/.test(document.querySelector('#jp-main-statusbar')?.innerText)",
        timeout=KERNEL_START_MS, polling=500)


# An output holding a drawn widget view (a failed one says "Error displaying widget" in the
# output node itself, which then carries the class: `> ` tells them apart).
DRAWN = f"{PANEL} .jp-OutputArea-output:has(> .jupyter-widgets)"
LOADED = "[...o.querySelectorAll('img')].every(i => i.complete && i.naturalWidth > 0)"


def wait_widgets_drawn(page, count, timeout=120_000):
    """Wait until `count` widget views are drawn, none still "Loading widget...", with every
    picture inside loaded, or until one says "Error displaying widget" (JupyterLab's last word
    on it); on a timeout return quietly: the checks that follow say what is missing, and a
    screenshot shows it."""
    try:
        page.wait_for_function(
            f"""() => {{
                const outputs = [...document.querySelectorAll('{PANEL} .jp-OutputArea-output')];
                if (outputs.some(o => /Error displaying widget/.test(o.innerText))) return true;
                const drawn = [...document.querySelectorAll('{DRAWN}')];
                return !outputs.some(o => /Loading widget/.test(o.innerText))
                    && drawn.length >= {count} && drawn.every(o => {LOADED});
            }}""", timeout=timeout, polling=500)
    except playwright.TimeoutError:
        pass


def open_and_run_all(page, url, name):
    open_notebook(page, url, f"notebooks/{name}.ipynb")
    # The copy has no stored outputs: every prompt is empty before the run.
    wait_prompts(page, "prompts.length > 0 && prompts.every(t => !/\\d/.test(t))", 30_000)
    page.locator(".lm-MenuBar-itemLabel", has_text="Run").first.click()
    page.locator(".lm-Menu-itemLabel", has_text="Run All Cells").first.click()
    wait_prompts(page, "prompts.some(t => /[*\\d]/.test(t))", 60_000)  # it started
    # Done when every code cell has its number ("[*]" runs or waits, "[ ]" never ran).
    wait_prompts(page, "prompts.every(t => /^\\[\\d+\\]:$/.test(t))", 420_000)
    page.wait_for_selector(".jp-Notebook-ExecutionIndicator[data-status='idle']",
                           timeout=60_000)
    wait_widgets_drawn(page, len(widget_cells(name)))  # views render after their models


def check_widgets_rendered(page, name):
    outputs = page.locator(f"{PANEL} .jp-OutputArea-output")
    texts = outputs.all_inner_texts()
    broken = [t for t in texts if "Error displaying widget" in t or "Loading widget" in t]
    assert not broken, f"{name}: widgets that did not render: {broken[:3]}"
    shown = outputs.evaluate_all("os => os.map(o => [o.dataset.mimeType, o.innerText])")
    reprs = [(mime, t) for mime, t in shown if t.strip().startswith(WIDGET_REPRS)]
    assert not reprs, f"{name}: widgets shown as plain text: {[(m, r[:80]) for m, r in reprs]}"
    errors = page.locator(f"{PANEL} .jp-OutputArea-output"
                          "[data-mime-type='application/vnd.jupyter.stderr']").all_inner_texts()
    tracebacks = [t for t in errors if "Traceback" in t or "Error" in t.split("\n")[0]]
    assert not tracebacks, f"{name}: a cell failed: {tracebacks[0][:500]}"
    assert page.locator(f"{PANEL} .jupyter-widgets.widget-vbox, "
                        f"{PANEL} .jupyter-widgets.widget-interact").count() >= 1, (
        f"{name}: no widget rendered")


def widget_picture(page, widget):
    """What a widget shows now: its images' sources and its text (the groups, the chart)."""
    return widget.evaluate(
        "w => [...w.querySelectorAll('img')].map(i => i.src).join('|') + '#' + w.innerText")


def change_dropdown(page, widget, label, value):
    control = widget.locator(".widget-dropdown", has_text=label).first
    before = widget_picture(page, widget)
    control.locator("select").select_option(label=value)
    page.wait_for_function(
        "([w, b]) => ([...w.querySelectorAll('img')].map(i => i.src).join('|') + '#' "
        "+ w.innerText) !== b", arg=[widget.element_handle(), before], timeout=60_000)
    return before, widget_picture(page, widget)


CASES = [
    # chapter, the widget (a CSS selector inside the output), the dropdown to move, its new value
    ("04_device_meshes", ".widget-vbox:has(.widget-image)", "order", "tp × pp × dp"),
    ("06_memory_and_zero", ".widget-interact", "model", "GPT-2 XL 1.5B"),
    ("08_pipeline_parallel", ".widget-vbox:has(.widget-dropdown)", "schedule", "GPipe"),
]


def fail_with_screenshot(page, shot):
    SHOTS.mkdir(exist_ok=True)
    try:
        page.screenshot(path=str(SHOTS / shot), full_page=False)
        print(f"screenshot of the failure: {SHOTS / shot}")
    except playwright.Error as e:  # a closed page: the failure itself is what matters
        print(f"no screenshot of the failure: {e}")


def cell_output_state(page, index):
    """What cell `index` of the notebook in front shows: its outputs' texts, how many widget
    views are drawn in it, how many pictures it has and how many of them are loaded."""
    return page.evaluate(
        f"""i => {{
            const cell = document.querySelectorAll('{PANEL} .jp-Cell')[i];
            const outputs = cell ? [...cell.querySelectorAll('.jp-OutputArea-output')] : [];
            const images = outputs.flatMap(o => [...o.querySelectorAll('img')]);
            return {{texts: outputs.map(o => o.innerText),
                     drawn: outputs.filter(o => o.querySelector(':scope > .jupyter-widgets'))
                                   .length,
                     images: images.length,
                     loaded: images.filter(i => i.complete && i.naturalWidth > 0).length}};
        }}""", index)


def wait_cell_pictures(page, index, timeout=120_000):
    """Wait until cell `index` shows a picture, every one loaded, nothing "Loading widget"."""
    try:
        page.wait_for_function(
            f"""i => {{
                const cell = document.querySelectorAll('{PANEL} .jp-Cell')[i];
                if (!cell) return false;
                const outputs = [...cell.querySelectorAll('.jp-OutputArea-output')];
                const images = outputs.flatMap(o => [...o.querySelectorAll('img')]);
                return images.length > 0 && !outputs.some(o => /Loading widget/.test(o.innerText))
                    && images.every(i => i.complete && i.naturalWidth > 0);
            }}""", arg=index, timeout=timeout, polling=500)
    except playwright.TimeoutError:
        pass  # the assertions below say what is missing


@pytest.mark.parametrize("name, selector, label, value", CASES, ids=[c[0][:2] for c in CASES])
def test_stored_chapter_draws_widgets_without_running(lab, browser, name, selector, label, value):
    """As stored, no cell run: a trusted copy draws every widget view from the notebook's saved
    widget state (its controls, and the picture it showed when regen ran it); an
    untrusted copy (a fresh clone) shows the stored picture in the same cells. Never "Error
    displaying widget" (a view without its state) nor a widget's plain-text repr."""
    cells = widget_cells(name)
    assert cells, f"notebooks/{name}.ipynb stores no widget view: run tools/regen.py on it"
    page = browser.new_page(viewport={"width": 1400, "height": 1000})
    try:
        open_notebook(page, lab, f"trusted/{name}.ipynb")
        wait_widgets_drawn(page, len(cells))
        check_widgets_rendered(page, name)
        for index in cells:
            shown = cell_output_state(page, index)
            assert shown["drawn"] == 1 and shown["images"] >= 1, (
                f"{name}, cell {index} (trusted, not run): no widget drawn from the saved "
                f"state; it shows {[t[:120] for t in shown['texts']]}")
            assert shown["loaded"] == shown["images"], (
                f"{name}, cell {index}: {shown['images'] - shown['loaded']} of the widget's "
                "pictures did not load from the saved state")
        widget = page.locator(f"{DRAWN} {selector}").first
        assert widget.locator(".widget-dropdown", has_text=label).count() == 1, (
            f"{name}: the stored widget has no '{label}' control")
        widget.scroll_into_view_if_needed()
        SHOTS.mkdir(exist_ok=True)  # what a reader sees before running anything
        widget.screenshot(path=str(SHOTS / f"{name}-stored.png"))
        page.close()

        page = browser.new_page(viewport={"width": 1400, "height": 1000})
        open_notebook(page, lab, f"untrusted/{name}.ipynb")
        for index in cells:
            wait_cell_pictures(page, index)
            shown = cell_output_state(page, index)
            texts = " | ".join(t[:120] for t in shown["texts"])
            assert "Error displaying widget" not in texts and not any(
                t.strip().startswith(WIDGET_REPRS) for t in shown["texts"]), (
                f"{name}, cell {index} (untrusted, not run) shows: {texts}")
            assert shown["images"] >= 1 and shown["loaded"] == shown["images"], (
                f"{name}, cell {index} (untrusted, not run): neither the widget nor its "
                f"stored picture is shown; it shows: {texts}")
    except Exception:
        fail_with_screenshot(page, f"{name}-stored-failure.png")
        raise
    finally:
        page.close()
        shut_down_kernels(lab)


@pytest.mark.parametrize("name, selector, label, value", CASES, ids=[c[0][:2] for c in CASES])
def test_chapter_widgets_render_and_respond(lab, browser, name, selector, label, value):
    page = browser.new_page(viewport={"width": 1400, "height": 1000})
    try:
        open_and_run_all(page, lab, name)
        check_widgets_rendered(page, name)
        widget = page.locator(f"{PANEL} .jp-OutputArea-output {selector}").first
        widget.scroll_into_view_if_needed()
        before, after = change_dropdown(page, widget, label, value)
        assert before != after
        check_widgets_rendered(page, name)
        SHOTS.mkdir(exist_ok=True)  # what the widget looks like, for a person to check
        widget.screenshot(path=str(SHOTS / f"{name}-widget.png"))
    except Exception:
        fail_with_screenshot(page, f"{name}.png")
        raise
    finally:
        page.close()
        shut_down_kernels(lab)
