"""All-gather K/V attention: every rank gathers every block's keys and values, then attends
locally (Llama 3's choice under grouped-query attention and packed documents)."""
import math

import torch
import torch.distributed as dist

from .blocks import _add_rows, _as_q_heads, _check_block, _grads, block_attention
from .exchange import _all_positions, _gather_tokens, _pad_tokens, _positions_for
from .plan import block_plan


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
    _check_block(q, k, v, positions, documents)
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
    sees at least itself, so no row is empty. Under grouped-query attention k and v have fewer
    heads than q: each is widened to q's heads here, after the gather, so the all-gather carries
    the small K/V and autograd sums each K/V head's gradient over the query heads it served."""
    k, v = _as_q_heads(q, (k, v))
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
