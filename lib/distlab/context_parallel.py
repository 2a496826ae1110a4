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
                     when K/V are small next to Q (grouped-query attention), as in Llama 3;
                     `documents=` masks packed sequences block-diagonally (Llama 3's other
                     reason to gather).
- all-to-all between tokens and heads (DeepSpeed-Ulysses): in `distlab.ulysses`.

Causal attention makes blocks unequal: with contiguous blocks, rank 0's queries see only their
own block while the last rank's see everything. `zigzag_positions` gives rank r the chunks r and
2N−1−r of 2N, so every rank does the same work; `striped_positions` gives it every N-th token
(striped attention), equal up to one diagonal per step. The mask is built from positions (key position
≤ query position), whatever the layout: `block_plan` cuts a block into runs of consecutive
positions, skips the pairs of runs the mask hides entirely, runs a block against itself as one
causal flash kernel (half the work) and the rest as full kernels — so the work, and the emulated
time, is what the layout gives each rank.

Tensors are (batch, heads, tokens, head_dim); `positions` are the global token indices of the
rank's block (real integers, also when q, k and v are meta tensors for full-size emulation).
Blocks may hold different numbers of tokens (7 tokens on 3 ranks: 3, 2, 2): two small
all-gathers at the start (block lengths, then positions) size every buffer a block arrives in
and tell every rank which tokens each block holds.

At the end, closed forms for full size: one ring step's kernel and hop (`ring_step_seconds`)
and the block length above which the hop hides (`overlap_condition`, `overlap_block_length`).
The ways to fit a long sequence — context parallelism, recompute, TP+SP — are priced by the
planner (`distlab.layout.price` with `cp=`, `checkpointing=`, `sequence_parallel=`), not here.
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


def striped_positions(seq_len, rank, world_size):
    """Rank r holds tokens r, r + N, r + 2N, ... (striped attention, Brandon et al. 2023): every
    rank's block spreads over the whole sequence, so causal work is equal up to one diagonal."""
    _check_divides(seq_len, world_size, "striped")
    return torch.arange(rank, seq_len, world_size)


def causal_work(positions_per_rank):
    """Query-key pairs each rank computes under a causal mask (the load each layout gives)."""
    total = torch.cat(positions_per_rank)
    return [int(sum((total <= p).sum() for p in pos)) for pos in positions_per_rank]


# ---- one block of attention, and merging blocks ----------------------------------------------------

def _scores(q, k, q_pos, k_pos, causal, scale):
    s = (q @ k.transpose(-2, -1)) * scale
    if causal:
        mask = (k_pos[None, :] > q_pos[:, None]).to(s.device)
        s = s.masked_fill(mask, float("-inf"))
    return s


def _runs(positions):
    """The block's runs of consecutive positions, as (first token, end token, first position):
    a contiguous block is one run, a zig-zag block two. Worked out on the host (numpy), once per
    call: a real implementation knows its layout and launches no kernel for this."""
    if positions.device.type == "meta":
        raise ValueError("positions must be real integers even when q, k and v are meta "
                         "tensors: the mask (which blocks to compute, skip or halve) is built "
                         "from them.")
    p = positions.detach().cpu().numpy().astype("int64")
    runs, start = [], 0
    for i in range(1, len(p) + 1):
        if i == len(p) or p[i] != p[i - 1] + 1:
            runs.append((start, i, int(p[start])))
            start = i
    return tuple(runs)


def _bounds(runs):
    """The positions where runs begin and where they end (one past their last)."""
    return sorted({f for _, _, f in runs} | {f + b - a for a, b, f in runs})


def _cut(runs, points):
    """`runs` split at the given positions."""
    out = []
    for a, b, f in runs:
        inside = [p for p in points if f < p < f + b - a]
        for lo, hi in zip([f] + inside, inside + [f + b - a]):
            out.append((a + lo - f, a + hi - f, lo))
    return tuple(out)


# What a (query run, key run) pair needs under a causal mask, from positions alone:
FULL, SKIP, DIAGONAL, PARTIAL = "full", "skip", "diagonal", "partial"


