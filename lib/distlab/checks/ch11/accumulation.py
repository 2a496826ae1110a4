"""Workbook 11, exercise 2: gradient accumulation whose last micro-batch is short."""
import os

import torch
import torch.nn.functional as F

from ... import debug
from ... import trace as _trace
from .. import CheckFailed, _traffic, compare, passed, sizes_phrase
from ._common import WORLD_SIZES, _close, _refused, _traced


# Each rank accumulates over ACC_MICRO micro-batches of its own; the last one is short, and the
# ranks' last micro-batches differ in size (the end of an epoch). Sizes are drawn afresh at every
# check, so no constant N or weight can match; one case keeps every rank's total equal (where a
# per-rank normalisation happens to be right) and one does not.

ACC_MICRO, ACC_STEPS = 3, 2
ACC_CASES = ("every rank's last micro-batch equally short", "the ranks' last micro-batches differ")


def _acc_sizes(world_size, seed):
    """Per case, per rank, its micro-batch sizes: full ones of `m` samples, then a short one."""
    g = torch.Generator().manual_seed(seed)
    m = int(torch.randint(4, 7, (), generator=g))
    same = int(torch.randint(1, m, (), generator=g))
    short = torch.randperm(m - 1, generator=g)[:world_size] + 1
    if world_size > m - 1:                      # more ranks than short sizes: repeat, not equal
        short = torch.arange(world_size) % (m - 1) + 1
    return [[[m] * (ACC_MICRO - 1) + [same] for _ in range(world_size)],
            [[m] * (ACC_MICRO - 1) + [int(short[r])] for r in range(world_size)]]


def _acc_data(sizes, step):
    """Every rank's micro-batches of one step, cut from one global batch in rank order."""
    total = sum(sum(s) for s in sizes)
    g = torch.Generator().manual_seed(1000 + 17 * step + total)
    x = torch.randn(total, 16, generator=g, dtype=torch.float64)
    y = torch.randn(total, 4, generator=g, dtype=torch.float64)
    out, at = [], 0
    for rank_sizes in sizes:
        mine = []
        for n in rank_sizes:
            mine.append((x[at:at + n], y[at:at + n]))
            at += n
        out.append(mine)
    return out


def _accumulation_reference(sizes):
    """One process: the gradient of the mean loss over every sample of every rank, per step, and
    the parameters after ACC_STEPS steps of SGD."""
    model, _ = debug.problem()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    grads = []
    for step in range(ACC_STEPS):
        x = torch.cat([xb for rank in _acc_data(sizes, step) for xb, _ in rank])
        y = torch.cat([yb for rank in _acc_data(sizes, step) for _, yb in rank])
        opt.zero_grad()
        F.mse_loss(model(x), y).backward()
        grads.append([p.grad.clone() for p in model.parameters()])
        opt.step()
    return grads, [p.detach().clone() for p in model.parameters()]


def _micro_grads(model, micro_batches):
    """This rank's gradient of each micro-batch's own mean loss (to explain a wrong answer)."""
    out = []
    for x, y in micro_batches:
        model.zero_grad()
        F.mse_loss(model(x), y).backward()
        out.append([p.grad.clone() for p in model.parameters()])
    model.zero_grad(set_to_none=True)
    return out


def _accumulate_on_ranks(rank, world_size, fn, cases):
    answers = []
    for sizes in cases:
        model, _ = debug.problem()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        steps = []
        for step in range(ACC_STEPS):
            micro = _acc_data(sizes, step)[rank]
            parts = _micro_grads(model, micro)
            opt.zero_grad(set_to_none=True)
            with _trace.span("fix"), _refused("weigh the micro-batches and combine the ranks' "
                                              "gradients yourself", _acc_data, _acc_sizes), \
                    _traffic.Carried() as carried:
                fn(model, [(x.clone(), y.clone()) for x, y in micro])
            grads = [None if p.grad is None else p.grad.detach().clone()
                     for p in model.parameters()]
            steps.append({"grads": grads, "parts": parts, "sent": carried.records})
            if any(g is None for g in grads):
                break
            opt.step()
        answers.append({"steps": steps, "params": [p.detach().clone() for p in model.parameters()]})
    return answers


