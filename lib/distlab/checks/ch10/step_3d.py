"""Workbook 10, exercise 3: one training step on a dp x pp x tp mesh you build."""
import copy

import torch
from torch.utils._python_dispatch import _disable_current_modes

from ... import data_parallel as _dp
from ... import mesh as _mesh
from ... import parallel3d as p3
from ...models import lm_loss, make_gpt, token_data
from .. import CheckFailed, compare, forbid, passed, sizes_phrase
from ..ch01 import collectives, learner_run
from ._carried import _Carried, _same_values


STEP_CFG = dict(vocab=32, d_model=16, n_heads=2, n_layers=4, seq_len=8)
STEP_LR = 0.1
# every parallelism at once; a middle stage with dp != tp (a mesh order with dp and tp swapped
# builds other groups there)
STEP_MESHES = ((2, 2, 2), (1, 3, 2))
STEP_BATCH = 8


def _step_data():
    return token_data(n=STEP_BATCH, seq_len=STEP_CFG["seq_len"], vocab=STEP_CFG["vocab"], seed=1)


def _replica_pass(dense, x, y, keep_blocks=()):
    """One process, the dense model on one replica's samples: (model with .grad, loss, the
    activations between blocks and their gradients, and for the blocks in `keep_blocks` the sums
    the tp all-reduces of a split block must produce: attention's and the MLP's output
    projections without their bias)."""
    gpt = copy.deepcopy(dense)          # far cheaper than building one again, traced
    sums = []

    def keep(module, inputs, out):
        sums.append(out.detach() - module.bias.detach())
    for i in keep_blocks:
        gpt.blocks[i].attn.proj.register_forward_hook(keep)
        gpt.blocks[i].mlp.fc2.register_forward_hook(keep)
    h = gpt.tok(x) + gpt.pos(torch.arange(x.shape[1]))
    hs = [h]
    for block in gpt.blocks:
        h = block(h)
        hs.append(h)
    for a in hs:
        a.retain_grad()
    loss = lm_loss(gpt.head(gpt.ln_f(h)), y)
    loss.backward()
    return gpt, loss.item(), [a.detach() for a in hs], [a.grad for a in hs], sums


def _course_3d_code():
    return (p3.train_step, p3.Mesh3D, p3.global_loss, _mesh.HandMesh, _mesh.device_mesh,
            _dp.average_gradients, _replica_pass, _values_problem)


