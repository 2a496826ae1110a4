"""Workbook 04's checkers: right answers written otherwise pass; wrong structures, the course's own
mesh code and an HSDP average that sends the whole gradient between replicas are refused, with the
sentence a learner reads; stubs are reported as not written."""
import itertools
import math

import pytest
import torch
import torch.distributed as dist

from distlab import mesh
from distlab.checks import CheckFailed, ch04


def flattened_group(rank, shape, names, dims):
    raise NotImplementedError("exercise: replace this line with your code")


def hsdp_average(rank, world_size, grad, replicate, shard):
    raise NotImplementedError("exercise: replace this line with your code")


# ---- exercise 1: flattened groups ----------------------------------------------------------------

def flattened_by_scan(rank, shape, names, dims):
    # Differently written: scan every rank, keep those that agree with us off `dims`.
    keep = [d for d, n in enumerate(names) if n not in dims]
    coords = lambda r: [int(c) for c in torch.unravel_index(torch.tensor(r), shape)]  # noqa: E731
    mine = coords(rank)
    return [r for r in range(math.prod(shape)) if all(coords(r)[d] == mine[d] for d in keep)]


def flattened_as_a_block(rank, shape, names, dims):
    # Wrong structure: the flattened group taken as a run of neighbouring ranks, which holds only
    # when `dims` are the last dimensions.
    size = math.prod(shape[names.index(n)] for n in dims)
    first = rank // size * size
    return list(range(first, first + size))


def flattened_with_peers(rank, shape, names, dims):
    # The cheat: the course's own arithmetic, one dimension after another.
    group = [rank]
    for n in dims:
        group = sorted({p for r in group for p in mesh.peers(r, shape, n, names)})
    return group


def test_flattened_group(capsys):
    ch04.check_flattened_group(flattened_by_scan)
    assert "✅ flattened_by_scan gives DeviceMesh's flattened groups on every rank, 7" in \
        capsys.readouterr().out
    with pytest.raises(CheckFailed, match=r"flattened_as_a_block\(0, \(2, 2, 2\), \('dp', 'cp', "
                                          r"'tp'\), \('dp', 'cp'\)\) against DeviceMesh's "
                                          r"mesh\[\('dp', 'cp'\)\]._flatten\(\), element \[1\]: "
                                          r"expected 2, got 1"):
        ch04.check_flattened_group(flattened_as_a_block)
    with pytest.raises(CheckFailed, match="course's own peers; the exercise is to work the group "
                                          "out from the rank number yourself"):
        ch04.check_flattened_group(flattened_with_peers)
    with pytest.raises(CheckFailed, match=r"the right ranks in another order, \[4, 0, 5, 1\]"):
        ch04.check_flattened_group(
            lambda r, s, n, d: [4, 0, 5, 1] if (s, d) == ((2, 2, 2), ("dp", "tp")) and r == 0
            else flattened_by_scan(r, s, n, d))
    with pytest.raises(NotImplementedError, match="flattened_group is not written yet"):
        ch04.check_flattened_group(flattened_group)


# ---- exercise 2: the order that crosses nodes least -------------------------------------------

def best_order_by_tensors(sizes, traffic, gpus_per_node):
    # Differently written: the groups are the lines of a reshaped arange, the node of each rank
    # is an integer division of the same tensor, min() over a generator.
    def crossing(order):
        shape = [sizes[n] for n in order]
        nodes = torch.arange(math.prod(shape)).reshape(shape) // gpus_per_node
        total = 0.0
        for d, n in enumerate(order):
            lines = nodes.movedim(d, -1).reshape(-1, shape[d])
            spans = torch.tensor([len(set(line.tolist())) for line in lines])
            total += float(spans[spans > 1].sum()) * traffic[n]
        return total
    return min(((o, crossing(o)) for o in itertools.permutations(sizes)), key=lambda x: x[1])


def heaviest_last(sizes, traffic, gpus_per_node):
    # Wrong structure: the rule of thumb (the most traffic last), with the right count for it.
    order = tuple(sorted(sizes, key=traffic.get))
    return order, _count(order, sizes, traffic, gpus_per_node)


def _count(order, sizes, traffic, gpus_per_node):
    shape = [sizes[n] for n in order]
    nodes = torch.arange(math.prod(shape)).reshape(shape) // gpus_per_node
    total = 0.0
    for d, n in enumerate(order):
        for line in nodes.movedim(d, -1).reshape(-1, shape[d]).tolist():
            k = len(set(line))
            total += k * traffic[n] if k > 1 else 0.0
    return total


