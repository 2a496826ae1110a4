"""Ring attention and all-gather-K/V attention equal dense attention, forward and backward."""
import json
from pathlib import Path

import pytest
import torch

import distlab
from distlab import context_parallel as cp
from distlab import ulysses

B, H, D = 1, 2, 4


def _inputs(seq_len, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(B, H, seq_len, D, dtype=torch.float64, generator=g) for _ in range(3)]


def _dense(seq_len, causal):
    q, k, v = [t.requires_grad_() for t in _inputs(seq_len)]
    out = cp.dense_attention(q, k, v, causal)
    (out * torch.linspace(-1, 1, out.numel(), dtype=torch.float64).view_as(out)).sum().backward()
    return out.detach(), q.grad, k.grad, v.grad


def _sharded(rank, world_size, seq_len, causal, layout, kind):
    place = dict(zigzag=cp.zigzag_positions, contiguous=cp.contiguous_positions,
                 striped=cp.striped_positions)[layout]
    positions = place(seq_len, rank, world_size)
    q, k, v = [t[:, :, positions].clone().requires_grad_() for t in _inputs(seq_len)]
    attend = cp.ring_attention if kind == "ring" else cp.all_gather_attention
    out = attend(q, k, v, positions, causal=causal)
    weights = torch.linspace(-1, 1, B * H * seq_len * D, dtype=torch.float64).view(B, H, seq_len, D)
    (out * weights[:, :, positions]).sum().backward()
    return positions, out.detach(), q.grad, k.grad, v.grad


@pytest.mark.parametrize("kind,world_size,layout,causal", [
    ("ring", 1, "contiguous", True), ("ring", 2, "zigzag", True), ("ring", 3, "contiguous", False),
    ("ring", 3, "zigzag", True), ("ring", 4, "contiguous", True), ("ring", 5, "striped", True),
    ("all_gather", 3, "zigzag", True), ("all_gather", 4, "contiguous", False)])
def test_context_parallel_attention_equals_dense_attention(kind, world_size, layout, causal):
    seq_len = 4 * world_size
    expected = _dense(seq_len, causal)
    for positions, *got in distlab.run(_sharded, world_size, seq_len, causal, layout, kind):
        for name, g, e in zip(("output", "dq", "dk", "dv"), got, expected):
            torch.testing.assert_close(g, e[:, :, positions], rtol=1e-12, atol=1e-12,
                                       msg=lambda m: f"{name}: {m}")


def _ring_trace(rank, world_size):
    positions = cp.zigzag_positions(8 * world_size, rank, world_size)
    q, k, v = [t[:, :, positions].clone().requires_grad_() for t in _inputs(8 * world_size)]
    cp.ring_attention(q, k, v, positions, causal=True).sum().backward()


@pytest.mark.parametrize("world_size", [3, 4])
def test_ring_attention_only_talks_to_its_neighbours(world_size):
    t = distlab.run(_ring_trace, world_size, trace=True).trace
    for rank in range(world_size):
        assert {peer for peer, _ in t.sends(rank)} == {(rank + 1) % world_size}
        # K/V move only as messages to the neighbour; two all-gathers (block lengths, then
        # positions) tell every rank which tokens each block holds: its receive buffers' sizes
        # and which pieces a causal mask skips
        assert sorted(set(t.ops(rank))) == ["all_gather", "recv", "send"]
        assert t.ops(rank).count("all_gather") == 2
        # forward: K, V x (N-1) hops; backward: K, V x (N-1) hops + dK, dV x N hops (home)
        assert len(t.sends(rank)) == 2 * (world_size - 1) + 2 * (world_size - 1) + 2 * world_size
        # and their bytes are the closed form's that chapter 12 prints beside Ulysses
        assert sum(b for _, b in t.sends(rank)) == sum(ulysses.communication_per_layer(
            "ring", 8 * world_size, world_size, H, H, D, itemsize=8))


def test_zigzag_balances_causal_work_and_contiguous_does_not():
    contiguous = cp.causal_work([cp.contiguous_positions(16, r, 4) for r in range(4)])
    zigzag = cp.causal_work([cp.zigzag_positions(16, r, 4) for r in range(4)])
    assert sum(contiguous) == sum(zigzag) == 16 * 17 // 2
    assert max(contiguous) / min(contiguous) == 58 / 10
    assert len(set(zigzag)) == 1


