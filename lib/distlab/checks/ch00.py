"""Checkers for workbook 00: how many GPUs sharded model states need, what share of the FLOPs
attention takes, and a mean across ranks whose numbers only travel by collective."""
import math
import random
from fractions import Fraction

import torch

from .. import memory, nan_debug
from . import CheckFailed, call_learner, compare, forbid, passed, sizes_phrase
from .ch01 import learner_run, refusing

# ---- exercise 1: the fewest GPUs once some model states are sharded ---------------------------

PARTS = ("weights", "grads", "optimizer")
BYTES = {"weights": 2, "grads": 2, "optimizer": 12}      # bf16 mixed precision + Adam
MODELS = (1.3e9, 7e9, 13e9, 70e9, 175e9)
SHARDINGS = ((), ("optimizer",), ("optimizer", "grads"), ("optimizer", "grads", "weights"),
             ("weights",))
GPU_GB = (80, 141, 40)


def _fewest(n_params, sharded, gpu_gb):
    """Exact: the fewest d with copied + split / d <= capacity, or None."""
    n = Fraction(int(n_params))
    copied = sum(BYTES[p] for p in PARTS if p not in sharded) * n
    split = sum(BYTES[p] for p in sharded) * n
    room = Fraction(gpu_gb) * 10 ** 9 - copied
    if room < 0 or (room == 0 and split > 0):
        return None
    return max(1, math.ceil(split / room)) if split else 1


def _gpu_cases():
    # A case whose answer sits exactly on a boundary (states == capacity at some d) is left out:
    # there a float rounding of the learner's arithmetic decides, not their reasoning.
    cases = []
    for n in MODELS:
        for sharded in SHARDINGS:
            for gb in GPU_GB:
                n_ = Fraction(int(n))
                copied = sum(BYTES[p] for p in PARTS if p not in sharded) * n_
                split = sum(BYTES[p] for p in sharded) * n_
                room = Fraction(gb) * 10 ** 9 - copied
                if room > 0 and split and (split / room).denominator == 1:
                    continue
                cases.append((n, frozenset(sharded), gb))
    return cases


GPU_CASES = _gpu_cases()


def _call_phrase(name, n, sharded, gb):
    parts = "{" + ", ".join(repr(p) for p in PARTS if p in sharded) + "}" if sharded else "set()"
    return f"{name}({n:.3g}, {parts}, gpu_gb={gb})"


def check_fewest_gpus(fn):
    """fn(n_params, sharded, gpu_gb) -> the fewest data-parallel GPUs whose memory holds the model
    states (bf16 mixed precision + Adam) with the parts in `sharded` split evenly, or None."""
    name = getattr(fn, "__name__", "fewest_gpus")
    with refusing(memory.model_state_bytes, memory.bytes_per_parameter, memory.gpus_to_hold,
                  memory.per_gpu_bytes, exercise="do the byte arithmetic yourself"):
        answers = [call_learner(fn, n, set(sharded), gb, name=name) for n, sharded, gb in GPU_CASES]
    for (n, sharded, gb), got in zip(GPU_CASES, answers):
        expected = _fewest(n, sharded, gb)
        call = _call_phrase(name, n, sharded, gb)
        if expected is None:
            if got is not None:
                raise CheckFailed(f"{call} returned {got!r}, but the copied parts alone need "
                                  f"more than {gb} GB on every GPU, however many: return None.")
            continue
        if got is None:
            raise CheckFailed(f"{call} returned None, but {expected} GPUs hold the states.")
        if isinstance(got, bool) or not isinstance(got, (int, float)) or got != int(got):
            raise CheckFailed(f"{call} should return a whole number of GPUs (or None); got "
                              f"{got!r}.")
        if int(got) != expected:
            raise CheckFailed(f"{call}: expected {expected} GPUs, got {int(got)}.")
    passed(f"{name} is right for {len(GPU_CASES)} cases: 1.3B to 175B parameters, nothing to "
           f"everything sharded, GPUs of 40, 80 and 141 GB, None where no number is enough.")


