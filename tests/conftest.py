import os
import time

import pytest

# tests/browser needs Chromium, playwright and minutes of JupyterLab: `make test-browser` runs it.
# Not even its conftest is imported otherwise (it would shadow this one for `from conftest import`).
collect_ignore = [] if os.environ.get("DISTLAB_BROWSER_TEST") else ["browser"]


def pid_alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie still answers kill(0); /proc tells the truth on Linux.
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return True


def wait_gone(pids, seconds=10.0):
    """The pids that are still alive after waiting up to `seconds`."""
    until = time.monotonic() + seconds
    alive = list(pids)
    while alive and time.monotonic() < until:
        alive = [p for p in alive if pid_alive(p)]
        if alive:
            time.sleep(0.05)
    return alive


@pytest.fixture
def pid_dir(tmp_path):
    """A folder where ranks write their pids, and a way to read them back."""
    def pids():
        return [int(p.read_text()) for p in sorted(tmp_path.glob("pid*"))]
    return tmp_path, pids
