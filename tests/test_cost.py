"""The α-β model: its formulas, the fit that recovers α and β, and measuring on real ranks."""
import math
import random

import pytest
import torch.distributed as dist

import distlab
from distlab import cost, nccl_tests
from distlab.cost import Link, fit, predict, terms

LINK = Link(alpha=10e-6, bandwidth=10e9)
S = 100e6


def test_ring_all_reduce_is_2_n_minus_1_alphas_plus_2_n_minus_1_over_n_bytes():
    for n in (2, 3, 8, 1000):
        expected = 2 * (n - 1) * LINK.alpha + 2 * (n - 1) / n * S / LINK.bandwidth
        assert predict("ring_all_reduce", S, n, LINK) == pytest.approx(expected, rel=1e-12)
        assert cost.ring_all_reduce_time(S, n, LINK) == pytest.approx(expected, rel=1e-12)


def test_one_rank_costs_nothing():
    for collective in cost.TERMS:
        if collective != "send":
            assert predict(collective, S, 1, LINK) == 0


def test_reduce_scatter_plus_all_gather_is_all_reduce():
    for n in (2, 5, 64):
        rs, ag = predict("ring_reduce_scatter", S, n, LINK), predict("ring_all_gather", S, n, LINK)
        assert rs + ag == pytest.approx(predict("ring_all_reduce", S, n, LINK), rel=1e-12)


@pytest.mark.parametrize("n, rounds", [(2, 1), (3, 2), (4, 2), (5, 3), (8, 3), (9, 4), (1024, 10)])
def test_tree_broadcast_takes_ceil_log2_n_rounds_of_the_whole_message(n, rounds):
    assert terms("tree_broadcast", S, n) == (rounds, rounds * S)


def test_ring_bytes_stay_below_2s_while_naive_root_bytes_grow_with_n():
    ring = [terms("ring_all_reduce", S, n)[1] for n in (2, 8, 64, 4096)]
    naive = [terms("naive_all_reduce", S, n)[1] for n in (2, 8, 64, 4096)]
    assert ring == sorted(ring) and all(b < 2 * S for b in ring)
    assert naive == [2 * (n - 1) * S for n in (2, 8, 64, 4096)]
    assert terms("ring_all_reduce", S, 2) == terms("naive_all_reduce", S / 2, 2)


def test_tree_beats_ring_broadcast_on_latency_for_tiny_messages_only():
    # A ring broadcast would take N-1 steps; the tree log2 N. For big messages a bandwidth-
    # optimal algorithm wins; the model says so through its bytes term.
    small = predict("tree_broadcast", 8, 64, LINK)
    assert small == pytest.approx(6 * (LINK.alpha + 8 / LINK.bandwidth))
    assert predict("tree_broadcast", S, 64, LINK) > predict("ring_all_gather", S, 64, LINK)


def test_bus_bandwidth_of_a_perfect_ring_is_the_link_bandwidth():
    # Times written out by hand (a ring all-reduce moves 2(N-1)/N of the tensor over each link),
    # so a wrong byte count in the model cannot cancel out between predict and bus_bandwidth.
    b = 20e9
    for n in (2, 3, 8):
        seconds = 2 * (n - 1) / n * S / b
        assert predict("ring_all_reduce", S, n, Link(0.0, b)) == pytest.approx(seconds, rel=1e-12)
        assert cost.bus_bandwidth("ring_all_reduce", S, n, seconds) == pytest.approx(b, rel=1e-12)
    # nccl-tests' convention: bus bandwidth = algorithm bandwidth (S / t) x 2(N-1)/N for an
    # all-reduce, x (N-1)/N for an all-gather or reduce-scatter of the whole tensor S.
    assert cost.bus_bandwidth("ring_all_reduce", 1e9, 4, 0.5) == pytest.approx(3e9, rel=1e-12)
    assert cost.bus_bandwidth("ring_all_gather", 1e9, 4, 0.5) == pytest.approx(1.5e9, rel=1e-12)
    assert cost.bus_bandwidth("ring_reduce_scatter", 1e9, 5, 0.1) == pytest.approx(8e9, rel=1e-12)
    assert cost.bus_bandwidth("send", 1e9, 2, 0.5) == pytest.approx(2e9, rel=1e-12)


