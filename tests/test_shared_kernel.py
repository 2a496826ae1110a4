"""`make test` runs the chapters in one kernel per worker (tests/shared_kernel.py): between two
notebooks the kernel must be as a new one. One kernel, every piece of state a notebook can leave
behind changed, then the reset, then each piece read back."""
import json

import pytest
import torch

import shared_kernel

nbval_kernel = pytest.importorskip("nbval.kernel")

LEAVE_BEHIND = r"""
import os, sys, warnings, torch, matplotlib, matplotlib.pyplot as plt
import distlab.ranks
sys._ranks_stopped = False      # stands for a %%ranks pool: the reset must stop it
distlab.ranks._stop_pool = lambda: setattr(__import__("sys"), "_ranks_stopped", True)
os.environ["DISTLAB_LEFT_BEHIND"] = "1"
os.environ.pop("HOME", None)
os.chdir("/")
sys.path.insert(0, "/nowhere")
warnings.simplefilter("ignore")
matplotlib.rcParams["lines.linewidth"] = 9.0
plt.figure()
torch.set_default_dtype(torch.float64)
torch.set_printoptions(precision=1)
torch.set_num_threads(1)
torch.set_grad_enabled(False)
torch.manual_seed(0)
left_behind = 1
"""

READ_BACK = r"""
import json, os, sys, warnings, torch, matplotlib, matplotlib.pyplot as plt
s = sys._distlab_fresh
print(json.dumps({
    "name gone": "left_behind" not in globals(),
    "environ": dict(os.environ) == s["environ"],
    "cwd": os.getcwd() == s["cwd"],
    "path": sys.path == s["path"],
    "filters": warnings.filters == s["filters"],
    "rc": matplotlib.rcParams["lines.linewidth"] == s["rc"]["lines.linewidth"],
    "figures": plt.get_fignums() == [],
    "dtype": str(torch.get_default_dtype()),
    "precision": torch._tensor_str.PRINT_OPTS.precision,
    "threads": torch.get_num_threads() == s["threads"],
    "grad": torch.is_grad_enabled(),
    "seed": torch.initial_seed(),
    "ranks stopped": sys._ranks_stopped,
}))
"""


def _output(kernel, code):
    msg_id = kernel.execute_cell_input(code, allow_stdin=False)
    text = []
    while True:
        msg = kernel.get_message(stream="iopub", timeout=120)
        if msg["parent_header"].get("msg_id") != msg_id:
            continue
        if msg["msg_type"] == "stream":
            text.append(msg["content"]["text"])
        if msg["msg_type"] == "error":
            raise AssertionError(msg["content"]["evalue"])
        if msg["msg_type"] == "status" and msg["content"]["execution_state"] == "idle":
            return "".join(text)


def test_the_reset_puts_back_what_a_notebook_can_change(tmp_path):
    kernel = nbval_kernel.RunningKernel(nbval_kernel.CURRENT_ENV_KERNEL_NAME, cwd=str(tmp_path))
    try:
        shared_kernel._run(kernel, shared_kernel.SNAPSHOT)
        _output(kernel, LEAVE_BEHIND)
        shared_kernel._run(kernel, "%reset -f")
        shared_kernel._run(kernel, shared_kernel.RESTORE)
        state = json.loads(_output(kernel, READ_BACK))
    finally:
        kernel.stop()
    assert state.pop("seed") != 0        # a new random seed, as a new process draws
    assert state == {"name gone": True, "environ": True, "cwd": True, "path": True,
                     "filters": True, "rc": True, "figures": True, "dtype": "torch.float32",
                     "precision": 4, "threads": True, "grad": True, "ranks stopped": True}


def test_a_reset_that_fails_is_not_taken_for_a_fresh_kernel():
    class Kernel:           # answers every request with an error, as a broken kernel would
        def execute_cell_input(self, code, allow_stdin=None):
            return "id"

        def get_message(self, stream, timeout=None):
            return {"parent_header": {"msg_id": "id"},
                    "content": {"status": "error", "evalue": "boom"}}

        def await_idle(self, parent_id, timeout):
            pass
    with pytest.raises(RuntimeError, match="resetting the shared kernel failed: boom"):
        shared_kernel._run(Kernel(), shared_kernel.RESTORE)
