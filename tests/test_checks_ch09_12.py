"""Every checker of workbooks 09 and 12 through the battery (tests/checker_battery.py): it
accepts the solution and a differently-written correct one, and refuses a wrong one, a cheat and
a decoy, each in one sentence. Checkers that take a group run on real subgroups (4 ranks as two
groups of 2; 5 ranks as {0, 2} and {1, 3, 4}), with inputs drawn afresh per check."""
import math

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from checker_battery import battery
from distlab import context_parallel as cp
from distlab import expert_parallel as ep_lib
from distlab import moe as moe_lib
from distlab.checks import ch09, ch12


# ==== workbook 09 ====================================================================================

# ---- exercise 1: batch-prioritized capacity ---------------------------------------------------------

def _top_k(probs, k):
    gates, experts = probs.topk(k, dim=-1)
    if k > 1:
        gates = gates / gates.sum(dim=-1, keepdim=True)
    return experts, gates


def route_loops(logits, k, capacity_factor):                 # as the workbook's solution
    probs = logits.softmax(dim=-1)
    experts, gates = _top_k(probs, k)
    T, E = probs.shape
    keep = torch.ones_like(experts, dtype=torch.bool)
    if capacity_factor is not None:
        capacity = math.ceil(capacity_factor * T * k / E)
        order = torch.sort(probs.detach().max(-1).values, descending=True, stable=True).indices
        filled = [0] * E
        for slot in range(k):
            for t in order.tolist():
                keep[t, slot] = filled[int(experts[t, slot])] < capacity
                filled[int(experts[t, slot])] += 1
    return experts, gates, keep


def route_vectorised(logits, k, capacity_factor):            # differently written: no loops
    probs = F.softmax(logits - logits.max(-1, keepdim=True).values, dim=-1)
    experts, gates = _top_k(probs, k)
    T, E = probs.shape
    if capacity_factor is None:
        return experts, gates, torch.ones(T, k, dtype=torch.bool)
    capacity = math.ceil(capacity_factor * T * k / E)
    order = torch.argsort(-probs.detach().amax(-1), stable=True)
    queue = experts[order].t().reshape(-1)                   # slot-major, by priority
    one_hot = F.one_hot(queue, E)
    place = ((one_hot.cumsum(0) - 1) * one_hot).sum(-1).view(k, T).t()
    keep = torch.empty(T, k, dtype=torch.bool)
    keep[order] = place < capacity
    return experts, gates, keep


def route_token_order(logits, k, capacity_factor):           # the chapter's rule
    probs = logits.softmax(dim=-1)
    experts, gates = _top_k(probs, k)
    cap = None if capacity_factor is None else math.ceil(capacity_factor * len(logits) * k
                                                         / logits.shape[-1])
    return experts, gates, _token_order_keep(experts, logits.shape[-1], cap)


def _token_order_keep(experts, n_experts, capacity):
    if capacity is None:
        return torch.ones_like(experts, dtype=torch.bool)
    one_hot = F.one_hot(experts.t().reshape(-1), n_experts)
    place = ((one_hot.cumsum(0) - 1) * one_hot).sum(-1)
    return (place < capacity).view(experts.shape[1], -1).t()


def route_naive_softmax(logits, k, capacity_factor):
    e = logits.exp()
    probs = e / e.sum(-1, keepdim=True)
    _, gates, keep = route_loops(logits, k, capacity_factor)
    experts, gates = _top_k(probs, k)
    return experts, gates, keep


def route_by_own_slot_gate(logits, k, capacity_factor):     # priority per slot by that slot's gate
    probs = logits.softmax(dim=-1)
    experts, gates = _top_k(probs, k)
    T, E = probs.shape
    keep = torch.ones_like(experts, dtype=torch.bool)
    if capacity_factor is not None:
        capacity = math.ceil(capacity_factor * T * k / E)
        filled = [0] * E
        for slot in range(k):
            for t in torch.sort(gates[:, slot].detach(), descending=True, stable=True).indices:
                keep[t, slot] = filled[int(experts[t, slot])] < capacity
                filled[int(experts[t, slot])] += 1
    return experts, gates, keep


