"""Re-execute notebooks in place, exactly as nbval will run them, then strip metadata.

    python tools/regen.py [notebooks/03_*.ipynb ...]     (default: notebooks/ and solutions/)

Each notebook runs in a fresh kernel of this environment (like `--nbval-current-env`), in its own
folder, with progress bars off; then `nbstripout --keep-output --keep-count` removes metadata but
keeps the outputs nbval compares against. Exercises are regenerated from solutions afterwards.

Widget state is kept: nbclient saves every widget's model in the notebook's
`metadata.widgets` (its default `store_widget_state`), and nbstripout is told to keep that key, so
a front end without a kernel (JupyterLab before a run, nbviewer) draws the stored widget views.
The kernel names widget models with random uuid4s; `stable_widget_ids` renames them, in the
outputs and in the state alike, after the notebook and the order the models were created in, so
regenerating an unchanged notebook leaves `git diff` quiet (so does joining the stream outputs a
kernel happened to flush in pieces; nbval joins them too before it compares).

Pictures are stored as palette PNGs (`compact_images`): matplotlib writes 32-bit RGBA, and a chart
of flat colours uses a few hundred of them, so a 256-colour palette looks the same at about a third
of the bytes. Learners' cells stay `plt.show()`; only the stored copy is compacted (nbval never
compares images). `python tools/regen.py --compact-only NB...` compacts without re-executing.
"""
import base64
import hashlib
import io
import os
import subprocess
import sys
import time
from pathlib import Path

import nbformat
from nbclient import NotebookClient

ROOT = Path(__file__).resolve().parent.parent
WIDGET_STATE = "application/vnd.jupyter.widget-state+json"
MODEL_REF = "IPY_MODEL_"  # how one widget's state names another (children, layout, style)


def stable_id(name, index):
    """The model id of the index-th widget created in notebook `name`: 32 hex digits, like the
    uuid4 it replaces, and different in every notebook."""
    return hashlib.sha256(f"distlab:{name}:{index}".encode()).hexdigest()[:32]


def stable_widget_ids(nb, name):
    """Rename every widget model of `nb` (in place) to `stable_id(name, i)`, i being the model's
    place in the saved state (the order the kernel opened them); returns {old: new}.

    A model id appears as a state key, as an output's widget-view `model_id` (also inside the
    outputs an Output widget stores) and as "IPY_MODEL_<id>" in other models' state; all are
    renamed together, so the notebook stays consistent whatever ids the kernel drew."""
    state = nb.metadata.get("widgets", {}).get(WIDGET_STATE, {}).get("state", {})
    renames = {old: stable_id(name, i) for i, old in enumerate(state)}

    def rename(value):
        if isinstance(value, str):
            if value in renames:
                return renames[value]
            if value.startswith(MODEL_REF) and value[len(MODEL_REF):] in renames:
                return MODEL_REF + renames[value[len(MODEL_REF):]]
            return value
        if isinstance(value, list):
            return [rename(v) for v in value]
        if isinstance(value, dict):
            return type(value)((rename(k), rename(v)) for k, v in value.items())
        return value

    if renames:
        nb.metadata = rename(nb.metadata)
        nb.cells = rename(nb.cells)
    return renames


def join_streams(nb):
    """Merge each run of consecutive stdout (or stderr) outputs into one, in place: how the
    kernel happened to flush a cell's text must not show up in `git diff`."""
    for cell in nb.cells:
        joined = []
        for out in cell.get("outputs", []):
            last = joined[-1] if joined else None
            if (out.output_type == "stream" and last is not None
                    and last.output_type == "stream" and last.name == out.name):
                last.text += out.text
            else:
                joined.append(out)
        if "outputs" in cell:
            cell.outputs = joined


def compact_png(data, colours=256):
    """PNG bytes `data` with a palette of at most `colours` colours, or `data` itself if that is
    not smaller. Fast octree quantization, no dithering: a colour only a few pixels use (a legend
    patch) keeps its own entry, and flat areas stay flat (dithering would speckle them)."""
    from PIL import Image
    picture = Image.open(io.BytesIO(data))
    if picture.mode == "P":
        return data
    if "A" in picture.getbands() and picture.getchannel("A").getextrema()[0] < 255:
        return data                          # see-through pixels: a palette would lose them
    quantized = picture.convert("RGB").quantize(colours, method=Image.Quantize.FASTOCTREE,
                                                dither=Image.Dither.NONE)
    out = io.BytesIO()
    quantized.save(out, format="png", optimize=True)
    return out.getvalue() if out.tell() < len(data) else data


def compact_images(nb):
    """Every stored image/png output of `nb` as a palette PNG (in place); returns bytes saved."""
    saved = 0
    for cell in nb.cells:
        for out in cell.get("outputs", []):
            data = out.get("data", {})
            if "image/png" in data:
                raw = base64.b64decode(data["image/png"])
                small = compact_png(raw)
                saved += len(raw) - len(small)
                data["image/png"] = base64.b64encode(small).decode("ascii")
    return saved


def strip(path):
    """Metadata out, outputs, counts and the widget state kept."""
    subprocess.run([sys.executable, "-m", "nbstripout", "--keep-output", "--keep-count",
                    "--keep-metadata-keys", "metadata.widgets", str(path)], check=True)


def execute(path):
    nb = nbformat.read(path, as_version=4)
    client = NotebookClient(nb, timeout=600, kernel_name="python3",
                            resources={"metadata": {"path": str(path.parent)}})
    client.execute()  # store_widget_state (default): metadata.widgets holds every model
    join_streams(nb)
    compact_images(nb)
    stable_widget_ids(nb, path.relative_to(ROOT).as_posix() if path.is_relative_to(ROOT)
                      else path.name)
    nbformat.write(nb, path)
    strip(path)


def compact_only(paths):
    for path in paths:
        nb = nbformat.read(path, as_version=4)
        saved = compact_images(nb)
        if saved:
            nbformat.write(nb, path)
            strip(path)
        print(f"{path.relative_to(ROOT)}: {saved / 1e3:.0f} kB of pictures saved", flush=True)


def main(paths):
    if paths[:1] == ["--compact-only"]:
        return compact_only([Path(p).resolve() for p in paths[1:]])
    os.environ["DISTLAB_NO_PROGRESS"] = "1"  # the kernels inherit it: no live widgets stored
    paths = [Path(p).resolve() for p in paths] or sorted(
        list((ROOT / "notebooks").glob("*.ipynb")) + list((ROOT / "solutions").glob("*.ipynb")))
    for path in paths:
        started = time.perf_counter()
        execute(path)
        print(f"{path.relative_to(ROOT)}: {time.perf_counter() - started:.1f} s", flush=True)
    subprocess.run([sys.executable, "-m", "distlab.exercises"], cwd=ROOT, check=True)


if __name__ == "__main__":
    main(sys.argv[1:])
