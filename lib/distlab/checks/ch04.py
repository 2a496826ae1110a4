"""Chapter 04 checkers (device meshes): what the chapter only described, checked against PyTorch.

- `check_flattened_group`: the group of several mesh dimensions taken as one (HSDP's whole data
  parallel dimension, dp × cp for the loss), against `DeviceMesh[dims]._flatten()` on real ranks;
- `check_best_order`: the dimension order that sends the fewest bytes between nodes, against every
  order of the dimensions (on cases where "TP last" or "heaviest last" is not the answer);
- `check_hsdp_average`: HSDP's gradient average on real ranks, judged by the values AND by what
  crosses between replicas (at most a ring all-reduce of this rank's shard: that is HSDP's point),
  counted by the checkers' one traffic rule for messages and collectives (`_traffic`), so a
  hand-written ring of send/recv passes where the collective of the same bytes does.
"""
import itertools
import math

import torch

from . import CheckFailed, _traffic, call_learner, compare, forbid, passed, run
from .ch01 import learner_run, refusing
from .. import mesh as _mesh


def _course_mesh_code():
    """The course's mesh arithmetic, its hand-built groups and this checker's references."""
    return (_mesh.coordinate, _mesh.rank_at, _mesh.peers, _mesh.groups_along, _mesh.all_groups,
            _mesh.peer_groups, _mesh.peer_table, _mesh.HandMesh, _mesh.device_mesh,
            _mesh.mesh_peer_groups, _mesh.gather_all_groups, flattened_truth, _flatten_on_ranks,
            _reference_groups, _crossing_bytes, _reference_best, _hsdp_reference)


def _call(fn, name, *args):
    """The learner's function called in this process: an exception it raises becomes the check's
    one sentence, naming the call to re-run (a stub stays a NotImplementedError)."""
    try:
        return call_learner(fn, *args, name=name)
    except (CheckFailed, NotImplementedError):
        raise
    except Exception as e:
        shown = ", ".join(map(repr, args))
        raise CheckFailed(f"{name}({shown}) raised {type(e).__name__}: "
                          f"{str(e).splitlines()[0] if str(e) else 'no message'}; call it "
                          f"yourself with these arguments to see where.") from None


# ---- exercise 1: the group of several dimensions flattened into one ---------------------------

# (shape, names, the dimensions flattened): HSDP's replicate × shard, dp × cp of a 3-D mesh,
# two dimensions that are not neighbours, a lopsided mesh with a size-1 dimension in between (so
# that a solution which swaps two dimensions, or assumes they are adjacent, fails somewhere).
# Every mesh holds 8 ranks, so that one run of 8 ranks builds them all.
FLATTEN_CASES = [
    ((2, 4), ("replicate", "shard"), ("replicate", "shard")),
    ((2, 4), ("replicate", "shard"), ("shard",)),
    ((2, 2, 2), ("dp", "cp", "tp"), ("dp", "cp")),
    ((2, 2, 2), ("dp", "cp", "tp"), ("dp", "tp")),
    ((2, 2, 2), ("dp", "cp", "tp"), ("cp", "tp")),
    ((4, 1, 2), ("pp", "dp", "tp"), ("pp", "tp")),
    ((4, 1, 2), ("pp", "dp", "tp"), ("pp", "dp")),
]

_truth = {}


def _flatten_on_ranks(rank, world_size, cases):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from distlab import device
    out, meshes = {}, {}
    for shape, names, dims in cases:
        if (shape, names) not in meshes:
            meshes[shape, names] = init_device_mesh(device().type, shape, mesh_dim_names=names)
        mesh = meshes[shape, names]
        flat = mesh[dims]._flatten("_".join(dims)) if len(dims) > 1 else mesh[dims[0]]
        out[shape, names, dims] = dist.get_process_group_ranks(flat.get_group())
    _mesh.wait_until_connected()
    return out


def flattened_truth():
    """{(shape, names, dims): [every rank's group]} as DeviceMesh's _flatten builds them on real
    ranks (one run, cached)."""
    if not _truth:
        cases = [(tuple(s), tuple(n), tuple(d)) for s, n, d in FLATTEN_CASES]
        results = run(_flatten_on_ranks, 8, cases, timeout=120)
        _truth.update({case: [r[case] for r in results] for case in cases})
    return _truth


