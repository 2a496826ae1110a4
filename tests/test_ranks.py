"""%%ranks: ranks that keep their state from cell to cell, and fail the way distlab.run does."""
import os
import signal
import threading

import pytest
from IPython.core.interactiveshell import InteractiveShell

import distlab
from distlab import RankFailed, RunTimeout
from distlab.ranks import Pool
from conftest import wait_gone


@pytest.fixture(scope="module")
def shell():
    ip = InteractiveShell.instance()
    ip.run_line_magic("load_ext", "distlab")
    yield ip
    distlab.ranks._stop_pool()


@pytest.fixture
def pool():
    p = Pool(2)
    yield p
    p.stop()


def cell(ip, line, body):
    """Run a %%ranks cell; return the exception it raised (or None)."""
    try:
        ip.run_cell_magic("ranks", line, body)
    except (RankFailed, RunTimeout, KeyboardInterrupt) as e:
        return e
    return None


def test_state_stays_from_cell_to_cell_output_in_rank_order_and_pull(shell, capsys):
    body = ("import time\ntime.sleep(0.05 * (2 - rank))\nx = torch.tensor([rank + 1.0])\n"
            "print('rank', rank, 'of', world_size)")     # rank 2 prints first
    assert cell(shell, "3", body) is None
    assert capsys.readouterr().out == ("[rank 0] rank 0 of 3\n[rank 1] rank 1 of 3\n"
                                       "[rank 2] rank 2 of 3\n")
    pids = distlab.ranks.pool().pids
    assert cell(shell, "3", "dist.all_reduce(x)\nx * rank") is None        # the same x, the same PG
    assert capsys.readouterr().out == ("[rank 0] tensor([0.])\n[rank 1] tensor([6.])\n"
                                       "[rank 2] tensor([12.])\n")
    assert distlab.ranks.pool().pids == pids                                # the same processes
    assert [t.item() for t in shell.run_line_magic("ranks", "pull x")] == [6.0, 6.0, 6.0]
    with pytest.raises(RankFailed, match="not defined on rank 0"):
        shell.run_line_magic("ranks", "pull nothing_here")


def test_an_exception_names_the_rank_and_the_others_keep_their_state(shell, capsys):
    cell(shell, "3", "y = rank * 10")
    e = cell(shell, "3", "if rank == 1:\n    raise ValueError('bad value on one rank')\ny += 1")
    assert isinstance(e, RankFailed) and e.rank == 1 and e.exc_type == "ValueError"
    assert "rank 1 raised ValueError: bad value on one rank" in str(e)
    assert "every rank keeps its variables" in str(e) and "Cell In[" in str(e)
    assert [v for v in shell.run_line_magic("ranks", "pull y")] == [1, 10, 21]
    capsys.readouterr()


def test_new_size_restarts_the_ranks_and_says_so(shell, capsys):
    cell(shell, "3", "z = 1")
    old = distlab.ranks.pool().pids
    assert cell(shell, "2", "'z' in globals()") is None
    out = capsys.readouterr().out
    assert "restarting: 2 ranks instead of 3" in out
    assert out.endswith("[rank 0] False\n[rank 1] False\n")
    assert wait_gone(old) == []


def test_a_collective_left_half_done_stops_the_ranks_and_the_next_cell_restarts(shell, capsys):
    cell(shell, "2", "t = torch.ones(1)")
    pids = distlab.ranks.pool().pids
    e = cell(shell, "2", "if rank == 0:\n    raise RuntimeError('left early')\ndist.all_reduce(t)")
    assert isinstance(e, RankFailed) and e.rank == 0
    assert "rank 1 did not finish the cell" in str(e) and "waits in all_reduce" in str(e)
    assert "next %%ranks cell starts 2 new ranks" in str(e)
    assert wait_gone(pids) == []
    assert cell(shell, "2", "rank") is None
    assert "new ranks: the previous ones were stopped because a collective was left half-done" \
        in capsys.readouterr().out


@pytest.mark.parametrize("how, phrase", [("os._exit(3)", "exited with code 3"),
                                         ("os.kill(os.getpid(), 9)", "killed by SIGKILL")])
def test_a_dead_rank_is_named(pool, how, phrase):
    pids = pool.pids
    with pytest.raises(RankFailed) as info:
        pool.run_cell(f"import os\nif rank == 1:\n    {how}\ndist.barrier()")
    assert info.value.rank == 1 and phrase in str(info.value)
    assert pool.broken == "rank 1 died"
    assert wait_gone(pids) == []


