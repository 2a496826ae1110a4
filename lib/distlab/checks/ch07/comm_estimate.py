"""Workbook 07, exercise 3 (predict, then run): one transformer layer's TP communication."""
import contextlib
import dataclasses
import io
import math
import types

import torch

from ... import cost as _cost
from ... import emulate as _emulate
from ... import hardware as _hardware
from ... import tensor_parallel as _tpm
from ... import trace as _trace
from .. import CheckFailed, expect_arguments, learner_seconds, passed, run


OPS = ("all_reduce", "all_gather", "reduce_scatter")


@dataclasses.dataclass(frozen=True)
class TPLink:
    """What nccl-tests would tell you about the link `tp` GPUs share: `latency[op]`, the seconds
    of a collective of a few bytes on them; `busbw[op]`, the bus bandwidth (bytes/s) of a large
    one — the bytes each rank sends on a ring divided by the time."""
    name: str
    tp: int
    latency: types.MappingProxyType
    busbw: types.MappingProxyType

    def __repr__(self):
        lat = ", ".join(f"{op} {self.latency[op] * 1e6:.3g} µs" for op in OPS)
        bw = ", ".join(f"{op} {self.busbw[op] / 1e9:.3g} GB/s" for op in OPS)
        return f"TPLink({self.name}, tp={self.tp}: latency {lat}; busbw {bw})"


def _cluster(preset):
    return preset if isinstance(preset, _hardware.Cluster) else _emulate.resolve(preset)


def tp_link(preset, tp):
    """The TPLink of the first `tp` GPUs of a preset (a name of distlab.emulate.PRESETS or a
    Cluster): the numbers the emulator charges their collectives with."""
    link = _cluster(preset).link_between(range(tp))
    return TPLink(f"{getattr(preset, 'name', preset)}: {link.name}", tp,
                  types.MappingProxyType({op: link.seconds(op, 0, tp) for op in OPS}),
                  types.MappingProxyType({op: link.busbw(op) for op in OPS}))


def _layer_ops(sp):
    """One layer's collectives, forward + backward: {op: count}."""
    return {"all_gather": 4, "reduce_scatter": 4} if sp else {"all_reduce": 4}


def _reference_layer_seconds(hidden, tokens, tp, dtype, sp, preset):
    """The closed form the emulator charges: each collective on the calibrated link's model."""
    link = _cluster(preset).link_between(range(tp))
    nbytes = tokens * hidden * torch.empty((), dtype=dtype).element_size()
    return sum(n * link.seconds(op, nbytes, tp) for op, n in _layer_ops(sp).items())


def _isolated(facts, latency=True, bandwidth=True):
    return dataclasses.replace(
        facts, latency=types.MappingProxyType(
            {op: facts.latency[op] if latency else 0.0 for op in OPS}),
        busbw=types.MappingProxyType({op: facts.busbw[op] if bandwidth else math.inf
                                      for op in OPS}))


ESTIMATE_CASES = [  # (hidden, tokens, tp, dtype, preset): in a node, across nodes, latency-bound
    (4096, 4096, 8, torch.bfloat16, "h100-node"), (8192, 8192, 16, torch.bfloat16, "h100-2x8"),
    (5120, 2048, 4, torch.float32, "a100-node"), (4096, 4096, 16, torch.bfloat16, "a100-2x8"),
    (1024, 128, 8, torch.bfloat16, "h100-node")]
# The run: the course's ParallelBlock at real size on meta tensors, 4 ranks in one H100 node and
# 4 ranks across two (two GPUs and two NICs per node: h100-2x8's parts, a node shape chosen so a
# 4-rank group spans nodes at the cost of 4 processes, not 16).
RUN_SHAPE = dict(hidden=4096, heads=32, tokens=4096)
RUN_TP = 4


def _run_clusters():
    two = dataclasses.replace(_hardware.PRESETS["h100-2x8"], ranks_per_node=2, nics_per_node=2,
                              name="two H100 nodes (2 GPUs, 2 NDR NICs each)")
    return [("h100-node", _hardware.PRESETS["h100-node"]), ("h100 2 nodes × 2", two)]


def _reference_layer_run(rank, ws, hidden, heads, tokens):
    """Forward + backward of one ParallelBlock (TP, then TP + SP) on meta tensors, bf16."""
    for sp in (False, True):
        with torch.device("meta"):
            block = _tpm.ParallelBlock(hidden, heads, 4 * hidden, None, sp, dtype=torch.bfloat16)
            x = torch.randn(1, tokens // ws if sp else tokens, hidden, dtype=torch.bfloat16,
                            requires_grad=True)
        with _trace.span(f"layer sp={sp}"):
            y = block(x)
            y.backward(torch.ones_like(y))
    return None


_RUNS = {}