def test_unknown_collective_and_bad_sizes_are_refused():
    with pytest.raises(ValueError, match="unknown collective"):
        terms("ring_all_reduc", S, 4)
    with pytest.raises(ValueError, match="world_size >= 1"):
        terms("ring_all_reduce", S, 0)


# ---- the memory model, against numbers worked out by hand ----------------------------------------

def test_bytes_per_parameter_of_each_precision_and_optimizer():
    from distlab.memory import bytes_per_parameter
    # bf16 weights and gradients; Adam's two fp32 moments (8) + the fp32 master copy (4).
    assert bytes_per_parameter("bf16-mixed", "adam") == {"weights": 2, "grads": 2, "optimizer": 12}
    # fp32: the weights are their own master copy; Adam keeps only its two moments.
    assert bytes_per_parameter("fp32", "adam") == {"weights": 4, "grads": 4, "optimizer": 8}
    assert bytes_per_parameter("fp32", "sgd-momentum") == {"weights": 4, "grads": 4, "optimizer": 4}
    assert bytes_per_parameter("fp32", "sgd") == {"weights": 4, "grads": 4, "optimizer": 0}
    assert bytes_per_parameter("bf16-mixed", "sgd") == {"weights": 2, "grads": 2, "optimizer": 4}


@pytest.mark.parametrize("stage, expected", [
    # The ZeRO paper's example (§5, Figure 1): 7.5B parameters, bf16 + Adam, 64 ranks.
    (0, {"weights": 15e9, "grads": 15e9, "optimizer": 90e9}),          # 120 GB
    (1, {"weights": 15e9, "grads": 15e9, "optimizer": 90e9 / 64}),     # 31.4 GB
    (2, {"weights": 15e9, "grads": 15e9 / 64, "optimizer": 90e9 / 64}),  # 16.6 GB
    (3, {"weights": 15e9 / 64, "grads": 15e9 / 64, "optimizer": 90e9 / 64}),  # 1.9 GB
])
def test_each_zero_stage_holds_the_bytes_of_the_zero_paper(stage, expected):
    from distlab.memory import model_state_bytes
    got = model_state_bytes(7.5e9, "bf16-mixed", "adam", zero_stage=stage, world_size=64)
    assert got == pytest.approx(expected, rel=1e-12)
    assert sum(got.values()) / 1e9 == pytest.approx([120, 31.4, 16.6, 1.9][stage], abs=0.05)


def test_fp32_adam_state_per_rank_at_four_ranks():
    from distlab.memory import model_state_bytes
    n = 1000
    assert [model_state_bytes(n, "fp32", "adam", s, 4) for s in range(4)] == [
        {"weights": 4000, "grads": 4000, "optimizer": 8000},
        {"weights": 4000, "grads": 4000, "optimizer": 2000},
        {"weights": 4000, "grads": 1000, "optimizer": 2000},
        {"weights": 1000, "grads": 1000, "optimizer": 2000}]


def synthetic(link, noise=0.0, seed=0):
    rng = random.Random(seed)
    out = []
    for collective, n in (("ring_all_reduce", 2), ("ring_all_reduce", 4), ("tree_broadcast", 3)):
        for size in (1 << 10, 1 << 14, 1 << 18, 1 << 22, 1 << 26):
            t = predict(collective, size, n, link) * (1 + rng.uniform(-noise, noise))
            out.append((collective, size, n, t))
    return out


@pytest.mark.parametrize("link", [Link(50e-6, 1e9), Link(3e-6, 450e9), Link(1e-3, 5e6)])
def test_fit_recovers_alpha_and_bandwidth_exactly_from_exact_data(link):
    got = fit(synthetic(link))
    assert got.alpha == pytest.approx(link.alpha, rel=1e-9)
    assert got.bandwidth == pytest.approx(link.bandwidth, rel=1e-9)
    assert max(abs(e) for e in cost.relative_errors(synthetic(link), got)) < 1e-9


