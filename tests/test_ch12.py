"""Workbook 12's checkers: right answers written differently pass; wrong structure, wrong numbers
and the course's own code are refused with a sentence."""
import math

import pytest
import torch
import torch.distributed as dist

from distlab import context_parallel as cp
from distlab.checks import CheckFailed, ch12



# ---- merge -----------------------------------------------------------------------------------------

def merge_with_running_max(out_a, lse_a, out_b, lse_b):
    m = torch.maximum(lse_a, lse_b)
    m = torch.where(torch.isinf(m), torch.zeros_like(m), m)
    wa, wb = torch.exp(lse_a - m), torch.exp(lse_b - m)
    total = wa + wb
    out = (out_a * wa.unsqueeze(-1) + out_b * wb.unsqueeze(-1)) / \
        torch.where(total == 0, torch.ones_like(total), total).unsqueeze(-1)
    return out, m + torch.log(total)


def merge_without_guard(out_a, lse_a, out_b, lse_b):
    lse = torch.logaddexp(lse_a, lse_b)
    return (out_a * torch.exp(lse_a - lse).unsqueeze(-1)
            + out_b * torch.exp(lse_b - lse).unsqueeze(-1)), lse


def merge_by_averaging(out_a, lse_a, out_b, lse_b):
    return (out_a + out_b) / 2, torch.maximum(lse_a, lse_b)


def merge_by_the_course(out_a, lse_a, out_b, lse_b):
    return cp.merge(out_a, lse_a, out_b, lse_b)


def test_merge_written_differently_passes(capsys):
    ch12.check_merge(merge_with_running_max)
    assert "✅" in capsys.readouterr().out


def test_merge_without_the_empty_row_guard_is_refused():
    with pytest.raises(CheckFailed, match="nan.*lse of -inf as weight 0"):
        ch12.check_merge(merge_without_guard)


def test_merge_by_averaging_is_refused_with_the_element():
    with pytest.raises(CheckFailed, match=r"merge's lse .*element \[0, 0, \d\]: expected"):
        ch12.check_merge(merge_by_averaging)


def test_merge_calling_the_course_is_refused():
    with pytest.raises(CheckFailed, match="course's own merge"):
        ch12.check_merge(merge_by_the_course)


# ---- ring hop --------------------------------------------------------------------------------------

def hop_with_parity(tensors):
    rank, n = dist.get_rank(), dist.get_world_size()
    received = [torch.empty(t.shape, dtype=t.dtype) for t in tensors]
    for t, r in zip(tensors, received):
        if rank % 2 == 0:
            dist.send(t, (rank + 1) % n)
            dist.recv(r, (rank - 1) % n)
        else:
            dist.recv(r, (rank - 1) % n)
            dist.send(t, (rank + 1) % n)
    return received


def hop_to_the_left(tensors):
    rank, n = dist.get_rank(), dist.get_world_size()
    received = [torch.empty(t.shape, dtype=t.dtype) for t in tensors]
    ops = [dist.P2POp(dist.isend, t, (rank - 1) % n) for t in tensors] + \
          [dist.P2POp(dist.irecv, r, (rank + 1) % n) for r in received]
    for h in dist.batch_isend_irecv(ops):
        h.wait()
    return received


def hop_by_all_gather(tensors):
    rank, n = dist.get_rank(), dist.get_world_size()
    out = []
    for t in tensors:
        parts = [torch.empty_like(t) for _ in range(n)]
        dist.all_gather(parts, t)
        out.append(parts[(rank - 1) % n])
    return out


def hop_by_the_course(tensors):
    received, handles = cp._shift(tensors, None)
    for h in handles:
        h.wait()
    return received


def test_ring_hop_with_blocking_parity_order_passes(capsys):
    ch12.check_ring_hop(hop_with_parity)
    assert "✅" in capsys.readouterr().out


def test_ring_hop_in_the_wrong_direction_is_refused():
    with pytest.raises(CheckFailed, match=r"rank 0 \(it should hold rank 2's tensors\)"):
        ch12.check_ring_hop(hop_to_the_left)


def test_ring_hop_with_a_collective_is_refused_though_its_numbers_are_right():
    with pytest.raises(CheckFailed, match="called all_gather; one ring hop uses only "
                                          "point-to-point"):
        ch12.check_ring_hop(hop_by_all_gather)


def test_ring_hop_calling_the_course_is_refused():
    with pytest.raises(CheckFailed, match="course's own _shift"):
        ch12.check_ring_hop(hop_by_the_course)


# ---- ring attention ------------------------------------------------------------------------------

def attention_with_own_scores(q, k, v, positions):
    """Ring without block_attention or merge: accumulate exp-scores and their sums directly."""
    n = dist.get_world_size()
    q_pos = positions.to(torch.float64)
    num, den, block = 0, 0, [k, v, q_pos]
    shift = 50.0                       # scores here are small: a fixed shift keeps exp finite
    for step in range(n):
        s = q @ block[0].transpose(-2, -1) / math.sqrt(q.shape[-1])
        s = s.masked_fill(block[2][None, :] > q_pos[:, None], -math.inf)
        p = torch.exp(s - shift)
        num, den = num + p @ block[1], den + p.sum(-1, keepdim=True)
        if step < n - 1:
            block = hop_with_parity(block)
    return num / den


