"""Workbook 09's checkers: right answers pass however they are written; wrong scaling, missing
renormalisation, communication where none belongs and the course's own code are refused."""
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from distlab import expert_parallel as ep_lib
from distlab import moe as moe_lib
from distlab.checks import CheckFailed, ch09


# ---- the router's top-k gates -------------------------------------------------------------------

def top_k_gates(logits, k):                       # as the workbook's solution
    probs = logits.softmax(dim=-1)
    gates, experts = probs.topk(k, dim=-1)
    if k > 1:
        gates = gates / gates.sum(dim=-1, keepdim=True)
    return experts, gates


def top_k_softmax_of_chosen(logits, k):           # differently written: softmax over the k logits
    chosen, experts = logits.topk(k, dim=-1)
    if k == 1:
        return experts, logits.softmax(-1).gather(1, experts)
    return experts, chosen.softmax(dim=-1)


def top_k_not_renormalised(logits, k):
    gates, experts = logits.softmax(-1).topk(k, dim=-1)
    return experts, gates


def top_k_always_renormalised(logits, k):
    gates, experts = logits.softmax(-1).topk(k, dim=-1)
    return experts, gates / gates.sum(-1, keepdim=True)


def top_k_course(logits, k):
    r = moe_lib.route(logits, k)
    return r.experts, r.gates


def test_top_k_gates():
    ch09.check_top_k_gates(top_k_gates)
    ch09.check_top_k_gates(top_k_softmax_of_chosen)
    with pytest.raises(CheckFailed, match=r"k=2: token \d's 2 gates sum to .*renormalise"):
        ch09.check_top_k_gates(top_k_not_renormalised)
    with pytest.raises(CheckFailed, match=r"k=1: every gate is 1.0 .*no gradient"):
        ch09.check_top_k_gates(top_k_always_renormalised)
    with pytest.raises(CheckFailed, match=r"course's own route"):
        ch09.check_top_k_gates(top_k_course)


# ---- the Switch auxiliary loss -------------------------------------------------------------------

def switch_aux_loss(probs, experts):              # as the workbook's solution
    n_experts = probs.shape[1]
    f = torch.bincount(experts.reshape(-1), minlength=n_experts).to(probs.dtype) / experts.numel()
    return n_experts * (f * probs.mean(dim=0)).sum()


def aux_one_hot(probs, experts):                  # differently written: one-hot means
    n_experts = probs.shape[1]
    f = F.one_hot(experts, n_experts).to(probs.dtype).sum(1).mean(0) / experts.shape[1]
    return n_experts * torch.dot(f, probs.mean(0))


def aux_unscaled(probs, experts):
    return switch_aux_loss(probs, experts) / probs.shape[1]


def aux_per_token(probs, experts):
    n_experts = probs.shape[1]
    f = torch.bincount(experts.reshape(-1), minlength=n_experts).to(probs.dtype) / len(experts)
    return n_experts * (f * probs.mean(dim=0)).sum()


def aux_soft_f(probs, experts):                   # f from the probabilities: a gradient through f
    p = probs.mean(0)
    return probs.shape[1] * (p * p).sum() + 0 * experts.sum()


def aux_course(probs, experts):
    return moe_lib.load_balancing_loss(moe_lib.Routing(probs, experts, None, None, None))


def test_switch_aux_loss():
    ch09.check_switch_aux_loss(switch_aux_loss)
    ch09.check_switch_aux_loss(aux_one_hot)
    with pytest.raises(CheckFailed, match=r"uniform router .*expected 1, got 0.25 — 0.25× the "
                                          r"right value: multiply by E = 4"):
        ch09.check_switch_aux_loss(aux_unscaled)
    with pytest.raises(CheckFailed, match=r"top-2: expected .* 2× the right value: f_e is the "
                                          r"fraction of the T·k = 20 assignments"):
        ch09.check_switch_aux_loss(aux_per_token)
    with pytest.raises(CheckFailed, match=r"gradient of the probabilities.*f_e is a count of choices"):
        ch09.check_switch_aux_loss(aux_soft_f)
    with pytest.raises(CheckFailed, match=r"course's own load_balancing_loss"):
        ch09.check_switch_aux_loss(aux_course)


# ---- dispatch plan and combine, in the layer on real ranks -----------------------------------------

def plan_sorted_keys(experts, keep, n_experts, ep_size):       # differently written
    T, k = experts.shape
    flat, kept = experts.reshape(-1), keep.reshape(-1)
    index = torch.arange(T * k)
    key = flat * (T * k) + index                               # expert first, then position
    order = index[kept][torch.sort(key[kept]).indices]
    per_rank = n_experts // ep_size
    splits = [int(((flat[order] // per_rank) == j).sum()) for j in range(ep_size)]
    return order, splits


def plan_that_gathers_loads(experts, keep, n_experts, ep_size):
    # "every rank must know the global load": an all_gather the layer's count exchange makes
    # unnecessary
    if dist.is_initialized():
        loads = [torch.empty(n_experts, dtype=torch.long) for _ in range(dist.get_world_size())]
        dist.all_gather(loads, torch.bincount(experts[keep], minlength=n_experts))
    return plan_sorted_keys(experts, keep, n_experts, ep_size)


def plan_course(experts, keep, n_experts, ep_size):
    return ep_lib.dispatch_plan(experts, keep, n_experts, ep_size)


def combine_scatter(expert_out, token, gate, n_tokens):      # differently written
    index = token.unsqueeze(-1).expand_as(expert_out)
    return torch.zeros(n_tokens, expert_out.shape[1], dtype=expert_out.dtype).scatter_add(
        0, index, expert_out * gate.unsqueeze(-1))


def combine_with_barrier(expert_out, token, gate, n_tokens):
    dist.barrier()                                            # "wait for every expert"
    return combine_scatter(expert_out, token, gate, n_tokens)


def combine_course(expert_out, token, gate, n_tokens):
    return ep_lib.combine(expert_out, token, gate, n_tokens)


def test_dispatch_plan():
    ch09.check_dispatch_plan(plan_sorted_keys, world_sizes=(3,))
    with pytest.raises(CheckFailed, match=r"EP=3, rank 0's dispatch_plan communicated "
                                          r"\(all_gather of \d+ B, 2 collectives in all; from the run's trace\); "
                                          r"dispatch_plan is local arithmetic"):
        ch09.check_dispatch_plan(plan_that_gathers_loads, world_sizes=(3,))
    with pytest.raises(CheckFailed, match=r"course's own dispatch_plan"):
        ch09.check_dispatch_plan(plan_course, world_sizes=(3,))


def test_combine():
    ch09.check_combine(combine_scatter, world_sizes=(3,))
    with pytest.raises(CheckFailed, match=r"combine tried to communicate"):
        ch09.check_combine(combine_with_barrier, world_sizes=(3,))
    with pytest.raises(CheckFailed, match=r"course's own combine"):
        ch09.check_combine(combine_course, world_sizes=(3,))


def test_stubs_are_reported_as_not_written():
    def stub(*args):
        raise NotImplementedError

    for check, n in ((ch09.check_top_k_gates, 2), (ch09.check_switch_aux_loss, 2),
                     (ch09.check_dispatch_plan, 4), (ch09.check_combine, 4)):
        def stub_n(*args):
            raise NotImplementedError
        with pytest.raises(NotImplementedError, match="is not written yet"):
            check(stub_n)
