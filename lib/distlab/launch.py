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
import io
import os
import pickle
import signal
import sys
import tempfile
import threading
import time
import types
from collections import ChainMap
from multiprocessing import connection, spawn

import cloudpickle

from . import _worker
from .diagnose import describe_stacks
from .progress import ProgressBar

MAX_WORLD_SIZE = 64
DEFAULT_TIMEOUT = 30.0
BACKENDS = ("gloo", "nccl")


class RankFailed(RuntimeError):
    """A rank raised an exception or died. `.rank`, `.exc_type`, `.remote_traceback`, `.exception`;
    `.peer_lost` is True when the error only says a peer vanished (the cause is elsewhere)."""

    def __init__(self, message, rank, exc_type=None, remote_traceback="", exception=None,
                 peer_lost=False):
        super().__init__(message)
        self.rank, self.exc_type = rank, exc_type
        self.remote_traceback, self.exception = remote_traceback, exception
        self.peer_lost = peer_lost


class RunTimeout(TimeoutError):
    """The ranks did not finish in time. `.running` lists the ranks still running, `.stacks` their dumps."""

    def __init__(self, message, running, stacks):
        super().__init__(message)
        self.running, self.stacks = running, stacks


class Results(list):
    """The ranks' return values in rank order, plus how the run went (backend, seconds, and
    `trace`: a distlab.trace.Trace when the run was traced or emulated, else None)."""
    backend = None
    seconds = None
    trace = None


def device():
    """The device this rank should use: cuda:LOCAL_RANK under nccl, else the CPU."""
    import torch
    return _worker._device if _worker._device is not None else torch.device("cpu")


def choose_backend(world_size):
    """nccl when every rank can have its own GPU, gloo otherwise."""
    import torch
    import torch.distributed as dist
    if torch.cuda.is_available() and torch.cuda.device_count() >= world_size \
            and dist.is_nccl_available():
        return "nccl"
    return "gloo"


def run(fn, world_size, *args, timeout=DEFAULT_TIMEOUT, backend=None, init=True, threads=None,
        env=None, trace=False, emulate=None, **kwargs):
    """Run `fn(rank, world_size, *args, **kwargs)` on `world_size` ranks; return their results.

    timeout: seconds before the ranks are stopped and their stacks reported (None: no limit).
    backend: "gloo" or "nccl"; by default nccl when there is one GPU per rank, gloo otherwise.
    init:    False leaves init_process_group to `fn` (the environment is set as torchrun sets it).
    threads: torch threads per rank; by default the cores divided among the ranks.
    env:     extra environment variables for the ranks.
    trace:   True records what every rank communicated and computed (`results.trace`).
    emulate: a preset name (see distlab.emulate.PRESETS) or a distlab.emulate.Cluster: time
             is modeled on that accelerator and its links instead of measured (traced too).
    """
    _check_arguments(fn, world_size, timeout, backend, threads)
    from .emulate import resolve
    cluster = resolve(emulate)
    if cluster is not None and not init:
        raise ValueError("emulate= needs init=True: the emulated clocks are set up together with "
                         "the process group.")
    if not isinstance(trace, bool):
        raise TypeError(f"trace must be True or False; got {trace!r}.")
    backend = backend or choose_backend(world_size)
    if backend == "nccl":
        import torch
        if torch.cuda.device_count() < world_size:
            raise ValueError(
                f"backend='nccl' needs one GPU per rank: world_size={world_size}, but this machine "
                f"has {torch.cuda.device_count()} GPU(s). Use backend='gloo' (it runs on CPUs).")
    payload = _pickle_payload(fn, args, kwargs)
    launch = _Launch(world_size, backend, init, timeout, threads, env or {})
    launch.trace, launch.cluster = trace or cluster is not None, cluster
    return launch.run(payload)


# ---- checking what the learner passed -----------------------------------------------------------

