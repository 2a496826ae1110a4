"""Workbook 11, exercise 5: a pipeline on a (dp, pp) mesh, forward and backward."""
import torch

from ...debug_parallel import PIPE_WIDTH, pipe_stage as _pipe_stage
from .. import CheckFailed, _traffic, compare, passed
from ._common import _plain, _refused, _traced


# The mesh order is the other one than chapter 10's: stages vary fastest, rank = replica * pp +
# stage. Shapes (dp, pp): one with replicas and one with three stages, so that a peer that is
# right on one shape only (rank ± dp, rank ± 2) fails on the other.

PIPE_SHAPES = ((2, 2), (1, 3))
PIPE_ROWS = 2                                 # PIPE_WIDTH: debug_parallel's stages'


def _pipe_input(replica):
    g = torch.Generator().manual_seed(20 + replica)
    return torch.randn(PIPE_ROWS, PIPE_WIDTH, generator=g, dtype=torch.float64)


def _pipe_expected(replica, pp, messages=False):
    """Each stage's gradients and the loss, in one process: loss = sum of the last output²; with
    `messages`, also what each stage must send: its output forward, its input's gradient back."""
    stages = [_pipe_stage(s) for s in range(pp)]
    acts = [_pipe_input(replica).requires_grad_()]
    for s in stages:
        acts.append(s(acts[-1]))
        acts[-1].retain_grad()
    loss = acts[-1].pow(2).sum()
    loss.backward()
    grads = [[p.grad.clone() for p in s.parameters()] for s in stages]
    if not messages:
        return loss.item(), grads
    return loss.item(), grads, [(acts[s + 1].detach(), acts[s].grad) for s in range(pp)]


def _pipeline_on_ranks(rank, world_size, pp, dp, fn):
    replica, stage = divmod(rank, pp)
    x = _pipe_input(replica) if stage == 0 else torch.zeros(PIPE_ROWS, PIPE_WIDTH,
                                                            dtype=torch.float64)
    module = _pipe_stage(stage)
    with _refused("send the activations and gradients yourself", _pipe_stage, _pipe_input), \
            _traffic.Carried() as carried:
        loss = fn(x, module, rank, pp, dp)
    grads = [None if p.grad is None else p.grad.clone() for p in module.parameters()]
    return {"loss": _plain(loss), "grads": grads,
            "sent": [(c["peer"], c["values"]) for c in carried.records if c["kind"] == "send"]}


def check_pipeline_step(fn):
    """fn(x, stage, rank, pp, dp) -> the loss on the last stage: forward through every stage of
    this replica, then backward, leaving each stage's gradients in its parameters. Judged by the
    checkers' one traffic rule: only messages, only with the neighbouring stages, and what they
    carried: the stage's output forward, its input's gradient back (not zeros of their size)."""
    name = getattr(fn, "__name__", "pipeline_step")
    for dp, pp in PIPE_SHAPES:
        where = f"with dp={dp} replicas x pp={pp} stages"
        got = _traced(_pipeline_on_ranks, pp * dp, name, pp, dp, fn,
                      rule="stage s of replica d is rank d*pp + s: the next stage is one rank "
                      "on, within the replica; the last stage sends nothing forward and the "
                      "first nothing back.")
        for rank in range(pp * dp):
            replica, stage = divmod(rank, pp)
            for e in _traffic.data_calls(_traffic.records(got.trace, rank)):
                if e["kind"] not in _traffic.P2P:
                    raise CheckFailed(f"{name} {where}: rank {rank} called {e['op']}; a pipeline "
                                      f"only sends and receives between neighbouring stages.")
                allowed = {rank + 1} if stage < pp - 1 else set()
                allowed |= {rank - 1} if stage > 0 else set()
                if e["peer"] not in allowed:
                    to = "to" if e["op"] == "send" else "from"
                    raise CheckFailed(
                        f"{name} {where}: rank {rank} (replica {replica}, stage {stage}) "
                        f"{'sent' if e['op'] == 'send' else 'received'} {e['bytes']} bytes "
                        f"{to} rank {e['peer']}, which is replica {e['peer'] // pp}'s stage "
                        f"{e['peer'] % pp}; rank = replica*pp + stage, so its neighbours are "
                        f"{sorted(allowed) or 'none'}.")
            sends = [e for e in _traffic.records(got.trace, rank) if e["kind"] == "send"]
            needed = (stage < pp - 1) + (stage > 0)
            if len(sends) != needed:
                raise CheckFailed(
                    f"{name} {where}: rank {rank} (stage {stage}) sent {len(sends)} messages; it "
                    f"sends its activation forward{' and' if needed == 2 else ''}"
                    f"{' its input gradient back' if stage > 0 else ''}: {needed}.")
        for replica in range(dp):
            loss, grads, messages = _pipe_expected(replica, pp, messages=True)
            last = replica * pp + pp - 1
            compare(got[last]["loss"], loss, f"{name} {where}: replica {replica}'s loss on its "
                    f"last stage (rank {last})", 1e-12, 1e-10)
            for stage in range(pp):
                rank = replica * pp + stage
                mine = got[rank]["grads"]
                if any(g is None for g in mine):
                    raise CheckFailed(f"{name} {where}: rank {rank} (stage {stage}) has no "
                                      f"gradient: run backward on every stage, from the gradient "
                                      f"the next stage sends back.")
                compare(mine, grads[stage], f"{name} {where}: rank {rank} (replica {replica}, "
                        f"stage {stage})'s gradients [weight, bias]", 1e-12, 1e-10)
            for stage in range(pp):     # what its messages carried, not only their sizes
                rank = replica * pp + stage
                _judge_carried(name, where, rank, replica, stage, pp, got[rank]["sent"],
                               messages[stage])
    passed(f"{name} runs forward and backward through the stages of each replica on "
           f"{' and '.join(f'dp={dp} x pp={pp}' for dp, pp in PIPE_SHAPES)}: every gradient "
           f"equals one process's.")


def _judge_carried(name, where, rank, replica, stage, pp, sent, expected):
    """Its message forward carried its stage's output, its message back its input's gradient
    (a decoy of zeros beside a pipeline recomputed from its recipe carries neither)."""
    out, back = expected
    for peer, want, what in ((rank + 1, out, "its stage's output"),
                             (rank - 1, back, "the gradient of the loss with respect to its "
                                              "input")):
        if not 0 <= peer - replica * pp < pp:
            continue
        if not any(p == peer and v.numel() == want.numel() and
                   torch.allclose(v, want.reshape(-1), atol=1e-12, rtol=1e-10) for p, v in sent):
            raise CheckFailed(
                f"{name} {where}: rank {rank} (replica {replica}, stage {stage})'s message to "
                f"rank {peer} did not carry {what}: the next stage computes on what arrives, so "
                f"send the values themselves — not zeros or a copy, beside numbers recomputed "
                f"from the stages' recipe.")
