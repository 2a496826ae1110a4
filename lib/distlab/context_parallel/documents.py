"""Ring attention over packed sequences: several documents in one sequence, each token attending
only to its own document (and, causal, only to its earlier tokens). Production long-context
training packs documents this way; FlashAttention's variable-length kernels take the boundaries
as cu_seqlens, TransformerEngine's THD layout the same.

The ring is chapter 12's `RingAttention` itself, given another planner: the plan of each ring
step comes from positions AND document ids (`document_plan`). A visiting block that shares no
document with this rank's queries (or only keys after them) is skipped whole — it still travels
on, since the next rank may need it — and a block that shares some is cut into pieces of one
document each, so every piece is again FULL, DIAGONAL or SKIP and runs on the flash kernels as
before.

`log=` (a list) receives one `RingStep` per forward step: which block, whether it was skipped,
computed in full or masked, and the query-key pairs its kernels charged (a DIAGONAL piece half).
The backward runs the same plans. `document_zigzag_positions` is the per-document zig-zag
(TransformerEngine's `thd_get_partitioned_indices`, torch's `_PerDocumentHeadTailLoadBalancer`):
every rank holds chunks r and 2N−1−r of EVERY document."""
import torch

from .. import _argcheck as check
from .blocks import _check_block
from .exchange import _all_positions, _gather_tokens, _positions_for
from .layouts import _check_layout
from .plan import SKIP, _bounds, _cut, _join, _pair
from .ring import RingAttention, RingStep, _check_log  # noqa: F401  (RingStep: its log's entries)


def _document_runs(positions, documents):
    """The block's runs of consecutive positions inside one document, as
    ((first token, end token, first position), document)."""
    for name, t in (("positions", positions), ("documents", documents)):
        if t.device.type == "meta":
            raise ValueError(f"{name} must be real integers even when q, k and v are meta "
                             f"tensors: the mask (which blocks to compute or skip) is built "
                             f"from them.")
    p = positions.detach().cpu().long().tolist()
    d = documents.detach().cpu().long().tolist()
    runs, start = [], 0
    for i in range(1, len(p) + 1):
        if i == len(p) or p[i] != p[i - 1] + 1 or d[i] != d[i - 1]:
            runs.append(((start, i, p[start]), d[start]))
            start = i
    return runs


def _cut_runs(runs, points):
    """Each run split where the other side's runs begin and end, keeping its document."""
    return [(piece, doc) for run, doc in runs for piece in _cut((run,), points)]


def document_plan(q_pos, k_pos, q_docs, k_docs, causal=True):
    """`block_plan` under a document mask: (query rows, [(key columns, kind), ...]) with kind
    FULL or DIAGONAL; a pair of pieces from different documents is skipped like a causally
    hidden one, so an empty plan means the whole block is skipped. Every piece lies inside one
    document on both sides, so the kernels need no document mask of their own."""
    for name, t in (("q_pos", q_pos), ("k_pos", k_pos), ("q_docs", q_docs), ("k_docs", k_docs)):
        check.integers(t, name)
    if q_docs.shape != q_pos.shape or k_docs.shape != k_pos.shape:
        raise ValueError(f"documents must give one document id per token: q_docs "
                         f"{tuple(q_docs.shape)} for q_pos {tuple(q_pos.shape)}, k_docs "
                         f"{tuple(k_docs.shape)} for k_pos {tuple(k_pos.shape)}.")
    qruns, kruns = _document_runs(q_pos, q_docs), _document_runs(k_pos, k_docs)
    if causal:      # cut so that two pieces hold the same positions or disjoint ones
        qruns = _cut_runs(qruns, _bounds([r for r, _ in kruns]))
        kruns = _cut_runs(kruns, _bounds([r for r, _ in qruns]))
    rows = [(qrun, tuple(_pair(qrun, krun, causal) if kdoc == qdoc else SKIP
                         for krun, kdoc in kruns)) for qrun, qdoc in qruns]
    return _join(rows, [krun for krun, _ in kruns])


# Chapter 12's ring, each step planned by `document_plan`: one Function for every mask.
DocumentRingAttention = RingAttention


def document_ring_attention(q, k, v, positions, documents, causal=True, group=None, log=None):
    """Ring attention where a query sees only keys of its own document (packed sequences):
    `documents` gives the document id of each token of this rank's block. Blocks may hold
    different numbers of tokens; K and V may have fewer heads than Q. `log`, a list, receives
    a `RingStep` per forward step."""
    _check_block(q, k, v, positions, documents)
    if documents.shape != positions.shape:
        raise ValueError(f"documents must give one document id per token of the block "
                         f"({len(positions)}); got shape {tuple(documents.shape)}.")
    _check_log(log)
    every = _all_positions(_positions_for(q, positions), group)
    docs = _gather_tokens(_positions_for(q, documents).to(torch.int64), [len(p) for p in every],
                          group).split([len(p) for p in every])

    def plan(mine, owner):   # a block sharing no document with these queries: an empty plan
        return document_plan(every[mine], every[owner], docs[mine], docs[owner], causal)

    return RingAttention.apply(q, k, v, every, plan, group, log)


def document_zigzag_positions(documents, rank, world_size):
    """Per-document zig-zag: every document (a run of equal ids in `documents`, the whole
    sequence's) is cut into 2N chunks and rank r holds chunks r and 2N−1−r of each, so every
    rank does the same causal work whatever the documents' lengths."""
    check.integers(documents, "documents (one document id per token of the whole sequence)")
    if documents.dim() != 1:
        raise ValueError(f"documents must be one id per token of the whole sequence (1-D); got "
                         f"shape {tuple(documents.shape)}.")
    _, rank, world_size = _check_layout(len(documents), rank, world_size)
    ids = documents.detach().cpu().long().tolist()
    starts = [i for i in range(len(ids)) if i == 0 or ids[i] != ids[i - 1]] + [len(ids)]
    parts = 2 * world_size
    held = []
    for a, b in zip(starts, starts[1:]):
        if world_size > 1 and (b - a) % parts:
            raise ValueError(
                f"the document at positions {a} to {b - 1} ({b - a} tokens) does not split "
                f"into {parts} equal chunks for per-document zig-zag on {world_size} ranks; pad "
                f"every document to a multiple of {parts} tokens (padding masked out, as "
                f"TransformerEngine's THD layout does), or use zigzag_positions.")
        c = (b - a) // parts if world_size > 1 else b - a
        chunks = (rank, parts - 1 - rank) if world_size > 1 else (0,)
        held += [torch.arange(a + i * c, a + (i + 1) * c) for i in chunks]
    return torch.cat(held) if held else torch.zeros(0, dtype=torch.int64)
