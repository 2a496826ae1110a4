"""distlab.run with real processes: results, environment, output, failures, hangs, bad input."""
import math
import os
import subprocess
import sys
import textwrap
import threading
import time

import numpy as np
import pytest
import torch
import torch.distributed as dist

import distlab
from distlab import RankFailed, RunTimeout
from conftest import wait_gone


def write_pid(folder, rank):
    (folder / f"pid{rank}").write_text(str(os.getpid()))


# ---- the happy path ------------------------------------------------------------------------------

def all_reduce_rank(rank, world_size):
    t = torch.tensor([float(rank)])
    dist.all_reduce(t)
    print(f"sum = {t.item():g}")
    return t.item()


def finish_in_reverse(rank, world_size):
    t = torch.tensor([float(rank)])
    dist.all_reduce(t)
    if rank < world_size - 1:       # finish only after the rank above has finished, and later
        dist.recv(torch.zeros(1), src=rank + 1)
        time.sleep(0.1)
    finished = time.monotonic()     # one clock for every process of the machine
    if rank > 0:
        dist.send(torch.zeros(1), dst=rank - 1)
    print(f"sum = {t.item():g}")
    return rank, t.item(), finished


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_results_in_rank_order(world_size, capsys):
    results = distlab.run(finish_in_reverse, world_size)
    expected = sum(range(world_size))
    assert [(r, total) for r, total, _ in results] == [(r, expected) for r in range(world_size)]
    finished = [t for _, _, t in results]
    assert finished == sorted(finished, reverse=True)     # the last rank finished first
    assert results.backend == "gloo"
    out = capsys.readouterr().out
    assert out == "".join(f"[rank {r}] sum = {expected:g}\n" for r in range(world_size))


def print_in_reverse(rank, world_size):
    time.sleep(0.05 * (world_size - rank))  # rank 3 prints first
    print(f"hello from {rank}")
    print(f"warning from {rank}", file=sys.stderr)
    os.write(1, f"raw fd write from {rank}\n".encode())  # C-level output is captured too
    return rank


def test_output_grouped_by_rank_whatever_the_order(capsys):
    assert distlab.run(print_in_reverse, 4) == [0, 1, 2, 3]
    captured = capsys.readouterr()
    assert captured.out == "".join(
        f"[rank {r}] hello from {r}\n[rank {r}] raw fd write from {r}\n" for r in range(4))
    assert captured.err == "".join(f"[rank {r}] warning from {r}\n" for r in range(4))


def report_environment(rank, world_size):
    keys = ["RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"]
    return {k: os.environ[k] for k in keys} | {
        "pg_rank": dist.get_rank(), "pg_size": dist.get_world_size(),
        "backend": dist.get_backend(), "threads": torch.get_num_threads(),
        "device": str(distlab.device())}


