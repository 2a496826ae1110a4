"""Bad input to the strategy modules a learner calls (MoE, expert parallelism, context
parallelism, Ulysses, the trace, the shared models, mixed precision) is refused with one sentence.

The rows follow tests/test_bad_input.py: a call, the error it must raise (ValueError or
TypeError, never a raw error from deep inside torch, a hang, or a silent wrong result), words
its message must hold. Calls that need a process group get torch's fake one (one process, world
size 4), in which a collective that was not refused "succeeds" without a word and so fails its
row: every refusal must come before the first collective.
"""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from distlab import context_parallel as cp
from distlab import expert_parallel as ep
from distlab import models
from distlab import moe
from distlab import trace
from distlab import ulysses
from distlab.mixed_precision import reference_step

from bad_input_tables import (WORLD, assert_refused_in_one_sentence,  # noqa: F401
                              fake_world, params)


def logits(tokens=6, experts=4):
    return torch.randn(tokens, experts, generator=torch.Generator().manual_seed(0))


def a_routing():
    return moe.route(logits(), top_k=2)


def qkv(heads=4, kv_heads=4, tokens=4, dim=8, dtype=torch.float32):
    q = torch.ones(1, heads, tokens, dim, dtype=dtype)
    k = torch.ones(1, kv_heads, tokens, dim, dtype=dtype)
    return q, k, k.clone()


def a_trace(ranks=2):
    return trace.Trace([{"rank": r, "events": [], "spans": [], "end": 0.0} for r in range(ranks)])


def a_step(world_size=2, n=4, dtype=torch.bfloat16, y_n=None):
    master = models.make_mlp((4, 4))
    x, y = torch.ones(n, 4), torch.ones(n if y_n is None else y_n, 4)
    return reference_step(master, torch.optim.SGD(master.parameters(), lr=0.1), x, y, F.mse_loss,
                          world_size, dtype)


E4 = torch.tensor([[0, 1], [2, 3], [1, 0]])          # (T=3, k=2) choices among 4 experts
KEEP = torch.ones(3, 2, dtype=torch.bool)