def _pair(qrun, krun, causal):
    """FULL: every key precedes every query; SKIP: every key follows every query (fully masked,
    nothing to compute); DIAGONAL: the same tokens on both sides (a square causal block: half
    the work); PARTIAL: anything else (an explicit mask)."""
    if not causal:
        return FULL
    (qa, qb, qf), (ka, kb, kf) = qrun, krun
    q_last, k_last = qf + qb - qa - 1, kf + kb - ka - 1
    if k_last <= qf:
        return FULL
    if kf > q_last:
        return SKIP
    if kf == qf and kb - ka == qb - qa:
        return DIAGONAL
    return PARTIAL


def block_plan(q_pos, k_pos, causal):
    """What attention of a block of queries over a block of keys computes: a list of
    (query rows, [(key columns, kind), ...]) with kind FULL or DIAGONAL (flash kernels, causal
    when DIAGONAL) or PARTIAL (a masked kernel); fully masked pairs are left out, and query rows
    that see no key of the block are not listed. Adjacent query runs that see the same keys
    share one kernel, and so do adjacent key runs they see in full."""
    stripes = _stripes(q_pos, k_pos) if causal else None
    if stripes is not None:
        return stripes
    qruns, kruns = _runs(q_pos), _runs(k_pos)
    if causal and qruns and qruns == kruns and all(a[2] < b[2] for a, b in zip(qruns, qruns[1:])):
        # A block against itself, positions increasing: key j is visible to query i exactly when
        # j ≤ i, one causal kernel (a zig-zag block's two chunks in one, its work c²/2 as theirs)
        n = qruns[-1][1]
        return [((0, n), [((0, n), DIAGONAL)])]
    if causal:
        # cut each side's runs where the other side's runs begin and end: every pair of pieces
        # then covers the same positions (DIAGONAL) or disjoint ones (FULL or SKIP), and none
        # needs an explicit mask (all-gather's joined K: chunks 3 and 4 of zig-zag are one run)
        qruns, kruns = _cut(qruns, _bounds(kruns)), _cut(kruns, _bounds(qruns))
    rows = []
    for qrun in qruns:
        kinds = tuple(_pair(qrun, krun, causal) for krun in kruns)
        if rows and rows[-1][1] == kinds and DIAGONAL not in kinds and PARTIAL not in kinds:
            rows[-1][0][1] = qrun[1]                     # extend the previous row group
        else:
            rows.append(([qrun[0], qrun[1]], kinds))
    plan = []
    for (qa, qb), kinds in rows:
        pieces = []
        for (ka, kb, _), kind in zip(kruns, kinds):
            if kind == SKIP:
                continue
            if kind == FULL and pieces and pieces[-1][1] == FULL and pieces[-1][0][1] == ka:
                pieces[-1] = ((pieces[-1][0][0], kb), FULL)
            else:
                pieces.append(((ka, kb), kind))
        if pieces:
            plan.append(((qa, qb), pieces))
    return plan


def _stripes(q_pos, k_pos):
    """The plan of two striped blocks (stride N, offsets below N, as many keys as queries), or
    None. Query i (position i·N + a) sees key j (j·N + b) when j ≤ i if b ≤ a: one causal
    kernel; when j < i if b > a: one causal kernel of queries 1.. against keys ..c−1."""
    if q_pos.device.type == "meta" or len(q_pos) < 2 or len(q_pos) != len(k_pos):
        return None
    q, k = q_pos.detach().cpu().numpy(), k_pos.detach().cpu().numpy()
    stride = int(q[1] - q[0])
    if stride < 2 or not all(((x[1:] - x[:-1]) == stride).all() and 0 <= x[0] < stride
                             for x in (q, k)):
        return None
    c = len(q)
    if k[0] <= q[0]:
        return [((0, c), [((0, c), DIAGONAL)])]
    return [((1, c), [((0, c - 1), DIAGONAL)])]


def _rows(x, span):
    a, b = span
    return x[..., a:b, :] if x.dim() == 4 else x[..., a:b]


def _flash(q, k, v, causal, scale):
    """One flash-attention kernel (the CPU's fused kernel, charged as the GPU's under emulation:
    its FLOPs, half when causal, and no s×s scores in memory): (output, log-sum-exp)."""
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q, k, v, 0.0, causal, scale=scale)
    return out, lse


def _masked(q, k, v, q_pos, k_pos, scale, causal=True):
    """Attention with materialised scores, masked by positions when `causal`."""
    s = _scores(q, k, q_pos, k_pos, causal, scale)
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - torch.where(torch.isinf(lse), 0.0, lse).unsqueeze(-1))
    return p @ v, lse