def check_flattened_group(flattened_group):
    """flattened_group(rank, shape, names, dims) -> the ranks of `rank`'s group of `dims`."""
    name = getattr(flattened_group, "__name__", "flattened_group")
    with refusing(*_course_mesh_code(), exercise="work the group out from the rank number "
                                                 "yourself"):
        answers = {(s, n, d): [_call(flattened_group, name, r, s, n, d)
                               for r in range(math.prod(s))] for s, n, d in FLATTEN_CASES}
    for (shape, names, dims), got in answers.items():
        truth = flattened_truth()[shape, names, dims]
        for r, answer in enumerate(got):
            call = f"{name}({r}, {shape}, {names}, {dims})"
            if isinstance(answer, torch.Tensor):
                answer = answer.tolist()
            if not isinstance(answer, (list, tuple)):
                raise CheckFailed(f"{call} should return a list of ranks like {truth[r]}; "
                                  f"got {answer!r}.")
            answer = [int(x) for x in answer]
            if sorted(answer) == truth[r] and answer != truth[r]:
                raise CheckFailed(f"{call} has the right ranks in another order, {answer}; a "
                                  f"group's order is its ranks' group rank (the flattened "
                                  f"index), which is increasing here: {truth[r]}.")
            compare(answer, truth[r], f"{call} against DeviceMesh's mesh[{dims}]._flatten()")
    meshes = ", ".join(dict.fromkeys(f"{shape} {names}" for shape, names, _ in FLATTEN_CASES))
    passed(f"{name} gives DeviceMesh's flattened groups on every rank, {len(FLATTEN_CASES)} "
           f"flattenings of the meshes {meshes}.")


# ---- exercise 2: the order of the dimensions that crosses nodes least --------------------------

# (sizes, bytes each rank sends to the next rank of its group per step, GPUs per node). The
# first is the review's 64-GPU job; in the second the data-parallel traffic is the heavy one; in
# the third the heaviest dimension is bigger than a node, so it crosses whatever its place and
# the lighter ones should stay inside; the last has a size-1 dimension and nodes of 2.
ORDER_CASES = [
    ({"dp": 4, "pp": 2, "tp": 8}, {"dp": 1.75e9, "pp": 0.27e9, "tp": 8.6e9}, 8),
    ({"dp": 8, "tp": 2}, {"dp": 10e9, "tp": 1e9}, 8),
    ({"ep": 16, "dp": 2, "tp": 4}, {"ep": 3e9, "dp": 2e9, "tp": 2e9}, 8),
    ({"pp": 1, "dp": 3, "tp": 2}, {"pp": 5e9, "dp": 1e9, "tp": 4e9}, 2),
]


def _reference_groups(shape):
    """Every group along every dimension of a row-major mesh: [(dim, [ranks])]."""
    ranks = torch.arange(math.prod(shape)).reshape(shape)
    out = []
    for d in range(len(shape)):
        lines = ranks.movedim(d, -1).reshape(-1, shape[d])
        out.extend((d, line.tolist()) for line in lines)
    return out


