"""Workbook 07, exercise 2: vocab-parallel cross-entropy, judged by its values and what it sends."""
import torch
import torch.nn.functional as F

from ... import trace as _trace
from .. import CheckFailed, _not_written, expect_arguments, forbid, passed, unsolved_stub
from ._common import TOL, _compare, _course_code, _returned_tensor, _run, _scaled
from ._groups import (LAYOUTS, _describe_calls, _group_of, _layouts_phrase, _my_group, _off_group,
                      _phase_calls)


# (tokens, vocabulary, logit offset) per group size: vocabularies that split unevenly (13 on 2,
# 20 on 3 as 7/7/6) and logits near 1000, where float64's exp overflows (above 709).
VOCAB_CASES = {2: ((4, 13, 0.0), (6, 16, 1000.0)), 3: ((5, 20, 1000.0), (3, 16, 0.0))}
VOCAB_LAYOUTS = LAYOUTS
PER_TOKEN = 3    # numbers per token a rank may send in forward: max, sum of exps, target logit


def _vocab_shards(vocab, ws):
    """[(start, size)] per rank: the first vocab % ws ranks hold one entry more."""
    sizes = [vocab // ws + (r < vocab % ws) for r in range(ws)]
    return [(sum(sizes[:r]), sizes[r]) for r in range(ws)]


def _reference_logits(tokens, vocab, offset, ws, seed):
    """Logits (small integers + offset), targets that hit the first and last entry and both sides
    of every shard boundary, and a weighting of the per-token losses."""
    g = torch.Generator().manual_seed(seed)
    z = offset + torch.randint(-12, 13, (tokens, vocab), generator=g).double()
    edges = [0, vocab - 1] + [s + d for s, _ in _vocab_shards(vocab, ws)[1:] for d in (-1, 0)]
    target = torch.tensor([edges[i % len(edges)] for i in range(tokens)])
    weighting = torch.randint(1, 4, (tokens,), generator=g).double()
    return z, target, weighting


def _vocab_rank(rank, ws, fn, name, layout):
    """The cases of this rank's group size, on its group; each group has logits of its own."""
    group, ranks, gi, r = _my_group(rank, layout)
    n = len(ranks)
    out = []
    for c, (tokens, vocab, offset) in enumerate(VOCAB_CASES[n]):
        z, target, weighting = _reference_logits(tokens, vocab, offset, n,
                                                 50 + 10 * n + c + 100 * gi)
        start, size = _vocab_shards(vocab, n)[r]
        shard = z[:, start:start + size].clone().requires_grad_()
        with _trace.span(f"forward {c}"):
            with forbid(*_course_code(), exercise="write the loss yourself"):
                loss = fn(shard, target.clone(), start, group)
            _returned_tensor(loss, (tokens,), f"{name}(logits_shard, target, vocab_start, group)",
                             " — one loss per token, the same on every rank (no mean, no sum)")
        with _trace.span(f"backward {c}"):
            with forbid(*_course_code(), exercise="write the loss yourself"):
                (loss * weighting).sum().backward()
        zd = z.clone().requires_grad_()
        dense = F.cross_entropy(zd, target, reduction="none")
        (dense * weighting).sum().backward()
        onehot = F.one_hot(target, vocab).double()[:, start:start + size] * weighting[:, None]
        out.append(({"per-token loss": loss.detach(), "logit-shard gradient": shard.grad},
                    {"per-token loss": dense.detach(),
                     "logit-shard gradient": zd.grad[:, start:start + size]}, onehot))
    return out


def _vocab_where(ranks, c):
    n = len(ranks)
    tokens, vocab, offset = VOCAB_CASES[n][c]
    split = "/".join(str(s) for _, s in _vocab_shards(vocab, n))
    return (f"{tokens} tokens, a vocabulary of {vocab} split {split} over the group "
            f"{list(ranks)}, logits "
            f"{'near ' + format(offset, 'g') if offset else 'between -12 and 12'}")


def _check_vocab_structure(trace, ws, layout, name):
    for rank in range(ws):
        ranks = _group_of(rank, layout)
        n = len(ranks)
        for c, (tokens, vocab, _) in enumerate(VOCAB_CASES[n]):
            limit = PER_TOKEN * tokens * 8
            calls = _phase_calls(trace, rank, f"forward {c}")
            bad, what = _off_group(calls + _phase_calls(trace, rank, f"backward {c}"), ranks, ws)
            if bad is not None:
                raise CheckFailed(
                    f"{name} ({_vocab_where(ranks, c)}): rank {rank} made {what} (from the run's "
                    f"trace), outside its tensor-parallel group {list(ranks)}: pass the `group` "
                    f"it was given to every collective (without it a collective runs over the "
                    f"whole world).")
            # what this rank contributes: an all-gather's trace bytes are the gathered result
            sent = [(e, e["bytes"] // n if e["op"] in ("all_gather", "gather") else e["bytes"])
                    for e in calls if e["op"] not in ("recv", "barrier")]
            worst = max(sent, key=lambda s: s[1], default=None)
            total = sum(s for _, s in sent)
            if worst is not None and (worst[1] > limit or total > limit + tokens * 8):
                per_token = total / (tokens * 8)
                whole = (" — a vocabulary shard's worth, the logits themselves"
                         if per_token >= 0.9 * vocab / n else "")
                raise CheckFailed(
                    f"{name} ({_vocab_where(ranks, c)}): in forward, rank {rank} made "
                    f"{_describe_calls(calls)} (from the run's trace), {per_token:.3g} numbers of 8 "
                    f"bytes per token{whole}. Vocab parallelism exists so that no rank ever "
                    f"holds the (tokens × vocabulary) logits — at a 128k vocabulary and 8k tokens "
                    f"that is 4 GiB in float32 — so what travels must be a few numbers per token "
                    f"whatever the vocabulary (the max, the sum of exps, the target's logit: at "
                    f"most {PER_TOKEN} × {tokens} tokens × 8 B = {limit} B here).")
            back = _phase_calls(trace, rank, f"backward {c}")
            if back:
                raise CheckFailed(
                    f"{name} ({_vocab_where(ranks, c)}): in backward, rank {rank} made "
                    f"{_describe_calls(back)} (from the run's trace); the gradient of a logit is "
                    f"local — (softmax − one-hot of the target) × the incoming gradient, from "
                    f"the max and the sum of exps the forward already has — so the backward "
                    f"sends nothing.")


def check_vocab_parallel_cross_entropy(fn, layouts=VOCAB_LAYOUTS):
    """fn(logits_shard, target, vocab_start, group) -> the per-token cross-entropy (tokens,),
    the same on every rank; logits_shard (tokens, my vocabulary entries) holds the entries
    vocab_start ... vocab_start + logits_shard.shape[1] - 1."""
    name = expect_arguments(fn, 4, "vocab_parallel_cross_entropy(logits_shard, target, "
                                   "vocab_start, group)")
    # an autograd Function the function names, still a stub: named at once, without launching
    code = getattr(fn, "__code__", None)
    used = [getattr(fn, "__globals__", {}).get(n) for n in (code.co_names if code else ())]
    stub = unsolved_stub(*(getattr(c, m) for c in used if isinstance(c, type) and issubclass(
        c, torch.autograd.Function) for m in ("forward", "backward")))
    if stub is not None:
        raise _not_written(f"{stub.__qualname__}, which {name} uses,")
    for ws, layout in layouts:
        results = _run(_vocab_rank, ws, fn, name, layout, name=name)
        for rank, cases in enumerate(results):
            ranks = _group_of(rank, layout)
            n = len(ranks)
            for c, (got, want, onehot) in enumerate(cases):
                offset = VOCAB_CASES[n][c][2]

                def hint(what, value, want=want, onehot=onehot, offset=offset):
                    if not torch.isfinite(value).all():
                        return (f" — not a number: exp of a logit near {offset:g} overflows "
                                f"(float64's exp does above 709); subtract the max over the "
                                f"WHOLE vocabulary (an all-reduce with op=MAX) before exp"
                                if offset else " — not a number")
                    if what == "per-token loss":
                        return (" — the loss is log Σ_v exp(z_v − M) + M − z_target, the sum "
                                "over every rank's shard, M the max over them all, z_target "
                                "from the rank whose shard holds the target")
                    if _scaled(value, want[what], n):
                        return (f" (the gradient is {n}× the right one: every rank computed "
                                f"the same loss, so nothing is summed over ranks in backward)")
                    if torch.allclose(value, want[what] + onehot, **TOL):
                        return (" — the −1 at the target is missing: it belongs to the rank "
                                "whose shard holds the target (softmax − one-hot)")
                    return (" — the gradient of a logit is (softmax_v − [v = target]) × the "
                            "incoming gradient of its token's loss")
                _compare(got, want, f"{name} ({_vocab_where(ranks, c)}), rank {rank}", hint)
        _check_vocab_structure(results.trace, ws, layout, name)
    passed(f"{name} equals dense F.cross_entropy in float64 — every per-token loss and every "
           f"logit shard's gradient — on {_layouts_phrase(layouts)}, each group on logits of its "
           f"own, vocabularies split unevenly, logits near 1000; in forward it sent at most "
           f"{PER_TOKEN} numbers per token (never the logits), on its own group, in backward "
           f"nothing.")
