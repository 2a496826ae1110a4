"""The child side of `distlab.run`: what each rank process does around the learner's function.

The parent (launch.py) starts one process per rank with `main(...)` as its target. This module
is preloaded in the forkserver together with torch, so it must stay cheap to import and must not
touch torch's thread pools or CUDA at import time (forked children would inherit them).
"""
import faulthandler
import linecache
import os
import pickle
import signal
import sys
import time
import traceback

import cloudpickle
import torch
import torch.distributed as dist

from . import devices
from ._payload import dumps, to_cpu

# Set while a rank runs: its message pipe to the parent and its device.
_conn = None
_device = None
_rank = None


def main(spec, payload, conn, out_w, err_w):
    global _conn, _device, _rank
    _rank = spec["rank"]
    # Own session (and process group), so the parent can stop whatever this rank started, even
    # after the rank itself has ended (kill_session).
    lead_own_session()
    # Send fd 1 and 2 (C++ warnings too, not only print) to the parent's pipes for this rank.
    os.dup2(out_w.fileno(), 1)
    os.dup2(err_w.fileno(), 2)
    out_w.close()
    err_w.close()
    sys.stdout.reconfigure(line_buffering=True)
    sys.stderr.reconfigure(line_buffering=True)
    _conn = conn

    # On a timeout the parent sends SIGUSR1 and reads where every thread was, even inside C++.
    if hasattr(signal, "SIGUSR1"):
        dump = open(spec["dump_path"], "w")
        faulthandler.register(signal.SIGUSR1, file=dump, all_threads=True)

    os.environ.update(
        MASTER_ADDR=spec["master_addr"], MASTER_PORT=str(spec["master_port"]),
        RANK=str(_rank), WORLD_SIZE=str(spec["world_size"]),
        LOCAL_RANK=str(_rank), LOCAL_WORLD_SIZE=str(spec["world_size"]), GROUP_WORLD_SIZE="1",
        GROUP_RANK="0", ROLE_RANK=str(_rank), ROLE_WORLD_SIZE=str(spec["world_size"]),
    )
    os.environ.update(spec.get("env", {}))
    _listen_on_loopback_only()
    # torch read TORCH_DISTRIBUTED_DEBUG when the forkserver imported it: read it again.
    dist.set_debug_level_from_env()
    # Ranks sharing a few cores each get their share: oversubscribed ranks run many times slower.
    torch.set_num_threads(spec["threads"])
    backend = spec["backend"]
    if "nccl" in backend:
        torch.cuda.set_device(_rank)
        _device = torch.device("cuda", _rank)
    else:
        _device = torch.device("cpu")
    devices.set_current(_device)
    linecache.cache.update(spec.get("sources", {}))

    try:
        fn, args, kwargs = cloudpickle.loads(payload)
        if spec["init"]:
            store = _init_process_group(spec)
        recorder = _recorder(spec, store if spec["init"] else None)
        if recorder is not None:
            recorder.start()
        try:
            result = fn(_rank, spec["world_size"], *args, **kwargs)
        finally:
            if recorder is not None:
                conn.send(("trace", recorder.stop()))
        try:
            blob = dumps(to_cpu(result), result=True)   # by value: classes of the notebook come back too
        except Exception as e:
            raise TypeError(
                f"rank {_rank} returned a {type(result).__name__} that cannot be sent back to the "
                f"notebook ({e}). Return plain data: numbers, lists, dicts, tensors.") from None
        message = ("result", blob)
    except BaseException as e:  # noqa: B902 - every failure must reach the parent
        message = ("error", _describe(e))
    sys.stdout.flush()
    sys.stderr.flush()
    # Report first: the parent must hear the result or the error even if cleanup blocks.
    conn.send(message)
    if dist.is_available() and dist.is_initialized():
        try:
            if message[0] == "result":
                # Nobody closes its connections while a peer may still be opening one to it
                # (a group created just before returning): leave together.
                dist.barrier()
            dist.destroy_process_group()
        except Exception:
            pass
    conn.close()
    sys.stdout.flush()
    sys.stderr.flush()


def lead_own_session():
    """Make this process the leader of a new session and process group, both named by its pid.

    Everything the rank starts inherits them: a child that moves to a process group of its own
    (a shell with job control, `Popen(process_group=0)`) stays in the session. Only a child that
    starts a session of its own (`start_new_session=True`, a daemon) leaves it."""
    if hasattr(os, "setsid") and os.getsid(0) != os.getpid():
        os.setsid()


