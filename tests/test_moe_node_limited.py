"""Node-limited routing and the hierarchical all-to-all (distlab.moe_node_limited): every rank's
output and every gradient (input, router, experts, None-ness) equal one process's dense
computation of the same routing, hierarchical and flat, at 2 × 2, 3 × 2 and 2 × 4 ranks; the
cross-node bytes in the run's trace equal what the routing predicts; bad input is refused in a
sentence. One launch per world size, every case inside it."""
import pytest
import torch
import torch.distributed as dist

import distlab
from distlab import moe_node_limited as nl
from distlab.moe import make_moe, route

F64, D = torch.float64, 8
# (experts, top_k, max_nodes) per (nodes, ranks per node): M = 1 and M = all nodes, top-k larger
# than a node's experts, one expert per rank and several.
CASES = {(2, 2): [(8, 2, 1), (8, 2, 2), (8, 6, 2), (4, 3, 2)],
         (3, 2): [(12, 2, 1), (12, 6, 3), (6, 3, 2)],
         (2, 4): [(8, 5, 2), (16, 3, 1)]}
TRACED = (3, 2)         # the trace's profiler doubles a rank's CPU: one world size shows the bytes


def _tokens(rank):
    # rank 1 brings no token at all; the others unequal numbers
    g = torch.Generator().manual_seed(100 + rank)
    return torch.randn(0 if rank == 1 else 9 + rank % 3, D, generator=g, dtype=F64)


def _probe(y):
    # a loss whose gradient differs per element, so a row summed into the wrong token shows
    return (y * torch.linspace(-1.0, 2.0, y.numel(), dtype=y.dtype).view_as(y)).sum()


def _worst(a, b):
    return float((a - b).detach().abs().max()) if a.numel() else 0.0