def test_torchrun_environment_and_process_group():
    results = distlab.run(report_environment, 2)
    ports = {r["MASTER_PORT"] for r in results}
    assert len(ports) == 1 and int(ports.pop()) > 0
    cores = len(os.sched_getaffinity(0))
    for rank, r in enumerate(results):
        assert (r["RANK"], r["WORLD_SIZE"], r["LOCAL_RANK"]) == (str(rank), "2", str(rank))
        assert r["MASTER_ADDR"] == "127.0.0.1"
        assert (r["pg_rank"], r["pg_size"], r["backend"]) == (rank, 2, "gloo")
        assert r["threads"] == max(1, cores // 2)
        assert r["device"] == "cpu"


def init_it_yourself(rank, world_size):
    assert not dist.is_initialized()
    dist.init_process_group("gloo", init_method="env://")
    t = torch.ones(1)
    dist.all_reduce(t)
    return t.item()


def test_init_false_leaves_init_to_the_function():
    assert distlab.run(init_it_yourself, 3, init=False) == [3.0, 3.0, 3.0]


def return_tensors(rank, world_size, scale, *, offset):
    return {"t": torch.arange(3) * scale + offset + rank, "pair": (rank, "x")}


def test_arguments_and_tensor_results():
    results = distlab.run(return_tensors, 2, 10, offset=1)
    assert torch.equal(results[1]["t"], torch.tensor([2, 12, 22]))
    assert results[0]["pair"] == (0, "x")


def test_functions_defined_at_run_time_travel_by_value():
    # As in a notebook cell: a closure and a lambda that no child process could import.
    factor = 7
    namespace = {}
    exec("def cell_fn(rank, world_size):\n    return rank * factor", {"factor": factor}, namespace)
    assert distlab.run(namespace["cell_fn"], 3) == [0, 7, 14]
    assert distlab.run(lambda rank, world_size: rank + factor, 2) == [7, 8]


def test_concurrent_launches_do_not_collide():
    results, errors = {}, []

    def launch(i):
        try:
            results[i] = distlab.run(all_reduce_rank, 2)
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=launch, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert all(results[i] == [1.0, 1.0] for i in range(4))


def count_with_progress(rank, world_size):
    return sum(1 for _ in distlab.progress(range(50), desc="steps"))


def test_progress_inside_ranks_is_harmless_without_a_notebook():
    assert distlab.run(count_with_progress, 2) == [50, 50]


# ---- failures -------------------------------------------------------------------------------------

def raise_on_rank_1(rank, world_size, folder):
    write_pid(folder, rank)
    if rank == 1:
        raise ValueError("rank 1 found a bad value")
    time.sleep(60)  # the others would wait forever: the launcher must stop them


def test_exception_names_the_rank_and_stops_the_others(pid_dir):
    folder, pids = pid_dir
    with pytest.raises(RankFailed) as info:
        distlab.run(raise_on_rank_1, 3, folder, timeout=60)
    e = info.value
    assert e.rank == 1 and e.exc_type == "ValueError"
    assert str(e).startswith("rank 1 raised ValueError: rank 1 found a bad value")
    assert "Traceback from rank 1" in str(e) and "raise_on_rank_1" in str(e)
    assert isinstance(e.exception, ValueError)
    assert len(pids()) == 3 and wait_gone(pids()) == []


def failing_collective(rank, world_size):
    if rank == 2:
        raise KeyError("missing")
    t = torch.ones(1)
    dist.all_reduce(t)  # the other ranks fail here once rank 2 is gone


def test_the_rank_that_raised_first_is_reported_not_its_victims():
    with pytest.raises(RankFailed) as info:
        distlab.run(failing_collective, 4, timeout=60)
    assert info.value.rank == 2 and info.value.exc_type == "KeyError"


def exit_silently(rank, world_size, folder, how, then="sleep"):
    write_pid(folder, rank)
    if rank == 2:
        time.sleep(0.3)    # the others are in their collective (or sleep) by now
        (folder / "died_at").write_text(repr(time.time()))
        if how == "exit":
            os._exit(3)
        if how == "segv":
            import ctypes
            ctypes.string_at(0)
        os.kill(os.getpid(), 9)
    if then == "sleep":
        time.sleep(60)
    else:
        dist.all_reduce(torch.ones(1))   # the survivors see "Connection closed by peer" here


@pytest.mark.parametrize("how, then, phrase", [
    ("exit", "sleep", "exited with code 3"),
    ("kill", "sleep", "was killed by SIGKILL"),
    ("exit", "collective", "exited with code 3"),
    ("kill", "collective", "was killed by SIGKILL"),
    ("segv", "collective", "was killed by SIGSEGV"),
])
def test_a_rank_that_dies_without_a_word_is_named_at_once(pid_dir, how, then, phrase):
    # The survivors' "Connection closed by peer" must not be blamed: the dead rank is. The
    # timeout is long: only noticing the death itself can raise RankFailed.
    folder, pids = pid_dir
    with pytest.raises(RankFailed) as info:
        distlab.run(exit_silently, 3, folder, how, then, timeout=60)
    noticed = time.time() - float((folder / "died_at").read_text())
    print(f"{how} while the others {then}: named {noticed:.2f} s after the death")
    e = info.value
    assert str(e).startswith(f"rank 2 {phrase} before its function returned")
    assert e.rank == 2 and e.exitcode == {"exit": 3, "kill": -9, "segv": -11}[how]
    assert not e.peer_lost
    assert wait_gone(pids()) == []


def recv_too_small(rank, world_size):
    if rank == 0:
        dist.send(torch.ones(4), 1)
    elif rank == 1:
        dist.recv(torch.ones(3), 0)   # 16 bytes arrive for 12: gloo aborts the process


def test_a_gloo_abort_on_a_size_mismatch_names_the_aborted_rank():
    with pytest.raises(RankFailed) as info:
        distlab.run(recv_too_small, 3, timeout=60)
    lines = str(info.value).splitlines()
    assert info.value.rank == 1
    assert lines[0] == ("rank 1 was killed by SIGABRT before its function returned, without "
                        "raising a Python exception.")
    assert "Received data size doesn't match expected size" in lines[1]
    assert lines[2].startswith("The ranks passed tensors of different sizes")


def unpicklable_result(rank, world_size):
    return threading.Lock()


def test_a_result_that_cannot_come_back_is_explained():
    with pytest.raises(RankFailed, match="returned a lock that cannot be sent back"):
        distlab.run(unpicklable_result, 2)


def hang_in_collective(rank, world_size, folder):
    write_pid(folder, rank)
    print(f"rank {rank} started")
    if rank == 1:
        time.sleep(60)
    t = torch.ones(1)
    dist.all_reduce(t)


def test_timeout_names_running_ranks_and_where_they_are(pid_dir, capsys):
    folder, pids = pid_dir
    with pytest.raises(RunTimeout) as info:
        distlab.run(hang_in_collective, 3, folder, timeout=5)
    e = info.value
    assert e.running == [0, 1, 2]
    lines = str(e).splitlines()
    assert lines[0] == "distlab.run timed out after 5 s: ranks 0, 1 and 2 still running."
    assert lines[1].startswith("  rank 0: waits in all_reduce, called from hang_in_collective")
    assert lines[2].startswith("  rank 1: is at hang_in_collective") and "time.sleep(60)" in lines[2]
    assert lines[3].startswith("  rank 2: waits in all_reduce")
    # What the ranks printed before the timeout is still shown.
    assert "[rank 1] rank 1 started" in capsys.readouterr().out
    assert wait_gone(pids()) == []


def test_finished_ranks_are_reported_as_finished():
    def only_rank_0_hangs(rank, world_size):
        if rank == 0:
            time.sleep(60)
    with pytest.raises(RunTimeout) as info:
        distlab.run(only_rank_0_hangs, 2, timeout=4)
    assert info.value.running == [0]
    assert "rank 1: finished" in str(info.value)


# ---- bad input ------------------------------------------------------------------------------------

@pytest.mark.parametrize("fn, world_size, kwargs, error, phrase", [
    (all_reduce_rank, 0, {}, ValueError, "world_size must be at least 1"),
    (all_reduce_rank, -2, {}, ValueError, "world_size must be at least 1"),
    (all_reduce_rank, 1000, {}, ValueError, "too many ranks for one machine"),
    (all_reduce_rank, "4", {}, TypeError, "whole number of ranks"),
    (all_reduce_rank, 2.0, {}, TypeError, "whole number of ranks"),
    (42, 2, {}, TypeError, "needs a function to run on every rank"),
    (all_reduce_rank, 2, {"timeout": -1}, ValueError, "timeout must be a positive number"),
    (all_reduce_rank, 2, {"backend": "mpi2"}, ValueError, "backend must be one of"),
    (all_reduce_rank, 2, {"backend": "nccl"}, ValueError, "needs one GPU per rank"),
])
def test_bad_input_is_refused_with_a_sentence(fn, world_size, kwargs, error, phrase):
    if kwargs.get("backend") == "nccl" and torch.cuda.device_count() >= 2:
        pytest.skip("this machine has GPUs")
    with pytest.raises(error, match=phrase):
        distlab.run(fn, world_size, **kwargs)


@pytest.mark.parametrize("world_size, kwargs, error, phrase", [
    # odd values of every argument: inf, nan, numpy scalars, bools
    (True, {}, TypeError, "whole number of ranks"),
    (np.bool_(True), {}, TypeError, "whole number of ranks"),
    (math.inf, {}, TypeError, "whole number of ranks"),
    (math.nan, {}, TypeError, "whole number of ranks"),
    (np.float64(2.0), {}, TypeError, "whole number of ranks"),
    (np.int64(0), {}, ValueError, "world_size must be at least 1"),
    (2, {"timeout": math.nan}, ValueError, "timeout must be a positive number"),
    (2, {"timeout": -math.inf}, ValueError, "timeout must be a positive number"),
    (2, {"timeout": 0}, ValueError, "timeout must be a positive number"),
    (2, {"timeout": True}, ValueError, "timeout must be a positive number"),
    (2, {"timeout": "30"}, ValueError, "timeout must be a positive number"),
    (2, {"threads": True}, TypeError, "threads must be a positive whole number"),
    (2, {"threads": math.inf}, TypeError, "threads must be a positive whole number"),
    (2, {"threads": np.int64(0)}, ValueError, "threads must be a positive whole number"),
    (2, {"backend": True}, ValueError, "backend must be one of"),
    (2, {"backend": "cuda:nccl,cpu:mpi"}, ValueError, "backend must be one of"),
    (2, {"init": 1}, TypeError, "init must be True or False"),
    (2, {"init": "yes"}, TypeError, "init must be True or False"),
    (2, {"trace": 1.0}, TypeError, "trace must be True or False"),
    (2, {"env": {"OMP_NUM_THREADS": 1}}, TypeError, "env must map names to strings"),
    (2, {"emulate": True}, ValueError, "emulate must be the name of a preset"),
    (2, {"emulate": math.nan}, ValueError, "emulate must be the name of a preset"),
])
def test_odd_argument_values_are_refused_with_a_sentence(world_size, kwargs, error, phrase):
    with pytest.raises(error, match=phrase):
        distlab.run(all_reduce_rank, world_size, **kwargs)


def report_settings(rank, world_size):
    return world_size, torch.get_num_threads(), dist.is_initialized()


def test_numpy_scalars_and_infinite_timeout_are_accepted():
    # np.prod([1, 2]) is a numpy integer; timeout=math.inf means no limit (like None).
    results = distlab.run(report_settings, np.prod([1, 2]), timeout=math.inf,
                          threads=np.int32(1), init=np.True_, trace=np.False_)
    assert results == [(2, 1, True)] * 2 and type(results[0][0]) is int
    cores = len(os.sched_getaffinity(0))
    assert distlab.run(report_settings, np.int8(1), timeout=np.float32(30)) == [(1, cores, True)]


def test_the_composite_nccl_backend_is_accepted_by_argument_checking():
    if torch.cuda.device_count() >= 2:
        pytest.skip("this machine has GPUs")
    # accepted as a backend name, refused only for want of GPUs
    with pytest.raises(ValueError, match="'cpu:gloo,cuda:nccl' needs one GPU per rank"):
        distlab.run(all_reduce_rank, 2, backend="cpu:gloo,cuda:nccl")


def test_results_travel_by_value_and_come_back_detached():
    # As in a notebook: a class defined in __main__, which pickle (by reference) cannot send.
    namespace = {"__name__": "__main__", "torch": torch}
    exec(textwrap.dedent("""
        class Out:
            def __init__(self, rank, best):
                self.rank, self.best = rank, best
        def fn(rank, world_size):
            y = (torch.arange(6.0).reshape(2, 3) * (rank + 1)).requires_grad_()
            return Out(rank, (y * 2).max(dim=0))
    """), namespace)
    Out = namespace["Out"]
    assert Out.__module__ == "__main__"
    results = distlab.run(namespace["fn"], 2)
    for rank, out in enumerate(results):
        assert type(out) is Out and out.rank == rank
        assert isinstance(out.best, torch.return_types.max)
        assert not out.best.values.requires_grad and out.best.values.grad_fn is None
        assert out.best.values.tolist() == [6.0 * (rank + 1), 8.0 * (rank + 1), 10.0 * (rank + 1)]
        assert out.best.indices.tolist() == [1, 1, 1]


def listening_sockets(pids):
    """{pid: ["ip:port", ...]} of every listening TCP socket the processes hold (from /proc)."""
    listening = {}
    for table, ipv6 in (("/proc/net/tcp", False), ("/proc/net/tcp6", True)):
        if not os.path.exists(table):
            continue
        for line in open(table).read().splitlines()[1:]:
            fields = line.split()
            if fields[3] != "0A":             # TCP_LISTEN
                continue
            address, port = fields[1].split(":")
            raw = bytes.fromhex(address)
            words = [raw[i:i + 4][::-1] for i in range(0, len(raw), 4)]   # little-endian words
            ip = ".".join(map(str, words[0])) if not ipv6 else \
                __import__("ipaddress").IPv6Address(b"".join(words)).compressed
            listening[fields[9]] = f"{ip}:{int(port, 16)}"
    found = {}
    for pid in pids:
        for fd in os.listdir(f"/proc/{pid}/fd"):
            try:
                link = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            inode = link[len("socket:["):-1] if link.startswith("socket:[") else None
            if inode in listening:
                found.setdefault(pid, []).append(listening[inode])
    return found


def sockets_during_a_run(rank, world_size, parent, init):
    if not init:
        dist.init_process_group("gloo")      # env://: rank 0 hosts the store (torchrun's way)
    pids = [torch.zeros(1, dtype=torch.int64) for _ in range(world_size)]
    dist.all_gather(pids, torch.tensor([os.getpid()]))
    found = listening_sockets([parent] + [int(p) for p in pids]) if rank == 0 else None
    dist.barrier()                            # everyone alive until rank 0 has looked
    return found


@pytest.mark.skipif(not os.path.exists("/proc/net/tcp"), reason="needs Linux /proc")
@pytest.mark.parametrize("init", [True, False])
def test_every_listening_socket_of_a_run_is_on_loopback(init):
    found = distlab.run(sockets_during_a_run, 3, os.getpid(), init, init=init)[0]
    addresses = [a for sockets in found.values() for a in sockets]
    assert len(found) >= 2, found            # the store's host and the ranks' gloo listeners
    assert all(a.startswith(("127.0.0.1:", "::1:")) for a in addresses), found
    if init:                                  # the parent hosts the store
        assert os.getpid() in found, found


def test_arguments_that_cannot_be_pickled_are_named():
    with pytest.raises(TypeError, match=r"cannot send argument 2 \(generator\) to the ranks"):
        distlab.run(return_tensors, 2, 1, (x for x in range(3)), offset=0)


def launch_inside(rank, world_size):
    return distlab.run(all_reduce_rank, 2)


def test_a_rank_cannot_launch_ranks_of_its_own():
    with pytest.raises(RankFailed, match="cannot be called from inside a rank"):
        distlab.run(launch_inside, 1)


def test_calling_the_function_instead_of_passing_it_is_explained():
    with pytest.raises(TypeError, match="Pass the function itself, without calling it"):
        distlab.run(all_reduce_rank(0, 1) if False else None, 2)


# ---- scripts and interrupts -------------------------------------------------------------------------

def run_script(tmp_path, body, timeout=120):
    script = tmp_path / "script.py"
    script.write_text(textwrap.dedent(body))
    return subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          timeout=timeout, cwd=tmp_path)


