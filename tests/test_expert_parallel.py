"""The MoE layer and expert parallelism: every rank's output and every gradient equal one process."""
import copy

import pytest
import torch
import torch.distributed as dist

import distlab
from distlab.expert_parallel import (ExpertParallelMoE, all_to_all, check_ep_size, combine,
                                     dispatch_plan, ep_dp_mesh, expert_parallel_model,
                                     global_name, reduce_gradients)
from distlab.models import regression_data
from distlab.moe import (Routing, capacity_keep, domain_steps, load_balancing_loss, make_moe,
                         make_moe_model, route, shard_loss, train_balancing, train_moe_reference)

F64 = torch.float64
D = 8
# (top_k, capacity_factor, router bias): with and without dropping; "skew" sends nearly every
# token to expert 0, so some ranks receive nothing and some send nothing.
CONFIGS = [(1, None, None), (1, 1.0, None), (1, 0.5, None), (2, None, None), (2, 1.0, None),
           (2, 0.75, None), (1, None, "skew"), (2, 1.0, "skew")]


def _tokens(rank, n=12):
    g = torch.Generator().manual_seed(100 + rank)
    return torch.randn(n, D, generator=g, dtype=F64)


def _layer(n_experts, top_k, capacity_factor, bias):
    moe = make_moe(seed=1, dtype=F64, d_model=D, hidden=16, n_experts=n_experts, top_k=top_k,
                   capacity_factor=capacity_factor)
    if bias == "skew":
        with torch.no_grad():
            moe.router.bias[0] = 8.0
    return moe


def _probe(y):
    # A loss whose gradient differs per element, so a row sent back to the wrong token shows.
    return (y * torch.linspace(-1.0, 2.0, y.numel(), dtype=y.dtype).view_as(y)).sum()


# ---- the single-process layer ----------------------------------------------------------------------

def test_capacity_drops_second_choices_before_first_choices():
    experts = torch.tensor([[0, 1], [0, 1], [1, 0], [0, 2]])
    keep = capacity_keep(experts, n_experts=3, capacity=2)
    # Expert 0's queue: first choices of tokens 0, 1, 3 (token 3 is third: dropped), then
    # token 2's second choice (dropped). Expert 1: token 2 (1st choice), then tokens 0, 1 (2nd).
    assert keep.tolist() == [[True, True], [True, False], [True, False], [False, True]]
    assert capacity_keep(experts, 3, None).all()


def _routing_by_hand(x, router, top_k, capacity):
    """(T, E) weight of each expert in each token's output, written out from the definition:
    softmax over the experts, the top k, gates renormalised to sum to 1 when k > 1, then each
    expert takes at most `capacity` assignments - all first choices before any second choice,
    earlier tokens first."""
    probs = torch.softmax(x @ router.weight.t() + router.bias, dim=-1)
    n_tokens, n_experts = probs.shape
    chosen = []
    for t in range(n_tokens):
        best = sorted(range(n_experts), key=lambda e: -probs[t, e].item())[:top_k]
        total = sum(probs[t, e] for e in best) if top_k > 1 else 1.0
        chosen.append([(e, probs[t, e] / total) for e in best])
    taken, weights = [0] * n_experts, [[0.0] * n_experts for _ in range(n_tokens)]
    for slot in range(top_k):
        for t in range(n_tokens):
            e, gate = chosen[t][slot]
            if capacity is None or taken[e] < capacity:
                taken[e] += 1
                weights[t][e] = weights[t][e] + gate
    return torch.stack([torch.stack([torch.as_tensor(w, dtype=F64) for w in row])
                        for row in weights]), chosen


# (top_k, capacity factor, capacity of 12 tokens over 4 experts = ceil(factor * 12 * k / 4))
ROUTINGS = [(1, None, None), (1, 0.5, 2), (1, 1.25, 4), (2, None, None), (2, 0.75, 5),
            (2, 1.0, 6)]


