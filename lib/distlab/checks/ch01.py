"""Checkers for the chapter-01 workbook: rank slices, a config through the store or a broadcast,
and a collective on subgroups."""
import contextlib
import time

import torch
import torch.distributed as dist

from . import CheckFailed, UsedCourseCode, call_learner, compare, forbid, passed, run_learner
from . import sizes_phrase
from ..launch import RankFailed, RunTimeout
from ..rendezvous import open_store


# ---- shared by the checkers of chapters 00, 01, 04, 10 and 11 ---------------------------------

def learner_run(fn, world_size, *args, name, hang_rule, timeout=20, **kwargs):
    """run_learner, traced: the course's refused code and a hang each become one CheckFailed
    sentence (a hang names where every rank waited, and the rule that was broken)."""
    try:
        return run_learner(fn, world_size, *args, name=name, timeout=timeout, trace=True,
                           **kwargs)
    except RankFailed as e:
        if e.peer_lost:
            raise CheckFailed(f"{name} with world_size={world_size}: rank {e.rank} was still "
                              f"waiting when the rank it talks to finished without making the "
                              f"matching call; {hang_rule}") from None
        raise
    except RunTimeout as e:
        where = "; ".join(line.strip() for line in str(e).splitlines()[1:1 + world_size])
        raise CheckFailed(f"{name} hung with world_size={world_size} ({where}): "
                          f"{hang_rule}") from None


@contextlib.contextmanager
def refusing(*objects, exercise):
    """forbid() in this process, the refusal turned into a CheckFailed sentence."""
    try:
        with forbid(*objects, exercise=exercise):
            yield
    except UsedCourseCode as e:
        raise CheckFailed(str(e)) from None


def collectives(trace, rank):
    """The rank's collective calls (everything but send/recv), in order."""
    return [e for e in trace.comm(rank) if e["op"] not in ("send", "recv")]

SLICE_WORLD_SIZES = range(1, 9)
SLICE_LENGTHS = list(range(0, 25)) + [97, 1000, 1001]


# ---- exercise 1: each rank's slice of n items ------------------------------------------------

def reference_slice(rank, world_size, n):
    """(start, stop) of rank's chunk in torch.tensor_split(range(n), world_size)."""
    sizes = [len(c) for c in torch.arange(n).tensor_split(world_size)]
    start = sum(sizes[:rank])
    return start, start + sizes[rank]


def _sum_of_my_slice(rank, world_size, rank_slice, n):
    with forbid(reference_slice, exercise="compute the slice yourself"):
        start, stop = rank_slice(rank, world_size, n)
    partial = torch.arange(n, dtype=torch.int64)[start:stop].sum()
    dist.all_reduce(partial)
    return partial.item()


def check_rank_slice(rank_slice):
    name = getattr(rank_slice, "__name__", "rank_slice")
    cases = [(rank, world_size, n) for world_size in SLICE_WORLD_SIZES for n in SLICE_LENGTHS
             for rank in range(world_size)]
    with refusing(reference_slice, exercise="compute the slice yourself"):
        answers = [call_learner(rank_slice, *case, name=name) for case in cases]
    for (rank, world_size, n), got in zip(cases, answers):
        call = f"{name}(rank={rank}, world_size={world_size}, n={n})"
        if not (isinstance(got, (tuple, list)) and len(got) == 2
                and all(isinstance(v, int) for v in got)):
            raise CheckFailed(f"{call} should return a pair of ints (start, stop); got {got!r}.")
        compare(tuple(got), reference_slice(rank, world_size, n),
                f"{call} (the first n % world_size ranks get one extra item)")
    # The same function, used for real: every rank sums its slice and all_reduce adds them up.
    for world_size, n in [(3, 100), (4, 10)]:
        got = learner_run(_sum_of_my_slice, world_size, rank_slice, n, name=name,
                          hang_rule="every rank must reach the all_reduce.")
        for rank, total in enumerate(got):
            compare(total, n * (n - 1) // 2,
                    f"with world_size={world_size}, rank {rank}'s all_reduced sum of 0..{n - 1}")
    passed(f"{name} matches torch.tensor_split for n = 0..24, 97, 1000, 1001 on 1 to 8 ranks, "
           f"and real ranks summing their slices get n(n-1)/2.")


# ---- exercise 2: rank 0 publishes a config through the store ----------------------------------

def config_for(world_size):
    return {"model": "tiny-gpt", "layers": [64, 64, 10], "lr": 3e-4, "world_size": world_size,
            "seed": 1000 + world_size}


def _compare_configs(got, expected, context):
    for rank, config in enumerate(got):
        if config != expected:
            raise CheckFailed(f"{context}: rank {rank} returned {config!r}, but rank 0's config "
                              f"was {expected!r}.")


