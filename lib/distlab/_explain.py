"""Explaining how a run went wrong, in sentences a learner can act on.

The supervisor (`_supervise.py`) collects what each rank did — returned, raised (type, message,
traceback), died (exit code or signal, its last words on stderr), still running (a stack dump) —
and this module turns that into one `RankFailed` or `RunTimeout` that names the rank to look at.

The rule that matters most: when a rank dies without raising (os._exit, a segfault, SIGKILL from
the out-of-memory killer, a C++ abort inside gloo), the ranks waiting for it in a collective fail
with "Connection closed by peer". Those are messengers; the report names the DEAD rank.
"""
import os
import pickle
import re
import signal

from .diagnose import describe_stacks


class RankFailed(RuntimeError):
    """A rank raised an exception or died. `.rank`, `.exc_type`, `.remote_traceback`, `.exception`;
    `.peer_lost` is True when the error only says a peer vanished (the cause is elsewhere);
    `.exitcode` is the dead rank's exit code (negative: the signal), else None."""

    def __init__(self, message, rank, exc_type=None, remote_traceback="", exception=None,
                 peer_lost=False, exitcode=None):
        super().__init__(message)
        self.rank, self.exc_type = rank, exc_type
        self.remote_traceback, self.exception = remote_traceback, exception
        self.peer_lost, self.exitcode = peer_lost, exitcode


class RunTimeout(TimeoutError):
    """The ranks did not finish in time. `.running` lists the ranks still running, `.stacks` their dumps."""

    def __init__(self, message, running, stacks):
        super().__init__(message)
        self.running, self.stacks = running, stacks


# The parent hears of a death through the process sentinel, a little after it happened, while a
# survivor time-stamps its "Connection closed" error at once: give deaths this head start.
_DEATH_NOTICE_S = 0.2


def is_consequence(error):
    """Errors a rank gets because ANOTHER rank died in the middle of a collective."""
    text = error["message"]
    return any(s in text for s in ("Connection closed by peer", "Connection reset by peer",
                                   "Broken pipe", "connection closed", "Socket closed"))


def died(r):
    """The rank's process ended without reporting an error, before returning or badly after."""
    if r.exitcode is None or r.error is not None:
        return False
    return not r.returned or r.exitcode != 0


def explain_failure(ranks):
    """A RankFailed for the rank that caused the failure, or None when every rank is fine."""
    errors = [r for r in ranks if r.error is not None]
    dead = [r for r in ranks if died(r)]
    if not errors and not dead:
        return None
    # Culprits: ranks whose own code raised, and ranks that died; the earliest one first.
    culprits = [(r.error["time"], r) for r in errors if not is_consequence(r.error)]
    culprits += [(r.died_at - _DEATH_NOTICE_S, r) for r in dead]
    if culprits:
        r = min(culprits, key=lambda c: (c[0], c[1].rank))[1]
    else:
        r = min(errors, key=lambda o: (o.error["time"], o.rank))
    others = [o.rank for o in errors + dead if o is not r]
    if r in dead:
        return _died_message(r, ranks, others)
    return _raised_message(r, ranks, others)


def _raised_message(r, ranks, others):
    e = r.error
    note = ""
    if others:
        note = (f"\n(also stopped: {ranks_phrase(sorted(others))}, most likely because rank "
                f"{r.rank} failed)")
    exception = None
    if e["exception"] is not None:
        try:
            exception = pickle.loads(e["exception"])
        except Exception:
            pass
    first = f"rank {r.rank} raised {e['type']}: {e['message']}{note}"
    alone = _reached_alone(r, ranks)
    if alone:
        first = f"{alone}\n(gloo's own words, on rank {r.rank}: {e['message']})"
    # Everyone who failed only lost a peer, nobody died: blame whoever was still busy elsewhere.
    busy = [o.rank for o in ranks if o.error is None and not o.returned and o.exitcode is None]
    errors = [o for o in ranks if o.error is not None]
    if busy and all(is_consequence(o.error) for o in errors):
        who = ranks_phrase(busy)
        first = (f"{ranks_phrase([o.rank for o in errors])} lost the connection to a "
                 f"peer while {who} {'was' if len(busy) == 1 else 'were'} still running: "
                 f"{who} is the likely cause (check that every rank calls the same "
                 f"collectives, with the same shapes, in the same order).\n"
                 f"rank {r.rank} raised {e['type']}: {e['message']}")
    message = f"{first}\n\nTraceback from rank {r.rank}:\n{pretty_filenames(e['traceback'])}"
    return RankFailed(message, r.rank, e["type"], e["traceback"], exception,
                      peer_lost=is_consequence(e))


_TB_FRAME = re.compile(r'File "(?P<file>[^"]+)", line (?P<line>\d+), in (?P<func>\S+)\n'
                       r'(?:\s+(?P<source>[^\n]*)\n)?')