def test_lengths_that_do_not_split_are_refused_in_a_sentence():
    with pytest.raises(ValueError, match="does not split into 6 equal chunks"):
        cp.zigzag_positions(10, 0, 3)
    with pytest.raises(ValueError, match="does not split into 3 equal chunks"):
        cp.contiguous_positions(10, 0, 3)
    # what to do names sizes that work: 4 divides 12, but zig-zag needs 2 chunks per rank
    with pytest.raises(ValueError, match=r"8 equal chunks for the zig-zag layout \(2 per rank\);"
                                         r".* choose a context-parallel size that splits it: "
                                         r"cp = 3 or 6 here\."):
        cp.zigzag_positions(12, 0, 4)
    with pytest.raises(ValueError, match=r"splits it: cp = 1 here\."):
        cp.zigzag_positions(11, 1, 2)
    # one rank holds the whole sequence in order, whatever its length
    assert torch.equal(cp.zigzag_positions(11, 0, 1), torch.arange(11))


def test_merging_two_halves_is_attention_over_both():
    q, k, v = _inputs(6)
    pos = torch.arange(6, dtype=torch.float64)
    a = cp.block_attention(q, k[:, :, :2], v[:, :, :2], pos, pos[:2], True, 0.5)
    b = cp.block_attention(q, k[:, :, 2:], v[:, :, 2:], pos, pos[2:], True, 0.5)
    out, _ = cp.merge(*a, *b)
    full, _ = cp.block_attention(q, k, v, pos, pos, True, 0.5)
    torch.testing.assert_close(out, full, rtol=1e-13, atol=1e-13)


def _uneven(rank, world_size, seq_len, causal, kind):
    """Blocks of unequal length, as tensor_split cuts 7 tokens for 3 ranks: 3, 2, 2."""
    positions = torch.arange(seq_len).tensor_split(world_size)[rank]
    q, k, v = [t[:, :, positions].clone().requires_grad_() for t in _inputs(seq_len)]
    attend = cp.ring_attention if kind == "ring" else cp.all_gather_attention
    out = attend(q, k, v, positions, causal=causal)
    weights = torch.linspace(-1, 1, B * H * seq_len * D, dtype=torch.float64).view(B, H, seq_len, D)
    (out * weights[:, :, positions]).sum().backward()
    got = [positions, out.detach(), q.grad, k.grad, v.grad]
    if kind == "all_gather":
        # the same launch: packed documents, whose boundaries cross the ranks' blocks
        q, k, v = [t.detach().requires_grad_() for t in (q, k, v)]
        out = cp.all_gather_attention(q, k, v, positions, causal, documents=_documents(seq_len)[positions])
        (out * weights[:, :, positions]).sum().backward()
        got += [out.detach(), q.grad, k.grad, v.grad]
        # grouped-query K/V (4 query heads, 2 K/V heads), without and with documents: Llama 3's
        # two reasons to gather, together
        w = torch.linspace(-1, 1, B * 4 * seq_len * D, dtype=torch.float64).view(B, 4, seq_len, D)
        for documents in (None, _documents(seq_len)[positions]):
            q, k, v = [t[:, :, positions].clone().requires_grad_()
                       for t in _gqa_inputs(seq_len, 4, 2)]
            out = cp.all_gather_attention(q, k, v, positions, causal, documents=documents)
            (out * w[:, :, positions]).sum().backward()
            got += [out.detach(), q.grad, k.grad, v.grad]
    return got


def _documents(seq_len):
    """Document ids of packed sequences of 2, 4, 1, 3, 2, 4, ... tokens (cut at seq_len)."""
    lengths = torch.tensor([2, 4, 1, 3] * seq_len)[:seq_len]
    return torch.repeat_interleave(torch.arange(seq_len), lengths)[:seq_len]


