"""Refusing the course's own answers while the learner's function runs, however imported."""
import contextlib
import os
import re
import sys
import threading

from ._verdict import CheckFailed, UsedCourseCode


# A checker's private helpers that compute or build an answer (`_reference_*`, `*_expected*`,
# `_model`, `_data`): refused by default while the learner's function runs, when the learner's own
# code calls them (the checker's code, calling them inside the same block, is not refused).
_HELPER = re.compile(r"reference|expected|^_(model|data)$")
_LIB = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
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
