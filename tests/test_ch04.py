"""Workbook 04's checkers, each through the battery (tests/checker_battery.py): the workbook's
solution and a right answer written otherwise pass; a wrong answer, the course's own mesh code (or
torch's answer where the exercise is to write it) and a decoy (right on the obvious case, wrong
structure) are refused, each in one sentence; stubs are reported as not written."""
import itertools
import math

import pytest
import torch
import torch.distributed as dist

from checker_battery import battery
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


def flattened_solution(rank, shape, names, dims):      # as the workbook's solution
    strides = [math.prod(shape[d + 1:]) for d in range(len(shape))]
    free = [names.index(n) for n in dims]
    first = rank - sum(rank // strides[d] % shape[d] * strides[d] for d in free)
    group = [first]
    for d in free:
        group = [r + i * strides[d] for r in group for i in range(shape[d])]
    return group


def flattened_the_other_dimensions(rank, shape, names, dims):
    # Wrong: the ranks that share the coordinates OF `dims` (the complement's group).
    coords = lambda r: [int(c) for c in torch.unravel_index(torch.tensor(r), shape)]  # noqa: E731
    fixed = [names.index(n) for n in dims]
    mine = coords(rank)
    return [r for r in range(math.prod(shape)) if all(coords(r)[d] == mine[d] for d in fixed)]


def flattened_with_a_wrong_stride(rank, shape, names, dims):
    # Wrong, and it crashes: strides from the sizes FROM each dimension on, halved twice, reach 0
    # on a (2, 2, 2) mesh: the refusal is still one sentence.
    strides = [math.prod(shape[d:]) // shape[0] // 2 for d in range(len(shape))]
    free = [names.index(n) for n in dims]
    first = rank - sum(rank // strides[d] % shape[d] * strides[d] for d in free)
    return [first + i * strides[free[-1]] for i in range(shape[free[-1]])]


def flattened_from_device_mesh_truth(rank, shape, names, dims):
    # The cheat: the checker's own answer, DeviceMesh's groups read back on ranks.
    return ch04.flattened_truth()[tuple(shape), tuple(names), tuple(dims)][rank]


def test_flattened_group_battery():
    said = battery(ch04.check_flattened_group, correct=[flattened_solution],
                   different=[flattened_by_scan], wrong=[flattened_the_other_dimensions, flattened_with_a_wrong_stride],
                   cheat=[flattened_with_peers, flattened_from_device_mesh_truth],
                   decoy=[flattened_as_a_block])
    assert ("flattened_as_a_block(0, (2, 2, 2), ('dp', 'cp', 'tp'), ('dp', 'cp')) against "
            "DeviceMesh's mesh[('dp', 'cp')]._flatten(), element [1]: expected 2, got 1"
            in said["decoy"][0])
    assert ("course's own peers; the exercise is to work the group out from the rank number "
            "yourself" in said["cheat"][0])
    assert "course's own flattened_truth" in said["cheat"][1]
    assert ("flattened_with_a_wrong_stride(0, (2, 2, 2), ('dp', 'cp', 'tp'), ('dp', 'tp')) "
            "raised ZeroDivisionError: integer division or modulo by zero; call it yourself "
            "with these arguments to see where." == said["wrong"][1])


def test_flattened_group_names_the_order(capsys):
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


def best_order_solution(sizes, traffic, gpus_per_node):     # as the workbook's solution
    best = None
    for order in itertools.permutations(sizes):
        shape = [sizes[n] for n in order]
        world = math.prod(shape)
        crossing = 0.0
        for d, dim in enumerate(order):
            stride = math.prod(shape[d + 1:])
            for start in range(world):
                if start // stride % shape[d]:
                    continue
                nodes = {(start + i * stride) // gpus_per_node for i in range(shape[d])}
                if len(nodes) > 1:
                    crossing += len(nodes) * traffic[dim]
        if best is None or crossing < best[1]:
            best = (order, crossing)
    return best


def best_order_with_groups_along(sizes, traffic, gpus_per_node):
    # The cheat: the course's mesh arithmetic lists the groups.
    def crossing(order):
        shape = tuple(sizes[n] for n in order)
        return sum(len({r // gpus_per_node for r in g}) * traffic[order[d]]
                   for d in range(len(order)) for g in mesh.groups_along(shape, d)
                   if len({r // gpus_per_node for r in g}) > 1)
    return min(((o, crossing(o)) for o in itertools.permutations(sizes)), key=lambda x: x[1])


def test_best_order_battery():
    said = battery(ch04.check_best_order, correct=[best_order_solution],
                   different=[best_order_by_tensors], wrong=[tp_last_counting_a_line],
                   cheat=[best_order_with_groups_along], decoy=[heaviest_last])
    assert ("'tp': 4}, traffic, gpus_per_node=8) chose ('dp', 'tp', 'ep'), which sends 560.00 GB "
            "between nodes per step (dp 256.00 GB, tp 256.00 GB, ep 48.00 GB); ('tp', 'ep', "
            "'dp') sends only 352.00 GB" in said["decoy"][0])
    assert said["wrong"][0].endswith(
        "for the order ('dp', 'pp', 'tp') the groups send 129.28 GB between nodes per step (dp "
        "112.00 GB, pp 17.28 GB, tp 0.00 GB); your function said 92.64 GB.")
    assert "course's own groups_along" in said["cheat"][0]


def test_best_order_refuses_a_bare_order():
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


def hsdp_solution(rank, world_size, grad, replicate, shard):   # as the workbook's solution
    replicas = [dist.new_group(list(range(i * shard, (i + 1) * shard))) for i in range(replicate)]
    same_shard = [dist.new_group(list(range(j, world_size, shard))) for j in range(shard)]
    piece = torch.empty(grad.numel() // shard, dtype=grad.dtype, device=grad.device)
    dist.reduce_scatter_single(piece, grad, group=replicas[rank // shard])
    dist.all_reduce(piece, group=same_shard[rank % shard])
    return piece / world_size


def hsdp_by_messages(rank, world_size, grad, replicate, shard):
    # Differently written: the same bytes as messages. A ring reduce-scatter inside the replica,
    # then a ring all-reduce of the shard across the replicas, all by isend/irecv.
    def ring_all_reduce(t, ranks, reduce_only=False):
        n, me = len(ranks), ranks.index(rank)
        chunks = list(torch.tensor_split(t, n))
        right, left = ranks[(me + 1) % n], ranks[(me - 1) % n]
        for s in range(n - 1):
            out_c, in_c = (me - s - 1) % n, (me - s - 2) % n
            buf = torch.empty_like(chunks[in_c])
            for h in [dist.isend(chunks[out_c].contiguous(), right), dist.irecv(buf, left)]:
                h.wait()
            chunks[in_c] += buf
        if reduce_only:
            return chunks[me]
        for s in range(n - 1):
            out_c, in_c = (me - s) % n, (me - s - 1) % n
            for h in [dist.isend(chunks[out_c].contiguous(), right),
                      dist.irecv(chunks[in_c], left)]:
                h.wait()
        return torch.cat(chunks)

    replica = list(range(rank // shard * shard, (rank // shard + 1) * shard))
    piece = ring_all_reduce(grad.clone(), replica, reduce_only=True).clone()
    piece = ring_all_reduce(piece, list(range(rank % shard, world_size, shard)))
    return piece / world_size


def test_hsdp_average_battery(monkeypatch):
    monkeypatch.setattr(ch04, "HSDP_CASES", [(3, 2), (2, 3)])
    battery(ch04.check_hsdp_average, correct=[hsdp_solution],
            different=[hsdp_with_device_mesh, hsdp_by_messages], require=("correct", "different"))
    monkeypatch.setattr(ch04, "HSDP_CASES", [(2, 3)])
    said = battery(ch04.check_hsdp_average, wrong=[hsdp_inside_the_replica_only],
                   cheat=[hsdp_with_hand_mesh], decoy=[hsdp_by_world_all_reduce],
                   require=("wrong", "cheat", "decoy"))
    assert ("replicate=2, shard=3, rank 0 (shard 0 of the gradient averaged over all 6 ranks), "
            "element [0]: expected 25, got 10" in said["wrong"][0])
    assert "course's own HandMesh" in said["cheat"][0]
    assert ("replicate=2, shard=3: the values are right, but rank 0 sent 160 bytes to other "
            "replicas (its all_reduce over ranks [0, 1, 2, 3, 4, 5] alone 160); HSDP sends "
            "between replicas at most a ring all-reduce of this rank's shard of 8 floats, "
            "2(R-1)·ceil(8/R) = 8 floats (32 bytes)" in said["decoy"][0])


def test_hsdp_average_stub_is_not_written():
    with pytest.raises(NotImplementedError, match="hsdp_average is not written yet"):
        ch04.check_hsdp_average(hsdp_average)


def test_ch04_group_creation_numbers_are_the_arithmetic():
    import pathlib
    import nbformat
    path = (pathlib.Path(__file__).resolve().parent.parent / "notebooks"
            / "04_device_meshes.ipynb")
    text = " ".join(c.source for c in nbformat.read(path, as_version=4).cells
                    if c.cell_type == "markdown").replace("\n", " ")
    shape, names = (16, 8, 8), ("dp", "pp", "tp")
    counts = [len(mesh.groups_along(shape, d, names)) for d in range(3)]
    assert counts == [64, 128, 128] and sum(counts) == 320
    assert "On 1,024 GPUs as `dp × pp × tp = 16 × 8 × 8` that is 64 + 128 + 128 = 320 calls" in text
