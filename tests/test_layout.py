"""The planner's physics (distlab.layout, distlab.memory), each term against a hand computation
from the paper it comes from."""
import math

import pytest
import torch

from distlab import hardware, layout, memory
from distlab.emulate import comm_seconds

H100 = hardware.PRESETS["h100-cluster"]
NVL = H100.link_between(range(8))
S = hardware.SUSTAINED
L13 = layout.SHAPES["Llama-2 13B"]
L70 = layout.SHAPES["Llama-2 70B"]
GPT13 = (13e9, 40, 5120, 40)             # Korthikanti's GPT block at 13B's width: MLP 4h


# ---- FLOPs -----------------------------------------------------------------------------------

def test_causal_attention_flops_are_half_the_square():
    s, h = 4096, 5120
    # Q·Kᵀ and P·V: 2·s²·h each per layer and sequence; the causal mask halves them
    assert layout.attention_flops(L13, s, 1) == 4 * s * s * h / 2
    assert layout.attention_flops(L13, s, 2, tp=4, cp=2, causal=False) == 4 * 2 * s * s * h / 8


def test_model_flops_are_narayanan_eq3():
    # Narayanan et al. 2021 eq. (3), GPT 145.6B of their Table 1: B=2304, s=2048, l=80,
    # h=12288, V=51200, with full recompute: 96·B·s·l·h²·(1 + s/6h + V/16lh)
    B, s, l, h, V = 2304, 2048, 80, 12288, 51200
    gpt = hardware.Transformer(l, h, 96, 4 * h, V)
    expected = 96 * B * s * l * h * h * (1 + s / (6 * h) + V / (16 * l * h))
    got = layout.model_flops(gpt, s, B * s, recompute="full", causal=False, attention_backward=2)
    assert got == pytest.approx(expected, rel=1e-12)
    # without recompute: 72 instead of 96 for the layers and attention (3 passes, not 4)
    none = layout.model_flops(gpt, s, B * s, causal=False, attention_backward=2)
    assert none == pytest.approx(72 * B * s * l * h * h * (1 + s / (6 * h)) + 6 * B * s * h * V)


# ---- activations: sequence parallelism, recompute, GQA -----------------------------------------

def test_activations_without_sp_are_korthikanti_table2():
    s, b, h, L = 4096, 1, 5120, 40
    sbh = s * b * h
    no_sp = memory.activation_bytes(s, b, h, L, 40, tp=2)
    with_sp = memory.activation_bytes(s, b, h, L, 40, tp=2, sequence_parallel=True)
    lse = L * 4 * 40 * s * b / 2            # flash's float32 log-sum-exp, not in the paper
    assert no_sp - lse == pytest.approx(L * sbh * (10 + 24 / 2))      # 18.5 GB
    assert with_sp - lse == pytest.approx(L * sbh * 34 / 2)           # 14.3 GB
    assert round(no_sp / 1e9, 1) == 18.5 and round(with_sp / 1e9, 1) == 14.3
    # full recompute keeps the layer input: replicated without SP, split with it
    assert memory.activation_bytes(s, b, h, L, 40, True, tp=2) == L * 2 * sbh
    assert memory.activation_bytes(s, b, h, L, 40, True, tp=2, sequence_parallel=True) == \
        L * sbh
    # the planner holds the same bytes for one micro-batch in flight (pp = 1)
    kw = dict(global_batch=1, checkpointing=False, dropout=True, zero_stage=0)
    for sp, acts in ((False, no_sp), (True, with_sp)):
        r = layout.price(GPT13, 1, 1, 2, sequence_parallel=sp, **kw)
        states = sum(memory.model_state_bytes(13e9 / 2).values())
        assert r["steady_gb"] * 1e9 == pytest.approx(states + acts)


