"""The rank side of `%%ranks`: a rank that stays, running one cell after another.

The rank starts exactly like a rank of `distlab.run` (`_worker.main`: own session, fds 1/2
to the parent, torchrun's environment, the process group initialised, stack dumps on SIGUSR1);
the function it runs is `serve`, a loop that executes the cells the notebook sends, in one
namespace that lives as long as the rank. Each cell is answered on the message pipe with the
launcher's own messages: ("result", None) when it finished, ("error", ...) when it raised.

A thread reads the command pipe: when it reaches end of file (the kernel stopped or died), the
rank kills its own session at once, whatever the main thread is doing. Linux's
PR_SET_PDEATHSIG backs it up, should that thread never get the interpreter lock.
"""
import ast
import builtins
import linecache
import os
import queue
import signal
import sys
import threading

from . import _worker
from ._payload import dumps, to_cpu

_commands = queue.Queue()
_cmd_conn = None


def main(spec, payload, conn, out_w, err_w, cmd_conn):
    """Process target: start as every rank of distlab.run does, with `serve` as the function."""
    global _cmd_conn
    _cmd_conn = cmd_conn
    _die_with_parent()
    # Own session BEFORE the watchdog can fire: its kill must never reach the notebook's group
    # (_worker.main leaves a session this process already leads as it is).
    _worker.lead_own_session()
    threading.Thread(target=_read_commands, name="distlab-commands", daemon=True).start()
    _worker.main(spec, dumps((serve, (spec,), {})), conn, out_w, err_w)


def _die_with_parent():
    if not sys.platform.startswith("linux"):
        return
    try:
        import ctypes
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)   # PR_SET_PDEATHSIG
    except Exception:
        pass
    if os.getppid() == 1:   # the forkserver is already gone
        os._exit(1)


def _read_commands():
    while True:
        try:
            command = _cmd_conn.recv()
        except (EOFError, OSError):
            # The notebook's end of the pipe is closed: nobody will ever read this rank's output.
            # Take down what this rank started too, but only a session this rank leads.
            if os.getsid(0) == os.getpid():
                _worker.kill_sessions([os.getpid()])
            os._exit(1)
        _commands.put(command)


def serve(rank, world_size, spec):
    """Run the cells sent by the notebook until told to stop."""
    import torch
    import torch.distributed as dist
    import distlab
    signal.signal(signal.SIGINT, signal.default_int_handler)   # the notebook's interrupt
    namespace = {"__name__": "__main__", "__builtins__": builtins, "rank": rank,
                 "world_size": world_size, "torch": torch, "dist": dist, "distlab": distlab}
    while True:
        try:
            command = _commands.get()
            if command[0] == "stop":
                return None
            if command[0] == "cell":
                _run_cell(namespace, *command[1:])
            elif command[0] == "pull":
                _pull(namespace, command[1])
        except KeyboardInterrupt:
            continue   # an interrupt that arrived just after the cell finished: nothing to stop


def _run_cell(namespace, source, filename, sources, cluster, cell, traced):
    linecache.cache.update(sources)
    recorder = None
    if traced:   # recorded; under emulation on a clock of its own
        import torch.distributed as dist
        store = dist.PrefixStore(f"cell{cell}/", dist.distributed_c10d._get_default_store())
        recorder = _worker._recorder(dict(trace=True, emulate=cluster,
                                          world_size=namespace["world_size"]), store)
        recorder.start()
    try:
        try:
            tree = ast.parse(source, filename)
            last = tree.body.pop() if tree.body and isinstance(tree.body[-1], ast.Expr) else None
            exec(compile(tree, filename, "exec"), namespace)
            if last is not None:
                value = eval(compile(ast.Expression(last.value), filename, "eval"), namespace)
                if value is not None:
                    namespace["_"] = value
                    print(repr(value))
        finally:
            if recorder is not None:
                _worker._conn.send(("trace", recorder.stop()))
            sys.stdout.flush()
            sys.stderr.flush()
    except BaseException as e:   # noqa: B902 - the notebook hears of every failure
        _worker._conn.send(("error", _worker._describe(e.with_traceback(_cell_frames(e)))))
        return
    _worker._conn.send(("result", dumps(None)))


def _cell_frames(e):
    """The traceback from the cell's first frame on (this module's frames are not the learner's)."""
    tb = e.__traceback__
    while tb is not None and tb.tb_frame.f_code.co_filename == __file__:
        tb = tb.tb_next
    return tb


def _pull(namespace, name):
    if name not in namespace:
        _worker._conn.send(("error", _worker._describe(
            NameError(f"name {name!r} is not defined on rank {namespace['rank']}"))))
        return
    try:
        blob = dumps(to_cpu(namespace[name]), result=True)
    except Exception as e:
        _worker._conn.send(("error", _worker._describe(TypeError(
            f"{name} ({type(namespace[name]).__name__}) cannot be sent to the notebook: {e}"))))
        return
    _worker._conn.send(("result", blob))
