"""When each strategy becomes communication-bound: the closed forms of chapters 06b, 07b and 09b
(properties), and every number the chapters' prose quotes, read from their stored outputs."""
import json
import math
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings, strategies as st

from distlab import hardware, moe_at_scale, tensor_parallel as tpm, zero_memory

NOTEBOOKS = Path(__file__).resolve().parent.parent / "notebooks"
RATE = st.floats(1e12, 5e15)
BW = st.floats(1e9, 2e12)
C = hardware.H100.peak(torch.bfloat16) * hardware.H100.gemm_efficiency(8192, 8192, 8192)


# ---- the closed forms: monotone, and equal sides at the crossover ------------------------------

@settings(max_examples=60, deadline=None)
@given(RATE, BW, st.integers(1, 1024), st.floats(1.01, 10))
def test_zero3_crossover_is_where_forward_equals_gather(rate, busbw, n, faster):
    t = zero_memory.comm_bound_tokens(rate, busbw, n)
    params = 4096 * 4096                                       # cancels: any P
    forward, gather = 2 * params * t / rate, (n - 1) / n * 2 * params / busbw
    assert forward == pytest.approx(gather, rel=1e-9, abs=1e-300)
    assert zero_memory.comm_bound_tokens(rate, busbw * faster, n) <= t     # a faster link: fewer
    assert zero_memory.comm_bound_tokens(rate * faster, busbw, n) >= t     # a faster GPU: more
    if n > 1:
        assert zero_memory.comm_bound_tokens(rate, busbw, n + 1) > t


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 64), RATE, BW, st.floats(4, 20), st.floats(1.01, 10))
def test_tp_crossover_is_where_allreduces_equal_matmuls(tp, rate, busbw, k, faster):
    d = tpm.comm_bound_width(tp, rate, busbw, k)
    for tokens in (1, 4096):                                   # tokens cancel
        comm = 4 * 2 * (tp - 1) / tp * 2 * tokens * d / busbw
        compute = 6 * k * d * d * tokens / (tp * rate)
        assert comm == pytest.approx(compute, rel=1e-9, abs=1e-300)
    assert tpm.comm_bound_width(tp, rate, busbw * faster, k) <= d
    assert tpm.comm_bound_width(tp + 1, rate, busbw, k) > d
    assert tpm.comm_bound_width(tp, rate, busbw, 12) == pytest.approx(2 * (tp - 1) * rate / (9 * busbw))


@settings(max_examples=60, deadline=None)
@given(RATE, BW, st.integers(2, 256), st.integers(1, 16), st.floats(1.01, 10))
def test_ep_crossover_is_where_all_to_all_equals_the_expert(rate, busbw, ep, k, faster):
    tokens, d = 8192, 4096
    routed = moe_at_scale.comm_bound_width(rate, busbw, ep)
    a2a = 2 * (ep - 1) / ep * 2 * k * tokens * d / busbw           # dispatch + combine
    assert a2a == pytest.approx(6 * k * tokens * d * routed / rate, rel=1e-9)
    shared = moe_at_scale.comm_bound_width(rate, busbw, ep, top_k=k)
    dispatch = (ep - 1) / ep * 2 * k * tokens * d / busbw
    assert dispatch == pytest.approx(6 * tokens * d * shared / rate, rel=1e-9)
    assert moe_at_scale.comm_bound_width(rate, busbw * faster, ep, top_k=k) <= shared
    assert moe_at_scale.comm_bound_width(rate, busbw, ep, top_k=k + 1) > shared


@pytest.mark.parametrize("call", [
    lambda: zero_memory.comm_bound_tokens(0, 1e9, 2),
    lambda: zero_memory.comm_bound_tokens(1e12, math.inf, 2),
    lambda: zero_memory.comm_bound_tokens(1e12, 1e9, 0),
    lambda: tpm.comm_bound_width(0, 1e12, 1e9),
    lambda: tpm.comm_bound_width(2, 1e12, -1.0),
    lambda: moe_at_scale.comm_bound_width(1e12, 1e9, True),
    lambda: moe_at_scale.comm_bound_width(1e12, 1e9, 8, top_k=0),
])
def test_bad_input_is_refused_with_a_sentence(call):
    with pytest.raises(ValueError, match="must be"):
        call()


