"""`distlab.run`: start a function on N real ranks from a notebook cell, and bring back what they did.

How it works, in order:
1. the function and its arguments are pickled BY VALUE (cloudpickle), so a function defined in
   a notebook cell or a script runs on every rank;
2. the parent opens the rendezvous store (a TCPStore on a free port), so concurrent launches never
   share a port and a rank that finishes early cannot take the store down with it;
3. one process per rank is forked from a forkserver that has torch preloaded (fast and fork-safe:
   the server never ran a thread or touched CUDA); spawn where forkserver does not exist;
4. each rank gets torchrun's environment, its share of the cores and an initialised process group;
   its stdout/stderr come back through pipes and are printed by the parent, grouped in rank order;
5. the parent watches every rank at once: an exception, a silent death, a timeout or an interrupt
   stops all ranks and says which rank did what.
"""
# The parts, each readable in one sitting: this module holds the API and the argument checks;
# _payload.py ships the function and the results by value; _supervise.py starts, watches and
# stops the ranks; _explain.py puts failures into words; _worker.py is the rank's side.
import math
import numbers
import operator

from . import _worker
from ._explain import RankFailed, RunTimeout
from ._payload import pickle_payload
from ._supervise import Launch, Results, cores as _cores, free_port as _free_port
from .devices import BACKENDS, NCCL_WITH_CPU, choose_backend, device, uses_nccl  # noqa: F401

__all__ = ["run", "device", "choose_backend", "RankFailed", "RunTimeout", "Results",
           "DEFAULT_TIMEOUT"]

MAX_WORLD_SIZE = 64
DEFAULT_TIMEOUT = 30.0
def run(fn, world_size, *args, timeout=DEFAULT_TIMEOUT, backend=None, init=True, threads=None,
        env=None, trace=False, emulate=None, **kwargs):
    """Run `fn(rank, world_size, *args, **kwargs)` on `world_size` ranks; return their results.

    timeout: seconds before the ranks are stopped and their stacks reported (None or math.inf:
             no limit).
    backend: "gloo", "nccl" or "cpu:gloo,cuda:nccl"; by default the last when there is one GPU
             per rank (CPU tensors then still work, over gloo), gloo otherwise.
    init:    False leaves init_process_group to `fn` (the environment is set as torchrun sets it).
    threads: torch threads per rank; by default the cores divided among the ranks.
    env:     extra environment variables for the ranks ({name: string}).
    trace:   True records what every rank communicated and computed (`results.trace`).
    emulate: a preset name (see distlab.emulate.PRESETS) or a distlab.emulate.Cluster: time
             is modeled on that accelerator and its links instead of measured (traced too).
    Results come back by value too: a rank may return an instance of a class of the notebook.
    """
    __tracebackhide__ = True   # IPython and pytest: the learner's cell is the frame to show
    world_size, timeout, threads, init, trace, env = _check_arguments(
        fn, world_size, timeout, backend, init, threads, env, trace)
    from .emulate import resolve
    cluster = resolve(emulate, world_size)
    if cluster is not None and not init:
        raise ValueError("emulate= needs init=True: the emulated clocks are set up together with "
                         "the process group.")
    backend = backend or choose_backend(world_size)
    if uses_nccl(backend):
        import torch
        if torch.cuda.device_count() < world_size:
            raise ValueError(
                f"backend={backend!r} needs one GPU per rank: world_size={world_size}, but this "
                f"machine has {torch.cuda.device_count()} GPU(s). Use backend='gloo' (it runs on "
                f"CPUs).")
    payload = pickle_payload(fn, args, kwargs)
    launch = Launch(world_size, backend, init, timeout, threads, env, trace, cluster)
    try:
        return launch.run(payload)
    except KeyboardInterrupt as e:
        # One line (which ranks were stopped), not a traceback through the event loop.
        raise e.with_traceback(None) from None


# ---- checking what the learner passed -----------------------------------------------------------

def _check_arguments(fn, world_size, timeout, backend, init, threads, env, trace):
    """Refuse bad input with a sentence; return the values normalised (numpy scalars to Python,
    timeout=inf to None)."""
    import multiprocessing
    if getattr(multiprocessing.current_process(), "_inheriting", False):
        raise RuntimeError(
            "distlab.run was called while a new process was importing your script. Put the code "
            "that launches ranks under `if __name__ == \"__main__\":`.")
    if _worker._rank is not None:
        raise RuntimeError("distlab.run cannot be called from inside a rank: call it from the "
                           "notebook (or script) that launches the ranks.")
    if not callable(fn):
        raise TypeError(
            f"distlab.run needs a function to run on every rank, but got {fn!r} (a "
            f"{type(fn).__name__}). Pass the function itself, without calling it: "
            f"distlab.run(my_fn, world_size=4).")
    world_size = _whole_number(world_size, "world_size must be a whole number of ranks, like 4")
    if world_size < 1:
        raise ValueError(f"world_size must be at least 1 (one process per rank); got {world_size}.")
    if world_size > MAX_WORLD_SIZE:
        raise ValueError(
            f"world_size={world_size} is too many ranks for one machine: distlab.run starts one "
            f"process per rank and this machine has {_cores()} core(s). Use at most "
            f"{MAX_WORLD_SIZE}; 8 ranks are enough to see every idea in this course.")
    if timeout is not None:
        if _is_bool(timeout) or not isinstance(timeout, numbers.Real) or math.isnan(timeout) \
                or timeout <= 0:
            raise ValueError(f"timeout must be a positive number of seconds (or None, or "
                             f"math.inf, for no limit); got {timeout!r}.")
        timeout = None if math.isinf(timeout) else float(timeout)
    if backend is not None and backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS} (or None to choose); got {backend!r}.")
    if threads is not None:
        threads = _whole_number(threads, "threads must be a positive whole number")
        if threads < 1:
            raise ValueError(f"threads must be a positive whole number; got {threads!r}.")
    init = _flag(init, "init")
    trace = _flag(trace, "trace")
    if env is not None and not isinstance(env, dict):
        raise TypeError(f"env must be a dict of environment variables for the ranks, like "
                        f"{{'NCCL_DEBUG': 'INFO'}}; got a {type(env).__name__}.")
    env = dict(env or {})
    for key, value in env.items():
        if not isinstance(key, str) or not isinstance(value, str):
            raise TypeError(f"env must map names to strings, like {{'NCCL_DEBUG': 'INFO'}}; got "
                            f"{key!r}: {value!r}. Write the value as a string: {str(value)!r}.")
    return world_size, timeout, threads, init, trace, env


def _is_bool(x):
    return isinstance(x, bool) or (type(x).__module__ == "numpy" and    # numpy.bool_ too
                                   type(x).__name__ in ("bool", "bool_"))


def _whole_number(x, sentence):
    """int(x) for Python and numpy integers; a TypeError with `sentence` otherwise (bools too)."""
    if not _is_bool(x) and isinstance(x, numbers.Integral):
        return operator.index(x)
    if not _is_bool(x) and type(x).__module__ == "numpy" and hasattr(x, "__index__"):
        return operator.index(x)
    raise TypeError(f"{sentence}; got {x!r}.")


def _flag(x, name):
    if not _is_bool(x):
        raise TypeError(f"{name} must be True or False; got {x!r}.")
    return bool(x)
