"""Where `make test`'s time goes: CPU-seconds and wall seconds per test file or notebook.

A report, not an assertion (tests never assert on time). Registered by conftest.py in every
process (the xdist controller and each worker); `make test` ends with the ten largest consumers
and the total against the budget, so growth shows when it happens, not at the limit.

CPU counts the test process and everything it starts: its ranks (reaped by a forkserver that
lives on, so read from that process's cutime), kernels and torchrun workers. Per test:
    own CPU delta + reaped children's delta + for each descendant alive at the end, its
    (utime + stime + cutime + cstime) now minus at the start. A descendant alive at the start
    and gone at the end whose parent is still ours was reaped by that parent, whose total now
    holds all of it: its start figure is taken off. One whose parent went too (a kernel's
    forkserver, orphaned when the kernel exits) is lost to init: the figure misses its last
    test's share, an approximation that errs low.
"""
import json
import os
import resource
import time

import pytest

BUDGET_S = 600  # the test-time issue's budget for `make test` on 2 cores
KEY = "distlab_budget"
# Each file's wall seconds in the last measured run (`make test-times` rewrites it). Only the
# ORDER of the files comes from it: xdist hands files to workers in collection order, so the
# longest start first and the run does not end with one worker alone on a long file.
WALLS = os.path.join(os.path.dirname(__file__), "budget_walls.json")
_TICK = os.sysconf("SC_CLK_TCK")


def _children_of():
    kids = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        # fields[0] is the state, [1] the parent, [11:15] utime stime cutime cstime
        kids.setdefault(int(fields[1]), []).append(
            (int(name), sum(int(x) for x in fields[11:15]) / _TICK))
    return kids


def _descendants():
    """{pid: (cpu seconds so far, parent pid)} of every process below this one."""
    kids, out, todo = _children_of(), {}, [os.getpid()]
    while todo:
        parent = todo.pop()
        for pid, cpu in kids.get(parent, ()):
            out[pid] = (cpu, parent)
            todo.append(pid)
    return out


def _snapshot():
    me = resource.getrusage(resource.RUSAGE_SELF)
    ch = resource.getrusage(resource.RUSAGE_CHILDREN)
    return (time.monotonic(), me.ru_utime + me.ru_stime, ch.ru_utime + ch.ru_stime,
            _descendants())


def _cpu_between(a, b):
    ours = set(b[3]) | {os.getpid()}
    live = sum(cpu - a[3].get(pid, (0.0,))[0] for pid, (cpu, _) in b[3].items())
    reaped = sum(cpu for pid, (cpu, parent) in a[3].items()
                 if pid not in b[3] and parent in ours)
    return (b[1] - a[1]) + (b[2] - a[2]) + live - reaped


class Budget:
    def __init__(self, config):
        self.config = config
        self.files = {}          # file -> [cpu_s, wall_s, tests]
        self.tests = {}          # test id -> [cpu_s, wall_s] (in the JSON only)
        self.started = time.monotonic()
        self.procs = 0
        self.busy = []           # each worker's seconds from its start to its last test's end

    def _add(self, key, cpu, wall, n=1):
        row = self.files.setdefault(key, [0.0, 0.0, 0])
        row[0] += cpu
        row[1] += wall
        row[2] += n

    def pytest_collection_modifyitems(self, items):
        try:
            with open(WALLS) as f:
                walls = json.load(f)
        except (OSError, ValueError):
            return
        default = sorted(walls.values())[len(walls) // 2] if walls else 0
        first = {}
        for i, item in enumerate(items):
            first.setdefault(item.nodeid.split("::")[0], i)
        # files stay whole and in their own order inside (nbval's cells, module fixtures)
        items.sort(key=lambda it: (-walls.get(it.nodeid.split("::")[0], default),
                                   first[it.nodeid.split("::")[0]]))

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_protocol(self, item, nextitem):
        before = _snapshot()
        yield
        after = _snapshot()
        cpu, wall = max(0.0, _cpu_between(before, after)), after[0] - before[0]
        self._add(item.nodeid.split("::")[0], cpu, wall)
        self.tests[item.nodeid] = [round(cpu, 3), round(wall, 3)]

    def pytest_sessionfinish(self, session):
        out = getattr(self.config, "workeroutput", None)
        if out is not None:  # an xdist worker: hand the figures to the controller
            out[KEY] = json.dumps({"files": self.files, "tests": self.tests,
                                   "busy": time.monotonic() - self.started})

    @pytest.hookimpl(optionalhook=True)
    def pytest_testnodedown(self, node, error):
        self.procs += 1
        got = json.loads(node.workeroutput.get(KEY, "{}"))
        for key, (cpu, wall, n) in got.get("files", {}).items():
            self._add(key, cpu, wall, n)
        self.tests.update(got.get("tests", {}))
        if "busy" in got:
            self.busy.append(got["busy"])

    def pytest_terminal_summary(self, terminalreporter):
        if getattr(self.config, "workeroutput", None) is not None or not self.files:
            return
        wall = time.monotonic() - self.started
        cpu = sum(r[0] for r in self.files.values())
        tr = terminalreporter
        tr.section("where the time went (a report, not a test)")
        tr.write_line(f"{'CPU-s':>7} {'wall-s':>7} {'tests':>5}  file or notebook")
        for key, (c, w, n) in sorted(self.files.items(), key=lambda kv: -kv[1][0])[:10]:
            tr.write_line(f"{c:7.1f} {w:7.1f} {n:5d}  {key}")
        tr.write_line(
            f"total: {wall:.0f} s wall of the {BUDGET_S} s budget ({100 * wall / BUDGET_S:.0f} %), "
            f"{cpu:.0f} CPU-s in {len(self.files)} files and notebooks"
            + (f" over {self.procs} workers (each busy {', '.join(f'{b:.0f}' for b in sorted(self.busy))} s)"
               if self.procs else ""))
        if os.environ.get("DISTLAB_BUDGET_SAVE"):
            with open(WALLS, "w") as f:
                json.dump({k: round(r[1]) for k, r in self.files.items()}, f, indent=0,
                          sort_keys=True)
        path = os.environ.get("DISTLAB_BUDGET_JSON")
        if path:
            with open(path, "w") as f:
                json.dump({"wall_s": wall, "files": self.files, "tests": self.tests}, f, indent=1, sort_keys=True)