def _share_through_store(rank, world_size, share_config, config):
    store = open_store(rank, world_size)
    if rank == 0:
        time.sleep(1.0)  # rank 0 arrives last, so reading before it has published shows up
    with forbid(config_for, exercise="receive rank 0's config through the store"):
        got = share_config(rank, world_size, store, config if rank == 0 else None)
    # The store lives in rank 0's process: keep it up until every rank has its answer.
    store.add("checker/done", 1)
    if rank == 0:
        while int(store.add("checker/done", 0)) < world_size:
            time.sleep(0.01)
    return got


def check_share_config(share_config, world_sizes=(1, 2, 3, 5)):
    name = getattr(share_config, "__name__", "share_config")
    for world_size in world_sizes:
        expected = config_for(world_size)
        got = learner_run(_share_through_store, world_size, share_config, expected, name=name,
                          init=False, hang_rule="every rank waits in store.get for a key that "
                          "rank 0 must set.")
        _compare_configs(got, expected, f"{name} with world_size={world_size}")
    passed(f"every rank got rank 0's config through the store with world_size "
           f"{sizes_phrase(world_sizes)}.")


# ---- exercise 3: the same with a collective ---------------------------------------------------

def _broadcast_on_ranks(rank, world_size, broadcast_config, config):
    with forbid(config_for, exercise="receive rank 0's config with a collective"):
        return broadcast_config(rank, world_size, config if rank == 0 else None)


def check_broadcast_config(broadcast_config, world_sizes=(2, 3, 4)):
    name = getattr(broadcast_config, "__name__", "broadcast_config")
    for world_size in world_sizes:
        expected = config_for(world_size)
        got = learner_run(_broadcast_on_ranks, world_size, broadcast_config, expected, name=name,
                          hang_rule="every rank, rank 0 too, must call the same collective.")
        _compare_configs(got, expected, f"{name} with world_size={world_size}")
        trace = got.trace
        world = tuple(range(world_size))
        for rank in range(1, world_size):
            if not any(e["group"] == world for e in collectives(trace, rank)):
                sends = trace.sends(0)
                how = (f"rank 0 sent it in {len(sends)} point-to-point messages"
                       if sends else "it made no collective call")
                raise CheckFailed(f"{name} with world_size={world_size}: rank {rank} got the "
                                  f"config, but {how}; the exercise is one collective that every "
                                  f"rank calls, dist.broadcast_object_list(objects, src=0).")
    passed(f"every rank got rank 0's config by broadcast with world_size "
           f"{sizes_phrase(world_sizes)}.")


# ---- exercise 4: a collective on subgroups ----------------------------------------------------

def reference_group_sum(rank, world_size, group_size):
    """Gather every rank's value with the whole world, add up this rank's block."""
    values = [torch.zeros(1) for _ in range(world_size)]
    dist.all_gather(values, torch.tensor([float(rank + 1) ** 2]))
    first = rank // group_size * group_size
    return sum(v.item() for v in values[first:first + group_size])


def _group_sum_on_ranks(rank, world_size, group_sum, group_size):
    with forbid(reference_group_sum, exercise="all_reduce on a group you make with new_group"):
        return group_sum(rank, world_size, group_size)


def _check_block_all_reduce(trace, world_size, group_size, name):
    """Each rank's sum must come from an all_reduce over exactly its block (a block of one rank
    needs no communication)."""
    for rank in range(world_size):
        first = rank // group_size * group_size
        block = tuple(range(first, min(first + group_size, world_size)))
        if len(block) == 1:
            continue
        calls = collectives(trace, rank)
        if any(e["op"] == "all_reduce" and e["group"] == block for e in calls):
            continue
        other = next((e for e in calls if e["op"] != "barrier"), None)
        seen = (f"its {other['op']} ran over ranks {list(other['group'])}" if other else
                "it never called a collective")
        raise CheckFailed(f"{name} with world_size={world_size}, group_size={group_size}: rank "
                          f"{rank}'s block is ranks {list(block)}, but {seen}; make a group of "
                          f"exactly the block with dist.new_group and all_reduce on it.")


def check_group_sum(group_sum, cases=((4, 2), (5, 2), (7, 3), (3, 3))):
    name = getattr(group_sum, "__name__", "group_sum")
    for world_size, group_size in cases:
        # Each rank contributes (rank + 1)²: its block's sum is the answer (no run needed).
        expected = [float(sum((r + 1) ** 2 for r in range(rank // group_size * group_size,
                                                           min(rank // group_size * group_size
                                                               + group_size, world_size))))
                    for rank in range(world_size)]
        got = learner_run(_group_sum_on_ranks, world_size, group_sum, group_size, name=name,
                          hang_rule="every rank must call new_group for every block, in the "
                          "same order, and all_reduce on its own block's group.")
        for rank in range(world_size):
            compare(got[rank], expected[rank],
                    f"{name} with world_size={world_size}, group_size={group_size}, rank {rank}")
        _check_block_all_reduce(got.trace, world_size, group_size, name)
    shapes = ", ".join(f"{w} ranks in groups of {g}" for w, g in cases)
    passed(f"{name} adds up each block of ranks ({shapes}).")
