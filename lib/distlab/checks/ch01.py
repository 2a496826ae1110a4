"""Checkers for the chapter-01 workbook: rank slices, a config through the store and through
tensor collectives, and a sum inside blocks of ranks. Configs and values are drawn afresh for
each check and given to their own rank only, so a right answer proves that they travelled."""
import contextlib
import json
import os
import random
import time

import torch
import torch.distributed as dist

from . import (CheckFailed, UsedCourseCode, _refusing_code, call_learner, compare, forbid,
               passed, run_learner)
from . import _traffic, sizes_phrase
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


def object_collectives():
    return (dist.all_gather_object, dist.gather_object, dist.broadcast_object_list,
            dist.scatter_object_list, dist.send_object_list, dist.recv_object_list)


@contextlib.contextmanager
def no_object_collectives(exercise=None, functions=None, reason=None):
    """Inside a rank: torch's object collectives raise UsedCourseCode with a sentence. They pickle
    each object into a byte tensor and share its length first: the very work `exercise` asks for
    (chapters 01 and 02), done for any Python object. `functions`: which of them (default: all);
    `reason(fn)`: the sentence, where another chapter refuses them for another reason."""
    saved = []
    for fn in functions or object_collectives():
        message = reason(fn) if reason else (
            f"your function used dist.{fn.__name__}, which pickles the object and shares its "
            f"length for you; the exercise is to {exercise}.")
        saved.append((fn, fn.__code__))
        fn.__code__ = _refusing_code(message, fn.__code__.co_freevars)
    try:
        yield
    finally:
        for fn, code in saved:
            fn.__code__ = code


def received_anything(trace, rank):
    """True when the rank took part in a collective or received a message."""
    return any(e["op"] != "send" for e in trace.comm(rank))


# ---- exercise 1: each rank's slice of n items ------------------------------------------------

SLICE_WORLD_SIZES = range(1, 9)
SLICE_LENGTHS = list(range(0, 25)) + [97, 1000, 1001]


def reference_slice(rank, world_size, n):
    """(start, stop) of rank's chunk in torch.tensor_split(range(n), world_size)."""
    sizes = [len(c) for c in torch.arange(n).tensor_split(world_size)]
    start = sum(sizes[:rank])
    return start, start + sizes[rank]


@contextlib.contextmanager
def _no_library_split():
    """While the learner's rank_slice runs: torch's and numpy's splitters refuse, in a sentence.
    They compute exactly the slices the exercise asks for."""
    import numpy
    targets = [(torch, "tensor_split"), (torch.Tensor, "tensor_split"), (numpy, "array_split")]
    saved = [(obj, attr, getattr(obj, attr)) for obj, attr in targets]

    def refuse(*args, **kwargs):
        raise UsedCourseCode("your function used a library's splitter (torch.tensor_split or "
                             "numpy.array_split), which computes the slices for you; the "
                             "exercise is to compute the slice yourself.")
    for obj, attr, _ in saved:
        setattr(obj, attr, refuse)
    try:
        yield
    finally:
        for obj, attr, value in saved:
            setattr(obj, attr, value)


def _sum_of_my_slice(rank, world_size, rank_slice, n):
    with forbid(reference_slice, exercise="compute the slice yourself"), _no_library_split():
        start, stop = rank_slice(rank, world_size, n)
    partial = torch.arange(n, dtype=torch.int64)[start:stop].sum()
    dist.all_reduce(partial)
    return partial.item()


def check_rank_slice(rank_slice):
    name = getattr(rank_slice, "__name__", "rank_slice")
    cases = [(rank, world_size, n) for world_size in SLICE_WORLD_SIZES for n in SLICE_LENGTHS
             for rank in range(world_size)]
    with refusing(reference_slice, exercise="compute the slice yourself"), _no_library_split():
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
    passed(f"{name} gives balanced, contiguous slices for n = 0..24, 97, 1000, 1001 on 1 to 8 "
           f"ranks, and real ranks summing their slices get n(n-1)/2.")


