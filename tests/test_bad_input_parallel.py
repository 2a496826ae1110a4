"""Bad input to the tensor-, vocabulary- and pipeline-parallel modules and the 3D/4D stages is
refused with one sentence.

The rows follow tests/test_bad_input.py: a call, the error it must raise (ValueError or
TypeError, never a raw error from deep inside torch, a hang, or a silent wrong result), words
its message must hold. Calls that need a process group get torch's fake one (one process, world
size 4), in which a collective that was not refused "succeeds" without a word and so fails its
row: every refusal must come before the first collective.
"""
import pytest
import torch
import torch.nn as nn

from distlab import parallel3d as p3
from distlab import parallel4d as p4
from distlab import pipeline_parallel as pp
from distlab import pipeline_schedules as ps
from distlab import tensor_parallel as tpm
from distlab import tp_comm
from distlab import vocab_parallel as vp
from distlab.models import make_gpt, make_mlp

from bad_input_tables import (WORLD, assert_refused_in_one_sentence,  # noqa: F401
                              fake_world, params)


def seq(n=4):
    return nn.Sequential(*[nn.Linear(2, 2) for _ in range(n)])


def col(**kw):
    return tpm.ColumnParallelLinear(8, 8, **kw)


def gpt(**kw):
    return make_gpt(seed=0, **{"n_layers": 2, "d_model": 16, "n_heads": 4, "vocab": 64, **kw})


def tokens(n=4, t=8):
    return torch.zeros(n, t, dtype=torch.long)


def stage3d():
    mesh = p3.Mesh3D(1, 1, WORLD)
    return p3.Stage3D.from_dense(gpt(), mesh), mesh


def stage4d():
    mesh = p4.Mesh4D(1, 1, WORLD, 1)
    return p4.Stage4D.from_dense(gpt(), mesh), mesh


