"""Which tokens a rank holds: contiguous, zig-zag and striped blocks of a sequence, and the
causal work each layout gives every rank."""
import torch

from .. import _argcheck as check


def _check_divides(seq_len, world_size, layout, per_rank=1):
    parts = per_rank * world_size
    if seq_len % parts:
        # the advice names real sizes: a cp that divides the length can still fail zig-zag
        # (12 tokens on cp = 4 need 8 chunks), so offer the nearest sizes that split it
        fits = [1] + [n for n in range(2, seq_len // per_rank + 1)    # one rank: any length
                      if seq_len % (per_rank * n) == 0]
        below = max((n for n in fits if n < world_size), default=None)
        above = min((n for n in fits if n > world_size), default=None)
        near = [n for n in (below, above) if n is not None]
        raise ValueError(
            f"a sequence of {seq_len} tokens does not split into {parts} equal chunks for the "
            f"{layout} layout{f' ({per_rank} per rank)' if per_rank > 1 else ''}; pad the "
            f"sequence to a multiple of {parts} (padding tokens masked out), or choose a "
            f"context-parallel size that splits it: cp = {' or '.join(map(str, near))} here.")


def _check_layout(seq_len, rank, world_size):
    """(seq_len, rank, world_size) as ints; a rank outside the group would get positions past
    the sequence (or, negative, before it) without a word."""
    world_size = check.whole(world_size, "world_size", at_least=1)
    return (check.whole(seq_len, "seq_len", at_least=0), check.rank_in(rank, world_size),
            world_size)


def contiguous_positions(seq_len, rank, world_size):
    """Rank r holds tokens [r·S/N, (r+1)·S/N)."""
    seq_len, rank, world_size = _check_layout(seq_len, rank, world_size)
    _check_divides(seq_len, world_size, "contiguous")
    n = seq_len // world_size
    return torch.arange(rank * n, (rank + 1) * n)


def zigzag_positions(seq_len, rank, world_size):
    """Rank r holds chunk r and chunk 2N−1−r of 2N: equal causal work on every rank. One rank
    holds the whole sequence in order, whatever its length."""
    seq_len, rank, world_size = _check_layout(seq_len, rank, world_size)
    if world_size == 1:
        return torch.arange(seq_len)
    _check_divides(seq_len, world_size, "zig-zag", per_rank=2)
    n = seq_len // (2 * world_size)
    first, second = rank, 2 * world_size - 1 - rank
    return torch.cat([torch.arange(first * n, (first + 1) * n),
                      torch.arange(second * n, (second + 1) * n)])


def striped_positions(seq_len, rank, world_size):
    """Rank r holds tokens r, r + N, r + 2N, ... (striped attention, Brandon et al. 2023): every
    rank's block spreads over the whole sequence, so causal work is equal up to one diagonal."""
    seq_len, rank, world_size = _check_layout(seq_len, rank, world_size)
    _check_divides(seq_len, world_size, "striped")
    return torch.arange(rank, seq_len, world_size)


def causal_work(positions_per_rank):
    """Query-key pairs each rank computes under a causal mask (the load each layout gives)."""
    if not len(positions_per_rank):
        raise ValueError("causal_work needs one tensor of positions per rank, e.g. "
                         "[zigzag_positions(S, r, N) for r in range(N)]; got none.")
    total = torch.cat([check.integers(p, "positions") for p in positions_per_rank])
    return [int(sum((total <= p).sum() for p in pos)) for pos in positions_per_rank]