def route_ties_to_the_later(logits, k, capacity_factor):  # equal priorities: the later token first
    flipped = route_loops(logits.flip(0), k, capacity_factor)
    return tuple(t.flip(0) for t in flipped)


def route_detached(logits, k, capacity_factor):
    experts, gates, keep = route_loops(logits, k, capacity_factor)
    return experts, gates.detach(), keep


def route_course(logits, k, capacity_factor):                # the course's route, then own keep
    r = moe_lib.route(logits, k, None)
    return r.experts, r.gates, route_loops(logits, k, capacity_factor)[2]


def route_reference(logits, k, capacity_factor):             # the checker's own reference
    _, experts, gates, keep, _, _ = ch09._reference_route(logits, k, capacity_factor)
    return experts, gates, keep


def test_prioritized_route_battery():
    said = battery(lambda fn: ch09.check_prioritized_route(fn, world_sizes=(2,)),
                   correct=[route_loops], different=[route_vectorised],
                   wrong=[route_naive_softmax, route_by_own_slot_gate, route_ties_to_the_later,
                          route_detached],
                   cheat=[route_course, route_reference], decoy=[route_token_order])
    assert "the chapter's rule (earlier tokens first)" in said["decoy"][0]
    assert "overflows float32" in said["wrong"][0]
    assert "course's own route" in said["cheat"][0]


# ---- exercise 2: the capacity of the whole EP group ---------------------------------------------------

def group_keep_counts(experts, n_experts, capacity_factor, group):    # as the workbook's solution
    T, k = experts.shape
    counts = torch.stack([torch.bincount(experts[:, s], minlength=n_experts) for s in range(k)])
    everyone = [torch.empty_like(counts) for _ in range(dist.get_world_size(group))]
    dist.all_gather(everyone, counts, group=group)
    everyone = torch.stack(everyone)                                   # [rank, slot, expert]
    me = dist.get_rank(group)
    capacity = math.ceil(capacity_factor * int(everyone[:, 0].sum()) * k / n_experts)
    keep = torch.empty_like(experts, dtype=torch.bool)
    for s in range(k):
        ahead = everyone[:, :s].sum(dim=(0, 1)) + everyone[:me, s].sum(0)
        one_hot = F.one_hot(experts[:, s], n_experts)
        keep[:, s] = ahead[experts[:, s]] + (one_hot.cumsum(0) * one_hot).sum(-1) - 1 < capacity
    return keep


def _gather_all(experts, group):
    everyone = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, experts, group=group)
    return everyone


def group_keep_gather_everything(experts, n_experts, capacity_factor, group):   # differently
    everyone = _gather_all(experts, group)
    me, k = dist.get_rank(group), experts.shape[1]
    capacity = math.ceil(capacity_factor * sum(len(e) for e in everyone) * k / n_experts)
    filled, keep = [0] * n_experts, torch.empty_like(experts, dtype=torch.bool)
    for slot in range(k):
        for r, theirs in enumerate(everyone):
            for t in range(len(theirs)):
                e = int(theirs[t, slot])
                if r == me:
                    keep[t, slot] = filled[e] < capacity
                filled[e] += 1
    return keep


def group_keep_local(experts, n_experts, capacity_factor, group):   # the chapter's per-rank rule
    cap = math.ceil(capacity_factor * len(experts) * experts.shape[1] / n_experts)
    return _token_order_keep(experts, n_experts, cap)


def group_keep_decoy(experts, n_experts, capacity_factor, group):
    dist.all_reduce(torch.zeros(n_experts), group=group)                # "the counts, exchanged"
    return group_keep_local(experts, n_experts, capacity_factor, group)