def test_a_main_module_without_spec_still_launches(monkeypatch):
    """IPython's `%reset -f` deletes __main__.__spec__; multiprocessing reads it at every start."""
    monkeypatch.delattr(sys.modules["__main__"], "__spec__")
    assert distlab.run(all_reduce_rank, 2) == [1.0, 1.0]
    assert not hasattr(sys.modules["__main__"], "__spec__")   # left as the learner had it


def test_a_script_without_a_main_guard_runs_once_and_ctrl_c_reaps_its_ranks(tmp_path):
    # forkserver and spawn normally re-import the main script in every child; without a guard
    # that would launch ranks from inside ranks. distlab.run must just work. Then the script's
    # second launch is interrupted as Ctrl-C in a terminal (or Kernel > Interrupt) does it.
    # (One script for both: a Python with torch and a forkserver is ≈ 8 CPU-seconds.)
    script = tmp_path / "script.py"
    script.write_text(textwrap.dedent(f"""
        import os, time
        import torch, torch.distributed as dist, distlab
        print("script body runs", flush=True)
        def fn(rank, world_size):
            t = torch.tensor([rank]); dist.all_reduce(t); return t.item()
        print(distlab.run(fn, 3), flush=True)
        def wait(rank, world_size):
            open(os.path.join({str(tmp_path)!r}, f"pid{{rank}}"), "w").write(str(os.getpid()))
            time.sleep(120)
        distlab.run(wait, 3, timeout=120)
    """))
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, cwd=tmp_path)
    until = time.monotonic() + 120
    while len(list(tmp_path.glob("pid*"))) < 3 and time.monotonic() < until \
            and proc.poll() is None:
        time.sleep(0.1)
    pids = [int(p.read_text()) for p in tmp_path.glob("pid*")]
    if len(pids) < 3:
        proc.kill()
        out, err = proc.communicate(timeout=60)
        pytest.fail(f"the script's ranks did not all start: {out}\n{err}")
    time.sleep(0.5)
    proc.send_signal(2)
    out, err = proc.communicate(timeout=60)
    assert out == "script body runs\n[3, 3, 3]\n", err
    # One line says which ranks were stopped; no traceback through the launcher's event loop.
    assert err.splitlines()[-1] == "KeyboardInterrupt: distlab.run interrupted: stopped ranks 0, 1 and 2."
    assert "selectors.py" not in err and "_supervise" not in err, err
    assert wait_gone(pids) == []


