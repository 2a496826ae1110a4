"""One block of attention (the kernels a plan calls), merging partial attentions by their
log-sum-exp, and a piece's gradient from the final output: what ring and all-gather attention
both run on the block in hand."""
import math

import torch

from .. import _argcheck as check
from .plan import DIAGONAL, FULL, PARTIAL, block_plan


def _scores(q, k, q_pos, k_pos, causal, scale):
    s = (q @ k.transpose(-2, -1)) * scale
    if causal:
        mask = (k_pos[None, :] > q_pos[:, None]).to(s.device)
        s = s.masked_fill(mask, float("-inf"))
    return s


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
    _check_pair(q, k, v, q_pos, k_pos)
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
    _check_merge(out_a, lse_a, out_b, lse_b)
    lse = torch.logaddexp(lse_a, lse_b)
    safe = torch.where(torch.isinf(lse), 0.0, lse)
    wa = torch.exp(lse_a - safe).unsqueeze(-1)
    wb = torch.exp(lse_b - safe).unsqueeze(-1)
    return out_a * wa + out_b * wb, lse


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


def dense_attention(q, k, v, causal=False):
    """The single-process reference over the whole sequence."""
    check.floating(q, "q")
    if not q.shape == k.shape == v.shape or q.dim() < 2:
        raise ValueError(f"dense_attention takes q, k and v of one shape (batch, heads, tokens, "
                         f"head_dim); got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}.")
    pos = torch.arange(q.shape[-2], dtype=torch.float64)
    s = _scores(q, k, pos, pos, causal, 1.0 / math.sqrt(q.shape[-1]))
    return torch.softmax(s, dim=-1) @ v


def _check_block(q, k, v, positions, documents=None):
    check.floating(q, "q")
    check.integers(positions, "positions")
    if documents is not None:
        check.integers(documents, "documents (one document id per token)")
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


def _check_pair(q, k, v, q_pos, k_pos):
    """A block of queries against a block of keys: each side's tokens may differ in number."""
    check.floating(q, "q")
    if (q.dim() != 4 or k.dim() != 4 or k.shape != v.shape or k.shape[0] != q.shape[0]
            or k.shape[-1] != q.shape[-1] or k.shape[1] == 0 or q.shape[1] % k.shape[1]):
        raise ValueError(f"q, k and v must be (batch, heads, tokens, head_dim) blocks with one "
                         f"batch and head_dim, k and v of one shape with heads that divide q's; "
                         f"got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}.")
    for name, pos, x in (("q_pos", q_pos, q), ("k_pos", k_pos, k)):
        if check.integers(pos, name).shape != (x.shape[-2],):
            raise ValueError(f"{name} must give one global index per token of its block "
                             f"({x.shape[-2]}); got shape {tuple(pos.shape)}.")


def _check_merge(out_a, lse_a, out_b, lse_b):
    # broadcasting would merge mismatched partials without a word
    if out_a.shape != out_b.shape or not lse_a.shape == lse_b.shape == out_a.shape[:-1]:
        raise ValueError(f"merge takes two partial attentions of the same queries: outputs of "
                         f"one shape, each lse the output's shape without head_dim "
                         f"{tuple(out_a.shape[:-1])}; got outputs {tuple(out_a.shape)}, "
                         f"{tuple(out_b.shape)} and lse {tuple(lse_a.shape)}, "
                         f"{tuple(lse_b.shape)}.")
