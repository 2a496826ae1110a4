"""Starting rank processes: the start method, a start that skips __main__, the rendezvous."""
import os
import socket
import sys
import threading
from multiprocessing import spawn


def cores():
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


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
                                            "distlab._worker", "distlab.trace",
                                            "distlab.emulate"])
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
            # IPython's `%reset -f` deletes __main__.__spec__, which multiprocessing reads here.
            main = sys.modules.get("__main__")
            lost_spec = main is not None and not hasattr(main, "__spec__")
            if lost_spec:
                main.__spec__ = None
            try:
                data = original(name)
            finally:
                if lost_spec:
                    del main.__spec__
            data.pop("init_main_from_path", None)
            data.pop("init_main_from_name", None)
            return data

        spawn.get_preparation_data = without_main
        try:
            process.start()
        finally:
            spawn.get_preparation_data = original


# Ports for a rendezvous that rank 0 binds later (init=False): chosen below the kernels'
# ephemeral ranges (Linux 32768-60999, macOS 49152-65535), where every outgoing connection of
# every other process takes its local port. A port the OS hands out for bind(0) comes from that
# range, so between this check and rank 0's bind a gloo connection elsewhere on the machine
# could take it ("Address already in use", seen under make test's parallel workers).
_RENDEZVOUS_PORTS = (20000, 32000)


def free_port():
    """A loopback port free now, outside the ephemeral range when one there is free."""
    import random
    pick = random.SystemRandom()        # not the global generator: notebooks seed that one
    for _ in range(64):
        port = pick.randrange(*_RENDEZVOUS_PORTS)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def loopback_listener():
    """A socket listening on 127.0.0.1 only: (port, fd). The caller hands the fd to a TCPStore,
    which then owns it (by default a TCPStore listens on every interface of the machine)."""
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.bind(("127.0.0.1", 0))
    s.listen(128)
    return s.getsockname()[1], s.detach()


def parent_store(world_size, timeout):
    """The rendezvous store, hosted by the parent on loopback for as long as the launch lasts."""
    from datetime import timedelta
    import torch.distributed as dist
    port, fd = loopback_listener()
    return dist.TCPStore("127.0.0.1", port, world_size, is_master=True, wait_for_workers=False,
                         timeout=timedelta(seconds=(timeout or 1800) + 60), master_listen_fd=fd)