# ---- exercise 2: rank 0 publishes a config through the store ----------------------------------

_WORDS = ("tiny-gpt", "llama", "moe", "mlp", "bert", "mamba", "t5")


def draw_config(world_size, seed, big=False):
    """A config drawn afresh for each check: no rank but rank 0 can know it without a message.
    `big` makes one of several hundred KB, past any buffer size a learner might guess."""
    rng = random.Random(seed)
    config = {"model": rng.choice(_WORDS) + f"-{rng.randrange(1000)}",
              "layers": [rng.randrange(8, 512) for _ in range(rng.randrange(1, 6))],
              "lr": rng.choice((1e-4, 3e-4, 6e-4)) * rng.randrange(1, 9),
              "world_size": world_size, "seed": rng.randrange(1 << 31),
              "note": "".join(rng.choice("αβγ abcdef") for _ in range(rng.randrange(0, 40)))}
    if big:
        config["vocab"] = [rng.choice(_WORDS) + str(i) for i in range(40_000)]
    return config


def _compare_configs(got, expected, context):
    for rank, config in enumerate(got):
        if config != expected:
            shown = repr(config) if len(repr(config)) < 120 else repr(config)[:100] + "...}"
            raise CheckFailed(f"{context}: rank {rank} returned {shown}, which is not rank 0's "
                              f"config.")


def _share_through_store(rank, world_size, share_config, config):
    store = open_store(rank, world_size)
    if rank == 0:
        time.sleep(0.6)  # rank 0 arrives after the first readers: reading too early shows up
    else:
        config = None
        if rank == world_size - 1 and world_size >= 3:
            time.sleep(1.0)  # ... and the last rank after rank 0: a key taken away shows up
    with forbid(draw_config, exercise="receive rank 0's config through the store"):
        got = share_config(rank, world_size, store, config)
    # The store lives in rank 0's process: keep it up until every rank has its answer.
    store.add("checker/done", 1)
    if rank == 0:
        while int(store.add("checker/done", 0)) < world_size:
            time.sleep(0.01)
    return got


def check_share_config(share_config, world_sizes=(1, 2, 3, 5)):
    name = getattr(share_config, "__name__", "share_config")
    for world_size in world_sizes:
        expected = draw_config(world_size, random.SystemRandom().randrange(1 << 30))
        got = learner_run(_share_through_store, world_size, share_config, expected, name=name,
                          init=False, timeout=8, hang_rule="every rank that reads must find the "
                          "key rank 0 set, for as long as any rank still needs it.")
        _compare_configs(got, expected, f"{name} with world_size={world_size}")
    passed(f"every rank got rank 0's config through the store with world_size "
           f"{sizes_phrase(world_sizes)}.")


# ---- exercise 3: the same with tensor collectives ---------------------------------------------

def _broadcast_on_ranks(rank, world_size, broadcast_config, configs):
    config = configs[0] if rank == 0 else None
    del configs
    with forbid(draw_config, exercise="receive rank 0's config with a collective"), \
            no_object_collectives("send the config's bytes in tensors yourself (its length "
                                  "first)"):
        return broadcast_config(rank, world_size, config)


def check_broadcast_config(broadcast_config, world_sizes=(2, 3, 4)):
    """Every rank gets rank 0's config with tensor collectives; at one world size the config is
    several hundred KB, so a buffer of a guessed size does not hold it."""
    name = getattr(broadcast_config, "__name__", "broadcast_config")
    for i, world_size in enumerate(world_sizes):
        expected = draw_config(world_size, random.SystemRandom().randrange(1 << 30),
                               big=(i == len(world_sizes) - 1))
        size = len(json.dumps(expected).encode())
        got = learner_run(_broadcast_on_ranks, world_size, broadcast_config, [expected],
                          name=name, hang_rule="every rank, rank 0 too, must call the same "
                          "collectives with tensors of the same size.")
        _compare_configs(got, expected, f"{name} with world_size={world_size} (a config of "
                                        f"{size:,} bytes as JSON)")
        for rank in range(1, world_size):
            if not received_anything(got.trace, rank):
                raise CheckFailed(f"{name} with world_size={world_size}: rank {rank} returned "
                                  f"the config without receiving a message; it must come from "
                                  f"rank 0 by a collective.")
    passed(f"every rank got rank 0's config through tensor collectives with world_size "
           f"{sizes_phrase(world_sizes)}, a config of several hundred KB included.")


