"""Device meshes: the ranks laid out as a grid, with one process group per line of the grid.

A mesh of shape (2, 4) with dimension names ("dp", "tp") puts the 8 ranks in row-major order:

    tp →   0  1  2  3
    dp ↓   4  5  6  7

Ranks that differ only in their "tp" coordinate form a TP group ({0,1,2,3} and {4,5,6,7});
ranks that differ only in their "dp" coordinate form a DP group ({0,4}, {1,5}, {2,6}, {3,7}).
The LAST dimension varies fastest, so its groups are runs of neighbouring ranks: put the
dimension that talks most (tensor parallelism) last, and it stays inside one machine.

This module does it three ways, and they agree:
- pure arithmetic on rank numbers (`coordinate`, `peers`, `groups_along`, `peer_groups`);
- process groups built by hand with `dist.new_group` (`HandMesh`);
- PyTorch's `init_device_mesh`, read back as rank lists (`device_mesh`, `mesh_peer_groups`).
"""
import math
import operator

import torch.distributed as dist


# ---- the arithmetic: no processes needed ------------------------------------------------------

def check_mesh(shape, names=None, world_size=None):
    """`(shape, names)` as tuples, or a one-sentence ValueError saying what is wrong with them."""
    if isinstance(shape, int):
        shape = (shape,)
    shape = tuple(shape) if isinstance(shape, (tuple, list)) else shape
    if not isinstance(shape, tuple) or not shape or \
            any(_whole(s) is None or _whole(s) < 1 for s in shape):
        raise ValueError(f"a mesh shape is a tuple of positive whole numbers, like (2, 4); "
                         f"got {shape!r}.")
    shape = tuple(_whole(s) for s in shape)      # numpy integers as Python ints
    if names is None:
        names = tuple(f"dim{d}" for d in range(len(shape)))
    if isinstance(names, str):
        names = (names,)
    if not isinstance(names, (tuple, list)) or not all(isinstance(n, str) for n in names):
        raise ValueError(f"mesh dimension names are strings, one per dimension, like "
                         f"('dp', 'tp'); got {names!r}.")
    names = tuple(names)
    if len(names) != len(shape):
        raise ValueError(f"a mesh of shape {shape} needs {len(shape)} dimension name(s), "
                         f"one per dimension; got {names!r}.")
    if len(set(names)) != len(names):
        raise ValueError(f"the dimension names of a mesh must be different; got {names!r}.")
    if world_size is not None and math.prod(shape) != world_size:
        raise ValueError(f"a mesh of shape {shape} holds {math.prod(shape)} ranks, but "
                         f"world_size is {world_size}: the product of the shape must equal it.")
    return shape, names


def _whole(x):
    """x as a Python int if it is a whole number (numpy's too, not a bool), else None."""
    if isinstance(x, bool) or type(x).__name__ in ("bool_", "bool"):
        return None
    try:
        return operator.index(x)
    except TypeError:
        return None


def _dim(d, names):
    """A dimension given by name or by index, as an index."""
    if isinstance(d, str):
        if d not in names:
            raise ValueError(f"the mesh has no dimension {d!r}; its dimensions are {names}.")
        return names.index(d)
    if _whole(d) is None:
        raise ValueError(f"a mesh dimension is given by its name (one of {names}) or its index; "
                         f"got {d!r}.")
    d = _whole(d)
    if not -len(names) <= d < len(names):
        raise ValueError(f"the mesh has {len(names)} dimension(s); there is no dimension {d}.")
    return d % len(names)


def coordinate(rank, shape):
    """Where `rank` sits in the mesh: its index along each dimension (row-major, last fastest)."""
    shape, _ = check_mesh(shape)
    if _whole(rank) is None or not 0 <= rank < math.prod(shape):
        raise ValueError(f"rank {rank!r} is not in a mesh of shape {shape} "
                         f"(ranks 0 to {math.prod(shape) - 1}).")
    coord = []
    for size in reversed(shape):
        coord.append(rank % size)
        rank //= size
    return tuple(reversed(coord))


def rank_at(coord, shape):
    """The rank at a coordinate: the inverse of `coordinate`."""
    shape, _ = check_mesh(shape)
    if not isinstance(coord, (tuple, list)) or len(coord) != len(shape) or \
            any(_whole(c) is None or not 0 <= c < size for c, size in zip(coord, shape)):
        raise ValueError(f"a coordinate in a mesh of shape {shape} is {len(shape)} whole "
                         f"number(s), each from 0 to that dimension's size - 1; got {coord!r}.")
    rank = 0
    for c, size in zip(coord, shape):
        rank = rank * size + c
    return rank


