"""Workbook 12's checkers: right answers written differently pass; wrong structure, wrong numbers
and the course's own code are refused with a sentence."""
import json
import math
from pathlib import Path

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


def merge_by_exponentiating(out_a, lse_a, out_b, lse_b):
    """Right for small scores: the denominators themselves, exp(lse), summed (overflows)."""
    wa, wb = torch.exp(lse_a), torch.exp(lse_b)
    total = wa + wb
    safe = torch.where(total == 0, torch.ones_like(total), total)
    return (out_a * wa.unsqueeze(-1) + out_b * wb.unsqueeze(-1)) / safe.unsqueeze(-1), \
        torch.log(total)


def test_merge_written_differently_passes(capsys):
    ch12.check_merge(merge_with_running_max)
    assert "✅" in capsys.readouterr().out


def test_merge_without_the_empty_row_guard_is_refused():
    with pytest.raises(CheckFailed, match="nan.*lse of -inf as weight 0"):
        ch12.check_merge(merge_without_guard)


def test_merge_by_averaging_is_refused_with_the_element():
    with pytest.raises(CheckFailed, match=r"merge's lse .*element \[0, 0, \d\]: expected"):
        ch12.check_merge(merge_by_averaging)


def test_merge_without_subtracting_the_lse_is_refused_at_lse_800():
    with pytest.raises(CheckFailed, match="lse is about 800: exp.800. overflows float64"):
        ch12.check_merge(merge_by_exponentiating)


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
    """Ring without block_attention or merge: a running maximum, and exp-scores and their sums
    rescaled whenever it grows (the online softmax written out)."""
    n = dist.get_world_size()
    q_pos = positions.to(torch.float64)
    top = torch.full(q.shape[:-1] + (1,), -math.inf, dtype=q.dtype)
    num, den, block = torch.zeros_like(q), torch.zeros_like(top), [k, v, q_pos]
    for step in range(n):
        s = q @ block[0].transpose(-2, -1) / math.sqrt(q.shape[-1])
        s = s.masked_fill(block[2][None, :] > q_pos[:, None], -math.inf)
        new_top = torch.maximum(top, s.amax(-1, keepdim=True))
        shift = torch.where(torch.isinf(new_top), torch.zeros_like(new_top), new_top)
        rescale = torch.exp(top - shift)
        p = torch.exp(s - shift)
        num, den, top = num * rescale + p @ block[1], den * rescale + p.sum(-1, keepdim=True), \
            new_top
        if step < n - 1:
            block = hop_with_parity(block)
    return num / den


def attention_with_a_fixed_shift(q, k, v, positions):
    """Exp-scores shifted by a constant instead of the running maximum: right for small
    scores, inf / inf at scores of a thousand."""
    n = dist.get_world_size()
    q_pos = positions.to(torch.float64)
    num, den, block = 0, 0, [k, v, q_pos]
    for step in range(n):
        s = q @ block[0].transpose(-2, -1) / math.sqrt(q.shape[-1])
        s = s.masked_fill(block[2][None, :] > q_pos[:, None], -math.inf)
        p = torch.exp(s - 50.0)
        num, den = num + p @ block[1], den + p.sum(-1, keepdim=True)
        if step < n - 1:
            block = hop_with_parity(block)
    return num / den


def attention_keeping_every_block(q, k, v, positions):
    """The ring's messages, right numbers, but every visiting block kept and one dense softmax
    over all of them at the end: the whole sequence's K/V on every rank."""
    n = dist.get_world_size()
    q_pos = positions.to(torch.float64)
    block, seen = [k, v, q_pos], []
    for step in range(n):
        seen.append(block)
        if step < n - 1:
            block = hop_with_parity(block)
    keys, values, pos = (torch.cat([b[i] for b in seen], dim=-2 if i < 2 else 0)
                         for i in range(3))
    s = q @ keys.transpose(-2, -1) / math.sqrt(q.shape[-1])
    s = s.masked_fill(pos[None, :] > q_pos[:, None], -math.inf)
    return torch.softmax(s, -1) @ values


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


def test_ring_attention_with_a_fixed_shift_is_refused_at_large_scores():
    with pytest.raises(CheckFailed, match="scores of about a thousand .* inf or nan.*running "
                                          "maximum"):
        ch12.check_ring_attention(attention_with_a_fixed_shift)


