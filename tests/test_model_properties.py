"""The cost and hardware models under Hypothesis: what each claims for every size, not only the
sizes a chapter prints. Pure arithmetic, one process; derandomized so a failure reproduces.

Only what the models claim is asserted, and where reality agrees:
- a collective's time (α-β or calibrated) is finite, positive once two ranks take part, and
  never shorter for more bytes, or for more ranks on the same link — with the total tensor
  fixed (the ring's bytes per rank tend to 2S) and with the bytes per rank fixed (then the
  total grows with N). NOT claimed: more ranks of one cluster never cost more: a 9th GPU on a
  second node moves the whole ring onto one NIC (`test_hardware`'s uneven group); what holds is
  that more nodes with the same members on each never make a collective faster;
- a device never runs an op faster for more FLOPs or bytes, nor a GEMM for a larger m, n or k;
- a training step takes longer for more layers or a longer sequence; data-parallel replicas
  at a fixed batch per replica never shorten a replica's step (communication only adds); a
  larger global batch never lowers the throughput (bubble and gradient sync amortised); the
  datasheet twin is never slower. NOT claimed: more GPUs always raise throughput — a gradient
  all_reduce slower than the compute it follows makes two replicas slower than one, on the
  model as on a real cluster without overlap.
"""
import math

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from distlab import cost, emulate, hardware

FAST = settings(max_examples=60, deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.too_slow])

OPS = sorted(cost.TERMS)
LINK_OPS = ["all_reduce", "all_gather", "reduce_scatter", "broadcast", "reduce", "all_to_all",
            "gather", "scatter", "barrier"]
BYTES = st.one_of(st.integers(0, 1 << 40), st.floats(0, 1e13))
RANKS = st.integers(1, 4096)
ALPHA_BETA = st.builds(cost.Link, st.floats(1e-9, 1e-3), st.floats(1e6, 1e13))
CALIBRATED = sorted({id(c.intra): c.intra for c in hardware.PRESETS.values()}.values(),
                    key=lambda link: link.name) + [hardware.IB_NDR, hardware.IB_HDR,
                                                   hardware.ETH_100G]
LINKS = st.one_of(ALPHA_BETA, st.sampled_from(CALIBRATED),
                  st.sampled_from(CALIBRATED).map(lambda link: link.ideal()))
MULTI_NODE = sorted(name for name, c in emulate.PRESETS.items() if c.inter is not None)


def _time(op, nbytes, n, link):
    """The time the course charges: cost.predict for its α-β names, the emulator's otherwise."""
    if op in cost.TERMS:
        return cost.predict(op, nbytes, n, link)
    return emulate.comm_seconds(op, nbytes, n, link)


@FAST
@given(st.sampled_from(OPS + LINK_OPS), BYTES, BYTES, RANKS, LINKS)
def test_a_collective_is_finite_positive_and_never_faster_for_more_bytes(op, a, b, n, link):
    small, large = sorted((a, b))
    t_small, t_large = _time(op, small, n, link), _time(op, large, n, link)
    assert math.isfinite(t_small) and math.isfinite(t_large)
    assert t_small <= t_large * (1 + 1e-12)
    assert t_small >= 0
    if n >= 2 or op == "send":
        assert t_large > 0              # a latency, or a link's worth of bytes, however small


@FAST
@given(st.sampled_from(OPS + LINK_OPS), BYTES, RANKS, RANKS, LINKS, st.booleans())
def test_more_ranks_on_one_link_never_make_a_collective_faster(op, nbytes, m, n, link, per_rank):
    """At a fixed total tensor (the ring's bytes tend to 2S) and at fixed bytes per rank (the
    total, and a gather's time, grow with N): both never fall as N grows."""
    few, many = sorted((m, n))
    size = (lambda k: nbytes * k) if per_rank else (lambda k: nbytes)
    assert _time(op, size(few), few, link) <= _time(op, size(many), many, link) * (1 + 1e-12)


