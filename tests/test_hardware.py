"""The calibrated hardware model: its curves and floors, its refusals, and that the emulator and
the cost model charge it the same way."""
import math

import pytest
from hypothesis import given, settings, strategies as st
import torch

import distlab
from distlab import cost, emulate, hardware
from distlab.hardware import A100, H100, H200, Cluster, Device, Link

H100_NODE = hardware.PRESETS["h100-node"]


def test_a_big_gemm_reaches_the_measured_best_and_a_small_one_far_less():
    big = H100.gemm_efficiency(8192, 8192, 8192)
    assert 0.75 < big <= H100.gemm_best
    assert H100.gemm_efficiency(256, 256, 256) < 0.4 * big
    m, n, k = 2048, 1024, 4096
    t = H100.gemm_seconds(m, n, k)
    assert t == pytest.approx(2 * m * n * k / (989e12 * H100.gemm_efficiency(m, n, k)))
    # without a shape (an op known only by its FLOPs and bytes) it is the square GEMM's
    d = 2048
    assert H100.seconds(2.0 * d ** 3, 2 * 3 * d * d, torch.bfloat16) == \
        pytest.approx(H100.gemm_seconds(d, d, d))


def test_the_same_flops_in_fewer_output_tiles_run_slower():
    """OpenXLA's H100 table: 1024×1024×2048 reaches 350 TFLOP/s, 2048×1024×2048 523 — a
    smaller output fills fewer SMs; a shallow k pays each tile's fixed cost more often."""
    assert H100.gemm_efficiency(1024, 1024, 2048) < 0.8 * H100.gemm_efficiency(2048, 1024, 2048)
    assert H100.gemm_efficiency(4096, 4096, 256) < 0.6 * H100.gemm_efficiency(4096, 4096, 4096)
    # a batched matmul fills the machine with its batch
    assert H100.gemm_efficiency(512, 512, 128, batch=64) > \
        3 * H100.gemm_efficiency(512, 512, 128)


def test_an_eager_op_costs_at_least_the_launch_floor_and_graphs_less():
    assert H100.seconds(0, 8, torch.float32) == H100.launch_floor == pytest.approx(10e-6)
    assert H100.with_mode("graphs").seconds(0, 8, torch.float32) == H100.graph_floor
    big_copy = 4e9
    assert H100.seconds(0, big_copy, torch.float32) == pytest.approx(big_copy / (0.9 * 3.35e12))
    assert H100.ideal().seconds(0, 8, torch.float32) == pytest.approx(8 / 3.35e12)
    assert H200.memory_bandwidth > H100.memory_bandwidth


def test_small_collectives_cost_a_near_flat_floor_and_big_ones_the_achieved_busbw():
    link = H100_NODE.intra
    small = [link.seconds("all_reduce", 8, n) for n in (2, 4, 8)]
    assert 7e-6 < small[0] < small[-1] < 16e-6            # ~10-15 µs, not 2(N-1)·α
    big = 8 << 30
    busbw = cost.bus_bandwidth("ring_all_reduce", big, 8, link.seconds("all_reduce", big, 8))
    assert busbw == pytest.approx(480e9, rel=0.01)        # NVLS
    gather = cost.bus_bandwidth("ring_all_gather", big, 8, link.seconds("all_gather", big, 8))
    assert gather == pytest.approx(370e9, rel=0.01)       # ring
    a100 = hardware.PRESETS["a100-node"].intra
    assert cost.bus_bandwidth("ring_all_reduce", big, 8,
                              a100.seconds("all_reduce", big, 8)) == pytest.approx(230e9, rel=0.01)


def test_a_cross_node_group_uses_every_nic_of_its_nodes():
    two = hardware.PRESETS["a100-2x8"]
    everyone = two.link_between(range(16))
    assert everyone.bandwidth == pytest.approx(min(230e9, 8 * 24e9))      # 192 GB/s
    one_per_node = two.link_between([0, 8])
    assert one_per_node.bandwidth == pytest.approx(24e9)
    four_per_node = two.link_between([0, 1, 2, 3, 8, 9, 10, 11])
    assert four_per_node.bandwidth == pytest.approx(4 * 24e9)
    assert two.link_between(range(8)) is two.intra
    small = everyone.seconds("all_reduce", 8, 16)
    assert 20e-6 < small < 30e-6                          # ~25 µs across two nodes


def test_the_datasheet_variant_shows_the_gap():
    ideal = hardware.DATASHEET["h100-node-datasheet"]
    assert ideal.device.seconds(2 * 8192 ** 3, 3 * 2 * 8192 ** 2, torch.bfloat16) \
        == pytest.approx(2 * 8192 ** 3 / 989e12)
    assert ideal.intra.bandwidth == 450e9
    assert emulate.PRESETS["h100-node-datasheet"] is ideal
    # never slower than the calibrated node, all_reduce (NVLS) included
    calibrated = hardware.PRESETS["h100-node"].intra
    for op in ("all_reduce", "all_gather"):
        assert ideal.intra.seconds(op, 1 << 30, 8) < calibrated.seconds(op, 1 << 30, 8)