def _emulated_layers():
    """{(cluster label, sp): (seconds of the activation collectives on rank 0's critical path,
    [their ops])} — run once per process: the run does not depend on the learner."""
    if not _RUNS:
        s = RUN_SHAPE
        nbytes = s["tokens"] * s["hidden"] * 2
        for label, cluster in _run_clusters():
            with contextlib.redirect_stdout(io.StringIO()):
                res = run(_reference_layer_run, RUN_TP, s["hidden"], s["heads"], s["tokens"],
                          emulate=cluster, timeout=300)
            for sp in (False, True):
                # the activations' collectives: the replicated LayerNorm and bias gradients (SP)
                # are all-reduced too, a few KiB each, not what the layer's formula counts
                calls = [e for e in res.trace.comm(0) if e["label"] == [f"layer sp={sp}"]
                         and e["bytes"] == nbytes]
                _RUNS[label, sp] = (sum(e["end"] - e["launch"] for e in calls),
                                    sorted(e["op"] for e in calls), cluster)
    return _RUNS


def _estimate(fn, name, *args):
    return learner_seconds(fn, name, *args,
                           refused=(_cost.predict, _cost.terms, _cost.ring_all_reduce_time,
                                    _emulate.comm_seconds, _hardware.Link.seconds,
                                    _hardware.GroupLink.seconds, _tpm.tp_block_seconds,
                                    _hardware.step_seconds))


def _dtype_name(dtype):
    return str(dtype).replace("torch.", "")


def _close(a, b, rel=1e-6):
    return math.isclose(a, b, rel_tol=rel, abs_tol=1e-15)


def _near(q, target):
    return math.isclose(q, target, rel_tol=1e-3)


def _why_bandwidth(q, tp, sp, esize, facts, name, dtype, case):
    """A sentence naming what makes the bandwidth term q× the layer's, or a generic one."""
    ring = (tp - 1) / tp * (1 if sp else 2)
    coll = ("an all-gather or reduce-scatter moves (N-1)/N·S per rank" if sp else
            "an all-reduce moves 2(N-1)/N·S per rank (a reduce-scatter, then an all-gather)")
    if _near(q, 1 / ring):
        return (f"misses the ring's factor: {coll} = {ring:.4g}·S at N = {tp}, not S")
    if sp and _near(q, 2):
        return ("counts an all-reduce's 2(N-1)/N for each all-gather and reduce-scatter: "
                "each moves (N-1)/N·S per rank, half an all-reduce")
    if not sp and _near(q, 0.5):
        return ("counts (N-1)/N for each all-reduce: it is a reduce-scatter plus an all-gather, "
                "2(N-1)/N·S per rank")
    for wrong in (1, 2, 4, 8, 16, 32):
        if wrong != esize and _near(q, wrong / esize):
            return (f"has the bytes per element wrong: {_dtype_name(dtype)} is {esize} byte"
                    f"{'s' if esize > 1 else ''} per element, and your term is {q:.4g}× the "
                    f"layer's (S = tokens × hidden × {esize} B)")
    for op, other in ((o, p) for o in OPS for p in OPS if o != p):
        if facts.busbw[op] != facts.busbw[other] and _near(q, facts.busbw[op] / facts.busbw[other]):
            return (f"divides by another collective's bus bandwidth: each collective at its own "
                    f"link.busbw[op] (inside an H100 node all_reduce runs NVLink SHARP, "
                    f"{facts.busbw['all_reduce'] / 1e9:.0f} GB/s, the gathers and scatters "
                    f"{facts.busbw['all_gather'] / 1e9:.0f})")
    n_true = 8 if sp else 4
    for k in range(1, 17):
        if k != n_true and _near(q, k / n_true):
            return (f"counts {k} collectives' bytes where a layer makes {n_true}: "
                    f"{'4 all-gathers + 4 reduce-scatters' if sp else '4 all-reduces'} (forward: "
                    f"after attention and after the MLP; backward: into each of their inputs)")
    return f"is {q:.4g}× the layer's"