# ---- exercise 4: a sum inside each block of ranks ---------------------------------------------

def _block(rank, world_size, group_size):
    first = rank // group_size * group_size
    return tuple(range(first, min(first + group_size, world_size)))


def _block_sum_on_ranks(rank, world_size, block_sum, group_size, values):
    value = values[rank]
    del values
    with forbid(exercise="sum within your block of ranks"):
        return block_sum(rank, world_size, group_size, value)


def _check_inside_block(trace, world_size, group_size, name):
    """Every message of a rank stays inside its block, by the checkers' one traffic rule
    (`_traffic`): collectives on exactly the block's group, point-to-point messages with peers of
    the block (a block of one rank needs none)."""
    for rank in range(world_size):
        block = _block(rank, world_size, group_size)
        context = f"{name} with world_size={world_size}, group_size={group_size}"
        calls = _traffic.data_calls(_traffic.records(trace, rank))
        bad, _ = _traffic.off_group(calls, block)
        if bad is not None:
            where = (f"its {bad['op']} went to rank {bad['peer']}" if bad["kind"] in _traffic.P2P
                     else f"its {bad['op']} ran over ranks {list(bad['group'])}")
            raise CheckFailed(f"{context}: rank {rank}'s block is ranks {list(block)}, but "
                              f"{where}; communicate on a group of exactly the block.")
        if len(block) > 1 and not calls:
            raise CheckFailed(f"{context}: rank {rank} returned its block's sum without a "
                              f"message; it only knows its own value.")


def check_block_sum(block_sum, cases=((4, 2), (5, 2), (7, 3))):
    """block_sum(rank, world_size, group_size, value) -> the sum of `value` over the rank's block
    of consecutive ranks; the values are drawn afresh and each rank gets only its own."""
    name = getattr(block_sum, "__name__", "block_sum")
    rng = random.SystemRandom()
    for world_size, group_size in cases:
        values = [float(rng.randrange(-50, 50)) + 0.25 * rng.randrange(4)
                  for _ in range(world_size)]
        expected = [sum(values[r] for r in _block(rank, world_size, group_size))
                    for rank in range(world_size)]
        got = learner_run(_block_sum_on_ranks, world_size, block_sum, group_size, values,
                          name=name, hang_rule="every rank must create every block's group, "
                          "in the same order, and use only its own.")
        for rank in range(world_size):
            compare(got[rank], expected[rank],
                    f"{name} with world_size={world_size}, group_size={group_size}, rank {rank} "
                    f"(its block is ranks {list(_block(rank, world_size, group_size))})")
        _check_inside_block(got.trace, world_size, group_size, name)
    shapes = ", ".join(f"{w} ranks in blocks of {g}" for w, g in cases)
    passed(f"{name} adds up each block of ranks, talking inside the block only ({shapes}).")


# ---- exercise 5: a script that survives torchrun's restart ------------------------------------

RESTART_CASES = ((2, 6, 3), (3, 5, 1))      # (world size, steps, the step at which a rank crashes)


def _draw_pushes(world_size, steps, seed):
    """What each rank adds at each step: drawn afresh, known to that rank only."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(-9, 10, (steps, 4), generator=g).double() for _ in range(world_size)]


def _reference_training(pushes, steps):
    state = torch.zeros(4, dtype=torch.float64)
    for i in range(steps):
        state = 0.5 * state + sum(p[i] for p in pushes)
    return state


class SimulatedCrash(RuntimeError):
    """The checker's stand-in for a worker that dies (a lost node, an OOM kill)."""