def _cases(rank, world_size, nodes, per_node):
    groups = nl.node_groups(per_node)
    out = []
    for case, (n_experts, top_k, max_nodes) in enumerate(CASES[nodes, per_node]):
        full = make_moe(seed=1, dtype=F64, d_model=D, hidden=16, n_experts=n_experts,
                        top_k=top_k)
        with torch.no_grad():
            full.router.bias[-1] = -6.0         # the last expert: chosen only when k forces it
        xs = [_tokens(r).requires_grad_() for r in range(world_size)]
        refs = [nl.dense_reference(full, xr, nodes, max_nodes) for xr in xs]
        sum(_probe(yr) + ar for yr, ar in refs).backward()
        for hierarchical in (True, False):
            layer = nl.NodeLimitedMoE(full, groups, max_nodes, hierarchical)
            x = _tokens(rank).requires_grad_()
            with distlab.trace.span(f"{case}-{hierarchical}"):
                y, aux = layer(x)
            (_probe(y) + aux).backward()
            router = torch.cat([layer.router.weight.grad, layer.router.bias.grad[:, None]], 1)
            dist.all_reduce(router)                         # every rank's tokens, once
            diffs = [_worst(y, refs[rank][0]), _worst(x.grad, xs[rank].grad),
                     _worst(router, torch.cat([full.router.weight.grad,
                                               full.router.bias.grad[:, None]], 1))]
            nones = []
            for i, expert in enumerate(layer.experts):
                for p, q in zip(expert.parameters(),
                                full.experts[layer.first + i].parameters()):
                    nones.append((p.grad is None, q.grad is None))
                    diffs.append(_worst(p.grad, q.grad) if p.grad is not None else 0.0)
            experts = layer.last_routing.experts
            node = experts // (n_experts // nodes)
            plain = route(layer.router(x).detach(), top_k).experts
            load = torch.bincount(experts.reshape(-1), minlength=n_experts)
            dist.all_reduce(load)
            out.append(dict(
                case=case, hierarchical=hierarchical, worst=max(diffs), nones=nones,
                crossings=nl.crossings(experts, n_experts // nodes, rank // per_node, nodes),
                most_nodes=max((len(set(t.tolist())) for t in node), default=0),
                same_as_top_k=bool((plain.sort(1).values == experts.sort(1).values).all()),
                all_home=int((node == rank // per_node).all(1).sum()),
                idle_experts=int((load == 0).sum())))
    return out


@pytest.mark.parametrize("nodes, per_node", list(CASES))
def test_node_limited_layer_equals_one_process_and_its_trace_counts_the_crossings(nodes,
                                                                                  per_node):
    world = nodes * per_node
    traced = (nodes, per_node) == TRACED
    ranks = distlab.run(_cases, world, nodes, per_node, trace=traced, timeout=60)
    for rank, results in enumerate(ranks):
        for r in results:
            n_experts, top_k, max_nodes = CASES[nodes, per_node][r["case"]]
            where = f"rank {rank}, case {r['case']}, hierarchical={r['hierarchical']}"
            assert r["worst"] < 1e-12, where
            assert all(a == b for a, b in r["nones"]) and r["nones"], where
            assert r["most_nodes"] <= max_nodes, where
            if max_nodes == nodes:                          # M = all nodes: plain top-k
                assert r["same_as_top_k"], where
            if not traced:
                continue
            # the trace: each crossing of this rank's tokens is one row of D float64 sent in the
            # dispatch, and one received in the combine
            label = f"{r['case']}-{r['hierarchical']}"
            sent = nl.cross_node_bytes(ranks.trace, per_node, nl.ROWS, label)[rank]
            back = nl.cross_node_bytes(ranks.trace, per_node, nl.RETURNS, label, "recv")[rank]
            crossings = r["crossings"][1 if r["hierarchical"] else 0]
            assert sent == back == D * 8 * crossings, where
    everything = [r for results in ranks for r in results]
    # the cases the issue names really happen: experts with no token, a token whose experts all
    # sit on its own node, a token crossing fewer times hierarchically than flat
    assert any(r["idle_experts"] for r in everything)
    assert any(r["all_home"] for r in everything)
    assert any(r["crossings"][1] < r["crossings"][0] for r in everything)


def test_crossings_count_rows_for_flat_and_nodes_for_hierarchical():
    # 4 experts per node, this rank on node 0: three experts on node 1, one at home
    experts = torch.tensor([[4, 5, 6, 0], [0, 1, 2, 3], [4, 8, 9, 1]])
    assert nl.crossings(experts, 4, 0, 3) == (3 + 0 + 3, 1 + 0 + 2)


def test_node_limited_route_keeps_m_nodes_by_their_best_experts():
    # 2 nodes of 3 experts, top-2 over M = 1: node 0's best two (0.30 + 0.05) lose to node 1's
    # (0.25 + 0.20) although node 0 holds the best single expert (plain top-2: experts 0 and 5)
    probs = torch.tensor([[0.30, 0.05, 0.01, 0.20, 0.19, 0.25]])
    r = nl.node_limited_route(probs.log(), 2, n_nodes=2, max_nodes=1)
    assert sorted(r.experts[0].tolist()) == [3, 5]
    assert torch.allclose(r.gates.sum(1), torch.ones(1, dtype=r.gates.dtype))


@pytest.mark.parametrize("args, message", [
    ((8, 2, 2, 3), r"max_nodes = 3, but the run has 2 node\(s\): a token can be limited to "
                   r"1 \.\. 2"),
    ((8, 5, 2, 1), r"top_k = 5 experts cannot be found on max_nodes = 1 node\(s\) of 4 experts "
                   r"each: raise max_nodes to at least 2 or lower top_k to 4"),
    ((9, 2, 2, 1), r"9 experts do not spread evenly over 2 nodes"),
])
def test_bad_routing_input_is_refused_in_a_sentence(args, message):
    n_experts, top_k, n_nodes, max_nodes = args
    with pytest.raises(ValueError, match=message):
        nl.node_limited_route(torch.zeros(3, n_experts), top_k, n_nodes, max_nodes)


def _refusals(rank, world_size):
    said = []
    for bad in (lambda: nl.node_groups(3),
                lambda: nl.NodeLimitedMoE(make_moe(n_experts=4, capacity_factor=1.0),
                                          nl.node_groups(2), 1),
                lambda: nl.NodeLimitedMoE(make_moe(n_experts=6), nl.node_groups(2), 1)):
        try:
            bad()
        except ValueError as e:
            said.append(str(e))
    return said


def test_bad_layer_input_is_refused_in_a_sentence():
    said = distlab.run(_refusals, 4, timeout=60)[0]
    assert said[0] == ("4 ranks do not split into nodes of 3 ranks: ranks_per_node must divide "
                       "the world size (one of [1, 2, 4]).")
    assert "build the MoE with capacity_factor=None" in said[1]
    assert said[2].startswith("6 experts cannot be spread evenly over 4 ranks")
