"""Checker of workbook 03's prediction: the α-β time of a hierarchical all-reduce.

The learner's formula (S, nodes M, GPUs per node G, intra link, inter link) is compared term by
term, each α and each bandwidth isolated, with the closed form that the emulator's own
`comm_seconds` gives on α-β links built here; then the same algorithm runs on real ranks emulated
on those links, and the prediction must match the run's virtual clocks.
"""
import contextlib
import io
import math

import torch

from . import CheckFailed, learner_seconds, passed, run
from .. import cost as _cost
from .. import emulate as _emulate
from .. import hardware as _hardware
from .. import trace as _trace


# ---- predict, then run: the α-β time of a hierarchical all-reduce ----------------------------------
#
# The learner writes the time of a two-level all-reduce as a formula of (S, nodes M, GPUs per node
# G, intra link, inter link): reduce-scatter inside each node, all-reduce of the 1/G shard between
# the nodes (one ring per local index), all-gather inside each node. The reference is priced by the
# emulator's own function (`emulate.comm_seconds`) on α-β links this module builds explicitly, so
# it follows whatever the emulator charges, and never depends on a preset; the run is the same
# algorithm on real ranks, emulated on a cluster made of those two links, timed on its virtual
# clocks.

def _hierarchical_reference(nbytes, nodes, gpus, intra, inter):
    return (_emulate.comm_seconds("reduce_scatter", nbytes, gpus, intra)
            + _emulate.comm_seconds("all_reduce", nbytes / gpus, nodes, inter)
            + _emulate.comm_seconds("all_gather", nbytes, gpus, intra))


INTRA = _cost.Link(3e-6, 300e9, "a node's link (NVLink-like)")
INTER = _cost.Link(15e-6, 25e9, "between nodes (one 200 Gb/s NIC per GPU)")
# (S bytes, nodes M, GPUs per node G, intra, inter): small and large messages, M or G = 1.
ESTIMATE_CASES = [(4096, 2, 4, INTRA, INTER), (64 * 2**20, 4, 8, INTRA, INTER),
                  (2**30, 16, 8, INTRA, INTER), (300_000, 3, 2, _cost.Link(5e-6, 50e9), INTER),
                  (2**20, 1, 8, INTRA, INTER), (2**20, 6, 1, INTRA, _cost.Link(40e-6, 12.5e9))]
RUN_CASES = [(2, 2, 8 * 2**20), (2, 3, 3 * 2**20), (3, 2, 6 * 2**20)]   # (M, G, S) run emulated
NO_TIME = _cost.Link(0.0, math.inf, "free")


def _terms(nodes, gpus, nbytes):
    """The four terms: (name, intra, inter, expected coefficient, unit, why)."""
    S = nbytes
    return [
        ("intra-node latency", lambda a, b: (_cost.Link(a.alpha, math.inf), NO_TIME),
         "α_intra", f"2(G-1) = {2 * (gpus - 1)}",
         "the reduce-scatter and the all-gather inside a node are G-1 steps each"),
        ("intra-node bandwidth", lambda a, b: (_cost.Link(0.0, a.bandwidth), NO_TIME),
         "S/B_intra", f"2(G-1)/G = {2 * (gpus - 1) / gpus:.4g}",
         "each GPU sends (G-1)/G·S in the reduce-scatter and again in the all-gather"),
        ("inter-node latency", lambda a, b: (NO_TIME, _cost.Link(b.alpha, math.inf)),
         "α_inter", f"2(M-1) = {2 * (nodes - 1)}",
         "the all-reduce between the nodes is a ring of M: 2(M-1) steps"),
        ("inter-node bandwidth", lambda a, b: (NO_TIME, _cost.Link(0.0, b.bandwidth)),
         "S/B_inter", f"2(M-1)/(M·G) = {2 * (nodes - 1) / (nodes * gpus):.4g}",
         "only this GPU's shard, S/G, crosses between the nodes: a ring all-reduce of S/G "
         "over M nodes"),
    ]


def _unit(term, nbytes, intra, inter):
    return {"α_intra": intra.alpha, "S/B_intra": nbytes / intra.bandwidth,
            "α_inter": inter.alpha, "S/B_inter": nbytes / inter.bandwidth}[term]


def _estimate(fn, name, *args):
    try:
        return learner_seconds(fn, name, *args, shown=f"{name}{args[:3]}",
                               refused=(_cost.predict, _cost.terms, _cost.ring_all_reduce_time,
                                        _emulate.comm_seconds, _hierarchical_reference))
    except (CheckFailed, NotImplementedError):
        raise
    except Exception as e:         # the learner's formula failed: one sentence, the call to re-run
        raise CheckFailed(f"{name}{args[:3]} (with its two links) raised {type(e).__name__}: "
                          f"{str(e).splitlines()[0] if str(e) else 'no message'}; call it "
                          f"yourself to see where (a link has .alpha and .bandwidth).") from None


def _close(a, b):
    return math.isclose(a, b, rel_tol=1e-6, abs_tol=1e-15)