# (id, call, error type, words its message must contain, needs a process group)
CASES = [
    # ---- tensor parallel layers
    ("tp-column-width", lambda: tpm.ColumnParallelLinear(8, 6), ValueError, ["out_features = 6", "4"], True),
    ("tp-row-width", lambda: tpm.RowParallelLinear(6, 8), ValueError, ["in_features = 6", "4"], True),
    ("tp-column-width-float", lambda: tpm.ColumnParallelLinear(8, 8.0), TypeError, ["out_features", "whole number"], True),
    ("tp-column-width-0", lambda: tpm.ColumnParallelLinear(0, 8), ValueError, ["in_features", "at least 1"], True),
    ("tp-row-width-str", lambda: tpm.RowParallelLinear("8", 8), TypeError, ["in_features", "whole number"], True),
    ("tp-column-group", lambda: tpm.ColumnParallelLinear(8, 8, group="tp"), TypeError, ["group", "ProcessGroup"], True),
    ("tp-column-from-conv", lambda: tpm.ColumnParallelLinear.from_dense(nn.Conv2d(2, 8, 1)), TypeError,
     ["nn.Linear", "Conv2d"], True),
    ("tp-row-from-str", lambda: tpm.RowParallelLinear.from_dense("fc"), TypeError, ["nn.Linear", "str"], True),
    ("tp-column-input-width", lambda: col()(torch.ones(2, 6)), ValueError, ["8 features", "6"], True),
    ("tp-column-input-int", lambda: col()(torch.ones(2, 8, dtype=torch.int64)), TypeError, ["floating-point"], True),
    ("tp-column-input-list", lambda: col()([1.0] * 8), TypeError, ["torch.Tensor"], True),
    ("tp-column-input-dtype", lambda: col()(torch.ones(2, 8, dtype=torch.float64)), TypeError,
     ["float64", "float32"], True),
    ("tp-row-input-width", lambda: tpm.RowParallelLinear(8, 8)(torch.ones(2, 8)), ValueError, ["2 features", "8"], True),
    ("tp-column-sp-1d", lambda: col(sequence_parallel=True)(torch.ones(8)), ValueError, ["(batch, tokens"], True),
    ("tp-heads", lambda: tpm.ParallelAttention(12, 6), ValueError, ["n_heads = 6", "4"], True),
    ("tp-heads-width", lambda: tpm.ParallelAttention(10, 4), ValueError, ["d_model=10", "n_heads=4"], True),
    ("tp-heads-0", lambda: tpm.ParallelAttention(8, 0), ValueError, ["n_heads", "at least 1"], True),
    ("tp-kv-heads", lambda: tpm.kv_head_split(8, 3, 4), ValueError, ["n_kv_heads=3"], False),
    ("tp-kv-tp-0", lambda: tpm.kv_head_split(8, 2, 0), ValueError, ["tp", "at least 1"], False),
    ("tp-attention-from-linear", lambda: tpm.ParallelAttention.from_dense(nn.Linear(8, 8)), TypeError,
     ["Attention", "Linear"], True),
    ("tp-mlp-hidden", lambda: tpm.ParallelMLP(8, 6), ValueError, ["out_features = 6"], True),
    ("tp-mlp-from-linear", lambda: tpm.ParallelMLP.from_dense(nn.Linear(8, 8)), TypeError, ["MLP", "Linear"], True),
    ("tp-block-from-gpt", lambda: tpm.ParallelBlock.from_dense(gpt()), TypeError, ["Block", "TinyGPT"], True),
    ("tp-block-heads", lambda: tpm.ParallelBlock.from_dense(gpt(n_heads=2).blocks[0]), ValueError, ["n_heads = 2"], True),
    ("tp-block-input-width", lambda: tpm.ParallelBlock.from_dense(gpt().blocks[0])(torch.ones(1, 4, 12)),
     ValueError, ["16 features", "12"], True),
    ("tp-block-input-2d", lambda: tpm.ParallelBlock.from_dense(gpt().blocks[0])(torch.ones(4, 16)),
     ValueError, ["(batch, tokens"], True),
    ("tp-sequence-slice", lambda: tpm.sequence_slice(torch.ones(1, 6, 2), None), ValueError, ["seq_len = 6"], True),
    ("tp-sequence-slice-list", lambda: tpm.sequence_slice([1, 2], None), TypeError, ["torch.Tensor"], True),
    ("tp-seed-float", lambda: tpm.model_parallel_seed(1.5), TypeError, ["seed", "whole number"], True),
    ("tp-block-seconds-tp-0", lambda: tpm.tp_block_seconds(None, 0, 128), ValueError, ["tp", "at least 1"], False),
    ("tp-block-seconds-heads", lambda: tpm.tp_block_seconds(None, 3, 128), ValueError, ["tp=3", "heads"], False),
    # ---- tp_comm
    ("tpc-split-uneven", lambda: tp_comm.split_fwd_all_gather_bwd(torch.ones(2, 6), None), ValueError,
     ["size 6", "evenly"], True),
    ("tpc-all-reduce-list", lambda: tp_comm.identity_fwd_all_reduce_bwd([1.0], None), TypeError, ["torch.Tensor"], True),
    # ---- vocabulary parallel
    ("vp-vocab-0", lambda: vp.VocabParallelEmbedding(0, 8), ValueError, ["vocab_size", ">= 1"], True),
    ("vp-padded-tp-float", lambda: vp.padded_vocab_size(64, 1.5), TypeError, ["tp", "whole number"], False),
    ("vp-embedding-from-linear", lambda: vp.VocabParallelEmbedding.from_dense(nn.Linear(8, 64)), TypeError,
     ["nn.Embedding", "Linear"], True),
    ("vp-head-from-embedding", lambda: vp.ParallelLMHead.from_dense(nn.Embedding(64, 8)), TypeError,
     ["nn.Linear", "Embedding"], True),
    ("vp-embedding-ids-float", lambda: vp.VocabParallelEmbedding(64, 8)(torch.zeros(2, 3)), TypeError,
     ["integer", "token"], True),
    ("vp-head-input-width", lambda: vp.ParallelLMHead(8, 64)(torch.ones(2, 3, 6)), ValueError, ["8 features", "6"], True),
    ("vp-ce-reduction", lambda: vp.vocab_parallel_cross_entropy(torch.ones(3, 16), torch.zeros(3, dtype=torch.long), 64,
                                                                reduction="avg"), ValueError, ["reduction"], True),
    ("vp-ce-shape", lambda: vp.vocab_parallel_cross_entropy(torch.ones(3, 16), torch.zeros(4, dtype=torch.long), 64),
     ValueError, ["one target per row"], True),
    ("vp-ce-target-float", lambda: vp.vocab_parallel_cross_entropy(torch.ones(3, 16), torch.zeros(3), 64),
     TypeError, ["integer"], True),
    ("vp-ce-narrow", lambda: vp.vocab_parallel_cross_entropy(torch.ones(3, 8), torch.zeros(3, dtype=torch.long), 64),
     ValueError, ["fewer than"], True),
    ("vp-ce-logits-int", lambda: vp.vocab_parallel_cross_entropy(torch.ones(3, 16, dtype=torch.long),
                                                                 torch.zeros(3, dtype=torch.long), 64),
     TypeError, ["logits_shard", "floating-point"], True),
    ("vp-ce-logits-list", lambda: vp.vocab_parallel_cross_entropy([[1.0]], torch.zeros(1, dtype=torch.long), 64),
     TypeError, ["logits_shard", "torch.Tensor"], True),
    ("vp-logits-bytes-tp-0", lambda: vp.logits_bytes(128, 64, tp=0), ValueError, ["tp", ">= 1"], False),
    # ---- pipeline parallel
    ("pp-split-not-sequential", lambda: pp.split_model(nn.Linear(2, 2), 2), TypeError, ["nn.Sequential"], False),
    ("pp-split-0", lambda: pp.split_model(seq(), 0), ValueError, ["4 layers into 0"], False),
    ("pp-split-too-many", lambda: pp.split_model(seq(), 5), ValueError, ["at least one layer"], False),
    ("pp-split-float", lambda: pp.split_model(seq(), 2.0), TypeError, ["n_parts", "whole number"], False),
    ("pp-micro-0", lambda: pp.micro_batch_sizes(8, 0), ValueError, ["micro-batches", ">= 1"], False),
    ("pp-micro-over", lambda: pp.micro_batch_sizes(4, 8), ValueError, ["at most 4"], False),
    ("pp-micro-batch-float", lambda: pp.micro_batch_sizes(8.0, 2), TypeError, ["batch", "whole number"], False),
    ("pp-train-micro-0", lambda: pp.train(0, 2, ps.one_f_one_b, make_mlp(), [], 0, (16,)), ValueError,
     [">= 1"], False),
    ("pp-train-rank", lambda: pp.train(2, 2, ps.one_f_one_b, make_mlp(), [], 2, (16,)), ValueError,
     ["rank", "0 to 1"], False),
    ("pp-train-name", lambda: pp.train(0, 2, "1F1B", make_mlp(), [], 2, (16,)), TypeError,
     ["schedule", "make_schedule"], False),
    ("pp-train-no-net", lambda: pp.train(0, 2, ps.one_f_one_b, seq(), [], 2, (2,)), TypeError,
     ["net", "nn.Sequential"], False),
    ("pp-stage-rank", lambda: pp.PipelineStage(pp.split_model(seq(), 2), 2, 2, (2, 2)), ValueError,
     ["rank", "0 to 1"], False),
    ("pp-stage-uneven", lambda: pp.PipelineStage(pp.split_model(seq(), 3), 0, 2, (2, 2)), ValueError,
     ["3 model pieces"], False),
    ("pp-stage-in-shape", lambda: pp.PipelineStage(pp.split_model(seq(), 2), 0, 2, (2, 3)), ValueError,
     ["in_shape", "(2, 3)"], False),
    ("pp-stage-dtype", lambda: pp.PipelineStage(pp.split_model(seq(), 2), 0, 2, (2, 2), dtype=torch.int64),
     TypeError, ["dtype", "floating-point"], False),
    # ---- schedules
    ("ps-name", lambda: ps.make_schedule("2F2B", 2, 4), ValueError, ["unknown schedule", "1F1B"], False),
    ("ps-p-0", lambda: ps.one_f_one_b(0, 4), ValueError, ["p (stages)", ">= 1"], False),
    ("ps-m-0", lambda: ps.gpipe(2, 0), ValueError, ["m (micro-batches)"], False),
    ("ps-m-float", lambda: ps.zb_h1(2, 2.0), ValueError, ["m (micro-batches)"], False),
    ("ps-interleaved-m", lambda: ps.interleaved_1f1b(2, 3), ValueError, ["m"], False),
    ("ps-dualpipe-odd", lambda: ps.dualpipe(3, 4), ValueError, ["even number"], False),
    ("ps-dualpipe-v-m", lambda: ps.dualpipe_v(2, 2), ValueError, ["at least 2p"], False),
    ("ps-simulate-m", lambda: ps.simulate(ps.one_f_one_b(2, 4), 3), ValueError, ["micro-batch"], False),
    ("ps-simulate-m-0", lambda: ps.simulate(ps.one_f_one_b(2, 4), 0), ValueError, ["m", ">= 1"], False),
    ("ps-simulate-t-f", lambda: ps.simulate(ps.one_f_one_b(2, 4), 4, t_f=-1), ValueError, ["t_f", "positive"], False),
    ("ps-simulate-t-w", lambda: ps.simulate(ps.zb_h1(2, 4), 4, t_w=3.0), ValueError, ["t_w", "t_b"], False),
    ("ps-simulate-placement", lambda: ps.simulate(ps.one_f_one_b(2, 4), 4, placement="ring"), ValueError,
     ["placement"], False),
    ("ps-simulate-empty", lambda: ps.simulate([], 4), ValueError, ["schedule", "stage"], False),
    ("ps-bubble-empty", lambda: ps.bubble_fraction([]), ValueError, ["timeline", "simulate"], False),
    ("ps-peak-str", lambda: ps.peak_in_flight("F0 B0"), ValueError, ["action"], False),
    ("ps-theory-name", lambda: ps.theory("2F2B", 2, 4), ValueError, ["unknown schedule"], False),
    ("ps-theory-bubble-p-0", lambda: ps.theory_bubble(0, 4), ValueError, ["p (stages)"], False),
    ("ps-theory-bubble-m-0", lambda: ps.theory_bubble(2, 0), ValueError, ["m (micro-batches)"], False),
    ("ps-zb-v-bubble-m-0", lambda: ps.zb_v_bubble(2, 0), ValueError, ["m (micro-batches)"], False),
    ("ps-dualpipe-bubble-p", lambda: ps.dualpipe_bubble(3, 1.0, 2.0, 1.0), ValueError, ["even"], False),
    ("ps-virtual-stage-chunk", lambda: ps.virtual_stage(0, 2, 2, "v"), ValueError, ["chunk"], False),
    ("ps-virtual-stage-rank", lambda: ps.virtual_stage(2, 0, 2), ValueError, ["rank", "0 to 1"], False),
    ("ps-placement", lambda: ps.placement_of(None, "ring"), ValueError, ["placement"], False),
    # ---- 3D / 4D
    ("p3-mesh-world", lambda: p3.Mesh3D(2, 2, 2), ValueError, ["8 ranks", f"is {WORLD}"], True),
    ("p3-mesh-zero", lambda: p3.Mesh3D(4, 1, 0), ValueError, ["positive whole numbers"], True),
    ("p3-bounds-0", lambda: p3.stage_bounds(4, 0), ValueError, ["4 blocks into 0"], False),
    ("p3-bounds-over", lambda: p3.stage_bounds(2, 3), ValueError, ["2 blocks into 3"], False),
    ("p3-stage-index", lambda: p3.Stage3D(gpt(), 2, 2, None), ValueError,
     ["stage", "0 to 1"], True),
    ("p3-stage-not-gpt", lambda: p3.Stage3D(nn.Linear(2, 2), 0, 1, None), TypeError, ["TinyGPT", "Linear"], True),
    ("p3-from-dense-mesh", lambda: p3.Stage3D.from_dense(gpt(), (1, 1, 4)), TypeError, ["Mesh3D"], True),
    ("p3-train-micro-0", lambda: p3.train_step(*stage3d(), tokens(), tokens(), 0, 0.1), ValueError,
     ["n_micro", "at least 1"], True),
    ("p3-train-micro-uneven", lambda: p3.train_step(*stage3d(), tokens(), tokens(), 3, 0.1), ValueError,
     ["4 samples", "3 equal"], True),
    ("p3-train-lengths", lambda: p3.train_step(*stage3d(), tokens(), tokens(2), 1, 0.1), ValueError,
     ["x", "y", "same"], True),
    ("p3-train-lr", lambda: p3.train_step(*stage3d(), tokens(), tokens(), 1, -0.1), ValueError,
     ["lr", "non-negative"], True),
    ("p3-train-float-tokens", lambda: p3.train_step(*stage3d(), tokens().float(), tokens(), 1, 0.1),
     TypeError, ["integer"], True),
    ("p3-layout-0", lambda: p3.layout_table(0, 1, 1, 4), ValueError, ["dp", "at least 1"], False),
    ("p4-stage-mesh", lambda: p4.Stage4D.from_dense(gpt(), p3.Mesh3D(1, 1, WORLD)), TypeError, ["Mesh4D", "Mesh3D"], True),
    ("p4-train-mesh", lambda: p4.train_step(stage4d()[0], p3.Mesh3D(1, 1, WORLD), tokens(), tokens(), 0.1), TypeError,
     ["Mesh4D"], True),
    ("p4-mesh-world", lambda: p4.Mesh4D(1, 1, 2, 4), ValueError, ["8 ranks", f"is {WORLD}"], True),
    ("p4-train-seq", lambda: p4.train_step(*stage4d(), tokens(2, 6), tokens(2, 6), 0.1), ValueError,
     ["6 tokens", "multiple of 8"], True),
    ("p4-train-micro-0", lambda: p4.train_step(*stage4d(), tokens(2), tokens(2), 0.1, n_micro=0), ValueError,
     ["n_micro", "at least 1"], True),
]


