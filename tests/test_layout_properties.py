"""Properties of the layout planner (distlab.layout), checked on many small cases (Hypothesis).

candidates() claims every layout it returns multiplies to the GPU count and splits the model,
the batch and (for zig-zag ring attention) the sequence evenly; the brute force below states
those rules once more, independently, and the two must list the same layouts. Every layout
priced has a finite, positive time and memory; what cannot be priced is refused in a sentence.
All pure arithmetic: no rank starts.
"""
import itertools
import math

import pytest
from hypothesis import given, settings, strategies as st

from distlab import hardware, layout

FAST = settings(max_examples=60, deadline=None)


def brute_force(n_gpus, gpus_per_node, layers, heads, global_batch, micro_batch, cps, seq_len):
    """Every (dp, pp, cp, tp) of whole numbers, kept when it follows the stated rules."""
    out = set()
    for dp, pp, cp, tp in itertools.product(range(1, n_gpus + 1), repeat=4):
        if dp * pp * cp * tp != n_gpus or cp not in cps:
            continue
        if heads % tp or gpus_per_node % tp or layers % pp:
            continue
        if global_batch % (dp * micro_batch):
            continue
        if cp > 1 and seq_len % (2 * cp):
            continue
        out.add((dp, pp, cp, tp))
    return out


problems = st.fixed_dictionaries(dict(
    n_gpus=st.integers(1, 24),
    gpus_per_node=st.sampled_from([1, 2, 4, 8]),
    layers=st.integers(1, 24),
    heads=st.integers(1, 16),
    global_batch=st.integers(1, 64),
    micro_batch=st.integers(1, 4),
    cps=st.sets(st.sampled_from([1, 2, 3, 4]), min_size=1).map(lambda s: tuple(sorted(s))),
    seq_len=st.integers(1, 64),
))


@FAST
@given(problems)
def test_candidates_are_exactly_the_layouts_the_rules_allow(p):
    got = layout.candidates(p["n_gpus"], p["gpus_per_node"], p["layers"], p["heads"],
                            p["global_batch"], p["micro_batch"], p["cps"], p["seq_len"])
    assert len(got) == len(set(got)), "a layout listed twice"
    for dp, pp, cp, tp in got:
        assert dp * pp * cp * tp == p["n_gpus"]
        assert p["heads"] % tp == 0 and p["gpus_per_node"] % tp == 0 and p["layers"] % pp == 0
        assert p["global_batch"] % (dp * p["micro_batch"]) == 0
        assert cp in p["cps"] and (cp == 1 or p["seq_len"] % (2 * cp) == 0)
    assert set(got) == brute_force(**p)


def test_a_sequence_of_odd_length_has_layouts_without_context_parallelism():
    """The zig-zag rule (2·cp pieces) once applied at cp = 1 too: no layout for 4095 tokens."""
    assert (1, 1, 1, 8) in layout.candidates(8, 8, 32, 32, 8, 1, (1,), seq_len=4095)
    assert layout.rank_layouts("Llama-2 7B", nodes=1, seq_len=4095)