def _hierarchical_run(rank, world_size, gpus, nbytes):
    """The two-level all-reduce on real ranks: returns this rank's (virtual) seconds and result."""
    import torch.distributed as dist
    nodes = world_size // gpus
    node_groups = [dist.new_group(list(range(n * gpus, (n + 1) * gpus))) for n in range(nodes)]
    cross_groups = [dist.new_group(list(range(g, world_size, gpus))) for g in range(gpus)]
    node, local = rank // gpus, rank % gpus
    x = torch.full((nbytes // 4,), float(rank + 1))
    shard = torch.empty(len(x) // gpus)
    dist.barrier()
    start = _trace.now()
    dist.reduce_scatter_single(shard, x, group=node_groups[node])
    dist.all_reduce(shard, group=cross_groups[local])
    dist.all_gather_single(x, shard, group=node_groups[node])
    seconds = _trace.now() - start
    return seconds, bool((x == world_size * (world_size + 1) / 2).all())


def check_hierarchical_estimate(fn):
    """fn(nbytes, nodes, gpus_per_node, intra, inter) -> seconds of a hierarchical all-reduce on
    α-β links (intra.alpha, intra.bandwidth, ...); compared term by term with the closed form, and
    with the same algorithm run on an emulated cluster of those links."""
    name = getattr(fn, "__name__", "hierarchical_seconds")
    if not callable(fn):
        raise TypeError(f"the check needs your function, e.g. check_hierarchical_estimate({name}); "
                        f"got {fn!r}.")
    for nbytes, nodes, gpus, intra, inter in ESTIMATE_CASES:
        where = (f"{name} for S = {nbytes} B on {nodes} node{'s' if nodes > 1 else ''} × {gpus} "
                 f"GPU{'s' if gpus > 1 else ''}")
        for term, links, unit, expected, why in _terms(nodes, gpus, nbytes):
            a, b = links(intra, inter)
            want = _hierarchical_reference(nbytes, nodes, gpus, a, b)
            got = _estimate(fn, name, nbytes, nodes, gpus, a, b)
            if _close(got, want):
                continue
            scale = _unit(unit, nbytes, intra, inter)
            yours = f"{got / scale:.4g}·{unit}" if got else "nothing"
            miss = "misses" if not got else "has"
            raise CheckFailed(
                f"{where}: your estimate {miss} the {term} term{'' if not got else ' wrong'} — "
                f"it counts {yours}, the algorithm pays {expected}·{unit} ({why}). (Checked with "
                f"every other α set to 0 and every other bandwidth infinite.)")
        want = _hierarchical_reference(nbytes, nodes, gpus, intra, inter)
        got = _estimate(fn, name, nbytes, nodes, gpus, intra, inter)
        if not _close(got, want):
            raise CheckFailed(f"{where}: your estimate is {got * 1e6:.4g} µs, the closed form "
                              f"{want * 1e6:.4g} µs, although each term alone is right: the "
                              f"terms add up (time = latency terms + bandwidth terms).")
    # The timed span holds communication only, so the device barely matters: one built here
    # (A100-like datasheet rates, no launch floor) keeps the run off the presets, which change.
    # The run's own "emulated" line is kept out of the learner's output; the verdict says the
    # times are modeled.
    device = _hardware.Device("a GPU built by the check", {torch.float32: 19.5e12}, 2.0e12)
    for nodes, gpus, nbytes in RUN_CASES:
        cluster = _hardware.Cluster(f"{nodes} nodes × {gpus} GPUs, α-β links", device, INTRA,
                                    INTER, gpus, "built by the check", nodes=nodes)
        with contextlib.redirect_stdout(io.StringIO()):
            got = run(_hierarchical_run, nodes * gpus, gpus, nbytes, emulate=cluster,
                      timeout=120)
        emulated = max(seconds for seconds, _ in got)
        if not all(ok for _, ok in got):
            raise RuntimeError("the check's hierarchical all-reduce gave a wrong sum: a bug in "
                               "the course, not in your formula.")
        closed = _hierarchical_reference(nbytes, nodes, gpus, INTRA, INTER)
        if not math.isclose(closed, emulated, rel_tol=0.02):
            raise RuntimeError(f"the emulated hierarchical all-reduce on {nodes} × {gpus} took "
                               f"{emulated * 1e6:.4g} µs and the closed form says "
                               f"{closed * 1e6:.4g} µs: the emulator no longer prices α-β links "
                               f"with distlab.cost's terms — a bug in the course, not in your "
                               f"formula.")
        estimate = _estimate(fn, name, nbytes, nodes, gpus, INTRA, INTER)
        if not math.isclose(estimate, emulated, rel_tol=0.02):
            raise CheckFailed(f"{name} for S = {nbytes} B on {nodes} × {gpus}: your estimate is "
                              f"{estimate * 1e6:.4g} µs, the emulated run took "
                              f"{emulated * 1e6:.4g} µs.")
    passed(f"{name} matches the closed form term by term — 2(G-1)·α_intra + 2(G-1)/G·S/B_intra "
           f"+ 2(M-1)·α_inter + 2(M-1)/M·(S/G)/B_inter — on {len(ESTIMATE_CASES)} clusters, "
           f"and the runs emulated on α-β links at "
           f"{', '.join(f'{m}×{g}' for m, g, _ in RUN_CASES)} GPUs within 2 % (times modeled, "
           f"not measured).")
