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


def _members(group):
    return [dist.get_global_rank(group, i) for i in range(dist.get_world_size(group))]


def by_messages(model, optimizer, group, donor):
    """Correct, written differently: the donor sends one flat buffer (parameters, then momenta,
    one message per member) to every other member with send/recv — the group's ranks are not
    0..k, and the messages are judged as the broadcast of the same tensors (the checkers' one
    traffic rule)."""
    params = list(model.parameters())
    with torch.no_grad():
        for p in params:
            if optimizer.state[p].get("momentum_buffer") is None:
                optimizer.state[p]["momentum_buffer"] = torch.zeros_like(p)
        momenta = [optimizer.state[p]["momentum_buffer"] for p in params]
        flat = torch.cat([t.reshape(-1) for t in params + momenta])
        if dist.get_rank() == donor:
            for peer in _members(group):
                if peer != donor:
                    dist.send(flat, peer)
        else:
            dist.recv(flat, donor)
        for t, part in zip(params + momenta, flat.split([t.numel() for t in params + momenta])):
            t.copy_(part.view_as(t))


def rebuilt_beside_zeros(model, optimizer, group, donor):
    """A decoy: the donor's state rebuilt from its recipe (the checker's, retyped: seed 10 +
    donor, 2 + donor steps of its own), beside a broadcast of zeros of the state's size."""
    torch.manual_seed(10 + donor)
    twin = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.Tanh(),
                               torch.nn.Linear(6, 3)).double()
    opt = torch.optim.SGD(twin.parameters(), lr=0.1, momentum=0.9)
    for s in range(2 + donor):
        x = torch.randn((5, 4), generator=torch.Generator().manual_seed(1000 * (10 + donor) + s),
                        dtype=torch.float64)
        opt.zero_grad()
        twin(x).pow(2).mean().backward()
        opt.step()
    with torch.no_grad():
        for p, q in zip(model.parameters(), twin.parameters()):
            p.copy_(q)
            optimizer.state[p]["momentum_buffer"] = opt.state[q]["momentum_buffer"].clone()
    size = 2 * sum(p.numel() for p in model.parameters())
    dist.broadcast(torch.zeros(size, dtype=torch.float64), src=donor, group=group)


def from_the_recipe(model, optimizer, group, donor):
    """A cheat: the checker's own recipe for the donor's state."""
    ch13._model_and_optimizer(10 + donor, 2 + donor)


def by_objects(model, optimizer, group, donor):
    """A cheat: the state pickled through an object collective."""
    box = [model.state_dict()]
    dist.broadcast_object_list(box, src=donor, group=group)
    model.load_state_dict(box[0])


def test_check_heal():
    said = battery(ch13.check_heal, correct=[heal], different=[by_messages, in_one_message],
                   wrong=[parameters_only], cheat=[the_course_heal, from_the_recipe, by_objects],
                   decoy=[from_the_first_member, rebuilt_beside_zeros])
    assert "momentum" in said["wrong"][0]
    assert "course's own _model_and_optimizer" in said["cheat"][1]
    assert "broadcast_object_list" in said["cheat"][2]
    assert "donor rank 2" in said["decoy"][0]
    assert "what their calls delivered does not hold the donor's parameter 0" in said["decoy"][1]