# (id, call, error type, words its message must contain, needs a process group)
CASES = [
    # ---- moe: routing, the layer, the balancing pieces
    ("moe-route-top-k-over", lambda: moe.route(logits(), top_k=5), ValueError, ["top_k", "(4)"], False),
    ("moe-route-top-k-float", lambda: moe.route(logits(), top_k=1.5), TypeError, ["top_k", "whole number"], False),
    ("moe-route-top-k-str", lambda: moe.route(logits(), top_k="2"), TypeError, ["top_k", "whole number"], False),
    ("moe-route-capacity-0", lambda: moe.route(logits(), 1, capacity_factor=0), ValueError,
     ["capacity_factor", "positive", "none"], False),
    ("moe-route-capacity-negative", lambda: moe.route(logits(), 1, capacity_factor=-1.0), ValueError,
     ["capacity_factor", "positive"], False),
    ("moe-route-capacity-str", lambda: moe.route(logits(), 1, capacity_factor="1.25"), TypeError,
     ["capacity_factor", "number"], False),
    ("moe-route-logits-1d", lambda: moe.route(torch.randn(4)), ValueError, ["(tokens, experts)"], False),
    ("moe-route-logits-int", lambda: moe.route(torch.ones(6, 4, dtype=torch.int64)), TypeError,
     ["floating-point"], False),
    ("moe-route-logits-list", lambda: moe.route([[0.0, 1.0]]), TypeError, ["torch.tensor"], False),
    ("moe-route-bias-shape", lambda: moe.route(logits(), selection_bias=torch.zeros(5)), ValueError,
     ["selection_bias", "one value per expert"], False),
    ("moe-layer-top-k", lambda: moe.MoE(n_experts=4, top_k=5), ValueError, ["top_k", "(4)"], False),
    ("moe-layer-experts-0", lambda: moe.MoE(n_experts=0), ValueError, ["n_experts", "at least 1"], False),
    ("moe-layer-d-model-0", lambda: moe.MoE(d_model=0), ValueError, ["d_model", "at least 1"], False),
    ("moe-layer-capacity-0", lambda: moe.MoE(capacity_factor=0), ValueError, ["capacity_factor"], False),
    ("moe-layer-shared-negative", lambda: moe.MoE(n_shared=-1), ValueError, ["n_shared"], False),
    ("moe-forward-width", lambda: moe.make_moe()(torch.ones(3, 8)), ValueError,
     ["d_model", "16", "8"], False),
    ("moe-forward-list", lambda: moe.make_moe()([[1.0] * 16]), TypeError, ["torch.tensor"], False),
    ("moe-capacity-keep-expert", lambda: moe.capacity_keep(torch.tensor([[4]]), 4, 1), ValueError,
     ["expert", "0 to 3"], False),
    ("moe-balancing-wanted-zeros", lambda: moe.load_balancing_loss(a_routing(), torch.zeros(4, dtype=torch.int64)),
     ValueError, ["wanted", "no assignment"], False),
    ("moe-balancing-wanted-shape", lambda: moe.load_balancing_loss(a_routing(), torch.ones(3, dtype=torch.int64)),
     ValueError, ["wanted", "4 experts"], False),
    ("moe-z-loss-int", lambda: moe.z_loss(torch.ones(2, 4, dtype=torch.int64)), TypeError, ["floating-point"], False),
    ("moe-bias-load-shape", lambda: moe.update_selection_bias(torch.zeros(4), torch.ones(1), 0.1), ValueError,
     ["load", "4 experts"], False),
    ("moe-bias-rate-negative", lambda: moe.update_selection_bias(torch.zeros(4), torch.ones(4), -0.1),
     ValueError, ["rate", "positive"], False),
    ("moe-max-violation-zero", lambda: moe.max_violation(torch.zeros(4)), ValueError, ["no load"], False),
    ("moe-max-violation-empty", lambda: moe.max_violation(torch.zeros(0)), ValueError, ["no load"], False),
    ("moe-fine-grained-m-0", lambda: moe.fine_grained(16, 32, 4, 1, 0), ValueError, ["m", "at least 1"], False),
    ("moe-fine-grained-m-negative", lambda: moe.fine_grained(16, 32, 4, 1, -1), ValueError, ["m", "at least 1"], False),
    # ---- expert parallelism
    ("ep-layer-not-moe", lambda: ep.ExpertParallelMoE(nn.Linear(2, 2)), TypeError, ["moe", "make_moe"], True),
    ("ep-layer-uneven", lambda: ep.ExpertParallelMoE(moe.make_moe(n_experts=6)), ValueError,
     ["6 experts", "4 ep ranks"], True),
    ("ep-plan-uneven", lambda: ep.dispatch_plan(E4, KEEP, 6, 4), ValueError, ["6 experts", "multiple"], False),
    ("ep-plan-ep-0", lambda: ep.dispatch_plan(E4, KEEP, 4, 0), ValueError, ["ep_size", "at least 1"], False),
    ("ep-plan-keep-shape", lambda: ep.dispatch_plan(E4, KEEP[:2], 4, 2), ValueError, ["keep", "same shape"], False),
    ("ep-plan-expert-out", lambda: ep.dispatch_plan(E4 + 2, KEEP, 4, 2), ValueError, ["expert", "0 to 3"], False),
    ("ep-combine-token-out", lambda: ep.combine(torch.ones(2, 3), torch.tensor([0, 5]), torch.ones(2), 3),
     ValueError, ["token", "0 to 2"], False),
    ("ep-combine-gate-length", lambda: ep.combine(torch.ones(2, 3), torch.tensor([0, 1]), torch.ones(3), 3),
     ValueError, ["per row"], False),
    ("ep-all-to-all-rows", lambda: ep.all_to_all(torch.ones(3, 2), [1] * WORLD, [1] * WORLD, None),
     ValueError, ["in_splits", "3 rows"], True),
    ("ep-all-to-all-count", lambda: ep.all_to_all(torch.ones(3, 2), [1, 2], [1, 1, 1], None),
     ValueError, ["per rank", "(4)"], True),
    ("ep-all-to-all-negative", lambda: ep.all_to_all(torch.ones(2, 2), [1, 1, 1, -1], [1, 1, 1, -1], None),
     ValueError, ["whole numbers", "not negative"], True),
    ("ep-mesh-float", lambda: ep.ep_dp_mesh(2.0, 2), TypeError, ["whole numbers"], True),
    ("ep-mesh-zero", lambda: ep.ep_dp_mesh(0, 4), ValueError, ["at least 1"], True),
    ("ep-mesh-world", lambda: ep.ep_dp_mesh(2, 4), ValueError, ["8 ranks", "4"], True),
    ("ep-reduce-no-moe", lambda: ep.reduce_gradients(nn.Linear(2, 2), None), TypeError,
     ["model.moe", "expertparallelmoe"], True),
    ("ep-volume-ep-0", lambda: ep.all_to_all_volume(128, 2, 16, 0), ValueError, ["ep_size", "at least 1"], False),
    ("ep-volume-tokens-negative", lambda: ep.all_to_all_volume(-1, 2, 16, 4), ValueError, ["tokens"], False),
    ("ep-volume-top-k-str", lambda: ep.all_to_all_volume(128, "2", 16, 4), TypeError, ["top_k"], False),
    # ---- context parallelism: layouts, plans, blocks, the two attentions, closed forms
    ("cp-contiguous-rank-out", lambda: cp.contiguous_positions(8, 4, 4), ValueError, ["rank", "0 to 3"], False),
    ("cp-contiguous-rank-negative", lambda: cp.contiguous_positions(8, -1, 4), ValueError, ["rank", "0 to 3"], False),
    ("cp-zigzag-rank-one-rank", lambda: cp.zigzag_positions(8, 1, 1), ValueError, ["rank", "0 to 0"], False),
    ("cp-zigzag-rank-out", lambda: cp.zigzag_positions(16, 5, 4), ValueError, ["rank", "0 to 3"], False),
    ("cp-striped-world-0", lambda: cp.striped_positions(8, 0, 0), ValueError, ["world_size", "at least 1"], False),
    ("cp-contiguous-seq-float", lambda: cp.contiguous_positions(8.0, 0, 2), TypeError, ["seq_len", "whole number"], False),
    ("cp-contiguous-seq-negative", lambda: cp.contiguous_positions(-8, 0, 2), ValueError, ["seq_len"], False),
    ("cp-zigzag-uneven", lambda: cp.zigzag_positions(12, 0, 4), ValueError, ["8 equal chunks", "cp ="], False),
    ("cp-causal-work-empty", lambda: cp.causal_work([]), ValueError, ["one tensor of positions per rank"], False),
    ("cp-block-plan-list", lambda: cp.block_plan([0, 1], [0, 1], True), TypeError, ["positions", "tensor"], False),
    ("cp-block-plan-float", lambda: cp.block_plan(torch.tensor([0.5, 1.5]), torch.arange(2), True), TypeError,
     ["positions", "integers"], False),
    ("cp-block-attention-positions", lambda: cp.block_attention(*qkv(), torch.arange(3), torch.arange(4), True, 1.0),
     ValueError, ["q_pos", "(4)"], False),
    ("cp-block-attention-head-dim", lambda: cp.block_attention(qkv()[0], *qkv(dim=4)[1:], torch.arange(4),
                                                               torch.arange(4), True, 1.0),
     ValueError, ["(batch, heads, tokens, head_dim)"], False),
    ("cp-dense-head-dim", lambda: cp.dense_attention(qkv()[0], *qkv(dim=4)[1:]), ValueError,
     ["(batch, heads, tokens, head_dim)"], False),
    ("cp-dense-int", lambda: cp.dense_attention(*qkv(dtype=torch.int64)), TypeError, ["floating-point"], False),
    ("cp-merge-lse-shape", lambda: cp.merge(torch.ones(1, 2, 4, 8), torch.ones(1, 2, 4),
                                            torch.ones(1, 2, 4, 8), torch.ones(1, 2, 1)),
     ValueError, ["lse", "(1, 2, 4)"], False),
    ("cp-ring-positions-list", lambda: cp.ring_attention(*qkv(), [0, 1, 2, 3]), TypeError,
     ["positions", "tensor"], True),
    ("cp-ring-positions-float", lambda: cp.ring_attention(*qkv(), torch.arange(4) + 0.5), TypeError,
     ["positions", "integers"], True),
    ("cp-ring-int", lambda: cp.ring_attention(*qkv(dtype=torch.int64), torch.arange(4)), TypeError,
     ["floating-point"], True),
    ("cp-ring-positions-length", lambda: cp.ring_attention(*qkv(), torch.arange(3)), ValueError,
     ["positions", "(4)"], True),
    ("cp-all-gather-heads", lambda: cp.all_gather_attention(*qkv(kv_heads=3), torch.arange(4)), ValueError,
     ["fewer heads that divide"], True),
    ("cp-all-gather-documents-float", lambda: cp.all_gather_attention(*qkv(), torch.arange(4),
                                                                      documents=torch.zeros(4) + 0.5),
     TypeError, ["documents", "integers"], True),
    ("cp-overlap-bandwidth-0", lambda: cp.overlap_condition(1e15, 0), ValueError, ["bandwidth", "positive"], False),
    ("cp-overlap-flops-negative", lambda: cp.overlap_condition(-1e15, 1e11), ValueError, ["peak_flops", "positive"], False),
    ("cp-overlap-kv-heads", lambda: cp.overlap_condition(1e15, 1e11, heads=32, kv_heads=3), ValueError,
     ["kv_heads", "divide"], False),
    # ---- Ulysses
    ("uly-check-heads-cp-0", lambda: ulysses.check_heads(8, 8, 0), ValueError, ["cp", "at least 1"], False),
    ("uly-check-heads-0", lambda: ulysses.check_heads(0, 0, 2), ValueError, ["heads", "at least 1"], False),
    ("uly-check-heads-split", lambda: ulysses.check_heads(6, 6, 4), ValueError, ["6 query heads", "cp = 4"], False),
    ("uly-positions-length", lambda: ulysses.ulysses_attention(*qkv(), torch.arange(3)), ValueError,
     ["positions", "(4)"], True),
    ("uly-positions-float", lambda: ulysses.ulysses_attention(*qkv(), torch.arange(4) + 0.5), TypeError,
     ["positions", "integers"], True),
    ("uly-int", lambda: ulysses.ulysses_attention(*qkv(dtype=torch.int64), torch.arange(4)), TypeError,
     ["floating-point"], True),
    ("uly-comm-cp-0", lambda: ulysses.communication_per_layer("ulysses", 1024, 0, 8), ValueError,
     ["cp", "at least 1"], False),
    ("uly-comm-seq-uneven", lambda: ulysses.communication_per_layer("ring", 1000, 3, 8), ValueError,
     ["1000", "cp = 3"], False),
    ("uly-comm-kv-heads", lambda: ulysses.communication_per_layer("ring", 1024, 4, 8, kv_heads=3), ValueError,
     ["kv_heads = 3", "heads = 8"], False),
    ("uly-comm-method", lambda: ulysses.communication_per_layer("rings", 1024, 4, 8), ValueError,
     ["unknown method"], False),
    # ---- the trace
    ("trace-comm-rank-out", lambda: a_trace().comm(rank=2), ValueError, ["rank", "0 to 1"], False),
    ("trace-comm-rank-negative", lambda: a_trace().comm(rank=-1), ValueError, ["rank", "0 to 1"], False),
    ("trace-comm-rank-float", lambda: a_trace().comm(rank=1.0), TypeError, ["rank", "whole number"], False),
    ("trace-comm-op", lambda: a_trace().comm(op="allreduce"), ValueError, ["op", "all_reduce"], False),
    ("trace-ops-rank", lambda: a_trace().ops(rank=3), ValueError, ["rank", "0 to 1"], False),
    ("trace-compute-rank", lambda: a_trace().compute(rank=2), ValueError, ["rank", "0 to 1"], False),
    ("trace-sends-rank", lambda: a_trace().sends(5), ValueError, ["rank", "0 to 1"], False),
    ("trace-totals-rank", lambda: a_trace().totals(-2), ValueError, ["rank", "0 to 1"], False),
    ("trace-overlap-rank", lambda: a_trace().overlap(2), ValueError, ["rank", "0 to 1"], False),
    ("trace-end-rank", lambda: a_trace().end(2), ValueError, ["rank", "0 to 1"], False),
    ("trace-compute-str", lambda: trace.compute("0.1"), TypeError, ["seconds", "0.004"], False),
    ("trace-span-name", lambda: trace.span(3).__enter__(), TypeError, ["span", "name", "string"], False),
    # ---- the shared models and data
    ("models-mlp-one-size", lambda: models.make_mlp((16,)), ValueError, ["sizes", "at least two"], False),
    ("models-mlp-int", lambda: models.make_mlp(16), TypeError, ["sizes", "(16, 64, 64, 4)"], False),
    ("models-mlp-negative", lambda: models.make_mlp((16, -1, 4)), ValueError, ["sizes", "at least 1"], False),
    ("models-mlp-float", lambda: models.make_mlp((16, 64.0, 4)), TypeError, ["sizes", "whole numbers"], False),
    ("models-data-n-0", lambda: models.regression_data(n=0), ValueError, ["n", "at least 1"], False),
    ("models-data-dim-0", lambda: models.regression_data(in_dim=0), ValueError, ["in_dim", "at least 1"], False),
    ("models-token-data-vocab-1", lambda: models.token_data(vocab=1), ValueError, ["vocab", "at least 2"], False),
    ("models-gpt-layers-negative", lambda: models.make_gpt(n_layers=-1), ValueError, ["n_layers"], False),
    ("models-gpt-vocab-0", lambda: models.make_gpt(vocab=0), ValueError, ["vocab", "at least 1"], False),
    ("models-gpt-heads", lambda: models.make_gpt(n_heads=3), ValueError, ["n_heads=3"], False),
    ("models-gpt-kv-heads", lambda: models.make_gpt(n_kv_heads=3), ValueError, ["n_kv_heads=3"], False),
    ("models-gpt-token-out", lambda: models.make_gpt()(torch.tensor([[64]])), ValueError,
     ["token", "0 to 63"], False),
    ("models-gpt-1d", lambda: models.make_gpt()(torch.arange(4)), ValueError, ["(batch, tokens)"], False),
    ("models-gpt-float", lambda: models.make_gpt()(torch.zeros(1, 4)), TypeError, ["integer"], False),
    ("models-gpt-too-long", lambda: models.make_gpt()(torch.zeros(1, 17, dtype=torch.int64)), ValueError,
     ["seq_len=16"], False),
    ("models-lm-loss-shape", lambda: models.lm_loss(torch.zeros(2, 4, 64), torch.zeros(2, 5, dtype=torch.int64)),
     ValueError, ["targets", "(2, 4)"], False),
    ("models-batches-size-0", lambda: models.batches_of(torch.ones(8, 2), torch.ones(8, 1), 0, 3), ValueError,
     ["batch_size", "at least 1"], False),
    ("models-batches-empty", lambda: models.batches_of(torch.ones(0, 2), torch.ones(0, 1), 4, 1), ValueError,
     ["no sample"], False),
    ("models-batches-lengths", lambda: models.batches_of(torch.ones(8, 2), torch.ones(6, 1), 4, 1), ValueError,
     ["same number"], False),
    ("models-batches-steps-float", lambda: models.batches_of(torch.ones(8, 2), torch.ones(8, 1), 4, 2.5), TypeError,
     ["steps", "whole number"], False),
    ("models-train-lr-negative", lambda: models.train_reference(models.make_mlp(), [], lr=-1), ValueError,
     ["lr", "positive"], False),
    ("models-train-optimizer", lambda: models.train_reference(models.make_mlp(), [], optimizer="lbfgs"), ValueError,
     ["'sgd' or 'adam'"], False),
    # ---- mixed precision
    ("mp-world-0", lambda: a_step(world_size=0), ValueError, ["world_size", "at least 1"], False),
    ("mp-world-over-batch", lambda: a_step(world_size=8), ValueError, ["4 samples", "8 ranks"], False),
    ("mp-uneven", lambda: a_step(world_size=4, n=6), ValueError, ["6 samples", "4 ranks"], False),
    ("mp-lengths", lambda: a_step(y_n=3), ValueError, ["x", "y", "same number"], False),
    ("mp-dtype-int", lambda: a_step(dtype=torch.int32), TypeError, ["compute_dtype", "floating-point"], False),
    ("mp-dtype-str", lambda: a_step(dtype="bf16"), TypeError, ["compute_dtype", "torch.bfloat16"], False),
]


