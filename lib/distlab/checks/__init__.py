"""Exercise checkers: run the learner's function for real, compare with the reference, and say in
one sentence what differs (which rank, which element, expected vs got) or that it passed.

Each chapter's checkers live in `distlab.checks.chNN`; this module holds what they share.
"""
import contextlib
import functools
import inspect
import linecache
import math
import numbers
import os
import re
import sys
import threading
import types

import torch

from ..launch import RankFailed, RunTimeout
from ..launch import run as _launch_run
from .._stub import MESSAGE as _STUB_MESSAGE


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


class CheckFailed(AssertionError):
    """The learner's answer differs from the reference; the message says where."""


class UsedCourseCode(CheckFailed):
    """The learner's function called the course's implementation instead of writing its own.
    A CheckFailed, so every refusal reaches the learner as a check's one sentence, however the
    checker called the learner (in this process or on ranks)."""


def passed(message):
    print(f"✅ {message}")


def first_difference(got, expected, atol=1e-6, rtol=1e-5, path=""):
    """None when `got` matches `expected`, else a phrase like 'element [3]: expected 6.0, got 3.0'."""
    where = f"element {path}" if path else "the value"
    if isinstance(expected, torch.Tensor):
        if not isinstance(got, torch.Tensor):
            return f"{where}: expected a tensor, got {type(got).__name__} {got!r}"
        if tuple(got.shape) != tuple(expected.shape):
            return f"{where}: expected shape {tuple(expected.shape)}, got {tuple(got.shape)}"
        g, e = got.detach().double(), expected.detach().double()
        bad = ~torch.isclose(g, e, atol=atol, rtol=rtol, equal_nan=True)
        if bad.any():
            index = tuple(int(i) for i in bad.nonzero()[0])
            label = f"{path}[{', '.join(map(str, index))}]" if index else path
            return f"element {label or '[]'}: " + _expected_got(e[index].item(), g[index].item())
        return None
    if isinstance(expected, (list, tuple)):
        if not isinstance(got, (list, tuple)):
            return f"{where}: expected a {type(expected).__name__}, got {type(got).__name__} {got!r}"
        if len(got) != len(expected):
            return f"{where}: expected {len(expected)} items, got {len(got)}"
        for i, (g, e) in enumerate(zip(got, expected)):
            found = first_difference(g, e, atol, rtol, f"{path}[{i}]")
            if found:
                return found
        return None
    if isinstance(expected, dict):
        if not isinstance(got, dict) or set(got) != set(expected):
            return f"{where}: expected keys {sorted(expected)}, got {got!r}"
        for k in expected:
            found = first_difference(got[k], expected[k], atol, rtol, f"{path}[{k!r}]")
            if found:
                return found
        return None
    if isinstance(expected, numbers.Real) and not isinstance(expected, bool):
        if isinstance(got, torch.Tensor) and got.numel() == 1:
            got = got.item()
        if not isinstance(got, numbers.Real) or isinstance(got, bool):
            return f"{where}: expected a number ({_fmt(expected)}), got {type(got).__name__} {got!r}"
        if not math.isclose(got, expected, rel_tol=rtol, abs_tol=atol):
            return f"{where}: " + _expected_got(expected, got)
        return None
    if got != expected:
        return f"{where}: expected {expected!r}, got {got!r}"
    return None


def _expected_got(expected, got):
    # Enough digits to see the difference: close values look identical at 6 digits.
    for digits in (6, 10, 17):
        e, g = f"{expected:.{digits}g}", f"{got:.{digits}g}"
        if e != g:
            break
    return f"expected {e}, got {g}"


def _fmt(x):
    return f"{x:.6g}" if isinstance(x, float) else repr(x)


def compare(got, expected, context, atol=1e-6, rtol=1e-5):
    """Raise CheckFailed('<context>, element [i]: expected .., got ..') when they differ."""
    found = first_difference(got, expected, atol, rtol)
    if found:
        if found.startswith("the value: "):
            raise CheckFailed(f"{context}: {found[len('the value: '):]}.")
        raise CheckFailed(f"{context}, {found}.")


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


_POINT_TO_POINT = ("send", "recv", "isend", "irecv", "batch_isend_irecv", "wait")


