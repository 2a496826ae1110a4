"""Dropout under TP: which ranks must draw the same random numbers."""
import contextlib

import torch
import torch.distributed as dist

from .. import _argcheck as check


def _rng_state():
    cuda = torch.cuda.get_rng_state() if torch.cuda.is_available() and torch.cuda.is_initialized() \
        else None
    return torch.get_rng_state(), cuda


def _set_rng_state(state):
    cpu, cuda = state
    torch.set_rng_state(cpu)
    if cuda is not None:
        torch.cuda.set_rng_state(cuda)


class RNGTracker:
    """Named random-number streams a block of code can switch to (Megatron-LM's
    CudaRNGStatesTracker, on the CPU generator here and the current CUDA one where it is up).

    `with tracker.fork(name):` saves the default generator's state, runs the block on the
    named stream, stores that stream's advanced state and restores the default: the code
    outside draws exactly what it would have drawn without the block."""

    def __init__(self):
        self.states = {}

    def add(self, name, seed):
        saved = _rng_state()
        torch.manual_seed(seed)
        self.states[name] = _rng_state()
        _set_rng_state(saved)

    @contextlib.contextmanager
    def fork(self, name="model-parallel-rng"):
        if name not in self.states:
            raise KeyError(f"no random stream named {name!r}; add it first "
                           f"(known: {sorted(self.states)}).")
        saved = _rng_state()
        _set_rng_state(self.states[name])
        try:
            yield
        finally:
            self.states[name] = _rng_state()
            _set_rng_state(saved)


def model_parallel_seed(seed, group=None):
    """Megatron-LM's model_parallel_cuda_manual_seed: the default generator gets `seed` on every
    rank of the TP group (dropout on REPLICATED activations — the residual stream after g's
    all-reduce — must be identical on every rank, or the replicas drift apart), and the returned
    tracker's "model-parallel-rng" stream gets seed + 2718 + the TP rank (dropout on SHARDED
    activations — a rank's heads, its slice of the MLP hidden, or, sequence parallel, its slice
    of the sequence — must differ, or every shard gets the same mask). 2718 is Megatron's offset."""
    torch.manual_seed(check.whole(seed, "seed", example=1234))
    tracker = RNGTracker()
    tracker.add("model-parallel-rng", seed + 2718 + dist.get_rank(group))
    return tracker
