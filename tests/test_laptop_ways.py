"""Referee: torch's own ways to run distributed code without GPUs (LocalTensor, the fake process
group with CommDebugMode) against the course's (real ranks on gloo and their trace), on one
DTensor tensor-parallel MLP (distlab.laptop_ways).

- real ranks and LocalTensor give the dense MLP's output, input gradient and every parameter
  gradient, on every rank, within 1e-12 in float64 (measured: ≤ 1e-15);
- under emulation, DTensor's ops cost their local shapes and its collectives sit on the critical
  path (the course's tracer charged global shapes, 8x the FLOPs at tp = 8, and let the clock
  run past DTensor's all-reduces);
- CommDebugMode's collectives per pass (LocalTensor at the small size, the fake process group at
  Llama-3 8B's MLP size, tp = 8) equal the course's trace of the real run and of the emulated
  full-size run: one all_reduce in forward (fc2's partial sums) and one in backward (the input's
  gradient through fc1), of one activation each;
- fc2 row-parallel without its all-reduce fails all of it: wrong values on every rank, and no
  forward all_reduce in either count.
"""
import pytest

from distlab import laptop_ways as lw

TP = 4
TP_SP = {"forward": {"all_reduce": 1}, "backward": {"all_reduce": 1}}


def worst(per_rank, ref):
    """The largest difference from the dense run over ranks, output, input and parameter grads."""
    return max(max((r["out"] - ref["out"]).abs().max().item(),
                   (r["x_grad"] - ref["x_grad"]).abs().max().item(),
                   *((r["grads"][n] - g).abs().max().item() for n, g in ref["grads"].items()))
               for r in per_rank)


@pytest.fixture(scope="module")
def ref():
    return lw.dense_reference(**lw.SMALL)


def test_real_ranks_equal_dense_and_trace_two_all_reduces(ref):
    a = lw.real_ranks(TP)
    assert len(a["per_rank"]) == TP
    assert worst(a["per_rank"], ref) <= 1e-12
    assert a["comm"] == TP_SP
    act = lw.SMALL["tokens"] * lw.SMALL["d_model"] * 8      # one float64 activation
    assert a["messages"] == [("forward", "all_reduce", act), ("backward", "all_reduce", act)]
    d, ffn = lw.SMALL["d_model"], lw.SMALL["ffn"]
    assert a["per_rank"][0]["shards"]["fc1.weight"] == (ffn // TP, d)
    assert a["per_rank"][0]["shards"]["fc2.weight"] == (d, ffn // TP)


def test_local_tensor_equals_dense_on_every_simulated_rank(ref):
    b = lw.local_tensor(TP)
    assert len(b["per_rank"]) == TP
    assert worst(b["per_rank"], ref) <= 1e-12
    assert b["comm"] == TP_SP
    # each simulated rank holds its own shard of fc1's weight gradient: rows r·ffn/tp onwards
    rows = lw.SMALL["ffn"] // TP
    for r, rank in enumerate(b["per_rank"]):
        want = ref["grads"]["fc1.weight"][r * rows:(r + 1) * rows]
        assert (rank["shards"]["fc1.weight"] - want).abs().max().item() <= 1e-12


def test_fake_process_group_counts_equal_the_emulated_trace_at_full_size():
    c = lw.fake_pg(8)
    assert c["comm"] == TP_SP
    d, ffn, tokens = lw.FULL["d_model"], lw.FULL["ffn"], lw.FULL["tokens"]
    assert c["shards"]["fc1.weight"] == (ffn // 8, d) and c["shards"]["fc2.weight"] == (d, ffn // 8)
    assert c["param_bytes"] == 2 * (2 * d * ffn // 8 + ffn // 8 + d)
    assert c["activation_bytes"] == tokens * d * 2
    e = lw.emulated(8)
    assert e["comm"] == c["comm"]
    assert [m[2] for m in e["messages"]] == [c["activation_bytes"]] * 2
    # compute is charged at each rank's local shapes, not DTensor's global ones
    flops = sum(s["flops"] for s in e["trace"].compute(0) if s["name"] == "forward")
    assert flops == 2 * 2 * tokens * d * (ffn // 8)
    # backward needs the forward's reduced output: it starts when that all-reduce ends, and the
    # step ends with the backward's all-reduce (both on the critical path, as on a GPU)
    (fwd_ar, bwd_ar) = e["trace"].comm(0)
    backward = next(s for s in e["trace"].compute(0) if s["name"] == "backward")
    assert backward["start"] >= fwd_ar["end"] > fwd_ar["launch"]
    forward = next(s for s in e["trace"].compute(0) if s["name"] == "forward")
    assert e["step"] >= bwd_ar["end"] - forward["start"] - 1e-12


def test_rowwise_without_its_all_reduce_is_caught(ref):
    b = lw.local_tensor(TP, broken=True)
    assert worst(b["per_rank"], ref) > 1e-3
    assert b["comm"]["forward"] == {} and b["comm"] != TP_SP
    assert lw.fake_pg(8, broken=True)["comm"] != TP_SP
    a = lw.real_ranks(2, broken=True)
    assert worst(a["per_rank"], ref) > 1e-3 and a["comm"] != TP_SP