def group_keep_rank_major(experts, n_experts, capacity_factor, group):
    # all of rank 0's choices (both slots) before rank 1's: the queue is rank-major
    everyone = _gather_all(experts, group)
    me, k = dist.get_rank(group), experts.shape[1]
    capacity = math.ceil(capacity_factor * sum(len(e) for e in everyone) * k / n_experts)
    filled, keep = [0] * n_experts, torch.empty_like(experts, dtype=torch.bool)
    for r, theirs in enumerate(everyone):
        for slot in range(k):
            for t in range(len(theirs)):
                e = int(theirs[t, slot])
                if r == me:
                    keep[t, slot] = filled[e] < capacity
                filled[e] += 1
    return keep


def group_keep_world(experts, n_experts, capacity_factor, group):
    """Right on one group; with two groups side by side it counts the other group's tokens."""
    return group_keep_counts(experts, n_experts, capacity_factor, None)


def group_keep_zeros_rebuilt(experts, n_experts, capacity_factor, group):
    """An all_to_all of zeros ("the counts, exchanged"), the other ranks' choices rebuilt from
    the checker's own data with a guessed seed."""
    size = dist.get_world_size(group)
    dist.all_to_all_single(torch.zeros(size), torch.zeros(size), group=group)
    ranks = dist.get_process_group_ranks(group)
    everyone = [ch09._group_case(r, n_experts, experts.shape[1], 0) for r in ranks]
    return group_keep_local(torch.cat(everyone), n_experts, capacity_factor, group)[:len(experts)]


def test_group_capacity_keep_battery():
    said = battery(ch09.check_group_capacity_keep,
                   correct=[group_keep_counts], different=[group_keep_gather_everything],
                   wrong=[group_keep_local, group_keep_rank_major],
                   cheat=[group_keep_world, group_keep_zeros_rebuilt],
                   decoy=[group_keep_decoy])
    assert "per-group capacity, the chapter's layer" in said["wrong"][0]
    assert "reached ranks [0, 1, 2, 3], but its group is [0, 1]" in said["cheat"][0]
    assert "course's own _group_case" in said["cheat"][1]


# ---- exercise 3: a dispatch with static shapes ---------------------------------------------------------

def _padded_buffer(x, experts, keep, n_experts, capacity):
    buffer = x.new_zeros(n_experts, capacity, x.shape[1])      # [expert, slot, d]
    for e in range(n_experts):
        rows = x[((experts == e) & keep).any(dim=1)]
        buffer[e, :len(rows)] = rows
    return buffer