def _values_problem(rank, dp, pp, tp, stage, carried, replica, global_grads, name):
    """The first value that travelled wrong on this rank (or the gradient left wrong), as the
    sentence a learner reads; None when everything carried what the algorithm needs."""
    shape = (dp, pp, tp)
    d, p, t = _mesh.coordinate(rank, shape)
    me = f"{name} on dp={dp} x pp={pp} x tp={tp}: rank {rank} (dp {d}, pp {p}, tp {t})"
    gpt, _, acts, act_grads, sums = replica
    a, b = stage.start, stage.start + len(stage.blocks)
    scales = (1.0, 1.0 / dp)                      # the replica's mean loss, or already / dp
    if p < pp - 1:
        nxt = _mesh.rank_at((d, p + 1, t), shape)
        got = torch.cat(carried.sent.get(nxt, [torch.zeros(0, dtype=torch.float64)]))
        if _same_values(got, acts[b].flatten(), (1.0,)) is False:
            return (f"{me} sent rank {nxt} values that are not its stage's output (the "
                    f"activations after block {b - 1} of this replica's samples): send what the "
                    f"stage's forward returned on the activations it received.")
    if p > 0:
        prev = _mesh.rank_at((d, p - 1, t), shape)
        got = torch.cat(carried.sent.get(prev, [torch.zeros(0, dtype=torch.float64)]))
        if _same_values(got, act_grads[a].flatten(), scales) is False:
            return (f"{me} sent rank {prev} values that are not the gradient of the loss with "
                    f"respect to the activations it received: send inp.grad after the backward "
                    f"of the stage's output.")
    groups = {dim: tuple(_mesh.peers(rank, shape, dim, p3.NAMES)) for dim in p3.NAMES}
    local = torch.cat([stage.shard_of(n, gpt.get_parameter(stage.dense_name(n)).grad).flatten()
                       for n, _ in stage.named_parameters()])
    if dp > 1:
        payload = [x.flatten() for e in carried.reduced if e["group"] == groups["dp"]
                   for x in e["input"] if x.numel() > 1]
        got = torch.cat(payload).double() if payload else torch.zeros(0, dtype=torch.float64)
        if payload and _same_values(got, local, scales) is not True:
            return (f"{me}: its all-reduces over the dp group {list(groups['dp'])} carried "
                    f"{got.numel():,} values that are not this rank's gradients ({local.numel():,}"
                    f" values, after its replica's backward): all-reduce each parameter's .grad "
                    f"(or one buffer of all of them), not a copy or zeros.")
    if tp > 1:
        results = [r for e in carried.reduced if e["group"] == groups["tp"] and e["result"]
                   for r in e["result"]]
        for i, want in enumerate(sums):
            if not any(r.shape == want.shape and torch.allclose(r.double(), want, atol=1e-9,
                                                                rtol=1e-7) for r in results):
                layer = "attention's output projection" if i % 2 == 0 else "the MLP's fc2"
                return (f"{me}: no all-reduce over its tp group {list(groups['tp'])} produced "
                        f"block {a + i // 2}'s {layer} (the sum of the tp ranks' partial "
                        f"products): run this rank's p3.Stage3D on its replica's activations — "
                        f"its split layers all-reduce the partial sums themselves.")
    for n, q in stage.named_parameters():
        want = stage.shard_of(n, global_grads[stage.dense_name(n)])
        if q.grad is None:
            return f"{me}: {n}.grad is None after the step; leave the averaged gradient there."
        if torch.allclose(q.grad, want, atol=1e-10, rtol=1e-8):
            continue
        own = stage.shard_of(n, gpt.get_parameter(stage.dense_name(n)).grad)
        if dp > 1 and torch.allclose(q.grad, own, atol=1e-10, rtol=1e-8):
            return (f"{me}: {n}.grad after the step is still this rank's own gradient (its "
                    f"replica's part of the batch only): put the dp group's mean back into "
                    f".grad — an average kept in a copy or a flat buffer must be copied back.")
        if dp > 1 and torch.allclose(q.grad, dp * want, atol=1e-10, rtol=1e-8):
            return (f"{me}: {n}.grad after the step is the SUM over the dp group, {dp} times the "
                    f"mean (a learning rate divided by dp gives the same parameters, but "
                    f".grad is what clipping, logging and the optimizer's state read): divide "
                    f"the gradient by dp.")
        try:
            compare(q.grad, want, f"{me}: {n}.grad after the step (against its shard of the "
                    f"global batch's mean gradient)", 1e-10, 1e-8)
        except CheckFailed as e:
            return str(e)
    return None


def _step_on_mesh(rank, world_size, dp, pp, tp, fn):
    gpt = make_gpt(seed=0, **STEP_CFG).double()
    dense = copy.deepcopy(gpt)          # the learner's function may change its gpt
    x, y = _step_data()
    with forbid(*_course_3d_code(), exercise="build the groups and take the step yourself"):
        with _Carried() as carried:
            answer = fn(gpt, x.clone(), y.clone(), dp, pp, tp, STEP_LR)
    if not (isinstance(answer, tuple) and len(answer) == 2 and isinstance(answer[0], p3.Stage3D)):
        return {"error": f"step_3d should return (stage, loss): this rank's p3.Stage3D and "
                         f"the global loss; rank {rank} returned {type(answer).__name__}."}
    stage, loss = answer
    # The references run outside the trace's dispatch mode: they are the checker's work, not
    # the learner's, and every op through the mode costs a Python call.
    with _disable_current_modes():
        return _judge_step(rank, dp, pp, tp, fn, stage, loss, dense, x, y, carried)


def _judge_step(rank, dp, pp, tp, fn, stage, loss, dense, x, y, carried):
    d = _mesh.coordinate(rank, (dp, pp, tp))[0]
    n = STEP_BATCH // dp
    # One process per replica: the gradient of the global mean loss is the replicas' mean.
    mine = range(stage.start, stage.start + len(stage.blocks))
    replicas = [_replica_pass(dense, x[e * n:(e + 1) * n], y[e * n:(e + 1) * n],
                              mine if e == d else ()) for e in range(dp)]
    grads = {k: sum(r[0].get_parameter(k).grad for r in replicas) / dp
             for k, _ in replicas[0][0].named_parameters()}
    values = _values_problem(rank, dp, pp, tp, stage, carried, replicas[d], grads,
                             getattr(fn, "__name__", "step_3d"))
    ref = replicas[0][0]
    params = {name: (p.detach().clone(), stage.shard_of(name, (
        ref.get_parameter(stage.dense_name(name)) - STEP_LR * grads[stage.dense_name(name)])
        .detach())) for name, p in stage.named_parameters()}
    loss = loss.item() if isinstance(loss, torch.Tensor) else loss
    return {"loss": loss, "ref_loss": sum(r[1] for r in replicas) / dp, "params": params,
            "values": values}