@pytest.mark.parametrize("top_k, capacity_factor, capacity", ROUTINGS)
def test_moe_equals_a_dense_computation(top_k, capacity_factor, capacity):
    """Every expert on every token, combined through a (T, E) weight matrix built by hand."""
    moe = _layer(4, top_k, capacity_factor, None)
    x = _tokens(0).requires_grad_()
    y, aux = moe(x)
    r = moe.last_routing
    assert r.capacity == capacity                               # rounded up, never down
    weights, chosen = _routing_by_hand(x, moe.router, top_k, capacity)
    dense = sum(weights[:, e:e + 1] * expert(x) for e, expert in enumerate(moe.experts))
    torch.testing.assert_close(y, dense, rtol=0, atol=1e-13)
    # The gates: a top-2 token's two sum to 1; a top-1 token's is its router probability.
    gate_sums = r.gates.sum(-1)
    if top_k > 1:
        torch.testing.assert_close(gate_sums, torch.ones(len(x), dtype=F64), rtol=0, atol=1e-15)
    else:
        torch.testing.assert_close(gate_sums, r.probs.max(-1).values, rtol=0, atol=0)
        assert (gate_sums < 1).all()
    assert r.experts.tolist() == [[e for e, _ in c] for c in chosen]
    if capacity is not None:
        assert int(r.load().max()) == capacity and int(r.load().sum()) < len(x) * top_k
        assert r.dropped_tokens() == int((~r.keep).all(-1).sum())
    gx, = torch.autograd.grad(_probe(y), x)
    gd, = torch.autograd.grad(_probe(dense), x)
    torch.testing.assert_close(gx, gd, rtol=0, atol=1e-13)
    assert 1.0 <= aux.item() <= 4.0


@pytest.mark.parametrize("tokens, experts, top_k, factor, capacity", [
    (12, 4, 1, 0.5, 2), (10, 3, 1, 1.0, 4), (12, 4, 2, 0.75, 5), (7, 4, 2, 1.0, 4),
    (8, 4, 1, 1.0, 2), (5, 8, 1, 1.0, 1)])
def test_expert_capacity_rounds_up(tokens, experts, top_k, factor, capacity):
    from distlab.moe import expert_capacity
    assert expert_capacity(tokens, experts, top_k, factor) == capacity
    assert expert_capacity(tokens, experts, top_k, None) is None


def test_load_balancing_loss_is_one_when_uniform_and_e_when_collapsed():
    e = 4
    uniform = Routing(torch.full((8, e), 1 / e), torch.arange(8).remainder(e).view(8, 1),
                      torch.ones(8, 1), torch.ones(8, 1, dtype=torch.bool), None)
    assert load_balancing_loss(uniform).item() == pytest.approx(1.0, abs=1e-12)
    probs = torch.zeros(8, e)
    probs[:, 0] = 1.0
    collapsed = uniform._replace(probs=probs, experts=torch.zeros(8, 1, dtype=torch.long))
    assert load_balancing_loss(collapsed).item() == pytest.approx(e, abs=1e-12)


def test_route_refuses_a_top_k_larger_than_the_experts():
    with pytest.raises(ValueError, match="top_k must be between 1 and the number of experts"):
        route(torch.zeros(3, 2), top_k=3)