def dispatch_all_to_all(x, experts, keep, n_experts, capacity, group):   # as the solution
    n = dist.get_world_size(group)
    buffer = _padded_buffer(x, experts, keep, n_experts, capacity)
    received = torch.empty_like(buffer)
    dist.all_to_all_single(received, buffer, group=group)
    return received.view(n, n_experts // n, capacity, x.shape[1])


def dispatch_point_to_point(x, experts, keep, n_experts, capacity, group):   # differently
    """Vectorised slots, and a send/recv to every other rank of the group: the same bytes."""
    n, me = dist.get_world_size(group), dist.get_rank(group)
    ranks = dist.get_process_group_ranks(group)
    local = n_experts // n
    chosen = torch.where(keep, experts, n_experts)               # dropped: a dummy expert
    buffer = x.new_zeros(n_experts + 1, capacity + x.shape[0], x.shape[1])
    for slot in range(experts.shape[1]):
        one_hot = F.one_hot(chosen[:, slot], n_experts + 1)
        before = sum(F.one_hot(chosen[:, s], n_experts + 1) for s in range(experts.shape[1]))
        place = ((before.cumsum(0) - before) * one_hot).sum(-1)
        buffer[chosen[:, slot], place] = x
    buffer = buffer[:n_experts, :capacity].reshape(n, local, capacity, x.shape[1])
    out = torch.empty_like(buffer)
    out[me] = buffer[me]
    ops = [dist.P2POp(dist.isend, buffer[j].contiguous(), ranks[j], group) for j in range(n)
           if j != me]
    recv = {j: torch.empty_like(buffer[j]) for j in range(n) if j != me}
    ops += [dist.P2POp(dist.irecv, recv[j], ranks[j], group) for j in recv]
    for h in dist.batch_isend_irecv(ops):
        h.wait()
    for j, t in recv.items():
        out[j] = t
    return out


def dispatch_last_token_first(x, experts, keep, n_experts, capacity, group):
    """Each expert's rows from the last token to the first."""
    n = dist.get_world_size(group)
    buffer = _padded_buffer(x.flip(0), experts.flip(0), keep.flip(0), n_experts, capacity)
    received = torch.empty_like(buffer)
    dist.all_to_all_single(received, buffer, group=group)
    return received.view(n, n_experts // n, capacity, x.shape[1])


def dispatch_world(x, experts, keep, n_experts, capacity, group):
    """Right on one group; beside another it exchanges with the whole world."""
    n = dist.get_world_size(group)
    buffer = _padded_buffer(x, experts, keep, n_experts, capacity)
    everyone = [torch.empty_like(buffer) for _ in range(dist.get_world_size())]
    dist.all_gather(everyone, buffer)
    ranks, me = dist.get_process_group_ranks(group), dist.get_rank(group)
    local = n_experts // n
    return torch.stack([everyone[r][me * local:(me + 1) * local] for r in ranks])


def dispatch_uneven_then_padded(x, experts, keep, n_experts, capacity, group):
    """The chapter's way (uneven splits after a count exchange), padded on arrival: the right
    values, but an exchange whose size follows the routing."""
    n = dist.get_world_size(group)
    local = n_experts // n
    buffer = _padded_buffer(x, experts, keep, n_experts, capacity)
    counts = torch.tensor([int(((experts == e) & keep).sum()) for e in range(n_experts)])
    incoming = torch.empty_like(counts)
    dist.all_to_all_single(incoming, counts, group=group)
    rows = torch.cat([buffer[e, :counts[e]] for e in range(n_experts)])
    send = counts.view(n, local).sum(1).tolist()
    recv = incoming.view(n, local)
    got = x.new_empty(int(recv.sum()), x.shape[1])
    dist.all_to_all_single(got, rows, recv.sum(1).tolist(), send, group=group)
    out = x.new_zeros(n, local, capacity, x.shape[1])
    pieces = iter(got.split(recv.reshape(-1).tolist()))
    for s in range(n):
        for e in range(local):
            piece = next(pieces)
            out[s, e, :len(piece)] = piece
    return out


def test_padded_dispatch_battery():
    said = battery(ch09.check_padded_dispatch,
                   correct=[dispatch_all_to_all], different=[dispatch_point_to_point],
                   wrong=[dispatch_last_token_first], cheat=[dispatch_world],
                   decoy=[dispatch_uneven_then_padded])
    assert "in token order" in said["wrong"][0]
    assert "but its group is" in said["cheat"][0]
    assert "whatever the routing" in said["decoy"][0]


def test_workbook_09_stubs_are_reported_as_not_written():
    def stub(*args):
        raise NotImplementedError("exercise: replace this line with your code")

    for check in (ch09.check_prioritized_route, ch09.check_group_capacity_keep,
                  ch09.check_padded_dispatch):
        with pytest.raises(NotImplementedError, match="is not written yet"):
            check(stub)


# ==== workbook 12 ====================================================================================

# ---- exercise 1: the online softmax, as a flash kernel streams it -----------------------------------

def fold(state, scores, v):                                       # as the solution
    acc, m, l = state
    m_new = torch.maximum(m, scores.amax(dim=-1))
    safe = torch.where(torch.isinf(m_new), torch.zeros_like(m_new), m_new)
    rescale = torch.exp(m - safe)
    p = torch.exp(scores - safe.unsqueeze(-1))
    return acc * rescale.unsqueeze(-1) + p @ v, m_new, l * rescale + p.sum(-1)


def finish(state):
    acc, m, l = state
    seen = l > 0
    ones = torch.ones_like(l)
    out = acc / torch.where(seen, l, ones).unsqueeze(-1)
    return out, torch.where(seen, m + torch.log(torch.where(seen, l, ones)), -math.inf)


def fold_normalised(state, scores, v):
    """Differently: acc kept normalised, m holding the running log-sum-exp, l a count of blocks."""
    out, lse, blocks = state
    block_lse = torch.logsumexp(scores, dim=-1)
    new = torch.logaddexp(lse, block_lse)
    safe = torch.where(torch.isinf(new), torch.zeros_like(new), new)
    p = torch.exp(scores - safe.unsqueeze(-1))
    return out * torch.exp(lse - safe).unsqueeze(-1) + p @ v, new, blocks + 1


def finish_normalised(state):
    return state[0], state[1]


def finish_undivided(state):
    acc, m, l = state
    return acc, finish(state)[1]


def fold_without_rescaling(state, scores, v):
    """Decoy: the sum rescaled, the output not: right whenever a row's first block holds its
    maximum."""
    acc, m, l = state
    m_new = torch.maximum(m, scores.amax(dim=-1))
    safe = torch.where(torch.isinf(m_new), torch.zeros_like(m_new), m_new)
    p = torch.exp(scores - safe.unsqueeze(-1))
    return acc + p @ v, m_new, l * torch.exp(m - safe) + p.sum(-1)


def fold_with_its_first_maximum(state, scores, v):
    """Wrong at large jumps: every block weighed against the first maximum seen (exact in
    exact arithmetic, overflows when a later score is 800 above it)."""
    acc, m, l = state
    first = torch.where(torch.isinf(m), scores.amax(dim=-1), m)
    safe = torch.where(torch.isinf(first), torch.zeros_like(first), first)
    p = torch.exp(scores - safe.unsqueeze(-1))
    return acc + p @ v, first, l + p.sum(-1)


def fold_by_the_course(state, scores, v):
    acc, m, l = state
    out, lse = finish(state)
    block = torch.logsumexp(scores, -1)
    p = torch.exp(scores - torch.where(torch.isinf(block), 0.0, block).unsqueeze(-1))
    out, lse = cp.merge(out, lse, p @ v, block)
    return out, lse, torch.ones_like(l)


def test_online_softmax_battery():
    call = lambda check, pair: check(*pair)                       # noqa: E731
    said = battery(ch12.check_online_softmax, call=call,
                   correct=[(fold, finish)], different=[(fold_normalised, finish_normalised)],
                   wrong=[(fold, finish_undivided), (fold_with_its_first_maximum, finish)],
                   cheat=[(fold_by_the_course, finish_normalised)],
                   decoy=[(fold_without_rescaling, finish)])
    assert "its maximum arrives in the last block" in said["decoy"][0]
    assert "finish divides it by the softmax's denominator" in said["wrong"][0]
    assert "overflows float64" in said["wrong"][1]
    assert "course's own merge" in said["cheat"][0]


# ---- exercise 2: one hop of the ring -----------------------------------------------------------------

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


def hop_packed(tensors):
    """Differently: one packed message a hop (the bytes of every tensor, once)."""
    rank, n = dist.get_rank(), dist.get_world_size()
    flat = torch.cat([t.contiguous().view(-1).view(torch.uint8) for t in tensors])
    got = torch.empty_like(flat)
    ops = [dist.P2POp(dist.isend, flat, (rank + 1) % n), dist.P2POp(dist.irecv, got, (rank - 1) % n)]
    for h in dist.batch_isend_irecv(ops):
        h.wait()
    out, at = [], 0
    for t in tensors:
        nbytes = t.numel() * t.element_size()
        out.append(got[at:at + nbytes].view(t.dtype).view(t.shape).clone())
        at += nbytes
    return out


def hop_twice(tensors):
    """Decoy: the right values, and every tensor sent twice."""
    hop_with_parity(tensors)
    return hop_with_parity(tensors)


def test_ring_hop_battery():
    said = battery(ch12.check_ring_hop, correct=[hop_with_parity], different=[hop_packed],
                   wrong=[hop_to_the_left], cheat=[hop_by_all_gather, hop_by_the_course],
                   decoy=[hop_twice])
    assert "it should hold rank 2's tensors" in said["wrong"][0]
    assert "called all_gather" in said["cheat"][0]


# ---- exercise 3: ring attention with the queries travelling ------------------------------------------

def pass_q(q, k, v, positions):                                   # as the solution
    n = dist.get_world_size()
    scale = 1.0 / math.sqrt(q.shape[-1])
    pos = positions.to(torch.float64)
    out = torch.zeros_like(q)
    lse = torch.full(q.shape[:-1], -math.inf, dtype=q.dtype)
    visiting = [q, pos, out, lse]
    for _ in range(n):
        vq, vpos, vout, vlse = visiting
        vout, vlse = cp.merge(vout, vlse, *cp.block_attention(vq, k, v, vpos, pos, True, scale))
        visiting = hop_with_parity([vq, vpos, vout, vlse])
    return visiting[2]


def pass_q_own_softmax(q, k, v, positions):
    """Differently: scores written out, the partial result kept as (acc, max, sum), and only it
    on the last hop home."""
    n = dist.get_world_size()
    pos = positions.to(torch.float64)
    r = q.shape[1] // k.shape[1]
    kk, vv = k.repeat_interleave(r, 1), v.repeat_interleave(r, 1)
    state = [torch.zeros_like(q), torch.full(q.shape[:-1], -math.inf, dtype=q.dtype),
             torch.zeros(q.shape[:-1], dtype=q.dtype)]
    vq, vpos = q, pos
    for step in range(n):
        s = (vq @ kk.transpose(-2, -1)) / math.sqrt(q.shape[-1])
        s = s.masked_fill(pos[None, :] > vpos[:, None], -math.inf)
        state = list(fold(state, s, vv))
        if step < n - 1:
            vq, vpos, *state = hop_with_parity([vq, vpos, *state])
        else:
            state = hop_with_parity(state)
    return finish(state)[0]


def pass_q_not_home(q, k, v, positions):
    """Wrong: N - 1 hops, the output left on the rank where the queries ended."""
    n = dist.get_world_size()
    scale = 1.0 / math.sqrt(q.shape[-1])
    pos = positions.to(torch.float64)
    visiting = [q, pos, torch.zeros_like(q), torch.full(q.shape[:-1], -math.inf, dtype=q.dtype)]
    for step in range(n):
        vq, vpos, vout, vlse = visiting
        vout, vlse = cp.merge(vout, vlse, *cp.block_attention(vq, k, v, vpos, pos, True, scale))
        visiting = [vq, vpos, vout, vlse]
        if step < n - 1:
            visiting = hop_with_parity(visiting)
    visiting = hop_with_parity(visiting)                         # sends, but the queries' own
    return visiting[2] * 0 + vout


def pass_kv(q, k, v, positions):
    """Decoy: the chapter's ring (K and V travel): right numbers, the other algorithm."""
    n = dist.get_world_size()
    scale = 1.0 / math.sqrt(q.shape[-1])
    pos = positions.to(torch.float64)
    out = torch.zeros_like(q)
    lse = torch.full(q.shape[:-1], -math.inf, dtype=q.dtype)
    block = [k, v, pos]
    for step in range(n):
        out, lse = cp.merge(out, lse, *cp.block_attention(q, block[0], block[1], pos, block[2],
                                                          True, scale))
        if step < n - 1:
            block = hop_with_parity(block)
    return out


def pass_q_by_the_course(q, k, v, positions):
    return cp.ring_attention(q, k, v, positions, causal=True)


def test_ring_attention_pass_q_battery():
    said = battery(ch12.check_ring_attention_pass_q, correct=[pass_q],
                   different=[pass_q_own_softmax], wrong=[pass_q_not_home],
                   cheat=[pass_q_by_the_course], decoy=[pass_kv])
    assert "that is K and V travelling" in said["decoy"][0]
    assert "course's own ring_attention" in said["cheat"][0]


# ---- exercise 4: ring attention's backward -----------------------------------------------------------

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


def backward_as_the_solution(q, k, v, positions, out, lse, grad_out):
    n = dist.get_world_size()
    q_pos = positions.to(torch.float64)
    dq, travelling = torch.zeros_like(q), [k, v, q_pos, torch.zeros_like(k), torch.zeros_like(v)]
    for _ in range(n):
        bk, bv, bpos, bdk, bdv = travelling
        gq, gk, gv = _block_grads(q, bk, bv, q_pos, bpos, out, lse, grad_out)
        dq = dq + gq
        travelling = hop_packed([bk, bv, bpos, bdk + gk, bdv + gv])
    return dq, travelling[3], travelling[4]


def test_ring_backward_battery():
    said = battery(ch12.check_ring_backward, correct=[backward_as_the_solution],
                   different=[backward_gradients_one_hop_behind],
                   wrong=[backward_exponentiating_apart],
                   cheat=[backward_by_autograd_on_gathered, backward_by_the_course],
                   decoy=[backward_keeping_gradients_at_home])
    assert "though dq is right" in said["decoy"][0]


# ---- exercise 5: predict, then run ------------------------------------------------------------------

def step_as_the_solution(c, heads, kv_heads, head_dim, itemsize, flops, link):
    kernel = 0.5 * 4 * c * c * heads * head_dim / flops
    return kernel, 2 * (link.alpha + c * kv_heads * head_dim * itemsize / link.bandwidth)


def crossover_as_the_solution(heads, kv_heads, head_dim, itemsize, flops, link):
    a = 2 * heads * head_dim / flops
    b = 2 * kv_heads * head_dim * itemsize / link.bandwidth
    return (b + math.sqrt(b * b + 8 * a * link.alpha)) / (2 * a)


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


def test_ring_step_battery():
    call = lambda check, pair: check(*pair)                       # noqa: E731
    said = battery(ch12.check_ring_step, call=call,
                   correct=[(step_as_the_solution, crossover_as_the_solution)],
                   different=[(step_per_token, crossover_by_bisection)],
                   wrong=[(step_without_latency, crossover_by_bisection),
                          (step_with_query_heads_travelling, crossover_by_bisection)],
                   cheat=[(step_per_token, crossover_by_the_course)],
                   decoy=[(step_of_a_whole_block, crossover_by_bisection),
                          (step_per_token, crossover_of_the_chapter)])
    assert "K and V have kv_heads heads" in said["wrong"][1]
    assert "yours leaves out the latency" in said["decoy"][1]


# ---- exercise 6: per-document zig-zag ------------------------------------------------------------------

def per_document_loop(documents, rank, world_size):           # as the workbook's solution
    parts = 2 * world_size
    _, lengths = torch.unique_consecutive(documents, return_counts=True)
    held, start = [], 0
    for length in lengths.tolist():
        chunk = length // parts
        for i in (rank, parts - 1 - rank):
            held.append(torch.arange(start + i * chunk, start + (i + 1) * chunk))
        start += length
    return torch.cat(held)


def per_document_by_token(documents, rank, world_size):
    """Differently written: token by token, each token's chunk of its own document; the
    positions in another order (every document's early chunk first, then the late ones)."""
    ids = documents.tolist()
    early, late, start, i = [], [], 0, 0
    while i < len(ids):
        end = i
        while end < len(ids) and ids[end] == ids[i]:
            end += 1
        chunk = (end - i) // (2 * world_size)
        for p in range(i, end):
            which = (p - i) // chunk
            if which == rank:
                early.append(p)
            elif which == 2 * world_size - 1 - rank:
                late.append(p)
        i = end
    return torch.tensor(early + late)


def per_document_by_the_chapters_zigzag(documents, rank, world_size):
    """Differently written: chapter 12's zig-zag of one sequence, applied to each document."""
    ids = documents.tolist()
    starts = [i for i in range(len(ids)) if i == 0 or ids[i] != ids[i - 1]] + [len(ids)]
    return torch.cat([a + cp.zigzag_positions(b - a, rank, world_size)
                      for a, b in zip(starts, starts[1:])])


def per_document_without_offsets(documents, rank, world_size):
    """Wrong: each chunk's positions counted from its document's start, not the sequence's."""
    parts = 2 * world_size
    _, lengths = torch.unique_consecutive(documents, return_counts=True)
    return torch.cat([torch.arange(i * (n // parts), (i + 1) * (n // parts))
                      for n in lengths.tolist() for i in (rank, parts - 1 - rank)])


def per_document_off_by_one(documents, rank, world_size):
    """Wrong: chunks r and 2N − r (for rank 0 one past its document's last chunk)."""
    return _chunks_of(documents, (rank, 2 * world_size - rank), world_size)


def _chunks_of(documents, which, world_size):
    _, lengths = torch.unique_consecutive(documents, return_counts=True)
    held, start = [], 0
    for n in lengths.tolist():
        c = n // (2 * world_size)
        held += [torch.arange(start + i * c, start + (i + 1) * c) for i in which]
        start += n
    return torch.cat(held)


def per_document_by_the_course(documents, rank, world_size):
    return cp.document_zigzag_positions(documents, rank, world_size)


def zigzag_of_the_whole_sequence(documents, rank, world_size):
    """Decoy: chapter 12's zig-zag over the packed sequence; right on one document only."""
    return cp.zigzag_positions(len(documents), rank, world_size)


def chunks_r_and_n_plus_r(documents, rank, world_size):
    """Decoy: two chunks of every document on every rank (the token counts balance, every
    token once), but chunks r and N + r: the later ranks hold the later chunks."""
    return _chunks_of(documents, (rank, world_size + rank), world_size)


def mirrored_ranks(documents, rank, world_size):
    """Decoy: balanced work, chunks N − 1 − r and N + r: another rank's pair of chunks."""
    return per_document_loop(documents, world_size - 1 - rank, world_size)


def test_per_document_zigzag_battery():
    said = battery(ch12.check_per_document_zigzag, correct=[per_document_loop],
                   different=[per_document_by_token, per_document_by_the_chapters_zigzag],
                   wrong=[per_document_without_offsets, per_document_off_by_one],
                   cheat=[per_document_by_the_course],
                   decoy=[zigzag_of_the_whole_sequence, chunks_r_and_n_plus_r, mirrored_ranks])
    assert "held twice by rank 0" in said["wrong"][0]
    assert "course's own document_zigzag_positions" in said["cheat"][0]
    assert "that is zig-zag over the whole sequence" in said["decoy"][0]
    assert "busiest / mean" in said["decoy"][1]
    assert "the work is balanced, but rank 0 holds" in said["decoy"][2]


def test_workbook_12_stubs_are_reported_as_not_written():
    def stub(*args):
        raise NotImplementedError("exercise: replace this line with your code")

    for check, args in ((ch12.check_online_softmax, (stub, stub)), (ch12.check_ring_hop, (stub,)),
                        (ch12.check_ring_attention_pass_q, (stub,)),
                        (ch12.check_ring_backward, (stub,)),
                        (ch12.check_ring_step, (step_stub, crossover_by_bisection)),
                        (ch12.check_per_document_zigzag, (stub,))):
        with pytest.raises(NotImplementedError, match="is not written yet"):
            check(*args)
