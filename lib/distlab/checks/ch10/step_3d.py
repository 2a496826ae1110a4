"""Workbook 10, exercise 3: one training step on a dp x pp x tp mesh you build."""
import copy

import torch
from torch.utils._python_dispatch import _disable_current_modes

from ... import data_parallel as _dp
from ... import mesh as _mesh
from ... import parallel3d as p3
from ...models import lm_loss, make_gpt, token_data
from .. import CheckFailed, _traffic, compare, forbid, passed, sizes_phrase
from ..ch01 import learner_run, no_object_collectives
from ._carried import _same_values, dp_problem, tp_problem


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
            _dp.average_gradients, _replica_pass, _values_problem, _grad_problem)


def _me(rank, dp, pp, tp, name):
    d, p, t = _mesh.coordinate(rank, (dp, pp, tp))
    return f"{name} on dp={dp} x pp={pp} x tp={tp}: rank {rank} (dp {d}, pp {p}, tp {t})"


def _sent_to(records, peer):
    """What this rank's messages to `peer` carried, in order, flat (the one rule's records)."""
    return torch.cat([torch.zeros(0, dtype=torch.float64)] + [
        c["values"] for c in records if c["kind"] == "send" and c["peer"] == peer])


def _values_problem(rank, dp, pp, tp, stage, records, replica, name):
    """The first pipeline message that carried the wrong values on this rank, as the sentence a
    learner reads; None when every message carried what the algorithm needs. (What the dp and tp
    calls delivered needs every member's records: the parent judges it, `_carried`.)"""
    shape = (dp, pp, tp)
    d, p, t = _mesh.coordinate(rank, shape)
    me = _me(rank, dp, pp, tp, name)
    _, _, acts, act_grads, _ = replica
    a, b = stage.start, stage.start + len(stage.blocks)
    scales = (1.0, 1.0 / dp)                      # the replica's mean loss, or already / dp
    if p < pp - 1:
        nxt = _mesh.rank_at((d, p + 1, t), shape)
        got = _sent_to(records, nxt)
        if _same_values(got, acts[b].flatten(), (1.0,)) is False:
            return (f"{me} sent rank {nxt} values that are not its stage's output (the "
                    f"activations after block {b - 1} of this replica's samples): send what the "
                    f"stage's forward returned on the activations it received.")
    if p > 0:
        prev = _mesh.rank_at((d, p - 1, t), shape)
        got = _sent_to(records, prev)
        if _same_values(got, act_grads[a].flatten(), scales) is False:
            return (f"{me} sent rank {prev} values that are not the gradient of the loss with "
                    f"respect to the activations it received: send inp.grad after the backward "
                    f"of the stage's output.")
    return None


def _grad_problem(rank, dp, pp, tp, stage, replica, global_grads, name):
    """The gradient left in .grad after the step, against the global batch's mean gradient, as
    the sentence a learner reads; None when every one is right."""
    me, gpt = _me(rank, dp, pp, tp, name), replica[0]
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
    with forbid(*_course_3d_code(), exercise="build the groups and take the step yourself"), \
            no_object_collectives("send the activations, gradients and losses themselves, as "
                                  "tensors"), _traffic.Carried() as carried:
        answer = fn(gpt, x.clone(), y.clone(), dp, pp, tp, STEP_LR)
    if not (isinstance(answer, tuple) and len(answer) == 2 and isinstance(answer[0], p3.Stage3D)):
        return {"error": f"step_3d should return (stage, loss): this rank's p3.Stage3D and "
                         f"the global loss; rank {rank} returned {type(answer).__name__}."}
    stage, loss = answer
    # The references run outside the trace's dispatch mode: they are the checker's work, not
    # the learner's, and every op through the mode costs a Python call.
    with _disable_current_modes():
        return _judge_step(rank, dp, pp, tp, fn, stage, loss, dense, x, y, carried.records)


