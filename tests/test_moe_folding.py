"""MoE parallel folding (distlab.moe_folding): both factorisations' groups partition the ranks in
Megatron-Core's order for every valid factorisation of 1-12 ranks; bad factorisations are refused
in a sentence; one training layout (dense MLP on tp × dp, MoE on ep × edp, the same ranks) equals
one process over two SGD steps at two shapes, and its trace shows each collective on its kind's
groups. One launch for both shapes."""
import pytest
import torch
from hypothesis import given, settings, strategies as st

import distlab
from distlab import moe_folding as mf

WORLDS = (1, 2, 3, 4, 6, 8, 12)


def _divisors(n):
    return [d for d in range(1, n + 1) if n % d == 0]


def _valid(world):
    for tp in _divisors(world):
        for etp in _divisors(world):
            for ep in _divisors(world // etp):
                yield dict(tp=tp, dp=world // tp, etp=etp, ep=ep, edp=world // (etp * ep))


ALL = [(w, s) for w in WORLDS for s in _valid(w)]


def test_every_valid_factorisation_partitions_the_ranks_in_megatrons_order():
    assert len(ALL) > 200
    for world, sizes in ALL:
        f = mf.folding_groups(world, **sizes)
        for kind, groups in f.groups.items():
            assert sorted(r for g in groups for r in g) == list(range(world)), (world, sizes, kind)
            assert all(len(g) == sizes[kind] for g in groups)
        for a, b in (("tp", "dp"), ("etp", "ep"), ("ep", "edp"), ("etp", "edp")):
            assert all(len(set(g) & set(h)) <= 1 for g in f.groups[a] for h in f.groups[b])
        tp, etp, ep = sizes["tp"], sizes["etp"], sizes["ep"]
        for r in range(world):       # rank = t + tp·d ; rank = u + etp·(e + ep·f)
            mine = f.of(r)
            assert mine["tp"] == [r - r % tp + i for i in range(tp)]
            assert mine["dp"] == [r % tp + tp * i for i in range(sizes["dp"])]
            assert mine["etp"] == [r - r % etp + i for i in range(etp)]
            assert mine["ep"] == [r % etp + etp * e + etp * ep * (r // (etp * ep)) for e in range(ep)]
            assert mine["edp"] == [r % (etp * ep) + etp * ep * i for i in range(sizes["edp"])]


def test_groups_are_listed_as_megatrons_masked_orthogonal_groups():
    f = mf.folding_groups(8, tp=2, dp=4, etp=2, ep=2, edp=2)
    assert f.groups["tp"] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert f.groups["dp"] == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert f.groups["ep"] == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert f.groups["edp"] == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert mf.folding_groups(4, tp=2, dp=2, etp=1, ep=2, edp=2).kinds([1, 0]) == ["tp", "ep"]


@settings(max_examples=60, deadline=None)
@given(st.sampled_from(WORLDS), st.lists(st.integers(1, 12), min_size=5, max_size=5))
def test_factorisations_that_do_not_multiply_to_the_world_are_refused(world, s):
    tp, dp, etp, ep, edp = s
    if tp * dp == world and etp * ep * edp == world:
        assert mf.folding_groups(world, tp=tp, dp=dp, etp=etp, ep=ep, edp=edp).world_size == world
        return
    with pytest.raises(ValueError, match=f"does not multiply to the world size {world}"):
        mf.folding_groups(world, tp=tp, dp=dp, etp=etp, ep=ep, edp=edp)


@pytest.mark.parametrize("bad, error, says", [(dict(tp=0), ValueError, "tp must be at least 1"),
                                              (dict(ep=2.0), TypeError, "ep must be a whole number"),
                                              (dict(edp=True), TypeError, "edp must be a whole")])
def test_sizes_that_are_not_whole_numbers_are_refused(bad, error, says):
    sizes = dict(tp=2, dp=2, etp=1, ep=2, edp=2)
    sizes.update(bad)
    with pytest.raises(error, match=says):
        mf.folding_groups(4, **sizes)


SHAPES = {"tp 2 × dp 2, ep 4": dict(tp=2, dp=2, etp=1, ep=4, edp=1),
          "tp 4, ep 2 × edp 2": dict(tp=4, dp=1, etp=1, ep=2, edp=2)}


def _both_shapes(rank, world_size):
    out = {}
    for name, sizes in SHAPES.items():
        with distlab.trace.span(name):
            out[name] = mf.folded_step(rank, world_size, mf.folding_groups(world_size, **sizes))
    return out


def test_folded_layout_equals_one_process_and_uses_each_kinds_groups():
    ranks = distlab.run(_both_shapes, 4, trace=True)
    for name, sizes in SHAPES.items():
        assert max(r[name] for r in ranks) < 1e-12, name
        f = mf.folding_groups(4, **sizes)
        seen = mf.comm_by_kind(ranks.trace, f, span=name)
        assert set(seen["ep"][1]) == {"all_to_all"} and seen["ep"][0] == f.groups["ep"]
        assert {"reduce_scatter", "all_gather"} <= set(seen["tp"][1])
        assert not any("all_to_all" in ops for k, (_, ops) in seen.items() if k != "ep")
        if sizes["edp"] > 1:
            assert seen["edp"][1] == {"all_reduce": 4 * 2}     # one bucket a rank a step


def test_folded_step_refuses_split_experts():
    with pytest.raises(ValueError, match="etp = 1"):
        mf.folded_step(0, 2, mf.folding_groups(2, tp=1, dp=2, etp=2, ep=1, edp=1))