@pytest.mark.parametrize("call,error,words,needs_group", params(CASES))
def test_bad_input_is_refused_in_one_sentence(request, call, error, words, needs_group):
    assert_refused_in_one_sentence(request, call, error, words, needs_group)


def test_what_is_allowed_still_works():
    """The checks refuse only what is wrong: numpy and 0-d tensor sizes, empty batches where
    they mean something, one rank holding the whole sequence."""
    import numpy as np
    assert moe.route(logits(), top_k=np.int64(2)).experts.shape == (6, 2)
    assert moe.route(logits(0), top_k=1, capacity_factor=1.0).experts.shape == (0, 1)
    assert moe.load_balancing_loss(moe.route(logits(0))).item() == 0
    assert moe.capacity_keep(E4, 4, None).all()
    assert cp.zigzag_positions(7, 0, 1).tolist() == list(range(7))
    assert cp.block_plan(torch.arange(4.0), torch.arange(4.0), True)    # whole floats are positions
    assert cp.contiguous_positions(np.int64(8), np.int64(1), 2).tolist() == [4, 5, 6, 7]
    assert models.batches_of(torch.ones(8, 2), torch.ones(8, 1), 4, 0) == []
    assert a_trace().comm(rank=np.int64(1)) == []
    order, splits = ep.dispatch_plan(E4, KEEP, 4, 2)
    assert splits == [4, 2] and len(order) == 6
    assert len(a_step(world_size=2, n=4)) == 2
