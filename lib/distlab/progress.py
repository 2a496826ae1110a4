"""`distlab.progress`: a progress bar for long loops inside ranks, shown live in the notebook.

    for step in distlab.progress(range(200), desc="training"):
        ...

Rank 0 reports (a few times a second at most) to the parent, which draws a bar in JupyterLab and
removes it when the run ends, so stored outputs stay deterministic. Other ranks, and code that
runs outside a rank, just iterate.
"""
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
