"""Moving blocks between the ranks of a context-parallel group: one hop around the ring
(posted sends and receives), and gathering every rank's block along the token axis, blocks of
unequal lengths included."""
import torch
import torch.distributed as dist


def _block_lengths(q, group):
    """Every rank's number of tokens (collective). Blocks may differ (7 tokens on 3 ranks:
    3, 2, 2), and a receive buffer must be the size of the block that arrives, not of this
    rank's own: gloo aborts the process on a mismatch, NCCL would hang or return garbage."""
    mine = torch.tensor([q.shape[-2 if q.dim() > 1 else 0]], device=q.device)
    lengths = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(lengths, mine, group=group)
    return [int(t) for t in lengths]


def _with_length(t, length):
    """The shape of `t` with its token axis (-2 of a block, the only axis of positions) resized."""
    return (*t.shape[:-2], length, t.shape[-1]) if t.dim() > 1 else (length,)


def _shift(tensors, group, length=None):
    """Start sending `tensors` to the right neighbour and receiving the left one's blocks of
    `length` tokens (default: as many as these); returns (received buffers, handles). Sends and
    receives are posted together (batch_isend_irecv), so no rank waits on a neighbour that is
    itself waiting (and NCCL cannot deadlock on them)."""
    n, r = dist.get_world_size(group), dist.get_rank(group)
    right = dist.get_global_rank(group, (r + 1) % n) if group is not None else (r + 1) % n
    left = dist.get_global_rank(group, (r - 1) % n) if group is not None else (r - 1) % n
    received = [torch.empty(t.shape if length is None else _with_length(t, length),
                            dtype=t.dtype, device=t.device) for t in tensors]
    if any(t.device.type == "meta" for t in tensors):
        # Full-size emulation: the emulator charges each message and moves nothing, and torch's
        # batch_isend_irecv looks for a backend of the meta device (there is none); posting them
        # one by one is the same pair of transfers on the emulated links.
        return received, ([dist.isend(t, right, group) for t in tensors]
                          + [dist.irecv(b, left, group) for b in received])
    ops = [dist.P2POp(dist.isend, t.contiguous(), right, group) for t in tensors] + \
          [dist.P2POp(dist.irecv, b, left, group) for b in received]
    return received, dist.batch_isend_irecv(ops)


def _wait(handles):
    for h in handles:
        h.wait()


def _pad_tokens(x, length):
    """x with its token axis (the second last; the only one of positions) zero-padded to `length`."""
    pad = length - x.shape[-2 if x.dim() > 1 else -1]
    return torch.nn.functional.pad(x, (0, 0, 0, pad) if x.dim() > 1 else (0, pad))


def _gather_tokens(x, lengths, group):
    """Every rank's block of x, joined along the token axis. all_gather and reduce_scatter need
    equal sizes, so blocks travel padded to the longest and are cut back to their length."""
    longest = max(lengths)
    parts = [torch.empty(_with_length(x, longest), dtype=x.dtype, device=x.device)
             for _ in lengths]
    dist.all_gather(parts, _pad_tokens(x, longest).contiguous(), group=group)
    return torch.cat([p.narrow(x.dim() - 2 if x.dim() > 1 else 0, 0, n)
                      for p, n in zip(parts, lengths)], dim=-2 if x.dim() > 1 else 0)


def _all_positions(positions, group):
    """Every rank's positions (collective: one all-gather of the block lengths, one of the
    positions). Blocks may differ (7 tokens on 3 ranks: 3, 2, 2), and a receive buffer must be
    the size of the block that arrives, not of this rank's own: gloo aborts the process on a
    mismatch, NCCL would hang or return garbage. Real implementations know their layout and
    skip this; here it keeps the functions correct for any positions."""
    lengths = _block_lengths(positions, group)
    gathered = _gather_tokens(positions.to(torch.int64), lengths, group)
    return list(gathered.split(lengths))


def _positions_for(q, positions):
    """Positions where the collectives can move them: on q's device (NCCL moves GPU tensors
    only), except for meta q (full-size emulation), whose positions stay real integers."""
    return positions if q.device.type == "meta" else positions.to(q.device)
