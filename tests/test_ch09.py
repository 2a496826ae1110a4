"""Workbook 09's checkers: right answers pass however they are written; the chapter's own rules
where the exercise asks for another, naive numerics, wrong groups and divisors, decoy collectives
and the course's own code are refused, each with a sentence that names what broke."""
import math

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from distlab import expert_parallel as ep_lib
from distlab import moe as moe_lib
from distlab.checks import CheckFailed, ch09


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


def test_prioritized_route_accepts_right_answers():
    ch09.check_prioritized_route(route_loops, world_sizes=(2,))
    ch09.check_prioritized_route(route_vectorised, world_sizes=(3,))


def test_prioritized_route_refuses_wrong_ones():
    with pytest.raises(CheckFailed, match=r"your keep is the chapter's rule \(earlier tokens "
                                          r"first\); batch-prioritized routing .* token \d+'s "
                                          r"choice \d"):
        ch09.check_prioritized_route(route_token_order, world_sizes=(2,))
    with pytest.raises(CheckFailed, match=r"float32 logits near 100.*token \d+'s gates are nan: "
                                          r"exp of a logit near \d+ overflows float32"):
        ch09.check_prioritized_route(route_naive_softmax, world_sizes=(2,))
    with pytest.raises(CheckFailed, match=r"token \d+'s choice 2 \(expert \d\) was (kept|dropped)"
                                          r".*top-1 probability"):
        ch09.check_prioritized_route(route_by_own_slot_gate, world_sizes=(2,))
    with pytest.raises(CheckFailed, match=r"tokens 1 and 3 tied for expert 2's last place: token "
                                          r"1's choice 1 \(expert 2\) was dropped.*\(ties: the "
                                          r"earlier token first\)"):
        ch09.check_prioritized_route(route_ties_to_the_later, world_sizes=(2,))
    with pytest.raises(CheckFailed, match=r"gates carry no gradient back to the logits"):
        ch09.check_prioritized_route(route_detached, world_sizes=(2,))
    with pytest.raises(CheckFailed, match=r"course's own route; the exercise is to write the "
                                          r"prioritized routing yourself"):
        ch09.check_prioritized_route(route_course, world_sizes=(2,))
    with pytest.raises(CheckFailed, match=r"course's own _reference_route"):
        ch09.check_prioritized_route(route_reference, world_sizes=(2,))


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


def group_keep_course(experts, n_experts, capacity_factor, group):
    everyone = _gather_all(experts, group)
    all_experts = torch.cat(everyone)
    cap = math.ceil(capacity_factor * len(all_experts) * experts.shape[1] / n_experts)
    keep = moe_lib.capacity_keep(all_experts, n_experts, cap)
    start = sum(len(e) for e in everyone[:dist.get_rank(group)])
    return keep[start:start + len(experts)]


def group_keep_regenerated(experts, n_experts, capacity_factor, group):
    me, ws, k = dist.get_rank(group), dist.get_world_size(group), experts.shape[1]
    case = next(i for i in range(len(ch09.GROUP_CASES))
                if torch.equal(ch09._group_case(me, ws, n_experts, k, i), experts))
    everyone = [ch09._group_case(r, ws, n_experts, k, case) for r in range(ws)]
    capacity = math.ceil(capacity_factor * sum(len(e) for e in everyone) * k / n_experts)
    keep = moe_lib.capacity_keep(torch.cat(everyone), n_experts, capacity)
    start = sum(len(e) for e in everyone[:me])
    return keep[start:start + len(experts)]


def test_group_capacity_accepts_right_answers():
    ch09.check_group_capacity_keep(group_keep_counts, world_sizes=(2, 3))
    ch09.check_group_capacity_keep(group_keep_gather_everything, world_sizes=(4,))