def test_ring_attention_that_keeps_every_block_is_refused_though_its_messages_are_right():
    with pytest.raises(CheckFailed, match=r"on 3 ranks and [\d,]+ on 5 .* K/V blocks more: it "
                                          r"keeps what it has seen"):
        ch12.check_ring_attention(attention_keeping_every_block)


def test_attention_by_all_gather_is_refused_though_its_numbers_are_right():
    with pytest.raises(CheckFailed, match="sent 0 messages per attention; the K/V blocks must "
                                          "travel"):
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


def backward_exponentiating_apart(q, k, v, positions, out, lse, grad_out):
    """The one-hop-behind ring, with P = exp(S) · exp(-lse): inf · 0 at large scores."""
    n = dist.get_world_size()
    q_pos = positions.to(torch.float64)
    c = 1 / math.sqrt(q.shape[-1])
    block, dq, grads = [k, v, q_pos], torch.zeros_like(q), None
    for step in range(n):
        bk, bv, bpos = block
        s = (q @ bk.transpose(-2, -1) * c).masked_fill(bpos[None, :] > q_pos[:, None], -math.inf)
        p = s.exp() * (-lse[..., None]).exp()
        ds = p * (grad_out @ bv.transpose(-2, -1) - (grad_out * out).sum(-1)[..., None])
        dq = dq + ds @ bk * c
        gk, gv = ds.transpose(-2, -1) @ q * c, p.transpose(-2, -1) @ grad_out
        grads = hop_with_parity([gk, gv] if grads is None else [grads[0] + gk, grads[1] + gv])
        if step < n - 1:
            block = hop_with_parity(block)
    return dq, grads[0], grads[1]


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


def test_ring_backward_exponentiating_scores_and_lse_apart_is_refused_at_large_scores():
    with pytest.raises(CheckFailed, match="scores of about a thousand .* inf or nan.*exp.S - lse."):
        ch12.check_ring_backward(backward_exponentiating_apart)


def test_ring_backward_calling_the_course_is_refused():
    with pytest.raises(CheckFailed, match="course's own ring_attention"):
        ch12.check_ring_backward(backward_by_the_course)



# ---- predict, then run: one ring step and its crossover ----------------------------------------

def step_per_token(c, heads, kv_heads, head_dim, itemsize, flops, link):
    """Written per token and per message: FLOPs a query spends on half the visiting block."""
    per_query = 4 * (c / 2) * heads * head_dim            # half the keys, causal zig-zag
    message = link.alpha + c * kv_heads * head_dim * itemsize / link.bandwidth
    return c * per_query / flops, message + message


def crossover_by_bisection(heads, kv_heads, head_dim, itemsize, flops, link):
    lo, hi = 0.0, 1.0
    args = (heads, kv_heads, head_dim, itemsize, flops, link)
    while step_per_token(hi, *args)[0] < step_per_token(hi, *args)[1]:
        hi *= 2
    for _ in range(200):
        mid = (lo + hi) / 2
        kernel, hop = step_per_token(mid, *args)
        lo, hi = (mid, hi) if kernel < hop else (lo, mid)
    return hi


def step_without_latency(c, heads, kv_heads, head_dim, itemsize, flops, link):
    return 2 * c * c * heads * head_dim / flops, \
        2 * c * kv_heads * head_dim * itemsize / link.bandwidth


def step_of_a_whole_block(c, heads, kv_heads, head_dim, itemsize, flops, link):
    kernel, hop = step_per_token(c, heads, kv_heads, head_dim, itemsize, flops, link)
    return 2 * kernel, hop


def step_with_query_heads_travelling(c, heads, kv_heads, head_dim, itemsize, flops, link):
    kernel, _ = step_per_token(c, heads, kv_heads, head_dim, itemsize, flops, link)
    return kernel, 2 * (link.alpha + c * heads * head_dim * itemsize / link.bandwidth)


def crossover_of_the_chapter(heads, kv_heads, head_dim, itemsize, flops, link):
    """The chapter's condition c >= (P / B)(KV / H)(item / 2) / f, latency left out."""
    return flops / link.bandwidth * kv_heads / heads * itemsize / 2 / 0.5