def _check_arguments(fn, world_size, timeout, backend, threads):
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
    if isinstance(world_size, bool) or not isinstance(world_size, int):
        raise TypeError(f"world_size must be a whole number of ranks, like 4; got {world_size!r}.")
    if world_size < 1:
        raise ValueError(f"world_size must be at least 1 (one process per rank); got {world_size}.")
    if world_size > MAX_WORLD_SIZE:
        raise ValueError(
            f"world_size={world_size} is too many ranks for one machine: distlab.run starts one "
            f"process per rank and this machine has {_cores()} core(s). Use at most "
            f"{MAX_WORLD_SIZE}; 8 ranks are enough to see every idea in this course.")
    if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, (int, float))
                                or timeout <= 0):
        raise ValueError(f"timeout must be a positive number of seconds (or None); got {timeout!r}.")
    if backend is not None and backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS} (or None to choose); got {backend!r}.")
    if threads is not None and (not isinstance(threads, int) or threads < 1):
        raise ValueError(f"threads must be a positive whole number; got {threads!r}.")


def _code_keeping_filename(code):
    # cloudpickle >= 3.1 renames every file to "<dynamic-code>"; keep the real one so a rank's
    # traceback and stack dump can point at the notebook cell and show its line.
    reducer, args = cloudpickle.cloudpickle._code_reduce(code)
    return reducer, tuple(code.co_filename if a == "<dynamic-code>" else a for a in args)


class _Pickler(cloudpickle.Pickler):
    dispatch_table = ChainMap({types.CodeType: _code_keeping_filename},
                              cloudpickle.Pickler.dispatch_table)


def _dumps(obj):
    buffer = io.BytesIO()
    _Pickler(buffer, protocol=pickle.DEFAULT_PROTOCOL).dump(obj)
    return buffer.getvalue()


def _pickle_payload(fn, args, kwargs):
    try:
        return _dumps((fn, args, kwargs))
    except Exception as e:
        culprit = "the function"
        for name, value in [("the function", fn)] + \
                [(f"argument {i + 1}", a) for i, a in enumerate(args)] + \
                [(f"keyword argument {k!r}", v) for k, v in kwargs.items()]:
            try:
                _dumps(value)
            except Exception:
                culprit = f"{name} ({type(value).__name__})"
                break
        raise TypeError(
            f"distlab.run cannot send {culprit} to the ranks: it cannot be pickled ({e}). "
            f"Pass plain data (numbers, lists, dicts, tensors) and create things like open files, "
            f"locks or generators inside the function.") from None


def _cores():
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


# ---- starting processes ---------------------------------------------------------------------------

_context_lock = threading.Lock()
_context = None


def _get_context():
    """forkserver with torch preloaded; spawn where there is no forkserver (or DISTLAB_START_METHOD)."""
    global _context
    with _context_lock:
        if _context is None:
            import torch.multiprocessing as mp
            method = os.environ.get("DISTLAB_START_METHOD")
            if method is None:
                method = "forkserver" if "forkserver" in mp.get_all_start_methods() else "spawn"
            ctx = mp.get_context(method)
            if method == "forkserver":
                # torch imports these lazily on the first optimizer / first backward(grad):
                # seconds per rank, paid once here instead (measured fork-safe: no threads).
                ctx.set_forkserver_preload(["torch", "torch.distributed", "torch._dynamo",
                                            "torch.fx.experimental.symbolic_shapes",
                                            "distlab._worker"])
            _context = ctx
        return _context


_start_lock = threading.Lock()


def _start_without_main(process):
    """Start a process that does not re-import the parent's __main__.

    multiprocessing normally re-imports the main script in every child (to find functions
    pickled by reference). Our function travels by value, so skipping that import means a script
    without an `if __name__ == "__main__":` guard cannot re-launch itself in every rank.
    """
    with _start_lock:
        original = spawn.get_preparation_data

        def without_main(name):
            data = original(name)
            data.pop("init_main_from_path", None)
            data.pop("init_main_from_name", None)
            return data

        spawn.get_preparation_data = without_main
        try:
            process.start()
        finally:
            spawn.get_preparation_data = original