# ---- the prose quotes the stored outputs --------------------------------------------------------

def _cells(name):
    return json.loads((NOTEBOOKS / name).read_text())["cells"]


def _outputs(name):
    return "\n".join("".join(o.get("text", "")) for c in _cells(name) if c["cell_type"] == "code"
                     for o in c.get("outputs", []))


def _prose(name):
    return " ".join(" ".join("".join(c["source"]) for c in _cells(name)
                             if c["cell_type"] == "markdown").split())


def test_chapter_06b_table_and_verdict():
    out, prose = _outputs("06b_zero3_at_scale.ipynb"), _prose("06b_zero3_at_scale.ipynb")
    links = (hardware.NVLINK4, hardware.IB_NDR, hardware.ETH_100G)
    for n in (2, 8, 64):
        row = [f"{zero_memory.comm_bound_tokens(C, l.busbw('all_gather'), n):,.0f}" for l in links]
        assert " ".join(row) in " ".join(out.split()), row
    assert "emulator agrees: gathers exposed below T*, hidden above: True" in out
    # "about 2,000 / 15,000 / 70,000" for the 8-GPU group; "about a third" exposed below T*
    n8 = [zero_memory.comm_bound_tokens(C, l.busbw("all_gather"), 8) for l in links]
    assert [round(x, -3) for x in n8] == [2000, 15000, 70000]
    assert "from about 2,000 tokens per GPU" in prose and "it needs about 15,000" in prose
    assert "about 70,000" in prose and "about a third of the forward" in prose
    assert "gathers exposed beyond the first  27%" in out and "first  33%" in out


def test_chapter_07b_table_and_verdict():
    out, prose = _outputs("07b_tensor_parallel_in_practice.ipynb"), _prose(
        "07b_tensor_parallel_in_practice.ipynb")
    k = 4 + 3 * 11008 / 4096
    links = (hardware.NVLINK4, hardware.IB_NDR, hardware.ETH_100G)
    for tp in (2, 4, 8):
        row = [f"{tpm.comm_bound_width(tp, C, l.busbw('all_reduce'), k):,.0f}" for l in links]
        assert " ".join(row) in " ".join(out.split()), row
    assert f"(d\\* = {tpm.comm_bound_width(8, C, 480e9, k):,.0f})" in prose.replace("d\\*", "d\\*")
    assert f"d > {tpm.comm_bound_width(2, C, 47e9, k):,.0f}" in prose
    assert f"a width of {tpm.comm_bound_width(8, C, 47e9, k):,.0f}" in prose
    assert "emulator agrees: communication-bound below d*, compute-bound above: True" in out
    for emulated, closed in (("1.65", "2.00"), ("0.97", "1.00"), ("0.50", "0.50")):
        assert f"comm / compute {emulated} (closed form {closed})" in out
    assert "1.65, 0.97 and 0.50 of the compute against its 2.00, 1.00 and 0.50" in prose


def test_chapter_09b_table_and_verdict():
    out, prose = _outputs("09b_moe_at_scale.ipynb"), _prose("09b_moe_at_scale.ipynb")
    links = (hardware.NVLINK4, hardware.IB_NDR, hardware.ETH_100G)
    for k in (None, 2, 8):
        row = [f"{moe_at_scale.comm_bound_width(C, l.busbw('all_to_all'), 8, k):,.0f}" for l in links]
        assert " ".join(row) in " ".join(out.split()), row
    ib = moe_at_scale.comm_bound_width(C, hardware.IB_NDR.busbw("all_to_all"), 8)
    assert f"over one InfiniBand NIC per GPU ({ib:,.0f})" in prose and ib < 14336
    # DeepSeek-V3's 2,048-wide experts: communication-bound on every link between nodes
    assert all(moe_at_scale.comm_bound_width(C, l.busbw("all_to_all"), 8, k) > 2048
               for l in links[1:] for k in (None, 8))
    assert "emulator agrees: dispatch exposed below f*, hidden above: True" in out
