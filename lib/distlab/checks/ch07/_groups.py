"""Real subgroups, and the one traffic rule every group-taking check of workbook 07 applies."""
import torch.distributed as dist

from .. import _traffic


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


# The checkers' one traffic rule (`distlab.checks._traffic`), under the names this chapter's
# checkers use: a call left the group (a collective over other ranks, a message to a rank outside
# it); the bytes a rank put on the wire (a collective what its ring sends per rank — all-reduce
# 2(N−1)/N of the tensor, all-gather and reduce-scatter (N−1)/N of the whole one —, a message its
# size, a recv nothing: it is the peer's send).

def _off_group(calls, ranks, world_size=None):
    """The first call that left the group: a collective over other ranks, a message to a rank
    outside it."""
    return _traffic.off_group(calls, ranks)


def _sent_bytes(calls, world_size=None):
    """The bytes this rank put on the wire in `calls`, one rule for every kind of call."""
    return _traffic.wire(calls)


_describe_calls = _traffic.describe


def _phase_calls(trace, rank, phase):
    return _traffic.records(trace, rank, phase)