def _check_step_structure(trace, dp, pp, tp, name):
    """Pipeline messages only to the neighbouring stage of the same (d, t), one replica's share of
    the activations, gradients averaged over the dp group, all-reduces only inside a rank's groups."""
    shape = (dp, pp, tp)
    where = f"on dp={dp} x pp={pp} x tp={tp}"
    per_replica = STEP_BATCH // dp * STEP_CFG["seq_len"] * STEP_CFG["d_model"] * 8
    for rank in range(dp * pp * tp):
        d, p, t = _mesh.coordinate(rank, shape)
        groups = {dim: tuple(_mesh.peers(rank, shape, dim, p3.NAMES)) for dim in p3.NAMES}
        neighbours = {_mesh.rank_at((d, q, t), shape) for q in (p - 1, p + 1) if 0 <= q < pp}
        sent = {}
        for peer, nbytes in trace.sends(rank):
            if peer not in neighbours:
                allowed = " and ".join(map(str, sorted(neighbours))) or "no one"
                raise CheckFailed(
                    f"{name} {where}: rank {rank} (dp {d}, pp {p}, tp {t}) sent {nbytes:,} bytes "
                    f"to rank {peer}; in the pipeline it only talks to the neighbouring stages of "
                    f"its own replica and tp slice: rank {allowed}.")
            sent[peer] = sent.get(peer, 0) + nbytes
        if p < pp - 1:
            nxt = _mesh.rank_at((d, p + 1, t), shape)
            if sent.get(nxt, 0) != per_replica:
                raise CheckFailed(
                    f"{name} {where}: rank {rank} sent {sent.get(nxt, 0):,} bytes of activations "
                    f"to the next stage (rank {nxt}); its replica's part of the batch is "
                    f"{per_replica:,} bytes ({STEP_BATCH // dp} samples x {STEP_CFG['seq_len']} "
                    f"tokens x {STEP_CFG['d_model']} features x 8 bytes): each replica runs only "
                    f"its 1/dp of the batch, once.")
        reduces = [e for e in collectives(trace, rank) if e["op"] == "all_reduce"]
        for e in reduces:
            if e["group"] not in groups.values():
                raise CheckFailed(
                    f"{name} {where}: rank {rank}'s all_reduce ran over ranks {list(e['group'])}; "
                    f"in 3D every collective stays inside one of its groups: tp "
                    f"{list(groups['tp'])}, pp {list(groups['pp'])}, dp {list(groups['dp'])}.")
        if dp > 1 and not any(e["group"] == groups["dp"] for e in reduces):
            raise CheckFailed(
                f"{name} {where}: rank {rank} never all-reduced over its dp group "
                f"{list(groups['dp'])}; each replica sees 1/dp of the batch, so the replicas "
                f"must average their gradients before the step.")


def check_step_3d(fn, meshes=STEP_MESHES):
    """fn(gpt, x, y, dp, pp, tp, lr) on every rank -> (its Stage3D after one SGD step, the loss).

    Judged by what travels as well as by the result: the trace's messages and groups, then on
    every rank the values its messages and all-reduces carried (the activations and their
    gradients, the tp partial sums, the gradients over dp), the gradient left in .grad, the
    parameters and the loss, each against one process on the dense model."""
    name = getattr(fn, "__name__", "step_3d")
    for dp, pp, tp in meshes:
        got = learner_run(_step_on_mesh, dp * pp * tp, dp, pp, tp, fn, name=name, timeout=45,
                          hang_rule="every send needs the matching recv on the neighbouring "
                          "stage, and every rank must create every group in the same order.")
        where = f"on dp={dp} x pp={pp} x tp={tp}"
        for result in got:
            if "error" in result:
                raise CheckFailed(result["error"])
        _check_step_structure(got.trace, dp, pp, tp, name)
        for rank, result in enumerate(got):
            if result["values"]:
                raise CheckFailed(result["values"])
            compare(result["loss"], result["ref_loss"], f"{name} {where}: rank {rank}'s loss "
                    f"(the global batch's mean, as one process computes it)", 1e-10, 1e-10)
            for pname, (mine, expected) in result["params"].items():
                compare(mine, expected, f"{name} {where}: rank {rank}'s {pname} after the step "
                        f"(against its shard of one process's)", 1e-10, 1e-9)
    passed(f"{name} equals one process's SGD step on meshes "
           f"{sizes_phrase(['x'.join(map(str, s)) for s in meshes])}: every message carried "
           f"its replica's activations or their gradients to the neighbouring stage, the tp "
           f"all-reduces the partial sums, the dp all-reduces the gradients, and .grad holds "
           f"their mean.")
