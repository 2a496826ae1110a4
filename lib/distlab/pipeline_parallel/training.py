"""Training a model pipelined: `train` runs a schedule for several SGD steps; DualPipe's two
copies of every piece have their gradients summed by `sum_dual_copies`, the copies of a weight
tied across stages by `sum_copies`."""
import torch
import torch.distributed as dist

from .. import _argcheck as check
from ..devices import device
from ..pipeline_schedules import n_pieces, placement_of
from .shared import sum_copies
from .stage import PipelineStage, split_model


def train(rank, world_size, schedule, model, batches, n_microbatches, in_shape, v=1,
          loss_fn=None, lr=0.05, prefix="net.", dtype=torch.float32):
    """Train `model.net` pipelined with `schedule(p, m)` for len(batches) SGD steps (where the
    chunks sit, the schedule says: a ps.Schedule's placement, else "loop"). In the dual placement
    (DualPipe) the model is cut into p pieces, each held by two stages: before the step the two
    copies' gradients are summed (`sum_dual_copies`), and the loss is the sum of the two ends'.
    A weight in two pieces (tied, or a layer used twice) has a copy on each stage that holds
    one: their gradients are summed before the step too (`sum_copies`), as Megatron does for the
    embedding tied between its first and last stage.

    Returns, per step, this rank's loss (last stage, else None), gradients and parameters after
    the step by full-model name, and the timeline; for tests and the notebook.
    """
    import torch.nn.functional as F
    _check_train(rank, world_size, schedule, model)
    loss_fn = loss_fn or F.mse_loss
    model = model.to(device=device(), dtype=dtype)
    schedule = schedule(world_size, n_microbatches)
    placement = placement_of(schedule)
    dual = placement == "dual"
    stage = PipelineStage(split_model(model.net, n_pieces(world_size, v, placement)), rank,
                          world_size, in_shape, dtype, placement=placement)
    actions = schedule[rank]
    named = [(f"{prefix}{n}", p) for c in sorted(stage.chunks)
             for n, p in stage.chunks[c].named_parameters()]
    out = []
    for x, y in batches:
        for p in stage.parameters():
            p.grad = None
        x, y = x.to(device(), dtype), y.to(device(), dtype)
        loss = stage.step(actions, x, y, n_microbatches, loss_fn)
        if dual:
            loss = sum_dual_copies(stage, loss)
        else:                       # a weight tied across stages: its copies' gradients summed
            sum_copies(stage)
        # a frozen (or unused) weight has no gradient, as in one process: None, not zeros
        grads = {n: None if p.grad is None else p.grad.clone() for n, p in named}
        with torch.no_grad():
            # Plain SGD, as torch.optim.SGD computes it; each stage updates only its own layers.
            # (Building a torch.optim optimizer imports torch._dynamo: seconds in a fresh rank.)
            for p in stage.parameters():
                if p.grad is not None:
                    p.add_(p.grad, alpha=-lr)
        out.append(dict(loss=None if loss is None else loss.item(), grads=grads,
                        params={n: p.detach().clone() for n, p in named},
                        timeline=stage.timeline, peak_bytes=stage.peak_activation_bytes,
                        peak_in_flight=stage.peak_in_flight))
    return out


def sum_dual_copies(stage, loss=None):
    """DualPipe holds every piece twice: stage r's chunk 0 and stage p - 1 - r's chunk 1 are
    the same layers, each with the gradient of the micro-batches that crossed it. Swap them with
    the partner stage and add (`sum_copies`, which sums every parameter over the stages holding
    it), so both copies hold the whole gradient (and take the same step); the two ends' partial
    losses are summed the same way. A weight that has a gradient on neither copy (frozen, or
    unused) keeps None, as one process leaves it. Returns the loss on stages 0 and p - 1, else
    None."""
    sum_copies(stage)
    if stage.rank not in (0, stage.p - 1):
        return None
    partner = stage.p - 1 - stage.rank
    peer = dist.get_global_rank(stage.group, partner) if stage.group else partner
    mine = torch.zeros(1, dtype=stage.dtype, device=device()) if loss is None else \
        loss.detach().reshape(1)
    theirs = torch.empty_like(mine)
    send = dist.isend(mine, dst=peer, group=stage.group)
    dist.recv(theirs, src=peer, group=stage.group)
    send.wait()
    return mine[0] + theirs[0]


def _check_train(rank, world_size, schedule, model):
    check.rank_in(rank, check.whole(world_size, "world_size", at_least=1))
    if not callable(schedule):
        raise TypeError(f"schedule must be a function of (p, m) such as ps.one_f_one_b, or "
                        f"lambda p, m: ps.make_schedule('1F1B', p, m); got {schedule!r}.")
    check.like(model, ("net",), "model", "a model whose layers are an nn.Sequential named net")
    check.instance(model.net, torch.nn.Sequential, "model.net", "an nn.Sequential to cut")
