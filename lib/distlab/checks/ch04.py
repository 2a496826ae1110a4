"""Chapter 04 checkers (device meshes): the learner's answers against DeviceMesh on real ranks."""
import math

import torch

from . import CheckFailed, call_learner, compare, forbid, passed, run
from .ch01 import collectives, learner_run, refusing
from .. import mesh as _mesh

# Square and lopsided meshes, every dimension order, a size-1 dimension and odd world sizes.
MESHES = [
    ((2, 4), ("dp", "tp")),
    ((4, 2), ("tp", "dp")),
    ((2, 2, 2), ("dp", "pp", "tp")),
    ((3, 1, 2), ("pp", "dp", "tp")),
    ((5,), ("dp",)),
]

_truth = {}


def _what_device_mesh_says(rank, world_size, shape, names):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from distlab import device
    from distlab.mesh import wait_until_connected
    mesh = init_device_mesh(device().type, shape, mesh_dim_names=names)
    wait_until_connected()
    return {"coordinate": tuple(mesh.get_coordinate()),
            "groups": {n: dist.get_process_group_ranks(mesh.get_group(n)) for n in names}}


def device_mesh_truth(shape, names):
    """Every rank's coordinate and groups, as DeviceMesh builds them on real ranks (cached)."""
    key = (tuple(shape), tuple(names))
    if key not in _truth:
        _truth[key] = list(run(_what_device_mesh_says, math.prod(shape), tuple(shape),
                               tuple(names), timeout=120))
    return _truth[key]


def _course_mesh_code():
    """What the exercises ask the learner to write: the course's mesh arithmetic, its hand-built
    groups, and this checker's DeviceMesh runs."""
    return (_mesh.coordinate, _mesh.rank_at, _mesh.peers, _mesh.groups_along, _mesh.all_groups,
            _mesh.peer_groups, _mesh.peer_table, _mesh.HandMesh, _mesh.device_mesh,
            _mesh.mesh_peer_groups, device_mesh_truth, _what_device_mesh_says)


def _learner_answers(fn, name, make_args):
    """Call the learner's pure function for every rank of every mesh, before starting any rank."""
    with refusing(*_course_mesh_code(), exercise="work it out from the rank number yourself"):
        return _call_all(fn, name, make_args)


def _call_all(fn, name, make_args):
    return {(shape, names): [call_learner(fn, *make_args(r, shape, names), name=name)
                             for r in range(math.prod(shape))]
            for shape, names in MESHES}


def check_coordinate(coordinate_of):
    """coordinate_of(rank, shape) -> the rank's index along each dimension."""
    name = getattr(coordinate_of, "__name__", "coordinate_of")
    answers = _learner_answers(coordinate_of, name, lambda r, shape, names: (r, shape))
    for (shape, names), got in answers.items():
        truth = device_mesh_truth(shape, names)
        for r in range(len(truth)):
            answer = got[r]
            if isinstance(answer, torch.Tensor):
                answer = answer.tolist()
            compare(list(answer) if isinstance(answer, (list, tuple)) else answer,
                    list(truth[r]["coordinate"]),
                    f"{name}({r}, {shape}) against DeviceMesh's get_coordinate()")
    passed(f"{name} agrees with DeviceMesh's get_coordinate() on every rank of "
           f"{_meshes_phrase()}.")


def check_peer_groups(peer_groups):
    """peer_groups(rank, shape, names) -> {name: the ranks of rank's group along that dimension}."""
    name = getattr(peer_groups, "__name__", "peer_groups")
    answers = _learner_answers(peer_groups, name, lambda r, shape, names: (r, shape, names))
    for (shape, names), got in answers.items():
        truth = device_mesh_truth(shape, names)
        for r in range(len(truth)):
            if not isinstance(got[r], dict):
                compare(got[r], truth[r]["groups"],
                        f"{name}({r}, {shape}, {names}) should return a dict like "
                        f"{truth[r]['groups']}")
            answer = {k: sorted(int(x) for x in v) if isinstance(v, (list, tuple)) else v
                      for k, v in got[r].items()}
            compare(answer, truth[r]["groups"],
                    f"{name}({r}, {shape}, {names}) against DeviceMesh's groups")
    passed(f"{name} gives the same groups as DeviceMesh on every rank of {_meshes_phrase()}.")


REDUCE_CASES = [((2, 4), ("dp", "tp"), "dp"), ((2, 4), ("dp", "tp"), "tp"),
                ((3, 2), ("tp", "dp"), "tp"), ((2, 2, 2), ("dp", "pp", "tp"), "pp")]


def _reduce_on_ranks(rank, world_size, reduce_along, shape, names, dim):
    with forbid(*_course_mesh_code(), exercise="build the groups yourself with dist.new_group"):
        return reduce_along(rank, world_size, shape, names, dim)


def check_reduce_along(reduce_along):
    """reduce_along(rank, world_size, shape, names, dim) on real ranks -> the sum along `dim`."""
    name = getattr(reduce_along, "__name__", "reduce_along")
    for shape, names, dim in REDUCE_CASES:
        ws = math.prod(shape)
        truth = device_mesh_truth(shape, names)
        got = learner_run(_reduce_on_ranks, ws, reduce_along, shape, names, dim, name=name,
                          hang_rule="with default settings every rank must call new_group for "
                          "every group along the dimension, in the same order, even the groups "
                          "it is not in.")
        for r in range(ws):
            # Each rank contributes [r, r²]: the sum over DeviceMesh's group is the answer.
            group = truth[r]["groups"][dim]
            expected = torch.tensor([float(sum(group)), float(sum(p * p for p in group))])
            compare(got[r], expected, f"{name} on mesh {shape} {names} along {dim!r}, rank {r}")
            calls = collectives(got.trace, r)
            if not any(e["op"] == "all_reduce" and e["group"] == tuple(group) for e in calls):
                other = next((e for e in calls if e["op"] != "barrier"), None)
                seen = (f"its {other['op']} ran over ranks {list(other['group'])}" if other
                        else "it never called a collective")
                raise CheckFailed(f"{name} on mesh {shape} {names} along {dim!r}: rank {r}'s "
                                  f"group is ranks {group}, but {seen}; all_reduce on the group "
                                  f"you built for it, so only those ranks communicate.")
    cases = ", ".join(f"{s} along {d!r}" for s, _, d in REDUCE_CASES)
    passed(f"{name} sums over the same ranks as DeviceMesh's groups on {cases}.")


def _meshes_phrase():
    return ", ".join(f"{shape} {names}" for shape, names in MESHES)
