"""Workbook 11, exercise 1: logging without a hang — the mean loss and the worst rank."""
import os

import torch

from .. import CheckFailed, compare, passed, sizes_phrase
from ._common import WORLD_SIZES, _plain, _refused, _run


REPORT_CASES = ("every rank's loss different", "a tie for the largest loss")


def _report_losses(world_size, seed):
    """Per case, every rank's loss: drawn afresh for each check, so no answer can be typed in."""
    g = torch.Generator().manual_seed(seed)
    distinct = (torch.randperm(10 * world_size, generator=g)[:world_size] + 1).double() / 4
    tie = distinct.clone()
    top = distinct.max() + 1
    tie[0] = tie[world_size - 1] = top      # rank 0 and the last share the largest loss
    return [distinct.tolist(), tie.tolist()]


def _expected_report(losses):
    worst = max(losses)
    return sum(losses) / len(losses), losses.index(worst)


def _report_on_ranks(rank, world_size, fn, cases):
    answers = []
    for losses in cases:
        loss = torch.tensor(losses[rank], dtype=torch.float64)
        with _refused("combine the ranks' losses yourself", _report_losses):
            got = fn(loss, rank, world_size)
        answers.append(_plain(got))
    return answers


def check_loss_report(fn, seed=None):
    """fn(loss, rank, world_size) -> (mean loss, rank with the largest loss), on every rank."""
    name = getattr(fn, "__name__", "loss_report")
    seed = int.from_bytes(os.urandom(4), "little") if seed is None else seed
    for ws in WORLD_SIZES:
        cases = _report_losses(ws, seed + ws)
        got = _run(_report_on_ranks, ws, name, fn, cases)
        for case, losses in zip(REPORT_CASES, cases):
            mean, worst = _expected_report(losses)
            for rank in range(ws):
                answer = got[rank][REPORT_CASES.index(case)]
                where = f"{name} with world_size={ws}, case '{case}', rank {rank}"
                if not (isinstance(answer, (tuple, list)) and len(answer) == 2):
                    raise CheckFailed(f"{where}: return a pair (mean loss, worst rank); got "
                                      f"{answer!r}.")
                compare(answer[0], mean, f"{where}: the mean loss", 1e-12, 1e-12)
                if answer[1] != worst:
                    raise CheckFailed(
                        f"{where}: worst rank {answer[1]!r}, expected {worst} (the losses were "
                        f"{[round(v, 4) for v in losses]}; on a tie the lowest rank). Every rank "
                        f"must reach the same answer from the same collectives.")
    passed(f"{name} gives every rank the mean loss and the worst rank (ties included), on "
           f"{sizes_phrase(WORLD_SIZES)} ranks, without a hang.")
