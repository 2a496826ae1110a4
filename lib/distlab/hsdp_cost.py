"""What one step of FSDP and of HSDP costs: communication per link, network bytes, memory.

FSDP (ZeRO-3 over all N = nodes x g GPUs) gathers every unit's bf16 weights twice (forward,
backward) and reduce-scatters its gradient, each over the whole group: with g GPUs a node, every
collective crosses the network. HSDP (chapter 04's mesh: `replicate` across nodes x `shard`
inside a node) does the same three collectives inside the node, on NVLink, and then all-reduces
each rank's 1/g gradient shard with the rank of the same position on every other node — g
such replica groups at once, which share the node's NICs.

Times come from the course's calibrated links (`hardware.Cluster.link_between`: NCCL's
latencies, achieved bus bandwidth, one ring per NIC), one collective per unit, so the latency of
a collective over N ranks (its ring steps across nodes) is paid once per unit. What the model
leaves out: the fabric is FLAT — every node keeps its NIC rate whatever the number of nodes, so
congestion, an oversubscribed spine and the rings' longer paths at large scale are not charged.
"""
import dataclasses

from . import memory
from .show import text_table


def _cross_node_link(cluster, nodes, per_node):
    """The link of ONE replica group (a rank per node) while all `per_node` groups run at once:
    together they share each node's NICs."""
    link = cluster.link_between(range(0, nodes * per_node, per_node))
    nics = cluster.nics_per_node or 1
    share = max(1.0, per_node / nics)
    if share == 1.0:
        return link
    return dataclasses.replace(link, bandwidth=link.bandwidth / share)


def step_comm(cluster, params, nodes, units, per_node=None, param_bytes=2, grad_bytes=2):
    """One training step's communication under FSDP and HSDP on `nodes` nodes of `cluster`.

    `params` parameters split into `units` equal units (one gather each); weights gathered in
    `param_bytes` per value, gradients reduced in `grad_bytes`. Returns {"fsdp": ..., "hsdp": ...},
    each a dict of seconds per collective ("all_gather" is forward + backward), "nvlink" and
    "network" (seconds on each kind of link), "total" (all of it, nothing overlapped),
    "forward_gather" (the forward's gathers alone, which only the forward's compute can hide),
    and "network_bytes" (bytes each node sends over its NICs in the step)."""
    g = per_node or cluster.ranks_per_node
    n = nodes * g
    if nodes < 1 or units < 1 or params <= 0:
        raise ValueError(f"step_comm needs nodes >= 1, units >= 1 and params > 0; got "
                         f"nodes={nodes}, units={units}, params={params}.")
    unit = params / units
    weights, grads = param_bytes * unit, grad_bytes * unit
    whole = cluster.link_between(range(n))
    node = cluster.link_between(range(g))
    cross = _cross_node_link(cluster, nodes, g)

    gather = units * 2 * whole.seconds("all_gather", weights, n)
    scatter = units * whole.seconds("reduce_scatter", grads, n)
    on_network = nodes > 1
    fsdp = {"all_gather": gather, "reduce_scatter": scatter, "all_reduce": 0.0,
            "nvlink": 0.0 if on_network else gather + scatter,
            "network": gather + scatter if on_network else 0.0,
            "forward_gather": gather / 2,
            # a ring's edge out of a node carries (N-1)/N of each collective's tensor
            "network_bytes": (units * (2 * weights + grads) * (n - 1) / n) if on_network else 0.0}
    h_gather = units * 2 * node.seconds("all_gather", weights, g)
    h_scatter = units * node.seconds("reduce_scatter", grads, g)
    h_reduce = units * cross.seconds("all_reduce", grads / g, nodes)
    hsdp = {"all_gather": h_gather, "reduce_scatter": h_scatter, "all_reduce": h_reduce,
            "nvlink": h_gather + h_scatter, "network": h_reduce, "forward_gather": h_gather / 2,
            # g replica groups, each a ring all-reduce of 1/g of the gradient across the nodes
            "network_bytes": g * units * 2 * (nodes - 1) / nodes * grads / g}
    for d in (fsdp, hsdp):
        d["total"] = d["nvlink"] + d["network"]
    return {"fsdp": fsdp, "hsdp": hsdp}


def state_bytes(params, nodes, per_node=8, precision="bf16-mixed", optimizer="adam"):
    """Model-state bytes per GPU: FSDP shards over all nodes x per_node GPUs, HSDP over per_node."""
    def held(world):
        return sum(memory.model_state_bytes(params, precision, optimizer, zero_stage=3,
                                            world_size=world).values())
    return {"fsdp": held(nodes * per_node), "hsdp": held(per_node)}


def table(cluster, params, node_counts, units, rate, per_node=None, **kw):
    """Rows for the notebook: per node count, FSDP's and HSDP's step communication (ms), the
    tokens per GPU from which the forward's gathers hide behind the forward (2·params FLOPs per
    token at `rate` FLOP/s) and the network GB each node sends."""
    rows = []
    for nodes in node_counts:
        c = step_comm(cluster, params, nodes, units, per_node, **kw)
        g = per_node or cluster.ranks_per_node
        rows.append({"nodes": nodes, "gpus": nodes * g, **{f"{k}_{name}": v for k, d in c.items()
                                         for name, v in d.items()},
                     "fsdp_hide": c["fsdp"]["forward_gather"] * rate / (2 * params),
                     "hsdp_hide": c["hsdp"]["forward_gather"] * rate / (2 * params)})
    return rows


def format_table(rows):
    """The rows of `table` as text: one line per node count."""
    def side(way):
        return ["|", (f"{way} ms", ">8.0f", lambda r: r[f"{way.lower()}_total"] * 1e3),
                ("of it net", ">9.0f", lambda r: r[f"{way.lower()}_network"] * 1e3),
                ("net GB/node", ">11.1f", lambda r: r[f"{way.lower()}_network_bytes"] / 1e9),
                ("fwd hides T>=", ">13,.0f", lambda r: r[f"{way.lower()}_hide"])]
    return text_table(rows, [("nodes", ">5", lambda r: r["nodes"]),
                             ("GPUs", ">5", lambda r: r["gpus"])] + side("FSDP") + side("HSDP"))
