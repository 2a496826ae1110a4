"""DeepSpeed-Ulysses: context parallelism by all-to-all between the sequence and the heads.

Jacobs et al. 2023, "DeepSpeed Ulysses: System Optimizations for Enabling Training of Extreme
Long Sequence Transformer Models" (arXiv:2309.14509), §3. Every rank holds a block of the
sequence with ALL heads, as ring attention's ranks do. Attention heads are independent, so:

1. one all-to-all turns "my tokens, all heads" into "all tokens, my heads": rank j receives
   head group j of every rank's block (q, k and v: three all-to-alls);
2. each rank runs ordinary attention over the whole sequence on its H/N heads (nothing to merge:
   every query meets every key of its heads in one kernel);
3. one all-to-all turns the output back into "my tokens, all heads".

The backward is the same all-to-alls in reverse (the gradient of an all-to-all is the inverse
all-to-all). Each rank sends (N−1)/N of its block per all-to-all, so the bytes a rank sends per
layer FALL as N grows (a ring's stay at (N−1) blocks), but the heads are what gets split: the
query heads, and the key/value heads under grouped-query attention, must divide by N. Past that
limit Ulysses alone cannot go (USP, Fang & Zhao 2024, runs a ring between Ulysses groups).

`communication_per_layer` gives the bytes each rank sends per attention layer for Ulysses, the
ring and all-gather K/V, forward and backward (the closed form the chapter prints; the test
compares it with the bytes a traced run sent).
"""
import torch
import torch.distributed as dist

from . import _argcheck as check
from .context_parallel import _LocalAttention, _all_positions, _check_block, _positions_for


def check_heads(heads, kv_heads, cp):
    """Refuse a head count that the cp ranks cannot split, in a sentence naming the limit."""
    cp = check.whole(cp, "cp (the context-parallel size)", at_least=1)
    heads = check.whole(heads, "heads", at_least=1)
    kv_heads = check.whole(kv_heads, "kv_heads (key/value heads)", at_least=1)
    for name, n in (("query heads", heads), ("key/value heads", kv_heads)):
        if n % cp:
            limit = max(d for d in range(1, n + 1) if n % d == 0 and d <= cp)
            raise ValueError(
                f"Ulysses splits the heads over the context-parallel ranks, and {n} {name} do "
                f"not split over cp = {cp}: the head count limits Ulysses to a cp that divides "
                f"it (at most {n}; here {limit} would do). Use ring or all-gather attention, "
                f"or Ulysses inside groups of {limit} with a ring between them (USP).")


def _flat_splits(pieces):
    return torch.cat([p.reshape(-1) for p in pieces]), [p.numel() for p in pieces]


def _all_to_all(send_pieces, receive_shapes, group):
    """Rank i's piece j goes to rank j; returns the pieces received, one per rank, shaped."""
    flat, in_splits = _flat_splits(send_pieces)
    out_splits = [int(torch.Size(s).numel()) for s in receive_shapes]
    out = torch.empty(sum(out_splits), dtype=flat.dtype, device=flat.device)
    dist.all_to_all_single(out, flat, out_splits, in_splits, group=group)
    return [p.view(s) for p, s in zip(out.split(out_splits), receive_shapes)]