def check_accumulation(fn, seed=None):
    """fn(model, micro_batches) on every rank: forward and backward over this rank's micro-batches
    [(x, y), ...] (the last one short), then every rank's .grad is the gradient of the mean
    F.mse_loss over every sample of every rank's micro-batches: what one process gets on them."""
    name = getattr(fn, "__name__", "accumulate")
    seed = int.from_bytes(os.urandom(4), "little") if seed is None else seed
    names = [n for n, _ in debug.problem()[0].named_parameters()]
    for ws in WORLD_SIZES:
        cases = _acc_sizes(ws, seed + ws)
        got = _traced(_accumulate_on_ranks, ws, name, fn, cases, rule="every rank must call "
                      "the same collectives on the same tensors, in the same order.")
        for rank in range(ws):          # by the one traffic rule: messages count as calls
            calls = _traffic.data_calls(_traffic.records(got.trace, rank, "fix"))
            bad, what = _traffic.off_group(calls, tuple(range(ws)))
            if bad is not None:
                raise CheckFailed(f"{name} with world_size={ws}: rank {rank} made {what}; every "
                                  f"rank's samples are part of the global batch: combine over "
                                  f"all {ws} ranks.")
        refs = [_accumulation_reference(sizes) for sizes in cases]
        for c, (label, sizes) in enumerate(zip(ACC_CASES, cases)):
            want_grads, want_params = refs[c]
            where = (f"{name} with world_size={ws}, case '{label}' (micro-batches "
                     f"{' | '.join('+'.join(map(str, s)) for s in sizes)})")
            for step in range(ACC_STEPS):
                for rank in range(ws):
                    mine = got[rank][c]["steps"][step]["grads"]
                    if any(g is None for g in mine):
                        raise CheckFailed(f"{where}: rank {rank} has no gradient after your "
                                          f"function: run forward and backward on every "
                                          f"micro-batch inside it.")
                    if all(_close(m, w) for m, w in zip(mine, want_grads[step])):
                        continue
                    _explain_accumulation(where, step, rank, mine, want_grads[step],
                                          [r[c]["steps"][step]["parts"] for r in got], sizes)
            for rank in range(ws):
                compare(got[rank][c]["params"], want_params, f"{where}: rank {rank}'s parameters "
                        f"after {ACC_STEPS} steps", 1e-10, 1e-9)
        # what travelled, by the one rule: the global gradient among what the ranks' calls
        # delivered (an all-reduce's sum, an all-gather's pieces added up, a ring's chunks)
        for c, label in enumerate(ACC_CASES):
            for step in range(ACC_STEPS):
                pieces = _traffic.delivered({r: got[r][c]["steps"][step]["sent"]
                                             for r in range(ws)})
                missing = _traffic.missing(pieces, refs[c][0][step], names)
                if missing:
                    raise CheckFailed(
                        f"{name} with world_size={ws}, case '{label}', step {step}: every rank "
                        f"has the right gradient, but what the ranks' calls delivered does not "
                        f"hold the gradient of {missing} (times any factor): every rank's "
                        f"gradients are part of the answer, so send the gradients (an "
                        f"all-reduce), not the samples or a copy.")
    passed(f"{name} gives every rank the global batch's gradient with a short last micro-batch "
           f"(sizes drawn afresh; equal and unequal totals per rank), at world sizes "
           f"{sizes_phrase(WORLD_SIZES)}: training equals one process.")


def _explain_accumulation(where, step, rank, mine, want, parts, sizes):
    head = f"{where}: rank {rank}'s gradient at step {step}"
    ws = len(sizes)
    # the bug the workbook shows: each micro-batch weighted 1/K, then the ranks averaged
    plain = [sum(sum(p[i] for p in rank_parts) / len(rank_parts) for rank_parts in parts) / ws
             for i in range(len(want))]
    if all(_close(m, p) for m, p in zip(mine, plain)):
        raise CheckFailed(f"{head} weighs every micro-batch alike (1/{ACC_MICRO}); each "
                          f"micro-batch's loss is the mean over ITS samples and the last is "
                          f"shorter: weigh micro-batch i by n_i / N, N = every rank's samples.")
    per_rank = [sum(sum(p[i] * n for p, n in zip(rank_parts, s)) / sum(s)
                    for rank_parts, s in zip(parts, sizes)) / ws for i in range(len(want))]
    if all(_close(m, p) for m, p in zip(mine, per_rank)):
        raise CheckFailed(f"{head} weighs the micro-batches within each rank but then averages "
                          f"the ranks alike; the ranks hold different numbers of samples: divide "
                          f"by the global count N, not by each rank's own.")
    summed = [sum(sum(p[i] for p in rank_parts) for rank_parts in parts)
              for i in range(len(want))]
    if all(_close(m, p) for m, p in zip(mine, summed)):
        raise CheckFailed(f"{head} is the plain sum of every micro-batch's gradient: weigh "
                          f"micro-batch i by n_i / N before adding.")
    scale = debug.gradient_scale(mine, want)
    raise CheckFailed(f"{head} is {scale:.4g}x the global batch's gradient, not equal to it: the "
                      f"answer is the sum over every micro-batch of every rank of n_i / N times "
                      f"its gradient.")
