"""Where the ranks of a hung run wait (from their stack dumps), and what to change."""
import linecache
import os
import re

import torch


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
