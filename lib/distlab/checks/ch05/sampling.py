"""Exercise 3 of workbook 05: what DistributedSampler gives each rank, epoch after epoch, and
why set_epoch matters. `_judge_shuffling` is also exercise 6's judge of the script's sampler."""
import torch

from .. import CheckFailed, passed, run_learner, sizes_phrase


# ---- exercise 3: DistributedSampler and set_epoch -------------------------------------------------

SAMPLES, EPOCHS = 12, 3          # 12 divides by 2 and 3: every sample exactly once per epoch


def _reference_epochs(dataset, epochs):
    """The indices this rank reads in each epoch (refused inside the learner's function)."""
    from torch.utils.data import DataLoader
    from torch.utils.data.distributed import DistributedSampler
    sampler = DistributedSampler(dataset, shuffle=True, seed=0)
    loader = DataLoader(dataset, batch_size=2, sampler=sampler)
    out = []
    for epoch in range(epochs):
        sampler.set_epoch(epoch)
        out.append([int(i) for (b,) in loader for i in b])
    return out


def _as_epochs(value, epochs):
    """The learner's answer as a list of lists of ints, or a sentence saying why it is not."""
    if not isinstance(value, (list, tuple)) or len(value) != epochs:
        return None, (f"returned {type(value).__name__}"
                      f"{f' of length {len(value)}' if isinstance(value, (list, tuple)) else ''};"
                      f" it must return one list of sample indices per epoch ({epochs} lists)")
    out = []
    for e, part in enumerate(value):
        if isinstance(part, torch.Tensor):
            part = part.reshape(-1).tolist()
        try:
            out.append([int(i) for i in part])
        except (TypeError, ValueError):
            return None, f"returned {type(part).__name__} for epoch {e}, not a list of indices"
    return out, None


def check_epoch_indices(fn, world_sizes=(2, 3)):
    """fn(dataset, epochs) -> for each epoch, the list of sample indices this rank read.

    The dataset is TensorDataset(torch.arange(12)): a sample's value is its index. Judged: every
    sample read exactly once per epoch across the ranks, each rank its equal share, a shuffled
    order that differs from epoch to epoch, and the same answer when the function runs again.
    """
    def learner(rank, world_size):
        from torch.utils.data import TensorDataset
        from .. import forbid
        data = TensorDataset(torch.arange(SAMPLES))
        with forbid(_reference_epochs, exercise="build the loader and the epoch loop yourself"):
            first, again = fn(data, EPOCHS), fn(data, EPOCHS)
        first, error = _as_epochs(first, EPOCHS)
        if error:
            return {"error": error}
        return {"epochs": first, "again": _as_epochs(again, EPOCHS)[0]}

    for ws in world_sizes:
        got = run_learner(learner, ws, name="epoch_indices", timeout=60)
        for rank in range(ws):
            if "error" in got[rank]:
                raise CheckFailed(f"epoch_indices {got[rank]['error']} (rank {rank}).")
        _judge_epochs([g["epochs"] for g in got], [g["again"] for g in got], ws)
    passed(f"epoch_indices reads every sample exactly once per epoch, split across "
           f"{sizes_phrase(world_sizes)} ranks, shuffled differently every epoch and the same "
           f"when run again.")


def _judge_epochs(per_rank, again, ws):
    share = SAMPLES // ws
    where = f"with world_size={ws}"
    for e in range(EPOCHS):
        for rank in range(ws):
            read = per_rank[rank][e]
            if len(read) == SAMPLES and ws > 1:
                raise CheckFailed(
                    f"{where}, rank {rank} read all {SAMPLES} samples in epoch {e}: a plain "
                    f"DataLoader gives every rank the whole dataset; give it a DistributedSampler "
                    f"so each rank reads its {share}.")
            if len(read) != share:
                raise CheckFailed(
                    f"{where}, rank {rank} read {len(read)} samples in epoch {e}; {SAMPLES} samples "
                    f"over {ws} ranks is {share} per rank.")
        owners = {}
        for rank in range(ws):
            for i in per_rank[rank][e]:
                owners.setdefault(i, []).append(rank)
        twice = sorted(i for i, r in owners.items() if len(r) > 1)
        if twice:
            i = twice[0]
            missing = sorted(set(range(SAMPLES)) - set(owners))
            raise CheckFailed(
                f"{where}, in epoch {e} sample {i} was read by ranks {owners[i][0]} and "
                f"{owners[i][1]}{f' and sample {missing[0]} by none' if missing else ''}: the ranks "
                f"must split the SAME permutation, so use the same seed on every rank and let the "
                f"sampler take rank and world size from the process group.")
        outside = sorted(i for i in owners if not 0 <= i < SAMPLES)
        if outside:
            raise CheckFailed(f"{where}, epoch {e} holds index {outside[0]}, which is not a "
                              f"sample of the 12 (0..11): return the values read from the loader.")
    _judge_shuffling(per_rank, ws, SAMPLES, EPOCHS, f"{where}, ", "samples",
                     "pass shuffle=True to the sampler")
    for rank in range(ws):
        if again[rank] != per_rank[rank]:
            raise CheckFailed(
                f"{where}, rank {rank} read a different order when your function ran a second "
                f"time: seed the shuffle (the same seed on every rank) so a run can be repeated.")


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