def _free_port():
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _cell_sources():
    """Source of notebook cells (files that do not exist on disk), so rank tracebacks show lines."""
    import linecache
    return {name: entry for name, entry in list(linecache.cache.items())
            if len(entry) == 4 and not os.path.exists(name) and not name.startswith("<frozen")
            and sum(len(line) for line in entry[2]) < 200_000}


# ---- one launch -------------------------------------------------------------------------------------

class _Rank:
    def __init__(self, rank):
        self.rank = rank
        self.process = None
        self.conn = None
        self.pipes = {}          # fd -> "out" | "err"
        self.out = {"out": bytearray(), "err": bytearray()}
        self.result = None
        self.returned = False
        self.error = None
        self.exitcode = None
        self.dump_path = None
        self.trace = None


class _Launch:
    def __init__(self, world_size, backend, init, timeout, threads, env):
        self.world_size, self.backend, self.init = world_size, backend, init
        self.timeout, self.env = timeout, env
        self.threads = threads or max(1, _cores() // world_size)
        self.ranks = [_Rank(r) for r in range(world_size)]
        self.progress = None
        self.trace, self.cluster = False, None

    def run(self, payload):
        started = time.perf_counter()
        ctx = _get_context()
        store = None
        tmpdir = tempfile.TemporaryDirectory(prefix="distlab-")
        try:
            if self.init:
                store = _parent_store(self.world_size, self.timeout)
                port = store.port
            else:
                port = _free_port()
            spec = dict(world_size=self.world_size, backend=self.backend, init=self.init,
                        master_addr="127.0.0.1", master_port=port, store_port=port,
                        threads=self.threads, env=self.env, sources=_cell_sources(),
                        pg_timeout=(self.timeout or 1800) + 60,
                        trace=self.trace, emulate=self.cluster)
            for r in self.ranks:
                self._start(ctx, r, payload, dict(spec, rank=r.rank,
                                         dump_path=os.path.join(tmpdir.name, f"stack{r.rank}")))
            failure = self._watch(started)
        except BaseException:
            self._stop_all()
            self._print_output(sys.stderr)
            raise
        finally:
            self._stop_all()
            if self.progress is not None:
                self.progress.close()
            self._close_fds()
            tmpdir.cleanup()
            del store  # the parent's store lives exactly as long as the launch
        if self.cluster is not None:
            from .emulate import describe
            print(describe(self.cluster))
        self._print_output()
        if failure is not None:
            raise failure
        results = Results(r.result for r in self.ranks)
        results.backend, results.seconds = self.backend, time.perf_counter() - started
        if self.trace:
            from .trace import Trace
            results.trace = Trace([r.trace for r in self.ranks], self.cluster)
        return results

    def _start(self, ctx, r, payload, spec):
        recv_conn, send_conn = ctx.Pipe(duplex=False)
        out_r, out_w = ctx.Pipe(duplex=False)
        err_r, err_w = ctx.Pipe(duplex=False)
        r.dump_path = spec["dump_path"]
        r.process = ctx.Process(target=_worker.main, name=f"distlab-rank{r.rank}",
                                args=(spec, payload, send_conn, out_w, err_w))
        _start_without_main(r.process)
        for c in (send_conn, out_w, err_w):
            c.close()
        r.conn = recv_conn
        r.pipes = {out_r.fileno(): "out", err_r.fileno(): "err"}
        r._keep = (out_r, err_r)  # keep the Connection objects alive: they own the fds

    # The event loop: wait on every rank's messages, output pipes and exit sentinel at once.
    def _watch(self, started):
        deadline = None if self.timeout is None else started + self.timeout
        first_error_at = None
        while True:
            live = [r for r in self.ranks if r.exitcode is None]
            if not live:
                break
            if first_error_at is not None and time.monotonic() - first_error_at > 0.3:
                break  # a short grace to hear from the other ranks, then stop them
            waitables = {}
            for r in self.ranks:
                if r.conn is not None:
                    waitables[r.conn] = ("msg", r)
                for fd in r.pipes:
                    waitables[fd] = ("pipe", r)
                if r.exitcode is None:
                    waitables[r.process.sentinel] = ("exit", r)
            wait_for = 0.1
            if deadline is not None:
                remaining = deadline - time.perf_counter()
                if remaining <= 0:
                    return self._timeout_error()
                wait_for = min(wait_for, remaining)
            for obj in connection.wait(list(waitables), timeout=wait_for):
                kind, r = waitables[obj]
                if kind == "msg":
                    self._read_message(r)
                elif kind == "pipe":
                    self._read_pipe(r, obj)
                else:
                    self._reap(r)
                if first_error_at is None and (r.error is not None or self._died(r)):
                    first_error_at = time.monotonic()
        return self._failure()

    def _read_message(self, r):
        try:
            kind, body = r.conn.recv()
        except (EOFError, OSError):
            r.conn.close()
            r.conn = None
            return
        if kind == "result":
            r.result, r.returned = pickle.loads(body), True
        elif kind == "trace":
            r.trace = body
        elif kind == "error":
            r.error = body
        elif kind == "progress":
            self._show_progress(*body)

    def _read_pipe(self, r, fd):
        try:
            data = os.read(fd, 1 << 16)
        except OSError:
            data = b""
        if data:
            r.out[r.pipes[fd]] += data
        else:
            del r.pipes[fd]

    def _reap(self, r):
        r.process.join(0)
        r.exitcode = r.process.exitcode
        # The result or error may still sit in the pipe behind the exit notice.
        while r.conn is not None and r.conn.poll(0):
            self._read_message(r)

    def _died(self, r):
        return r.exitcode is not None and not r.returned and r.error is None

    def _failure(self):
        errors = [r for r in self.ranks if r.error is not None]
        dead = [r for r in self.ranks if self._died(r)]
        if not errors and not dead:
            return None
        if errors:
            # Prefer the rank whose own code raised over ranks that failed because a peer vanished.
            errors.sort(key=lambda r: (_is_consequence(r.error), r.error["time"]))
            r = errors[0]
            others = [o.rank for o in errors[1:]] + [o.rank for o in dead]
            e = r.error
            note = ""
            if others:
                note = (f"\n(also stopped: {_ranks_phrase(others)}, most likely because rank "
                        f"{r.rank} failed)")
            exception = None
            if e["exception"] is not None:
                try:
                    exception = pickle.loads(e["exception"])
                except Exception:
                    pass
            first = f"rank {r.rank} raised {e['type']}: {e['message']}{note}"
            # Everyone who failed only lost a peer: blame whoever was still busy elsewhere.
            busy = [o.rank for o in self.ranks
                    if o.error is None and not o.returned and o.exitcode is None]
            if busy and all(_is_consequence(o.error) for o in errors):
                who = _ranks_phrase(busy)
                first = (f"{_ranks_phrase([o.rank for o in errors])} lost the connection to a "
                         f"peer while {who} {'was' if len(busy) == 1 else 'were'} still running: "
                         f"{who} is the likely cause (check that every rank calls the same "
                         f"collectives, with the same shapes, in the same order).\n"
                         f"rank {r.rank} raised {e['type']}: {e['message']}")
            message = (f"{first}\n\n"
                       f"Traceback from rank {r.rank}:\n{_pretty_filenames(e['traceback'])}")
            return RankFailed(message, r.rank, e["type"], e["traceback"], exception,
                              peer_lost=_is_consequence(e))
        r = dead[0]
        return RankFailed(f"rank {r.rank} {_exit_phrase(r.exitcode)} before its function "
                          f"returned, without raising a Python exception.", r.rank)

    def _timeout_error(self):
        # A rank that returned may still wait for the others at its exit barrier: it finished.
        running = [r for r in self.ranks if r.exitcode is None and not r.returned]
        stacks = self._dump_stacks(running)
        lines = [f"distlab.run timed out after {self.timeout:g} s: "
                 f"{_ranks_phrase([r.rank for r in running])} still running."]
        for r in self.ranks:
            if r not in running:
                lines.append(f"  rank {r.rank}: finished")
            else:
                lines.append(f"  rank {r.rank}: {describe_stacks(stacks.get(r.rank, ''))}")
        lines.append("A collective returns only when every rank of its group has called it: check "
                     "that all ranks reach the same collectives in the same order. If the work is "
                     "just slow, pass a longer limit: distlab.run(..., timeout=120).")
        return RunTimeout("\n".join(lines), [r.rank for r in running], stacks)

    def _dump_stacks(self, running):
        if not hasattr(signal, "SIGUSR1"):
            return {}
        for r in running:
            try:
                os.kill(r.process.pid, signal.SIGUSR1)
            except OSError:
                pass
        # faulthandler writes from the signal handler; a dump is complete once it stops growing.
        stacks, sizes, until = {}, {}, time.monotonic() + 2.0
        while time.monotonic() < until and len(stacks) < len(running):
            time.sleep(0.05)
            for r in running:
                try:
                    size = os.path.getsize(r.dump_path)
                except OSError:
                    continue
                if size > 0 and sizes.get(r.rank) == size:
                    with open(r.dump_path) as f:
                        stacks[r.rank] = f.read()
                sizes[r.rank] = size
        return stacks

    def _show_progress(self, desc, n, total):
        if self.progress is None:
            self.progress = ProgressBar.create()
        if self.progress is not None:
            self.progress.update(desc, n, total)

    def _stop_all(self):
        for r in self.ranks:
            p = r.process
            if p is None or p.pid is None or r.exitcode is not None:
                continue
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except (OSError, AttributeError):
                p.kill()
        for r in self.ranks:
            if r.process is not None and r.process.pid is not None and r.exitcode is None:
                r.process.join(5)
                r.exitcode = r.process.exitcode
        self._drain_pipes()

    def _drain_pipes(self):
        # Output may still be in flight; a grandchild holding the pipe open must not block us.
        until = time.monotonic() + 1.0
        while time.monotonic() < until:
            fds = {fd: r for r in self.ranks for fd in r.pipes}
            if not fds:
                return
            for fd in connection.wait(list(fds), timeout=0.05):
                self._read_pipe(fds[fd], fd)

    def _close_fds(self):
        for r in self.ranks:
            for c in getattr(r, "_keep", ()):
                c.close()
            if r.conn is not None:
                r.conn.close()
            if r.process is not None and r.process.pid is not None:
                try:
                    r.process.close()
                except ValueError:
                    pass

    def _print_output(self, stream=None):
        for kind, default in (("out", sys.stdout), ("err", sys.stderr)):
            target = stream or default
            for r in self.ranks:
                text = r.out[kind].decode(errors="replace")
                r.out[kind].clear()
                if not text:
                    continue
                lines = text.rstrip("\n").split("\n")
                target.write("".join(f"[rank {r.rank}] {line}\n" for line in lines))
            target.flush()


def _parent_store(world_size, timeout):
    from datetime import timedelta
    import torch.distributed as dist
    return dist.TCPStore("127.0.0.1", 0, world_size, is_master=True, wait_for_workers=False,
                         timeout=timedelta(seconds=(timeout or 1800) + 60))


def _is_consequence(error):
    """Errors a rank gets because ANOTHER rank died in the middle of a collective."""
    text = error["message"]
    return any(s in text for s in ("Connection closed by peer", "Connection reset by peer",
                                   "Broken pipe", "connection closed", "Socket closed"))


def _ranks_phrase(ranks):
    ranks = list(ranks)
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    return "ranks " + ", ".join(map(str, ranks[:-1])) + f" and {ranks[-1]}"


def _exit_phrase(code):
    if code is not None and code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        return f"was killed by {name}"
    return f"exited with code {code}"


def _pretty_filenames(text):
    """Show notebook cells as IPython does ('Cell In[3]') instead of temporary file names."""
    try:
        from IPython import get_ipython
        ip = get_ipython()
        names = ip.compile._filename_map if ip is not None else {}
    except Exception:
        names = {}
    for filename, count in names.items():
        text = text.replace(f'File "{filename}"', f"Cell In[{count}]")
    return text
