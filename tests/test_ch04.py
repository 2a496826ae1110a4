"""Workbook 04's checkers: right answers written otherwise pass; the course's own mesh code and a
sum that never uses the dimension's group are refused, with the sentence a learner reads."""
import pytest
import torch
import torch.distributed as dist

from distlab import mesh
from distlab.checks import CheckFailed, ch04


def coordinate_by_unravel(rank, shape):
    # Differently written: torch's unravel_index.
    return tuple(int(c) for c in torch.unravel_index(torch.tensor(rank), shape))


def peer_groups_by_scan(rank, shape, names):
    # Differently written: scan every rank, keep those equal to ours off the dimension.
    size = 1
    for s in shape:
        size *= s
    mine = coordinate_by_unravel(rank, shape)
    out = {}
    for d, name in enumerate(names):
        out[name] = [r for r in range(size)
                     if all(c == m for i, (c, m) in enumerate(zip(coordinate_by_unravel(r, shape),
                                                                   mine)) if i != d)]
    return out


def test_coordinate_and_peer_groups(capsys):
    ch04.check_coordinate(coordinate_by_unravel)
    ch04.check_peer_groups(peer_groups_by_scan)
    assert capsys.readouterr().out.count("✅") == 2
    # Wrong: the first dimension varying fastest (column-major).
    with pytest.raises(CheckFailed,
                       match=r"lambda>\(1, \(2, 4\)\) against DeviceMesh.*expected 0, got 1"):
        ch04.check_coordinate(lambda rank, shape: (rank % shape[0], rank // shape[0] % shape[1])
                              if len(shape) == 2 else coordinate_by_unravel(rank, shape))
    with pytest.raises(CheckFailed, match="course's own coordinate; the exercise is to work it out"):
        ch04.check_coordinate(mesh.coordinate)
    with pytest.raises(CheckFailed, match="course's own peer_groups"):
        ch04.check_peer_groups(mesh.peer_groups)


def reduce_along_by_enumeration(rank, world_size, shape, names, dim):
    # Differently written: new_subgroups_by_enumeration, an imported all_reduce, ReduceOp.SUM.
    from torch.distributed import ReduceOp, all_reduce
    groups = []
    for r in range(world_size):
        g = peer_groups_by_scan(r, shape, names)[dim]
        if g not in groups:
            groups.append(g)
    mine, _ = dist.new_subgroups_by_enumeration(groups)
    x = torch.tensor([float(rank), float(rank * rank)])
    all_reduce(x, op=ReduceOp.SUM, group=mine)
    return x


def reduce_along_gathered(rank, world_size, shape, names, dim):
    # Right answer, wrong structure: every rank gathers the whole world and adds its group.
    x = torch.tensor([float(rank), float(rank * rank)])
    every = [torch.empty_like(x) for _ in range(world_size)]
    dist.all_gather(every, x)
    return sum(every[r] for r in peer_groups_by_scan(rank, shape, names)[dim])


def reduce_along_hand_mesh(rank, world_size, shape, names, dim):
    x = torch.tensor([float(rank), float(rank * rank)])
    dist.all_reduce(x, group=mesh.HandMesh(shape, names).get_group(dim))
    return x


def test_reduce_along(capsys, monkeypatch):
    monkeypatch.setattr(ch04, "REDUCE_CASES", ch04.REDUCE_CASES[:2])
    ch04.check_reduce_along(reduce_along_by_enumeration)
    assert "✅" in capsys.readouterr().out
    with pytest.raises(CheckFailed, match=r"on mesh \(2, 4\) \('dp', 'tp'\) along 'dp': rank 0's "
                                          r"group is ranks \[0, 4\], but its all_gather ran over "
                                          r"ranks \[0, 1, 2, 3, 4, 5, 6, 7\]; all_reduce on the "
                                          r"group you built"):
        ch04.check_reduce_along(reduce_along_gathered)
    with pytest.raises(CheckFailed, match="course's own HandMesh; the exercise is to build the "
                                          "groups yourself with dist.new_group"):
        ch04.check_reduce_along(reduce_along_hand_mesh)
