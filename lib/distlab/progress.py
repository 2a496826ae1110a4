"""`distlab.progress`: a progress bar for long loops inside ranks, shown live in the notebook.

    for step in distlab.progress(range(200), desc="training"):
        ...

Rank 0 reports (a few times a second at most) to the parent, which draws a bar in JupyterLab and
removes it when the run ends, so stored outputs stay deterministic. Other ranks, and code that
runs outside a rank, just iterate.
"""
import os
import time

from . import _worker

_MIN_INTERVAL = 0.1


def progress(iterable, desc="", total=None):
    if total is None:
        try:
            total = len(iterable)
        except TypeError:
            total = None
    if _worker._rank != 0:
        yield from iterable
        return
    last = 0.0
    n = 0
    for n, item in enumerate(iterable, 1):
        yield item
        now = time.monotonic()
        if now - last >= _MIN_INTERVAL:
            _worker.send_progress(desc, n, total)
            last = now
    _worker.send_progress(desc, n, total)


class ProgressBar:
    """A progress bar fed by rank 0's `distlab.progress`, shown live in JupyterLab only.

    It is closed when the run ends, so stored notebook outputs never contain it; under
    pytest/nbval and `make regen` (DISTLAB_NO_PROGRESS) it is not shown at all.
    """

    @classmethod
    def create(cls):
        if os.environ.get("PYTEST_CURRENT_TEST") or os.environ.get("DISTLAB_NO_PROGRESS"):
            return None
        try:
            from IPython import get_ipython
            if get_ipython() is None or "IPKernelApp" not in get_ipython().config:
                return None
            import ipywidgets
            from IPython.display import display
        except Exception:
            return None
        self = cls()
        self.bar = ipywidgets.IntProgress(value=0, min=0, max=1)
        self.label = ipywidgets.Label()
        self.box = ipywidgets.HBox([self.bar, self.label])
        self.handle = display(self.box, display_id=True)
        return self

    def update(self, desc, n, total):
        self.bar.max = max(total or 1, 1)
        self.bar.value = min(n, self.bar.max)
        self.label.value = f"{desc} {n}/{total}" if total else f"{desc} {n}"

    def close(self):
        self.box.close()
        # Replace the output too, so a saved notebook keeps no trace of the bar.
        self.handle.update({"text/plain": ""}, raw=True)