def test_gqa_shrinks_k_and_v():
    t, kv = 4096, 8 * 8192 // 64
    assert layout.layer_gemms(L70, t, 8)[0] == (t, (8192 + 2 * kv) // 8, 8192)
    parts = memory.activation_breakdown(4096, 1, 8192, 64, kv_heads=8, tp=8)
    assert parts["Q, K, V"] == (1 + 2 * 8 / 64) * 2 * 4096 * 8192 / 8
    assert layout._layer_params(L70) == 2 * 8192 ** 2 + 2 * 8192 * kv + 3 * 8192 * 28672


# ---- compute from the calibrated device -----------------------------------------------------

def test_compute_is_the_calibrated_devices_gemms():
    dev, t = H100.device, 4096
    one = layout.layer_seconds(L13, dev, 4096, 1, tp=2, recompute="none")
    def gemm(m, n, k):
        return dev.seconds(2.0 * m * n * k, 2 * (m * k + k * n + m * n), torch.bfloat16,
                           (m, n, k))
    # forward (t, out, in), input gradient (t, in, out), weight gradient (in, out, t)
    assert one["gemm"] == pytest.approx(sum(gemm(m, n, k) + gemm(m, k, n) + gemm(k, n, m)
                                            for m, n, k in layout.layer_gemms(L13, t, 2)))
    assert layout.layer_gemms(L13, t, 2) == [(t, 3 * 5120 // 2, 5120), (t, 5120, 5120 // 2),
                                             (t, 13824 // 2, 5120), (t, 13824 // 2, 5120),
                                             (t, 5120, 13824 // 2)]
    # fused attention at its kernel's rates (hardware.kernels), forward and backward (2.5× the
    # FLOPs), causal
    def attn(backward):
        shape = hardware.AttentionShape(t, t, 128, 20, True, backward)
        return layout.attention_flops(L13, t, 1, 2) / (
            dev.peak(torch.bfloat16) * dev.attention_efficiency(shape))
    assert one["attention"] == pytest.approx(attn(False) + 2.5 * attn(True))
    # the same accounting as hardware.step_seconds (validated in bench/fidelity.py) where both
    # model the same thing (full recompute, SP's element-wise split, the attention kernel's
    # forward and backward rates), within 1 %: step_seconds charges every pass in one GEMM shape,
    # the planner each in its own
    shape = hardware.Transformer(40, 5120, 40, 13824, 0, glu=True)
    ref = hardware.step_seconds(shape, H100, 2, 16, 4096, tp=2)
    lay = layout.layer_seconds(shape, dev, 4096, 1, tp=2)
    mine = 16 * 40 * (lay["gemm"] + lay["attention"] + lay["elementwise"]) / S
    assert mine + 16 * 3 * dev.floor == pytest.approx(ref["compute"], rel=0.01)
    assert ref["tp"] == pytest.approx(16 * 40 * 6 * NVL.seconds("all_reduce", 2 * 4096 * 5120, 2))


def test_the_old_fixed_mfu_is_still_there_on_request():
    kw = dict(dp=4, pp=2, tp=4, global_batch=64, seq_len=2048)
    old = layout.price("Llama-2 7B", mfu=0.4, peak_flops=989e12, **kw)
    n = memory.PRESETS["Llama-2 7B"][0]
    assert old["compute_s"] == pytest.approx(8 * n * 64 * 2048 / (32 * 989e12 * 0.4))
    new = layout.price("Llama-2 7B", **kw)
    assert new["compute_s"] != pytest.approx(old["compute_s"], rel=0.05)


# ---- recompute and its extra tensor-parallel communication ------------------------------------

def test_full_recompute_pays_six_tp_all_reduces_selective_four():
    kw = dict(dp=1, pp=1, tp=8, global_batch=4, seq_len=4096, sequence_parallel=False)
    one = NVL.seconds("all_reduce", 2 * 4096 * 5120, 8)
    vocab = 2 * one                             # vocab-parallel embedding and head
    for ckpt, n_ar in (("full", 6), ("selective", 4), ("none", 4)):
        r = layout.price("Llama-2 13B", checkpointing=ckpt, **kw)
        assert r["tp_s"] == pytest.approx(4 * (40 * n_ar * one + vocab)), ckpt
    # with sequence parallelism each all-reduce is an all-gather plus a reduce-scatter
    sp = layout.price("Llama-2 13B", checkpointing="full", **{**kw, "sequence_parallel": True})
    one_sp = (NVL.seconds("all_gather", 2 * 4096 * 5120, 8)
              + NVL.seconds("reduce_scatter", 2 * 4096 * 5120, 8))
    assert sp["tp_s"] == pytest.approx(4 * (40 * 6 * one_sp + 2 * one_sp))


def test_recompute_compute_and_memory():
    kw = dict(dp=1, pp=1, tp=2, global_batch=2, seq_len=4096)
    full = layout.price("Llama-2 13B", checkpointing="full", **kw)
    none = layout.price("Llama-2 13B", checkpointing="none", **kw)
    sel = layout.price("Llama-2 13B", checkpointing="selective", **kw)
    lay = layout.layer_seconds(L13, H100.device, 4096, 1, 2, recompute="full")
    fwd = layout.layer_seconds(L13, H100.device, 4096, 1, 2, recompute="none")
    # the recomputed forward: one more pass of the layer's forward GEMMs, attention and
    # element-wise work
    dev = H100.device
    forward = sum(dev.seconds(2.0 * m * n * k, 2 * (m * k + k * n + m * n), torch.bfloat16,
                              (m, n, k)) for m, n, k in layout.layer_gemms(L13, 4096, 2))
    attention_forward = layout.attention_flops(L13, 4096, 1, 2) / (
        dev.peak(torch.bfloat16) * dev.attention_efficiency(
            hardware.AttentionShape(4096, 4096, 128, 20, True, False)))
    assert lay["recompute"] == pytest.approx(forward + fwd["elementwise"] / 3
                                             + attention_forward)
    assert lay["gemm"] == pytest.approx(fwd["gemm"] + forward)
    assert full["recompute_s"] == pytest.approx(2 * 40 * lay["recompute"] / S)
    # with flash attention, selective recompute is what the kernel already does: free
    assert sel["step_s"] == none["step_s"] and sel["gb"] == none["gb"]
    assert full["gb"] < none["gb"] and full["step_s"] > none["step_s"]
    # with materialised scores it drops the s×s term and recomputes the attention core
    mat = dict(kw, attention="materialized")
    m_none = layout.price("Llama-2 13B", checkpointing="none", **mat)
    m_sel = layout.price("Llama-2 13B", checkpointing="selective", **mat)
    assert m_sel["gb"] < m_none["gb"] and m_sel["recompute_s"] > 0 == m_none["recompute_s"]


# ---- the pipeline: 1F1B, interleaved -----------------------------------------------------------

def test_interleaved_bubble_and_memory():
    kw = dict(dp=4, pp=8, tp=1, global_batch=512, seq_len=4096, checkpointing="full",
              cluster="h100-cluster")
    plain = layout.price("Llama-2 70B", **kw)
    two = layout.price("Llama-2 70B", interleave=2, **kw)
    m = 512 // 4
    for r, v in ((plain, 1), (two, 2)):
        # Narayanan et al. 2021 §2.2: bubble (p − 1)/(v·m) of the stage time
        # ... of a stage without the head (the fill and drain pass through the others)
        stage = r["compute_s"] - r["head_s"] + r["tp_s"]
        assert r["bubble_s"] == pytest.approx(stage * 7 / (v * m))
        pp_link = H100.link_between([0, 1])
        assert r["pp_s"] == pytest.approx(2 * (v * m + 7) * pp_link.seconds(
            "send", 2 * 4096 * 8192, 2))
    # Korthikanti §4.2.3: the first stage holds (1 + (p − 1)/(p·v)) times 1F1B's activations
    per = sum(memory.activation_breakdown(4096, 1, 8192, 64, recompute="full", tp=1,
                                          sequence_parallel=True, kv_heads=8, glu=True,
                                          ffn_mult=28672 / 8192, dropout=False).values())
    held = 8 * 10 * per                         # pp micro-batches of 80/8 layers
    assert (two["steady_gb"] - plain["steady_gb"]) * 1e9 == pytest.approx(held * 7 / 16)
    with pytest.raises(ValueError, match=r"80 layers do not split into 8 stages × 3 chunks"):
        layout.price("Llama-2 70B", interleave=3, **kw)


# ---- data parallel: overlapped except the last bucket ------------------------------------------

def test_dp_reduction_hides_behind_the_last_backward_except_its_last_bucket():
    kw = dict(dp=32, pp=1, tp=1, global_batch=64, seq_len=4096, checkpointing="none",
              cluster="h100-cluster")
    exposed = layout.price("Llama-2 13B", overlap_dp=False, **kw)
    hidden = layout.price("Llama-2 13B", **kw)
    grads = 2 * (13e9 - 2 * 32000 * 5120 + 2 * 32000 * 5120)       # every parameter, bf16
    n = math.ceil(grads / layout.BUCKET_BYTES)
    link = H100.link_between([d for d in range(32)])
    bucket = link.seconds("all_reduce", grads / n, 32)
    assert exposed["dp_s"] == pytest.approx(n * bucket)
    window = hidden["compute_s"] / 2 * 2 / 3                        # the last backward
    assert hidden["dp_s"] == pytest.approx(max(bucket, n * bucket - window * (1 - 1 / n)))
    assert hidden["dp_s"] < exposed["dp_s"]
    # one micro-batch's backward this short cannot hide it: all but the window is exposed
    tiny = layout.price("Llama-2 13B", **dict(kw, seq_len=256))
    assert tiny["dp_s"] > bucket


def test_tp_overlap_hides_behind_the_layers_gemms():
    kw = dict(dp=1, pp=1, tp=8, global_batch=2, seq_len=4096, checkpointing="none")
    off = layout.price("Llama-2 13B", **kw)
    on = layout.price("Llama-2 13B", overlap_tp=True, **kw)
    lay = layout.layer_seconds(L13, H100.device, 4096, 1, 8, recompute="none")
    one = (NVL.seconds("all_gather", 2 * 4096 * 5120, 8)
           + NVL.seconds("reduce_scatter", 2 * 4096 * 5120, 8))
    assert on["tp_s"] == pytest.approx(2 * (40 * max(0.0, 4 * one - lay["gemm"]) + 2 * one))
    assert on["tp_s"] < off["tp_s"]


# ---- the vocabulary and peak memory ----------------------------------------------------------

def test_vocabulary_parallel_head_and_logits_at_the_peak():
    kw = dict(dp=1, pp=1, tp=4, global_batch=1, seq_len=4096, zero_stage=0,
              checkpointing="full")
    par = layout.price("Llama-2 13B", **kw)
    rep = layout.price("Llama-2 13B", vocab_parallel=False, **kw)
    emb = 32000 * 5120
    # states: embedding and head, 1/tp each when vocab-parallel (16 bytes per parameter)
    layers = (13e9 - 2 * emb) / 4
    assert par["steady_gb"] * 1e9 - rep["steady_gb"] * 1e9 == pytest.approx(
        16 * (layers + 2 * emb / 4) - 16 * (layers + 2 * emb))
    # the peak adds one recomputed layer's activations and the logits (10 bytes each)
    whole = sum(memory.activation_breakdown(4096, 1, 5120, 40, tp=4, sequence_parallel=True,
                                            glu=True, ffn_mult=13824 / 5120,
                                            dropout=False).values())
    logits = 4096 * 32000 / 4 * layout.LOGIT_BYTES
    assert (par["gb"] - par["steady_gb"]) * 1e9 == pytest.approx(whole + logits)
    assert (rep["gb"] - rep["steady_gb"]) * 1e9 == pytest.approx(whole + 4 * logits)


def test_peak_decides_fits():
    r = layout.price("Llama-2 70B", dp=4, pp=8, tp=1, global_batch=512, checkpointing="full")
    assert r["gb"] > r["steady_gb"]
    tight = layout.price("Llama-2 70B", dp=4, pp=8, tp=1, global_batch=512,
                         checkpointing="full", gpu_bytes=(r["gb"] + r["steady_gb"]) / 2 * 1e9)
    assert not tight["fits"]


# ---- the ranking --------------------------------------------------------------------------

def test_rank_layouts_on_the_calibrated_model():
    rows = layout.rank_layouts("Llama-2 13B", nodes=4, gpus_per_node=8)
    assert rows[0]["fits"] and [r["step_s"] for r in rows if r["fits"]] == \
        sorted(r["step_s"] for r in rows if r["fits"])
    assert "MFU" in layout.table(rows)
    with pytest.raises(ValueError, match=r"unknown cluster 'h900'"):
        layout.price("Llama-2 13B", 4, 1, 8, cluster="h900")
    with pytest.raises(ValueError, match=r"unknown model 'Llama-9'"):
        layout.price("Llama-9", 4, 1, 8)


def test_pipeline_messages_scatter_gather_and_isend():
    kw = dict(dp=1, pp=4, tp=8, global_batch=16, seq_len=4096, checkpointing="none",
              cluster="h100-cluster")
    link = H100.link_between([0, 8])                       # stage to stage: the next node
    act = 2 * 4096 * 8192
    m = 16
    sg = layout.price("Llama-2 70B", **kw)
    whole = layout.price("Llama-2 70B", scatter_gather=False, **kw)
    # Narayanan et al. 2021 §4.1: 1/tp of the activation per message with scatter/gather
    assert sg["pp_s"] == pytest.approx(2 * (m + 3) * link.seconds("send", act / 8, 2))
    assert whole["pp_s"] == pytest.approx(2 * (m + 3) * link.seconds("send", act, 2))
    # isend: the fill and drain's 2·(pp − 1) wait; the others hide behind a micro-batch
    hidden = layout.price("Llama-2 70B", scatter_gather=False, overlap_pp=True, **kw)
    chunk = (hidden["compute_s"] - hidden["head_s"]) / m
    one = link.seconds("send", act, 2)
    assert hidden["pp_s"] == pytest.approx(2 * 3 * one + 2 * m * max(0.0, one - chunk))
    assert hidden["pp_s"] < whole["pp_s"]


# ---- issue 43: op-level selective recompute, fp32 gradients, layers pp does not divide ----------

def test_op_level_selective_recompute_keeps_what_torchtitans_policy_saves():
    # Llama 3 8B, 2 × 8192 tokens: the block input, q (1st matmul), v (3rd), the MLP gate (5th),
    # the down projection (7th), the attention output and its float32 log-sum-exp
    h, kv, ffn, t = 4096, 1024, 14336, 2 * 8192
    parts = memory.activation_breakdown(8192, 2, h, 32, recompute="selective-op", kv_heads=8,
                                        glu=True, ffn_mult=ffn / h)
    assert sum(parts.values()) == pytest.approx(2 * t * (h + h + kv + ffn + h + h) + 4 * 32 * t)
    none = memory.activation_breakdown(8192, 2, h, 32, kv_heads=8, glu=True, ffn_mult=ffn / h)
    full = memory.activation_breakdown(8192, 2, h, 32, recompute="full")
    assert sum(full.values()) < sum(parts.values()) < sum(none.values())
    shape = hardware.Transformer(32, h, 32, ffn, 128256, 8, True)
    kw = dict(dp=8, pp=1, tp=1, global_batch=16, seq_len=8192, micro_batch=2, zero_stage=3)
    op = layout.price(shape, checkpointing="selective-op", **kw)
    sel, fl = layout.price(shape, checkpointing="none", **kw), layout.price(
        shape, checkpointing="full", **kw)
    assert fl["gb"] < op["gb"] < sel["gb"]
    assert sel["step_s"] < op["step_s"] < fl["step_s"]     # half the matmuls recomputed
    assert op["peak_parts"]["fsdp buffers"] > 0


def test_fp32_gradients_cost_two_more_bytes_a_parameter():
    kw = dict(dp=4, pp=1, tp=8, global_batch=64, seq_len=2048)
    bf16 = layout.price("Llama-2 13B", **kw)
    fp32 = layout.price("Llama-2 13B", grad_bytes=4, **kw)
    n = memory.PRESETS["Llama-2 13B"][0]
    assert (fp32["gb"] - bf16["gb"]) * memory.GB == pytest.approx(2 * n / 8, rel=0.02)
    with pytest.raises(ValueError, match="grad_bytes must be 2"):
        layout.price("Llama-2 13B", grad_bytes=3, **kw)


def test_layers_that_pp_does_not_divide_are_priced_on_the_heaviest_stage():
    # Llama 3 405B: 126 layers at pp 8 (torchtitan's Table 5 runs it): 16 on the heaviest stage
    shape = hardware.Transformer(126, 16384, 128, 53248, 128256, 8, True)
    r = layout.price(shape, dp=8, pp=8, tp=8, global_batch=256, seq_len=8192,
                     checkpointing="full", zero_stage=3)
    even = hardware.Transformer(128, 16384, 128, 53248, 128256, 8, True)
    r128 = layout.price(even, dp=8, pp=8, tp=8, global_batch=256, seq_len=8192,
                        checkpointing="full", zero_stage=3)
    assert r["step_s"] == pytest.approx(r128["step_s"], rel=0.02)
    with pytest.raises(ValueError, match="do not split into 8 stages × 2 chunks"):
        layout.price(shape, dp=8, pp=8, tp=8, global_batch=256, seq_len=8192, interleave=2)


# ---- the data-parallel families: ZeRO-1, FSDP, HSDP -------------------------------------------

def test_hsdp_shards_inside_the_group_and_all_reduces_a_shard_over_the_replicas():
    """HSDP (FSDP2's fully_shard on a (replicate, shard) mesh): states / shard, the gathers and
    reduce-scatters on the shard group's link (NVLink: 8 consecutive GPUs), 1/shard of the
    gradients all-reduced over the replicas (one GPU a node: the NICs) once a step, hidden
    behind the last backward but its last layer's."""
    kw = dict(zero_stage=3, overlap_dp=False)
    fsdp = layout.price("Llama-2 13B", 32, 1, 1, **kw)
    assert layout.price("Llama-2 13B", 32, 1, 1, dp_shard=32, **kw) == fsdp   # the default
    hsdp = layout.price("Llama-2 13B", 32, 1, 1, dp_shard=8, **kw)
    n = memory.PRESETS["Llama-2 13B"][0]
    per_layer = (n - 2 * L13.vocab * L13.hidden) / L13.layers
    params = L13.layers * per_layer + 2 * L13.vocab * L13.hidden
    grads = 2 * params
    m = hsdp["micro_batches"]
    nic = H100.link_between([0, 8, 16, 24])
    expected = (m * comm_seconds("reduce_scatter", grads, 8, NVL)
                + 2 * m * comm_seconds("all_gather", grads, 8, NVL)
                + comm_seconds("all_reduce", grads / 8, 4, nic))
    assert hsdp["dp_s"] == pytest.approx(expected, rel=1e-9)
    # model states a GPU: 16 bytes a parameter over 8 ranks, not 32 (the gap is 16·N/8 − 16·N/32)
    assert (hsdp["peak_parts"]["states"] - fsdp["peak_parts"]["states"]) * memory.GB == \
        pytest.approx(16 * params * (1 / 8 - 1 / 32), rel=1e-9)
    hidden = layout.price("Llama-2 13B", 32, 1, 1, zero_stage=3, dp_shard=8)
    assert hidden["dp_s"] < hsdp["dp_s"] / 10          # prefetched, and the all-reduce overlapped
    for bad, match in ((dict(zero_stage=3, dp_shard=3), "divide"),
                       (dict(zero_stage=1, dp_shard=8), "zero_stage=3")):
        with pytest.raises(ValueError, match=match):
            layout.price("Llama-2 13B", 32, 1, 1, **bad)


def test_the_families_rank_beside_each_other_and_leave_the_old_ranking_alone():
    from distlab.layout.search import families
    old = layout.rank_layouts("Llama-2 70B", nodes=4, gpus_per_node=8)
    assert all("family" not in r for r in old)
    zero1 = layout.rank_layouts("Llama-2 70B", nodes=4, gpus_per_node=8, families=("zero1",))
    assert [{k: v for k, v in r.items() if k not in ("family", "dp_shard")} for r in zero1] == old
    every = layout.rank_layouts("Llama-2 70B", nodes=4, gpus_per_node=8,
                                families=("zero1", "fsdp", "hsdp"))
    labels = {r["family"].split()[0] for r in every}
    assert labels == {"ZeRO-1", "FSDP", "HSDP"} and "family" in layout.table(every)
    # HSDP's shard group lies inside one node: dp_shard · pp · tp GPUs divide the node's 8
    for r in every:
        if r["family"].startswith("HSDP"):
            assert 8 % (r["dp_shard"] * r["pp"] * r["tp"]) == 0 and 1 < r["dp_shard"] < r["dp"]
            assert r["family"] == f"HSDP {r['dp'] // r['dp_shard']}x{r['dp_shard']}"
    assert families("fsdp", 1, 8, 1, 4, 8) == []            # nothing to shard over
    with pytest.raises(ValueError, match="families"):
        layout.rank_layouts("Llama-2 13B", families=("zero2",))
    with pytest.raises(ValueError, match="either families or zero_stage"):
        layout.rank_layouts("Llama-2 13B", families=("fsdp",), zero_stage=3)
