"""Exercise 1 of workbook 05: average the gradients when the ranks hold DIFFERENT numbers of
samples, in one all-reduce per step.

The chapter's `average_gradients` divides the sum by N, which is the global mean only for equal
shards. With n_r samples on rank r and each rank's loss the mean over its own samples, the
global mean's gradient is sum_r n_r g_r / sum_r n_r: each rank's gradient weighted by its count,
and the total count is not known to any rank. The exercise asks for both in ONE message (the
count travels in the same flat tensor as the gradients), so the latency is paid once.

Judged per step and rank, by the checkers' one traffic rule: the messages of one all-reduce (one
all_reduce call, or one packed message per hop of a hand-written ring: `_traffic.messages`); what
travelled carried the gradients (their values, not a decoy of the right size: `_wire`); every
gradient equals one process's on the whole batch (float64); an equal-weight mean of the ranks'
means, and a total count fixed in advance, are named as such. The global batch differs from step to step and between world sizes (12, 11, 13
and 10 samples), so no constant total passes.
"""
import torch
import torch.nn.functional as F

from .. import CheckFailed, _traffic, passed, run_learner, sizes_phrase
from ._common import STEPS, _compare_step, _data, _model, _names, refuse_too, refused
from ._wire import Handles, Wire, delivered, missing_gradient, never_waited_sentence

# Rank r holds SHARDS[N][s][r] consecutive samples of global batch s: unequal on purpose, and
# each global batch of another size (12, 11, 13, 10, ...), so that no constant total passes.
SHARDS = {2: ((5, 7), (3, 8)), 3: ((2, 4, 7), (6, 1, 3)), 4: ((1, 2, 4, 6), (3, 3, 1, 4))}


def _slices(world_size, step):
    """(lo, hi) of every rank's samples in the data, at this step."""
    start = sum(sum(sizes) for sizes in SHARDS[world_size][:step])
    sizes = SHARDS[world_size][step]
    starts = [start + sum(sizes[:r]) for r in range(world_size)]
    return [(lo, lo + n) for lo, n in zip(starts, sizes)]


def _reference_uneven(world_size):
    """Per step: every rank's gradient of its own mean loss, and one process's gradient of the
    mean over the whole global batch (SGD follows the latter, as every correct answer does)."""
    model, (x, y) = _model(), _data()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    shards, whole = [], []
    for s in range(STEPS):
        slices = _slices(world_size, s)
        shards.append([torch.autograd.grad(F.mse_loss(model(x[lo:hi]), y[lo:hi]),
                                           list(model.parameters())) for lo, hi in slices])
        lo, hi = slices[0][0], slices[-1][1]
        opt.zero_grad()
        F.mse_loss(model(x[lo:hi]), y[lo:hi]).backward()
        whole.append([p.grad.clone() for p in model.parameters()])
        opt.step()
    return shards, whole