def test_group_capacity_refuses_wrong_ones():
    local = (r"every rank applied the capacity to its own tokens only \(GShard's per-group "
             r"capacity, the chapter's layer\), so an expert can receive 3× its capacity")
    with pytest.raises(CheckFailed, match=local):
        ch09.check_group_capacity_keep(group_keep_local, world_sizes=(3,))
    with pytest.raises(CheckFailed, match=local):
        ch09.check_group_capacity_keep(group_keep_decoy, world_sizes=(3,))
    with pytest.raises(CheckFailed, match=r"with EP=3: rank \d (kept|dropped) its token \d+'s "
                                          r"choice \d \(expert \d\).* queue"):
        ch09.check_group_capacity_keep(group_keep_rank_major, world_sizes=(3,))
    with pytest.raises(CheckFailed, match=r"course's own capacity_keep"):
        ch09.check_group_capacity_keep(group_keep_course, world_sizes=(2,))
    # A cheat: the other ranks' choices rebuilt from the checker's own data, without a message.
    with pytest.raises(CheckFailed, match=r"course's own _group_case"):
        ch09.check_group_capacity_keep(group_keep_regenerated, world_sizes=(2,))


# ---- exercise 3: EP × DP gradients on an (ep, dp) layout -----------------------------------------------

def _my_dp_group(ep_size):
    world, rank = dist.get_world_size(), dist.get_rank()
    dp, mine = world // ep_size, None
    for e in range(ep_size):                       # every rank creates every group, in order
        group = dist.new_group([e * dp + d for d in range(dp)])
        if rank // dp == e:
            mine = group
    return mine


def reduce_groups(model, ep_size):                  # as the workbook's solution
    dp_group, world = _my_dp_group(ep_size), dist.get_world_size()
    experts = {id(p) for p in model.moe.expert_parameters()}
    for p in model.parameters():
        dist.all_reduce(p.grad, group=dp_group if id(p) in experts else None)
        p.grad /= world