def _cpu_kernel(q):
    """Whether torch's CPU flash kernel takes these tensors (CPU, or meta under emulation). On
    a GPU the pieces run the explicit-mask path instead: correct for every kind of piece."""
    return q.device.type in ("cpu", "meta")


def _piece(q, k, v, q_pos, k_pos, rows, cols, kind, scale):
    qs, ks, vs = _rows(q, rows), _rows(k, cols), _rows(v, cols)
    if kind == PARTIAL or not _cpu_kernel(q):
        return _masked(qs, ks, vs, q_pos[rows[0]:rows[1]].double(),
                       k_pos[cols[0]:cols[1]].double(), scale, causal=kind != FULL)
    return _flash(qs, ks, vs, kind == DIAGONAL, scale)


def _attend_plan(q, k, v, q_pos, k_pos, plan, scale):
    """[(query rows, output, lse)] of the rows the plan touches, each merged over its pieces."""
    done = []
    for rows, pieces in plan:
        out = lse = None
        for cols, kind in pieces:
            o, l = _piece(q, k, v, q_pos, k_pos, rows, cols, kind, scale)
            out, lse = (o, l) if out is None else merge(out, lse, o, l)
        done.append((rows, out, lse))
    return done


def block_attention(q, k, v, q_pos, k_pos, causal, scale):
    """Attention of q against one K/V block: (output, log-sum-exp per query). Rows with every
    key masked give output 0 and log-sum-exp −inf, which merge() treats as 'nothing here'.
    Under a causal mask the block is cut by positions (`block_plan`): key runs entirely after
    a query run are skipped, a run against itself costs half (a causal flash kernel)."""
    plan = block_plan(q_pos, k_pos, causal)
    out = torch.zeros_like(q)
    lse = torch.full(q.shape[:-1], float("-inf"), dtype=_lse_dtype(q), device=q.device)
    if len(plan) == 1 and plan[0][0] == (0, q.shape[-2]):
        (_, o, l), = _attend_plan(q, k, v, q_pos, k_pos, plan, scale)
        return o.to(q.dtype), l            # merged pieces are float32 for 16-bit inputs
    for rows, o, l in _attend_plan(q, k, v, q_pos, k_pos, plan, scale):
        _rows(out, rows).copy_(o)
        _rows(lse, rows).copy_(l)
    return out, lse


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


def _grads(q, k, v, q_pos, k_pos, out, lse, grad_out, rows, cols, kind, scale):
    """Gradients of one plan piece, from the FINAL output and log-sum-exp of these queries
    (FlashAttention-2's backward: P = exp(S − lse), delta = rowsum(dO ∘ O)): (dq of the rows,
    dk and dv of the columns)."""
    qs, ks, vs = _rows(q, rows), _rows(k, cols), _rows(v, cols)
    go, o, l = _rows(grad_out, rows), _rows(out, rows), _rows(lse, rows)
    if kind != PARTIAL and _cpu_kernel(q):
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            go, qs, ks, vs, o, l, 0.0, kind == DIAGONAL, scale=scale)
    s = _scores(qs, ks, q_pos[rows[0]:rows[1]].double(), k_pos[cols[0]:cols[1]].double(),
                kind != FULL, scale)
    p = torch.exp(s - torch.where(torch.isinf(l), 0.0, l).unsqueeze(-1))
    ds = p * (go @ vs.transpose(-2, -1) - (go * o).sum(-1, keepdim=True))
    return (ds @ ks) * scale, (ds.transpose(-2, -1) @ qs) * scale, p.transpose(-2, -1) @ go


def _add_rows(acc, span, x):
    """acc[rows] += x (the whole of acc when the rows are all of it)."""
    if span == (0, acc.shape[-2]):
        return acc.add_(x)
    _rows(acc, span).add_(x)
    return acc