@pytest.mark.parametrize("make, words", [
    (lambda: Link("x", float("nan")), "bandwidth must be a finite number > 0"),
    (lambda: Link("x", 1e9, latency=-1e-6), "latency must be a finite number >= 0"),
    (lambda: Link("x", 0.0), "bandwidth"),
    (lambda: cost.Link(float("nan"), 1e9), "alpha"),
    (lambda: cost.Link(1e-6, -5.0), "bandwidth"),
    (lambda: cost.Link(1e-6, 0), "bandwidth"),
    (lambda: Device("d", {torch.float32: 0.0}, 1e12), "flops"),
    (lambda: Device("d", {torch.float32: 1e12}, float("nan")), "memory_bandwidth"),
    (lambda: Device("d", {torch.float32: 1e12}, 1e12, launch_floor=-1), "launch_floor"),
    (lambda: Device("d", {torch.float32: 1e12}, 1e12, mode="fast"), "mode"),
    (lambda: Cluster("c", A100, hardware.NVLINK3, ranks_per_node=0), "ranks_per_node"),
    (lambda: Cluster("c", "A100", hardware.NVLINK3), "device"),
])
def test_bad_numbers_are_refused_in_one_sentence(make, words):
    with pytest.raises(ValueError, match=words) as info:
        make()
    assert "\n" not in str(info.value)


def _nothing(rank, world_size):
    return rank


def test_more_ranks_than_the_emulated_cluster_has_are_refused():
    with pytest.raises(ValueError, match="has 8 GPUs") as info:
        distlab.run(_nothing, 9, emulate="a100-nvlink")
    assert "\n" not in str(info.value)
    with pytest.raises(ValueError, match="has 16 GPUs"):
        emulate.resolve("h100-2x8", world_size=17)
    assert emulate.resolve("h100-cluster", world_size=1024).nodes is None
    assert emulate.resolve("h100-ib", world_size=64) is emulate.PRESETS["h100-ib"]


def test_the_emulator_and_the_cost_model_charge_a_calibrated_link_alike():
    link = H100_NODE.intra
    for op, term in (("all_reduce", "ring_all_reduce"), ("all_gather", "ring_all_gather")):
        assert emulate.comm_seconds(op, 1 << 20, 4, link) == cost.predict(term, 1 << 20, 4, link)
    assert emulate.comm_seconds("send", 4000, 2, link) == pytest.approx(
        link.alpha + 4000 / link.bandwidth)
    # with the measured regimes: its own (p2p) rate, on the size ramp
    measured = hardware.measured(link)
    assert emulate.comm_seconds("send", 4000, 2, measured) == pytest.approx(
        link.alpha + 4000 / (measured.p2p_bandwidth * measured.filled(4000)))
    assert measured.filled(4 << 30) > 0.998 and measured.filled(16 << 20) < 0.6
    # the course's first preset names are calibrated too; their datasheet twins show the gap
    assert emulate.PRESETS["a100-nvlink"] is hardware.CALIBRATED_LEGACY["a100-nvlink"]
    legacy = emulate.PRESETS["a100-nvlink"].intra
    assert emulate.comm_seconds("all_reduce", 4000, 4, legacy) == pytest.approx(
        legacy.latency + 6 * legacy.hop + 1.5 * 4000 / (230e9 * legacy.filled(4000)))
    ideal = emulate.PRESETS["a100-nvlink-datasheet"].intra
    assert emulate.comm_seconds("all_reduce", 4 << 30, 4, ideal) < \
        emulate.comm_seconds("all_reduce", 4 << 30, 4, legacy) * 0.8


def test_a_transformer_step_is_priced_from_its_parts():
    llama7b = hardware.Transformer(32, 4096, 32, 11008, 32000, glu=True)
    assert llama7b.params() == pytest.approx(6.74e9, rel=0.01)
    parts = hardware.step_seconds(llama7b, hardware.PRESETS["h100-cluster"], 64, 256, 4096,
                                  tp=2, pp=2)
    assert parts["step"] > parts["compute"] > 0 and parts["bubble"] > 0 and parts["tp"] > 0
    assert math.isfinite(parts["dp"]) and parts["dp_size"] == 16


