"""What workbook 11's checks share: what is refused inside a rank, and the launch."""
import contextlib

import torch

from ... import debug, models
from ...launch import RankFailed, RunTimeout
from .. import CheckFailed, forbid, run_learner
from ..ch01 import learner_run, no_object_collectives


WORLD_SIZES = (2, 3)       # even and odd: what a fix must survive; 4 catches nothing 3 misses
TIMEOUT = 60


def _course_code():
    """The course's answers to this workbook's bugs: the detectors and the hand-written loop."""
    return (debug.average_gradients, debug.broadcast_parameters, debug.checksums,
            debug.replicas_out_of_sync, debug.sample_fingerprints, debug.duplicated_samples,
            debug.gradient_scale, debug.train_data_parallel, debug.reference, debug.problem,
            debug.contiguous_shard, models.regression_data, models.batches_of, models.make_mlp,
            models.train_reference)


@contextlib.contextmanager
def _refused(exercise, *helpers):
    """The course's code and this checker's data builders (`helpers`) refused; its
    answer-building helpers (_expected_*, _*reference*) the framework refuses by default; and
    torch's object collectives, as chapter 02's checkers refuse them."""
    with forbid(*_course_code(), *helpers, exercise=exercise), _no_object_collectives():
        yield


def _no_object_collectives():
    """torch's object collectives (all_gather_object, gather_object, broadcast_object_list,
    scatter_object_list, send_object_list, recv_object_list) refused inside a rank, as chapter
    02's checkers refuse them: they pickle Python objects, send them as byte tensors and unpickle
    them, with a host sync each; what travelled is then a pickle, not the tensors the exercise is
    about, and no rule can say what it held."""
    return no_object_collectives(
        reason=lambda fn: (f"your function used dist.{fn.__name__}, which pickles Python objects "
                           f"into byte tensors; send the tensors themselves with tensor "
                           f"collectives (all_reduce, all_gather, broadcast) or send/recv."))


def _run(fn, world_size, name, *args, **kwargs):
    try:
        return run_learner(fn, world_size, *args, name=name, timeout=TIMEOUT, **kwargs)
    except RunTimeout as e:
        where = "; ".join(line.strip() for line in str(e).splitlines()[1:1 + world_size])
        raise CheckFailed(f"{name} hung with world_size={world_size} ({where}): every rank must "
                          f"call the same collectives.") from None
    except RankFailed as e:
        if not e.peer_lost:
            raise
        # A rank that skipped the collective finished and closed its connections under the
        # ranks still waiting in it: a hang that ended early.
        raise CheckFailed(f"{name} with world_size={world_size}: rank {e.rank} waited in a "
                          f"collective that another rank never called (that rank finished and "
                          f"left): every rank must call the same collectives.") from None


def _traced(fn, world_size, name, *args, rule):
    return learner_run(fn, world_size, *args, name=name, timeout=TIMEOUT, hang_rule=rule)


def _plain(value):
    if isinstance(value, torch.Tensor):
        return value.item() if value.numel() == 1 else value.tolist()
    if isinstance(value, (tuple, list)):
        return [_plain(v) for v in value]
    return value


def _close(a, b):
    return torch.allclose(a, b, atol=1e-10, rtol=1e-9)