@FAST
@given(BYTES, st.integers(2, 4096), ALPHA_BETA)
def test_the_ring_all_reduce_meets_the_bound_and_its_bytes_stay_below_2s(nbytes, n, link):
    t = cost.predict("ring_all_reduce", nbytes, n, link)
    bound = cost.all_reduce_lower_bound(nbytes, n, link.bandwidth)
    assert t == pytest.approx(2 * (n - 1) * link.alpha + bound, rel=1e-12)
    assert bound <= 2 * nbytes / link.bandwidth
    # a gather at fixed bytes per rank: the total grows, so its bytes grow like N
    gather = cost.terms("ring_all_gather", nbytes * n, n)[1]
    assert gather == pytest.approx((n - 1) * nbytes, rel=1e-12)


@FAST
@given(st.sampled_from(MULTI_NODE), st.sampled_from(LINK_OPS + ["send"]), BYTES,
       st.integers(1, 8), st.integers(1, 16), st.integers(1, 16), st.booleans())
def test_more_nodes_with_the_same_members_each_never_make_a_collective_faster(
        preset, op, nbytes, per_node, m, n, per_rank):
    cluster = emulate.PRESETS[preset]
    per_node = min(per_node, cluster.ranks_per_node)
    few, many = sorted((m, n))
    if cluster.nodes is not None:
        assume(many <= cluster.nodes)

    def seconds(nodes):
        ranks = [node * cluster.ranks_per_node + j for node in range(nodes)
                 for j in range(per_node)]
        size = nbytes * len(ranks) if per_rank else nbytes
        return cluster.link_between(ranks).seconds(op, size, len(ranks))
    assert seconds(few) <= seconds(many) * (1 + 1e-12)


BAD_BYTES = st.one_of(st.floats(max_value=-1e-300), st.just(math.nan), st.just(math.inf),
                      st.integers(max_value=-1), st.text(max_size=3), st.booleans(), st.none())
BAD_RANKS = st.one_of(st.integers(max_value=0), st.just(math.nan), st.just(math.inf),
                      st.floats(1.01, 1e6).filter(lambda x: not x.is_integer()),
                      st.booleans(), st.none())


@FAST
@given(st.sampled_from(OPS + LINK_OPS), st.one_of(BAD_BYTES.map(lambda b: (b, 4)),
                                                  BAD_RANKS.map(lambda n: (1e6, n))), LINKS)
def test_numbers_no_model_can_price_are_refused_in_one_sentence(op, size, link):
    nbytes, n = size
    with pytest.raises(ValueError) as info:
        _time(op, nbytes, n, link)
    message = str(info.value)
    assert "\n" not in message and message.endswith(".")
    assert ("nbytes" in message) if n == 4 else ("world_size >= 1" in message)


# ---- a device -------------------------------------------------------------------------------------

DEVICES = [hardware.A100, hardware.H100, hardware.H200, hardware.H100.ideal(),
           hardware.H100.with_mode("graphs")]
DIM = st.integers(1, 1 << 16)


@FAST
@given(st.sampled_from(DEVICES), st.floats(0, 1e16), st.floats(0, 1e16), st.floats(0, 1e11),
       st.floats(0, 1e11))
def test_an_op_never_runs_faster_for_more_flops_or_bytes(device, f1, f2, b1, b2):
    (f1, f2), (b1, b2) = sorted((f1, f2)), sorted((b1, b2))
    low, high = device.seconds(f1, b1, None), device.seconds(f2, b2, None)
    assert device.floor <= low <= high * (1 + 1e-12) and math.isfinite(high)


@FAST
@given(st.sampled_from(DEVICES), DIM, DIM, DIM, st.sampled_from("mnk"), DIM)
def test_a_larger_gemm_is_never_faster_and_never_beyond_the_best_efficiency(device, m, n, k,
                                                                          which, grow):
    bigger = dict(m=m, n=n, k=k)
    bigger[which] += grow
    assert device.gemm_efficiency(m, n, k) <= device.gemm_efficiency(**bigger) <= device.gemm_best
    assert device.gemm_seconds(m, n, k) <= device.gemm_seconds(**bigger) * (1 + 1e-12)


# ---- a training step ------------------------------------------------------------------------------