# ---- exercise 2: attention's share of the training FLOPs --------------------------------------

ATTENTION_CASES = (   # (n_params, layers, hidden, seq_len): params are not 12·L·h² (embeddings)
    (7e9, 32, 4096, 4096), (7e9, 32, 4096, 32768), (175e9, 96, 12288, 2048),
    (1.3e9, 24, 2048, 2048), (70e9, 80, 8192, 131072), (8e9, 32, 4096, 8192))


def _attention_share(n_params, layers, hidden, seq_len):
    attention = 12 * layers * hidden * seq_len      # QKᵀ and PV: 4·h·s per token and layer, ×3
    return attention / (6 * n_params + attention)


def check_attention_share(fn):
    """fn(n_params, layers, hidden, seq_len) -> the fraction of training FLOPs in attention's
    score and weighted-sum matmuls (no causal saving)."""
    name = getattr(fn, "__name__", "attention_share")
    with refusing(nan_debug.flops_per_token, nan_debug.mfu, memory.training_flops,
                  exercise="count the FLOPs yourself"):
        answers = [call_learner(fn, *case, name=name) for case in ATTENTION_CASES]
    for case, got in zip(ATTENTION_CASES, answers):
        n, layers, hidden, seq = case
        compare(got, _attention_share(*case),
                f"{name}({n:.3g}, layers={layers}, hidden={hidden}, seq_len={seq})", rtol=1e-6,
                atol=1e-12)
    passed(f"{name} is right for {len(ATTENTION_CASES)} models from 1.3B to 175B and sequences "
           f"of 2k to 128k tokens.")


# ---- exercise 3: a mean whose numbers are only known on their own rank ------------------------

def _draw_shards(world_size, seed):
    """Every rank's numbers, drawn fresh for each check: uneven lengths (one rank may hold none,
    at least two hold some), so a mean of means, a constant or a recipe rebuilt on the rank is
    refused."""
    rng = random.Random(seed)
    while True:
        lengths = [rng.randrange(0, 7) for _ in range(world_size)]
        if world_size == 1 and lengths[0]:
            break
        if sum(n > 0 for n in lengths) >= 2 and len(set(lengths)) > 1:
            break
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(n, generator=g, dtype=torch.float64) * 3 + rng.uniform(-5, 5)
            for n in lengths]


def _mean_on_rank(rank, world_size, fn, shards):
    local = shards[rank].clone()
    del shards                  # this rank's numbers only, as on a real job
    with forbid(_draw_shards, exercise="combine the ranks' numbers with collectives"):
        return fn(local)


def check_global_mean(fn, world_sizes=(1, 3, 4)):
    """fn(local) -> the mean over every rank's numbers, called on each rank with its own data."""
    name = getattr(fn, "__name__", "global_mean")
    for ws in world_sizes:
        shards = _draw_shards(ws, random.SystemRandom().randrange(1 << 30))
        got = learner_run(_mean_on_rank, ws, fn, shards, name=name,
                          hang_rule="every rank must call the same collectives, in the same order.")
        expected = torch.cat(shards).mean().item()
        lengths = ", ".join(str(len(s)) for s in shards)
        for rank in range(ws):
            value = got[rank]
            if isinstance(value, torch.Tensor) and value.numel() == 1:
                value = value.item()
            own = shards[rank].mean().item() if len(shards[rank]) else None
            if (ws > 1 and own is not None and isinstance(value, float)
                    and abs(value - own) < 1e-12 and abs(own - expected) > 1e-9):
                raise CheckFailed(f"{name} with world_size={ws}: rank {rank} returned its own "
                                  f"local mean ({value:.6g}); the ranks must combine their data.")
            compare(value, expected, f"{name} with world_size={ws} (shards of {lengths} "
                                     f"numbers), rank {rank}", atol=1e-9, rtol=1e-9)
    passed(f"{name} gives every rank the mean of all the data, on {sizes_phrase(world_sizes)} "
           f"ranks with uneven shards drawn afresh.")