def reduce_with_mesh(model, ep_size):               # differently written: a mesh, one flat buffer
    from torch.distributed.device_mesh import init_device_mesh
    world = dist.get_world_size()
    mesh = init_device_mesh("cpu", (ep_size, world // ep_size), mesh_dim_names=("ep", "dp"))
    experts = list(model.moe.experts.parameters())
    ids = {id(p) for p in experts}
    dense = [p for p in model.parameters() if id(p) not in ids]
    flat = torch.cat([p.grad.reshape(-1) for p in dense]) / world
    dist.all_reduce(flat)
    for p, piece in zip(dense, flat.split([p.numel() for p in dense])):
        p.grad.copy_(piece.view_as(p))
    for p in experts:
        dist.all_reduce(p.grad, group=mesh.get_group("dp"))
        p.grad.div_(world)


def reduce_chapter_layout(model, ep_size):          # the chapter's (dp, ep) groups: strided
    world, rank = dist.get_world_size(), dist.get_rank()
    mine = None
    for e in range(ep_size):
        group = dist.new_group(list(range(e, world, ep_size)))
        if rank % ep_size == e:
            mine = group
    experts = {id(p) for p in model.moe.expert_parameters()}
    for p in model.parameters():
        dist.all_reduce(p.grad, group=mine if id(p) in experts else None)
        p.grad /= world


def reduce_everything_everywhere(model, ep_size):
    for p in model.parameters():
        dist.all_reduce(p.grad)
        p.grad /= dist.get_world_size()


def reduce_experts_by_dp(model, ep_size):           # divides an expert's gradient by dp
    dp_group, world = _my_dp_group(ep_size), dist.get_world_size()
    experts = {id(p) for p in model.moe.expert_parameters()}
    for p in model.parameters():
        dist.all_reduce(p.grad, group=dp_group if id(p) in experts else None)
        p.grad /= (world // ep_size) if id(p) in experts else world


def reduce_decoy(model, ep_size):                   # collectives of zeros on the right groups
    dp_group = _my_dp_group(ep_size)
    experts = {id(p) for p in model.moe.expert_parameters()}
    for p in model.parameters():
        dist.all_reduce(torch.zeros_like(p.grad), group=dp_group if id(p) in experts else None)


def reduce_course(model, ep_size):
    ep_lib.reduce_gradients(model, _my_dp_group(ep_size))


def test_reduce_moe_gradients_accepts_right_answers():
    ch09.check_reduce_moe_gradients(reduce_groups, layouts=((4, 2), (6, 3)))
    ch09.check_reduce_moe_gradients(reduce_with_mesh, layouts=((6, 2),))


def test_reduce_moe_gradients_refuses_wrong_ones():
    with pytest.raises(CheckFailed, match=r"ep=3, dp=2 .*rank 0's gradient of moe\.experts\.0\."
                                          r".*that is the sum over ranks \[0, 3\], divided by 6 "
                                          r"\(rank 3 holds other experts\)"):
        ch09.check_reduce_moe_gradients(reduce_chapter_layout, layouts=((6, 3),))
    with pytest.raises(CheckFailed, match=r"ep=2, dp=2 \(4 ranks\): rank \d's gradient of "
                                          r"moe\.experts\.\d\.\w+\.\w+ \(its local expert, global "
                                          r"expert \d\).*that is the sum over its EP group \(the "
                                          r"ranks that hold different experts\), ranks \[\d, \d\], "
                                          r"divided by 4; .*ranks \[\d, \d\], and divide by all 4"):
        ch09.check_reduce_moe_gradients(reduce_chapter_layout, layouts=((4, 2),))
    with pytest.raises(CheckFailed, match=r"that is the sum over every rank, ranks \[0, 1, 2, 3, "
                                          r"4, 5\], divided by 6"):
        ch09.check_reduce_moe_gradients(reduce_everything_everywhere, layouts=((6, 3),))
    with pytest.raises(CheckFailed, match=r"ep=3, dp=2 .*that is the sum over its DP group \(the "
                                          r"ranks that hold the same experts\), ranks \[\d, \d\], "
                                          r"divided by 2; .*divide by all 6"):
        ch09.check_reduce_moe_gradients(reduce_experts_by_dp, layouts=((6, 3),))
    with pytest.raises(CheckFailed, match=r"that is this rank's own gradient: nothing from the "
                                          r"other ranks was added to it; a replicated parameter"):
        ch09.check_reduce_moe_gradients(reduce_decoy, layouts=((4, 2),))
    with pytest.raises(CheckFailed, match=r"course's own reduce_gradients"):
        ch09.check_reduce_moe_gradients(reduce_course, layouts=((4, 2),))


def test_stubs_are_reported_as_not_written():
    def stub(*args):
        raise NotImplementedError("exercise: replace this line with your code")

    for check in (ch09.check_prioritized_route, ch09.check_group_capacity_keep,
                  ch09.check_reduce_moe_gradients):
        with pytest.raises(NotImplementedError, match="is not written yet"):
            check(stub)



# ---- chapter 09 at real size: every number its prose quotes, recomputed ---------------------------

def _chapter_text():
    import pathlib
    import nbformat
    path = pathlib.Path(__file__).resolve().parent.parent / "notebooks" / "09_expert_parallel.ipynb"
    cells = nbformat.read(path, as_version=4).cells
    return " ".join(" ".join(c.source for c in cells if c.cell_type == "markdown").split())


def test_skewed_rows_keeps_the_assignments_and_refuses_impossible_shares():
    rows = ep_lib.skewed_rows(8192, 2, 8, 4.0)
    assert sum(rows) == 16384 and rows[0] == 4 * 16384 // 8 and max(rows[1:]) - min(rows[1:]) <= 1
    assert ep_lib.skewed_rows(8192, 2, 8, 1.0) == [2048] * 8
    with pytest.raises(ValueError, match="between 1 .balanced. and 8"):
        ep_lib.skewed_rows(8192, 2, 8, 9.0)


def test_real_size_imbalance_and_all_to_all_numbers_the_prose_quotes():
    """The Mixtral-8x7B layer at full size on meta tensors (balanced and 4x), and the all-to-all
    table beside DeepEP's published bandwidths: each claim of the chapter's sections 4 and 5."""
    import distlab
    from distlab.emulate import PRESETS
    text = _chapter_text()
    cfg = ep_lib.MIXTRAL_8X7B
    def both(rank, world_size):
        return [ep_lib.imbalanced_layer_step(rank, world_size, f) for f in (1.0, 4.0)]
    ranks = distlab.run(both, 8, emulate="h100-node", timeout=120)
    runs = {f: [r[i] for r in ranks] for i, f in enumerate((1.0, 4.0))}
    step = {f: max(r[1] for r in runs[f]) for f in runs}
    balanced_rows, balanced_expert = runs[1.0][0][0], runs[1.0][0][2]
    assert balanced_rows == 8192 * 2
    assert f"takes {step[4.0] / step[1.0]:.1f} times the balanced one" in text
    # the expert phase of the busiest rank grows with busiest/mean
    busy = max(runs[4.0], key=lambda r: r[0])
    assert busy[0] == 4 * balanced_rows and 3.8 < busy[2] / balanced_expert < 4.2
    assert "the phase runs at busiest/mean times the balanced time" in text
    # "the all-to-alls, and what waits for them, are under a tenth of a balanced layer"
    assert (step[1.0] - balanced_expert) / step[1.0] < 0.1 and "under a tenth" in text
    # the model (balanced + extra rows x per-row cost) beside the emulated run
    model = step[1.0] + (busy[0] - balanced_rows) * balanced_expert / balanced_rows
    assert abs(step[4.0] / model - 1) < 0.05
    assert "share their formulas" in text and "(measured)" not in text
    # section 5: a few per cent inside a node, several times more across two nodes; the model's
    # logical bandwidth within 10 % of DeepEP's dispatch at EP 8 x 2 (90 GB/s) and 8 x 4 (61)
    cluster = PRESETS["h100-cluster"]
    send = 8192 * cfg["top_k"] * cfg["d_model"] * 2
    t = {n: ep_lib.all_to_all_seconds(send, n, cluster) for n in (8, 16, 32)}
    assert 4 * t[8] / balanced_expert < 0.1 and t[16] / t[8] > 3
    for n, published in ((16, 90), (32, 61)):
        logical = send * (n - 1) / n / t[n] / 1e9
        assert abs(logical / published - 1) < 0.10, (n, logical)
    assert "within 10 % of DeepEP's measured dispatch at EP 8 × 2 and 8 × 4" in text
    assert "they cost several times more" in text


def test_all_to_all_seconds_inside_a_node_is_the_links_own_model():
    from distlab.emulate import PRESETS
    node = PRESETS["h100-node"]
    assert ep_lib.all_to_all_seconds(1e8, 8, node) == node.intra.seconds("all_to_all", 1e8, 8)
    # across nodes the NIC carries the cross-node half at EP 16: slower than any ring's rate
    two = PRESETS["h100-2x8"]
    assert ep_lib.all_to_all_seconds(1e8, 16, two) > 1e8 * 8 / 16 / two.inter.bandwidth


# ---- chapter 09 section 6 (modern MoE): the prose's numbers, and the verdicts its cells print ----

def test_modern_moe_prose_numbers():
    text = _chapter_text()
    # "bfloat16 keeps 8 bits of mantissa, so a logit between 32 and 64 is rounded to a multiple
    # of 0.25"
    assert torch.finfo(torch.bfloat16).eps == 2 ** -7            # 7 stored + 1 implicit bit
    for value in (32.1, 47.3, 63.9):
        rounded = float(torch.tensor(value).bfloat16())
        assert abs(rounded / 0.25 - round(rounded / 0.25)) == 0 and abs(rounded - value) <= 0.125
    assert "a logit between 32 and 64 is rounded to a multiple of 0.25" in text
    # "64 tokens, 4 experts, factor 1 (C = 16)"
    assert moe_lib.expert_capacity(64, 4, 1, 1.0) == 16 and "factor 1 (C = 16)" in text
    # fine-grained keeps the width x active experts of the coarse layer
    fine = moe_lib.fine_grained(16, 64, 8, 2, m=4, n_shared=1)
    assert (fine["top_k"] + fine["n_shared"]) * fine["hidden"] == 2 * 64


def test_modern_moe_cells_print_true_verdicts():
    """Each claim of section 4's balancing comparison and of section 6 is printed by its cell as a
    verdict (recomputed by nbval on every run); none of the stored verdicts may read False."""
    import pathlib
    import nbformat
    path = pathlib.Path(__file__).resolve().parent.parent / "notebooks" / "09_expert_parallel.ipynb"
    outputs = " ".join(o.get("text", "") for c in nbformat.read(path, as_version=4).cells
                       if c.cell_type == "code" for o in c.get("outputs", []))
    for claim in ("both methods end below a third of the unbalanced router's MaxVio: True",
                  "than one capacity for the group: True",
                  "task loss within 0.01, smaller bf16 error: True",
                  "while the whole batch stays at least as balanced: True"):
        assert claim in outputs, claim
    assert outputs.count("every rank equals one process, within 1e-12: True") == 3
    assert "False" not in outputs and "NOT within" not in outputs