def _reached_alone(r, ranks):
    """'only rank 0 reached the barrier ...' when rank r lost its peers inside a collective
    because every other rank had returned without calling it (gloo then says only "Connection
    closed by peer ... GLHF"), else None."""
    if not is_consequence(r.error):
        return None
    others = [o for o in ranks if o is not r]
    if not others or not all(o.returned and o.error is None and not died(o) for o in others):
        return None
    frames = [m.groupdict() for m in _TB_FRAME.finditer(r.error["traceback"] or "")]
    calls = [i for i, f in enumerate(frames) if f["file"].endswith("distributed_c10d.py")
             and not f["func"].startswith("_")]
    if not calls:
        return None
    collective = frames[calls[0]]["func"]
    mine = [f for f in frames[:calls[0]] if not _plumbing(f["file"])]
    at = ""
    if mine and mine[-1]["source"]:
        at = f" at `{mine[-1]['source'].strip()}` ({mine[-1]['func']}, line {mine[-1]['line']})"
    what = "the barrier" if collective in ("barrier", "monitored_barrier") else collective
    they = "it" if len(others) == 1 else "they"
    return (f"only rank {r.rank} reached {what}{at}: "
            f"{ranks_phrase([o.rank for o in others])} had returned without calling it, so "
            f"rank {r.rank} waited alone until {they} left. A collective needs "
            f"every rank of its group: call it on every rank (look for it under `if rank == ...` "
            f"or after an early return), and keep only the printing on one rank.")


_HERE = os.path.dirname(os.path.abspath(__file__))
# The course's wrappers between a learner's line and torch: a stack read for the learner skips them.
_PLUMBING = {os.path.join(_HERE, f) for f in ("trace.py", "emulate.py")} | {
    os.path.join(_HERE, "checks", f) for f in ("__init__.py", "_verdict.py", "_learner.py",
                                               "_hangs.py", "_forbid.py")}
_PLUMBING_PACKAGES = (os.path.join(_HERE, "_tracer") + os.sep,)


def _ours(path):
    path = os.path.abspath(path)
    return path in _PLUMBING or path.startswith(_PLUMBING_PACKAGES)


def _plumbing(path):
    return _ours(path) or f"{os.sep}torch{os.sep}" in os.path.abspath(path)


def without_plumbing(stack):
    """A faulthandler dump without the frames of the course's own wrappers (the tracer's
    ProcessGroup methods): the innermost frame left is the learner's line that called torch."""
    return "\n".join(line for line in stack.splitlines()
                     if not (line.lstrip().startswith('File "') and
                             _ours(line.split('"')[1])))


def _died_message(r, ranks, others):
    if r.returned:
        first = (f"rank {r.rank} returned, then {exit_phrase(r.exitcode)} while the other ranks "
                 f"were still running.")
    else:
        first = (f"rank {r.rank} {exit_phrase(r.exitcode)} before its function returned, "
                 f"without raising a Python exception.")
    lines = [first]
    words = last_words(r)
    if words:
        lines.append(f"Its last words (stderr): {words}")
        if "size doesn't match" in words or "preamble.length" in words:
            lines.append("The ranks passed tensors of different sizes to the same collective "
                         "(or called different collectives): compare what each rank passes.")
    elif r.exitcode == -signal.SIGKILL:
        lines.append("SIGKILL is what the out-of-memory killer sends: a rank that uses too much "
                     "memory dies this way.")
    if others:
        lines.append(f"(also stopped: {ranks_phrase(sorted(others))}, because rank {r.rank} "
                     f"died: the ranks waiting for it in a collective lose their connection)")
    return RankFailed("\n".join(lines), r.rank, exitcode=r.exitcode)


def last_words(r):
    """What a C++ abort printed before the rank died (`what(): ...`), shortened; else ''."""
    text = bytes(r.out["err"]).decode(errors="replace")
    found = re.findall(r"what\(\):\s*(.+)", text)
    if not found:
        return ""
    words = re.sub(r"^\[enforce fail at [^\]]*\]\s*", "", found[-1].strip())
    return words[:300]


def explain_timeout(ranks, running, stacks, timeout):
    if not running:   # no rank had reported in yet: a machine too busy to start processes
        return RunTimeout(f"distlab.run timed out after {timeout:g} s before its ranks had "
                          f"started (a busy machine starts processes slowly): run it again, or "
                          f"pass a longer limit: distlab.run(..., timeout=120).", [], stacks)
    lines = [f"distlab.run timed out after {timeout:g} s: "
             f"{ranks_phrase([r.rank for r in running])} still running."]
    waiting = []
    for r in ranks:
        if r not in running:
            lines.append(f"  rank {r.rank}: finished")
        else:
            where = describe_stacks(without_plumbing(stacks.get(r.rank, '')))
            waiting += [r.rank] if where.startswith("waits in") else []
            lines.append(f"  rank {r.rank}: {where}")
    finished = [r.rank for r in ranks if r not in running]
    if finished and waiting and len(waiting) == len(running):
        lines.append(f"{ranks_phrase(finished)} finished while {ranks_phrase(waiting)} "
                     f"{'waits' if len(waiting) == 1 else 'wait'} in a collective: "
                     f"{'it' if len(finished) == 1 else 'they'} called fewer collectives, or "
                     f"passed a tensor of a different size.")
    lines.append("A collective returns only when every rank of its group has called it: check "
                 "that all ranks reach the same collectives in the same order. If the work is "
                 "just slow, pass a longer limit: distlab.run(..., timeout=120).")
    return RunTimeout("\n".join(lines), [r.rank for r in running], stacks)


def interrupted_message(stopped):
    if not stopped:
        return "distlab.run interrupted (every rank had already finished)."
    return f"distlab.run interrupted: stopped {ranks_phrase(stopped)}."


def ranks_phrase(ranks):
    ranks = list(ranks)
    if not ranks:
        return "no rank"
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    return "ranks " + ", ".join(map(str, ranks[:-1])) + f" and {ranks[-1]}"


def exit_phrase(code):
    if code is not None and code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        return f"was killed by {name}"
    return f"exited with code {code}"


def pretty_filenames(text):
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