def check_uneven_average(fn, world_sizes=(2, 3)):
    """fn(model, n_local): after backward of this rank's mean loss over its n_local samples,
    make every p.grad the gradient of the mean over ALL the ranks' samples, with one all_reduce."""
    def learner(rank, world_size):
        from ... import _tracer
        events = _tracer._active.events
        model, (x, y) = _model(), _data()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        log = []
        with Wire() as wire, Handles():
            for s in range(STEPS):
                lo, hi = _slices(world_size, s)[rank]
                xb, yb = x[lo:hi], y[lo:hi]
                opt.zero_grad()
                F.mse_loss(model(xb), yb).backward()
                start, mark = len(events), wire.mark()
                with refused("average the gradients yourself"):
                    fn(model, hi - lo)
                mine = events[start:]
                log.append(dict(
                    native=any(e["native"] for e in mine),
                    unwaited=len(Handles.unwaited(mine)),
                    sent=wire.records[mark:],
                    grads=[p.grad.clone() if p.grad is not None else None
                           for p in model.parameters()]))
                opt.step()
        return log

    names = _names()
    for ws in world_sizes:
        got = run_learner(learner, ws, name=getattr(fn, "__name__", "average_uneven"),
                          timeout=60, trace=True)
        shards, expected = _reference_uneven(ws)
        for s in range(STEPS):
            for rank in range(ws):
                _judge_uneven_step(got[rank][s], expected[s], shards[s], SHARDS[ws][s], ws,
                                   rank, s, names)
            carried = missing_gradient(delivered([got[r][s]["sent"] for r in range(ws)]),
                                       expected[s], names)
            if carried:
                raise CheckFailed(
                    f"with world_size={ws}, step {s}: every rank ends with the right gradient, "
                    f"but what its calls delivered does not hold the gradient of {carried} "
                    f"(times any factor): the all-reduce must carry the ranks' own gradients — a "
                    f"decoy call, with the gradient computed some other way, does not count.")
    batches = [sum(sizes) for ws in world_sizes for sizes in SHARDS[ws]]
    passed(f"{getattr(fn, '__name__', 'average_uneven')} gives every rank the gradient of the "
           f"whole batch from unequal shards (global batches of "
           f"{', '.join(map(str, batches[:-1]))} and {batches[-1]} samples), in one all-reduce "
           f"per step that carries the gradients ({sizes_phrase(world_sizes)} ranks, "
           f"{STEPS} steps).")


def _judge_uneven_step(step, expected, shards, counts, ws, rank, s, names):
    where = f"with world_size={ws} (shards of {' / '.join(map(str, counts))} samples), rank " \
            f"{rank}, step {s}"
    if step["unwaited"]:
        raise CheckFailed(never_waited_sentence(where, step["unwaited"]))
    if step["native"]:
        raise CheckFailed(f"{where}: the gradients were all-reduced from C++ (torch's DDP or "
                          f"similar); the exercise is to send them yourself.")
    calls = _traffic.data_calls(step["sent"])
    if not calls:
        raise CheckFailed(f"{where} sent nothing: the ranks' gradients must be combined with an "
                          f"all_reduce.")
    # one all-reduce, by the one rule: its messages done as a ring, however written
    sent, one = _traffic.messages(calls), _traffic.ring_messages("all_reduce", ws)
    if sent > one:
        made = (f"made {len(calls)} all_reduce calls" if all(c["op"] == "all_reduce"
                                                              for c in calls)
                else f"sent {sent} messages (by {', '.join(sorted({c['op'] for c in calls}))}; "
                     f"one all-reduce done as a ring sends {one})")
        raise CheckFailed(
            f"{where} {made}; the exercise asks for one all-reduce per step: put every gradient "
            f"AND this rank's sample count into one flat tensor, so the latency is paid once.")
    got = step["grads"]
    equal_weight = [sum(g[i] for g in shards) / ws for i in range(len(names))]
    if all(isinstance(g, torch.Tensor) and torch.allclose(g, e, rtol=1e-9, atol=1e-12)
           for g, e in zip(got, equal_weight)):
        raise CheckFailed(
            f"{where}: every gradient is the plain mean of the ranks' gradients, each rank "
            f"weighted the same, but rank 0 holds {counts[0]} samples and rank {ws - 1} holds "
            f"{counts[-1]}: weight each rank's gradient by its sample count and divide by the "
            f"total count ({sum(counts)}), which only the all-reduce knows.")
    for total in {sum(counts) + d for d in (-2, -1, 1, 2)}:     # a count that is off
        scaled = [e * sum(counts) / total for e in expected]
        if all(isinstance(g, torch.Tensor) and torch.allclose(g, e, rtol=1e-9, atol=1e-12)
               for g, e in zip(got, scaled)):
            raise CheckFailed(
                f"{where}: every gradient is the count-weighted sum divided by {total}, but this "
                f"step's global batch holds {sum(counts)} samples (the batches differ from step "
                f"to step): divide by the total count the all-reduce delivers, not a number "
                f"fixed in advance.")
    _compare_step(got, expected, "the gradient", ws, rank, names, s)


refuse_too(_reference_uneven)