def _crossing_bytes(order, sizes, traffic, gpus_per_node):
    """{dim name: bytes per step sent between nodes}: a ring over a group spanning k > 1 nodes
    crosses between nodes k times (each node's ranks are neighbours in it)."""
    shape = tuple(sizes[n] for n in order)
    out = {n: 0.0 for n in order}
    for d, members in _reference_groups(shape):
        nodes = len({r // gpus_per_node for r in members})
        if nodes > 1:
            out[order[d]] += nodes * traffic[order[d]]
    return out


def _reference_best(sizes, traffic, gpus_per_node):
    """{order: total crossing bytes} for every order of the dimensions."""
    return {order: sum(_crossing_bytes(order, sizes, traffic, gpus_per_node).values())
            for order in itertools.permutations(sizes)}


def _gb(x):
    return f"{x / 1e9:.2f} GB"


def check_best_order(best_order):
    """best_order(sizes, traffic, gpus_per_node) -> (order, bytes crossing nodes per step)."""
    name = getattr(best_order, "__name__", "best_order")
    for sizes, traffic, gpus_per_node in ORDER_CASES:
        call = f"{name}({sizes}, traffic, gpus_per_node={gpus_per_node})"
        with refusing(*_course_mesh_code(), exercise="work out the groups of each order "
                                                     "yourself"):
            got = _call(best_order, name, dict(sizes), dict(traffic), gpus_per_node)
        if not (isinstance(got, (tuple, list)) and len(got) == 2):
            raise CheckFailed(f"{call} should return (order, bytes), e.g. "
                              f"({tuple(sizes)}, 1.2e9); got {got!r}.")
        order, crossing = got
        order = tuple(order) if isinstance(order, (tuple, list)) else order
        if not isinstance(order, tuple) or sorted(order) != sorted(sizes):
            raise CheckFailed(f"{call}: the order should name every dimension once, like "
                              f"{tuple(sizes)}; got {order!r}.")
        every = _reference_best(sizes, traffic, gpus_per_node)
        per_dim = _crossing_bytes(order, sizes, traffic, gpus_per_node)
        parts = ", ".join(f"{n} {_gb(b)}" for n, b in per_dim.items())
        try:
            crossing = float(crossing)
        except (TypeError, ValueError):
            raise CheckFailed(f"{call}: the second item should be a number of bytes; got "
                              f"{crossing!r}.") from None
        if not math.isclose(crossing, every[order], rel_tol=1e-9, abs_tol=1e-6):
            raise CheckFailed(f"{call}: for the order {order} the groups send "
                              f"{_gb(every[order])} between nodes per step ({parts}); your "
                              f"function said {_gb(crossing)}.")
        best = min(every.values())
        if every[order] > best * (1 + 1e-9):
            winner = min(every, key=every.get)
            raise CheckFailed(f"{call} chose {order}, which sends {_gb(every[order])} between "
                              f"nodes per step ({parts}); {winner} sends only {_gb(best)}. Try "
                              f"every order.")
    passed(f"{name} finds an order that sends the fewest bytes between nodes, and says how many, "
           f"on {len(ORDER_CASES)} jobs (up to 128 GPUs, nodes of 2 and 8).")


# ---- exercise 3: HSDP's gradient average -----------------------------------------------------

HSDP_CASES = [(2, 3), (3, 2), (2, 4)]     # (replicate, shard): replicate ≠ shard both ways
HSDP_LENGTH = 24                          # divisible by every shard size above


def _hsdp_gradient(rank, n):
    # Distinct per rank and element, small integers: float32 sums of them are exact.
    return torch.arange(n, dtype=torch.float32) * (rank + 1) + 10 * rank


def _hsdp_reference(rank, world_size, shard, n):
    mean = sum(_hsdp_gradient(r, n) for r in range(world_size)) / world_size
    return mean.chunk(shard)[rank % shard]


def _hsdp_on_ranks(rank, world_size, hsdp_average, replicate, shard, n):
    from distlab import device
    grad = _hsdp_gradient(rank, n).to(device())
    with forbid(*_course_mesh_code(), exercise="build the two groups and reduce over them "
                                               "yourself"):
        out = hsdp_average(rank, world_size, grad, replicate, shard)
    return out.cpu() if isinstance(out, torch.Tensor) else out


def _across_replicas(trace, rank, shard):
    """[(op, reach, bytes)] of what `rank` sent to other replicas, by the one traffic rule of the
    checkers (`_traffic`): a message counts its bytes, a collective whose group reaches another
    replica the bytes this rank sends in it done as a ring — so send/recv carrying the same bytes
    as a collective count the same."""
    mine = rank // shard
    out = []
    for c in _traffic.records(trace, rank):
        if not c["wire"]:
            continue                        # a receive, a barrier: nothing left this rank
        reach = [c["peer"]] if c["kind"] == "send" else list(c["group"])
        if c["peer"] is None and c["kind"] == "send":
            continue
        if any(r // shard != mine for r in reach):
            out.append((c["op"], reach, c["wire"]))
    return out


def check_hsdp_average(hsdp_average):
    """hsdp_average(rank, world_size, grad, replicate, shard) on real ranks -> this rank's shard
    of the gradient averaged over every rank."""
    name = getattr(hsdp_average, "__name__", "hsdp_average")
    n = HSDP_LENGTH
    for replicate, shard in HSDP_CASES:
        ws = replicate * shard
        got = learner_run(_hsdp_on_ranks, ws, hsdp_average, replicate, shard, n, name=name,
                          hang_rule="every rank must create every group, in the same order, "
                          "and call the same collectives on its own groups.")
        context = f"{name} with replicate={replicate}, shard={shard}"
        for r in range(ws):
            compare(got[r], _hsdp_reference(r, ws, shard, n),
                    f"{context}, rank {r} (shard {r % shard} of the gradient averaged over all "
                    f"{ws} ranks)")
        piece = n // shard                                      # this rank's shard
        allowed = 2 * (replicate - 1) * math.ceil(piece / replicate) * 4
        for r in range(ws):
            sent = _across_replicas(got.trace, r, shard)
            total = sum(b for _, _, b in sent)
            if total > allowed + 1e-6:
                op, reach, b = max(sent, key=lambda s: s[2])
                raise CheckFailed(
                    f"{context}: the values are right, but rank {r} sent {int(total)} bytes to "
                    f"other replicas (its {op} over ranks {reach} alone {int(b)}); HSDP sends "
                    f"between replicas at most a ring all-reduce of this rank's shard of "
                    f"{piece} floats, 2(R-1)·ceil({piece}/R) = {allowed // 4} floats "
                    f"({allowed} bytes): reduce inside the replica first.")
    cases = ", ".join(f"{r} × {s}" for r, s in HSDP_CASES)
    passed(f"{name} averages the gradient over every rank and sends only a shard between "
           f"replicas, on replicate × shard = {cases}.")

