"""Context parallelism: attention over a sequence split across ranks.

Every rank holds a block of the sequence: its queries, keys and values. Attention needs every
query to meet every key, so the key/value blocks must travel:

- ring attention:    the K/V blocks go around the ring with point-to-point messages, one hop per
                     step, while each rank computes attention of its queries against the block it
                     holds. Partial results are merged with the online softmax (running
                     log-sum-exp), so no rank ever holds the whole sequence's scores or K/V.
                     The backward pass goes around the ring again, carrying each block's
                     gradient with it until it is back home (a custom autograd Function: nothing
                     but the rank's own block and the final log-sum-exp is kept for backward).
- all-gather K/V:    every rank gathers all keys and values (one all_gather), then attends
                     locally; the backward reduce-scatters their gradients. Simple, and cheap
                     when K/V are small next to Q (grouped-query attention), as in Llama 3.

Causal attention makes blocks unequal: with contiguous blocks, rank 0's queries see only their
own block while the last rank's see everything. `zigzag_positions` gives rank r the chunks r and
2N−1−r of 2N, so every rank does the same work. Positions travel with their blocks, and the mask
is built from them (key position ≤ query position), whatever the layout.

Tensors are (batch, heads, tokens, head_dim); `positions` are the global token indices of the
rank's block. Blocks may hold different numbers of tokens (7 tokens on 3 ranks: 3, 2, 2): one
all-gather of the block lengths (an integer per rank) sizes every buffer a block arrives in.
"""
import math

import torch
import torch.distributed as dist


# ---- which tokens a rank holds ---------------------------------------------------------------------

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


def causal_work(positions_per_rank):
    """Query-key pairs each rank computes under a causal mask (the load each layout gives)."""
    total = torch.cat(positions_per_rank)
    return [int(sum((total <= p).sum() for p in pos)) for pos in positions_per_rank]


# ---- one block of attention, and merging blocks ----------------------------------------------------

def _scores(q, k, q_pos, k_pos, causal, scale):
    s = (q @ k.transpose(-2, -1)) * scale
    if causal:
        s = s.masked_fill(k_pos[None, :] > q_pos[:, None], float("-inf"))
    return s


def block_attention(q, k, v, q_pos, k_pos, causal, scale):
    """Attention of q against one K/V block: (output, log-sum-exp per query). Rows with every
    key masked give output 0 and log-sum-exp −inf, which merge() treats as 'nothing here'."""
    s = _scores(q, k, q_pos, k_pos, causal, scale)
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - torch.where(torch.isinf(lse), 0.0, lse).unsqueeze(-1))
    return p @ v, lse


def merge(out_a, lse_a, out_b, lse_b):
    """Combine two partial attentions of the same queries over disjoint keys (online softmax):
    each is weighted by its share exp(lse_x − lse) of the total softmax mass."""
    lse = torch.logaddexp(lse_a, lse_b)
    safe = torch.where(torch.isinf(lse), 0.0, lse)
    wa = torch.exp(lse_a - safe).unsqueeze(-1)
    wb = torch.exp(lse_b - safe).unsqueeze(-1)
    return out_a * wa + out_b * wb, lse


# ---- moving blocks one hop around the ring ---------------------------------------------------------

def _block_lengths(q, group):
    """Every rank's number of tokens (collective). Blocks may differ (7 tokens on 3 ranks:
    3, 2, 2), and a receive buffer must be the size of the block that arrives, not of this
    rank's own: gloo aborts the process on a mismatch, NCCL would hang or return garbage."""
    mine = torch.tensor([q.shape[-2]], device=q.device)
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
    ops = [dist.P2POp(dist.isend, t.contiguous(), right, group) for t in tensors] + \
          [dist.P2POp(dist.irecv, b, left, group) for b in received]
    return received, dist.batch_isend_irecv(ops)


def _wait(handles):
    for h in handles:
        h.wait()