models = st.sampled_from(sorted(layout.SHAPES)) | st.builds(
    lambda layers, head_dim, heads, kv, glu, vocab: hardware.Transformer(
        layers, head_dim * heads, heads, 4 * head_dim * heads, vocab,
        kv_heads=heads // kv if heads % kv == 0 else None, glu=glu),
    st.integers(1, 16), st.sampled_from([32, 64, 128]), st.sampled_from([4, 8, 16]),
    st.sampled_from([1, 2, 4]), st.booleans(), st.sampled_from([0, 1000, 32000]))


@FAST
@given(models, st.sampled_from([1, 2, 4]), st.sampled_from([2, 4, 8]),
       st.sampled_from([64, 512]), st.sampled_from([1, 2]),
       st.sampled_from([(1,), (1, 2)]), st.sampled_from(["full", "selective", "none"]),
       st.sampled_from([0, 1, 2, 3]))
def test_every_layout_has_a_finite_positive_price(model, nodes, per_node, batch, micro, cps,
                                                   recompute, zero):
    shape, _ = layout.shape_of(model)
    n = nodes * per_node
    for dp, pp, cp, tp in layout.candidates(n, per_node, shape.layers, shape.heads, batch, micro,
                                            cps, 4096):
        r = layout.price(model, dp, pp, tp, per_node, batch, 4096, micro, cp=cp,
                         zero_stage=zero, checkpointing=recompute)
        assert (r["dp"], r["pp"], r["cp"], r["tp"]) == (dp, pp, cp, tp)
        assert 0 < r["step_s"] < math.inf and 0 < r["gb"] < math.inf
        assert 0 < r["compute_s"] and 0 < r["mfu"] < math.inf
        parts = ("recompute_s", "bubble_s", "tp_s", "cp_s", "pp_s", "dp_s", "optimizer_s")
        assert all(0 <= r[k] < math.inf for k in parts), {k: r[k] for k in parts}
        assert r["bubble_s"] == 0 if pp == 1 else r["bubble_s"] > 0
        assert r["steady_gb"] <= r["gb"]


@FAST
@given(st.sampled_from(sorted(layout.SHAPES)), st.integers(1, 3), st.sampled_from([4, 8]))
def test_the_ranking_prices_every_candidate_and_puts_fitting_and_fast_first(model, nodes, per_node):
    shape, _ = layout.shape_of(model)
    expected = set(layout.candidates(nodes * per_node, per_node, shape.layers, shape.heads, 512, 1))
    if not expected:
        with pytest.raises(ValueError, match="no .* splits") as e:
            layout.rank_layouts(model, nodes=nodes, gpus_per_node=per_node, global_batch=512)
        assert _sentence(e)
        return
    rows = layout.rank_layouts(model, nodes=nodes, gpus_per_node=per_node, global_batch=512)
    assert {(r["dp"], r["pp"], r["cp"], r["tp"]) for r in rows} == expected
    keys = [(not r["fits"], r["step_s"]) for r in rows]
    assert keys == sorted(keys)


def _sentence(e):
    message = str(e.value)
    return "\n" not in message and message.endswith(".") and len(message) < 300


bad_degrees = st.one_of(st.integers(-4, 0), st.floats(0.5, 4.5).filter(lambda x: x != int(x)),
                        st.just("2"), st.just(None), st.just(True))


@FAST
@given(st.sampled_from(["dp", "pp", "tp", "cp", "micro_batch", "global_batch", "seq_len"]),
       bad_degrees)
def test_a_layout_that_cannot_exist_is_refused_in_a_sentence(name, value):
    kw = dict(dp=1, pp=1, tp=1, cp=1, micro_batch=1, global_batch=8, seq_len=4096)
    kw[name] = value
    with pytest.raises((ValueError, TypeError)) as e:
        layout.price("Llama-2 7B", **kw)
    assert name in str(e.value) and _sentence(e)


@FAST
@given(st.sampled_from(sorted(layout.SHAPES)), st.integers(2, 64))
def test_a_tp_that_does_not_divide_the_heads_is_refused(model, tp):
    shape, _ = layout.shape_of(model)
    if shape.heads % tp == 0:
        return
    with pytest.raises(ValueError) as e:
        layout.price(model, 1, 1, tp, global_batch=8)
    assert "does not divide" in str(e.value) and _sentence(e)


@FAST
@given(st.sampled_from(["nodes", "gpus_per_node", "micro_batch", "global_batch"]), bad_degrees)
def test_a_search_that_cannot_exist_is_refused_in_a_sentence(name, value):
    with pytest.raises((ValueError, TypeError)) as e:
        layout.rank_layouts("Llama-2 7B", **{name: value})
    assert name in str(e.value) and _sentence(e)


@FAST
@given(dp=st.sampled_from([2, 4, 8, 16]), pp=st.sampled_from([1, 2, 4]),
       accumulate=st.sampled_from([1, 2, 8]), model=st.sampled_from(["Llama-2 13B", "Llama-2 70B"]))
def test_fsdp_keeping_weights_gathered_trades_traffic_for_memory(dp, pp, accumulate, model):
    # ZeRO-3 per micro-batch: 2·m all-gathers and m reduce-scatters a step; kept gathered: one
    # of each, for the stage's bf16 weights and fp32 gradients held whole (6 bytes a parameter)
    kw = dict(zero_stage=3, overlap_dp=False, global_batch=dp * accumulate, cluster="h100-cluster")
    every = layout.price(model, dp, pp, 8, keep_unsharded=False, **kw)
    kept = layout.price(model, dp, pp, 8, keep_unsharded=True, **kw)
    m = every["micro_batches"]
    assert kept["dp_s"] < every["dp_s"]
    gather_and_scatter = every["dp_s"] / (3 * m)           # all-gather and reduce-scatter alike
    assert kept["dp_s"] == pytest.approx(2 * gather_and_scatter, rel=1e-9)
    assert kept["gb"] > every["gb"]
    default = layout.price(model, dp, pp, 8, **kw)
    assert default["gb"] == (kept if pp > 1 else every)["gb"]
    zero1 = layout.price(model, dp, pp, 8, **{**kw, "zero_stage": 1})
    assert every["gb"] < zero1["gb"]


@FAST
@given(dp=st.sampled_from([4, 8, 16, 32]), shard=st.sampled_from([2, 4, 8]),
       pp=st.sampled_from([1, 2]), model=st.sampled_from(["Llama-2 7B", "Llama-2 13B"]))
def test_hsdp_holds_more_than_fsdp_and_is_fsdp_when_it_shards_over_every_rank(dp, shard, pp,
                                                                            model):
    """HSDP shards the states over fewer ranks than FSDP over the same dp: never less memory,
    and the same layout priced the same when its shard group is every dp rank."""
    if shard >= dp:
        return
    fsdp = layout.price(model, dp, pp, 1, global_batch=256, zero_stage=3)
    hsdp = layout.price(model, dp, pp, 1, global_batch=256, zero_stage=3, dp_shard=shard)
    assert hsdp["peak_parts"]["states"] > fsdp["peak_parts"]["states"]
    assert hsdp["optimizer_s"] > fsdp["optimizer_s"]
    assert math.isfinite(hsdp["step_s"]) and hsdp["dp_s"] >= 0
    assert layout.price(model, dp, pp, 1, global_batch=256, zero_stage=3, dp_shard=dp) == fsdp
