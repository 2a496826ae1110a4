"""What workbook 06's checkers share: the exercises' model and sizes, the launch that turns gloo's
and the learner's errors into one sentence, and a recorder of what each collective carried."""
import re

import torch

from ...launch import RankFailed
from ...sharding import ZeRO, gather_flat
from .. import CheckFailed, run_learner

# Parameter counts 60, 10, 50, 5, 15, 3: none divides by both 2 and 3, so slices are padded.
SIZES, STEPS, BATCH, LR = (6, 10, 5, 3), 3, 12, 0.05
TIMEOUT = 60  # a learner's deadlock is reported (with where each rank waits) within this
# (generous: on a loaded 2-core machine a 3-rank launch alone has taken over 20 s)


def _course_code():
    return (ZeRO, ZeRO.step, ZeRO._reduce_scatter_grad, ZeRO._all_gather_param, ZeRO._gather,
            ZeRO._start_prefetch, ZeRO._make_grad_hook, gather_flat)


_PAD_RULE = ("every rank must pass tensors of the same size, so pad each slice to "
             "ceil(numel / world_size) elements (F.pad) before gathering or scattering and trim "
             "the padding after — the last ranks' slices are shorter when numel does not divide.")


def _run(rank_fn, ws, fn, name, rule=_PAD_RULE):
    """run_learner, traced; gloo's own words about mismatched calls become one sentence."""
    try:
        return run_learner(rank_fn, ws, fn, name=name, timeout=TIMEOUT, trace=True)
    except RankFailed as e:
        calls = re.findall(r"distributed_c10d\.py\", line \d+, in (\w+)", e.remote_traceback)
        # gloo's own words ("Connection reset by peer ... GLHF", or an abort when the sizes it
        # receives differ) say nothing a learner can use.
        aborted = e.exc_type is None and "SIGABRT" in str(e)
        if aborted or (calls and ("gloo" in str(e) or getattr(e, "peer_lost", False))):
            op = f"{calls[-1]} calls" if calls else "collectives"
            raise CheckFailed(f"with world_size={ws}, the ranks' {op} did not match (gloo "
                              f"failed on rank {e.rank}): {rule}") from None
        if e.exc_type == "CheckFailed" or isinstance(e.exception, CheckFailed):
            said = (str(e.exception) if e.exception is not None
                    else str(e).splitlines()[0].split(": ", 1)[-1])
            raise CheckFailed(said) from None
        if e.exc_type and _learners_frame(e.remote_traceback):
            # an error in the learner's own code: its one line, where it came from
            first = (str(e.exception) if e.exception is not None else str(e)).strip()
            first = first.splitlines()[0] if first else e.exc_type
            raise CheckFailed(f"{name} with world_size={ws}: rank {e.rank} raised "
                              f"{e.exc_type} in your code — {first}") from None
        raise


def _learners_frame(tb):
    """Whether a rank's traceback passes through code that is not the course's or torch's (the
    learner's cell or file)."""
    files = re.findall(r'File "([^"]+)"', tb or "")
    return any("distlab" not in f and "site-packages" not in f and "/lib/python" not in f
               for f in files)


def _kb(b):
    return f"{b:,.0f} B"


class _Collectives:
    """A dispatch mode that records, for every c10d collective this rank calls, its op and a
    flat copy of what this rank PUTS IN (its all-gather piece, its reduce-scatter input, its
    all-reduce tensor); `phase` is stamped on each record."""

    _INPUT = {"allgather_": ("all_gather", lambda a: a[1][0]),
              "_allgather_base_": ("all_gather", lambda a: a[1]),
              "allgather_into_tensor_coalesced_": ("all_gather", lambda a: torch.cat(
                  [t.reshape(-1) for t in a[1]])),
              "reduce_scatter_": ("reduce_scatter", lambda a: torch.cat(
                  [t.reshape(-1) for t in a[1][0]])),
              "_reduce_scatter_base_": ("reduce_scatter", lambda a: a[1]),
              "allreduce_": ("all_reduce", lambda a: torch.cat([t.reshape(-1) for t in a[0]]))}

    def __init__(self):
        from torch.utils._python_dispatch import TorchDispatchMode
        recorder = self
        self.calls, self.phase = [], None

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                name = str(func)
                if name.startswith("c10d."):
                    op = name.split(".")[1]
                    label, get = recorder._INPUT.get(op, (op.strip("_"), None))
                    values = get(args).detach().reshape(-1).clone() if get else None
                    recorder.calls.append((recorder.phase, label, values))
                return func(*args, **(kwargs or {}))
        self._mode = Mode()

    def __enter__(self):
        self._mode.__enter__()
        return self

    def __exit__(self, *exc):
        return self._mode.__exit__(*exc)
