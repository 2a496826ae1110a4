"""Ring attention over packed documents (`cp.document_ring_attention`) equals single-process
attention under the document mask: output and the gradients of q, k and v, in float64, at world
sizes 1, 2, 3 and 5 — one launch per world size, every case inside it. What each rank computed
and skipped at each ring step (its `log`) is held against a brute-force count of the mask, and
chapter 12b's counted numbers against `document_plan`."""
import json
from pathlib import Path

import pytest
import torch

import distlab
from distlab import context_parallel as cp

B, D = 1, 4


def _contiguous(seq_len, world_size):
    """Blocks of unequal length where the length does not divide (10 on 3: 4, 3, 3)."""
    sizes = [seq_len // world_size + (r < seq_len % world_size) for r in range(world_size)]
    starts = [sum(sizes[:r]) for r in range(world_size + 1)]
    return [torch.arange(starts[r], starts[r + 1]) for r in range(world_size)]


def _docs(lengths):
    return torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)])


def _cases(world_size):
    """(name, positions per rank, documents of the whole sequence, causal, heads, kv_heads)."""
    n = world_size
    cases = []
    # zig-zag blocks, documents crossing every kind of boundary (chunk, rank), one of one token
    s = 4 * max(n, 2)
    cases.append(("zig-zag", [cp.zigzag_positions(s, r, n) for r in range(n)],
                  _docs([3, 1, s - 7, 3]), True, 2, 2))
    cases.append(("zig-zag, on the explicit-mask path a GPU takes", *cases[-1][1:]))
    cases.append(("zig-zag, grouped-query", [cp.zigzag_positions(s, r, n) for r in range(n)],
                  _docs([s - 5, 5]), True, 4, 2))
    # a length that does not divide: rank 1's block is one whole document (rank 0's with one
    # rank), the documents around it cross the other blocks' boundaries
    s = 3 * n + 1
    held = _contiguous(s, n)
    whole = held[min(1, n - 1)]
    first, last = int(whole[0]), int(whole[-1]) + 1
    cuts = sorted({0, first, last, s} | {p for p in (first // 2, (last + s) // 2) if 0 < p < s})
    cases.append(("uneven, a rank's block one whole document", held,
                  _docs([b - a for a, b in zip(cuts, cuts[1:])]), True, 2, 2))
    cases.append(("uneven, not causal", held, _docs([s // 2, s - s // 2]), False, 2, 2))
    # per-document zig-zag: every document's length a multiple of 2N
    docs = _docs([4 * n, 2 * n, 2 * n])
    cases.append(("per-document zig-zag", [cp.document_zigzag_positions(docs, r, n)
                                           for r in range(n)], docs, True, 2, 2))
    return cases


def _inputs(seq_len, heads, kv_heads):
    g = torch.Generator().manual_seed(seq_len)
    return [torch.randn(B, h, seq_len, D, dtype=torch.float64, generator=g)
            for h in (heads, kv_heads, kv_heads)]


def _weights(seq_len, heads):
    return torch.linspace(-1, 1, B * heads * seq_len * D, dtype=torch.float64).view(
        B, heads, seq_len, D)


def _on_ranks(rank, world_size):
    results = []
    flash = cp.blocks._cpu_kernel
    for name, held, docs, causal, heads, kv_heads in _cases(world_size):
        # the pieces' kernels read the test where it lives (the package only re-exports it)
        cp.blocks._cpu_kernel = (lambda q: False) if "explicit" in name else flash
        positions = held[rank]
        q, k, v = [t[:, :, positions].clone().requires_grad_()
                   for t in _inputs(len(docs), heads, kv_heads)]
        log = []
        out = cp.document_ring_attention(q, k, v, positions, docs[positions], causal=causal,
                                         log=log)
        (out * _weights(len(docs), heads)[:, :, positions]).sum().backward()
        results.append((out.detach(), q.grad, k.grad, v.grad, log))
    return results


def _dense(held, docs, causal, heads, kv_heads):
    seq_len = len(docs)
    q, k, v = [t.requires_grad_() for t in _inputs(seq_len, heads, kv_heads)]
    pos = torch.arange(seq_len)
    out = cp.document_attention(q, k, v, pos, pos, docs, docs, causal)
    (out * _weights(seq_len, heads)).sum().backward()
    return out.detach(), q.grad, k.grad, v.grad


def _visible(q_pos, k_pos, docs, causal):
    seen = docs[q_pos][:, None] == docs[k_pos][None, :]
    return int((seen & (k_pos[None, :] <= q_pos[:, None]) if causal else seen).sum())


@pytest.mark.parametrize("world_size", [1, 2, 3, 5])
def test_document_ring_equals_dense_masked_attention_and_logs_what_it_skipped(world_size):
    cases = _cases(world_size)
    per_rank = distlab.run(_on_ranks, world_size, timeout=120)
    skipped = 0
    for i, (name, held, docs, causal, heads, kv_heads) in enumerate(cases):
        expected = _dense(held, docs, causal, heads, kv_heads)
        for rank, results in enumerate(per_rank):
            *got, log = results[i]
            positions = held[rank]
            for what, g, e in zip(("output", "dq", "dk", "dv"), got, expected):
                torch.testing.assert_close(g, e[:, :, positions], rtol=1e-12, atol=1e-12,
                                           msg=lambda m: f"{name}, rank {rank}, {what}: {m}")
            # the log: one entry per step, the block of rank r − s, skipped exactly when no
            # query sees a key of it, and the pairs the kernels charged
            assert [(s.step, s.block) for s in log] == [(s, (rank - s) % world_size)
                                                        for s in range(world_size)]
            for s in log:
                visible = _visible(positions, held[s.block], docs, causal)
                assert s.size == len(positions) * len(held[s.block])
                assert (s.kind == "skip") == (visible == 0), (name, rank, s)
                assert (s.kind == "full") == (visible == s.size), (name, rank, s)
                # a causal flash kernel charges c²/2 for a diagonal piece of c tokens: at most
                # half a pair per query below the exact count, none without a causal mask
                assert 0 <= visible - s.pairs <= (len(positions) / 2 if causal else 0)
                plan = cp.document_plan(positions, held[s.block], docs[positions],
                                        docs[held[s.block]], causal)
                assert s.pairs == cp.plan_work(plan)
                assert s.kernels == sum(len(pieces) for _, pieces in plan)
                assert (s.kernels == 0) == (s.kind == "skip")
                skipped += s.kind == "skip"
        if name == "uneven, a rank's block one whole document" and world_size > 1:
            # its queries see its own block only: every other step is skipped whole
            assert [s.kind for s in per_rank[1][i][-1][1:]] == ["skip"] * (world_size - 1)
            assert len({len(p) for p in held}) == 2          # unequal blocks
    assert (skipped > 0) == (world_size > 1)


def test_one_document_plans_what_the_causal_ring_plans():
    """With a single document the mask is plain causal: the same work as chapter 12's ring."""
    for place in (cp.zigzag_positions, cp.contiguous_positions):
        held = [place(24, r, 3) for r in range(3)]
        one = torch.zeros(24, dtype=torch.int64)
        for a in held:
            for b in held:
                assert cp.plan_work(cp.document_plan(a, b, one[a], one[b], True)) == \
                    cp.plan_work(cp.block_plan(a, b, True))


def _both_rings(rank, world_size):
    positions = cp.zigzag_positions(16, rank, world_size)
    q, k, v = [t[:, :, positions] for t in _inputs(16, 2, 2)]
    plain, documents = [], []
    out = cp.ring_attention(q, k, v, positions, causal=True, log=plain)
    one = cp.document_ring_attention(q, k, v, positions, torch.zeros(len(positions),
                                     dtype=torch.int64), log=documents)
    return out, one, plain, documents


def test_one_ring_for_both_masks():
    """The packed-document ring is chapter 12's Function given another planner: with one
    document it computes what the causal ring does, and logs the same work at every step (its
    own block in three kernels where `block_plan` joins zig-zag's two chunks in one)."""
    assert cp.DocumentRingAttention is cp.RingAttention
    for out, one, plain, documents in distlab.run(_both_rings, 2, timeout=60):
        torch.testing.assert_close(one, out, rtol=1e-12, atol=1e-12)
        assert len(plain) == 2 and [s[:5] for s in plain] == [s[:5] for s in documents]


def test_bad_input_is_refused_in_a_sentence():
    q = torch.zeros(B, 2, 4, D)
    with pytest.raises(ValueError, match=r"one document id per token of the block \(4\); got "
                                         r"shape \(3,\)"):
        cp.document_ring_attention(q, q, q, torch.arange(4), torch.zeros(3, dtype=torch.int64))
    with pytest.raises(TypeError, match="documents .* must be a tensor of integers"):
        cp.document_ring_attention(q, q, q, torch.arange(4), torch.full((4,), 0.5))
    with pytest.raises(TypeError, match="log must be a list"):
        cp.document_ring_attention(q, q, q, torch.arange(4), torch.zeros(4, dtype=torch.int64),
                                   log={})
    with pytest.raises(ValueError, match="documents must be real integers even when q, k and v "
                                         "are meta"):
        cp.document_plan(torch.arange(2), torch.arange(2), torch.zeros(2, dtype=torch.int64,
                         device="meta"), torch.zeros(2, dtype=torch.int64), True)
    with pytest.raises(ValueError, match=r"the document at positions 8 to 14 \(7 tokens\) does "
                                         r"not split into 4 equal chunks .* pad every document "
                                         r"to a multiple of 4 tokens"):
        cp.document_zigzag_positions(_docs([8, 7, 1]), 0, 2)


# ---- chapter 12b's counted numbers (stale prose fails) -------------------------------------------

NOTEBOOK = Path(__file__).resolve().parent.parent / "notebooks" / "12b_cp_at_scale.ipynb"


def _prose():
    cells = json.loads(NOTEBOOK.read_text())["cells"]
    return " ".join(" ".join("".join(c["source"]) for c in cells
                             if c["cell_type"] == "markdown").split())


def _blocks(held, docs, n):
    """Per rank: the fraction of a block its kernels compute at each ring step, and how many
    kernels it runs in all."""
    c = len(held[0])
    plans = [[cp.document_plan(held[r], held[(r - s) % n], docs[held[r]],
                               docs[held[(r - s) % n]], True) for s in range(n)] for r in range(n)]
    return ([[cp.plan_work(p) / (c * c) for p in steps] for steps in plans],
            [sum(len(pieces) for p in steps for _, pieces in p) for steps in plans])


def test_the_document_imbalance_the_chapter_quotes():
    docs, n = _docs([72, 24, 8, 24]), 4
    zigzag, kernels = _blocks([cp.zigzag_positions(128, r, n) for r in range(n)], docs, n)
    per_doc, per_doc_kernels = _blocks([cp.document_zigzag_positions(docs, r, n)
                                        for r in range(n)], docs, n)
    totals, per_doc_totals = [sum(s) for s in zigzag], [sum(s) for s in per_doc]
    skips = [steps.count(0) for steps in zigzag]
    assert skips == [2, 2, 0, 0] and all(0 not in steps for steps in per_doc)
    assert max(per_doc_totals) - min(per_doc_totals) < 0.002          # "0.78 blocks" each
    prose = _prose()
    for text in (f"rank 3 computes {totals[3]:.3f} blocks, rank 0 {totals[0]:.3f}",
                 f"busiest / mean {max(totals) * n / sum(totals):.2f}",
                 f"{max(per_doc_totals) * n / sum(per_doc_totals):.2f} with per-document zig-zag",
                 f"every rank computes {per_doc_totals[0]:.2f} blocks, so the busiest rank's work "
                 f"falls {max(totals) / max(per_doc_totals):.2f} times",
                 f"each rank runs {min(per_doc_kernels)} to {max(per_doc_kernels)} kernels where "
                 f"zig-zag ran {min(kernels)} to {max(kernels)}"):
        assert text in prose, f"chapter 12b's prose no longer says {text!r}: recompute and fix it"