def test_dispatch_plan_and_combine_against_brute_force():
    g = torch.Generator().manual_seed(5)
    for ep, n_experts, top_k in [(1, 4, 1), (2, 4, 2), (3, 6, 2), (4, 8, 1)]:
        experts = torch.stack([torch.randperm(n_experts, generator=g)[:top_k] for _ in range(10)])
        keep = torch.rand(10, top_k, generator=g) > 0.3
        order, splits = dispatch_plan(experts, keep, n_experts, ep)
        pairs = [(int(experts.view(-1)[i]), int(i)) for i in keep.view(-1).nonzero().view(-1)]
        assert [int(i) for i in order] == [i for _, i in sorted(pairs)]
        owner = [e // (n_experts // ep) for e, _ in pairs]
        assert splits == [owner.count(j) for j in range(ep)]
    rows, token, gate = torch.randn(5, 3, dtype=F64), torch.tensor([2, 0, 2, 1, 0]), torch.rand(5, dtype=F64)
    expected = torch.zeros(4, 3, dtype=F64)
    for i in range(5):
        expected[token[i]] += gate[i] * rows[i]
    torch.testing.assert_close(combine(rows, token, gate, 4), expected, rtol=0, atol=1e-15)


def test_experts_must_divide_over_the_ep_ranks():
    with pytest.raises(ValueError, match="must be a multiple of the EP size"):
        check_ep_size(6, 4)


# ---- the all-to-all with its backward ----------------------------------------------------------------

def _all_to_all_against_torch(rank, world_size):
    import torch.distributed.nn.functional as dnn
    send = [(rank + 2 * j) % 3 for j in range(world_size)]          # uneven, some zero
    recv = [(j + 2 * rank) % 3 for j in range(world_size)]
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(sum(send), 3, generator=g, dtype=F64)
    ours_x, theirs_x = x.clone().requires_grad_(), x.clone().requires_grad_()
    ours = all_to_all(ours_x, recv, send, None)
    theirs = dnn.all_to_all_single(torch.empty(sum(recv), 3, dtype=F64), theirs_x, recv, send)
    _probe(ours).backward()
    _probe(theirs).backward()
    return ours.detach(), theirs.detach(), ours_x.grad, theirs_x.grad


@pytest.mark.parametrize("world_size", [1, 3, 4, 6])
def test_all_to_all_forward_and_backward_equal_torch_distributed_nn(world_size):
    for rank, (ours, theirs, g_ours, g_theirs) in enumerate(
            distlab.run(_all_to_all_against_torch, world_size, timeout=120)):
        assert torch.equal(ours, theirs), f"rank {rank}: forward differs"
        assert torch.equal(g_ours, g_theirs), f"rank {rank}: backward differs"


# ---- the expert-parallel layer equals the single-process layer ------------------------------------

def _ep_against_reference(rank, world_size, experts_per_rank):
    n_experts = experts_per_rank * world_size
    errors = {}
    for top_k, capacity_factor, bias in CONFIGS:
        moe = _layer(n_experts, top_k, capacity_factor, bias)
        ep = ExpertParallelMoE(moe, group=None)
        x = _tokens(rank).requires_grad_()
        y, aux = ep(x)
        (_probe(y) + aux).backward()

        # One process: the same layer on every rank's tokens, the losses summed.
        xs = [_tokens(r).requires_grad_() for r in range(world_size)]
        outs = [moe(xr) for xr in xs]
        sum(_probe(yr) + ar for yr, ar in outs).backward()

        router_grads = [p.grad.clone() for p in ep.router.parameters()]
        for grad in router_grads:
            dist.all_reduce(grad)          # the router is replicated: its gradient sums all ranks
        pairs = {"output": (y, outs[rank][0]), "aux": (aux, outs[rank][1]),
                 "input grad": (x.grad, xs[rank].grad),
                 "router weight grad": (router_grads[0], moe.router.weight.grad),
                 "router bias grad": (router_grads[1], moe.router.bias.grad)}
        for i, expert in enumerate(ep.experts):
            ref = moe.experts[ep.first + i]
            for (name, p), q in zip(expert.named_parameters(), ref.parameters()):
                pairs[f"expert {ep.first + i} {name} grad"] = (p.grad, q.grad)
        worst = {k: (a.detach() - b.detach()).abs().max().item() for k, a, b in
                 ((k, *v) for k, v in pairs.items())}
        errors[(top_k, capacity_factor, bias)] = (worst, ep.stats["received_rows"])
    if world_size in (2, 3) and experts_per_rank == 2:
        errors.update(_modern_against_reference(rank, world_size))
        errors.update(_empty_rank_against_reference(rank, world_size))
    return errors


# A rank with no token (the last), beside ranks of 12 and 7: per-rank losses against the
# one-process layer on each rank's batch (an empty batch's aux and z-loss are 0, not a mean over
# nothing), and global-batch balancing against one process over ALL the tokens at once.
EMPTY = {
    "empty rank, top-2, per-rank": (dict(top_k=2, capacity_factor=1.0), {}),
    "empty rank, expert choice, per-rank": (dict(router="expert_choice", capacity_factor=1.0), {}),
    "empty rank, top-2, global batch": (dict(top_k=2, capacity_factor=1.0),
                                        dict(global_capacity=True, balance_group="world")),
    "empty rank, top-1, shared expert, global batch": (
        dict(top_k=1, capacity_factor=1.5, n_shared=1),
        dict(global_capacity=True, balance_group="world")),
}


def _empty_rank_against_reference(rank, world_size):
    sizes = [12, 7, 0][-world_size:] if world_size == 3 else [12, 0]
    errors = {}
    for name, (config, options) in EMPTY.items():
        moe = make_moe(seed=1, dtype=F64, d_model=D, hidden=16, n_experts=2 * world_size, **config)
        if options.get("balance_group") == "world":
            options = dict(options, balance_group=dist.group.WORLD)
        ep = ExpertParallelMoE(moe, group=None, **options)
        x = _tokens(rank, sizes[rank]).requires_grad_()
        y, aux = ep(x)
        (_probe(y) + aux + ep.z_loss).backward()
        xs = [_tokens(r, n).requires_grad_() for r, n in enumerate(sizes)]
        if "global" in name:
            # one process, every token at once; each rank's losses are its share, so their
            # mean over the ranks is the whole batch's
            y_all, aux_all = moe(torch.cat(xs))
            ref_y = y_all.split(sizes)[rank]
            loss = sum(_probe(yr) for yr in y_all.split(sizes)) + world_size * (aux_all
                                                                               + moe.z_loss)
            shares = torch.stack([aux.detach(), ep.z_loss.detach()])
            dist.all_reduce(shares)
            worst = {"mean aux": (shares[0] / world_size - aux_all).abs().item(),
                     "mean z-loss": (shares[1] / world_size - moe.z_loss).abs().item()}
        else:
            # one process, batch by batch (the empty one too), the losses summed
            loss, worst = 0, {}
            for r, xr in enumerate(xs):
                yr, ar = moe(xr)
                loss = loss + _probe(yr) + ar + moe.z_loss
                if r == rank:
                    ref_y = yr
                    worst["aux"] = (aux - ar).abs().item()
                    worst["z-loss"] = (ep.z_loss - moe.z_loss).abs().item()
        loss.backward()
        worst["output"] = (y - ref_y).abs().max().item() if len(y) else 0.0
        worst["input grad"] = (x.grad - xs[rank].grad).abs().max().item() if len(x) else 0.0
        replicated = list(zip(ep.router.parameters(), moe.router.parameters()))
        replicated += list(zip(ep.shared.parameters(), moe.shared.parameters()))
        for i, (p, q) in enumerate(replicated):
            grad = p.grad.clone()
            dist.all_reduce(grad)               # NaN on one rank would be NaN on every rank
            worst[f"replicated parameter {i} grad"] = (grad - q.grad).abs().max().item()
        for i, expert in enumerate(ep.experts):
            for (pname, p), q in zip(expert.named_parameters(),
                                     moe.experts[ep.first + i].parameters()):
                worst[f"expert {ep.first + i} {pname} grad"] = (p.grad - q.grad).abs().max().item()
        errors[name] = (worst, sizes[rank])
    return errors


# Each modern option against the single-process reference that applies the same rule, in the
# same launch as the plain layer (2 and 3 ranks). "global" configs: one process routing every
# rank's tokens at once (one capacity for the group's queue; f over the whole batch).
MODERN = {
    "global capacity, top-2": (dict(top_k=2, capacity_factor=0.75), dict(global_capacity=True)),
    "global capacity, top-1, skewed": (dict(top_k=1, capacity_factor=1.0),
                                       dict(global_capacity=True)),
    "shared expert + selection bias + global-batch aux + global capacity":
        (dict(top_k=2, capacity_factor=1.0, n_shared=1),
         dict(global_capacity=True, balance_group="world")),
    "shared experts, fine-grained, per-rank": (dict(top_k=2, n_shared=2, shared_hidden=8), {}),
    "expert choice": (dict(router="expert_choice", capacity_factor=1.0), {}),
}


def _modern_against_reference(rank, world_size):
    errors = {}
    for name, (config, options) in MODERN.items():
        moe = make_moe(seed=1, dtype=F64, d_model=D, hidden=16, n_experts=2 * world_size, **config)
        with torch.no_grad():
            if "skewed" in name:
                moe.router.bias[0] = 3.0
            if "bias" in name:
                moe.selection_bias.copy_(torch.linspace(0.2, -0.2, moe.n_experts, dtype=F64))
        if options.get("balance_group") == "world":
            options = dict(options, balance_group=dist.group.WORLD)
        ep = ExpertParallelMoE(moe, group=None, **options)
        x = _tokens(rank).requires_grad_()
        y, aux = ep(x)
        together = "global" in name
        # Per-rank aux is the loss of that rank's batch; global-batch aux's mean over ranks is the
        # whole batch's. Only the latter has a one-process twin when the capacity is global too.
        uses_aux = "global-batch" in name or not together
        (_probe(y) + (aux if uses_aux else 0)).backward()
        xs = [_tokens(r).requires_grad_() for r in range(world_size)]
        if together:
            y_all, aux_all = moe(torch.cat(xs))
            ys = y_all.split(len(x))
            loss = sum(_probe(yr) for yr in ys) + (world_size * aux_all if uses_aux else 0)
            ref_y, ref_keep = ys[rank], moe.last_routing.keep.split(len(x))[rank]
            mean_aux = aux.detach().clone()
            dist.all_reduce(mean_aux)
            aux_err = (mean_aux / world_size - aux_all).abs() if uses_aux else \
                (aux - moe(xs[rank].detach())[1]).abs()     # its own batch's f and P
        else:
            outs = [moe(xr) for xr in xs]
            keeps = []
            for xr in xs:
                moe(xr)
                keeps.append(moe.last_routing.keep)
            loss = sum(_probe(yr) + ar for yr, ar in outs)
            ref_y, ref_keep = outs[rank][0], keeps[rank]
            aux_err = (aux - outs[rank][1]).abs()
        loss.backward()
        worst = {"output": (y - ref_y).abs().max().item(), "aux": aux_err.item(),
                 "input grad": (x.grad - xs[rank].grad).abs().max().item(),
                 "kept assignments": float(not torch.equal(ep.last_routing.keep, ref_keep))}
        replicated = list(zip(ep.router.parameters(), moe.router.parameters()))
        replicated += list(zip(ep.shared.parameters(), moe.shared.parameters()))
        for i, (p, q) in enumerate(replicated):
            grad = p.grad.clone()
            dist.all_reduce(grad)               # replicated: its gradient sums every rank's tokens
            worst[f"replicated parameter {i} grad"] = (grad - q.grad).abs().max().item()
        for i, expert in enumerate(ep.experts):
            for (pname, p), q in zip(expert.named_parameters(),
                                     moe.experts[ep.first + i].parameters()):
                worst[f"expert {ep.first + i} {pname} grad"] = (p.grad - q.grad).abs().max().item()
        load = ep.last_routing.load()
        dist.all_reduce(load)                   # what each expert processed, from every rank
        errors[name] = (worst, (int(load.max()), ep.last_routing.capacity))
    errors["training"] = _modern_training(rank, world_size)
    return errors


def _modern_training(rank, world_size, steps=3):
    """EP training with shared experts, global-batch aux, z-loss and the selection-bias update
    against `train_balancing` in one process (balance="global", the ranks' shards as its
    micro-batches): losses, parameters and biases after every step."""
    config = dict(d_model=D, hidden=16, n_experts=2 * world_size, top_k=2, n_shared=1)
    data = [[(x.to(F64), y.to(F64)) for x, y in shards]
            for shards in domain_steps(steps, world_size, tokens=8, in_dim=16, seed=4)]
    model = make_moe_model(seed=3, dtype=F64, **config)
    with torch.no_grad():
        model.moe.router.bias[0] = 2.0
    reference = copy.deepcopy(model)
    dp_group = ep_dp_mesh(1, world_size).get_group("dp")
    model.moe = ExpertParallelMoE(model.moe, None, balance_group=dist.group.WORLD)
    opt = torch.optim.SGD(model.parameters(), lr=0.2)
    worst = {}
    history = train_balancing(reference, data, aux_coef=0.1, z_coef=0.01, bias_rate=0.05,
                              balance="global", lr=0.2)
    ref = dict(reference.named_parameters())
    for step, shards in enumerate(data):
        opt.zero_grad()
        shard_loss(model, *shards[rank], aux_coef=0.1, z_coef=0.01).backward()
        reduce_gradients(model, dp_group)
        opt.step()
        model.moe.update_selection_bias(0.05)
        worst[f"step {step} selection bias"] = (model.moe.selection_bias
                                                - history[step]["bias"]).abs().max().item()
    for name, value in _global_params(model).items():
        worst[f"{name} after {steps} steps"] = (value - ref[name].detach()).abs().max().item()
    # the bias really moved, and the shared expert's parameters are among those compared
    assert history[-1]["bias"].abs().max() > 0 and any("shared" in k for k in worst)
    return worst, 0


@pytest.mark.parametrize("world_size, experts_per_rank",
                         [(1, 3), (2, 2), (3, 2), (4, 2), (4, 1), (5, 1), (6, 1)])
def test_expert_parallel_equals_single_process(world_size, experts_per_rank):
    results = distlab.run(_ep_against_reference, world_size, experts_per_rank, timeout=120)
    for rank, errors in enumerate(results):
        for config, (worst, _) in errors.items():
            for what, err in worst.items():
                assert err < 1e-12, (f"EP={world_size}, rank {rank}, top_k/capacity/bias={config}:"
                                     f" {what} differs by {err:.3g}")
    if world_size in (2, 3) and experts_per_rank == 2:
        modern = results[0]
        assert set(MODERN) | {"training"} | set(EMPTY) <= set(modern)
        # Global capacity: one capacity for the group's queue, computed from all 12N tokens
        # (ceil(0.75 * 12N * 2 / 2N) = 9), and no expert processes more, whatever N is.
        most, capacity = modern["global capacity, top-2"][1]
        assert capacity == 9 and most <= 9
        most, capacity = modern["global capacity, top-1, skewed"][1]
        assert capacity == 6 and most == 6          # the skewed expert 0 is full, not over
    # The skewed router really exercised the empty exchanges: some rank received nothing.
    received = [errors[(1, None, "skew")][1] for errors in results]
    assert (0 in received or world_size == 1) and sum(received) == 12 * world_size


# ---- EP × DP training equals single-process training ------------------------------------------------

STEPS, TOKENS = 4, 8


def _shards(world_size):
    x, y = regression_data(n=STEPS * world_size * TOKENS, seed=7)
    x, y = x.to(F64), y.to(F64)
    cut = lambda t, s, r: t[(s * world_size + r) * TOKENS:(s * world_size + r + 1) * TOKENS]
    return [[(cut(x, s, r), cut(y, s, r)) for r in range(world_size)] for s in range(STEPS)]


def _global_params(model):
    """{name: tensor} with local expert i renamed to its global index, for comparison."""
    return {global_name(name, model.moe.first): p.detach().clone()
            for name, p in model.named_parameters()}


def _train_ep_dp(rank, world_size, dp, ep, config, aux_coef, lr):
    mesh = ep_dp_mesh(dp, ep)
    model = expert_parallel_model(make_moe_model(seed=3, dtype=F64, **config), mesh)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    history = []
    for shards in _shards(world_size):
        x, y = shards[rank]
        opt.zero_grad()
        loss = shard_loss(model, x, y, aux_coef)
        loss.backward()
        reduce_gradients(model, mesh.get_group("dp"))
        opt.step()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        history.append((mean.item() / world_size, _global_params(model)))
    return history


@pytest.mark.parametrize("dp, ep, top_k, capacity_factor", [
    (1, 2, 1, None), (1, 3, 2, 1.0), (2, 2, 2, 1.0), (1, 4, 1, 1.0), (1, 1, 2, 0.75),
    (1, 5, 2, 1.25), (2, 3, 1, 0.75)])
def test_ep_dp_training_equals_single_process(dp, ep, top_k, capacity_factor):
    config = dict(d_model=8, hidden=16, n_experts=2 * ep, top_k=top_k,
                  capacity_factor=capacity_factor)
    aux_coef, lr = 0.1, 0.2
    world = dp * ep
    results = distlab.run(_train_ep_dp, world, dp, ep, config, aux_coef, lr, timeout=120)

    reference = make_moe_model(seed=3, dtype=F64, **config)
    for step, shards in enumerate(_shards(world)):
        (loss, _), = train_moe_reference(reference, [shards], aux_coef, lr)
        expected = dict(reference.named_parameters())
        for rank in range(world):
            got_loss, params = results[rank][step]
            assert got_loss == pytest.approx(loss, rel=1e-12, abs=1e-13), f"step {step}, rank {rank}"
            for name, value in params.items():
                err = (value - expected[name]).abs().max().item()
                assert err < 1e-12, (f"dp={dp}, ep={ep}, step {step}, rank {rank}: {name} "
                                     f"differs by {err:.3g} after the update")
    # Each rank holds its EP shard of the experts, not all of them.
    assert sum(name.endswith("fc1.weight") for name in results[0][0][1]) == 2


# The workbook's checkers (prioritized routing, group capacity, EP x DP gradients) and the
# refusal of the course's own dispatch_plan and combine are tested in tests/test_ch09.py.


# ---- the modern routing options, in one process ----------------------------------------------------

def test_selection_bias_chooses_but_does_not_weigh():
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(10, 4, generator=g, dtype=F64)
    bias = torch.tensor([0.5, 0.0, -0.5, 0.1], dtype=F64)
    r = route(logits, top_k=2, selection_bias=bias)
    probs = logits.softmax(-1)
    for t in range(10):
        best = sorted(range(4), key=lambda e: -(probs[t, e] + bias[e]).item())[:2]
        assert r.experts[t].tolist() == best
        chosen = probs[t, best]
        torch.testing.assert_close(r.gates[t], chosen / chosen.sum(), rtol=0, atol=1e-15)


def test_update_selection_bias_moves_by_the_sign_of_the_load_error():
    from distlab.moe import max_violation, update_selection_bias
    bias = torch.zeros(4, dtype=F64)
    update_selection_bias(bias, torch.tensor([10, 2, 4, 0]), rate=0.1)    # mean 4
    assert bias.tolist() == [-0.1, 0.1, 0.0, 0.1]
    assert max_violation(torch.tensor([10, 2, 4, 0])) == 1.5
    assert max_violation(torch.tensor([3, 3, 3])) == 0.0


def test_z_loss_is_the_mean_squared_logsumexp():
    from distlab.moe import z_loss
    logits = torch.tensor([[0.0, 0.0], [3.0, -1.0]], dtype=F64)
    by_hand = (torch.log(torch.tensor(2.0, dtype=F64)) ** 2
               + torch.log(torch.exp(torch.tensor(3.0, dtype=F64)) + torch.exp(torch.tensor(-1.0, dtype=F64))) ** 2) / 2
    assert z_loss(logits).item() == pytest.approx(by_hand.item(), abs=1e-14)


def test_expert_choice_fills_every_expert_with_its_best_tokens():
    from distlab.moe import expert_choice_route
    moe = make_moe(seed=1, dtype=F64, d_model=D, hidden=16, n_experts=4, router="expert_choice",
                   capacity_factor=1.0)
    x = _tokens(0)
    y, _ = moe(x)
    r = moe.last_routing
    assert r.capacity == 3 and r.load().tolist() == [3, 3, 3, 3]
    probs = moe.router(x).softmax(-1)
    dense = 0
    for e, expert in enumerate(moe.experts):
        best = sorted(range(12), key=lambda t: -probs[t, e].item())[:3]
        weight = torch.zeros(12, 1, dtype=F64)
        weight[best, 0] = probs[best, e]
        assert sorted(r.keep[:, e].nonzero().view(-1).tolist()) == sorted(best)
        dense = dense + weight * expert(x)
    torch.testing.assert_close(y, dense, rtol=0, atol=1e-13)
    with pytest.raises(ValueError, match="router must be"):
        make_moe(router="expert-choice")
    assert expert_choice_route(torch.zeros(2, 4), 8.0).capacity == 2      # at most every token


def test_shared_experts_add_to_every_token_and_fine_grained_keeps_the_cost():
    from distlab.moe import fine_grained
    plain = make_moe(seed=1, dtype=F64, d_model=D, hidden=16, n_experts=4, top_k=2)
    shared = make_moe(seed=1, dtype=F64, d_model=D, hidden=16, n_experts=4, top_k=2, n_shared=2)
    x = _tokens(0)
    torch.testing.assert_close(shared(x)[0], plain(x)[0] + shared.shared[0](x) + shared.shared[1](x),
                               rtol=0, atol=1e-14)
    coarse = dict(d_model=16, hidden=64, n_experts=8, top_k=2)
    fine = fine_grained(**coarse, m=4, n_shared=1)
    assert fine == dict(d_model=16, hidden=16, n_experts=31, top_k=7, n_shared=1)
    active = lambda c: (c["top_k"] + c.get("n_shared", 0)) * c["hidden"]
    total = lambda c: (c["n_experts"] + c.get("n_shared", 0)) * c["hidden"]
    assert active(fine) == active(coarse) and total(fine) == total(coarse)
    with pytest.raises(ValueError, match="split into m = 3"):
        fine_grained(**coarse, m=3)


def test_global_batch_aux_is_the_whole_batch_loss():
    """Mean over micro-batches of E Σ f_global P_micro equals the loss of the concatenated batch."""
    moe = make_moe(seed=1, dtype=F64, d_model=D, hidden=16, n_experts=4, top_k=2)
    parts = [_tokens(r) for r in range(3)]
    routings = [route(moe.router(p), 2) for p in parts]
    total = sum(r.wanted() for r in routings)
    mean = sum(load_balancing_loss(r, total) for r in routings) / 3
    whole = load_balancing_loss(route(moe.router(torch.cat(parts)), 2))
    assert mean.item() == pytest.approx(whole.item(), abs=1e-14)
    assert sum(load_balancing_loss(r) for r in routings).item() / 3 != pytest.approx(whole.item())
    with pytest.raises(ValueError, match="balance must be"):
        train_balancing(make_moe_model(), [], balance="per-rank")
    # parts of 12, 7 and 0 tokens: each weighted by its share of the tokens (T_part · 3 / T), the
    # mean over the parts is still the whole batch's loss; the empty part adds 0, not 0/0
    parts = [_tokens(0), _tokens(1, 7), _tokens(2, 0)]
    routings = [route(moe.router(p), 2) for p in parts]
    total = sum(r.wanted() for r in routings)
    mean = sum(load_balancing_loss(r, total, len(p) * 3 / 19) for r, p in zip(routings, parts)) / 3
    whole = load_balancing_loss(route(moe.router(torch.cat(parts)), 2))
    assert mean.item() == pytest.approx(whole.item(), abs=1e-14)
    from distlab.moe import z_loss
    empty = moe.router(parts[2])
    assert load_balancing_loss(routings[2]).item() == z_loss(empty).item() == 0.0


# ---- around the all-to-all (distlab.moe_at_scale): grouped GEMM, EP × TP, overlap -----------------

def test_grouped_experts_equal_the_loop_forward_and_backward_with_padding_and_empty_groups():
    from distlab import moe_at_scale
    from distlab.moe import make_moe
    moe = make_moe(seed=1, d_model=16, hidden=32, n_experts=4)
    experts = list(moe.experts)
    expert_of_row = torch.tensor([3, 0, 0, 3, 3, 1, 0, 3, 3, 3, 0])        # expert 2: no row
    rows = torch.randn(len(expert_of_row), 16, generator=torch.Generator().manual_seed(0),
                       requires_grad=True)
    index, ends, padding = moe_at_scale.permute(expert_of_row, 4, align=8)
    assert ends.tolist() == [8, 16, 16, 24] and padding == 24 - 11
    assert sorted(index[index >= 0].tolist()) == list(range(11))
    out, _ = moe_at_scale.grouped_experts(rows, expert_of_row, experts)
    weights = torch.randn(out.shape, generator=torch.Generator().manual_seed(1))
    (out * weights).sum().backward()
    grads = [p.grad.clone() for p in moe.experts.parameters()] + [rows.grad.clone()]
    moe.zero_grad()
    rows.grad = None
    loop = torch.stack([experts[int(e)](rows[i]) for i, e in enumerate(expert_of_row)])
    (loop * weights).sum().backward()
    assert torch.allclose(out, loop, atol=1e-5)
    # the loop never calls expert 2 (its gradient None); the grouped GEMM gives it zeros
    wanted = [torch.zeros_like(p) if p.grad is None else p.grad for p in moe.experts.parameters()]
    for got, want in zip(grads, wanted + [rows.grad]):
        assert torch.allclose(got, want, atol=1e-5)


def _scale_ranks(rank, world_size):
    """EP × TP = 2 × 2 against one process (float64), and the grouped EP layer at EP 4 (float32):
    the largest difference of each."""
    from distlab import moe_at_scale
    from distlab.moe import make_moe
    tokens = lambda r, dtype: torch.randn(10, 16, dtype=dtype,                    # noqa: E731
                                          generator=torch.Generator().manual_seed(100 + r))
    ep_group, tp_group = moe_at_scale.ep_tp_groups(2, 2)
    full = make_moe(seed=1, dtype=torch.float64, d_model=16, hidden=32, n_experts=4, top_k=2,
                    capacity_factor=1.0)
    layer = moe_at_scale.ExpertTensorParallelMoE(full, ep_group, tp_group)
    e, t = divmod(rank, 2)
    x = tokens(e, torch.float64).requires_grad_()
    y, aux = layer(x)
    (y.square().sum() + aux).backward()
    xs = [tokens(r, torch.float64).requires_grad_() for r in range(2)]
    ref = [full(v) for v in xs]
    sum(a.square().sum() + b for a, b in ref).backward()
    cut = slice(16 * t, 16 * (t + 1))
    diffs = [(y - ref[e][0]).abs().max(), (x.grad - xs[e].grad).abs().max()]
    for i, mine in enumerate(layer.experts):
        whole = full.experts[layer.first + i]
        diffs += [(mine.fc1.weight.grad - whole.fc1.weight.grad[cut]).abs().max(),
                  (mine.fc2.weight.grad - whole.fc2.weight.grad[:, cut]).abs().max(),
                  (mine.fc2.bias.grad - whole.fc2.bias.grad).abs().max()]
    router = layer.router.weight.grad.clone()
    dist.all_reduce(router, group=ep_group)
    diffs.append((router - full.router.weight.grad).abs().max())
    ep_tp = max(d.item() for d in diffs)

    full32 = make_moe(seed=2, d_model=16, hidden=32, n_experts=8, top_k=2, capacity_factor=1.0)
    grouped = moe_at_scale.GroupedExpertParallelMoE(full32, dist.group.WORLD)
    x = tokens(rank, torch.float32).requires_grad_()
    y, _ = grouped(x)
    y.square().sum().backward()
    xs = [tokens(r, torch.float32).requires_grad_() for r in range(world_size)]
    ref = [full32(v)[0] for v in xs]
    sum(a.square().sum() for a in ref).backward()
    diffs = [(y - ref[rank]).abs().max(), (x.grad - xs[rank].grad).abs().max()]
    for i, mine in enumerate(grouped.experts):
        for p, q in zip(mine.parameters(), full32.experts[grouped.first + i].parameters()):
            diffs.append((p.grad - q.grad).abs().max())
    return ep_tp, max(d.item() for d in diffs)


def test_expert_tensor_parallel_and_grouped_layers_equal_one_process():
    import distlab
    results = distlab.run(_scale_ranks, 4)
    assert max(r[0] for r in results) < 1e-12
    assert max(r[1] for r in results) < 1e-5


def test_expert_tensor_parallel_refuses_hidden_units_that_do_not_split():
    import distlab
    from distlab import moe_at_scale
    from distlab.moe import make_moe

    def build(rank, world_size):
        ep_group, tp_group = moe_at_scale.ep_tp_groups(1, 3)
        try:
            moe_at_scale.ExpertTensorParallelMoE(make_moe(hidden=32, n_experts=2), ep_group,
                                                 tp_group)
        except ValueError as e:
            return str(e)

    assert distlab.run(build, 3)[0] == "an expert's 32 hidden units do not split over tp = 3."


def _overlap(rank, world_size):
    from distlab import moe_at_scale
    return [moe_at_scale.shared_overlap_step(rank, world_size, o) for o in (False, True)]


def test_the_shared_expert_hides_the_dispatch_across_nodes_as_chapter_09_says():
    import distlab
    ranks = distlab.run(_overlap, 4, emulate="h100-ib", timeout=120)
    (plain, dispatch), (hidden, _) = (max(r[i] for r in ranks) for i in (0, 1))
    assert dispatch > 0.1 * plain                          # across nodes: a real share
    assert plain - hidden == pytest.approx(dispatch, rel=1e-6)      # all of it hidden
