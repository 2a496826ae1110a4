"""What workbook 06's checkers share: the exercises' model and sizes, the launch that turns gloo's
and the learner's errors into one sentence, and the checkers' recorder of what each call carried."""
import re

from ...launch import RankFailed
from ...sharding import ZeRO, gather_flat
from .. import CheckFailed, _traffic, run_learner

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


class _Collectives(_traffic.Carried):
    """The checkers' traffic recorder (`_traffic.Carried`) inside a rank: for every collective and
    message this rank makes, its op and a flat copy of what this rank PUTS IN (its all-gather
    piece, its reduce-scatter input, its all-reduce tensor, a message's payload); `phase` is
    stamped on each record. `calls`: [(phase, op, values)]."""

    @property
    def calls(self):
        return [(r["phase"], r["op"], r["values"]) for r in self.records]
