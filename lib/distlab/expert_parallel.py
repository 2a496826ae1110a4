"""Expert parallelism: the experts of an MoE layer spread over the ranks of an EP group.

With E experts on an EP group of N ranks, rank r holds experts [r·E/N, (r+1)·E/N) and a copy of
everything else (the router). Every rank brings its own batch of tokens. One layer is:

    route          each rank routes its own tokens (the router is replicated)
    dispatch plan  sort the kept assignments by expert; experts are contiguous per rank, so this
                   also sorts them by destination rank; count the rows for each rank
    exchange       all_to_all the per-expert counts, so every rank knows what it will receive
    dispatch       all_to_all_single(rows, uneven splits): every token travels to its experts
    experts        each rank runs its local experts on what it received
    combine        all_to_all_single back along the reversed splits; then the inverse
                   permutation: each row is scaled by its gate and added to its token

all_to_all_single is not differentiable by itself: `AllToAll` is an autograd Function whose
backward is the same exchange reversed (a gradient row goes back to where its token came from).
A rank with no tokens for some expert, or none at all, still joins every exchange.

EP × DP on a 2D mesh (dp, ep): the experts are sharded along "ep" and replicated along "dp";
everything else is replicated everywhere. After backward, an expert's gradient already holds the
contributions of its whole EP group (they came back through the all-to-all), so it is all-reduced
over the DP group only; a replicated parameter's gradient is all-reduced over every rank.

Options beyond the plain layer (each proven equal to one process in tests/test_expert_parallel.py):
- capacity: by default each rank applies the capacity to its OWN tokens (GShard's per-group
  capacity: an expert can receive up to N × one rank's capacity, and which assignments drop
  depends on how the tokens are split over the ranks). `global_capacity=True` applies one
  capacity, computed from the EP group's tokens, to the group's queue (first choices of every
  rank before second choices, rank order, then token order): one process routing all the
  group's tokens at once does the same;
- `balance_group`: the group whose load counts f the auxiliary loss uses (global-batch
  balancing); None is the micro-batch's own. With a group, each rank's aux and z-loss are its
  share of the group's batch: their mean over the group is one process's over all its tokens,
  ranks with unequal or no tokens included. A rank with no token adds 0 either way;
- shared experts are replicated like the router; the selection bias and expert-choice routing
  come from the layer (`distlab.moe`).

At real size (`imbalanced_layer_step`: a Mixtral-8x7B layer on meta tensors, under emulation) the
routing is fixed (`skewed_rows`): a router needs values. `all_to_all_seconds` models the
exchange across nodes at two levels (each GPU's NIC carries the share for other nodes).
"""
import copy
import time

import torch
import torch.distributed as dist
import torch.nn as nn

from .moe import (MoE, Routing, capacity_keep, expert_capacity, expert_choice_route,
                  load_balancing_loss, route, update_selection_bias, z_loss)
from ._moe_checks import (_check_combine, _check_ep_model, _check_mesh_sizes, _check_moe,
                          _check_plan, _check_splits, _check_tokens, _check_volume)