def peers(rank, shape, dim, names=None):
    """The ranks in `rank`'s group along `dim`: same coordinate everywhere except along `dim`."""
    shape, names = check_mesh(shape, names)
    d = _dim(dim, names)
    coord = coordinate(rank, shape)
    return [rank_at(coord[:d] + (i,) + coord[d + 1:], shape) for i in range(shape[d])]


def groups_along(shape, dim, names=None):
    """Every group along `dim`, each once, ordered by its first rank.

    The order matters when the groups are created: every rank walks this same list.
    """
    shape, names = check_mesh(shape, names)
    d = _dim(dim, names)
    starts = [r for r in range(math.prod(shape)) if coordinate(r, shape)[d] == 0]
    return [peers(r, shape, d) for r in starts]


def all_groups(shape, names):
    """{name: every group along that dimension}."""
    shape, names = check_mesh(shape, names)
    return {n: groups_along(shape, d) for d, n in enumerate(names)}


def peer_groups(rank, shape, names):
    """{name: the ranks in `rank`'s group along that dimension}."""
    shape, names = check_mesh(shape, names)
    return {n: peers(rank, shape, d) for d, n in enumerate(names)}


def peer_table(shape, names):
    """A text table: each rank, its coordinate and its group along every dimension."""
    shape, names = check_mesh(shape, names)
    rows = [["rank", "coordinate"] + [f"{n} group" for n in names]]
    for r in range(math.prod(shape)):
        rows.append([str(r), str(coordinate(r, shape))]
                    + [str(p) for p in peer_groups(r, shape, names).values()])
    return format_table(rows)


def format_table(rows):
    """Left-aligned columns, the first row as the header."""
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


# ---- process groups by hand -------------------------------------------------------------------

class HandMesh:
    """The groups of a mesh built with `dist.new_group`; call it on every rank, like DeviceMesh.

    new_group is collective over the WHOLE world: every rank must call it for every group, in the
    same order, even for groups it is not in (it then gets a placeholder back). A rank that only
    creates its own groups leaves the others waiting, or pairs up the wrong calls.
    `dist.new_group(ranks, use_local_synchronization=True)` lifts the rule: only members meet.
    """

    def __init__(self, shape, names):
        self.rank = dist.get_rank()
        self.shape, self.names = check_mesh(shape, names, dist.get_world_size())
        self.groups, self.ranks = {}, {}
        for d, name in enumerate(self.names):
            for ranks in groups_along(self.shape, d):
                group = dist.new_group(ranks)
                if self.rank in ranks:
                    self.groups[name], self.ranks[name] = group, ranks
        wait_until_connected()  # no rank may leave while a peer is still connecting to it

    def get_group(self, name):
        return self.groups[self.names[_dim(name, self.names)]]

    def get_coordinate(self):
        return coordinate(self.rank, self.shape)

    def get_local_rank(self, name):
        return self.get_coordinate()[_dim(name, self.names)]

    def __repr__(self):
        dims = ", ".join(f"{n}={s}" for n, s in zip(self.names, self.shape))
        return f"HandMesh({dims})"


# ---- PyTorch's DeviceMesh, read back as rank lists -----------------------------------------------

def device_mesh(shape, names, device_type=None):
    """`init_device_mesh` on this rank's device type ("cpu" under gloo, "cuda" under nccl)."""
    from torch.distributed.device_mesh import init_device_mesh
    from .devices import device
    shape, names = check_mesh(shape, names, dist.get_world_size())
    mesh = init_device_mesh(device_type or device().type, shape, mesh_dim_names=names)
    wait_until_connected()
    return mesh


def wait_until_connected():
    """A barrier over the whole world, right after creating groups.

    gloo connects a new group's ranks while new_group runs, and a rank can finish before its
    peers have finished connecting to it. If it then exits (or destroys its groups), a peer still
    connecting fails with "Connection closed by peer" (measured here: 7 runs in 100 of
    init_device_mesh with nothing after it, 0 in 100 with this barrier).
    """
    dist.barrier()


def mesh_peer_groups(mesh):
    """{name: the ranks of this rank's group along that dimension}, read from the real groups."""
    return {name: dist.get_process_group_ranks(mesh.get_group(name))
            for name in mesh.mesh_dim_names}


def gather_all_groups(my_groups):
    """Collective: every rank's {name: group ranks} put together into {name: every group, sorted}.

    Works for a HandMesh's `.ranks` and for `mesh_peer_groups(mesh)` alike, so the two can be
    compared group for group.
    """
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, my_groups)
    return {name: [list(t) for t in sorted({tuple(g[name]) for g in everyone})]
            for name in my_groups}