def check_tp_comm_estimate(fn, cases=ESTIMATE_CASES):
    """fn(hidden, tokens, tp, dtype, sequence_parallel, link) -> seconds of one transformer
    layer's tensor-parallel communication, forward + backward, on the TPLink `link`."""
    name = expect_arguments(fn, 6, "layer_comm_seconds(hidden, tokens, tp, dtype, "
                                   "sequence_parallel, link)")
    for hidden, tokens, tp, dtype, preset in cases:
        facts = tp_link(preset, tp)
        esize = torch.empty((), dtype=dtype).element_size()
        S = tokens * hidden * esize
        for sp in (False, True):
            ops = _layer_ops(sp)
            where = (f"{name}(hidden={hidden}, tokens={tokens}, tp={tp}, {_dtype_name(dtype)}, "
                     f"sequence_parallel={sp}) on {preset}")
            want_lat = sum(n * facts.latency[op] for op, n in ops.items())
            got_lat = _estimate(fn, name, hidden, tokens, tp, dtype, sp,
                                _isolated(facts, bandwidth=False))
            if not _close(got_lat, want_lat):
                one = facts.latency[next(iter(ops))]
                count = ("4 all-gathers + 4 reduce-scatters" if sp else "4 all-reduces")
                if got_lat == 0:
                    why = (f"misses the latency: each collective costs its link.latency[op] "
                           f"however small ({one * 1e6:.3g} µs here), and a layer makes {count}")
                elif _near(got_lat / one, round(got_lat / one)) and round(got_lat / one) != sum(
                        ops.values()):
                    why = (f"counts {round(got_lat / one)} collectives' latencies where a layer "
                           f"makes {sum(ops.values())}: {count} (forward: after attention and "
                           f"after the MLP; backward: into each of their inputs)")
                else:
                    why = (f"has the latency term wrong: yours is {got_lat * 1e6:.4g} µs, the "
                           f"layer's {want_lat * 1e6:.4g} µs = {count} × link.latency[op]")
                raise CheckFailed(f"{where}: your estimate {why}. (Checked with every bus "
                                  f"bandwidth infinite.)")
            want_bw = sum(n * _cost.TERMS["ring_" + op](S, tp)[1] / facts.busbw[op]
                          for op, n in ops.items())
            got_bw = _estimate(fn, name, hidden, tokens, tp, dtype, sp,
                               _isolated(facts, latency=False))
            if not _close(got_bw, want_bw):
                if got_bw == 0:
                    why = "misses the bandwidth term: bytes take time on the link"
                else:
                    other = torch.float32 if esize != 4 else torch.bfloat16
                    got_other = _estimate(fn, name, hidden, tokens, tp, other, sp,
                                          _isolated(facts, latency=False))
                    if _close(got_other, got_bw):
                        why = (f"does not change with the dtype: S = tokens × hidden × bytes per "
                               f"element ({_dtype_name(dtype)} {esize} B, {_dtype_name(other)} "
                               f"{torch.empty((), dtype=other).element_size()} B)")
                    else:
                        why = _why_bandwidth(got_bw / want_bw, tp, sp, esize, facts, name,
                                             dtype, where)
                raise CheckFailed(f"{where}: your estimate's bandwidth term {why}. It counts "
                                  f"{got_bw * 1e6:.4g} µs, the layer pays {want_bw * 1e6:.4g} µs. "
                                  f"(Checked with every latency 0.)")
            got = _estimate(fn, name, hidden, tokens, tp, dtype, sp, facts)
            want = _reference_layer_seconds(hidden, tokens, tp, dtype, sp, preset)
            if not _close(want, want_lat + want_bw):
                raise RuntimeError("the check's closed form no longer matches the emulator's "
                                   "link model — a bug in the course, not in your formula.")
            if not _close(got, want):
                raise CheckFailed(f"{where}: your estimate is {got * 1e6:.4g} µs, the closed "
                                  f"form {want * 1e6:.4g} µs, although each term alone is right: "
                                  f"the terms add (latency terms + bandwidth terms).")
    lines = []
    s = RUN_SHAPE
    for (label, sp), (emulated, ops, cluster) in _emulated_layers().items():
        closed = _reference_layer_seconds(s["hidden"], s["tokens"], RUN_TP, torch.bfloat16, sp,
                                          cluster)
        expect = sorted(op for op, n in _layer_ops(sp).items() for _ in range(n))
        if ops != expect or not math.isclose(closed, emulated, rel_tol=0.01):
            raise RuntimeError(f"the emulated ParallelBlock on {label} made {ops} in "
                               f"{emulated * 1e6:.4g} µs against the closed form's "
                               f"{closed * 1e6:.4g} µs — a bug in the course, not in your "
                               f"formula.")
        guess = _estimate(fn, name, s["hidden"], s["tokens"], RUN_TP, torch.bfloat16, sp,
                          tp_link(cluster, RUN_TP))
        if not math.isclose(guess, emulated, rel_tol=0.01):
            raise CheckFailed(f"{name} for the emulated ParallelBlock on {label} (tp={RUN_TP}, "
                              f"sequence_parallel={sp}): your estimate is {guess * 1e6:.4g} µs, "
                              f"the run's collectives took {emulated * 1e6:.4g} µs.")
        lines.append(f"   {label:>16}, {'TP + SP' if sp else 'TP':>7}: yours {guess * 1e6:7.1f} "
                     f"µs, closed form {closed * 1e6:7.1f}, emulated {emulated * 1e6:7.1f} "
                     f"({len(ops)} collectives)")
    passed(f"{name} matches the closed form term by term (latency alone, bandwidth alone, each "
           f"dtype) on {len(cases)} shapes × TP and TP + SP, from 1 to 2 nodes, and the "
           f"course's ParallelBlock (hidden {s['hidden']}, {s['tokens']} tokens, bf16, meta "
           f"tensors) emulated at tp={RUN_TP} within 1 % (times modeled, not measured: the "
           f"emulator charges the same link formulas, so the agreement checks which collectives "
           f"the layer makes and of what size, not the hardware):\n" + "\n".join(lines))
