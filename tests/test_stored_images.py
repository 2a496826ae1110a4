"""The pictures stored in the notebooks are palette PNGs (tools/regen.py's compact_images): the
same pixels' look at about a third of the bytes, while the learner's cell stays `plt.show()`."""
import base64
import importlib.util
import io
import json
from pathlib import Path

import matplotlib
import pytest
from PIL import Image

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("regen", ROOT / "tools" / "regen.py")
regen = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(regen)


def _png(fig, **kw):
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=100, bbox_inches="tight", **kw)
    plt.close(fig)
    return buffer.getvalue()


def test_a_busy_trace_picture_keeps_every_legend_colour_in_under_half_the_bytes():
    from matplotlib.colors import to_rgb

    from distlab.viz.gpu_trace import IDLE, PHASE_COLOURS, annotated_step, read_step
    from distlab.viz.trace import COMM, COMPUTE, WAIT

    data = ROOT / "tests" / "data" / "hta_resnet50_ddp" / "rank0.pt.trace.json.gz"
    plain = _png(annotated_step(read_step(data, "ProfilerStep#5")))
    small = regen.compact_png(plain)
    shown = Image.open(io.BytesIO(small))
    assert shown.mode == "P" and shown.size == Image.open(io.BytesIO(plain)).size
    assert len(small) < len(plain) / 2
    colours = {c for _, c in shown.convert("RGB").getcolors(1 << 16)}
    for name in (COMPUTE, COMM, WAIT, IDLE, *PHASE_COLOURS.values()):
        want = [round(255 * x) for x in to_rgb(name)]
        # within a few units of 255 per channel: a legend patch keeps its own palette entry
        assert min(sum(abs(a - b) for a, b in zip(want, c)) for c in colours) <= 8, name


def test_see_through_and_already_compact_pictures_are_kept_as_they_are():
    fig, ax = plt.subplots(figsize=(2, 2))
    ax.plot([0, 1], [1, 0])
    clear = _png(fig, transparent=True)
    assert regen.compact_png(clear) == clear
    fig, ax = plt.subplots(figsize=(2, 2))
    ax.plot([0, 1], [1, 0])
    once = regen.compact_png(_png(fig))
    assert regen.compact_png(once) == once


@pytest.mark.parametrize("folder", ["notebooks", "solutions"])
def test_every_stored_picture_went_through_regen(folder):
    loose = []
    for path in sorted((ROOT / folder).glob("*.ipynb")):
        for i, cell in enumerate(json.loads(path.read_text())["cells"]):
            for out in cell.get("outputs", []):
                png = out.get("data", {}).get("image/png")
                if png and regen.compact_png(base64.b64decode(png)) != base64.b64decode(png):
                    loose.append(f"{path.name} cell {i}")
    assert not loose, ("stored as full RGBA PNGs (run tools/regen.py on them, or "
                       "`tools/regen.py --compact-only`): " + ", ".join(loose))
