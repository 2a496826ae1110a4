"""Re-execute notebooks in place, exactly as nbval will run them, then strip metadata.

    python tools/regen.py [notebooks/03_*.ipynb ...]     (default: notebooks/ and solutions/)

Each notebook runs in a fresh kernel of this environment (like `--nbval-current-env`), in its own
folder, with progress bars off; then `nbstripout --keep-output --keep-count` removes metadata but
keeps the outputs nbval compares against. Exercises are regenerated from solutions afterwards.
"""
import os
import subprocess
import sys
import time
from pathlib import Path

import nbformat
from nbclient import NotebookClient

ROOT = Path(__file__).resolve().parent.parent


def execute(path):
    nb = nbformat.read(path, as_version=4)
    client = NotebookClient(nb, timeout=600, kernel_name="python3",
                            resources={"metadata": {"path": str(path.parent)}})
    client.execute()
    nbformat.write(nb, path)
    subprocess.run([sys.executable, "-m", "nbstripout", "--keep-output", "--keep-count",
                    str(path)], check=True)


def main(paths):
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