def crossover_by_the_course(heads, kv_heads, head_dim, itemsize, flops, link):
    return cp.overlap_condition(flops, link.bandwidth, heads, kv_heads, itemsize, causal=True)


def step_stub(c, heads, kv_heads, head_dim, itemsize, flops, link):
    raise NotImplementedError("exercise: replace this line with your code")


def test_ring_step_written_differently_passes_and_runs_below_and_above(capsys):
    ch12.check_ring_step(step_per_token, crossover_by_bisection)
    out = capsys.readouterr().out
    assert "✅" in out and out.count("emulated") >= 4
    assert "below your crossover" in out and "above your crossover" in out


@pytest.mark.parametrize("step, crossover, says", [
    (step_without_latency, crossover_by_bisection, "counts nothing; it pays 2·α"),
    (step_of_a_whole_block, crossover_by_bisection, r"half a block \(f = ½\)"),
    (step_with_query_heads_travelling, crossover_by_bisection, "K and V have kv_heads heads"),
    (step_per_token, crossover_of_the_chapter, "yours leaves out the latency"),
    (step_per_token, crossover_by_the_course, "course's own overlap_condition"),
])
def test_ring_step_names_the_term_that_is_off(step, crossover, says):
    with pytest.raises(CheckFailed, match=says):
        ch12.check_ring_step(step, crossover)


def test_ring_step_stub_fails_cleanly():
    with pytest.raises(NotImplementedError, match="ring_step is not written yet"):
        ch12.check_ring_step(step_stub, crossover_by_bisection)

# ---- chapter 12's long-context comparison, as the planner prices it (stale prose fails) ----------

NOTEBOOK = Path(__file__).resolve().parent.parent / "notebooks" / "12_context_parallelism.ipynb"


def _says(text):
    cells = json.loads(NOTEBOOK.read_text())["cells"]
    prose = " ".join(" ".join("".join(c["source"]) for c in cells
                              if c["cell_type"] == "markdown").split())
    assert text in prose, f"chapter 12's prose no longer says {text!r}: recompute and fix it"


def test_context_parallel_against_recompute_and_tp_as_the_chapter_quotes():
    """Section 7's ways to fit 262,144 tokens of Llama-2 7B, priced by layout.price (the planner
    of chapter 10, the one source of these numbers), as the notebook's cell calls it."""
    from distlab import hardware, layout
    model = layout.SHAPES["Llama-2 7B"]
    ways = [dict(dp=4, cp=1, tp=8, checkpointing="none"),
            dict(dp=4, cp=1, tp=8, checkpointing="selective"),
            dict(dp=4, cp=1, tp=8, checkpointing="full", sequence_parallel=False),
            dict(dp=4, cp=1, tp=8, checkpointing="full"),
            dict(dp=2, cp=2, tp=8, checkpointing="none"),
            dict(dp=2, cp=2, tp=8, checkpointing="full"),
            dict(dp=1, cp=4, tp=8, checkpointing="none"),
            dict(dp=1, cp=8, tp=4, checkpointing="none")]
    rows = [layout.price(model, pp=1, global_batch=4, seq_len=262_144, cluster="h100-cluster",
                         **w) for w in ways]
    none, selective, no_sp, full, cp2, cp2_full, cp4, cp8 = rows
    assert [r["fits"] for r in rows] == [False, False, False, True, False, True, True, True]
    for r in rows:       # the peak's parts add up to the peak the planner reports
        assert sum(r["peak_parts"].values()) == pytest.approx(r["gb"], rel=1e-12)
    assert selective["gb"] == none["gb"] and selective["step_s"] == none["step_s"]
    _says(f"TP+SP alone keeps {none['gb']:.0f} GB per GPU")
    device = hardware.PRESETS["h100-cluster"].device
    by_layer = {r: layout.layer_seconds(model, device, 262_144, 1, 8, recompute=r)
                for r in ("none", "full")}
    attention_share = ((by_layer["full"]["attention"] - by_layer["none"]["attention"])
                       / by_layer["full"]["recompute"])
    _says(f"each layer's whole input: {no_sp['gb']:.0f} GB) — {full['gb']:.1f} GB per GPU, but "
          f"every step runs the forward again: {full['step_s']:.1f} s, of which "
          f"{full['recompute_s']:.1f} s recompute ({attention_share * 100:.0f} % of it attention")
    block = 262_144 // 4
    _says(f"cp = 4 without recompute fits at {cp4['gb']:.1f} GB and takes {cp4['step_s']:.1f} s, "
          f"{full['step_s'] / cp4['step_s']:.2f} times faster: the ring's {block:,}-token blocks "
          f"hide their hops behind the attention (cp comm {cp4['cp_s']:.2f} s)")
    assert cp4["cp_s"] == 0.0 and cp2["gb"] > 80
    _says(f"cp = 2 misses 80 GB by {cp2['gb'] - 80:.1f} GB without recompute")
    assert cp2_full["step_s"] > cp4["step_s"]
    assert cp8["step_s"] < cp4["step_s"] and cp8["tp_s"] < cp4["tp_s"]
    _says(f"cp = 8 at tp = 4 is faster still ({cp8['step_s']:.1f} s at {cp8['gb']:.1f} GB): "
          f"halving *tp* cuts tensor parallelism's communication from {cp4['tp_s']:.2f} s to "
          f"{cp8['tp_s']:.2f} s")
    # attention FLOPs at this length: causal 2·s·h per token and layer forward, against 2·N
    per_token = layout.attention_flops(model, 262_144, 1) / 262_144 * model.layers
    ratio = per_token / (2 * model.params())
    assert round(ratio) == 5
    _says("attention at 262k tokens is about five times the dense FLOPs")


