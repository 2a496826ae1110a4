"""Exercise 3 of workbook 05: resume an epoch on a different number of ranks (an elastic
restart): which samples are left, and how DistributedSampler would split them.
`_judge_shuffling` is exercise 6's judge of the script's sampler."""
import math

import torch

from .. import CheckFailed, call_learner, forbid, passed


# ---- exercise 3: resuming an epoch on a different number of ranks ---------------------------------

# (samples, seed, epoch, ranks before the restart, samples each had read, ranks after it): a
# restart at the start of an epoch, lengths that do not divide (padding before and after), a
# whole epoch already read, more ranks than samples left.
RESUME_CASES = ((12, 0, 0, 2, 0, 3), (12, 0, 1, 4, 1, 2), (10, 3, 2, 4, 2, 3), (17, 5, 4, 3, 2, 4),
                (10, 3, 2, 4, 3, 2), (9, 2, 1, 2, 4, 3), (20, 1, 3, 4, 3, 8))


def _old_reads(n, seed, epoch, old_world, consumed):
    """{sample: (old rank, position)} of what the job read before it stopped: torch's own
    DistributedSampler for each old rank, its first `consumed` samples."""
    from torch.utils.data.distributed import DistributedSampler
    read = {}
    for r in range(old_world):
        sampler = DistributedSampler(range(n), num_replicas=old_world, rank=r, shuffle=True,
                                     seed=seed)
        sampler.set_epoch(epoch)
        for position, i in enumerate(list(sampler)[:consumed]):
            read.setdefault(i, (r, position))
    return read


def _resumed(n, seed, epoch, old_world, consumed, world_size):
    """What each new rank reads: the epoch's order (DistributedSampler on one replica), minus
    what was read, padded as DistributedSampler pads, every world_size-th from the rank."""
    from torch.utils.data.distributed import DistributedSampler
    whole = DistributedSampler(range(n), num_replicas=1, rank=0, shuffle=True, seed=seed)
    whole.set_epoch(epoch)
    read = _old_reads(n, seed, epoch, old_world, consumed)
    left = [i for i in whole if i not in read]
    if not left:
        return [[] for _ in range(world_size)]
    total = math.ceil(len(left) / world_size) * world_size
    padded = (left * math.ceil(total / len(left)))[:total]
    return [padded[r::world_size] for r in range(world_size)]


def _as_indices(value):
    if isinstance(value, torch.Tensor):
        value = value.reshape(-1).tolist()
    if not isinstance(value, (list, tuple, range)):
        return None
    try:
        return [int(i) for i in value]
    except (TypeError, ValueError):
        return None


def check_resume_indices(fn, cases=RESUME_CASES):
    """fn(n, seed, epoch, old_world, consumed, world_size, rank) -> the sample indices rank `rank`
    of the restarted job (world_size ranks) reads for the rest of epoch `epoch`, when each of the
    old job's old_world ranks had read `consumed` samples of it through
    DistributedSampler(shuffle=True, seed=seed) with set_epoch(epoch).

    Judged on the algorithm, per case: equal lengths on every new rank, nothing read before the
    restart read again, nothing left out, and the epoch's own order, strided over the new ranks
    (a job that had never stopped would have read the same permutation)."""
    name = getattr(fn, "__name__", "resume_indices")
    if not callable(fn):
        raise TypeError(f"the check needs your function, e.g. check_resume_indices({name}); "
                        f"got {fn!r}.")
    for n, seed, epoch, old_world, consumed, ws in cases:
        where = (f"{name}({n}, seed={seed}, epoch={epoch}, old_world={old_world}, "
                 f"consumed={consumed}, world_size={ws})")
        got = []
        for rank in range(ws):
            with forbid(_resumed, _old_reads, exercise="work out what is left yourself"):
                value = call_learner(fn, n, seed, epoch, old_world, consumed, ws, rank,
                                     name=name)
            indices = _as_indices(value)
            if indices is None:
                raise CheckFailed(f"{where} returned {type(value).__name__} for rank {rank}; it "
                                  f"must return a list of sample indices.")
            got.append(indices)
        _judge_resume(got, where, n, seed, epoch, old_world, consumed, ws)
    passed(f"{name} reads the rest of every epoch exactly once, in DistributedSampler's order, "
           f"on {len(cases)} restarts (e.g. 4 ranks that had read {cases[2][4]} samples each "
           f"of {cases[2][0]}, resumed on {cases[2][5]}).")