def test_a_hang_hits_the_cells_timeout_with_where_each_rank_waits(pool):
    pids = pool.pids
    with pytest.raises(RunTimeout) as info:
        pool.run_cell("import time\nif rank == 0:\n    time.sleep(60)\ndist.barrier()", timeout=1)
    text = str(info.value)
    assert text.startswith("%%ranks timed out after 1 s: ranks 0 and 1 still running.")
    assert "rank 0: is at line 3: time.sleep(60)" in text
    assert "rank 1: waits in barrier" in text and "%%ranks 2 --timeout 120" in text
    assert wait_gone(pids) == []


def interrupt_soon():
    threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGINT)).start()


def test_an_interrupt_in_python_stops_the_cell_and_keeps_the_state(pool):
    pool.run_cell("x = rank")
    interrupt_soon()
    with pytest.raises(KeyboardInterrupt, match="every rank stopped the cell"):
        pool.run_cell("import time\ntime.sleep(30)")
    assert not pool.broken and pool.pull("x") == [0, 1]


def test_an_interrupt_kills_ranks_stuck_in_a_collective(pool):
    pids = pool.pids
    interrupt_soon()
    with pytest.raises(KeyboardInterrupt, match="rank 1 did not stop"):
        pool.run_cell("import time\nif rank == 0:\n    time.sleep(30)\ndist.barrier()")
    assert pool.broken and wait_gone(pids) == []


def test_ranks_end_when_the_notebook_goes_away_even_in_the_middle_of_a_cell(pool):
    pids = pool.pids
    for r in pool.ranks:                       # what a kernel that dies leaves: closed pipes
        r.cmd.send(("cell", "import time\ntime.sleep(60)", "<cell>", {}, None, 1))
    for r in pool.ranks:
        r.cmd.close()
        r.cmd = None
    assert wait_gone(pids) == []


def test_stop_leaves_no_process(shell, capsys):
    cell(shell, "2", "pass")
    pids = distlab.ranks.pool().pids
    shell.run_line_magic("ranks", "stop")
    assert "ranks stopped" in capsys.readouterr().out and wait_gone(pids) == []


def test_emulated_cells_print_modeled_time_and_keep_a_trace(shell, capsys):
    e = cell(shell, "2 --emulate a100-nvlink",
             "t = torch.ones(1 << 20)\ndist.all_reduce(t)\nround(distlab.trace.now() * 1e6)")
    assert e is None
    out = capsys.readouterr().out
    assert "emulated" in out and out.count("[rank") == 2
    trace = distlab.ranks.pool().trace
    assert trace.counts() == {"all_reduce": 2}
    assert trace.comm(0, "all_reduce")[0]["bytes"] == 4 << 20


def test_a_traced_cell_keeps_its_trace_and_exports_it_for_perfetto(shell, capsys, tmp_path):
    import json
    assert cell(shell, "2", "x = torch.ones(8)") is None           # an untraced cell first
    with pytest.raises(RuntimeError, match="no traced cell yet"):
        shell.run_line_magic("ranks", "trace")
    assert cell(shell, "2 --trace", "dist.all_reduce(x)\nif rank == 0:\n    dist.send(x, 1)\n"
                "else:\n    dist.recv(x, 0)") is None
    assert "emulated" not in capsys.readouterr().out                 # traced, not modeled
    trace = shell.run_line_magic("ranks", "trace")
    assert trace.counts() == {"all_reduce": 2, "send": 1, "recv": 1} and not trace.emulated
    assert shell.run_line_magic("ranks", "pull x")[0].tolist() == [2.0] * 8   # state kept
    doc = json.loads(open(trace.save(tmp_path / "cell.json")).read())
    flows = [e for e in doc["traceEvents"] if e.get("ph") in ("s", "f")]
    assert sorted(e["ph"] for e in flows) == ["f", "s"]              # the send's arrow
    cell(shell, "2", "pass")                                          # untraced again: no trace
    with pytest.raises(RuntimeError, match="no traced cell yet"):
        shell.run_line_magic("ranks", "trace")


