"""Turn a rank's stack dump into one sentence: where it is and what it waits for.

On a timeout every rank still running dumps its threads with faulthandler (which works even while
the rank is blocked inside a C++ collective). A learner needs "rank 1 is at time.sleep(100), ranks
0 and 2 wait in all_reduce", not forty lines of frames.
"""
import linecache
import os
import re
import sysconfig

_FRAME = re.compile(r'^\s*File "(?P<file>.*)", line (?P<line>\d+) in (?P<func>\S+)')
_TORCH_DIR = None
_STDLIB = os.path.normcase(sysconfig.get_paths()["stdlib"])
_HERE = os.path.dirname(os.path.abspath(__file__))
_LAUNCHER_FILES = {os.path.join(_HERE, *f.split("/")) for f in (
    "_worker.py", "launch.py", "_supervise/__init__.py", "_supervise/starting.py",
    "_supervise/one_launch.py", "_payload.py", "_explain.py")}


def parse_threads(text):
    """[[(file, line, func), ...innermost first], ...] — one list per thread in the dump."""
    threads, current = [], None
    for line in text.splitlines():
        if line.startswith(("Thread ", "Current thread ")) or line.startswith("Stack (most"):
            current = []
            threads.append(current)
            continue
        m = _FRAME.match(line)
        if m and current is not None:
            current.append((m["file"], int(m["line"]), m["func"]))
    return threads


def _torch_dir():
    global _TORCH_DIR
    if _TORCH_DIR is None:
        import torch
        _TORCH_DIR = os.path.dirname(os.path.abspath(torch.__file__))
    return _TORCH_DIR


def _is_torch(file):
    return os.path.abspath(file).startswith(_torch_dir())


def _is_user(file):
    """Learner's code, notebook cells and course lib code; not torch, stdlib or the launcher."""
    path = os.path.abspath(file)
    if path in _LAUNCHER_FILES or _is_torch(file):
        return False
    if os.path.normcase(path).startswith(_STDLIB) and "site-packages" not in path:
        return False
    return True


def _where(frame):
    file, line, func = frame
    # A trailing comment is the author's note, not what the rank is doing.
    source = re.sub(r"\s+#[^'\"]*$", "", linecache.getline(file, line).strip())
    place = f"{func}, line {line}" if func != "<module>" else f"line {line}"
    return f"{place}: {source}" if source else f"{place} ({os.path.basename(file)})"


def describe_stacks(text):
    """One line for one rank, e.g. 'waits in all_reduce, called from fn, line 4: dist.all_reduce(t)'."""
    if not text.strip():
        return "did not answer the request for its stack (it may be busy in C code)"
    threads = parse_threads(text)
    # The thread running the learner's function is the one that passes through the launcher.
    main = next((t for t in threads if any(f[0] in _LAUNCHER_FILES for f in t)),
                threads[0] if threads else [])
    user = [i for i, f in enumerate(main) if _is_user(f[0])]
    if not user:
        return "is inside the launcher (starting or finishing)"
    innermost_user = user[0]
    inner = main[:innermost_user]
    # The torch.distributed call that the learner's line made, if it is blocked inside one.
    calls = [f for f in inner if f[0].endswith("distributed_c10d.py") and not f[2].startswith("_")]
    if calls:
        return f"waits in {calls[-1][2]}, called from {_where(main[innermost_user])}"
    if inner and any(_is_torch(f[0]) for f in inner):
        return f"is inside torch ({inner[0][2]}), called from {_where(main[innermost_user])}"
    return f"is at {_where(main[innermost_user])}"
