"""Parameters that more than one stage holds: a weight tied across stages (Megatron's embedding
and output head), a layer used in two places of the model, DualPipe's two copies of every piece.

Each stage trains its own copy. The copies start equal (`sync_copies`: the lowest stage's
values) and get the same gradient, the sum of every copy's (`sum_copies`, before the optimizer
step), so they take the same step and stay equal - what Megatron does for the embedding tied
between its first and last stage, here in point-to-point messages between the holders.
"""
import torch
import torch.distributed as dist

from ..devices import device
from ..pipeline_schedules import stage_of

SHARED = 2          # the messages' tag, apart from ACTIVATION (0) and GRADIENT (1)


def holders(parts, p, placement):
    """[(parameter, pieces it is in, stages holding it)] for every parameter of `parts`, by
    identity, in the order they first appear (every rank builds the same model: the same order
    everywhere). In the dual placement piece k is held by stages k and p - 1 - k."""
    where = {}
    for k, part in enumerate(parts):
        ranks = {k, p - 1 - k} if placement == "dual" else {stage_of(k, p, placement)[0]}
        for q in part.parameters():
            _, pieces, stages = where.setdefault(id(q), (q, set(), set()))
            pieces.add(k)
            stages.update(ranks)
    return [(q, pieces, sorted(stages)) for q, pieces, stages in where.values()]


def _exchange(stage, outgoing, incoming_sizes):
    """Send outgoing[peer] to every peer and receive a tensor of incoming_sizes[peer] from each,
    as one batch (NCCL would deadlock two ranks that each send before they receive; gloo does
    not mind)."""
    where = dict(dtype=stage.dtype, device=device())
    got = {peer: torch.empty(n, **where) for peer, n in sorted(incoming_sizes.items())}
    ops = [dist.P2POp(dist.isend, t, _global(stage, peer), stage.group, SHARED)
           for peer, t in sorted(outgoing.items())]
    ops += [dist.P2POp(dist.irecv, t, _global(stage, peer), stage.group, SHARED)
            for peer, t in got.items()]
    for work in dist.batch_isend_irecv(ops) if ops else []:
        work.wait()
    return got


def _global(stage, peer):
    return dist.get_global_rank(stage.group, peer) if stage.group else peer


def sync_copies(stage):
    """Give every copy of a parameter that sits in more than one piece (tied, reused) the values
    of its lowest holder, so the copies start equal even if the ranks built their models apart."""
    out, inn = {}, {}
    for q, pieces, ranks in stage.holders:
        if len(pieces) < 2 or len(ranks) < 2 or stage.rank not in ranks or q.is_meta:
            continue
        if stage.rank == ranks[0]:
            for peer in ranks[1:]:
                out.setdefault(peer, []).append(q)
        else:
            inn.setdefault(ranks[0], []).append(q)
    got = _exchange(stage, {r: torch.cat([q.detach().reshape(-1) for q in qs])
                            for r, qs in out.items()},
                    {r: sum(q.numel() for q in qs) for r, qs in inn.items()})
    with torch.no_grad():
        for r, qs in inn.items():
            for q, v in zip(qs, got[r].split([q.numel() for q in qs])):
                q.copy_(v.view_as(q))


def sum_copies(stage):
    """Before the optimizer step: every copy's gradient becomes the sum over all the copies
    (each holds the gradient of the uses that ran on its stage). A parameter that has a gradient
    on no copy (frozen, or unused) keeps None, as one process leaves it."""
    shared = {}                      # peer -> the parameters we both hold, in the same order
    for q, _, ranks in stage.holders:
        if q.requires_grad and stage.rank in ranks:
            for peer in ranks:
                if peer != stage.rank:
                    shared.setdefault(peer, []).append(q)
    if not shared:
        return
    where = dict(dtype=stage.dtype, device=device())

    def flat(qs):                    # the gradients, then which of them exist (1) or are None
        return torch.cat([(q.grad if q.grad is not None else torch.zeros_like(q)).reshape(-1)
                          for q in qs] + [torch.tensor([float(q.grad is not None) for q in qs],
                                                       **where)])
    sizes = {r: sum(q.numel() for q in qs) + len(qs) for r, qs in shared.items()}
    got = _exchange(stage, {r: flat(qs) for r, qs in shared.items()}, sizes)
    parts = {id(q): {stage.rank: q.grad} for qs in shared.values() for q in qs}
    for r, qs in shared.items():
        grads, flags = got[r].split([sizes[r] - len(qs), len(qs)])
        for q, g, f in zip(qs, grads.split([q.numel() for q in qs]), flags.tolist()):
            parts[id(q)][r] = g.view_as(q) if f else None
    for qs in shared.values():
        for q in qs:
            # in the holders' order on every copy: the same sum to the last bit everywhere
            gs = [g for _, g in sorted(parts[id(q)].items()) if g is not None]
            q.grad = None if not gs else sum(gs[1:], gs[0].clone())