@pytest.mark.parametrize("call,error,words,needs_group", params(CASES))
def test_bad_input_is_refused_in_one_sentence(request, call, error, words, needs_group):
    assert_refused_in_one_sentence(request, call, error, words, needs_group)


def test_what_is_allowed_still_works(fake_world):
    """The checks refuse only what is wrong: numpy sizes, an int in_shape, t_w = 0, lr = 0 (the
    step an outside optimizer takes), DualPipe's names in `theory`."""
    import numpy as np
    assert tpm.ColumnParallelLinear(np.int64(8), 8).weight.shape == (2, 8)
    assert tpm.ColumnParallelLinear(8, 8, sequence_parallel=True)(torch.ones(1, 1, 8)).shape == (1, 4, 2)
    assert tpm.kv_head_split(np.int64(8), 2, np.int64(4))["copies"] == 2
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert col()(torch.ones(2, 8, dtype=torch.bfloat16)).dtype == torch.bfloat16
    # meta tensors (full-size emulated runs): a device with no autocast to ask
    with torch.device("meta"):
        assert col()(torch.ones(2, 8)).shape == (2, 2)
    assert pp.split_model(seq(), np.int64(2))[1][0] is not None
    assert pp.PipelineStage(pp.split_model(seq(), 1), 0, 1, 2).in_shape == (2,)
    assert ps.bubble_fraction(ps.simulate(ps.zb_h1(2, 4), 4, t_w=0.0)) > 0
    assert ps.theory("DualPipeV", 2, 4) == ps.theory_bubble(2, 4)
    stage, mesh = stage3d()
    assert p3.train_step(stage, mesh, tokens(), tokens(), 1, 0.0) is not None