def test_fit_is_close_under_ten_percent_noise():
    link = Link(50e-6, 2e9)
    got = fit(synthetic(link, noise=0.1, seed=3))
    assert got.alpha == pytest.approx(link.alpha, rel=0.25)
    assert got.bandwidth == pytest.approx(link.bandwidth, rel=0.25)


def test_fit_never_returns_a_negative_latency():
    # Pure bandwidth data with noise that pulls the unconstrained α below zero.
    data = [("send", s, 2, s / 1e9 * f) for s, f in ((1e3, 0.5), (1e6, 1.0), (1e8, 1.0))]
    got = fit(data)
    assert got.alpha >= 0 and math.isfinite(got.bandwidth) and got.bandwidth > 0


def test_fit_needs_two_sizes_to_tell_alpha_from_beta():
    with pytest.raises(ValueError, match="at least two"):
        fit([("send", 1e3, 2, 1e-5)])
    with pytest.raises(ValueError, match="different sizes"):
        fit([("send", 1e3, 2, 1e-5), ("send", 1e3, 2, 2e-5)])


def test_presets_are_ordered_as_the_hardware_is():
    p = cost.PRESETS
    assert p["nvlink4"].bandwidth > p["infiniband_ndr"].bandwidth > p["ethernet_100g"].bandwidth \
        > p["ethernet_10g"].bandwidth
    assert cost.INTRA_NODE.bandwidth > cost.INTER_NODE.bandwidth
    assert cost.INTRA_NODE.alpha < cost.INTER_NODE.alpha


def measure_rank(rank, world_size):
    return cost.measure(dist.all_reduce, [1 << 10, 1 << 16], repeats=2)


def test_measure_returns_one_positive_time_per_size_and_the_same_on_every_rank():
    results = distlab.run(measure_rank, 3)
    assert all(len(r) == 2 and all(t > 0 for t in r) for r in results)
    assert results[0] == results[1] == results[2]  # the slowest rank's time, agreed by all


# ---- reading a real cluster: nccl-tests -----------------------------------------------------------

LOG = open(__import__("os").path.join(__import__("os").path.dirname(__file__), "data",
                                      "all_reduce_perf_8xh100.txt")).read()
# tests/data/all_reduce_perf_8xh100.txt is a REPRESENTATIVE log in the exact all_reduce_perf
# format (header, rank lines, the out-of-place / in-place table, the footer) with the shape
# NVIDIA's issues show for 8 H100s: a ~13 µs floor and ~475 GB/s busbw with NVLS. Not a
# measurement.


def test_the_nccl_tests_table_is_read_row_by_row():
    log = nccl_tests.read_nccl_tests(LOG)
    assert (log.world_size, log.nodes, log.collective) == (8, 1, "all_reduce")
    assert "H100" in log.gpu and len(log.rows) == 31
    first, last = log.rows[0], log.rows[-1]
    assert (first["size"], first["count"], first["type"], first["redop"]) == (8, 2, "float", "sum")
    assert first["time"] == pytest.approx(12.96e-6) and first["time_in_place"] == pytest.approx(13.12e-6)
    assert last["size"] == 8 << 30 and last["busbw"] == pytest.approx(473.70e9)
    m = log.measurements
    assert m[0] == ("ring_all_reduce", 8, 8, pytest.approx(12.96e-6))


def test_an_older_log_without_a_root_column_and_with_mpi_tags_is_read_too():
    old = """#   Rank  0 Pid  1 on host-a device  0 [0x00] NVIDIA A100-SXM4-80GB
#   Rank  1 Pid  2 on host-b device  0 [0x00] NVIDIA A100-SXM4-80GB
#       size         count    type   redop     time   algbw   busbw  error     time   algbw   busbw  error
[0]      1048576        262144   float     sum    80.10   13.09   13.09  0e+00    79.90   13.12   13.12  0e+00
[0]     16777216       4194304   float     sum    740.2   22.67   22.67  0e+00    738.1   22.73   22.73  0e+00
"""
    log = nccl_tests.read_nccl_tests(old)
    assert (log.world_size, log.nodes) == (2, 2) and "A100" in log.gpu
    assert [r["size"] for r in log.rows] == [1048576, 16777216]
    assert log.rows[1]["time_in_place"] == pytest.approx(738.1e-6)