def test_bad_arguments_are_refused_with_a_sentence(shell):
    with pytest.raises(ValueError, match="needs the number of ranks"):
        shell.run_cell_magic("ranks", "four", "pass")
    with pytest.raises(ValueError, match="world_size must be at least 1"):
        shell.run_cell_magic("ranks", "0", "pass")
    with pytest.raises(ValueError, match="timeout must be a positive number"):
        shell.run_cell_magic("ranks", "2 --timeout -1", "pass")
    with pytest.raises(ValueError, match="takes `stop`, `pull NAME` or `trace`"):
        shell.run_line_magic("ranks", "push x")


# ---- no orphans: what a rank started ends with the ranks ----------------------------------------

def start_grandchildren(folder):
    """A cell that starts two `sleep 60` children on every rank, one in the rank's process group
    and one in a group of its own, and writes their pids into `folder`."""
    return (f"import os, pathlib, subprocess\n"
            f"kids = [subprocess.Popen(['sleep', '60']),\n"
            f"        subprocess.Popen(['sleep', '60'], process_group=0)]\n"
            f"for k, kid in enumerate(kids):\n"
            f"    (pathlib.Path({str(folder)!r}) / f'kid{{rank}}-{{k}}').write_text(str(kid.pid))\n")


def grandchild_pids(folder):
    return [int(p.read_text()) for p in sorted(folder.glob("kid*"))]


@pytest.fixture
def grandchildren(tmp_path):
    yield tmp_path
    for pid in grandchild_pids(tmp_path):     # never leave them behind, even when a test fails
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass


def test_ranks_stop_stops_what_the_ranks_started(shell, capsys, grandchildren):
    assert cell(shell, "2", start_grandchildren(grandchildren)) is None
    assert len(grandchild_pids(grandchildren)) == 4
    shell.run_line_magic("ranks", "stop")
    capsys.readouterr()
    assert wait_gone(grandchild_pids(grandchildren), seconds=5) == []


def test_what_a_dead_rank_started_is_stopped_with_the_ranks(pool, grandchildren):
    with pytest.raises(RankFailed, match="rank 1 exited with code 3"):
        pool.run_cell(start_grandchildren(grandchildren) +
                      "if rank == 1:\n    os._exit(3)\ndist.barrier()", timeout=5)
    assert pool.broken == "rank 1 died" and len(grandchild_pids(grandchildren)) == 4
    assert wait_gone(grandchild_pids(grandchildren), seconds=5) == []


def test_a_pool_stopped_by_hand_is_replaced_cleanly(shell, capsys):
    # distlab.ranks.pool().stop() closes the processes: neither the next cell nor %ranks stop
    # may trip over them ("process object is closed").
    assert cell(shell, "2", "x = 1") is None
    pids = distlab.ranks.pool().pids
    distlab.ranks.pool().stop()
    assert wait_gone(pids) == []
    assert cell(shell, "2", "'x' in globals()") is None
    out = capsys.readouterr().out
    assert "the previous ones were stopped, and their variables" in out
    assert out.endswith("[rank 1] False\n")
    distlab.ranks.pool().stop()
    distlab.ranks.pool().stop()                         # twice is harmless
    shell.run_line_magic("ranks", "stop")
    assert "no ranks were running" in capsys.readouterr().out
    assert cell(shell, "2", "rank") is None
    assert capsys.readouterr().out.endswith("[rank 0] 0\n[rank 1] 1\n")


def test_more_ranks_than_the_emulated_cluster_has_are_refused_before_anything_starts(shell):
    assert cell(shell, "2", "kept = rank + 1") is None
    pids = distlab.ranks.pool().pids
    with pytest.raises(ValueError, match=r"has 8 GPUs .*world_size=9 needs more"):
        shell.run_cell_magic("ranks", "9 --emulate a100-nvlink", "pass")
    assert distlab.ranks.pool().pids == pids
    assert shell.run_line_magic("ranks", "pull kept") == [1, 2]


def test_a_bad_emulate_name_is_refused_before_the_running_ranks_are_touched(shell, capsys):
    assert cell(shell, "2", "kept = rank + 1") is None
    pids = distlab.ranks.pool().pids
    with pytest.raises(ValueError, match="emulate must be the name of a preset"):
        shell.run_cell_magic("ranks", "3 --emulate a_laptop", "pass")   # 3: would restart them
    assert distlab.ranks.pool().pids == pids and not distlab.ranks.pool().broken
    assert shell.run_line_magic("ranks", "pull kept") == [1, 2]
    assert "restarting" not in capsys.readouterr().out
