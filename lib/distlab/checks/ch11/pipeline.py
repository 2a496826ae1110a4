"""Workbook 11, exercise 5: a pipeline on a (dp, pp) mesh, forward and backward."""
import torch

from ...debug_parallel import PIPE_WIDTH, pipe_stage as _pipe_stage
from .. import CheckFailed, compare, passed
from ._common import _plain, _refused, _traced


# The mesh order is the other one than chapter 10's: stages vary fastest, rank = replica * pp +
# stage. Shapes (dp, pp): one with replicas and one with three stages, so that a peer that is
# right on one shape only (rank ± dp, rank ± 2) fails on the other.

PIPE_SHAPES = ((2, 2), (1, 3))
PIPE_ROWS = 2                                 # PIPE_WIDTH: debug_parallel's stages'


def _pipe_input(replica):
    g = torch.Generator().manual_seed(20 + replica)
    return torch.randn(PIPE_ROWS, PIPE_WIDTH, generator=g, dtype=torch.float64)


def _pipe_expected(replica, pp):
    """Each stage's gradients and the loss, in one process: loss = sum of the last output²."""
    stages = [_pipe_stage(s) for s in range(pp)]
    x = _pipe_input(replica)
    for s in stages:
        x = s(x)
    loss = x.pow(2).sum()
    loss.backward()
    return loss.item(), [[p.grad.clone() for p in s.parameters()] for s in stages]


def _pipeline_on_ranks(rank, world_size, pp, dp, fn):
    replica, stage = divmod(rank, pp)
    x = _pipe_input(replica) if stage == 0 else torch.zeros(PIPE_ROWS, PIPE_WIDTH,
                                                            dtype=torch.float64)
    module = _pipe_stage(stage)
    with _refused("send the activations and gradients yourself", _pipe_stage, _pipe_input):
        loss = fn(x, module, rank, pp, dp)
    grads = [None if p.grad is None else p.grad.clone() for p in module.parameters()]
    return {"loss": _plain(loss), "grads": grads}


def check_pipeline_step(fn):
    """fn(x, stage, rank, pp, dp) -> the loss on the last stage: forward through every stage of
    this replica, then backward, leaving each stage's gradients in its parameters."""
    name = getattr(fn, "__name__", "pipeline_step")
    for dp, pp in PIPE_SHAPES:
        where = f"with dp={dp} replicas x pp={pp} stages"
        got = _traced(_pipeline_on_ranks, pp * dp, name, pp, dp, fn,
                      rule="stage s of replica d is rank d*pp + s: the next stage is one rank "
                      "on, within the replica; the last stage sends nothing forward and the "
                      "first nothing back.")
        for rank in range(pp * dp):
            replica, stage = divmod(rank, pp)
            for e in got.trace.comm(rank):
                if e["op"] not in ("send", "recv"):
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
            sends = [e for e in got.trace.comm(rank) if e["op"] == "send"]
            needed = (stage < pp - 1) + (stage > 0)
            if len(sends) != needed:
                raise CheckFailed(
                    f"{name} {where}: rank {rank} (stage {stage}) sent {len(sends)} messages; it "
                    f"sends its activation forward{' and' if needed == 2 else ''}"
                    f"{' its input gradient back' if stage > 0 else ''}: {needed}.")
        for replica in range(dp):
            loss, grads = _pipe_expected(replica, pp)
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
    passed(f"{name} runs forward and backward through the stages of each replica on "
           f"{' and '.join(f'dp={dp} x pp={pp}' for dp, pp in PIPE_SHAPES)}: every gradient "
           f"equals one process's.")