def test_a_log_becomes_a_cluster_to_emulate_with_and_a_table_against_the_platform():
    from distlab import emulate
    cluster = nccl_tests.nccl_tests_cluster(LOG)
    assert emulate.resolve(cluster, world_size=8) is cluster
    link = cluster.link_between(range(8))
    big = 8 << 30
    busbw = cost.bus_bandwidth("ring_all_reduce", big, 8, link.seconds("all_reduce", big, 8))
    assert 400e9 < busbw < 500e9
    assert 10e-6 < link.seconds("all_reduce", 8, 8) < 20e-6
    table = nccl_tests.busbw_table(LOG)
    lines = table.splitlines()
    assert "your busbw" in lines[1] and "expected" in lines[1]
    last = lines[-1].split()
    assert last[0] == str(8 << 30) and abs(float(last[-1]) - 1) < 0.05   # ~ what H100 should reach
    mid = next(l.split() for l in lines if l.split()[:1] == [str(2 << 20)])
    assert float(mid[-1]) < 0.8          # the protocol switch the model does not know


def test_a_log_that_is_not_nccl_tests_gets_a_sentence():
    with pytest.raises(ValueError, match="no nccl-tests table"):
        nccl_tests.read_nccl_tests("hello\nworld\n")
    with pytest.raises(ValueError, match="world_size"):
        nccl_tests.read_nccl_tests("           8             2     float     sum      -1    12.9    0.00"
                             "    0.00      0    13.1    0.00    0.00      0\n")
    with pytest.raises(ValueError, match="platform"):
        nccl_tests.busbw_table("#  Rank  0 Group 0 Pid 1 on h device 0 [0x0] Some GPU\n"
                         "           8             2     float     sum      -1    12.9    0.00"
                         "    0.00      0    13.1    0.00    0.00      0\n")


def test_fit_with_a_latency_floor_recovers_a_flat_latency():
    link = Link(15e-6, 400e9)
    data = [("ring_all_reduce", s, 8, link.alpha + terms("ring_all_reduce", s, 8)[1] / 400e9)
            for s in (8, 1 << 20, 1 << 26, 1 << 30)]
    got = fit(data, latency="floor")
    assert got.alpha == pytest.approx(15e-6, rel=1e-6) and got.bandwidth == pytest.approx(400e9)


# ---- pipelined rows, the lower bound, and what NCCL's broadcast is --------------------------------

def test_pipelined_ring_broadcast_and_tree_all_reduce_terms():
    assert terms("ring_broadcast", S, 8) == (7, S) == terms("ring_reduce", S, 8)
    assert terms("tree_all_reduce", S, 8) == (6, 2 * S)
    assert terms("tree_all_reduce", S, 9) == (8, 2 * S)
    assert terms("ring_broadcast", S, 1) == (0, 0.0) == terms("tree_all_reduce", S, 1)
    # the tree: fewer latencies than the ring at 64 ranks, within N/(N-1) of its bytes
    ring, tree = terms("ring_all_reduce", S, 64), terms("tree_all_reduce", S, 64)
    assert tree[0] == 12 < ring[0] == 126 and tree[1] / ring[1] == pytest.approx(64 / 63)
    # a pipelined ring broadcast beats the binomial tree on bytes for large messages only
    assert predict("ring_broadcast", S, 64, LINK) < predict("tree_broadcast", S, 64, LINK)
    assert predict("ring_broadcast", 8, 64, LINK) > predict("tree_broadcast", 8, 64, LINK)