def tp_last_counting_a_line(sizes, traffic, gpus_per_node):
    # Wrong model: the best order, but its crossings counted along a line (k - 1), not a ring.
    order, _ = best_order_by_tensors(sizes, traffic, gpus_per_node)
    shape = [sizes[n] for n in order]
    nodes = torch.arange(math.prod(shape)).reshape(shape) // gpus_per_node
    total = sum((len(set(line)) - 1) * traffic[n] for d, n in enumerate(order)
                for line in nodes.movedim(d, -1).reshape(-1, shape[d]).tolist())
    return order, total


def test_best_order(capsys):
    ch04.check_best_order(best_order_by_tensors)
    assert "✅ best_order_by_tensors finds an order" in capsys.readouterr().out
    with pytest.raises(CheckFailed, match=r"'tp': 4\}, traffic, gpus_per_node=8\) chose \('dp', "
                                          r"'tp', 'ep'\), which sends 560.00 GB between nodes per "
                                          r"step \(dp 256.00 GB, tp 256.00 GB, ep 48.00 GB\); "
                                          r"\('tp', 'ep', 'dp'\) sends only 352.00 GB"):
        ch04.check_best_order(heaviest_last)
    with pytest.raises(CheckFailed, match=r"for the order \('dp', 'pp', 'tp'\) the groups send "
                                          r"129.28 GB between nodes per step \(dp 112.00 GB, pp "
                                          r"17.28 GB, tp 0.00 GB\); your function said "
                                          r"92.64 GB\.$"):
        ch04.check_best_order(tp_last_counting_a_line)
    with pytest.raises(CheckFailed, match="course's own groups_along"):
        ch04.check_best_order(lambda s, t, g: (tuple(s), len(mesh.groups_along(tuple(s.values()),
                                                                              0))))
    with pytest.raises(CheckFailed, match="should return \\(order, bytes\\)"):
        ch04.check_best_order(lambda s, t, g: tuple(s))


# ---- exercise 3: HSDP's average -----------------------------------------------------------------

def hsdp_with_device_mesh(rank, world_size, grad, replicate, shard):
    # Differently written: DeviceMesh's groups, the list form of reduce_scatter, divide first.
    from torch.distributed.device_mesh import init_device_mesh
    m = init_device_mesh("cpu", (replicate, shard), mesh_dim_names=("replicate", "shard"))
    piece = torch.zeros(grad.numel() // shard)
    dist.reduce_scatter(piece, list((grad / world_size).chunk(shard)), group=m["shard"].get_group())
    dist.all_reduce(piece, group=m["replicate"].get_group())
    return piece


def hsdp_by_world_all_reduce(rank, world_size, grad, replicate, shard):
    # Right values, wrong structure: the whole gradient all-reduced over every rank.
    dist.all_reduce(grad)
    return (grad / world_size).chunk(shard)[rank % shard]


def hsdp_inside_the_replica_only(rank, world_size, grad, replicate, shard):
    # Wrong values: the replica's average, never combined across replicas.
    groups = [dist.new_group(list(range(i * shard, (i + 1) * shard))) for i in range(replicate)]
    piece = torch.empty(grad.numel() // shard)
    dist.reduce_scatter_single(piece, grad, group=groups[rank // shard])
    return piece / shard


def hsdp_with_hand_mesh(rank, world_size, grad, replicate, shard):
    hand = mesh.HandMesh((replicate, shard), ("replicate", "shard"))
    dist.all_reduce(grad, group=hand.get_group("replicate"))
    return grad


def test_hsdp_average(capsys, monkeypatch):
    monkeypatch.setattr(ch04, "HSDP_CASES", [(2, 3), (3, 2)])
    ch04.check_hsdp_average(hsdp_with_device_mesh)
    assert "✅ hsdp_with_device_mesh averages the gradient" in capsys.readouterr().out
    monkeypatch.setattr(ch04, "HSDP_CASES", [(2, 3)])
    with pytest.raises(CheckFailed, match=r"replicate=2, shard=3: the values are right, but rank "
                                          r"0 sent 96 bytes to other replicas \(its all_reduce "
                                          r"over ranks \[0, 1, 2, 3, 4, 5\] alone 96\); HSDP "
                                          r"sends only this rank's shard between replicas, 32 "
                                          r"bytes"):
        ch04.check_hsdp_average(hsdp_by_world_all_reduce)
    with pytest.raises(CheckFailed, match=r"replicate=2, shard=3, rank 0 \(shard 0 of the "
                                          r"gradient averaged over all 6 ranks\), element \[0\]: "
                                          r"expected 25, got 10"):
        ch04.check_hsdp_average(hsdp_inside_the_replica_only)
    with pytest.raises(CheckFailed, match="course's own HandMesh"):
        ch04.check_hsdp_average(hsdp_with_hand_mesh)
    with pytest.raises(NotImplementedError, match="hsdp_average is not written yet"):
        ch04.check_hsdp_average(hsdp_average)
