"""Rendezvous: how N processes that know only an address and a port find each other.

Before any collective, every rank must learn how to reach every other rank. PyTorch does this
with a key-value store (a TCPStore) that one process hosts at MASTER_ADDR:MASTER_PORT:
each rank connects to it, publishes its own address under a key, waits until all the keys are
there, reads them, and then opens direct connections to its peers. After that the store is only
used for bookkeeping; the data of collectives flows rank to rank.

This module holds the chapter's small helpers around that:
- `toy_rendezvous`: the exchange written out by hand with the store's own API;
- `store_keys`: what `init_process_group` really wrote into the store, addresses decoded;
- `run_torchrun` / `rank_logs`: launch a module with torchrun from Python and read each rank's
  output from torchrun's log folder, in rank order.
"""
import ipaddress
import os
import socket
import subprocess
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path

import torch.distributed as dist


# ---- the rendezvous by hand --------------------------------------------------------------------

def open_store(rank, world_size, timeout=30):
    """Connect to the rendezvous store at MASTER_ADDR:MASTER_PORT; rank 0 hosts it."""
    return dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world_size,
                         is_master=(rank == 0), timeout=timedelta(seconds=timeout))


def toy_rendezvous(rank, world_size, store):
    """Publish this rank's listening address, wait for everyone's, then use one directly.

    Returns {rank: "host:port"}: the table every rank now holds.
    """
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))          # port 0: the OS picks a free one
    listener.listen()
    host, port = listener.getsockname()
    store.set(f"addr/{rank}", f"{host}:{port}")
    print(f"set  addr/{rank} = {host}:{port}")
    # wait() returns only once every key exists: this is the moment all ranks have arrived.
    keys = [f"addr/{r}" for r in range(world_size)]
    store.wait(keys)
    print(f"wait {keys[0]} .. {keys[-1]}: all {world_size} present")
    peers = {r: store.get(f"addr/{r}").decode() for r in range(world_size)}

    # The store's job is done: from here ranks talk directly, as gloo and NCCL do. Each rank
    # sends a word to its right-hand neighbour and hears from its left-hand one.
    right_host, right_port = peers[(rank + 1) % world_size].rsplit(":", 1)
    with socket.create_connection((right_host, int(right_port))) as out:
        out.sendall(f"hello from rank {rank}".encode())
        out.shutdown(socket.SHUT_WR)    # end of message
        conn, _ = listener.accept()     # the OS queued the neighbour's connection meanwhile
        with conn:
            heard = b"".join(iter(lambda: conn.recv(100), b"")).decode()
    print(f"direct socket from the left neighbour: {heard!r}")
    # The store lives in rank 0's process: if rank 0 left now, a slower rank's get() would fail.
    store.add("done", 1)
    if rank == 0:
        while int(store.add("done", 0)) < world_size:
            time.sleep(0.01)
    listener.close()
    return peers


# ---- what init_process_group wrote ------------------------------------------------------------

def tcp_store_of(store):
    """The TCPStore under the PrefixStores that process groups wrap around it."""
    while hasattr(store, "underlying_store"):
        store = store.underlying_store
    return store


def decode_address(value):
    """'127.0.0.1:PORT' from a gloo address record (it embeds a sockaddr_in), else its size."""
    # gloo serialises a sockaddr_storage: AF_INET (2, little-endian), port (big-endian), IPv4.
    for i in range(len(value) - 7):
        port = int.from_bytes(value[i + 2:i + 4], "big")
        if value[i:i + 2] == b"\x02\x00" and port and value[i + 4]:
            return f"{ipaddress.IPv4Address(value[i + 4:i + 8])}:{port}"
    return f"({len(value)} bytes)"


def store_keys(store=None):
    """{key: decoded value} of every key in the default group's TCPStore, sorted by key."""
    if store is None:
        store = dist.distributed_c10d._get_default_store()
    store = tcp_store_of(store)
    return {k: decode_address(store.get(k)) for k in sorted(store.list_keys())}


# ---- torchrun from Python ---------------------------------------------------------------------

def torchrun_command(module, nproc, *args, log_dir, extra=()):
    """The torchrun command line, run as `python -m torch.distributed.run` of this interpreter."""
    return [sys.executable, "-m", "torch.distributed.run", *extra,
            f"--nproc-per-node={nproc}", "--redirects=3", f"--log-dir={log_dir}",
            "-m", module, *map(str, args)]


def rank_logs(log_dir):
    """{local rank: (stdout, stderr)} from torchrun's log folder: <run id>/attempt_<k>/<rank>/."""
    logs = {}
    for folder in sorted(Path(log_dir).glob("*/attempt_*/*")):
        if folder.name.isdigit():
            read = lambda name: (folder / name).read_text() if (folder / name).exists() else ""
            logs[int(folder.name)] = (read("stdout.log"), read("stderr.log"))
    return dict(sorted(logs.items()))


def run_torchrun(module, nproc, *args, standalone=True, timeout=120, extra=()):
    """Run `module` under torchrun on this machine; return (exit code, {local rank: stdout}, stderr).

    Each rank's output goes to its own file (--redirects=3), so it comes back whole and in rank
    order instead of interleaved as the processes happened to print.
    """
    with tempfile.TemporaryDirectory(prefix="torchrun-") as log_dir:
        extra = (("--standalone",) if standalone else ()) + tuple(extra)
        cmd = torchrun_command(module, nproc, *args, log_dir=log_dir, extra=extra)
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
        logs = rank_logs(log_dir)
    outputs = {r: out for r, (out, _) in logs.items()}
    errors = done.stderr + "".join(err for _, err in logs.values())
    return done.returncode, outputs, errors
