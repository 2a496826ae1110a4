"""Real subgroups, and the one traffic rule every group-taking check of workbook 07 applies."""
import torch.distributed as dist

from ... import cost as _cost
from ...emulate import _MODEL


# (world size, its tensor-parallel groups): two groups of 2 on 4 ranks; on 5 ranks groups of 2 and
# 3 whose ranks are not 0..k. Each group gets numbers of its own, so a function that talks to the
# whole world (group=None, dist.get_world_size()) gets the wrong shapes or another group's sums.
LAYOUTS = ((4, ((0, 1), (2, 3))), (5, ((1, 3), (0, 2, 4))))


def _my_group(rank, layout):
    """Every rank creates every group (new_group is collective) and keeps its own: (group, its
    global ranks, the group's index, this rank's place in it)."""
    groups = [dist.new_group(list(ranks)) for ranks in layout]
    index = next(i for i, ranks in enumerate(layout) if rank in ranks)
    return groups[index], tuple(layout[index]), index, layout[index].index(rank)


def _group_of(rank, layout):
    return next(tuple(ranks) for ranks in layout if rank in ranks)


def _layouts_phrase(layouts):
    return ", and ".join(f"{ws} ranks as groups " + " and ".join(str(list(g)) for g in layout)
                         for ws, layout in layouts)


def _event_group(e, world_size):
    return tuple(e["group"]) if e["group"] else tuple(range(world_size))


def _off_group(calls, ranks, world_size):
    """The first call that left the group: a collective over other ranks, a message to a rank
    outside it."""
    for e in calls:
        if e["op"] in ("send", "recv"):
            if e["peer"] is not None and e["peer"] not in ranks:
                return e, f"a {e['op']} with rank {e['peer']}"
        elif sorted(_event_group(e, world_size)) != sorted(ranks):
            return e, f"a {e['op']} over ranks {list(_event_group(e, world_size))}"
    return None, ""


def _sent_bytes(calls, world_size):
    """The bytes this rank put on the wire in `calls`, one rule for every kind of call: a
    collective what its ring sends per rank (all-reduce 2(N−1)/N of the tensor, all-gather and
    reduce-scatter (N−1)/N of the whole one), a message its size (a recv is the peer's send)."""
    total = 0.0
    for e in calls:
        if e["op"] in ("recv", "barrier"):
            continue
        if e["op"] == "send":
            total += e["bytes"]
            continue
        n = len(_event_group(e, world_size))
        total += _cost.TERMS[_MODEL.get(e["op"], "send")](e["bytes"], n)[1] if n > 1 else 0
    return total


def _describe_calls(calls):
    if not calls:
        return "no communication"
    return ", ".join(f"{e['op']} of {e['bytes']:,} B" for e in calls)


def _phase_calls(trace, rank, phase):
    return [e for e in trace.comm(rank) if e["label"] and e["label"][0] == phase]
