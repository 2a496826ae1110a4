"""Workbook 12, exercise 1: the online softmax, as a flash kernel streams it."""
import math

import torch

from .. import CheckFailed, call_learner, compare, first_difference, forbid, passed
from ._common import COURSE


def _fold_cases():
    """[(what, scores, v, blocks)]: scores (..., q, keys) with -inf where masked, split into
    blocks of keys. Row 0's maximum is in the last block; row 1 sees no key at all; row 2 sees
    none in the first block; row 3's last key scores 800 above the rest (a fold that keeps its
    first maximum as the reference overflows)."""
    g = torch.Generator().manual_seed(21)
    cases = []
    for shape, blocks, shift in ((((1, 2), 4, 3), (3, 1, 4, 2), 0.0),
                                 (((2, 1), 4, 5), (1, 5, 2), 0.0),
                                 (((1, 3), 5, 2), (2, 2, 3), 1000.0)):
        lead, n_q, d_v = shape
        n_k = sum(blocks)
        scores = 3 * torch.randn(*lead, n_q, n_k, generator=g, dtype=torch.float64) + shift
        scores[..., 0, -1] += 25.0                              # row 0: its max comes last
        scores[..., 1, :] = -math.inf                           # row 1: sees nothing
        scores[..., 2, : blocks[0]] = -math.inf                 # row 2: nothing in block 1
        scores[..., 3, -1] += 800.0                             # row 3: a jump past exp's range
        v = torch.randn(*lead, n_k, d_v, generator=g, dtype=torch.float64)
        what = (f"scores {tuple(scores.shape)} in blocks of {list(blocks)} keys"
                + (f", scores of about {shift:.0f}" if shift else ""))
        cases.append((what, scores, v, blocks))
    return cases


def _softmax_reference(scores, v):
    lse = torch.logsumexp(scores, dim=-1)
    p = torch.exp(scores - torch.where(torch.isinf(lse), 0.0, lse).unsqueeze(-1))
    return p @ v, lse


def _start(scores, v):
    lead = scores.shape[:-1]
    return (torch.zeros(*lead, v.shape[-1], dtype=v.dtype), torch.full(lead, -math.inf,
            dtype=scores.dtype), torch.zeros(lead, dtype=scores.dtype))


def _state_ok(state, scores, v, where):
    lead = tuple(scores.shape[:-1])
    shapes = (lead + (v.shape[-1],), lead, lead)
    if (not isinstance(state, (tuple, list)) or len(state) != 3
            or not all(torch.is_tensor(t) and tuple(t.shape) == s for t, s in zip(state, shapes))):
        raise CheckFailed(f"fold {where} should return the state (acc, m, l) with shapes "
                          f"{[s for s in shapes]} — the output so far, unnormalised, the running "
                          f"maximum and the running sum — and nothing that grows with the keys; "
                          f"got {state!r:.80}.")
    return tuple(state)


def _learner_fold(fold, state, scores, v, where):
    with forbid(*COURSE, exercise="write the online softmax yourself"):
        got = call_learner(fold, state, scores.clone(), v.clone(), name="fold")
    return _state_ok(got, scores, v, where)


def check_online_softmax(fold, finish):
    """fold((acc, m, l), scores, v) -> (acc, m, l) folds a block of keys into the running state;
    finish((acc, m, l)) -> (out, lse): softmax(all scores) @ all v and the log-sum-exp."""
    cases = _fold_cases()
    states = [_start(scores, v) for _, scores, v, _ in cases]
    cuts = [[0, *torch.tensor(blocks).cumsum(0).tolist()] for _, _, _, blocks in cases]
    # The cases' blocks folded in turn, interleaved: a fold that keeps anything beyond its state
    # mixes the sequences.
    for step in range(max(len(b) for _, _, _, b in cases)):
        for i, (what, scores, v, blocks) in enumerate(cases):
            if step >= len(blocks):
                continue
            a, b = cuts[i][step], cuts[i][step + 1]
            states[i] = _learner_fold(fold, states[i], scores[..., a:b], v[..., a:b, :],
                                      f"on {what}, block {step + 1}")
    for (what, scores, v, blocks), state in zip(cases, states):
        with forbid(*COURSE, exercise="write the online softmax yourself"):
            got = call_learner(finish, state, name="finish")
        if not isinstance(got, (tuple, list)) or len(got) != 2:
            raise CheckFailed(f"finish should return (out, lse); got {got!r:.80}.")
        out, lse = got
        want_out, want_lse = _softmax_reference(scores, v)
        where = f"on {what}"
        if not (torch.is_tensor(out) and torch.is_tensor(lse) and out.shape == want_out.shape
                and lse.shape == want_lse.shape):
            raise CheckFailed(f"finish {where} should return out {tuple(want_out.shape)} and lse "
                              f"{tuple(want_lse.shape)}; got {out!r:.60} and {lse!r:.60}.")
        finite = torch.isfinite(want_lse)
        bad = [r for r in range(scores.shape[-2])
               if not torch.isfinite(out[..., r, :]).all() or torch.isnan(lse[..., r]).any()
               or (torch.isinf(lse[..., r]) & finite[..., r]).any()]
        if bad and bad[0] in (1, 2):
            which = "no key" + (" in the first block" if bad[0] == 2 else "")
            came = "nan" if torch.isnan(out[..., bad[0], :]).any() else "inf"
            raise CheckFailed(
                f"{where}: row {bad[0]} (which sees {which}) came out {came}. A row that has "
                f"seen no key yet has m = -inf, and exp(-inf - (-inf)) is nan: where the new "
                f"maximum is -inf, rescale by 0 (nothing was accumulated), and finish a row "
                f"with l = 0 as output 0, lse -inf.")
        if bad:
            raise CheckFailed(
                f"{where}: row {bad[0]} came out inf or nan: one of its scores is 800 above the "
                f"others, and exp of a difference above 709 overflows float64. Exponentiate "
                f"scores minus the running maximum — the largest score seen so far — only.")
        compare(lse, want_lse, f"finish's lse {where} (the log of the whole softmax "
                f"denominator)", atol=1e-10, rtol=1e-12)
        seen = [r for r in range(scores.shape[-2]) if r != 1]       # row 1 saw no key
        scale = ((out * want_out).sum(-1) / (want_out * want_out).sum(-1).clamp_min(1e-300))
        if (torch.allclose(out[..., seen, :], scale[..., seen, None] * want_out[..., seen, :],
                           atol=1e-10, rtol=1e-8)
                and not torch.allclose(scale[..., seen], torch.ones_like(scale[..., seen]))):
            raise CheckFailed(
                f"{where}: every output row points the right way but has the wrong length (row "
                f"0 is {scale.reshape(-1, scale.shape[-1])[0, 0].item():.3g} times the softmax's): "
                f"acc is not normalised — finish divides it by the softmax's denominator, l.")
        if first_difference(out[..., 0, :], want_out[..., 0, :], 1e-10, 1e-10):
            raise CheckFailed(
                f"{where}: row 0 is wrong — its maximum arrives in the last block. When a block "
                f"raises a row's maximum from m to m', what was accumulated so far was weighted "
                f"by exp(score − m): rescale both acc and l by exp(m − m') before adding the "
                f"block.")
        compare(out, want_out, f"finish's output {where} (softmax of all the scores times v)",
                atol=1e-10, rtol=1e-10)
    passed("fold and finish stream a softmax exactly, block by block — rows whose maximum "
           "arrives last, rows that see nothing, or nothing at first, and scores of about a "
           "thousand — on 3 shapes folded interleaved, the state never larger than one output "
           "row, one maximum and one sum per query.")
