"""`make test`: the chapters' notebooks under nbval, one kernel per pytest worker instead of one
per notebook.

A new kernel costs ≈ 5 CPU-seconds before a notebook's first line does anything useful (the
kernel, torch's and matplotlib's imports, the launcher's forkserver); 21 chapters on 4 workers
paid that 21 times, now 4. Between two notebooks the kernel is put back as a new one would be:
the namespace reset (`%reset -f`), and what a notebook can change outside its namespace restored
from a snapshot taken when the kernel started — the working folder, os.environ, sys.path,
warnings' filters, matplotlib's settings and open figures, torch's default dtype, print options,
threads, grad mode and default generator (a new random seed, as a new process draws one),
and `%%ranks`' persistent ranks (stopped). A kernel that died, timed out or was started for
another folder or kernel spec is not reused.

nbval's own rule, a new kernel per notebook, still runs in CI: `make test-portable` runs nbval
unchanged on every chapter and workbook (tests/test_shared_kernel.py proves the reset on the
state it restores). Enabled by DISTLAB_SHARED_KERNEL=1, which only `make test` sets.
"""
import atexit
import os

SNAPSHOT = r"""
def _distlab_snapshot():
    import os, sys, warnings
    import matplotlib.pyplot
    import matplotlib
    import torch
    sys._distlab_fresh = {
        "cwd": os.getcwd(), "environ": dict(os.environ), "path": list(sys.path),
        "filters": list(warnings.filters), "rc": dict(matplotlib.rcParams),
        "threads": torch.get_num_threads(),
        "dtype": torch.get_default_dtype(),
    }
_distlab_snapshot()
del _distlab_snapshot
"""

RESTORE = r"""
def _distlab_restore():
    import os, sys, warnings, gc
    import matplotlib, matplotlib.pyplot as plt
    import torch
    s = sys._distlab_fresh
    ranks = sys.modules.get("distlab.ranks")
    if ranks is not None:
        ranks._stop_pool()
    os.chdir(s["cwd"])
    os.environ.clear()
    os.environ.update(s["environ"])
    sys.path[:] = s["path"]
    warnings.filters[:] = s["filters"]
    plt.close("all")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        matplotlib.rcParams.update(s["rc"])
    torch.set_default_dtype(s["dtype"])
    torch.set_printoptions(profile="default")
    torch.set_num_threads(s["threads"])
    torch.set_grad_enabled(True)
    torch.autograd.set_detect_anomaly(False)
    torch.seed()
    gc.collect()
_distlab_restore()
del _distlab_restore
"""

_kernel = None      # (key, RunningKernel) of this worker, kept between notebooks


def _run(kernel, code, timeout=120):
    """Run code in the kernel; raise if it raised (a reset that failed must not pass silently)."""
    msg_id = kernel.execute_cell_input(code, allow_stdin=False)
    while True:
        reply = kernel.get_message(stream="shell", timeout=timeout)
        if reply["parent_header"].get("msg_id") == msg_id:
            break
    kernel.await_idle(msg_id, timeout)
    if reply["content"]["status"] != "ok":
        raise RuntimeError(f"resetting the shared kernel failed: {reply['content'].get('evalue')}")


def _stop():
    global _kernel
    if _kernel is not None:
        try:
            _kernel[1].stop()
        except Exception:
            pass
        _kernel = None


def install():
    """Patch nbval's notebook collector to keep its kernel for the next notebook."""
    from nbval.plugin import IPyNbFile

    original_setup, original_teardown = IPyNbFile.setup, IPyNbFile.teardown

    def key_of(item):
        config = item.parent.config.option
        return (str(item.fspath.dirname), config.nbval_current_env, config.nbval_kernel_name,
                item.nb.metadata.get("kernelspec", {}).get("name"))

    def setup(self):
        global _kernel
        key = key_of(self)
        if _kernel is not None and _kernel[0] == key and _kernel[1].is_alive():
            kernel = _kernel[1]
            try:
                _run(kernel, "%reset -f")
                _run(kernel, RESTORE)
            except Exception:
                _stop()
            else:
                self.kernel = kernel
                self.setup_sanitize_files()
                return
        _stop()
        original_setup(self)
        _run(self.kernel, SNAPSHOT)
        _kernel = (key, self.kernel)

    def teardown(self):
        global _kernel
        if (_kernel is not None and self.kernel is _kernel[1] and not self.timed_out
                and self.kernel.is_alive()):
            return              # kept for the next notebook; _stop at exit
        if _kernel is not None and self.kernel is _kernel[1]:
            _kernel = None
        original_teardown(self)

    IPyNbFile.setup, IPyNbFile.teardown = setup, teardown
    atexit.register(_stop)


def enabled():
    return os.environ.get("DISTLAB_SHARED_KERNEL") == "1"
