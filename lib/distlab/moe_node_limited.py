"""Node-limited routing and the two-level (hierarchical) all-to-all, on real ranks (chapter 09b).

The EP group is cut into NODES of L ranks: rank r = node · L + local. Expert e lives on rank
e // (E/W), so node m holds experts [m·E/N, (m+1)·E/N).

- node-limited routing (DeepSeek-V3, §2.1.2): for each token, score every node by the sum of its
  ceil(k/M) highest affinities, keep the M best nodes, then take the top-k experts among those
  nodes' experts only. A token's experts then sit on at most M nodes;
- hierarchical dispatch (DeepEP's scheme): a token crosses to each destination NODE once, to the
  rank on that node with its own local index (the same "rail"), over the inter-node group; that
  rank forwards it inside its node, over the intra-node group, once to each rank holding some of
  the token's experts. The combine runs the same way back, summing on the way: each expert rank
  returns one gate-weighted sum per token, each relay one sum per token across the nodes;
- the flat all-to-all of the same routing sends one row per (token, expert) straight to the
  expert's rank: a token going to 3 experts on one remote node crosses 3 times.

Both schemes use one `stage` (each row once to every peer of a group that holds one of its
targets) and its `unstage` (the sums back); the exchanges are point-to-point messages, so the
run's trace shows every message's two ends and bytes. The gates travel with the rows and come
back with their gradients. The layer is dropless (no capacity). Proven equal to
`dense_reference` (every expert on every token, weighted by a dense (T, E) gate matrix) in
tests/test_moe_node_limited.py.
"""
import copy
import math
from typing import NamedTuple

import torch
import torch.distributed as dist
import torch.nn as nn

from .moe import Routing, load_balancing_loss

# message tags: the dispatched rows, their gates, where they go; the rows the combine returns
ROWS, GATES, TARGETS, RETURNS = 1, 2, 3, 4


# ---- the groups: one intra-node group per node, one inter-node group per local index -------------

class NodeGroups(NamedTuple):
    intra: object           # this rank's node: ranks node·L .. node·L + L-1
    inter: object           # the ranks with this rank's local index, one per node
    nodes: int
    ranks_per_node: int