def hang_advice(rank_lines):
    """What to change when ranks hang, from the launcher's per-rank lines ('rank 0: waits in
    send, called from ...')."""
    waits = [re.search(r"waits in (\w+)", line) for line in rank_lines]
    ops = {m.group(1) for m in waits if m}
    if ops and ops <= set(_POINT_TO_POINT):
        return ("A blocking dist.send returns only once its peer has received the message: when "
                "every rank sends first, no rank reaches its recv. Post the send and the receive "
                "together (dist.isend and dist.irecv, then wait on both, or "
                "dist.batch_isend_irecv), or let even ranks send first and odd ranks receive "
                "first; and check that every send has a matching recv on the peer it names.")
    return ("A collective returns only when every rank of its group has called it: every rank "
            "must call the same collectives, in the same order, with tensors of the same size. "
            "Look for a collective under `if rank == ...`, after an early return, or in a loop "
            "whose length differs between ranks.")


def _ranks_phrase(ranks):
    from .._explain import ranks_phrase
    return ranks_phrase(sorted(ranks))


_FRAME = re.compile(r'File "(?P<file>[^"]+)", line (?P<line>\d+) in (?P<func>\S+)')
_LIB = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_TORCH = os.path.dirname(os.path.abspath(torch.__file__))


def _not_learner(path):
    return path.startswith((_LIB, _TORCH)) or "multiprocessing" in path or path == "<string>"


def where_ranks_wait(error, world_size):
    """'rank 0 waits in recv at `dist.recv(t, left)`; rank 1 ...' from a RunTimeout's stack
    dumps, or None when no rank is in the learner's code (the run was stuck somewhere else)."""
    phrases, in_learner = [], False
    for rank in range(world_size):
        if rank not in error.running:
            phrases.append(f"rank {rank} had finished")
            continue
        frames = _FRAME.findall((error.stacks or {}).get(rank, ""))   # most recent call first
        mine = next((i for i, (path, _, _) in enumerate(frames) if not _not_learner(path)), None)
        if mine is None:
            phrases.append(f"rank {rank} did not say where it waits")
            continue
        in_learner = True
        path, line, func = frames[mine]
        inner = [f for (p, _, f) in frames[:mine] if p.endswith("distributed_c10d.py")]
        called = inner[-1] if inner else (frames[mine - 1][2] if mine > 0 else "your code")
        source = linecache.getline(path, int(line)).split("  #")[0].strip()
        at = f"`{source}`" if source else f"line {line} of {func}"
        phrases.append(f"rank {rank} waits in {called} at {at}")
    return "; ".join(phrases) if in_learner else None


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


def check_on_ranks(fn, reference, world_sizes, args_for=lambda ws: (), name=None,
                   atol=1e-6, rtol=1e-5, timeout=30):
    """Run `fn` and `reference` on each world size with the same arguments; compare every rank."""
    name = name or getattr(fn, "__name__", "your function")
    for ws in world_sizes:
        args = args_for(ws)
        expected = run(reference, ws, *args, timeout=timeout)
        got = run_learner(fn, ws, *args, name=name, timeout=timeout)
        for rank in range(ws):
            compare(got[rank], expected[rank], f"{name} with world_size={ws}, rank {rank}",
                    atol, rtol)
    return world_sizes


def sizes_phrase(sizes):
    sizes = list(sizes)
    return ", ".join(map(str, sizes[:-1])) + f" and {sizes[-1]}" if len(sizes) > 1 else str(sizes[0])


# ---- refusing the course's own answers ---------------------------------------------------------

# A checker's private helpers that compute or build an answer (`_reference_*`, `*_expected*`,
# `_model`, `_data`): refused by default while the learner's function runs, when the learner's own
# code calls them (the checker's code, calling them inside the same block, is not refused).
_HELPER = re.compile(r"reference|expected|^_(model|data)$")
_CHECKS = os.path.dirname(os.path.abspath(__file__))
_REAL = {}


def _real(path):
    """os.path.realpath, cached: the profile hook asks it at every call."""
    try:
        return _REAL[path]
    except KeyError:
        _REAL[path] = found = path if path.startswith("<") else os.path.realpath(path)
        return found


_LIB_REAL, _CHECKS_REAL = _real(_LIB) + os.sep, _real(_CHECKS) + os.sep


def _identities(obj):
    """(real file, qualified name) of the code that IS `obj`: a reloaded module, or the same file
    loaded under another module name, compiles new code objects with these same two names."""
    if isinstance(obj, type):
        own = obj.__dict__
        names = [n for n in ("__init__", "__new__") if n in own]
        if not names and isinstance(own.get("forward"), staticmethod):   # an autograd Function
            names = ["forward"]
        targets = [getattr(own[n], "__func__", own[n]) for n in names]
    else:
        targets = [getattr(obj, "__func__", obj)]
    keys = []
    for t in targets:
        code = getattr(t, "__code__", None)
        if code is not None:
            keys.append((_real(code.co_filename), code.co_qualname))
    return keys