def test_the_all_reduce_lower_bound_is_what_the_ring_meets():
    from distlab.cost import all_reduce_lower_bound
    for n in (2, 3, 8, 64):
        bound = all_reduce_lower_bound(S, n, LINK.bandwidth)
        assert bound == pytest.approx(terms("ring_all_reduce", S, n)[1] / LINK.bandwidth)
        assert bound <= terms("tree_all_reduce", S, n)[1] / LINK.bandwidth
    assert all_reduce_lower_bound(S, 1, 1e9) == 0.0
    with pytest.raises(ValueError, match="bandwidth > 0"):
        all_reduce_lower_bound(S, 4, 0)


def test_broadcast_and_reduce_are_charged_as_nccl_runs_them_a_pipelined_ring():
    from distlab import emulate, hardware
    # α-β link: (N-1)·α + S/B, not ceil(log2 N)·(α + S/B)
    assert emulate.comm_seconds("broadcast", S, 8, LINK) == pytest.approx(
        7 * LINK.alpha + S / LINK.bandwidth)
    assert emulate.comm_seconds("reduce", S, 8, LINK) == emulate.comm_seconds("broadcast", S, 8,
                                                                              LINK)
    # a calibrated link: busbw = algbw for broadcast, so 1 GB on 8 GPUs takes S / ring busbw
    nvlink = hardware.PRESETS["h100-node"].intra
    t = nvlink.seconds("broadcast", 1 << 30, 8)
    # (the size ramp: a 1 GiB message runs at 98 % of the large-message busbw)
    assert t == pytest.approx(nvlink.latency + 7 * nvlink.hop
                              + (1 << 30) / (370e9 * nvlink.filled(1 << 30)))
    assert nvlink.seconds("broadcast", 1 << 30, 64) == pytest.approx(
        t + 56 * nvlink.hop)          # adding ranks adds steps, not bytes


# ---- bad calls get one sentence that says what to pass (issue 42) -------------------------------

NAN = float("nan")


@pytest.mark.parametrize("call, words", [
    (lambda: predict("ring_all_reduce", -1, 4, LINK), "nbytes.*finite number >= 0.*got -1"),
    (lambda: predict("ring_all_reduce", NAN, 4, LINK), "nbytes.*got nan"),
    (lambda: predict("ring_all_reduce", math.inf, 4, LINK), "nbytes.*got inf"),
    (lambda: predict("ring_all_reduce", "1MB", 4, LINK), "nbytes.*got '1MB'"),
    (lambda: predict("ring_all_reduce", S, 0, LINK), "world_size >= 1.*got 0"),
    (lambda: predict("ring_all_reduce", S, 2.5, LINK), "world_size >= 1.*got 2.5"),
    (lambda: predict("ring_all_reduce", S, NAN, LINK), "world_size >= 1.*got nan"),
    (lambda: terms("ring_all_reduce", S, True), "world_size >= 1.*got True"),
    (lambda: cost.ring_all_reduce_time(NAN, 4, LINK), "nbytes.*got nan"),
    (lambda: cost.all_reduce_lower_bound(NAN, 4, 1e9), "nbytes.*got nan"),
    (lambda: cost.all_reduce_lower_bound(S, 4, NAN), "bandwidth > 0"),
    (lambda: cost.bus_bandwidth("ring_all_reduce", S, 4, 0), "seconds.*> 0.*got 0"),
    (lambda: cost.bus_bandwidth("ring_all_reduce", S, 4, NAN), "seconds.*got nan"),
    (lambda: fit([("ring_all_reduce", -5, 4, 1e-3), ("ring_all_reduce", S, 4, 1e-2)]),
     "nbytes.*got -5"),
    (lambda: Link(NAN, 1e9), "alpha must be"),
    (lambda: Link(1e-6, -1e9), "bandwidth must be"),
])
def test_bad_calls_to_the_cost_model_are_refused_in_one_sentence(call, words):
    with pytest.raises((ValueError, TypeError), match=words) as info:
        call()
    message = str(info.value)
    assert "\n" not in message and message.endswith(".")
