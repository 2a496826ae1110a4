"""Calling and running the learner's function: stubs, refusals and deadlocks as one sentence."""
import functools
import inspect
import math
import types

from ..launch import RankFailed, RunTimeout
from ..launch import run as _launch_run
from .._stub import MESSAGE as _STUB_MESSAGE
from ._forbid import forbid
from ._hangs import _ranks_phrase, hang_advice, where_ranks_wait
from ._verdict import CheckFailed, UsedCourseCode


def run(fn, world_size, *args, **kwargs):
    """distlab.run as the learner's own cells run it: with one GPU per rank that is
    "cpu:gloo,cuda:nccl", so the checkers' CPU tensors go over gloo and the learner's CUDA tensors
    over NCCL, on the backend the learner's code will meet. A learner's function that still holds
    its exercise stub is named at once: launching ranks only for each to raise costs a learner
    (and CI's run of every unsolved workbook) a second or more per check."""
    stub = unsolved_stub(fn, *args, *kwargs.values())
    if stub is not None:
        raise _not_written(getattr(stub, "__name__", "your function"))
    return _launch_run(fn, world_size, *args, **kwargs)


def _holds_stub(code):
    return any(c == _STUB_MESSAGE or (isinstance(c, types.CodeType) and _holds_stub(c))
               for c in code.co_consts)


def unsolved_stub(*objects, _depth=2):
    """The first function among `objects` (or among the functions their closures hold: a
    checker's rank function wraps the learner's) whose code still raises the exercise stub."""
    for obj in objects:
        if isinstance(obj, functools.partial):
            obj = obj.func
        code = getattr(obj, "__code__", None)
        if not isinstance(code, types.CodeType):
            continue
        if _holds_stub(code):
            return obj
        cells = [c.cell_contents for c in (getattr(obj, "__closure__", None) or ())
                 if _has_contents(c)]
        found = _depth and unsolved_stub(*cells, _depth=_depth - 1)
        if found:
            return found
    return None


def _has_contents(cell):
    try:
        cell.cell_contents
    except ValueError:           # a closure variable not assigned yet
        return False
    return True


def _not_written(name):
    return NotImplementedError(
        f"{name} is not written yet: replace the `raise NotImplementedError` in it with your "
        f"code, then run this check again.")


def call_learner(fn, *args, name=None, **kwargs):
    """Call the learner's function in this process; a stub becomes a one-line NotImplementedError
    and a call of the course's own code a CheckFailed."""
    name = name or getattr(fn, "__name__", "your function")
    try:
        return fn(*args, **kwargs)
    except NotImplementedError:
        raise _not_written(name) from None
    except UsedCourseCode as e:
        raise CheckFailed(str(e)) from None


def learner_seconds(fn, name, *args, refused=(), shown=None):
    """Call the learner's time estimate with the course's cost functions `refused`, and return it
    as a float number of seconds, or say in one sentence why it is not one. `shown` names the
    call in that sentence (default: the function's name)."""
    with forbid(*refused, exercise="write the formula yourself"):
        got = call_learner(fn, *args, name=name)
    try:
        value = float(got)
    except (TypeError, ValueError):
        raise CheckFailed(f"{name} should return a number of seconds; got {got!r}.") from None
    if not math.isfinite(value) or value < 0:
        raise CheckFailed(f"{shown or name} returned {value!r}: a time is a finite number >= 0.")
    return value


def run_learner(fn, world_size, *args, name=None, timeout=30, deadlock_rule=None, **kwargs):
    """distlab.run the learner's function. A stub becomes a one-line NotImplementedError, a call
    of the course's own code a CheckFailed; with `deadlock_rule`, a run that hangs in the
    learner's code becomes a CheckFailed saying where each rank waits, and the rule."""
    name = name or getattr(fn, "__name__", "your function")
    if not callable(fn):
        raise TypeError(f"the check needs your function, e.g. check({name}); got {fn!r}.")
    try:
        return run(fn, world_size, *args, timeout=timeout, **kwargs)
    except RankFailed as e:
        if e.exc_type == "NotImplementedError":
            raise _not_written(name) from None
        if e.exc_type == UsedCourseCode.__name__:
            said = (str(e.exception) if e.exception is not None
                    else str(e).splitlines()[0].split(": ", 1)[1])
            raise CheckFailed(said) from None
        raise
    except RunTimeout as e:
        where = where_ranks_wait(e, world_size)
        if where is None:
            raise          # stuck before the learner's code ran: not the learner's deadlock
        if not deadlock_rule:
            # Still a RunTimeout (callers catch it), but worded for a check: its limit is not the
            # learner's to raise, so say what to change in the code instead.
            lines = str(e).splitlines()
            first = (f"{name} with world_size={world_size} did not finish within the check's "
                     f"{timeout:g} s: {_ranks_phrase(e.running)} still running.")
            kept = [line for line in lines[1:] if not line.startswith("A collective returns")]
            raise RunTimeout("\n".join([first, *kept, hang_advice(kept)]), e.running,
                             e.stacks) from None
        raise CheckFailed(f"{name} with world_size={world_size} deadlocked (no rank finished in "
                          f"{timeout:g} s): {where}. {deadlock_rule}") from None


def expect_arguments(fn, n_args, example, name=None):
    """The learner's function's name, or a one-sentence TypeError when it is not a function of
    `n_args` positional arguments (checked before any rank starts)."""
    name = name or getattr(fn, "__name__", "your function")
    if not callable(fn) or isinstance(fn, type):
        raise TypeError(f"the check needs your function, e.g. {example}; got {fn!r}.")
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        return name
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    if len(positional) != n_args and not any(p.kind == p.VAR_POSITIONAL for p in params):
        raise TypeError(f"{name} should take {n_args} arguments, as in {example}; it takes "
                        f"{len(positional)}.")
    return name
