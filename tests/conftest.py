import os
import signal
import time

import pytest

# A kernel's ports are picked free by jupyter_client, released, and bound by the kernel a moment
# later; with three pytest workers starting kernels and ranks opening connections, another process
# sometimes takes one in between and the kernel dies at birth ("Address already in use"). A new
# kernel gets new ports: try again, twice at most. (Kernels only; the tests' own code is untouched.)
KERNEL_BORN_DEAD = ("Kernel died before replying to kernel_info",
                    "Kernel didn't respond to heartbeats")


def retry_kernel_start(start):
    def start_kernel(*args, **kwargs):
        for attempt in range(3):
            try:
                return start(*args, **kwargs)
            except RuntimeError as e:
                if attempt == 2 or not any(s in str(e) for s in KERNEL_BORN_DEAD):
                    raise
    return start_kernel


def _hypothesis_profile():
    """Property tests draw the same examples on every machine and every run (derandomize, no
    example database): a red CI then means the code changed, never that a new seed was drawn.
    (A seed drawn once found a garbled trace naming 10**12 ranks: now a test of its own.)
    HYPOTHESIS_PROFILE=explore draws new examples, to look for more."""
    try:
        from hypothesis import settings
    except ImportError:
        return
    settings.register_profile("distlab", derandomize=True, database=None)
    settings.register_profile("explore", derandomize=False, database=None)
    settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "distlab"))


_hypothesis_profile()


def pytest_configure(config):
    # Tests stop ranks and scripts with SIGINT, as Ctrl-C does. A harness that starts the suite
    # in the background without job control (`nohup make test &`) hands it SIGINT ignored, which
    # every child keeps across exec, so Python never turns it into KeyboardInterrupt: give the
    # suite, and through it every child, what a terminal gives.
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    from budget import Budget
    config.pluginmanager.register(Budget(config), "distlab-budget")
    import jupyter_client.manager
    jupyter_client.manager.start_new_kernel = retry_kernel_start(
        jupyter_client.manager.start_new_kernel)
    try:
        import nbval.kernel
    except ImportError:
        return
    nbval.kernel.start_new_kernel = retry_kernel_start(nbval.kernel.start_new_kernel)
    import shared_kernel
    if shared_kernel.enabled():
        shared_kernel.install()

def pytest_collection_modifyitems(items):
    """Test modules' functions travel to ranks BY VALUE, as a notebook cell's do.

    By reference (pickle's default for an importable module) every rank of every launch imports
    the test module, and pytest and this conftest with it: measured ≈ 0.7 CPU-seconds more per
    4-rank launch, hundreds of launches in the suite. cloudpickle sends the function, the test
    module's functions and classes it uses, and the names of the modules they import instead.
    """
    import sys

    import cloudpickle
    for module in {item.module for item in items if getattr(item, "module", None)} | \
            {sys.modules[__name__]}:
        if module.__name__ in sys.modules:
            cloudpickle.register_pickle_by_value(module)


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


def run_in_one_kernel(paths, timeout=120):
    """Execute notebooks one after another in ONE kernel, the namespace reset between them
    (`%reset -f`), each cell with errors allowed: {path: (its stored cells, its executed cells)}.
    A kernel, torch's import and a launcher's forkserver cost ≈ 10 CPU-seconds per notebook;
    for the workbooks (solved or not) that is more than their cells."""
    import nbformat
    from nbclient import NotebookClient
    from nbclient.exceptions import CellTimeoutError
    import pytest
    books = {p: nbformat.read(p, as_version=4) for p in paths}
    merged = nbformat.v4.new_notebook()
    spans = {}
    for path, nb in books.items():
        merged.cells.append(nbformat.v4.new_code_cell("%reset -f"))
        spans[path] = (len(merged.cells), len(merged.cells) + len(nb.cells))
        merged.cells.extend(nbformat.from_dict(c) for c in nb.cells)
    folder = str(paths[0].parent) if paths else "."
    client = NotebookClient(merged, timeout=timeout, kernel_name="python3", allow_errors=True,
                            resources={"metadata": {"path": folder}})
    try:
        retry_kernel_start(client.execute)()
    except CellTimeoutError as e:  # pragma: no cover - the failure we guard against
        pytest.fail(f"a cell hung: {e}")
    return {path: (books[path].cells, merged.cells[a:b]) for path, (a, b) in spans.items()}