class RingAttention(torch.autograd.Function):
    """Forward: N steps, each attending to the K/V block in hand while the next one travels.
    Backward: the same ring again; dK and dV ride along with their block and arrive home last.

    At step s rank r holds the block of rank r−s (mod N), and receives that of rank r−s−1.
    `positions` (every rank's, gathered once) say which pieces of each block a causal mask
    lets through (`block_plan`): fully masked pieces are skipped, diagonal ones cost half, so
    the work of a step is what the layout gives it — with zig-zag, the same on every rank.
    Under grouped-query attention K and V have fewer heads than Q: the ring carries them (and
    their gradients) that small, and each rank widens the block in hand for its kernels."""

    @staticmethod
    def forward(ctx, q, k, v, positions, causal, group):
        n, r = dist.get_world_size(group), dist.get_rank(group)
        scale = 1.0 / math.sqrt(q.shape[-1])
        lengths = [len(p) for p in positions]
        out = lse = None
        blocks = (k, v)
        for step in range(n):
            owner = (r - step) % n
            pending = (_shift(blocks, group, lengths[(owner - 1) % n]) if step < n - 1
                       else None)                                   # the next block travels
            plan = block_plan(positions[r], positions[owner], causal)
            for rows, o, l in _attend_plan(q, *_as_q_heads(q, blocks), positions[r],
                                           positions[owner], plan, scale):
                if rows == (0, q.shape[-2]):
                    out, lse = (o, l) if out is None else merge(out, lse, o, l)
                else:
                    if out is None:
                        out = torch.zeros_like(q)
                        lse = torch.full(q.shape[:-1], float("-inf"), dtype=_lse_dtype(q),
                                         device=q.device)
                    merged, merged_lse = merge(_rows(out, rows), _rows(lse, rows), o, l)
                    _rows(out, rows).copy_(merged)
                    _rows(lse, rows).copy_(merged_lse)
            if pending is not None:
                blocks, handles = pending
                _wait(handles)
        if out is None:                            # no token on this rank
            out = torch.zeros_like(q)
            lse = torch.full(q.shape[:-1], float("-inf"), dtype=_lse_dtype(q), device=q.device)
        # merging in the log-sum-exp's float32 (16-bit inputs) promotes the running output to
        # it, as real ring kernels accumulate; the result is returned in the inputs' dtype
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.causal, ctx.group, ctx.scale, ctx.positions = causal, group, scale, positions
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse = ctx.saved_tensors
        group, causal, scale, positions = ctx.group, ctx.causal, ctx.scale, ctx.positions
        n, r = dist.get_world_size(group), dist.get_rank(group)
        lengths = [len(p) for p in positions]
        grad_out = grad_out.contiguous()
        dq = torch.zeros_like(q)
        blocks, arriving_grads = (k, v), None
        for step in range(n):
            owner = (r - step) % n
            arriving = lengths[(owner - 1) % n]       # K, V and their gradients alike
            # K and V do not change: they leave for the next rank right away and travel while
            # this rank computes.
            ahead = _shift(blocks, group, arriving) if step < n - 1 else None
            wide = _as_q_heads(q, blocks)
            dk, dv = torch.zeros_like(wide[0]), torch.zeros_like(wide[1])
            plan = block_plan(positions[r], positions[owner], causal)
            for rows, pieces in plan:
                for cols, kind in pieces:
                    gq, gk, gv = _grads(q, *wide, positions[r], positions[owner], out, lse,
                                        grad_out, rows, cols, kind, scale)
                    dq = _add_rows(dq, rows, gq)
                    dk, dv = _add_rows(dk, cols, gk), _add_rows(dv, cols, gv)
            dk, dv = _sum_heads(dk, k.shape[1]), _sum_heads(dv, k.shape[1])
            # The block's gradient so far comes from the left neighbour, sent at its previous
            # step while this step's kernels ran; add this rank's share and pass it on, to be
            # waited for one step later (after N hops it is back with its owner).
            if arriving_grads is not None:
                (dk_in, dv_in), handles = arriving_grads
                _wait(handles)
                dk, dv = dk.add_(dk_in), dv.add_(dv_in)
            arriving_grads = _shift((dk, dv), group, arriving) if n > 1 else ((dk, dv), [])
            if ahead is not None:
                blocks, handles = ahead
                _wait(handles)
        (dk, dv), handles = arriving_grads
        _wait(handles)
        return dq, dk, dv, None, None, None


def _as_q_heads(q, blocks):
    """K/V blocks with q's heads: query head h reads K/V head h // (q heads / K/V heads)."""
    groups = q.shape[1] // blocks[0].shape[1]
    return blocks if groups == 1 else tuple(t.repeat_interleave(groups, dim=1) for t in blocks)


