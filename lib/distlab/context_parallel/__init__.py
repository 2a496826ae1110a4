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

One module per idea: `layouts` (which tokens a rank holds), `plan` (what a causal mask leaves of
a pair of blocks), `blocks` (one block's kernels, merge, a piece's gradient), `exchange` (hops
and gathers between ranks), `ring` (one ring for every mask, given each step's plan),
`documents` (the ring over packed documents: a document mask's plan, whole blocks skipped, and
per-document zig-zag), `all_gather`, `closed_forms`. Every name is re-exported here, so
`distlab.context_parallel.ring_attention` is where it always was.
"""
from .layouts import (_check_divides, causal_work, contiguous_positions, striped_positions,
                      zigzag_positions)
from .plan import (DIAGONAL, FULL, PARTIAL, SKIP, _bounds, _cut, _pair, _runs, _stripes,
                   block_plan, plan_work)
from .blocks import (_add_rows, _as_q_heads, _attend_plan, _check_block, _cpu_kernel, _flash,
                     _grads, _lse_dtype, _masked, _piece, _rows, _scores, _sum_heads,
                     block_attention, dense_attention, merge)
from .exchange import (_all_positions, _block_lengths, _gather_tokens, _pad_tokens,
                       _positions_for, _shift, _wait, _with_length)
from .ring import RingAttention, ring_attention
from .all_gather import _GatherSequence, _LocalAttention, all_gather_attention, document_attention
from .closed_forms import overlap_block_length, overlap_condition, ring_step_seconds
from .documents import (DocumentRingAttention, RingStep, document_plan, document_ring_attention,
                        document_zigzag_positions)
