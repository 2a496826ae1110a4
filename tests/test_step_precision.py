"""hardware.step_seconds with FP8 GEMMs and context parallelism (issue 43): what each option
charges, held on shapes Hypothesis picks, and the refusals in one sentence."""
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from distlab import hardware
from distlab.hardware import A100, H100, H200

LLAMA_8B = hardware.Transformer(32, 4096, 32, 14336, 128256, 8, True)
NODE = hardware.PRESETS["h100-node"]
FP8 = torch.float8_e4m3fn


def step(**kw):
    args = dict(model=LLAMA_8B, cluster=NODE, n_gpus=8, global_batch=8, seq_len=8192,
                recompute="selective-op", fsdp=True)
    args.update(kw)
    return hardware.step_seconds(**args)


def test_the_fp8_curve_reproduces_the_table_it_was_fitted_to_and_caps_below_peak():
    dev = H100.with_mode("graphs")
    rate = 2.0 * 4096 * 7168 * 16384 / dev.gemm_seconds(4096, 7168, 16384, FP8) / 1e12
    assert rate == pytest.approx(1358, rel=0.01)            # DeepGEMM, calibration row
    huge = 2.0 * 65536 ** 3 / dev.gemm_seconds(65536, 65536, 65536, FP8)
    assert huge < 0.75 * H100.peak(FP8)
    # an FP8 GEMM of a size that fills the GPU beats the same GEMM in bf16, by less than 2×
    bf16 = dev.gemm_seconds(8192, 8192, 8192, torch.bfloat16)
    assert 1.2 < bf16 / dev.gemm_seconds(8192, 8192, 8192, FP8) < 2.0


def test_bf16_and_cp_1_price_exactly_what_they_priced_before_the_options():
    base = step()
    assert step(cp=1, precision="bf16", fp8_allgather=False) == base
    assert base["cp"] == 0.0


def test_fp8_pays_for_its_casts():
    # The same step on a part whose FP8 matmuls were free: what is left over bf16's non-GEMM
    # work is the casts, which cost HBM traffic, so FP8 never comes out free
    free = H100.__class__(**{**H100.__dict__, "fp8_best": 1.0, "fp8_k_half": 0.0,
                             "flops": {**H100.flops, FP8: 1e30}})
    cluster = NODE.__class__(**{**NODE.__dict__, "device": free})
    fp8 = step(cluster=cluster, precision="fp8")
    bf16 = step(precision="bf16")
    assert 0 < fp8["compute"] < bf16["compute"]
    fused = step(precision="fp8", fused=True)["compute"]
    eager = step(precision="fp8", fused=False)["compute"]
    assert eager > fused


def test_fp8_all_gathers_move_half_the_bytes():
    two = step(n_gpus=16, global_batch=16, cluster=hardware.PRESETS["h100-cluster"],
               precision="fp8")
    one = step(n_gpus=16, global_batch=16, cluster=hardware.PRESETS["h100-cluster"],
               precision="fp8", fp8_allgather=True)
    assert one["dp"] < two["dp"]


@settings(max_examples=40, deadline=None)
@given(cp=st.sampled_from([2, 4, 8]), s0=st.sampled_from([2048, 4096, 8192]),
       tp=st.sampled_from([1, 2]), recompute=st.sampled_from(["none", "selective-op", "full"]),
       precision=st.sampled_from(["bf16", "fp8"]))
def test_cp_splits_a_sequence_and_keeps_its_attention(cp, s0, tp, recompute, precision):
    # cp ranks on a cp·s0-long sequence: each has s0 tokens, so its GEMMs are those of one rank
    # on s0 tokens, its attention more (its queries see keys from the whole sequence), and
    # the cp ranks together do no more than one rank doing the long sequence alone
    kw = dict(tp=tp, recompute=recompute, precision=precision, fsdp=False,
              cluster=hardware.PRESETS["h100-cluster"], global_batch=1)
    split = hardware.step_seconds(LLAMA_8B, n_gpus=cp * tp, seq_len=cp * s0, cp=cp, **kw)
    short = hardware.step_seconds(LLAMA_8B, n_gpus=tp, seq_len=s0, **kw)
    alone = hardware.step_seconds(LLAMA_8B, n_gpus=tp, seq_len=cp * s0, **kw)
    assert short["compute"] < split["compute"] < alone["compute"]
    assert split["cp"] >= 0.0 and split["dp_size"] == 1


def test_long_sequences_hide_the_ring_behind_attention_and_short_ones_do_not():
    slow = hardware.PRESETS["h100-cluster"]
    long = step(n_gpus=16, global_batch=2, seq_len=131072, cp=16, fsdp=False, cluster=slow)
    short = step(n_gpus=16, global_batch=2, seq_len=16384, cp=16, fsdp=False, cluster=slow)
    assert long["cp"] / long["step"] < short["cp"] / short["step"]


@pytest.mark.parametrize("call, words", [
    (lambda: step(cluster=hardware.PRESETS["a100-cluster"], precision="fp8"),
     "FP8 tensor cores"),
    (lambda: step(precision="fp16"), "precision must be"),
    (lambda: step(fp8_allgather=True), "fsdp=True and precision='fp8'"),
    (lambda: step(seq_len=8190, cp=4), "multiple of 4"),
    (lambda: step(n_gpus=8, cp=3, seq_len=8190), "tp×pp×cp"),
    (lambda: step(cp=0), "cp must be a whole number"),
    (lambda: step(interleave=2), "needs pp > 1"),
    (lambda: A100.gemm_seconds(64, 64, 64, FP8), "no FP8 tensor cores"),
])
def test_fp8_and_cp_misuse_is_refused_in_one_sentence(call, words):
    with pytest.raises(ValueError, match=words) as e:
        call()
    assert str(e.value).count(". ") <= 1 and str(e.value).endswith(".")


def test_only_hopper_parts_price_fp8():
    assert H100.has_fp8 and H200.has_fp8 and not A100.has_fp8
    assert H100.ideal().gemm_efficiency(4096, 4096, 4096, FP8) == 1.0


@settings(max_examples=30, deadline=None)
@given(pp=st.sampled_from([2, 4, 8]), v=st.sampled_from([2, 4, 5]), m=st.sampled_from([8, 16, 32]))
def test_interleaving_divides_the_bubble_and_multiplies_the_messages(pp, v, m):
    # Narayanan et al. 2021 §2.2: v chunks per stage, bubble (pp − 1)/(v·m), 2·(v·m + pp − 1)
    # stage-to-stage messages; the compute does not change
    kw = dict(n_gpus=pp, global_batch=m, seq_len=4096, pp=pp, fsdp=False, recompute="full",
              cluster=hardware.PRESETS["h100-cluster"])
    one = hardware.step_seconds(LLAMA_8B, **kw)
    many = hardware.step_seconds(LLAMA_8B, interleave=v, **kw)
    assert many["compute"] == one["compute"]
    assert many["bubble"] == pytest.approx(one["bubble"] / v, rel=1e-12)
    assert many["pp"] == pytest.approx(one["pp"] * (v * m + pp - 1) / (m + pp - 1), rel=1e-12)