@st.composite
def steps(draw):
    """A valid (model, cluster, layout, batch) as step_seconds takes them."""
    heads = draw(st.sampled_from([8, 16, 32, 64]))
    hidden = heads * draw(st.sampled_from([64, 128]))
    model = hardware.Transformer(draw(st.integers(1, 96)), hidden, heads,
                                 draw(st.sampled_from([2, 4])) * hidden,
                                 draw(st.sampled_from([0, 32000, 128256])),
                                 kv_heads=draw(st.sampled_from([None, heads // 8])),
                                 glu=draw(st.booleans()))
    cluster = hardware.PRESETS[draw(st.sampled_from(["a100-cluster", "h100-cluster",
                                                     "h100-node", "h100-2x8"]))]
    tp = draw(st.sampled_from([t for t in (1, 2, 4, 8) if heads % t == 0]))
    pp = draw(st.sampled_from([1, 2, 4]))
    limit = cluster.max_ranks or 1024
    assume(tp * pp <= limit)
    dp = draw(st.integers(1, max(1, min(64, limit // (tp * pp)))))
    micro = draw(st.sampled_from([1, 2]))
    per_replica = micro * draw(st.integers(1, 16))
    kw = dict(tp=tp, pp=pp, micro_batch=micro, recompute=draw(st.sampled_from(
                  ["none", "selective", "selective-op", "full"])),
              flash=draw(st.booleans()), overlap_dp=draw(st.booleans()),
              fsdp=draw(st.booleans()), fused=draw(st.booleans()))
    return model, cluster, dp, per_replica, draw(st.sampled_from([512, 2048, 4096])), kw


def _step(model, cluster, dp, per_replica, seq, kw):
    tp, pp = kw["tp"], kw["pp"]
    return hardware.step_seconds(model, cluster, dp * tp * pp, dp * per_replica, seq, **kw)


@FAST
@given(steps(), st.integers(1, 32))
def test_more_layers_take_longer(step, more):
    model, cluster, dp, per_replica, seq, kw = step
    deeper = hardware.Transformer(model.layers + more, model.hidden, model.heads, model.ffn,
                                  model.vocab, model.kv_heads, model.glu)
    t, t_deeper = (_step(m, cluster, dp, per_replica, seq, kw)["step"] for m in (model, deeper))
    assert math.isfinite(t) and 0 < t < t_deeper


@FAST
@given(steps())
def test_a_longer_sequence_is_never_faster(step):
    model, cluster, dp, per_replica, seq, kw = step
    assert _step(model, cluster, dp, per_replica, seq, kw)["step"] <= \
        _step(model, cluster, dp, per_replica, 2 * seq, kw)["step"] * (1 + 1e-12)


@FAST
@given(steps())
def test_replicas_at_a_fixed_batch_each_never_shorten_a_replicas_step(step):
    model, cluster, dp, per_replica, seq, kw = step
    alone = _step(model, cluster, 1, per_replica, seq, kw)
    many = _step(model, cluster, dp, per_replica, seq, kw)
    assert many["compute"] == pytest.approx(alone["compute"], rel=1e-12)
    assert alone["step"] <= many["step"] * (1 + 1e-12)
    # gradients fully hidden and no stages to place: throughput grows with dp. (With stages,
    # Megatron's order puts pp outermost: more replicas push a stage's neighbour tp·dp ranks
    # away, across the network, on the model as on a cluster.)
    if kw["overlap_dp"] and not kw["fsdp"] and kw["pp"] == 1:
        assert many["step"] == pytest.approx(alone["step"], rel=1e-12)


@FAST
@given(steps(), st.integers(2, 8))
def test_a_larger_global_batch_never_lowers_the_throughput(step, times):
    model, cluster, dp, per_replica, seq, kw = step
    small = _step(model, cluster, dp, per_replica, seq, kw)["step"]
    large = _step(model, cluster, dp, per_replica * times, seq, kw)["step"]
    assert small <= large * (1 + 1e-12)
    assert per_replica / small <= per_replica * times / large * (1 + 1e-12)


@FAST
@given(steps())
def test_the_datasheet_twin_is_never_slower(step):
    model, cluster, dp, per_replica, seq, kw = step
    real = _step(model, cluster, dp, per_replica, seq, kw)["step"]
    ideal = _step(model, cluster.ideal(), dp, per_replica, seq, kw)["step"]
    assert ideal <= real * (1 + 1e-12)
