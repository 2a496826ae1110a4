"""The chapter's plain averaging, judged: every gradient replaced by its mean over the ranks, by
what the calls delivered. No workbook exercise asks for it any more (chapter 05 displays it); its
battery (tests/test_checks_ch05_10.py) keeps it honest. Workbook 05's exercise 2 is `arrival`."""
import torch
import torch.nn.functional as F

from ...data_parallel import shard_batch
from .. import CheckFailed, passed, run_learner, sizes_phrase
from ._common import (GLOBAL_BATCH, STEPS, _compare_steps, _data, _model, _names, _reference,
                      refused)
from ._wire import Handles, Wire, delivered, missing_gradient, never_waited_sentence


def check_average_gradients(fn, world_sizes=(2, 3, 4)):
    """fn(model): after backward, replace every p.grad by its mean over the ranks."""
    def learner(rank, world_size):
        from ... import _tracer
        events = _tracer._active.events
        model, (x, y) = _model(), _data()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        grads, sent, unwaited = [], [], []
        with Wire() as wire, Handles():
            for s in range(STEPS):
                xb = shard_batch(x[s * GLOBAL_BATCH:(s + 1) * GLOBAL_BATCH], rank, world_size)
                yb = shard_batch(y[s * GLOBAL_BATCH:(s + 1) * GLOBAL_BATCH], rank, world_size)
                opt.zero_grad()
                F.mse_loss(model(xb), yb).backward()
                start, mark = len(events), wire.mark()
                with refused("average the gradients yourself"):
                    fn(model)
                unwaited.append(len(Handles.unwaited(events[start:])))
                sent.append(wire.records[mark:])
                grads.append([p.grad.clone() if p.grad is not None else None
                              for p in model.parameters()])
                opt.step()
        return grads, sent, unwaited

    expected, _ = _reference()
    for ws in world_sizes:
        got = run_learner(learner, ws, name="average_gradients", timeout=120, trace=True)
        for rank in range(ws):
            for s, count in enumerate(got[rank][2]):
                if count:
                    raise CheckFailed(never_waited_sentence(
                        f"with world_size={ws}, rank {rank}, step {s}", count))
            _compare_steps(got[rank][0], expected, "the gradient", ws, rank, _names())
        _judge_carried([g[1] for g in got], expected, ws)
    passed(f"average_gradients gives every rank the gradient of the whole batch, on "
           f"{sizes_phrase(world_sizes)} ranks, two steps in a row.")


def _judge_carried(sent, expected, ws):
    """sent[rank][step]: that step's calls on that rank, with what each carried (`_wire`). Every
    rank already holds the right gradients; refuse a run whose calls did not carry them (a
    decoy), whichever way they went: all-reduces, an all-gather, a ring of send/recv."""
    names = _names()
    for s in range(STEPS):
        missing = missing_gradient(delivered([sent[r][s] for r in range(ws)]), expected[s], names)
        if missing:
            raise CheckFailed(
                f"with world_size={ws}, step {s}: every rank ends with the right gradients, but "
                f"what its calls delivered does not hold the gradient of {missing} (times any "
                f"factor): the all-reduce (or your messages) must carry the ranks' own gradients "
                f"— a decoy call, with the gradient computed some other way, does not count.")