def node_groups(ranks_per_node):
    """Build every node's intra-node group and every local index's inter-node group (every rank
    builds all of them, in the same order) and return this rank's two."""
    world, rank = dist.get_world_size(), dist.get_rank()
    if isinstance(ranks_per_node, bool) or not isinstance(ranks_per_node, int) \
            or ranks_per_node < 1 or world % ranks_per_node:
        fits = [d for d in range(1, world + 1) if world % d == 0]
        raise ValueError(f"{world} ranks do not split into nodes of {ranks_per_node!r} ranks: "
                         f"ranks_per_node must divide the world size (one of {fits}).")
    n, L = world // ranks_per_node, ranks_per_node
    intra = [dist.new_group([m * L + j for j in range(L)]) for m in range(n)]
    inter = [dist.new_group([m * L + j for m in range(n)]) for j in range(L)]
    return NodeGroups(intra[rank // L], inter[rank % L], n, L)


# ---- node-limited routing ------------------------------------------------------------------------

def node_limited_route(logits, top_k, n_nodes, max_nodes):
    """DeepSeek-V3's top-k over at most `max_nodes` of the `n_nodes` nodes (experts spread
    evenly, node by node): the M nodes whose ceil(k/M) highest affinities sum highest (the
    report's K/M, rounded up when M does not divide k), then the top-k among their experts; gates
    renormalised over the k (as `distlab.moe.route`). The softmax probabilities stand in for
    V3's sigmoid affinities."""
    n_tokens, n_experts = logits.shape
    per_node = _check_route(n_experts, top_k, n_nodes, max_nodes)
    probs = logits.softmax(dim=-1)
    scores = probs.detach().view(n_tokens, n_nodes, per_node)
    best = min(per_node, math.ceil(top_k / max_nodes))
    node_score = scores.topk(best, dim=-1).values.sum(dim=-1)                  # (T, nodes)
    nodes = node_score.topk(max_nodes, dim=-1).indices                         # (T, M)
    allowed = torch.zeros_like(node_score, dtype=torch.bool).scatter_(1, nodes, True)
    scores = scores.masked_fill(~allowed.unsqueeze(-1), float("-inf")).view(n_tokens, n_experts)
    experts = scores.topk(top_k, dim=-1).indices
    gates = probs.gather(-1, experts)
    if top_k > 1:
        gates = gates / gates.sum(dim=-1, keepdim=True)
    return Routing(probs, experts, gates, torch.ones_like(experts, dtype=torch.bool), None, logits)


def dense_reference(moe, x, n_nodes, max_nodes):
    """One process, densely: every expert on every token, weighted by the (T, E) gate matrix of
    the node-limited routing (zero where a token did not choose the expert). (y, aux)."""
    routing = node_limited_route(moe.router(x), moe.top_k, n_nodes, max_nodes)
    weight = torch.zeros_like(routing.probs).scatter(1, routing.experts, routing.gates)
    y = sum(weight[:, e:e + 1] * expert(x) for e, expert in enumerate(moe.experts))
    for expert in moe.shared:
        y = y + expert(x)
    return y, load_balancing_loss(routing)


# ---- the exchanges: point-to-point messages, differentiable --------------------------------------

def _exchange(blocks, sizes_in, group, tag):
    """Send blocks[j] to group rank j, receive sizes_in[j] rows from it (my own block stays
    here; empty blocks travel no message: both ends know the sizes). Returns the received blocks."""
    me, ops, got = dist.get_rank(group), [], []
    for j, (block, n) in enumerate(zip(blocks, sizes_in)):
        if j == me:
            got.append(block)
            continue
        got.append(block.new_empty((n,) + block.shape[1:]))
        if len(block):
            ops.append(dist.P2POp(dist.isend, block.contiguous(), group=group, group_peer=j,
                                  tag=tag))
        if n:
            ops.append(dist.P2POp(dist.irecv, got[-1], group=group, group_peer=j, tag=tag))
    for work in dist.batch_isend_irecv(ops) if ops else []:
        work.wait()
    return torch.cat(got)


class SendRows(torch.autograd.Function):
    """forward: rows[blocks of sizes_out] to the group's ranks, sizes_in rows back from each;
    backward: the gradients of what arrived go back to where the rows came from."""

    @staticmethod
    def forward(ctx, rows, sizes_out, sizes_in, group, tag):
        ctx.args = sizes_out, sizes_in, group, tag
        return _exchange(rows.split(sizes_out), sizes_in, group, tag)

    @staticmethod
    def backward(ctx, grad):
        sizes_out, sizes_in, group, tag = ctx.args
        return _exchange(grad.split(sizes_in), sizes_out, group, tag), None, None, None, None


class Staged(NamedTuple):
    rows: torch.Tensor      # the rows that arrived (by source rank)
    targets: torch.Tensor   # (rows, k) each slot's target index on THIS rank, -1: elsewhere
    gates: torch.Tensor     # (rows, k) the slots' gates, 0 where the target is elsewhere
    undo: tuple             # what unstage needs


def stage(rows, targets, gates, group, per_peer):
    """Each row once to every rank of `group` that holds one of its targets (target index //
    per_peer; -1: no target), with the targets (relative to the receiver) and gates."""
    peers = dist.get_world_size(group)
    peer = torch.where(targets >= 0, targets.div(per_peer, rounding_mode="floor"), peers)
    goes = torch.zeros(len(rows), peers + 1, dtype=torch.bool, device=rows.device)
    goes.scatter_(1, peer, True)
    to, row = goes[:, :peers].t().nonzero(as_tuple=True)              # by destination peer
    sizes_out = torch.bincount(to, minlength=peers)
    sizes_in = torch.empty_like(sizes_out)
    dist.all_to_all_single(sizes_in, sizes_out, group=group)
    sizes_out, sizes_in = sizes_out.tolist(), sizes_in.tolist()
    here = peer[row] == to.unsqueeze(1)
    local = torch.where(here, targets[row] - to.unsqueeze(1) * per_peer, -1)
    gate = torch.where(here, gates[row], 0.0)
    return Staged(SendRows.apply(rows[row], sizes_out, sizes_in, group, ROWS),
                  _exchange(local.split(sizes_out), sizes_in, group, TARGETS),
                  SendRows.apply(gate, sizes_out, sizes_in, group, GATES),
                  (row, sizes_out, sizes_in, group, len(rows)))


def unstage(out, undo):
    """The way back: one row per row that arrived, summed into the rows they came from."""
    row, sizes_out, sizes_in, group, n_rows = undo
    back = SendRows.apply(out, sizes_in, sizes_out, group, RETURNS)
    return back.new_zeros((n_rows,) + back.shape[1:]).index_add(0, row, back)


# ---- the layer -----------------------------------------------------------------------------------

class NodeLimitedMoE(nn.Module):
    """The experts of `moe` this rank owns, a copy of its router, node-limited routing to at most
    `max_nodes` nodes, and the hierarchical exchange (or, `hierarchical=False`, the flat one of
    the same routing over every rank). forward(x) -> (y, aux) equals dense_reference on x."""

    def __init__(self, moe, groups, max_nodes, hierarchical=True):
        super().__init__()
        _check_layer(moe, groups, max_nodes)
        self.groups, self.max_nodes, self.hierarchical = groups, max_nodes, hierarchical
        self.top_k, self.n_experts = moe.top_k, moe.n_experts
        self.per_rank = moe.n_experts // dist.get_world_size()
        self.first = dist.get_rank() * self.per_rank
        self.router, self.shared = copy.deepcopy(moe.router), copy.deepcopy(moe.shared)
        self.experts = nn.ModuleList(copy.deepcopy(moe.experts[self.first + i])
                                     for i in range(self.per_rank))

    def forward(self, x):
        tokens = x.reshape(-1, x.shape[-1])
        routing = node_limited_route(self.router(tokens), self.top_k, self.groups.nodes,
                                     self.max_nodes)
        self.last_routing = routing
        if self.hierarchical:           # across nodes once per node, then inside the node
            to_node = stage(tokens, routing.experts, routing.gates, self.groups.inter,
                            self.n_experts // self.groups.nodes)
            to_rank = stage(*to_node[:3], self.groups.intra, self.per_rank)
            relayed = unstage(self._experts(to_rank), to_rank.undo)
            y = unstage(relayed, to_node.undo)
        else:                           # one row per (token, expert), straight to its rank
            k = self.top_k
            flat = stage(tokens.repeat_interleave(k, 0), routing.experts.reshape(-1, 1),
                         routing.gates.reshape(-1, 1), dist.group.WORLD, self.per_rank)
            y = unstage(self._experts(flat), flat.undo).view(len(tokens), k, tokens.shape[1]).sum(1)
        for expert in self.shared:
            y = y + expert(tokens)
        return y.reshape(x.shape), load_balancing_loss(routing)

    def _experts(self, staged):
        """Each row: the gate-weighted sum of this rank's experts it was sent to. Every expert
        runs, on no rows too, so its gradient is zero rather than None (as in one process)."""
        out = staged.rows.new_zeros(staged.rows.shape)
        for i, expert in enumerate(self.experts):
            row, slot = (staged.targets == i).nonzero(as_tuple=True)
            out = out.index_add(0, row, staged.gates[row, slot, None] * expert(staged.rows[row]))
        return out


# ---- what crosses between nodes ------------------------------------------------------------------

def crossings(experts, experts_per_node, own_node, n_nodes):
    """(flat, hierarchical): how many times this rank's tokens cross to another node in one
    dispatch, from the routing alone — one per expert on another node, or one per other node."""
    node = experts.div(experts_per_node, rounding_mode="floor")
    remote = node != own_node
    distinct = torch.zeros(len(node), n_nodes, dtype=torch.bool).scatter_(1, node, True)
    distinct[:, own_node] = False
    return int(remote.sum()), int(distinct.sum())


def cross_node_bytes(trace, ranks_per_node, tag=ROWS, span=None, op="send"):
    """Per rank: bytes of the trace's messages with `tag` (inside the trace.span named `span`)
    that it sent (op="send") to, or received from, a rank on another node."""
    out = [0] * trace.world_size
    for e in trace.comm(op=op):
        if e["tag"] == tag and (span is None or span in (e["label"] or ())) \
                and e["rank"] // ranks_per_node != e["peer"] // ranks_per_node:
            out[e["rank"]] += e["bytes"]
    return out


# ---- refusals in one sentence --------------------------------------------------------------------

def _check_route(n_experts, top_k, n_nodes, max_nodes):
    if n_experts % n_nodes:
        raise ValueError(f"{n_experts} experts do not spread evenly over {n_nodes} nodes: use a "
                         f"number of experts that is a multiple of the number of nodes.")
    if isinstance(max_nodes, bool) or not isinstance(max_nodes, int) \
            or not 1 <= max_nodes <= n_nodes:
        raise ValueError(f"max_nodes = {max_nodes!r}, but the run has {n_nodes} node(s): a "
                         f"token can be limited to 1 .. {n_nodes} nodes.")
    per_node = n_experts // n_nodes
    if top_k > max_nodes * per_node:
        raise ValueError(f"top_k = {top_k} experts cannot be found on max_nodes = {max_nodes} "
                         f"node(s) of {per_node} experts each: raise max_nodes to at least "
                         f"{math.ceil(top_k / per_node)} or lower top_k to {max_nodes * per_node}.")
    return per_node


def _check_layer(moe, groups, max_nodes):
    if not isinstance(groups, NodeGroups):
        raise TypeError(f"NodeLimitedMoE takes the groups from node_groups(ranks_per_node); got "
                        f"a {type(groups).__name__}.")
    if getattr(moe, "router_kind", None) != "token_choice" or moe.capacity_factor is not None \
            or moe.selection_bias.any():
        raise ValueError("the node-limited layer is dropless token choice without selection "
                         "bias: build the MoE with capacity_factor=None and the default router.")
    world = dist.get_world_size()
    if moe.n_experts % world:
        raise ValueError(f"{moe.n_experts} experts cannot be spread evenly over {world} ranks: "
                         f"the number of experts must be a multiple of the world size.")
    _check_route(moe.n_experts, moe.top_k, groups.nodes, max_nodes)