def test_the_ulysses_and_grouped_query_numbers_the_chapter_quotes():
    """Section 5's bytes: Q against K + V per token (why a ring rotates K/V), and what ring,
    all-gather and Ulysses send per rank per layer at 131,072 tokens (ulysses'
    communication_per_layer, which test_context_parallel checks against a traced run)."""
    from distlab import ulysses
    q_bytes, kv_bytes = 128 * 128 * 2, 2 * 8 * 128 * 2            # Llama 3 405B, bf16
    _says(f"rotating queries and outputs would move {2 * q_bytes // kv_bytes} times the bytes of "
          f"rotating K and V")
    assert 2 * (32 * 128 * 2) == 2 * 32 * 128 * 2                    # Llama-2 7B: the same

    def sent(way, heads, kv_heads, n):
        return sum(ulysses.communication_per_layer(way, 131_072, n, heads, kv_heads)) / 2 ** 20
    mha = [sent(w, 32, 32, 8) for w in ("ulysses", "ring", "all-gather")]
    _says("at *cp* = 8, Llama-2 7B's Ulysses sends {:,.0f} MiB per rank against the ring's {:,.0f} "
          "and all-gather's {:,.0f}".format(*mha))
    gqa = [sent(w, 128, 8, 8) for w in ("ulysses", "ring", "all-gather")]
    _says("at *cp* = 8 sends {:,.0f} MiB against the ring's {:,.0f} and all-gather's {:,.0f}; past 8 "
          "key/value heads it is refused".format(*gqa))
    with pytest.raises(ValueError, match="8 key/value heads do not split over cp = 16"):
        ulysses.check_heads(128, 8, 16)
    # the ring's bytes per rank hardly fall with cp, Ulysses' shrink as 1/cp
    assert sent("ring", 32, 32, 16) > sent("ring", 32, 32, 2)
    assert sent("ulysses", 32, 32, 16) == pytest.approx(sent("ulysses", 32, 32, 2) * (15 / 16) / (1 / 2) / 8)


def test_the_striped_balance_the_chapter_quotes():
    """Section 4's striped layout: busiest rank / mean over a ring's steps, 4 ranks."""
    ratios = []
    for c in (4, 4_096):
        held = [cp.striped_positions(4 * c, r, 4) for r in range(4)]
        work = [sum(cp.plan_work(cp.block_plan(held[r], held[(r - s) % 4], causal=True))
                    for s in range(4)) for r in range(4)]
        ratios.append(max(work) * 4 / sum(work))
    _says("at 4 tokens per rank the busiest rank does {:.4f} times the mean, at 4,096 tokens per "
          "rank {:.4f} times".format(*ratios))