def attention_by_gathering(q, k, v, positions):
    n = dist.get_world_size()
    ks, vs, ps = ([torch.empty_like(t) for _ in range(n)] for t in (k, v, positions))
    dist.all_gather(ks, k.contiguous())
    dist.all_gather(vs, v.contiguous())
    dist.all_gather(ps, positions)
    s = q @ torch.cat(ks, -2).transpose(-2, -1) / math.sqrt(q.shape[-1])
    s = s.masked_fill(torch.cat(ps)[None, :] > positions[:, None], -math.inf)
    return torch.softmax(s, -1) @ torch.cat(vs, -2)


def attention_by_the_course(q, k, v, positions):
    return cp.ring_attention(q, k, v, positions, causal=True)


def test_ring_attention_written_differently_passes(capsys):
    ch12.check_ring_attention(attention_with_own_scores)
    assert "✅" in capsys.readouterr().out


def test_attention_by_all_gather_is_refused_though_its_numbers_are_right():
    with pytest.raises(CheckFailed, match="sent 0 messages; the K/V blocks must travel"):
        ch12.check_ring_attention(attention_by_gathering)


def test_ring_attention_calling_the_course_is_refused():
    with pytest.raises(CheckFailed, match="course's own ring_attention"):
        ch12.check_ring_attention(attention_by_the_course)


# ---- ring attention's backward -------------------------------------------------------------------

def _block_grads(q, bk, bv, q_pos, bpos, out, lse, grad_out):
    """One block's share, written with -inf scores and softmax-style exponentials."""
    s = (q @ bk.transpose(-2, -1)) / math.sqrt(q.shape[-1])
    s = s.masked_fill(bpos[None, :] > q_pos[:, None], -math.inf)
    p = (s - lse[..., None]).exp()
    dp = grad_out @ bv.transpose(-2, -1)
    ds = p * (dp - (grad_out * out).sum(-1)[..., None])
    c = 1 / math.sqrt(q.shape[-1])
    return ds @ bk * c, ds.transpose(-2, -1) @ q * c, p.transpose(-2, -1) @ grad_out


def backward_gradients_one_hop_behind(q, k, v, positions, out, lse, grad_out):
    """K, V and positions make N - 1 hops; the gradients follow in their own hops, N of them."""
    n = dist.get_world_size()
    q_pos = positions.to(torch.float64)
    block, dq, grads = [k, v, q_pos], torch.zeros_like(q), None
    for step in range(n):
        gq, gk, gv = _block_grads(q, *block[:2], q_pos, block[2], out, lse, grad_out)
        dq = dq + gq
        grads = [gk, gv] if grads is None else [grads[0] + gk, grads[1] + gv]
        grads = hop_with_parity(grads)
        if step < n - 1:
            block = hop_with_parity(block)
    return dq, grads[0], grads[1]


def backward_keeping_gradients_at_home(q, k, v, positions, out, lse, grad_out):
    """dq right, but every block's dK/dV only from its owner's queries: nothing travels back."""
    n = dist.get_world_size()
    q_pos = positions.to(torch.float64)
    block, dq = [k, v, q_pos], torch.zeros_like(q)
    dk, dv = None, None
    for step in range(n):
        gq, gk, gv = _block_grads(q, *block[:2], q_pos, block[2], out, lse, grad_out)
        dq = dq + gq
        if step == 0:
            dk, dv = gk, gv
        if step < n - 1:
            block = hop_with_parity(block)
    return dq, dk, dv


def backward_by_autograd_on_gathered(q, k, v, positions, out, lse, grad_out):
    """Right numbers: every rank gathers the whole sequence and differentiates it densely."""
    n, rank = dist.get_world_size(), dist.get_rank()
    whole = []
    for t in (q, k, v, positions, grad_out):
        parts = [torch.empty_like(t) for _ in range(n)]
        dist.all_gather(parts, t.contiguous())
        whole.append(torch.cat(parts, dim=-2 if t.dim() > 1 else 0))
    fq, fk, fv = (t.clone().requires_grad_() for t in whole[:3])
    pos = whole[3]
    s = fq @ fk.transpose(-2, -1) / math.sqrt(q.shape[-1])
    s = s.masked_fill(pos[None, :] > pos[:, None], -math.inf)
    (torch.softmax(s, -1) @ fv).backward(whole[4])
    mine = slice(rank * q.shape[-2], (rank + 1) * q.shape[-2])
    return fq.grad[:, :, mine], fk.grad[:, :, mine], fv.grad[:, :, mine]


def backward_by_the_course(q, k, v, positions, out, lse, grad_out):
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    cp.ring_attention(q, k, v, positions, causal=True).backward(grad_out)
    return q.grad, k.grad, v.grad


def test_ring_backward_written_differently_passes(capsys):
    ch12.check_ring_backward(backward_gradients_one_hop_behind)
    assert "✅" in capsys.readouterr().out


def test_ring_backward_that_keeps_gradients_at_home_is_refused_with_the_reason():
    with pytest.raises(CheckFailed, match=r"dk with world_size=3, rank 0 .* though dq is right"
                                          r".*come home — N = 3 hops"):
        ch12.check_ring_backward(backward_keeping_gradients_at_home)


def test_ring_backward_by_gathering_everything_is_refused():
    with pytest.raises(CheckFailed, match="called all_gather; ring attention's backward uses only"):
        ch12.check_ring_backward(backward_by_autograd_on_gathered)


def test_ring_backward_calling_the_course_is_refused():
    with pytest.raises(CheckFailed, match="course's own ring_attention"):
        ch12.check_ring_backward(backward_by_the_course)
