"""Ring attention and all-gather-K/V attention equal dense attention, forward and backward."""
import pytest
import torch

import distlab
from distlab import context_parallel as cp

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
    positions = (cp.zigzag_positions if layout == "zigzag" else cp.contiguous_positions)(
        seq_len, rank, world_size)
    q, k, v = [t[:, :, positions].clone().requires_grad_() for t in _inputs(seq_len)]
    attend = cp.ring_attention if kind == "ring" else cp.all_gather_attention
    out = attend(q, k, v, positions, causal=causal)
    weights = torch.linspace(-1, 1, B * H * seq_len * D, dtype=torch.float64).view(B, H, seq_len, D)
    (out * weights[:, :, positions]).sum().backward()
    return positions, out.detach(), q.grad, k.grad, v.grad


@pytest.mark.parametrize("kind,world_size,layout,causal", [
    ("ring", 1, "contiguous", True), ("ring", 2, "zigzag", True), ("ring", 3, "contiguous", False),
    ("ring", 3, "zigzag", True), ("ring", 4, "contiguous", True), ("ring", 5, "zigzag", True),
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
        # K/V move only as messages to the neighbour; one all-gather of the block lengths (one
        # integer per rank) sizes the receive buffers, since blocks may differ in length
        assert sorted(set(t.ops(rank))) == ["all_gather", "recv", "send"]
        assert t.ops(rank).count("all_gather") == 1
        # forward: 3 tensors x (N-1) hops; backward: 5 x (N-1) hops + 2 to bring dK, dV home
        assert len(t.sends(rank)) == 3 * (world_size - 1) + 5 * (world_size - 1) + 2


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
    return positions, out.detach(), q.grad, k.grad, v.grad


@pytest.mark.parametrize("kind,world_size,seq_len,causal", [
    ("ring", 3, 7, True), ("ring", 3, 7, False), ("ring", 4, 10, True), ("ring", 2, 5, True),
    ("ring", 3, 2, True),                                   # a rank with no token at all
    ("all_gather", 3, 7, True), ("all_gather", 4, 10, False)])
def test_blocks_of_unequal_length_equal_dense_attention(kind, world_size, seq_len, causal):
    expected = _dense(seq_len, causal)
    results = distlab.run(_uneven, world_size, seq_len, causal, kind, timeout=30)
    assert len({len(positions) for positions, *_ in results}) == 2      # unequal blocks
    for positions, *got in results:
        for name, g, e in zip(("output", "dq", "dk", "dv"), got, expected):
            torch.testing.assert_close(g, e[:, :, positions], rtol=1e-12, atol=1e-12,
                                       msg=lambda m: f"{name}: {m}")
