"""Which tokens a rank holds: contiguous, zig-zag and striped blocks of a sequence, and the
causal work each layout gives every rank."""
import torch


def _check_divides(seq_len, parts, layout):
    if seq_len % parts:
        raise ValueError(
            f"a sequence of {seq_len} tokens does not split into {parts} equal chunks for the "
            f"{layout} layout; pad the sequence to a multiple of {parts} (padding tokens masked "
            f"out), or choose a context-parallel size that divides it.")


def contiguous_positions(seq_len, rank, world_size):
    """Rank r holds tokens [r·S/N, (r+1)·S/N)."""
    _check_divides(seq_len, world_size, "contiguous")
    n = seq_len // world_size
    return torch.arange(rank * n, (rank + 1) * n)


def zigzag_positions(seq_len, rank, world_size):
    """Rank r holds chunk r and chunk 2N−1−r of 2N: equal causal work on every rank."""
    _check_divides(seq_len, 2 * world_size, "zig-zag")
    n = seq_len // (2 * world_size)
    first, second = rank, 2 * world_size - 1 - rank
    return torch.cat([torch.arange(first * n, (first + 1) * n),
                      torch.arange(second * n, (second + 1) * n)])


def striped_positions(seq_len, rank, world_size):
    """Rank r holds tokens r, r + N, r + 2N, ... (striped attention, Brandon et al. 2023): every
    rank's block spreads over the whole sequence, so causal work is equal up to one diagonal."""
    _check_divides(seq_len, world_size, "striped")
    return torch.arange(rank, seq_len, world_size)


def causal_work(positions_per_rank):
    """Query-key pairs each rank computes under a causal mask (the load each layout gives)."""
    total = torch.cat(positions_per_rank)
    return [int(sum((total <= p).sum() for p in pos)) for pos in positions_per_rank]