def _sum_heads(grad, kv_heads):
    """A widened K/V block's gradient brought back to its kv_heads: each K/V head's gradient
    is the sum over the query heads it served (repeat_interleave's backward)."""
    b, heads, t, d = grad.shape
    return grad if heads == kv_heads else grad.view(b, kv_heads, heads // kv_heads, t, d).sum(2)


def _lse_dtype(q):
    """Flash kernels keep the log-sum-exp in float32 for 16-bit inputs."""
    return torch.float32 if q.dtype in (torch.bfloat16, torch.float16) else q.dtype


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


def ring_attention(q, k, v, positions, causal=False, group=None):
    """Attention of this rank's queries over the whole sequence, K/V passed around the ring.
    The ranks' blocks may hold different numbers of tokens. q, k and v may be meta tensors
    (full-size emulation); positions are real integers."""
    _check_block(q, k, v, positions)
    return RingAttention.apply(q, k, v, _all_positions(_positions_for(q, positions), group),
                               causal, group)


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


def all_gather_attention(q, k, v, positions, causal=False, group=None, documents=None):
    """Gather every rank's K/V (and positions), then attend locally, skipping what a causal
    mask hides as ring attention does. The ranks' blocks may hold different numbers of tokens.

    documents: the document each token of the block belongs to (packed sequences): a query then
    sees only the keys of its own document (block-diagonal causal with `causal`). Gathered like
    the positions; the mask is explicit (a GPU kernel takes the boundaries instead, as
    FlashAttention's variable-length kernels take cu_seqlens)."""
    _check_block(q, k, v, positions)
    positions = _positions_for(q, positions)
    every = _all_positions(positions, group)
    lengths = [len(p) for p in every]
    k_all = _GatherSequence.apply(k, group, lengths)
    v_all = _GatherSequence.apply(v, group, lengths)
    if documents is not None:
        if documents.shape != positions.shape:
            raise ValueError(f"documents must give one document id per token of the block "
                             f"({len(positions)}); got shape {tuple(documents.shape)}.")
        docs_all = _gather_tokens(_positions_for(q, documents).to(torch.int64), lengths, group)
        return document_attention(q, k_all, v_all, positions, torch.cat(every), documents,
                                  docs_all, causal)
    return _LocalAttention.apply(q, k_all, v_all, positions, torch.cat(every), causal)


def document_attention(q, k, v, q_pos, k_pos, q_docs, k_docs, causal=True):
    """Attention of q over k, v where a query sees only keys of its own document (and, causal,
    not after it): the mask of packed sequences. Plain autograd on explicit scores: every query
    sees at least itself, so no row is empty."""
    s = (q @ k.transpose(-2, -1)) / math.sqrt(q.shape[-1])
    hidden = q_docs.to(s.device)[:, None] != k_docs.to(s.device)[None, :]
    if causal:
        hidden = hidden | (k_pos.to(s.device)[None, :] > q_pos.to(s.device)[:, None])
    return torch.softmax(s.masked_fill(hidden, float("-inf")), dim=-1) @ v


class _LocalAttention(torch.autograd.Function):
    """Attention over keys this rank holds, by `block_plan`'s kernels; backward from the final
    output and log-sum-exp, piece by piece (the flash kernels' own backward has no gradient for
    their log-sum-exp, which merging pieces by autograd would need)."""

    @staticmethod
    def forward(ctx, q, k, v, q_pos, k_pos, causal):
        scale = 1.0 / math.sqrt(q.shape[-1])
        out, lse = block_attention(q, k, v, q_pos, k_pos, causal, scale)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.plan, ctx.scale, ctx.positions = block_plan(q_pos, k_pos, causal), scale, (q_pos, k_pos)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse = ctx.saved_tensors
        grad_out = grad_out.contiguous()
        dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
        for rows, pieces in ctx.plan:
            for cols, kind in pieces:
                gq, gk, gv = _grads(q, k, v, *ctx.positions, out, lse, grad_out, rows, cols,
                                    kind, ctx.scale)
                dq, dk, dv = _add_rows(dq, rows, gq), _add_rows(dk, cols, gk), _add_rows(dv, cols, gv)
        return dq, dk, dv, None, None, None


def dense_attention(q, k, v, causal=False):
    """The single-process reference over the whole sequence."""
    pos = torch.arange(q.shape[-2], dtype=torch.float64)
    s = _scores(q, k, pos, pos, causal, 1.0 / math.sqrt(q.shape[-1]))
    return torch.softmax(s, dim=-1) @ v


def _check_block(q, k, v, positions):
    if (q.dim() != 4 or k.shape != v.shape or k.dim() != 4
            or (k.shape[0], k.shape[2], k.shape[3]) != (q.shape[0], q.shape[2], q.shape[3])
            or k.shape[1] == 0 or q.shape[1] % k.shape[1]):
        raise ValueError(f"q, k and v must be (batch, heads, tokens, head_dim) blocks of one "
                         f"shape, except that k and v may have fewer heads that divide q's "
                         f"(grouped-query attention); got {tuple(q.shape)}, {tuple(k.shape)}, "
                         f"{tuple(v.shape)}.")
    if positions.shape != (q.shape[-2],):
        raise ValueError(f"positions must give one global index per token of the block "
                         f"({q.shape[-2]}); got shape {tuple(positions.shape)}.")


# ---- time at full size (closed forms) ------------------------------------------------------------
#
# The emulator charges ring attention op by op (the flash kernels' FLOPs at the device's achieved
# efficiency, each message at its link's latency and bandwidth); these closed forms charge the same
# formulas for one step, so an emulated ring set beside them checks the code's critical path (does
# the next block really travel while this one is computed?), not the hardware.

def ring_step_seconds(device, link, block_tokens, heads=32, head_dim=128, kv_heads=None,
                      causal=True, dtype=torch.bfloat16):
    """One ring-attention step of one rank (forward): `compute`, the flash kernel of its
    block_tokens queries against one visiting block of as many keys — 4·c²·heads·head_dim FLOPs,
    half under a causal mask with zig-zag blocks (every step is then half a block: Brandon et al.
    2023, striped / zig-zag load balance) — and `hop`, the two messages (K and V, c·kv_heads·
    head_dim values each) that travel meanwhile. `overlap` is True when the hop hides behind the
    kernel (Liu et al. 2023, Ring Attention, §3: block size ≥ FLOPs / bandwidth)."""
    item = torch.empty((), dtype=dtype).element_size()
    kv = kv_heads or heads
    flops = 4.0 * block_tokens ** 2 * heads * head_dim * (0.5 if causal else 1.0)
    io = item * block_tokens * head_dim * (2 * heads + 2 * kv)           # q, out; k, v
    compute = device.seconds(flops, io, dtype, (block_tokens, block_tokens, head_dim, heads))
    hop = 2 * link.seconds("send", item * block_tokens * kv * head_dim, 2)
    return dict(compute=compute, hop=hop, overlap=compute >= hop)


def overlap_condition(peak_flops, bandwidth, heads=32, kv_heads=None, itemsize=2, causal=False):
    """The block length (tokens per rank) above which a ring step's kernel outlasts its hop, from
    peaks alone: 4·f·c²·H·d / P ≥ 2·c·KV·d·item / B  ⇔  c ≥ (P / B)·(KV / H)·(item / 2) / f, with
    f = 1 (f = ½ causal zig-zag). For 16-bit multi-head attention without a mask: c ≥ P / B."""
    kv = kv_heads or heads
    return peak_flops / bandwidth * (kv / heads) * (itemsize / 2) / (0.5 if causal else 1.0)


def overlap_block_length(device, link, heads=32, head_dim=128, kv_heads=None, causal=True,
                         dtype=torch.bfloat16):
    """The smallest block length (tokens per rank) at which `ring_step_seconds` says the hop
    hides behind the kernel on this device and link (achieved rates, latencies included)."""
    def hidden(c):
        return ring_step_seconds(device, link, c, heads, head_dim, kv_heads, causal, dtype)["overlap"]
    lo, hi = 1, 1
    while not hidden(hi):
        lo, hi = hi, hi * 2
        if hi > 2 ** 26:
            raise ValueError(f"{link} never hides behind {device.name}'s attention kernel "
                             f"below 2**26 tokens per rank.")
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if hidden(mid) else (mid, hi)
    return hi


def plan_work(plan):
    """The query-key pairs a plan's kernels compute: rows × columns of each FULL or PARTIAL
    piece, half of a DIAGONAL one (what a causal flash kernel charges)."""
    total = 0.0
    for (qa, qb), pieces in plan:
        for (ka, kb), kind in pieces:
            total += (qb - qa) * (kb - ka) * (0.5 if kind == DIAGONAL else 1.0)
    return total
