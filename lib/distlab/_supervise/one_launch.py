"""One launch: start every rank, watch them all in one event loop, report, stop them all."""
import os
import signal
import sys
import tempfile
import time
from multiprocessing import connection

from .. import _worker
from .._explain import died, explain_failure, explain_timeout, interrupted_message
from .._payload import cell_sources, loads
from ..progress import ProgressBar
from .starting import _get_context, _start_without_main, cores, free_port, parent_store


class Results(list):
    """The ranks' return values in rank order, plus how the run went (backend, seconds, and
    `trace`: a distlab.trace.Trace when the run was traced or emulated, else None)."""
    backend = None
    seconds = None
    trace = None


class _Rank:
    def __init__(self, rank):
        self.rank = rank
        self.process = None
        self.pid = None          # kept: a closed Process object no longer tells it
        self.stopped = False     # its session was killed after it ended (never signal it twice)
        self.conn = None
        self.pipes = {}          # fd -> "out" | "err"
        self.out = {"out": bytearray(), "err": bytearray()}
        self.result = None
        self.returned = False
        self.error = None
        self.exitcode = None
        self.died_at = None      # time.time() when the parent saw the process end on its own
        self.dump_path = None
        self.trace = None


class Launch:
    """One run of `fn` on `world_size` ranks: start, watch, report (see distlab.launch.run)."""

    GRACE_S = 0.3   # after the first failure, how long to listen to the other ranks

    def __init__(self, world_size, backend, init, timeout, threads, env, trace=False,
                 cluster=None):
        self.world_size, self.backend, self.init = world_size, backend, init
        self.timeout, self.env = timeout, env
        self.threads = threads or max(1, cores() // world_size)
        self.ranks = [_Rank(r) for r in range(world_size)]
        self.progress = None
        self.trace, self.cluster = trace or cluster is not None, cluster

    def run(self, payload):
        started = time.perf_counter()
        ctx = _get_context()
        store = None
        tmpdir = tempfile.TemporaryDirectory(prefix="distlab-")
        try:
            if self.init:
                store = parent_store(self.world_size, self.timeout)
                port = store.port
            else:
                port = free_port()
            for r, spec in zip(self.ranks, self._specs(port, tmpdir.name)):
                self._start(ctx, r, payload, spec)
            # The limit counts from when every rank is up: the first launch of a session waits
            # seconds for the forkserver to import torch, which is not the learner's code.
            failure = self._watch(time.perf_counter())
        except KeyboardInterrupt:
            stopped = [r.rank for r in self.ranks
                       if r.process is not None and r.exitcode is None and not r.returned]
            self._stop_all()
            self._print_output(sys.stderr)
            raise KeyboardInterrupt(interrupted_message(stopped)) from None
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
            from ..emulate import announce
            announce(self.cluster, meta=any(r.trace and r.trace.get("meta") for r in self.ranks))
        self._print_output()
        if failure is not None:
            raise failure
        results = Results(r.result for r in self.ranks)
        results.backend, results.seconds = self.backend, time.perf_counter() - started
        if self.trace:
            from ..trace import Trace
            results.trace = Trace([r.trace for r in self.ranks], self.cluster)
        return results

    def _specs(self, port, folder):
        """What each rank needs to know to start (its rank, the rendezvous, where to dump its stack)."""
        spec = dict(world_size=self.world_size, backend=self.backend, init=self.init,
                    master_addr="127.0.0.1", master_port=port, store_port=port,
                    threads=self.threads, env=self.env, sources=cell_sources(),
                    pg_timeout=(self.timeout or 1800) + 60,
                    trace=self.trace, emulate=self.cluster)
        return [dict(spec, rank=r.rank, dump_path=os.path.join(folder, f"stack{r.rank}"))
                for r in self.ranks]

    def _start(self, ctx, r, payload, spec, target=_worker.main, extra=()):
        """Start rank `r`: target(spec, payload, message pipe, stdout pipe, stderr pipe, *extra)."""
        recv_conn, send_conn = ctx.Pipe(duplex=False)
        out_r, out_w = ctx.Pipe(duplex=False)
        err_r, err_w = ctx.Pipe(duplex=False)
        r.dump_path = spec["dump_path"]
        r.process = ctx.Process(target=target, name=f"distlab-rank{r.rank}",
                                args=(spec, payload, send_conn, out_w, err_w, *extra))
        _start_without_main(r.process)
        r.pid = r.process.pid
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
            if not self._pending():
                break
            if first_error_at is not None and time.monotonic() - first_error_at > self.GRACE_S:
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
                if first_error_at is None and (r.error is not None or self._failed_death(r)):
                    first_error_at = time.monotonic()
        return self._failure()

    def _pending(self):
        """The ranks the loop still waits for (here: until their process ends)."""
        return [r for r in self.ranks if r.exitcode is None]

    def _failed_death(self, r):
        # A rank that returned and then died counts only while others still need it.
        return died(r) and (not r.returned or not all(o.returned for o in self.ranks))

    def _read_message(self, r):
        try:
            kind, body = r.conn.recv()
        except (EOFError, OSError):
            r.conn.close()
            r.conn = None
            return
        if kind == "result":
            r.result, r.returned = loads(body), True
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
        r.died_at = time.time()
        # The result or error may still sit in the pipe behind the exit notice, and a C++ abort's
        # last words in the stderr pipe.
        while r.conn is not None and r.conn.poll(0):
            self._read_message(r)
        for fd in list(r.pipes):
            for _ in range(64):
                if fd not in r.pipes or not connection.wait([fd], timeout=0):
                    break
                self._read_pipe(r, fd)

    def _failure(self):
        if all(r.returned for r in self.ranks):
            return None    # a crash while leaving, after every rank returned, costs no result
        return explain_failure(self.ranks)

    def _timeout_error(self):
        # A rank that returned may still wait for the others at its exit barrier: it finished.
        running = [r for r in self.ranks if r.exitcode is None and not r.returned]
        return explain_timeout(self.ranks, running, self._dump_stacks(running), self.timeout)

    def _dump_stacks(self, running):
        if not hasattr(signal, "SIGUSR1"):
            return {}
        for r in running:
            try:
                os.kill(r.pid, signal.SIGUSR1)
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
        """Kill every rank and whatever it started, also when the rank itself has ended: one that
        died, returned, or left after a peer died can leave its children running."""
        # Each rank leads its own session (_worker.main): one look through them all.
        _worker.kill_sessions([r.pid for r in self.ranks if r.pid is not None and not r.stopped])
        for r in self.ranks:
            if r.pid is None or r.stopped:
                continue
            if r.exitcode is None and r.process is not None:
                try:
                    r.process.kill()      # also a rank killed before it could lead a session
                except (OSError, ValueError):
                    pass
        for r in self.ranks:
            if r.pid is None or r.stopped:
                continue
            if r.exitcode is None and r.process is not None:
                r.process.join(5)
                r.exitcode = r.process.exitcode
            # Done once: much later its pid may name someone else's group.
            r.stopped = r.exitcode is not None
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
            if r.process is not None and r.pid is not None:
                try:
                    r.process.close()
                    r.process = None      # closed: nothing may ask it anything again
                except ValueError:        # still running (it would not die): keep asking it
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