def kill_sessions(leaders):
    """SIGKILL the ranks `leaders` (pids) and every process they left in their sessions.

    A rank may be gone (it died, returned, or left after a peer died) while its children run on:
    its pid still names their group and session (Linux frees a pid only once no process uses it
    as a group or session id), so it finds them. A group goes in one call; members of other
    groups of a session are found in /proc (Linux), again until none is left (one may fork).
    A rank may stop its own session: it goes last."""
    leaders, me = set(leaders), os.getpid()
    if not leaders or not hasattr(os, "killpg"):
        return
    for leader in leaders - {me}:
        _killpg(leader)       # first, so that no rank can start more while we look
    for _ in range(10):
        left = [pid for pid, sid in _sessions() if sid in leaders and pid not in leaders | {me}]
        if not left:
            break
        for pid in left:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
    if me in leaders:
        _killpg(me)


def _killpg(pgid):
    try:
        os.killpg(pgid, signal.SIGKILL)
    except OSError:
        pass


def _sessions():
    """(pid, session id) of every live process (zombies excluded), from /proc; [] elsewhere."""
    try:
        names = os.listdir("/proc")
    except OSError:
        return []
    out = []
    for name in names:
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                fields = f.read().rsplit(b")", 1)[1].split()
        except (OSError, IndexError):
            continue
        # after the command name: state, ppid, pgrp, session, ...
        if len(fields) > 3 and fields[0] != b"Z":
            out.append((int(name), int(fields[3])))
    return out


def _init_process_group(spec):
    from datetime import timedelta
    # Without this barrier a rank that finishes fast (point-to-point code) can exit while a
    # peer is still connecting to it inside init, and that peer fails with "Connection closed".
    os.environ.setdefault("TORCH_DIST_INIT_BARRIER", "1")
    store = dist.TCPStore(spec["master_addr"], spec["store_port"], spec["world_size"],
                          is_master=False, timeout=timedelta(seconds=spec["pg_timeout"]))
    dist.init_process_group(spec["backend"], store=store, rank=_rank,
                            world_size=spec["world_size"],
                            timeout=timedelta(seconds=spec["pg_timeout"]))
    return store


class _LoopbackTCPStore(dist.TCPStore):
    """dist.TCPStore, except that a store hosted at 127.0.0.1 listens on 127.0.0.1 only.

    By default a TCPStore server listens on every interface of the machine: on a shared network
    anyone could write into the unauthenticated store the ranks trust. With init=False the
    learner's init_process_group (or rendezvous code) hosts it on rank 0: hand it a socket
    bound to loopback instead."""

    def __init__(self, host_name, port, world_size=None, is_master=False, *args, **kwargs):
        if is_master and host_name in ("127.0.0.1", "localhost") and \
                kwargs.get("master_listen_fd") is None and len(args) < 4:
            import socket
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind(("127.0.0.1", port))
            s.listen(128)
            kwargs["master_listen_fd"] = s.detach()   # the store owns (and closes) it
        super().__init__(host_name, port, world_size, is_master, *args, **kwargs)


def _listen_on_loopback_only():
    # (`import torch.distributed.rendezvous as m` gives the function of that name, not the module)
    rendezvous = sys.modules["torch.distributed.rendezvous"]
    dist.TCPStore = rendezvous.TCPStore = _LoopbackTCPStore


def _recorder(spec, store):
    """The trace recorder of this rank (with a virtual clock under emulation), or None."""
    if not spec.get("trace"):
        return None
    from . import _tracer
    from .emulate import Clock
    clock = None
    if spec.get("emulate") is not None:
        clock = Clock(spec["emulate"], dist.PrefixStore("distlab-emulate/", store), _rank,
                      spec["world_size"])
    return _tracer.Recorder(_rank, clock)


def _describe(e):
    """What the parent needs to report an exception: its type, message and traceback."""
    tb = e.__traceback__
    # Drop this module's own frame: the learner's code starts one frame further in.
    if tb is not None and tb.tb_frame.f_code.co_filename == __file__:
        tb = tb.tb_next
    text = "".join(traceback.format_exception(type(e), e, tb))
    try:
        exc = pickle.dumps(e)
        pickle.loads(exc)
    except Exception:
        exc = None
    return {"type": type(e).__name__, "message": str(e), "traceback": text, "exception": exc,
            "time": time.time()}


# ---- helpers that the learner's code calls inside a rank -------------------------------------

def send_progress(desc, n, total):
    if _conn is not None:
        try:
            _conn.send(("progress", (desc, n, total)))
        except (OSError, ValueError):
            pass
