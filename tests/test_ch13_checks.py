"""Workbook 13's checkers, proven by their verdicts (tests/checker_battery.py): each accepts the
solution and a differently written one, and refuses a wrong, a cheating and a decoy answer, each
in one sentence."""
import math

import torch
import torch.distributed as dist

from checker_battery import battery
from distlab import fault_tolerance
from distlab.checks import ch13


# ---- exercise 1 -------------------------------------------------------------------------------

def break_even_H(compute_s, sync_s, utilisation, overlap_steps):
    exposed = max(0.0, sync_s - overlap_steps * compute_s)
    least = max(1, overlap_steps)
    if exposed == 0:
        return least
    return max(least, math.ceil(exposed * utilisation / (compute_s * (1 - utilisation))))


def by_search(compute_s, sync_s, utilisation, overlap_steps):
    h = max(1, overlap_steps)
    while compute_s / (compute_s + max(0.0, sync_s - overlap_steps * compute_s) / h) < utilisation:
        h += 1
    return h


def rounded_down(compute_s, sync_s, utilisation, overlap_steps):
    exposed = max(0.0, sync_s - overlap_steps * compute_s)
    return max(1, overlap_steps, int(exposed * utilisation / (compute_s * (1 - utilisation))))


def from_the_checker(compute_s, sync_s, utilisation, overlap_steps):
    return ch13._reference_break_even(compute_s, sync_s, utilisation, overlap_steps)


def overlap_ignored(compute_s, sync_s, utilisation, overlap_steps):
    return break_even_H(compute_s, sync_s, utilisation, 0)   # right whenever overlap_steps == 0


def test_check_break_even_H():
    said = battery(ch13.check_break_even_H, correct=[break_even_H], different=[by_search],
                   wrong=[rounded_down], cheat=[from_the_checker], decoy=[overlap_ignored])
    assert "below 0.9" in said["wrong"][0]
    assert "course" in said["cheat"][0] or "yourself" in said["cheat"][0]
    assert "overlap_steps=5" in said["decoy"][0] or "overlap_steps=3" in said["decoy"][0]


# ---- exercise 2 -------------------------------------------------------------------------------

def topk_feedback(grad, error, k):
    corrected = grad + error
    flat = corrected.reshape(-1)
    keep = flat.abs().topk(k).indices
    sent = torch.zeros_like(flat)
    sent[keep] = flat[keep]
    sent = sent.view_as(grad)
    return sent, corrected - sent


def by_sorting(grad, error, k):
    corrected = grad + error
    order = corrected.reshape(-1).abs().argsort(descending=True)
    mask = torch.zeros(corrected.numel(), dtype=torch.bool)
    mask[order[:k]] = True
    sent = torch.where(mask.view_as(corrected), corrected, torch.zeros_like(corrected))
    return sent, corrected - sent


def forgets_the_old_error(grad, error, k):
    sent, _ = topk_feedback(grad, error, k)
    return sent, grad - sent


def sends_everything(grad, error, k):
    corrected = grad + error
    return corrected, torch.zeros_like(corrected)


def gradient_alone(grad, error, k):           # right on a first step, when the buffer is zero
    sent, _ = topk_feedback(grad, torch.zeros_like(error), k)
    return sent, grad + error - sent


def test_check_topk_feedback():
    said = battery(ch13.check_topk_feedback, correct=[topk_feedback], different=[by_sorting],
                   wrong=[forgets_the_old_error], cheat=[sends_everything],
                   decoy=[gradient_alone])
    assert "forgets the old error" in said["wrong"][0]
    assert "non-zero values" in said["cheat"][0]
    assert "gradient alone" in said["decoy"][0]


# ---- exercise 3 -------------------------------------------------------------------------------

def heal(model, optimizer, group, donor):
    with torch.no_grad():
        for p in model.parameters():
            dist.broadcast(p, src=donor, group=group)
            state = optimizer.state[p]
            if state.get("momentum_buffer") is None:
                state["momentum_buffer"] = torch.zeros_like(p)
            dist.broadcast(state["momentum_buffer"], src=donor, group=group)


def in_one_message(model, optimizer, group, donor):
    params = list(model.parameters())
    with torch.no_grad():
        for p in params:
            if optimizer.state[p].get("momentum_buffer") is None:
                optimizer.state[p]["momentum_buffer"] = torch.zeros_like(p)
        flat = torch.cat([p.reshape(-1) for p in params]
                         + [optimizer.state[p]["momentum_buffer"].reshape(-1) for p in params])
        dist.broadcast(flat, group_src=dist.get_group_rank(group, donor), group=group)
        sizes = [p.numel() for p in params] * 2
        pieces = flat.split(sizes)
        for p, v, m in zip(params, pieces[:len(params)], pieces[len(params):]):
            p.copy_(v.view_as(p))
            optimizer.state[p]["momentum_buffer"].copy_(m.view_as(p))


def parameters_only(model, optimizer, group, donor):
    with torch.no_grad():
        for p in model.parameters():
            dist.broadcast(p, src=donor, group=group)


def the_course_heal(model, optimizer, group, donor):
    members = [dist.get_global_rank(group, i) for i in range(dist.get_world_size(group))]
    fault_tolerance._heal(group, model, optimizer, members, donor, dist.get_rank())


def from_the_first_member(model, optimizer, group, donor):   # right when the donor comes first
    heal(model, optimizer, group, dist.get_global_rank(group, 0))


def test_check_heal():
    said = battery(ch13.check_heal, correct=[heal], different=[in_one_message],
                   wrong=[parameters_only], cheat=[the_course_heal],
                   decoy=[from_the_first_member])
    assert "momentum" in said["wrong"][0]
    assert "donor rank 2" in said["decoy"][0]