def _documents_dense(seq_len, causal, heads=H, kv_heads=H, documents=True):
    """Dense attention over the whole sequence with a block-diagonal (causal) mask; query head h
    reads K/V head h // (heads / kv_heads)."""
    q, k, v = [t.requires_grad_() for t in _gqa_inputs(seq_len, heads, kv_heads)]
    docs, pos = _documents(seq_len), torch.arange(seq_len)
    hidden = (docs[:, None] != docs[None, :]) & documents
    hidden = hidden | ((pos[None, :] > pos[:, None]) & causal)
    wide_k, wide_v = (t.repeat_interleave(heads // kv_heads, dim=1) for t in (k, v))
    s = (q @ wide_k.transpose(-2, -1)) / D ** 0.5
    out = torch.softmax(s.masked_fill(hidden, float("-inf")), dim=-1) @ wide_v
    (out * torch.linspace(-1, 1, out.numel(), dtype=torch.float64).view_as(out)).sum().backward()
    return out.detach(), q.grad, k.grad, v.grad


@pytest.mark.parametrize("kind,world_size,seq_len,causal", [
    ("ring", 3, 7, True), ("ring", 3, 7, False), ("ring", 4, 10, True), ("ring", 2, 5, True),
    ("ring", 3, 2, True),                                   # a rank with no token at all
    ("all_gather", 3, 7, True), ("all_gather", 4, 10, False)])
def test_blocks_of_unequal_length_equal_dense_attention(kind, world_size, seq_len, causal):
    expected = _dense(seq_len, causal)
    results = distlab.run(_uneven, world_size, seq_len, causal, kind, timeout=120)
    assert len({len(positions) for positions, *_ in results}) == 2      # unequal blocks
    if kind == "all_gather":
        expected += _documents_dense(seq_len, causal)
        expected += _documents_dense(seq_len, causal, 4, 2, documents=False)
        expected += _documents_dense(seq_len, causal, 4, 2)
        docs = _documents(seq_len)
        # a document that spans blocks, and a mask that hides something causality would not
        assert any(len(set(docs[r[0]].tolist()) & set(docs[o[0]].tolist())) for r, o in
                   zip(results, results[1:]))
    for positions, *got in results:
        names = [f"{case} {name}" for case in ("plain", "documents", "GQA", "GQA documents")
                 for name in ("output", "dq", "dk", "dv")]
        assert len(got) == len(expected) == (16 if kind == "all_gather" else 4)
        for name, g, e in zip(names, got, expected):
            torch.testing.assert_close(g, e[:, :, positions], rtol=1e-12, atol=1e-12,
                                       msg=lambda m: f"{name}: {m}")


# ---- which pieces a causal mask lets through, and what they cost --------------------------------

def test_a_block_plan_skips_what_the_mask_hides_and_halves_the_diagonal():
    own = cp.zigzag_positions(16, 1, 4)                    # chunks 1 and 6 of 8
    assert cp.block_plan(own, own, causal=True) == [((0, 4), [((0, 4), cp.DIAGONAL)])]
    earlier = cp.zigzag_positions(16, 0, 4)                # chunks 0 and 7: 0 seen by both
    assert cp.block_plan(own, earlier, causal=True) == [((0, 4), [((0, 2), cp.FULL)])]
    later = cp.zigzag_positions(16, 2, 4)                  # chunks 2 and 5: only chunk 6 sees them
    assert cp.block_plan(own, later, causal=True) == [((2, 4), [((0, 4), cp.FULL)])]
    assert cp.block_plan(cp.contiguous_positions(16, 0, 4), cp.contiguous_positions(16, 3, 4),
                         causal=True) == []
    assert cp.block_plan(own, later, causal=False) == [((0, 4), [((0, 4), cp.FULL)])]


def test_zigzag_work_is_half_a_block_at_every_step_and_contiguous_is_not():
    """The notebook's table: fractions of a block's pairs per ring step, 16 tokens on 4 ranks."""
    def steps(place, rank):
        held = [place(16, r, 4) for r in range(4)]
        return [cp.plan_work(cp.block_plan(held[rank], held[(rank - s) % 4], True)) / 16
                for s in range(4)]
    assert all(steps(cp.zigzag_positions, r) == [0.5] * 4 for r in range(4))
    assert steps(cp.contiguous_positions, 0) == [0.5, 0, 0, 0]
    assert sum(steps(cp.contiguous_positions, 3)) == 3.5


@pytest.mark.parametrize("causal", [False, True])
def test_the_explicit_mask_path_a_gpu_takes_equals_the_cpu_flash_kernel(causal, monkeypatch):
    q, k, v = _inputs(8)
    q_pos = torch.tensor([0, 1, 6, 7])
    k_pos = torch.tensor([2, 3, 4, 5, 6, 7, 0, 1])
    flash = cp.block_attention(q[:, :, :4], k, v, q_pos, k_pos, causal, 0.5)
    # block_attention reads the kernel test where it lives (the package only re-exports it)
    monkeypatch.setattr(cp.blocks, "_cpu_kernel", lambda q: False)
    masked = cp.block_attention(q[:, :, :4], k, v, q_pos, k_pos, causal, 0.5)
    for a, b in zip(flash, masked):
        torch.testing.assert_close(a, b, rtol=1e-13, atol=1e-13)


def test_striped_blocks_are_one_causal_kernel_per_step_and_balanced():
    """Brandon et al.'s striped layout: against an earlier-offset block one causal kernel, against
    a later one the same kernel shifted by a row (query i sees keys j < i); equal up to a diagonal."""
    mine, earlier, later = (cp.striped_positions(16, r, 4) for r in (1, 0, 2))
    assert cp.block_plan(mine, earlier, True) == [((0, 4), [((0, 4), cp.DIAGONAL)])]
    assert cp.block_plan(mine, later, True) == [((1, 4), [((0, 3), cp.DIAGONAL)])]
    assert cp.block_plan(mine, mine, True) == [((0, 4), [((0, 4), cp.DIAGONAL)])]
    assert cp._stripes(cp.zigzag_positions(16, 1, 4), cp.zigzag_positions(16, 2, 4)) is None
    for c, worst in ((4, 1.2), (4096, 1.0002)):
        held = [cp.striped_positions(4 * c, r, 4) for r in range(4)]
        work = [sum(cp.plan_work(cp.block_plan(held[r], held[(r - s) % 4], True))
                    for s in range(4)) for r in range(4)]
        assert max(work) / (sum(work) / 4) < worst


def test_meta_positions_are_refused_in_a_sentence():
    with pytest.raises(ValueError, match="positions must be real integers"):
        cp.block_plan(torch.arange(4, device="meta"), torch.arange(4), True)


# ---- chapter 12's headline numbers, recomputed (stale prose fails) --------------------------------

NOTEBOOK = Path(__file__).resolve().parent.parent / "notebooks" / "12_context_parallelism.ipynb"


def _says(text):
    cells = json.loads(NOTEBOOK.read_text())["cells"]
    prose = " ".join(" ".join("".join(c["source"]) for c in cells
                              if c["cell_type"] == "markdown").split())
    assert text in prose, f"chapter 12's prose no longer says {text!r}: recompute and fix it"


def test_the_overlap_condition_the_chapter_quotes():
    from distlab import emulate, hardware
    _says(f"about {cp.overlap_condition(989e12, 50e9):,.0f} tokens over InfiniBand and "
          f"{cp.overlap_condition(989e12, 450e9):,.0f} over NVLink")
    assert cp.overlap_condition(989e12, 50e9, causal=True) == 2 * cp.overlap_condition(989e12, 50e9)
    # grouped-query attention: K/V 4x smaller than Q, blocks 4x shorter suffice
    assert cp.overlap_condition(989e12, 50e9, heads=32, kv_heads=8) == 19_780 / 4
    ib, node = emulate.PRESETS["h100-ib"], emulate.PRESETS["h100-node"]
    at_ib = cp.overlap_block_length(ib.device, ib.link_between(range(4)))
    at_node = cp.overlap_block_length(node.device, node.link_between(range(4)))
    _says(f"the crossover sits at {at_ib:,} tokens per rank on the calibrated model")
    _says(f"the hop hides from {at_node:,} tokens per rank on")
    nic = hardware.IB_NDR.bandwidth
    _says(f"would move it to {cp.overlap_condition(740e12, nic, causal=True):,.0f}, the datasheet "
          f"peak's to {cp.overlap_condition(989e12, nic, causal=True):,.0f}")
    # the closed form's crossover and the bisection on the calibrated step agree (latency apart)
    rate = ib.device.peak(torch.bfloat16) * ib.device.attention_efficiency(
        hardware.AttentionShape(32_768, 32_768, 128, 32, False, False))
    assert 1.0 <= at_ib / cp.overlap_condition(rate, nic, causal=True) < 1.02


def _attention_seconds(rank, world_size, configs):
    import torch.distributed as dist
    times = []
    for seq_len, layout, backward in configs:
        place = cp.zigzag_positions if layout == "zig-zag" else cp.contiguous_positions
        positions = place(seq_len, rank, world_size)
        with torch.device("meta"):
            q, k, v = [torch.empty(1, 32, len(positions), 128, dtype=torch.bfloat16,
                                   requires_grad=backward) for _ in range(3)]
        dist.barrier()
        start = distlab.trace.now()
        out = cp.ring_attention(q, k, v, positions, causal=True)
        forward = distlab.trace.now()
        if backward:
            out.backward(torch.ones_like(out))
        times.append((start, forward, distlab.trace.now()))
    return times


def test_the_emulated_ring_exposure_and_zigzag_balance_the_chapter_quotes():
    """One full-size run on meta tensors (h100-ib), as the chapter's: exposed share of the ring's
    forward below and above the crossover, and contiguous vs zig-zag in time."""
    sweep = [(s, "zig-zag", False) for s in (4_096, 16_384, 32_768, 65_536)]
    balance = [(131_072, layout, True) for layout in ("zig-zag", "contiguous")]
    run = distlab.run(_attention_seconds, 4, sweep + balance, emulate="h100-ib", timeout=120)

    def busy(rank, a, b):
        return sum(max(0.0, min(s["end"], b) - max(s["start"], a)) for s in run.trace.compute(rank))
    exposed = []
    for i in range(len(sweep)):
        total = max(t[i][1] - t[i][0] for t in run)
        kernels = max(busy(r, t[i][0], t[i][1]) for r, t in enumerate(run))
        exposed.append(f"{(total - kernels) / total:.0%}".replace("%", " %"))
    _says(f"about half of its time is the hop ({exposed[0]}, {exposed[1]}), at 8,192 still "
          f"{exposed[2]}")
    _says(f"(16,384 tokens per rank: {exposed[3]})")
    zigzag, contiguous = [[t[i][2] - t[i][0] for t in run] for i in (4, 5)]
    # balanced in time, within the diagonal blocks' causal kernel running at its own rate
    assert max(zigzag) / min(zigzag) < 1.01
    _says(f"{max(contiguous) / max(zigzag):.2f} times zig-zag's")


# ---- DeepSpeed-Ulysses: all-to-all between the sequence and the heads ----------------------------

def _ulysses(rank, world_size, seq_len, heads, kv_heads):
    """Causal Ulysses attention on zig-zag blocks, grouped-query (kv_heads < heads), forward and
    backward; then the same call with a head count cp does not divide, whose refusal is kept."""
    positions = cp.zigzag_positions(seq_len, rank, world_size)
    q, k, v = [t[:, :, positions].clone().requires_grad_()
               for t in _gqa_inputs(seq_len, heads, kv_heads)]
    out = ulysses.ulysses_attention(q, k, v, positions, causal=True)
    weights = torch.linspace(-1, 1, B * heads * seq_len * D, dtype=torch.float64)
    (out * weights.view(B, heads, seq_len, D)[:, :, positions]).sum().backward()
    odd = heads // world_size * world_size + 1                    # cp does not divide it
    try:
        ulysses.ulysses_attention(*(torch.zeros(B, odd, len(positions), D) for _ in range(3)),
                                  positions)
        refusal = None
    except ValueError as e:
        refusal = str(e)
    return positions, out.detach(), q.grad, k.grad, v.grad, refusal


def _gqa_inputs(seq_len, heads, kv_heads, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(B, h, seq_len, D, dtype=torch.float64, generator=g)
            for h in (heads, kv_heads, kv_heads)]


def _gqa_dense(seq_len, heads, kv_heads):
    q, k, v = [t.requires_grad_() for t in _gqa_inputs(seq_len, heads, kv_heads)]
    # query head h reads key/value head h // (heads / kv_heads), as in Llama's attention
    out = cp.dense_attention(q, *(t.repeat_interleave(heads // kv_heads, dim=1) for t in (k, v)),
                             causal=True)
    (out * torch.linspace(-1, 1, out.numel(), dtype=torch.float64).view_as(out)).sum().backward()
    return out.detach(), q.grad, k.grad, v.grad


@pytest.mark.parametrize("world_size,heads,kv_heads", [(2, 6, 2), (3, 6, 3)])
def test_ulysses_equals_dense_attention_and_sends_its_closed_form(world_size, heads, kv_heads):
    seq_len = 4 * world_size
    expected = _gqa_dense(seq_len, heads, kv_heads)
    run = distlab.run(_ulysses, world_size, seq_len, heads, kv_heads, trace=True, timeout=120)
    for positions, *got, refusal in run:
        for name, g, e in zip(("output", "dq", "dk", "dv"), got, expected):
            torch.testing.assert_close(g, e[:, :, positions], rtol=1e-12, atol=1e-12,
                                       msg=lambda m: f"{name}: {m}")
        odd = heads // world_size * world_size + 1
        assert f"{odd} query heads do not split over cp = {world_size}" in refusal
        assert f"(at most {odd};" in refusal
    forward, backward = ulysses.communication_per_layer("ulysses", seq_len, world_size, heads,
                                                        kv_heads, D, itemsize=8)
    for rank in range(world_size):
        # four all-to-alls forward (q, k, v to heads; the output back), four backward; each
        # rank keeps 1/N of what it puts in and sends the rest
        a2a = [b for op, b in zip(run.trace.ops(rank), (e["bytes"] for e in run.trace.comm(rank)))
               if op == "all_to_all"]
        assert len(a2a) == 8
        assert sum(a2a) * (world_size - 1) / world_size == forward + backward
        assert sorted(set(run.trace.ops(rank))) == ["all_gather", "all_to_all"]   # no ring


# ---- ring attention under grouped-query attention: the ring carries the small K/V ---------------

def _ring_gqa(rank, world_size, seq_len, heads, kv_heads, layout):
    positions = (cp.zigzag_positions(seq_len, rank, world_size) if layout == "zigzag"
                 else torch.arange(seq_len).tensor_split(world_size)[rank])   # 7 on 3: 3, 2, 2
    q, k, v = [t[:, :, positions].clone().requires_grad_()
               for t in _gqa_inputs(seq_len, heads, kv_heads)]
    out = cp.ring_attention(q, k, v, positions, causal=True)
    weights = torch.linspace(-1, 1, B * heads * seq_len * D, dtype=torch.float64)
    (out * weights.view(B, heads, seq_len, D)[:, :, positions]).sum().backward()
    return positions, out.detach(), q.grad, k.grad, v.grad


@pytest.mark.parametrize("world_size,seq_len,heads,kv_heads,layout", [
    (2, 8, 6, 2, "zigzag"), (3, 7, 6, 3, "uneven")])
def test_ring_attention_with_grouped_query_heads_equals_dense_and_rotates_only_kv(
        world_size, seq_len, heads, kv_heads, layout):
    expected = _gqa_dense(seq_len, heads, kv_heads)
    run = distlab.run(_ring_gqa, world_size, seq_len, heads, kv_heads, layout, trace=True,
                      timeout=120)
    for positions, *got in run:
        for name, g, e in zip(("output", "dq", "dk", "dv"), got, expected):
            torch.testing.assert_close(g, e[:, :, positions], rtol=1e-12, atol=1e-12,
                                       msg=lambda m: f"{name}: {m}")
    lengths = [len(p) for p, *_ in run]
    for rank in range(world_size):
        # every message is a K/V block (or its gradient) of kv_heads heads: forward N-1 hops of
        # K and V, backward N-1 of K and V and N of their gradients, each the size of the block
        # its owner holds
        kv_block = {n * B * kv_heads * D * 8 for n in lengths}
        assert {b for _, b in run.trace.sends(rank)} <= kv_block
        assert len(run.trace.sends(rank)) == 2 * (world_size - 1) * 2 + 2 * world_size


def test_kv_heads_that_do_not_divide_the_query_heads_are_refused():
    with pytest.raises(ValueError, match=r"fewer heads that divide q's \(grouped-query"):
        cp._check_block(torch.zeros(B, 6, 4, D), *[torch.zeros(B, 4, 4, D)] * 2, torch.arange(4))
    with pytest.raises(ValueError, match="blocks of one shape"):
        cp._check_block(torch.zeros(B, 6, 4, D), torch.zeros(B, 3, 4, D), torch.zeros(B, 2, 4, D),
                        torch.arange(4))
