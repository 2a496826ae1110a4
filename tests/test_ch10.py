"""Workbook 10's checkers: right answers written three ways pass; a wrong structure, a cheat and
the forbidden in-place edit are refused with the sentence a learner reads."""
import pytest
import torch
import torch.distributed as dist

from distlab import parallel3d as p3
from distlab.checks import CheckFailed, ch10
from distlab.models import lm_loss


# ---- exercise 1: unshard_column ------------------------------------------------------------------

def unshard_column(shards, chunks):
    pieces = [s.chunk(chunks, dim=0) for s in shards]
    return torch.cat([torch.cat([p[j] for p in pieces]) for j in range(chunks)])


def unshard_column_by_index(shards, chunks):
    # Differently written: fill a preallocated tensor row by row.
    rows = sum(len(s) for s in shards)
    out = shards[0].new_empty((rows,) + tuple(shards[0].shape[1:]))
    per, i = len(shards[0]) // chunks, 0
    for j in range(chunks):
        for s in shards:
            out[i:i + per] = s[j * per:(j + 1) * per]
            i += per
    return out


def test_unshard_column(capsys):
    ch10.check_unshard_column(unshard_column)
    ch10.check_unshard_column(unshard_column_by_index)
    assert capsys.readouterr().out.count("✅") == 2
    # Wrong: the shards concatenated as they come, q, k and v mixed up.
    with pytest.raises(CheckFailed, match=r"2 shards of 3 stacked matrices .*element \[2, 0\]"):
        ch10.check_unshard_column(lambda shards, chunks: torch.cat(shards))
    with pytest.raises(CheckFailed, match=r"course's own _reference_unshard"):
        ch10.check_unshard_column(lambda shards, chunks: ch10._reference_unshard(shards, chunks))


# ---- exercise 2: global_loss ---------------------------------------------------------------------

def global_loss(shard_loss, mesh):
    loss = shard_loss.clone() if mesh.p == mesh.pp - 1 else torch.zeros_like(shard_loss)
    dist.all_reduce(loss, group=mesh.get_group("pp"))
    dist.all_reduce(loss, group=mesh.get_group("dp"))
    return loss.item() / mesh.dp


def global_loss_broadcast_avg(shard_loss, mesh):
    # Differently written: the last stage broadcasts along the pipeline, then ReduceOp.AVG.
    from torch.distributed import ReduceOp, all_reduce, broadcast
    loss = shard_loss.detach().clone()
    broadcast(loss, src=mesh.pp_rank(mesh.pp - 1), group=mesh.get_group("pp"))
    all_reduce(loss, op=ReduceOp.AVG, group=mesh.get_group("dp"))
    return loss.item()


def global_loss_in_place(shard_loss, mesh):
    # Right numbers, but the caller's loss is overwritten (what the text forbids).
    if mesh.p != mesh.pp - 1:
        shard_loss.zero_()
    dist.all_reduce(shard_loss, group=mesh.get_group("pp"))
    dist.all_reduce(shard_loss, group=mesh.get_group("dp"))
    return shard_loss.item() / mesh.dp


def test_global_loss(capsys):
    ch10.check_global_loss(global_loss)
    ch10.check_global_loss(global_loss_broadcast_avg)
    assert capsys.readouterr().out.count("✅") == 2
    with pytest.raises(CheckFailed, match=r"changed rank \d's shard_loss in place .*reduce a clone"):
        ch10.check_global_loss(global_loss_in_place)
    with pytest.raises(CheckFailed, match=r"course's own global_loss"):
        ch10.check_global_loss(lambda shard_loss, mesh: p3.global_loss(shard_loss, mesh))


# ---- exercise 3: step_3d -------------------------------------------------------------------------

def _groups_by_hand(dp, pp, tp):
    rank = dist.get_rank()
    d, p, t = rank // (pp * tp), rank // tp % pp, rank % tp

    def at(d, p, t):
        return (d * pp + p) * tp + t

    mine = {}
    for key, lists in {
            "tp": [[at(a, b, i) for i in range(tp)] for a in range(dp) for b in range(pp)],
            "pp": [[at(a, i, c) for i in range(pp)] for a in range(dp) for c in range(tp)],
            "dp": [[at(i, b, c) for i in range(dp)] for b in range(pp) for c in range(tp)]}.items():
        for ranks in lists:
            group = dist.new_group(ranks)
            if rank in ranks:
                mine[key] = group
    return (d, p, t), at, mine


def step_3d(gpt, x, y, dp, pp, tp, lr, whole_batch=False, world_dp=False):
    (d, p, t), at, groups = _groups_by_hand(dp, pp, tp)
    stage = p3.Stage3D(gpt, p, pp, groups["tp"])
    n = len(x) // dp
    if not whole_batch:
        x, y = x[d * n:(d + 1) * n], y[d * n:(d + 1) * n]
    if stage.first:
        inp = x
    else:
        inp = torch.empty(len(x), x.shape[1], gpt.tok.embedding_dim, dtype=torch.float64)
        dist.recv(inp, src=at(d, p - 1, t))
        inp.requires_grad_()
    out = stage(inp)
    if stage.last:
        loss = lm_loss(out, y)
        loss.backward()
    else:
        dist.send(out.detach(), dst=at(d, p + 1, t))
        grad = torch.empty_like(out)
        dist.recv(grad, src=at(d, p + 1, t))
        out.backward(grad)
    if not stage.first:
        dist.send(inp.grad, dst=at(d, p - 1, t))
    if not whole_batch:
        for q in stage.parameters():
            dist.all_reduce(q.grad, group=None if world_dp else groups["dp"])
            q.grad /= dp
    with torch.no_grad():
        for q in stage.parameters():
            q -= lr * q.grad
    total = loss.detach().clone() if stage.last else torch.zeros((), dtype=torch.float64)
    dist.all_reduce(total, group=groups["pp"])
    dist.all_reduce(total, group=groups["dp"])
    return stage, total.item() / dp