class AllToAll(torch.autograd.Function):
    """forward: all_to_all_single of rows with uneven splits; backward: the reverse all-to-all."""

    @staticmethod
    def forward(ctx, rows, out_splits, in_splits, group):
        ctx.out_splits, ctx.in_splits, ctx.group = out_splits, in_splits, group
        out = rows.new_empty((sum(out_splits),) + rows.shape[1:])
        dist.all_to_all_single(out, rows.contiguous(), out_splits, in_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        back = grad.new_empty((sum(ctx.in_splits),) + grad.shape[1:])
        dist.all_to_all_single(back, grad.contiguous(), ctx.in_splits, ctx.out_splits,
                               group=ctx.group)
        return back, None, None, None


def all_to_all(rows, out_splits, in_splits, group):
    """Send in_splits[j] rows to rank j, receive out_splits[j] rows from rank j (differentiable)."""
    out_splits, in_splits = _check_splits(rows, out_splits, in_splits, dist.get_world_size(group))
    return AllToAll.apply(rows, out_splits, in_splits, group)


# ---- the two pieces the workbook asks for -------------------------------------------------------

def dispatch_plan(experts, keep, n_experts, ep_size):
    """(order, send_splits): which assignments to send, in what order, and how many to each rank.

    experts, keep: (T, k) from the routing. order indexes the flattened (T·k) assignments: the
    kept ones, sorted by expert (stable, so ties keep token order). send_splits[j] is the number
    of rows for rank j, which holds experts [j·E/N, (j+1)·E/N).
    """
    _check_plan(experts, keep, n_experts, ep_size)
    flat = experts.reshape(-1)
    kept = keep.reshape(-1).nonzero().squeeze(1)
    order = kept[torch.argsort(flat[kept], stable=True)]
    destination = flat[order] // (n_experts // ep_size)
    return order, torch.bincount(destination, minlength=ep_size).tolist()


def combine(expert_out, token, gate, n_tokens):
    """The inverse permutation: row i of expert_out, scaled by gate[i], is added to token[i]."""
    _check_combine(expert_out, token, gate, n_tokens)
    out = expert_out.new_zeros((n_tokens,) + expert_out.shape[1:])
    return out.index_add(0, token, gate.unsqueeze(-1) * expert_out)


# ---- the layer ----------------------------------------------------------------------------------

def check_ep_size(n_experts, ep_size):
    if n_experts % ep_size:
        raise ValueError(f"{n_experts} experts cannot be spread evenly over {ep_size} EP ranks: "
                         f"the number of experts must be a multiple of the EP size.")
    return n_experts // ep_size


class ExpertParallelMoE(nn.Module):
    """The experts of `moe` that this rank owns in `group`, plus a copy of its router.

    forward(x) -> (y, aux) equals moe(x) on this rank's tokens. `plan` and `combine` can be
    swapped (the workbook plugs in its own). After each forward, `stats` holds what this rank
    sent and received, and how long its local experts took.
    """

    def __init__(self, moe: MoE, group=None, plan=dispatch_plan, combine=combine,
                 global_capacity=False, balance_group=None):
        super().__init__()
        _check_moe(moe)
        self.group, self.balance_group = group, balance_group
        self.ep_size, self.ep_rank = dist.get_world_size(group), dist.get_rank(group)
        self.n_experts = moe.n_experts
        self.n_local = check_ep_size(moe.n_experts, self.ep_size)
        self.first = self.ep_rank * self.n_local
        self.top_k, self.capacity_factor = moe.top_k, moe.capacity_factor
        if global_capacity and moe.router_kind != "token_choice":
            raise ValueError("global_capacity applies to token-choice routing; expert choice "
                             "fills each expert from this rank's tokens by construction.")
        self.global_capacity = global_capacity
        # The full layer is built (same seed everywhere) and sliced: simple, and at scale one
        # would initialise only the local experts.
        self.router = copy.deepcopy(moe.router)
        self.experts = nn.ModuleList(copy.deepcopy(moe.experts[self.first + i])
                                     for i in range(self.n_local))
        self.shared = copy.deepcopy(moe.shared)       # replicated, like the router
        self.register_buffer("selection_bias", moe.selection_bias.clone())
        self.router_kind, self.plan, self.combine = moe.router_kind, plan, combine
        self.last_routing, self.z_loss, self.mean_probs, self.stats = None, None, None, {}

    def route(self, tokens):
        """The layer's routing (top-k, with the selection bias if set, or expert choice). The
        top-k goes through this module's name `route`, which the workbook's checkers swap."""
        logits = self.router(tokens)
        if self.router_kind == "expert_choice":
            routing = expert_choice_route(logits, self.capacity_factor or 1.0)
        elif self.selection_bias.any():
            routing = route(logits, self.top_k, self.capacity_factor, self.selection_bias)
        else:
            routing = route(logits, self.top_k, self.capacity_factor)
        self.last_routing = Routing(*(t.detach() if torch.is_tensor(t) else t for t in routing))
        # Kept with their graph, as in the one-process layer (z-loss, global-batch balancing).
        self.z_loss, self.mean_probs = z_loss(logits), routing.probs.mean(dim=0)
        return routing

    def expert_parameters(self):
        """The routed experts: sharded over EP. The shared experts are replicated."""
        return list(self.experts.parameters())

    def forward(self, x):
        tokens = _check_tokens(x, self.router.in_features).reshape(-1, x.shape[-1])
        if self.global_capacity:
            routing = self._route_with_group_capacity(tokens)
        else:
            routing = self.route(tokens)
        order, send_splits = self.plan(routing.experts, routing.keep, self.n_experts,
                                       self.ep_size)
        slots = routing.experts.shape[1]               # k; E under expert choice
        token, gate = order // slots, routing.gates.reshape(-1)[order]

        # Counts first: rank j learns how many rows of each of its experts every rank sends.
        per_expert = torch.bincount(routing.experts.reshape(-1)[order], minlength=self.n_experts)
        incoming = torch.empty_like(per_expert)
        dist.all_to_all_single(incoming, per_expert, group=self.group)
        incoming = incoming.view(self.ep_size, self.n_local)     # [source rank, local expert]
        recv_splits = incoming.sum(dim=1).tolist()

        received = all_to_all(tokens[token], recv_splits, send_splits, self.group)
        started = time.perf_counter()
        processed = self._run_local_experts(received, incoming)
        seconds = time.perf_counter() - started
        returned = all_to_all(processed, send_splits, recv_splits, self.group)
        y = self.combine(returned, token, gate, len(tokens))
        for expert in self.shared:
            y = y + expert(tokens)

        self.stats = {"sent_rows": send_splits, "received_rows": sum(recv_splits),
                      "expert_seconds": seconds}
        return y.reshape(x.shape), self._balancing_loss(routing)

    def _balancing_loss(self, routing):
        if self.balance_group is None:
            return load_balancing_loss(routing)
        # Global-batch balancing: f counts every rank's choices (a count: no gradient to carry).
        # P and the z-loss are means over the WHOLE batch's tokens, of which this rank holds
        # T_r: its losses are its share (T_r · N / T, from the same counts: each token is counted
        # once per slot), so their mean over the N ranks is the whole batch's loss also when the
        # ranks hold unequal numbers of tokens, or none.
        wanted = routing.wanted()
        dist.all_reduce(wanted, group=self.balance_group)
        # counted in Python ints: an integer tensor's true division is float32 (1e-8 off)
        all_tokens = int(wanted.sum()) // routing.experts.shape[1]
        share = len(routing.probs) * dist.get_world_size(self.balance_group) / max(all_tokens, 1)
        self.z_loss = z_loss(routing.logits, share)
        return load_balancing_loss(routing, wanted, share)

    def _route_with_group_capacity(self, tokens):
        # Learn every rank's choices and queue the whole group's assignments as one process
        # routing all the group's tokens at once would (the local capacity's keep is replaced).
        free = self.route(tokens)
        if self.capacity_factor is None:
            return free
        size = torch.tensor([len(tokens)], device=tokens.device)
        sizes = [torch.zeros_like(size) for _ in range(self.ep_size)]
        dist.all_gather(sizes, size, group=self.group)
        sizes = [int(n) for n in sizes]
        # all_gather wants equal shapes: pad every rank's (T, k) choices to the longest.
        padded = free.experts.new_zeros((max(sizes), self.top_k))
        padded[:len(tokens)] = free.experts
        everyone = [torch.empty_like(padded) for _ in sizes]
        dist.all_gather(everyone, padded, group=self.group)
        everyone = [e[:n] for e, n in zip(everyone, sizes)]
        capacity = expert_capacity(sum(sizes), self.n_experts, self.top_k, self.capacity_factor)
        mine = sum(sizes[:self.ep_rank])
        keep = capacity_keep(torch.cat(everyone), self.n_experts, capacity)
        routing = free._replace(keep=keep[mine:mine + len(tokens)], capacity=capacity)
        self.last_routing = self.last_routing._replace(keep=routing.keep, capacity=capacity)
        return routing

    def update_selection_bias(self, rate, group=None):
        """Aux-loss-free balancing after a step: the load summed over `group` (every rank that
        shares this router; None: the world), so that every copy of the bias moves alike."""
        load = self.last_routing.load()
        dist.all_reduce(load, group=group)
        update_selection_bias(self.selection_bias, load, rate)
        return load

    def _run_local_experts(self, received, incoming):
        # Rows arrive grouped by source rank, and inside each by local expert: regroup them by
        # expert, run each expert once on all its rows, and put the outputs back in arrival order.
        expert_of_row = torch.arange(self.n_local, device=received.device).repeat(self.ep_size)
        expert_of_row = expert_of_row.repeat_interleave(incoming.reshape(-1))
        by_expert = torch.argsort(expert_of_row, stable=True)
        sizes = torch.bincount(expert_of_row, minlength=self.n_local).tolist()
        chunks = received[by_expert].split(sizes)
        out = torch.cat([expert(chunk) for expert, chunk in zip(self.experts, chunks)])
        return out[torch.argsort(by_expert)]


# ---- EP × DP on a 2D mesh ------------------------------------------------------------------------

def ep_dp_mesh(dp, ep):
    """A DeviceMesh of shape (dp, ep): "ep" last, so an EP group is a run of neighbouring ranks
    (the all-to-alls stay inside a node) and a DP group strides across them."""
    from torch.distributed.device_mesh import init_device_mesh
    from .devices import device
    _check_mesh_sizes(dp, ep)
    if dp * ep != dist.get_world_size():
        raise ValueError(f"a ({dp}, {ep}) mesh needs {dp * ep} ranks; this run has "
                         f"{dist.get_world_size()}.")
    return init_device_mesh(device().type, (dp, ep), mesh_dim_names=("dp", "ep"))


def expert_parallel_model(model, mesh):
    """Replace `model.moe` by its expert-parallel shard on the mesh's "ep" group (in place)."""
    model.moe = ExpertParallelMoE(model.moe, mesh.get_group("ep"))
    return model


def global_name(name, first):
    """A parameter's name with local expert i renamed to global expert first + i (this rank's
    experts are first, first + 1, ...), to compare an EP rank's parameters with the dense model's;
    other names as they are."""
    if name.startswith("moe.experts."):
        i, rest = name[len("moe.experts."):].split(".", 1)
        return f"moe.experts.{first + int(i)}.{rest}"
    return name


def reduce_gradients(model, dp_group, world_group=None):
    """Average the gradients of an EP × DP model so that every rank holds the global gradient.

    The loss is the mean over all ranks of each rank's loss. Experts: their gradient already sums
    their EP group's tokens, so sum over DP. Everything else is replicated: sum over all ranks.
    """
    _check_ep_model(model)
    world = dist.get_world_size(world_group)
    experts = {id(p) for p in model.moe.expert_parameters()}
    for p in model.parameters():
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        dist.all_reduce(p.grad, group=dp_group if id(p) in experts else world_group)
        p.grad.div_(world)


# ---- communication volume --------------------------------------------------------------------------

def all_to_all_volume(tokens, top_k, d_model, ep_size, bytes_per_element=4):
    """Bytes one rank sends in ONE of a layer's all-to-alls, with a uniform load and no dropping.

    Each of its tokens·k rows lands on one of the N ranks uniformly, and the 1/N that stay home
    cross no wire: tokens · k · (N-1)/N · d_model · bytes. A layer does two of them forward
    (dispatch, combine) and two more backward.
    """
    _check_volume(tokens, top_k, d_model, ep_size, bytes_per_element)
    return tokens * top_k * (ep_size - 1) / ep_size * d_model * bytes_per_element


# ---- load imbalance and the all-to-alls at real size (meta tensors under emulation) ---------------

# Mixtral 8x7B's MoE layer (Jiang et al. 2024, "Mixtral of Experts", table 1: dim 4096,
# hidden_dim 14336, num_experts 8, top_k_experts 2; each expert a SwiGLU FFN), bf16.
MIXTRAL_8X7B = dict(d_model=4096, ffn=14336, n_experts=8, top_k=2, dtype=torch.bfloat16)


class SwiGLUExpert(nn.Module):
    """One Mixtral expert: down(silu(gate(x)) * up(x)), no biases (gate and up in one matmul)."""

    def __init__(self, d_model, ffn, dtype=torch.bfloat16, **_):
        super().__init__()
        self.gate_up = nn.Linear(d_model, 2 * ffn, bias=False, dtype=dtype)
        self.down = nn.Linear(ffn, d_model, bias=False, dtype=dtype)

    def forward(self, x):
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        return self.down(nn.functional.silu(gate) * up)


def skewed_rows(tokens, top_k, n_experts, busiest_over_mean):
    """Rows each expert receives from ONE rank when every rank's router sends expert 0
    `busiest_over_mean` times its fair share of the tokens·k assignments and spreads the rest
    evenly: a FIXED routing (meta tensors have no values to route by), the same on every rank.
    Rounded to whole rows; the total stays tokens·k."""
    if not 1.0 <= busiest_over_mean <= n_experts:
        raise ValueError(f"busiest/mean must lie between 1 (balanced) and {n_experts} (every "
                         f"assignment on one expert); got {busiest_over_mean}.")
    total = tokens * top_k
    hot = round(total * busiest_over_mean / n_experts)
    rest = total - hot
    cold = [rest // (n_experts - 1) + (1 if i < rest % (n_experts - 1) else 0)
            for i in range(n_experts - 1)] if n_experts > 1 else []
    return [hot] + cold


def imbalanced_layer_step(rank, world_size, busiest_over_mean, tokens=8192, config=MIXTRAL_8X7B):
    """One MoE layer's expert-parallel forward and backward at full size on meta tensors, one
    expert per rank, with the fixed routing of `skewed_rows`: dispatch all-to-all, the local
    expert, combine all-to-all, then the backward (the same exchanges reversed). The router, the
    permutation and the gate multiply are left out: their cost does not depend on the balance.
    Returns (rows this rank's expert processed, seconds of the layer, seconds of its expert's
    forward + backward) on this rank's virtual clock."""
    from . import trace
    if config["n_experts"] != world_size:
        raise ValueError(f"this step holds one expert per rank: run it on "
                         f"{config['n_experts']} ranks, not {world_size}.")
    rows = skewed_rows(tokens, config["top_k"], config["n_experts"], busiest_over_mean)
    send = rows                                   # to rank j: the rows for expert j
    recv = [rows[rank]] * world_size              # from every rank: its rows for my expert
    with torch.device("meta"):
        expert = SwiGLUExpert(**config)
        x = torch.empty(sum(send), config["d_model"], dtype=config["dtype"], requires_grad=True)
    dist.barrier()
    start = trace.now()
    arrived = AllToAll.apply(x, recv, send, dist.group.WORLD)
    t0 = trace.now()
    out = expert(arrived)
    forward = trace.now() - t0
    back = AllToAll.apply(out, send, recv, dist.group.WORLD)
    # the backward, timed by the ranks' clocks; the expert's own part recorded with a hook
    spans = []
    arrived.register_hook(lambda g: spans.append(trace.now()))
    out.register_hook(lambda g: spans.append(trace.now()))
    back.backward(torch.empty_like(back))
    expert_seconds = forward + (spans[1] - spans[0])
    return rows[rank] * world_size, trace.now() - start, expert_seconds


def all_to_all_seconds(nbytes, world_size, cluster):
    """Modeled seconds of one all-to-all in which every one of `world_size` ranks sends `nbytes`
    spread evenly over all ranks (itself included), on `cluster` (ranks placed node by node).

    Inside a node: the node link's own model. Across nodes the traffic has two levels: the share
    for ranks on other nodes leaves through this GPU's own NIC (one NIC per GPU, as in DGX
    nodes), the share for its node's ranks over NVLink, both at once: the longer one sets the
    time. (A ring crossing nodes gets min(NVLink, k NICs), but an all-to-all cannot spread one
    GPU's cross-node bytes over its neighbours' NICs without forwarding them over NVLink first,
    which is what DeepEP's kernels do at the same NIC rate.) The emulator charges the same
    link (`Cluster.link_between`)."""
    from .emulate import resolve
    cluster = resolve(cluster)
    # the link the emulator charges (distlab.hardware.GroupLink's two-level all_to_all)
    return cluster.link_between(range(world_size)).seconds("all_to_all", nbytes, world_size)