def test_spawn_start_method_works_too(tmp_path):
    proc = run_script(tmp_path, """
        import os
        os.environ["DISTLAB_START_METHOD"] = "spawn"
        import distlab
        if __name__ == "__main__":
            # spawn imports torch afresh in every rank: on 2 busy cores that alone can take
            # longer than the default limit, which this test is not about
            print(distlab.run(lambda rank, world_size: rank * 10, 2, timeout=180))
    """)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[0, 10]"


def test_interrupting_a_jupyter_kernel_reaps_every_rank(tmp_path):
    from jupyter_client.manager import start_new_kernel
    km, kc = start_new_kernel(kernel_name="python3", cwd=str(tmp_path))
    try:
        code = textwrap.dedent(f"""
            import os, time, distlab
            def wait(rank, world_size):
                open(os.path.join({str(tmp_path)!r}, f"pid{{rank}}"), "w").write(str(os.getpid()))
                time.sleep(120)
            distlab.run(wait, 2, timeout=120)
        """)
        msg_id = kc.execute(code)
        until = time.monotonic() + 60
        while len(list(tmp_path.glob("pid*"))) < 2 and time.monotonic() < until:
            time.sleep(0.1)
        pids = [int(p.read_text()) for p in tmp_path.glob("pid*")]
        assert len(pids) == 2
        km.interrupt_kernel()
        reply = kc.get_shell_msg(timeout=60)
        while reply["parent_header"].get("msg_id") != msg_id:
            reply = kc.get_shell_msg(timeout=60)
        assert reply["content"]["status"] == "error"
        assert reply["content"]["ename"] == "KeyboardInterrupt"
        assert reply["content"]["evalue"] == "distlab.run interrupted: stopped ranks 0 and 1."
        shown = "\n".join(reply["content"]["traceback"])
        assert "selectors.py" not in shown and "_supervise" not in shown, shown
        assert wait_gone(pids) == []
        # The kernel is still usable: the next launch works.
        reply = kc.execute_interactive("r = distlab.run(lambda rank, ws: rank, 2)", timeout=60)
        assert reply["content"]["status"] == "ok", (reply["content"].get("ename"),
                                                    reply["content"].get("evalue"),
                                                    "\n".join(reply["content"].get("traceback", [])))
        reply = kc.execute_interactive("print(r)", timeout=60)
        assert reply["content"]["status"] == "ok"
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=True)


