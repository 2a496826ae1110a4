"""What the checkers of workbook 05 share: the global batch, the model, and the single-process
reference every data-parallel answer is compared with (float64, so that a real mistake cannot
hide in rounding)."""

import contextlib

import torch
import torch.nn.functional as F

from ... import models
from .. import CheckFailed, compare

STEPS = 2
GLOBAL_BATCH = 12        # divides by 1, 2, 3 and 4


def _data():
    x, y = models.regression_data(n=STEPS * GLOBAL_BATCH, seed=5)
    return x.double(), y.double()


def _model():
    return models.make_mlp(sizes=(16, 24, 20, 4), seed=3).double()


def _reference():
    """Gradients of every step, and parameters after every step, trained in one process."""
    model, (x, y) = _model(), _data()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    grads, params = [], []
    for s in range(STEPS):
        opt.zero_grad()
        F.mse_loss(model(x[s * GLOBAL_BATCH:(s + 1) * GLOBAL_BATCH]),
                   y[s * GLOBAL_BATCH:(s + 1) * GLOBAL_BATCH]).backward()
        grads.append([p.grad.clone() for p in model.parameters()])
        opt.step()
        params.append([p.detach().clone() for p in model.parameters()])
    return grads, params


def _compare_steps(got, expected, what, ws, rank, names):
    for s in range(STEPS):
        _compare_step(got[s], expected[s], what, ws, rank, names, s)


def _compare_step(got, expected, what, ws, rank, names, s):
    for name, g, e in zip(names, got, expected):
        if isinstance(g, torch.Tensor) and g.shape == e.shape and ws > 1 \
                and torch.allclose(g, e * ws, rtol=1e-9, atol=1e-12) \
                and not torch.allclose(g, e, rtol=1e-9, atol=1e-12):
            raise CheckFailed(
                f"with world_size={ws}, rank {rank} has the SUM of the ranks' gradients of "
                f"{name} at step {s}: divide by the world size to get their mean.")
        compare(g, e, f"with world_size={ws}, rank {rank}, step {s}, {what} of {name}",
                atol=1e-10, rtol=1e-9)


def _names():
    return [n for n, _ in _model().named_parameters()]


# The other checker modules' data and reference helpers, added by each as it is imported
# (ch05/__init__ imports them all before any check runs): they import this module, so it must not
# import them.
_HELPERS = []


def refuse_too(*helpers):
    _HELPERS.extend(helpers)


def _forbidden():
    """Refused inside the learner's function: the course's own data parallelism (also chapter
    11's copies in distlab.debug) and the checkers' own helpers, whose data, model and
    single-process references would let a rank compute the global gradient without
    communicating."""
    from ... import data_parallel, debug
    return (data_parallel.BucketedDDP, data_parallel.average_gradients,
            data_parallel.broadcast_parameters, data_parallel.predict_step,
            debug.average_gradients, debug.broadcast_parameters, debug.train_data_parallel,
            debug.reference, _reference, _data, _model, *_HELPERS)


@contextlib.contextmanager
def refused(exercise):
    """Inside a rank, while the learner's code runs: the course's own data parallelism and the
    checkers' helpers (`_forbidden`), and torch's object collectives (they pickle Python objects
    into byte tensors: what travels is then no gradient), each refused in one sentence, as
    chapter 02's checkers refuse them."""
    from .. import forbid
    from ..ch01 import no_object_collectives
    with forbid(*_forbidden(), exercise=exercise), \
            no_object_collectives(f"{exercise}, sending the tensors themselves"):
        yield