class RingAttention(torch.autograd.Function):
    """Forward: N steps, each attending to the K/V block in hand while the next one travels.
    Backward: the same ring again; dK and dV ride along with their block and arrive home last.

    At step s rank r holds the block of rank r−s (mod N), and receives that of rank r−s−1:
    `lengths` (every rank's block length) sizes each receive for the block that arrives."""

    @staticmethod
    def forward(ctx, q, k, v, q_pos, k_pos, causal, group, lengths):
        n, r = dist.get_world_size(group), dist.get_rank(group)
        scale = 1.0 / math.sqrt(q.shape[-1])
        out = torch.zeros_like(q)
        lse = torch.full(q.shape[:-1], float("-inf"), dtype=q.dtype, device=q.device)
        blocks = (k, v, k_pos.to(q.device, torch.float64))
        for step in range(n):
            arriving = lengths[(r - step - 1) % n]
            pending = _shift(blocks, group, arriving) if step < n - 1 else None   # next block travels
            bk, bv, bpos = blocks
            block_out, block_lse = block_attention(q, bk, bv, q_pos, bpos, causal, scale)
            out, lse = merge(out, lse, block_out, block_lse)
            if pending is not None:
                blocks, handles = pending
                _wait(handles)
        ctx.save_for_backward(q, k, v, q_pos, k_pos, out, lse)
        ctx.causal, ctx.group, ctx.scale, ctx.lengths = causal, group, scale, lengths
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, q_pos, k_pos, out, lse = ctx.saved_tensors
        group, causal, scale, lengths = ctx.group, ctx.causal, ctx.scale, ctx.lengths
        n, r = dist.get_world_size(group), dist.get_rank(group)
        delta = (grad_out * out).sum(-1, keepdim=True)          # rowsum(dO ∘ O)
        safe_lse = torch.where(torch.isinf(lse), 0.0, lse).unsqueeze(-1)
        dq = torch.zeros_like(q)
        blocks = (k, v, k_pos.to(q.device, torch.float64), torch.zeros_like(k),
                  torch.zeros_like(v))
        for step in range(n):
            bk, bv, bpos, dk, dv = blocks
            arriving = lengths[(r - step - 1) % n]      # K, V and their gradients alike
            # K, V and positions do not change: they leave for the next rank right away, and
            # travel while this rank computes; their gradients follow once computed.
            ahead = _shift((bk, bv, bpos), group, arriving) if step < n - 1 else None
            p = torch.exp(_scores(q, bk, q_pos, bpos, causal, scale) - safe_lse)
            dv = dv + p.transpose(-2, -1) @ grad_out
            ds = p * (grad_out @ bv.transpose(-2, -1) - delta)
            dq = dq + (ds @ bk) * scale
            dk = dk + (ds.transpose(-2, -1) @ q) * scale
            # After N hops a block's gradients are back with the rank that owns it.
            if n > 1:
                (dk, dv), handles = _shift((dk, dv), group, arriving)
                _wait(handles)
            if ahead is not None:
                (bk, bv, bpos), handles = ahead
                _wait(handles)
            blocks = (bk, bv, bpos, dk, dv)
        return dq, blocks[3], blocks[4], None, None, None, None, None


def ring_attention(q, k, v, positions, causal=False, group=None):
    """Attention of this rank's queries over the whole sequence, K/V passed around the ring.
    The ranks' blocks may hold different numbers of tokens."""
    _check_block(q, k, v, positions)
    return RingAttention.apply(q, k, v, positions.to(torch.float64), positions, causal, group,
                               _block_lengths(q, group))


# ---- all-gather K/V --------------------------------------------------------------------------------

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


class _GatherSequence(torch.autograd.Function):
    """Forward: all_gather blocks along the token axis. Backward: reduce-scatter the gradient,
    since every rank's queries contributed to every key's gradient."""

    @staticmethod
    def forward(ctx, x, group, lengths):
        ctx.group, ctx.lengths = group, lengths
        return _gather_tokens(x, lengths, group)

    @staticmethod
    def backward(ctx, grad):
        lengths, longest = ctx.lengths, max(ctx.lengths)
        parts = [_pad_tokens(p, longest).contiguous() for p in grad.split(lengths, dim=-2)]
        out = torch.empty_like(parts[0])
        dist.reduce_scatter(out, parts, group=ctx.group)
        return out[..., :lengths[dist.get_rank(ctx.group)], :], None, None


def all_gather_attention(q, k, v, positions, causal=False, group=None):
    """Gather every rank's K/V (and positions), then attend locally. The ranks' blocks may hold
    different numbers of tokens."""
    _check_block(q, k, v, positions)
    lengths = _block_lengths(q, group)
    all_pos = _gather_tokens(positions, lengths, group)
    k_all = _GatherSequence.apply(k, group, lengths)
    v_all = _GatherSequence.apply(v, group, lengths)
    scale = 1.0 / math.sqrt(q.shape[-1])
    s = _scores(q, k_all, positions.to(torch.float64), all_pos.to(torch.float64), causal, scale)
    return torch.softmax(s, dim=-1) @ v_all


def dense_attention(q, k, v, causal=False):
    """The single-process reference over the whole sequence."""
    pos = torch.arange(q.shape[-2], dtype=torch.float64)
    s = _scores(q, k, pos, pos, causal, 1.0 / math.sqrt(q.shape[-1]))
    return torch.softmax(s, dim=-1) @ v


def _check_block(q, k, v, positions):
    if q.dim() != 4 or k.shape != q.shape or v.shape != q.shape:
        raise ValueError(f"q, k and v must be (batch, heads, tokens, head_dim) blocks of one "
                         f"shape; got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}.")
    if positions.shape != (q.shape[-2],):
        raise ValueError(f"positions must give one global index per token of the block "
                         f"({q.shape[-2]}); got shape {tuple(positions.shape)}.")