def lost_peer(rank):
    return {"type": "RuntimeError", "time": 100.0 + rank, "exception": None,
            "message": "[../gloo/transport/tcp/pair.cc] Connection closed by peer [127.0.0.1]:1",
            "traceback": "Traceback ..."}


def test_the_dead_rank_is_blamed_not_the_survivors_that_noticed():
    # The parent hears of the death (sentinel) a little after the survivors time-stamp their
    # "Connection closed by peer": the dead rank is still the one named.
    from distlab._supervise import Launch
    launch = Launch(4, "gloo", True, 10, None, {})
    for rank in (0, 1, 3):
        launch.ranks[rank].error, launch.ranks[rank].exitcode = lost_peer(rank), 0
    launch.ranks[2].exitcode, launch.ranks[2].died_at = -9, 100.1
    failure = launch._failure()
    assert failure.rank == 2 and failure.exitcode == -9
    assert str(failure).startswith("rank 2 was killed by SIGKILL before its function returned")
    assert "(also stopped: ranks 0, 1 and 3, because rank 2 died" in str(failure)
    # ... but a rank whose own code raised before the death is the cause.
    launch.ranks[1].error = dict(lost_peer(1), type="ValueError", message="bad batch", time=99.0)
    assert launch._failure().rank == 1


def test_a_rank_left_behind_is_named_when_the_others_only_lost_a_peer():
    # The shape-mismatch crash: healthy ranks see "Connection closed by peer", the culprit is
    # silent. The report must point at the silent rank, not at the first messenger.
    from distlab._supervise import Launch as _Launch
    launch = _Launch(3, "gloo", True, 10, None, {})
    for rank in (0, 2):
        launch.ranks[rank].error = {"type": "RuntimeError", "time": rank, "exception": None,
                                    "message": "[../gloo/transport/tcp/pair.cc] Connection "
                                               "closed by peer [127.0.0.1]:1234",
                                    "traceback": "Traceback ..."}
        launch.ranks[rank].exitcode = 1
    failure = launch._failure()
    assert str(failure).startswith(
        "ranks 0 and 2 lost the connection to a peer while rank 1 was still running: "
        "rank 1 is the likely cause")


