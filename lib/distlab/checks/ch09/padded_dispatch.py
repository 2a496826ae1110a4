"""Workbook 09, exercise 3: a dispatch with static shapes."""
import torch

from .. import CheckFailed, _traffic, expect_arguments, passed, run_learner
from ._common import (LAYOUTS, TIMEOUT, _fresh_seed, _layout_phrase, _my_group, _refusing,
                      _talked_outside)
from ._references import _dispatch_case, _dispatch_reference


DISPATCH_CASES = {4: (4, 1, 2, 5), 5: (6, 2, 3, 3)}     # world: (E, k, capacity per source, d)


def _dispatch_on_ranks(rank, world_size, fn, groups, seed):
    group, ranks = _my_group(rank, groups)
    n_experts, k, capacity, d = DISPATCH_CASES[world_size]
    x, experts, keep = _dispatch_case(rank, n_experts, k, capacity, d, seed)
    with _refusing("the static dispatch"):
        got = fn(x.clone(), experts.clone(), keep.clone(), n_experts, capacity, group)
    return (x, experts, keep), got


def _static_bytes(trace, groups):
    """(rank, bytes) of the ranks of one group that sent the most and the fewest bytes, or None
    when every rank of each group sent the same (the ranks' buffers have one shape)."""
    for ranks in groups:
        # the bytes each rank put on the wire, by the checkers' one traffic rule (`_traffic`)
        sent = {r: _traffic.wire(_traffic.records(trace, r)) for r in ranks}
        if len(set(sent.values())) > 1:
            most, fewest = max(sent, key=sent.get), min(sent, key=sent.get)
            return (most, sent[most]), (fewest, sent[fewest])
    return None


def check_padded_dispatch(fn, layouts=LAYOUTS[1:]):
    """fn(x, experts, keep, n_experts, capacity, group) -> (N, E/N, capacity, d) on every rank of
    the group: [source rank, local expert, slot] holds the source's kept rows for that expert in
    token order, zeros after them; every rank sends the same bytes whatever the routing."""
    name = expect_arguments(fn, 6, "padded_dispatch(x, experts, keep, n_experts, capacity, "
                                   "group)")
    seed = _fresh_seed()
    for ws, groups in layouts:
        n_experts, k, capacity, d = DISPATCH_CASES[ws]
        got = run_learner(_dispatch_on_ranks, ws, fn, groups, seed, name=name, timeout=TIMEOUT,
                          trace=True, deadlock_rule="Every rank of the group must join the same "
                                                    "exchange, also a rank that sends no row.")
        outside = _talked_outside(got.trace, groups, name)
        if outside:
            raise CheckFailed(outside)
        for ranks in groups:
            expected = _dispatch_reference([got[r][0] for r in ranks], n_experts, capacity)
            n = len(ranks)
            for r, want in zip(ranks, expected):
                mine = got[r][1]
                where = (f"{name} on the group {list(ranks)} of {ws} ranks ({n_experts} experts, "
                         f"k={k}, capacity {capacity}, d={d}), rank {r}")
                if not torch.is_tensor(mine) or tuple(mine.shape) != tuple(want.shape):
                    raise CheckFailed(f"{where} should return a ({n}, {n_experts // n}, "
                                      f"{capacity}, {d}) tensor [source rank in the group, local "
                                      f"expert, slot, d]; got {mine!r:.80}.")
                bad = first_difference_at(mine, want)
                if bad is not None:
                    s, e, slot = bad
                    first = ranks.index(r) * (n_experts // n)
                    should = ("zeros (padding)" if not want[s, e, slot].any() else
                              f"that rank's {_nth(slot)} kept row for the expert, in token order")
                    holds = "zeros" if not mine[s, e, slot].any() else "another row"
                    raise CheckFailed(
                        f"{where}: slot {slot} of local expert {e} (global expert {first + e}) "
                        f"from the group's rank {s} (rank {ranks[s]}) should hold {should}; it "
                        f"holds {holds}.")
        uneven = _static_bytes(got.trace, groups)
        if uneven:
            (most, a), (fewest, b) = uneven
            raise CheckFailed(f"{name}: rank {most} sent {a:g} bytes and rank {fewest} {b:g}: the "
                              f"values are right, but a static dispatch sends the same padded "
                              f"buffer ({capacity} rows per expert per source) whatever the "
                              f"routing, so every exchange has one shape known in advance.")
    passed(f"{name} lays every kept row in its slot, zeros after, on subgroups side by side "
           f"({_layout_phrase(layouts)}), with tokens drawn afresh, and every rank sends the same "
           f"bytes whatever the routing.")


def _nth(i):
    return {0: "first", 1: "second", 2: "third"}.get(i, f"{i + 1}th")


def first_difference_at(got, want):
    """(source, expert, slot) of the first row that differs, or None."""
    diff = (got.to(want.dtype) - want).abs().amax(dim=-1) > 1e-12
    if not diff.any():
        return None
    return tuple(int(i) for i in diff.nonzero()[0])