def test_the_first_presets_have_calibrated_twins_of_the_same_shape():
    legacy, calibrated = emulate.LEGACY if hasattr(emulate, "LEGACY") else None, \
        hardware.CALIBRATED_LEGACY
    for name, cluster in calibrated.items():
        old = emulate.PRESETS[name] if legacy is None else legacy[name]
        assert (cluster.name, cluster.ranks_per_node) == (old.name, old.ranks_per_node)
        assert (cluster.inter is None) == (old.inter is None)
    ring = calibrated["a100-ethernet"].inter.alpha_beta()
    assert isinstance(ring, cost.Link) and ring.alpha == pytest.approx(10e-6) and ring.bandwidth == 10e9


def test_an_all_to_all_across_nodes_goes_through_each_members_own_nics():
    """A ring across nodes spreads over k NICs (min(NVLink, k × NIC)); an all_to_all's bytes
    for other nodes leave through the member's own NIC share, its node's bytes over NVLink."""
    two = hardware.PRESETS["h100-2x8"]
    link = two.link_between(range(16))
    size = 128 << 20
    remote = size * 8 / 16 / hardware.IB_NDR.bandwidth        # half its bytes, one NIC each
    local = size * 7 / 16 / hardware.NVLINK4.bandwidth
    assert link.seconds("all_to_all", size, 16) == pytest.approx(
        link.latency + link.hop + max(remote, local) / link.filled(size))
    assert link.seconds("all_to_all", size, 16) > 3 * link.bandwidth ** -1 * size * 15 / 16
    from distlab.expert_parallel import all_to_all_seconds
    assert all_to_all_seconds(size, 16, two) == link.seconds("all_to_all", size, 16)


def test_a_group_split_unevenly_over_nodes_is_charged_for_the_members_each_node_holds():
    """Issue 42 item 9: ranks 0-3 on node 0 and rank 8 on node 1 (4+1). NCCL's small-message
    tree climbs a chain of 4 inside node 0 (not 5 // 2 = 2); a ring reaches the second node
    through the one NIC its single member has; that member's all_to_all bytes for node 0 (4/5
    of what it sends) leave through that NIC alone."""
    two = hardware.PRESETS["h100-2x8"]
    nvl, nic = hardware.NVLINK4, hardware.IB_NDR
    uneven, even = two.link_between([0, 1, 2, 3, 8]), two.link_between([0, 1, 2, 3, 8, 9, 10, 11])
    tiny = uneven.seconds("all_reduce", 8, 5)
    assert tiny == pytest.approx(nic.latency + 2 * 3 * nvl.hop + 2 * nic.hop
                                 + 1.6 * 8 / (47e9 * uneven.filled(8)))
    assert uneven.bandwidth == 47e9 and even.bandwidth == 4 * 47e9
    size = 1 << 30
    assert uneven.seconds("all_to_all", size, 5) == pytest.approx(
        nic.latency + nic.hop + size * 4 / 5 / 47e9 / uneven.filled(size))
    # ring collectives: 5 - 1 steps, one across each way, the rest on NVLink
    assert uneven.seconds("all_gather", 8, 5) == pytest.approx(
        nic.latency + 3 * nvl.hop + nic.hop + 8 * 4 / 5 / 47e9 / uneven.filled(8))
    # the same group in the other order, and 1+4, cost the same
    assert two.link_between([8, 3, 2, 1, 0]).seconds("all_reduce", 8, 5) == tiny
    assert two.link_between([0, 8, 9, 10, 11]).seconds("all_to_all", size, 5) == pytest.approx(
        uneven.seconds("all_to_all", size, 5))


LLAMA7B = hardware.Transformer(32, 4096, 32, 11008, 32000, glu=True)
NAN = float("nan")