def _attempt(rank, world_size, train, folder, steps, pushes, attempt, crash_at):
    mine = pushes[rank]
    del pushes
    os.environ["TORCHELASTIC_RESTART_COUNT"] = str(attempt)   # as torchrun's agent sets it
    seen = []

    def step(state, i):
        if not isinstance(state, torch.Tensor) or tuple(state.shape) != (4,):
            raise TypeError(f"step(state, i) takes the state step returned last (a tensor of 4 "
                            f"numbers; torch.zeros(4) at first); got {state!r}.")
        if not dist.is_initialized():
            raise RuntimeError("step(state, i) runs a collective: initialise the process group "
                               "first, from the environment torchrun sets.")
        seen.append(int(i))
        if crash_at is not None and int(i) == crash_at and rank == world_size - 1:
            time.sleep(0.5)             # the others finish saving step crash_at - 1 first
            raise SimulatedCrash(f"rank {rank} crashed at step {i} (simulated)")
        push = mine[int(i)].clone()
        dist.all_reduce(push)
        return 0.5 * state.to(torch.float64) + push

    with forbid(_reference_training, _draw_pushes, exercise="run the steps yourself"):
        final = train(folder, steps, step)
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    return final, seen


def check_resumable_training(train, cases=RESTART_CASES):
    """train(folder, steps, step) runs as torchrun starts a script; attempt 0 crashes on the last
    rank at step k, attempt 1 (TORCHELASTIC_RESTART_COUNT=1) must go on from a saved step > 0
    and end with the state of an uninterrupted run."""
    import tempfile
    name = getattr(train, "__name__", "train")
    for world_size, steps, crash_at in cases:
        pushes = _draw_pushes(world_size, steps, random.SystemRandom().randrange(1 << 30))
        expected = _reference_training(pushes, steps)
        context = f"{name} with world_size={world_size}, {steps} steps"
        with tempfile.TemporaryDirectory() as folder:
            try:
                learner_run(_attempt, world_size, train, folder, steps, pushes, 0, crash_at,
                            name=name, init=False, hang_rule="every rank must run the same steps.")
            except RankFailed as e:
                if e.exc_type != SimulatedCrash.__name__:
                    raise
            else:
                raise CheckFailed(f"{context}: the first attempt finished without reaching step "
                                  f"{crash_at}, where the checker crashes rank {world_size - 1}; "
                                  f"call step(state, i) for i = 0, 1, ..., {steps - 1}.")
            got = learner_run(_attempt, world_size, train, folder, steps, pushes, 1, None,
                              name=name, init=False, hang_rule="every rank must run the same "
                              "steps, from the same saved step.")
        for rank, (final, seen) in enumerate(got):
            where = f"{context}, restarted after a crash at step {crash_at}, rank {rank}"
            if not seen or seen[0] == 0:
                raise CheckFailed(f"{where}: the restart began again at step 0; it must go on "
                                  f"from the last step saved before the crash.")
            if seen[0] > crash_at:
                raise CheckFailed(f"{where}: the restart began at step {seen[0]}, but step "
                                  f"{crash_at} never completed; resume at the first step not "
                                  f"saved.")
            if seen != list(range(seen[0], steps)):
                raise CheckFailed(f"{where}: after the restart step ran for i = {seen}; it must "
                                  f"run once for each remaining step, in order.")
            compare(final, expected, f"{where}, its final state", atol=1e-9, rtol=1e-9)
    shapes = ", ".join(f"{w} ranks, a crash at step {k} of {s}" for w, s, k in cases)
    passed(f"{name} survives a crash and torchrun's restart ({shapes}), going on from its "
           f"checkpoint to the state of an uninterrupted run.")
