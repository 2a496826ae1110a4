"""Checkers for the chapter-01 workbook: rank slices, a config through the store or a broadcast,
and a collective on subgroups."""
import time

import torch
import torch.distributed as dist

from . import CheckFailed, call_learner, compare, passed, run_learner, sizes_phrase
from . import run
from ..rendezvous import open_store

SLICE_WORLD_SIZES = range(1, 9)
SLICE_LENGTHS = list(range(0, 25)) + [97, 1000, 1001]


# ---- exercise 1: each rank's slice of n items ------------------------------------------------

def reference_slice(rank, world_size, n):
    """(start, stop) of rank's chunk in torch.tensor_split(range(n), world_size)."""
    sizes = [len(c) for c in torch.arange(n).tensor_split(world_size)]
    start = sum(sizes[:rank])
    return start, start + sizes[rank]


def _sum_of_my_slice(rank, world_size, rank_slice, n):
    start, stop = rank_slice(rank, world_size, n)
    partial = torch.arange(n, dtype=torch.int64)[start:stop].sum()
    dist.all_reduce(partial)
    return partial.item()


def check_rank_slice(rank_slice):
    name = getattr(rank_slice, "__name__", "rank_slice")
    for world_size in SLICE_WORLD_SIZES:
        for n in SLICE_LENGTHS:
            for rank in range(world_size):
                got = call_learner(rank_slice, rank, world_size, n, name=name)
                call = f"{name}(rank={rank}, world_size={world_size}, n={n})"
                if not (isinstance(got, (tuple, list)) and len(got) == 2
                        and all(isinstance(v, int) for v in got)):
                    raise CheckFailed(f"{call} should return a pair of ints (start, stop); "
                                      f"got {got!r}.")
                compare(tuple(got), reference_slice(rank, world_size, n),
                        f"{call} (the first n % world_size ranks get one extra item)")
    # The same function, used for real: every rank sums its slice and all_reduce adds them up.
    for world_size, n in [(3, 100), (4, 10)]:
        got = run_learner(_sum_of_my_slice, world_size, rank_slice, n, name=name)
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
        got = run_learner(_share_through_store, world_size, share_config, expected, name=name,
                          init=False)
        _compare_configs(got, expected, f"{name} with world_size={world_size}")
    passed(f"every rank got rank 0's config through the store with world_size "
           f"{sizes_phrase(world_sizes)}.")


# ---- exercise 3: the same with a collective ---------------------------------------------------

def _broadcast_on_ranks(rank, world_size, broadcast_config, config):
    return broadcast_config(rank, world_size, config if rank == 0 else None)


def check_broadcast_config(broadcast_config, world_sizes=(2, 3, 4)):
    name = getattr(broadcast_config, "__name__", "broadcast_config")
    for world_size in world_sizes:
        expected = config_for(world_size)
        got = run_learner(_broadcast_on_ranks, world_size, broadcast_config, expected, name=name)
        _compare_configs(got, expected, f"{name} with world_size={world_size}")
    passed(f"every rank got rank 0's config by broadcast with world_size "
           f"{sizes_phrase(world_sizes)}.")


# ---- exercise 4: a collective on subgroups ----------------------------------------------------

def reference_group_sum(rank, world_size, group_size):
    """Gather every rank's value with the whole world, add up this rank's block."""
    values = [torch.zeros(1) for _ in range(world_size)]
    dist.all_gather(values, torch.tensor([float(rank + 1) ** 2]))
    first = rank // group_size * group_size
    return sum(v.item() for v in values[first:first + group_size])


def check_group_sum(group_sum, cases=((4, 2), (5, 2), (7, 3), (3, 3))):
    name = getattr(group_sum, "__name__", "group_sum")
    for world_size, group_size in cases:
        expected = run(reference_group_sum, world_size, group_size)
        got = run_learner(group_sum, world_size, group_size, name=name)
        for rank in range(world_size):
            compare(got[rank], expected[rank],
                    f"{name} with world_size={world_size}, group_size={group_size}, rank {rank}")
    shapes = ", ".join(f"{w} ranks in groups of {g}" for w, g in cases)
    passed(f"{name} adds up each block of ranks ({shapes}).")