@pytest.mark.parametrize("call, words", [
    # issue 42 item 18: fewer samples than replicas (before: ZeroDivisionError), GPUs that
    # tp×pp does not divide (before: modelled silently with 12 of 14)
    (lambda: hardware.step_seconds(LLAMA7B, H100_NODE, 8, 4, 4096),
     "global_batch=4 .* 8 data-parallel replicas.*at least 8"),
    (lambda: hardware.step_seconds(LLAMA7B, hardware.PRESETS["h100-cluster"], 14, 64, 4096,
                                   tp=4), "n_gpus=14 .*tp×pp = 4.*multiple of 4"),
    (lambda: hardware.step_seconds(LLAMA7B, H100_NODE, 8, 100, 4096),
     "global_batch=100 .*multiple of 8"),
    (lambda: hardware.step_seconds(LLAMA7B, H100_NODE, 8, 64, 4096, tp=3, pp=1),
     "n_gpus=8 .*tp×pp = 3"),
    (lambda: hardware.step_seconds(LLAMA7B, hardware.PRESETS["h100-cluster"], 48, 48, 4096,
                                   tp=3), "tp=3 .*32 attention heads"),
    (lambda: hardware.step_seconds(LLAMA7B, H100_NODE, 0, 64, 4096), "n_gpus .*got 0"),
    (lambda: hardware.step_seconds(LLAMA7B, H100_NODE, 8, 64, 4096, tp=0), "tp .*got 0"),
    (lambda: hardware.step_seconds(LLAMA7B, H100_NODE, 8, 64, NAN), "seq_len .*got nan"),
    (lambda: hardware.step_seconds(LLAMA7B, H100_NODE, 8, 64, 4096, micro_batch=-1),
     "micro_batch .*got -1"),
    (lambda: hardware.step_seconds(LLAMA7B, "h100-node", 8, 64, 4096),
     "cluster must be .*hardware.PRESETS"),
    (lambda: hardware.step_seconds((32, 4096), H100_NODE, 8, 64, 4096),
     "model must be a distlab.hardware.Transformer"),
    (lambda: hardware.step_seconds(LLAMA7B, H100_NODE, 8, 64, 4096, recompute="some"),
     "recompute must be"),
    (lambda: H100_NODE.intra.seconds("all_reduce", -1, 8), "nbytes.*got -1"),
    (lambda: H100_NODE.intra.seconds("all_reduce", NAN, 8), "nbytes.*got nan"),
    (lambda: H100_NODE.intra.seconds("all_reduce", 1e6, 0), "world_size >= 1.*got 0"),
    (lambda: H100_NODE.intra.seconds("send", 1e6, -2), "world_size >= 1.*got -2"),
    (lambda: H100_NODE.intra.seconds("allreduce", 1e6, 8), "unknown collective 'allreduce'"),
    (lambda: hardware.PRESETS["h100-2x8"].link_between(range(16)).seconds("all_to_all", NAN, 16),
     "nbytes.*got nan"),
    (lambda: hardware.PRESETS["h100-2x8"].link_between([]), "at least one rank"),
    (lambda: hardware.PRESETS["h100-2x8"].link_between([0, -1]), "ranks.*got -1"),
    (lambda: H100.seconds(-1e9, 100, torch.bfloat16), "flops.*got -1000000000.0"),
    (lambda: H100.seconds(1e9, NAN, torch.bfloat16), "nbytes.*got nan"),
    (lambda: H100.gemm_seconds(1024, NAN, 1024), "n must be"),
    (lambda: H100.gemm_efficiency(0, 1024, 1024), "m must be"),
])
def test_bad_calls_to_the_hardware_model_are_refused_in_one_sentence(call, words):
    with pytest.raises(ValueError, match=words) as info:
        call()
    message = str(info.value)
    assert "\n" not in message and message.endswith(".")


def test_an_op_without_a_matmul_shape_never_costs_less_for_more_flops():
    """Found by tests/test_model_properties.py: the square GEMM was read from FLOPs per byte, so
    on 1 MB of bf16 an op of 33 MFLOP cost 15.6 µs and one of 67 MFLOP the 10 µs floor. Now the
    square GEMM of the same FLOPs: a matmul of that shape costs what its own shape costs."""
    small, large = (H100.seconds(f, 1e6, torch.bfloat16) for f in (3.3e7, 6.7e7))
    assert H100.floor <= small <= large
    d = 1024
    assert H100.seconds(2.0 * d**3, 2 * 3 * d * d, torch.bfloat16) == \
        pytest.approx(H100.gemm_seconds(d, d, d), rel=1e-12)



@settings(max_examples=40, deadline=None)
@given(st.floats(0.3, 1.0), st.sampled_from([1024, 4096, 16384]))
def test_a_part_at_a_lower_clock_runs_its_flops_slower_and_its_hbm_the_same(fraction, n):
    """A power- or thermally-limited part (the FA2 rows of bench/published.csv state 1,200 of
    1,410 MHz): every peak scales with the SM clock, memory bandwidth does not."""
    slow = H100.at_clock(fraction)
    assert slow.peak(torch.bfloat16) == pytest.approx(fraction * H100.peak(torch.bfloat16))
    assert slow.memory_bandwidth == H100.memory_bandwidth
    assert slow.gemm_efficiency(n, n, n) == H100.gemm_efficiency(n, n, n)
    assert slow.gemm_seconds(n, n, n) >= H100.gemm_seconds(n, n, n)
    if n == 16384:                     # past the launch floor: time goes as 1 / clock
        assert slow.gemm_seconds(n, n, n) == pytest.approx(H100.gemm_seconds(n, n, n) / fraction)


@pytest.mark.parametrize("fraction", [0, -0.5, 1.2])
def test_a_clock_fraction_outside_0_to_1_is_refused_in_a_sentence(fraction):
    with pytest.raises(ValueError, match="clock fraction"):
        H100.at_clock(fraction)