@contextlib.contextmanager
def forbid(*objects, exercise="write it yourself", helpers=True):
    """Inside a rank: make the course's own implementations (functions, classes, methods) raise
    UsedCourseCode while the learner's function runs, however they were imported.

    A function is refused by swapping its code object, so every reference to it (a name imported
    in the notebook, a module attribute, a bound method) refuses; a class by its __init__.
    Copies are refused by code identity: a profile hook, on only inside this block, refuses any
    call of code with the same file and qualified name (an `importlib.reload`ed module, the file
    loaded under another name, a function pickled by value). With `helpers`, the checkers' own
    answer-building helpers (`_reference_*`, `_pipe_expected`, `_model`, ...) are refused too
    when the learner's code calls them. A refusal the learner's code catches is raised again when
    the block ends.
    """
    saved, refused = [], {}
    for obj in objects:
        name = getattr(obj, "__qualname__", repr(obj))
        message = f"your function called the course's own {name}; the exercise is to {exercise}."
        for key in _identities(obj):
            refused[key] = message
        if isinstance(obj, type):
            saved.append((obj, "__init__", obj.__dict__.get("__init__")))
            obj.__init__ = _refusing_function(message)
        else:
            target = getattr(obj, "__func__", obj)
            saved.append((target, "__code__", target.__code__))
            target.__code__ = _refusing_code(message, target.__code__.co_freevars)
    caught, active = [], [True]     # a thread started in the block keeps the hook: `active`
    previous = sys.getprofile()
    previous_threads = threading.getprofile()

    def hook(frame, event, arg):
        if event == "call" and active:
            code = frame.f_code
            path = _real(code.co_filename)
            if path.startswith(_LIB_REAL):
                message = refused.get((path, code.co_qualname))
                if message is None and helpers and path.startswith(_CHECKS_REAL):
                    message = _helper_refusal(frame, code, exercise)
                if message is not None:
                    caught.append(message)
                    raise UsedCourseCode(message)   # the hook is off from here: `caught` holds it
        if previous is not None:
            previous(frame, event, arg)

    sys.setprofile(hook)
    threading.setprofile(hook)
    try:
        yield
    except CheckFailed:
        raise           # the refusal itself, or call_learner's sentence for it: one sentence
    except BaseException:
        if caught:      # the learner caught the refusal, then failed: the refusal is the cause
            raise UsedCourseCode(caught[0]) from None
        raise
    else:
        if caught:      # refused, and the learner's code caught the refusal and went on
            raise UsedCourseCode(caught[0]) from None
    finally:
        active.clear()
        sys.setprofile(previous)
        threading.setprofile(previous_threads)
        for obj, attr, value in reversed(saved):
            if attr == "__init__" and value is None:
                delattr(obj, "__init__")
            else:
                setattr(obj, attr, value)


def _helper_refusal(frame, code, exercise):
    """The sentence refusing a checker's helper called by the learner's code, else None."""
    name = code.co_qualname
    if "." in name or not _HELPER.search(name):
        return None
    caller = frame.f_back
    if caller is not None and _real(caller.f_code.co_filename).startswith(_LIB_REAL):
        return None                     # the course's own code uses its helper
    module = os.path.splitext(os.path.relpath(_real(code.co_filename), _LIB_REAL))[0]
    return (f"your function called the checker's own {name} (distlab/{module}.py), which "
            f"builds the answer it is compared with; the exercise is to {exercise}.")


def _refusing_code(message, freevars):
    """A code object that raises UsedCourseCode(message) whatever globals and closure it runs
    with: it may only replace the code of a function with the same free variables."""
    args = ", ".join(freevars)
    touch = f"        ({args},)\n" if freevars else ""
    source = (f"def outer({args}):\n"
              f"    def refused(*args, **kwargs):\n"
              f"{touch}"
              f"        raise __import__('distlab.checks', fromlist=['UsedCourseCode'])"
              f".UsedCourseCode({message!r})\n"
              f"    return refused\n")
    namespace = {}
    exec(source, {}, namespace)
    return namespace["outer"](*([None] * len(freevars))).__code__


def _refusing_function(message):
    code = _refusing_code(message, ())
    return type(_refusing_function)(code, {})