def _judge_step(rank, dp, pp, tp, fn, stage, loss, dense, x, y, records):
    d = _mesh.coordinate(rank, (dp, pp, tp))[0]
    n = STEP_BATCH // dp
    # One process per replica: the gradient of the global mean loss is the replicas' mean.
    mine = range(stage.start, stage.start + len(stage.blocks))
    replicas = [_replica_pass(dense, x[e * n:(e + 1) * n], y[e * n:(e + 1) * n],
                              mine if e == d else ()) for e in range(dp)]
    grads = {k: sum(r[0].get_parameter(k).grad for r in replicas) / dp
             for k, _ in replicas[0][0].named_parameters()}
    name = getattr(fn, "__name__", "step_3d")
    values = _values_problem(rank, dp, pp, tp, stage, records, replicas[d], name)
    # for the parent: what this rank's calls carried within its dp and tp groups, and what they
    # had to deliver (its shard of the global mean gradient; the tp partial products' sums)
    groups = {dim: tuple(_mesh.peers(rank, (dp, pp, tp), dim, p3.NAMES)) for dim in ("dp", "tp")}
    inside = {dim: [c for c in records if c["kind"] != "recv" and c["values"] is not None
                    and (c["group"] == ranks if c["kind"] == "collective" else c["peer"] in ranks)]
              for dim, ranks in groups.items()}
    want_dp = [(pname, stage.shard_of(pname, grads[stage.dense_name(pname)]))
               for pname, _ in stage.named_parameters()]
    ref = replicas[0][0]
    params = {name: (p.detach().clone(), stage.shard_of(name, (
        ref.get_parameter(stage.dense_name(name)) - STEP_LR * grads[stage.dense_name(name)])
        .detach())) for name, p in stage.named_parameters()}
    loss = loss.item() if isinstance(loss, torch.Tensor) else loss
    return {"loss": loss, "ref_loss": sum(r[1] for r in replicas) / dp, "params": params,
            "values": values, "inside": inside, "want_dp": want_dp, "sums": replicas[d][4],
            "first_block": stage.start,
            "grads": _grad_problem(rank, dp, pp, tp, stage, replicas[d], grads, name)}


def _check_step_structure(trace, dp, pp, tp, name):
    """By the checkers' one traffic rule (`_traffic`): pipeline messages only to the neighbouring
    stage of the same (d, t), one replica's share of the activations; every collective on one of
    the rank's groups, a message only within them (a hand-written ring over the dp group is the
    dp all-reduce of the same bytes); the gradients averaged over the dp group."""
    shape = (dp, pp, tp)
    where = f"on dp={dp} x pp={pp} x tp={tp}"
    per_replica = STEP_BATCH // dp * STEP_CFG["seq_len"] * STEP_CFG["d_model"] * 8
    for rank in range(dp * pp * tp):
        d, p, t = _mesh.coordinate(rank, shape)
        groups = {dim: tuple(_mesh.peers(rank, shape, dim, p3.NAMES)) for dim in p3.NAMES}
        neighbours = {_mesh.rank_at((d, q, t), shape) for q in (p - 1, p + 1) if 0 <= q < pp}
        calls = _traffic.data_calls(_traffic.records(trace, rank))
        allowed = " and ".join(map(str, sorted(neighbours))) or "no one"

        def stray(c):
            return CheckFailed(
                f"{name} {where}: rank {rank} (dp {d}, pp {p}, tp {t}) sent {c['bytes']:,} bytes "
                f"to rank {c['peer']}; in the pipeline it only talks to the neighbouring stages "
                f"of its own replica and tp slice: rank {allowed} (and its dp group "
                f"{list(groups['dp'])}, for the gradients).")
        # a message within its dp or tp group may be a hand-written collective's (a ring)
        within = [c for c in calls if c["kind"] == "send" and c["peer"] not in neighbours]
        for c in calls:
            if c in within and c["peer"] not in groups["dp"] + groups["tp"]:
                raise stray(c)
            if c["kind"] == "collective" and c["group"] not in groups.values():
                raise CheckFailed(
                    f"{name} {where}: rank {rank}'s {c['op']} ran over ranks {list(c['group'])}; "
                    f"in 3D every collective stays inside one of its groups: tp "
                    f"{list(groups['tp'])}, pp {list(groups['pp'])}, dp {list(groups['dp'])}.")
        if p < pp - 1:
            nxt = _mesh.rank_at((d, p + 1, t), shape)
            sent = sum(c["bytes"] for c in calls if c["kind"] == "send" and c["peer"] == nxt)
            if sent != per_replica and within:
                raise stray(within[0])      # its activations went elsewhere (another mesh order)
            if sent != per_replica:
                raise CheckFailed(
                    f"{name} {where}: rank {rank} sent {sent:,} bytes of activations to the next "
                    f"stage (rank {nxt}); its replica's part of the batch is {per_replica:,} "
                    f"bytes ({STEP_BATCH // dp} samples x {STEP_CFG['seq_len']} tokens x "
                    f"{STEP_CFG['d_model']} features x 8 bytes): each replica runs only its 1/dp "
                    f"of the batch, once.")
        if dp > 1 and not any(c["group"] == groups["dp"] if c["kind"] == "collective"
                              else c["peer"] in groups["dp"] for c in calls):
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
            # pipeline messages (judged in the rank), what the dp and tp calls delivered (over
            # every member's records, `_carried`), then the gradient left in .grad
            me = _me(rank, dp, pp, tp, name)
            problem = (result["values"] or dp_problem(got, rank, (dp, pp, tp), me)
                       or tp_problem(got, rank, (dp, pp, tp), me) or result["grads"])
            if problem:
                raise CheckFailed(problem)
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