def mismatched_ops(rank, world_size):
    t = torch.ones(3)
    if rank == 0:
        dist.all_reduce(t)
    else:
        dist.broadcast(t, 0)


def test_torch_distributed_debug_passed_in_env_takes_effect():
    # The forkserver imported torch before the rank saw env=...; the launcher re-reads it.
    with pytest.raises(RankFailed, match="Detected mismatch between collectives"):
        distlab.run(mismatched_ops, 2, env={"TORCH_DISTRIBUTED_DEBUG": "DETAIL"}, timeout=60)


# ---- no orphans: what a rank started ends with the run ------------------------------------------

def start_grandchildren(folder, rank):
    """Two `sleep 60` children of this rank: one in its process group, one in a group of its own
    (as a shell with job control or `process_group=0` makes); their pids go to `folder`."""
    kids = [subprocess.Popen(["sleep", "60"]), subprocess.Popen(["sleep", "60"], process_group=0)]
    for k, kid in enumerate(kids):
        (folder / f"kid{rank}-{k}").write_text(str(kid.pid))
    return kids


def grandchild_pids(folder):
    return [int(p.read_text()) for p in sorted(folder.glob("kid*"))]


def leave_grandchildren(rank, world_size, folder, how):
    kids = start_grandchildren(folder, rank)
    if rank == 1:
        if how == "exit":
            os._exit(3)
        if how == "raise":
            raise ValueError("rank 1 gives up")
        return len(kids)
    if how != "return":
        dist.all_reduce(torch.ones(1))      # rank 1 is gone: this rank fails and exits too
    return len(kids)


@pytest.mark.parametrize("how", ["return", "exit", "raise"])
def test_what_a_rank_started_is_stopped_whatever_way_the_rank_ended(tmp_path, how):
    # A rank that exited (returned, died, or left after a peer died) has a known exit code; the
    # processes it started must be stopped all the same, also those in a process group of their own.
    try:
        if how == "return":
            assert distlab.run(leave_grandchildren, 2, tmp_path, how, timeout=5) == [2, 2]
        else:
            with pytest.raises(RankFailed) as info:
                distlab.run(leave_grandchildren, 2, tmp_path, how, timeout=5)
            assert info.value.rank == 1
        assert len(grandchild_pids(tmp_path)) == 4
        assert wait_gone(grandchild_pids(tmp_path), seconds=5) == []
    finally:
        for pid in grandchild_pids(tmp_path):   # never leave them behind, even when it fails
            try:
                os.kill(pid, 9)
            except OSError:
                pass
