"""distlab: distributed training in PyTorch, run for real from a notebook.

    import distlab
    results = distlab.run(fn, world_size=4)   # fn(rank, world_size) on 4 real processes

The launcher is in `distlab.launch`; each strategy of the course has its own module.
"""
from .launch import (DEFAULT_TIMEOUT, RankFailed, Results, RunTimeout, choose_backend, device,
                     run)
from .progress import progress
from .show import agreement, show_source
from .ranks import load_ipython_extension, register_if_in_ipython as _register_magic

_register_magic()   # `import distlab` in a notebook makes %%ranks available

__all__ = ["run", "device", "choose_backend", "progress", "show_source", "agreement", "RankFailed",
           "RunTimeout", "Results", "DEFAULT_TIMEOUT"]
__version__ = "0.1.0"


def __getattr__(name):
    # `distlab.trace` and `distlab.emulate` load on first use: they import DTensor and sympy
    # (≈ 1.3 CPU-s), which a script, a torchrun worker or a kernel that never traces need not
    # pay; ranks have them already (the forkserver preloads both).
    if name in ("trace", "emulate"):
        import importlib
        return importlib.import_module(f".{name}", __name__)
    raise AttributeError(f"module 'distlab' has no attribute {name!r}")