def _seq_to_heads(x, lengths, group):
    """(b, H, my tokens, d) -> (b, H/N, all tokens, d): head group j of my block to rank j."""
    n = len(lengths)
    b, h, _, d = x.shape
    pieces = [p.contiguous() for p in x.chunk(n, dim=1)]
    received = _all_to_all(pieces, [(b, h // n, c, d) for c in lengths], group)
    return torch.cat(received, dim=-2)


def _heads_to_seq(y, lengths, group):
    """(b, H/N, all tokens, d) -> (b, H, my tokens, d): rank i's tokens of my heads to rank i."""
    n, r = len(lengths), dist.get_rank(group)
    b, hn, _, d = y.shape
    pieces = [p.contiguous() for p in y.split(lengths, dim=-2)]
    received = _all_to_all(pieces, [(b, hn, lengths[r], d)] * n, group)
    return torch.cat(received, dim=1)


class SequenceToHeads(torch.autograd.Function):
    """Forward: all-to-all from sequence-sharded to head-sharded. Backward: the inverse."""

    @staticmethod
    def forward(ctx, x, lengths, group):
        ctx.lengths, ctx.group = lengths, group
        return _seq_to_heads(x, lengths, group)

    @staticmethod
    def backward(ctx, grad):
        return _heads_to_seq(grad.contiguous(), ctx.lengths, ctx.group), None, None


class HeadsToSequence(torch.autograd.Function):
    """Forward: all-to-all from head-sharded back to sequence-sharded. Backward: the inverse."""

    @staticmethod
    def forward(ctx, y, lengths, group):
        ctx.lengths, ctx.group = lengths, group
        return _heads_to_seq(y, lengths, group)

    @staticmethod
    def backward(ctx, grad):
        return _seq_to_heads(grad.contiguous(), ctx.lengths, ctx.group), None, None


def ulysses_attention(q, k, v, positions, causal=False, group=None):
    """Attention of this rank's tokens over the whole sequence, by two all-to-alls.

    q: (batch, heads, my tokens, head_dim); k, v: (batch, kv_heads, my tokens, head_dim), with
    kv_heads dividing heads (grouped-query attention). Both head counts must divide by cp."""
    n = dist.get_world_size(group)
    if q.dim() != 4 or k.shape != v.shape or k.shape[::2] != q.shape[::2] \
            or k.shape[-1] != q.shape[-1] or q.shape[1] % k.shape[1]:
        raise ValueError(f"q must be (batch, heads, tokens, head_dim) and k, v (batch, kv_heads, "
                         f"tokens, head_dim) with kv_heads dividing heads; got {tuple(q.shape)}, "
                         f"{tuple(k.shape)}, {tuple(v.shape)}.")
    _check_block(q, k, v, positions)
    check_heads(q.shape[1], k.shape[1], n)
    every = _all_positions(_positions_for(q, positions), group)
    lengths = [len(p) for p in every]
    q_h, k_h, v_h = (SequenceToHeads.apply(t, lengths, group) for t in (q, k, v))
    if k_h.shape[1] != q_h.shape[1]:
        # grouped-query attention: head group j of q uses key/value head group j; repeated
        # here, after the all-to-all, so that only the kv_heads travel
        k_h, v_h = (t.repeat_interleave(q_h.shape[1] // t.shape[1], dim=1) for t in (k_h, v_h))
    every = torch.cat(every)
    out = _LocalAttention.apply(q_h, k_h, v_h, every, every, causal)
    return HeadsToSequence.apply(out, lengths, group)


def communication_per_layer(method, seq_len, cp, heads, kv_heads=None, head_dim=128,
                            itemsize=2, batch=1):
    """Bytes ONE rank sends to others in one attention layer, as (forward, backward), with
    blocks of seq_len / cp tokens. `block(h)` is one rank's block of one tensor with h heads.

    - "ulysses": forward the all-to-alls of q, k, v and of the output, each sending (N−1)/N of
      its block; backward the inverse all-to-alls of dO (to heads) and dq, dk, dv (back).
    - "ring": forward N−1 hops of K and V; backward N−1 hops of K and V again and N hops of
      their gradients (home), as `context_parallel.RingAttention` does.
    - "all-gather": forward all-gather of K and V (each rank's block reaches N−1 others; a ring
      all-gather sends N−1 blocks per rank); backward reduce-scatter of dK and dV (the same).
    """
    _check_layer(seq_len, cp, heads, kv_heads, head_dim, itemsize, batch)
    kv = kv_heads or heads
    n = cp

    def block(h):
        return batch * h * (seq_len // cp) * head_dim * itemsize
    if method == "ulysses":
        share = (n - 1) / n
        return share * (2 * block(heads) + 2 * block(kv)), share * (2 * block(heads) + 2 * block(kv))
    if method == "ring":
        return (n - 1) * 2 * block(kv), (n - 1) * 2 * block(kv) + (n if n > 1 else 0) * 2 * block(kv)
    if method == "all-gather":
        return (n - 1) * 2 * block(kv), (n - 1) * 2 * block(kv)
    raise ValueError(f"unknown method {method!r}: 'ulysses', 'ring' or 'all-gather'.")


def _check_layer(seq_len, cp, heads, kv_heads, head_dim, itemsize, batch):
    # the closed form floors seq_len / cp: a length the ranks cannot split would be priced wrong
    cp = check.whole(cp, "cp (the context-parallel size)", at_least=1)
    seq_len = check.whole(seq_len, "seq_len", at_least=1)
    for name, n in (("head_dim", head_dim), ("batch", batch), ("itemsize", itemsize)):
        check.whole(n, name, at_least=1)
    if seq_len % cp:
        raise ValueError(f"a sequence of {seq_len} tokens does not split into equal blocks over "
                         f"cp = {cp} ranks: pad it to a multiple of {cp} or choose another cp.")
    # heads that cp does not divide are priced all the same (check_heads says Ulysses refuses
    # them; the chapter prices the bytes beside the refusal)
    if kv_heads is not None and check.whole(heads, "heads", at_least=1) % check.whole(
            kv_heads, "kv_heads", at_least=1):
        raise ValueError(f"kv_heads = {kv_heads} must divide heads = {heads}.")
