"""Checkers for workbook 00: memory arithmetic, time to train, and a first collective."""
import torch

from .. import memory
from . import CheckFailed, call_learner, compare, forbid, passed, sizes_phrase
from .ch01 import collectives, learner_run, refusing

MODELS = {"a 1.3B model": 1.3e9, "a 7B model": 7e9, "a 70B model": 70e9, "GPT-3 (175B)": 175e9}


def check_model_states_gb(fn):
    """fn(n_params) -> {"weights", "grads", "optimizer"} in GB, bf16 mixed precision with Adam."""
    with refusing(memory.model_state_bytes, memory.training_days,
                  exercise="do the byte arithmetic yourself"):
        answers = [call_learner(fn, n) for n in MODELS.values()]
    for (label, n), got in zip(MODELS.items(), answers):
        expected = {k: v / memory.GB for k, v in
                    memory.model_state_bytes(n, "bf16-mixed", "adam").items()}
        if not isinstance(got, dict):
            raise CheckFailed(f"model_states_gb should return a dict with keys 'weights', "
                              f"'grads' and 'optimizer'; got {type(got).__name__}.")
        compare(got, expected, f"model_states_gb({n:.3g}) for {label}", rtol=1e-9, atol=1e-9)
    passed("model_states_gb is right for 1.3B, 7B, 70B and 175B parameters: "
           "16 bytes per parameter, 12 of them for Adam.")


def check_training_days(fn):
    """fn(n_params, tokens, n_gpus, peak_flops, mfu) -> days."""
    cases = [(175e9, 300e9, 1024, 312e12, 0.4), (7e9, 2e12, 256, 989e12, 0.45),
             (1.3e9, 26e9, 1, 165e12, 0.3)]
    with refusing(memory.model_state_bytes, memory.training_days,
                  exercise="write the formula yourself"):
        answers = [call_learner(fn, *args) for args in cases]
    for args, got in zip(cases, answers):
        compare(got, memory.training_days(*args),
                f"training_days{tuple(f'{a:.3g}' for a in args)}".replace("'", ""), rtol=1e-9)
    passed("training_days is right: 6·N·D FLOPs divided by what the GPUs really deliver.")


def _local_data(rank):
    # Uneven shards on purpose: rank r holds r + 2 numbers, so a mean of means is wrong.
    g = torch.Generator().manual_seed(1000 + rank)
    return torch.randn(rank + 2, generator=g, dtype=torch.float64)


def _reference_global_mean(rank, world_size):
    return torch.cat([_local_data(r) for r in range(world_size)]).mean().item()


def check_global_mean(fn, world_sizes=(1, 2, 3, 4)):
    """fn(local) -> the mean over every rank's numbers, called on each rank with its own data."""
    def learner(rank, world_size):
        local = _local_data(rank)
        with forbid(_local_data, _reference_global_mean,
                    exercise="combine the ranks' numbers with a collective"):
            return fn(local)

    for ws in world_sizes:
        got = learner_run(learner, ws, name="global_mean",
                          hang_rule="every rank must call the same collectives, in the same order.")
        expected = _reference_global_mean(0, ws)
        for rank in range(ws):
            value = got[rank]
            if isinstance(value, torch.Tensor) and value.numel() == 1:
                value = value.item()
            local_mean = _local_data(rank).mean().item()
            if ws > 1 and isinstance(value, float) and abs(value - local_mean) < 1e-12:
                raise CheckFailed(f"with world_size={ws}, rank {rank} returned its own local mean "
                                  f"({value:.6g}): the ranks must combine their data.")
            compare(value, expected, f"global_mean with world_size={ws}, rank {rank}",
                    atol=1e-9, rtol=1e-9)
            world = tuple(range(ws))
            if ws > 1 and not any(e["group"] == world for e in collectives(got.trace, rank)):
                raise CheckFailed(f"with world_size={ws}, rank {rank} returned the right number "
                                  f"without a collective over all the ranks: it only holds its "
                                  f"own {rank + 2} numbers, so it must get the others' sums and "
                                  f"counts with dist.all_reduce.")
    passed(f"global_mean gives every rank the mean of all the data, on "
           f"{sizes_phrase(world_sizes)} ranks with uneven shards.")