def step_3d_device_mesh(gpt, x, y, dp, pp, tp, lr):
    # Differently written: DeviceMesh's groups, batch_isend_irecv, ReduceOp.AVG, one flat buffer.
    from torch.distributed import P2POp, ReduceOp, all_reduce, batch_isend_irecv, irecv, isend
    from torch.distributed.device_mesh import init_device_mesh
    mesh = init_device_mesh("cpu", (dp, pp, tp), mesh_dim_names=("dp", "pp", "tp"))
    d, p, t = mesh.get_coordinate()
    pipe = dist.get_process_group_ranks(mesh.get_group("pp"))
    stage = p3.Stage3D(gpt, p, pp, mesh.get_group("tp"))
    n = len(x) // dp
    x, y = x[d * n:(d + 1) * n], y[d * n:(d + 1) * n]
    inp = x
    if p > 0:
        inp = torch.empty(n, x.shape[1], gpt.tok.embedding_dim, dtype=torch.float64)
        for w in batch_isend_irecv([P2POp(irecv, inp, pipe[p - 1])]):
            w.wait()
        inp.requires_grad_()
    out = stage(inp)
    if p == pp - 1:
        loss = lm_loss(out, y)
        torch.autograd.backward(loss)
    else:
        grad = torch.empty_like(out)
        for w in batch_isend_irecv([P2POp(isend, out.detach(), pipe[p + 1]),
                                    P2POp(irecv, grad, pipe[p + 1])]):
            w.wait()
        torch.autograd.backward(out, grad)
    if p > 0:
        for w in batch_isend_irecv([P2POp(isend, inp.grad, pipe[p - 1])]):
            w.wait()
    flat = torch.cat([q.grad.flatten() for q in stage.parameters()])
    all_reduce(flat, op=ReduceOp.AVG, group=mesh.get_group("dp"))
    i = 0
    with torch.no_grad():
        for q in stage.parameters():
            q -= lr * flat[i:i + q.numel()].view_as(q)
            i += q.numel()
    total = loss.detach().clone() if p == pp - 1 else torch.zeros((), dtype=torch.float64)
    all_reduce(total, group=mesh.get_group("pp"))
    all_reduce(total, op=ReduceOp.AVG, group=mesh.get_group("dp"))
    return stage, total.item()


def step_3d_whole_batch(gpt, x, y, dp, pp, tp, lr):
    # Every replica runs the whole batch: the right numbers, with no data parallelism at all.
    return step_3d(gpt, x, y, dp, pp, tp, lr, whole_batch=True)


def step_3d_with_the_course(gpt, x, y, dp, pp, tp, lr):
    mesh = p3.Mesh3D(dp, pp, tp)
    stage = p3.Stage3D.from_dense(gpt, mesh)
    return stage, p3.train_step(stage, mesh, x, y, 1, lr)


def test_step_3d_passes_two_ways(capsys):
    ch10.check_step_3d(step_3d)
    ch10.check_step_3d(step_3d_device_mesh)
    assert capsys.readouterr().out.count("✅") == 2


def test_step_3d_refuses_a_wrong_structure_and_the_course():
    with pytest.raises(CheckFailed, match=r"rank 0 sent 8,192 bytes of activations to the next "
                                          r"stage \(rank 2\); its replica's part of the batch is "
                                          r"4,096 bytes"):
        ch10.check_step_3d(step_3d_whole_batch)
    with pytest.raises(CheckFailed, match=r"course's own Mesh3D"):
        ch10.check_step_3d(step_3d_with_the_course)


# ---- the layout model: full checkpointing pays its recompute (issue 13) --------------------------

def test_full_checkpointing_costs_a_second_forward():
    from distlab import layout
    kw = dict(dp=4, pp=2, tp=4, gpus_per_node=8, global_batch=64, seq_len=2048)
    with_ckpt = layout.price("Llama-2 7B", checkpointing=True, **kw)
    without = layout.price("Llama-2 7B", checkpointing=False, **kw)
    # the forward runs again in backward: the compute grows by exactly the recompute
    assert with_ckpt["compute_s"] == pytest.approx(without["compute_s"] + with_ckpt["recompute_s"])
    assert without["recompute_s"] == 0 and with_ckpt["recompute_s"] > 0.2 * without["compute_s"]
    # the bubble is idle time sized by the stage's time, recompute and tp comm included
    def stage(r):
        return r["compute_s"] - r["head_s"] + r["tp_s"]     # the stage without the head
    assert with_ckpt["bubble_s"] / without["bubble_s"] == pytest.approx(stage(with_ckpt)
                                                                        / stage(without))
    assert with_ckpt["gb"] < without["gb"]
    # a model given by its preset's shape prices like the preset
    assert layout.price(layout.SHAPES["Llama-2 7B"], **kw)["step_s"] == pytest.approx(
        layout.price("Llama-2 7B", **kw)["step_s"], rel=0.01)