def _judge_resume(got, where, n, seed, epoch, old_world, consumed, ws):
    want = _resumed(n, seed, epoch, old_world, consumed, ws)
    if got == want:
        return
    read = _old_reads(n, seed, epoch, old_world, consumed)
    left = n - len(read)
    per = len(want[0])
    outside = sorted({i for g in got for i in g if not 0 <= i < n})
    if outside:
        raise CheckFailed(f"{where}: a rank reads index {outside[0]}, not a sample of the {n}.")
    if epoch and got == _resumed(n, seed, 0, old_world, consumed, ws):
        raise CheckFailed(f"{where}: your order is epoch 0's: DistributedSampler shuffles with "
                          f"the seed plus the epoch (torch.Generator().manual_seed(seed + "
                          f"epoch)).")
    if consumed and got == _resumed(n, seed, epoch, old_world, 0, ws):
        raise CheckFailed(f"{where}: you restarted the epoch from its beginning, so the "
                          f"{len(read)} samples read before the restart are read twice: skip "
                          f"what the old ranks had read.")
    for rank, g in enumerate(got):
        if len(g) != per:
            raise CheckFailed(
                f"{where}: rank {rank} reads {len(g)} samples; {left} sample(s) of the epoch were "
                f"left unread, over {ws} ranks that is {per} each (every rank must run the same "
                f"number of steps: pad by repeating from the start of what is left, as "
                f"DistributedSampler does).")
    again = [(rank, i) for rank, g in enumerate(got) for i in g if i in read]
    if again:
        rank, i = again[0]
        old_rank, position = read[i]
        raise CheckFailed(
            f"{where}: rank {rank} reads sample {i}, which old rank {old_rank} had already read "
            f"(its read number {position}) before the restart: after each old rank read "
            f"{consumed}, the job had read the first {consumed} × {old_world} samples of the "
            f"epoch's padded order; skip them.")
    missing = sorted(set(range(n)) - set(read) - {i for g in got for i in g})
    if missing:
        raise CheckFailed(f"{where}: sample {missing[0]} was not read before the restart and no "
                          f"rank reads it after: the epoch would never see it.")
    rank = next(r for r in range(ws) if got[r] != want[r])
    raise CheckFailed(
        f"{where}: rank {rank} reads {got[rank]}; the epoch's order gives it {want[rank]}: keep "
        f"the epoch's permutation (what is left, in the order DistributedSampler shuffled it) and "
        f"give rank r the samples at positions r, r + {ws}, r + {2 * ws}, ... of it.")


def _judge_shuffling(per_rank, ws, n, epochs, where, noun, fix):
    """per_rank[r][e]: the indices rank r read in epoch e. Refuses an unshuffled first epoch and
    an epoch that repeats the one before (the missing set_epoch)."""
    unshuffled = [list(range(rank, n, ws)) for rank in range(ws)]
    if all(per_rank[r][0] == unshuffled[r] for r in range(ws)):
        raise CheckFailed(f"{where}epoch 0 reads the {noun} in order ({unshuffled[0]} on rank 0): "
                          f"nothing was shuffled; {fix}.")
    for e in range(1, epochs):
        if all(per_rank[r][e] == per_rank[r][e - 1] for r in range(ws)):
            raise CheckFailed(
                f"{where}epoch {e} repeats epoch {e - 1}'s order on every rank "
                f"({per_rank[0][e]} on rank 0): call sampler.set_epoch(epoch) at the start of each "
                f"epoch, or the sampler shuffles with the same seed every time.")
