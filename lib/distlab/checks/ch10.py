"""Checkers for workbook 10: putting tp shards back together, the loss every rank reports, and
one training step on a dp x pp x tp mesh built by hand."""
import torch

from .. import data_parallel as _dp
from .. import mesh as _mesh
from .. import parallel3d as p3
from ..models import lm_loss, make_gpt, token_data
from . import CheckFailed, call_learner, compare, forbid, passed, sizes_phrase
from .ch01 import collectives, learner_run, refusing


# ---- exercise 1: a dense weight from its column-parallel shards ---------------------------------

def _reference_unshard(shards, chunks):
    parts = [s.chunk(chunks, dim=0) for s in shards]
    return torch.cat([torch.cat([p[j] for p in parts], dim=0) for j in range(chunks)])


def check_unshard_column(fn):
    """Cases: q, k, v stacked (chunks=3) over 2 and 4 ranks; a plain layer over 3 ranks; a bias."""
    cases = [(2, 3, (12, 5)), (3, 1, (9, 4)), (4, 3, (24, 2)), (2, 3, (12,))]
    for tp, chunks, shape in cases:
        g = torch.Generator().manual_seed(tp * 10 + chunks)
        dense = torch.randn(shape, generator=g, dtype=torch.float64)
        shards = [torch.cat([m.chunk(tp, dim=0)[r] for m in dense.chunk(chunks, dim=0)])
                  for r in range(tp)]
        with refusing(_reference_unshard, p3._unshard, exercise="put the shards back together "
                      "yourself"):
            got = call_learner(fn, [s.clone() for s in shards], chunks, name="unshard_column")
        compare(got, dense, f"unshard_column with {tp} shards of {chunks} stacked matri"
                f"{'ces' if chunks > 1 else 'x'} of shape {tuple(shape)}", atol=0, rtol=0)
    passed("unshard_column rebuilds the dense weight (and bias) from 2, 3 and 4 shards, "
           "q, k and v kept apart.")


# ---- exercise 2: the loss every rank reports ------------------------------------------------------

def _shard_loss_value(rank, d):
    return 1.0 + 0.25 * rank + 0.125 * d


def _expected_global_loss(rank, dp, pp, tp):
    """The mean over the replicas of the last stage's loss (of the same tp slice)."""
    _, _, t = _mesh.coordinate(rank, (dp, pp, tp))
    last = [_mesh.rank_at((d, pp - 1, t), (dp, pp, tp)) for d in range(dp)]
    return sum(_shard_loss_value(r, d) for d, r in enumerate(last)) / dp


def _losses_on_mesh(rank, world_size, dp, pp, tp, fn):
    mesh = p3.Mesh3D(dp, pp, tp)
    # Every rank holds a different number, as if each had computed a loss; only the last
    # stage's are real losses, and they differ between replicas.
    mine = torch.tensor(_shard_loss_value(rank, mesh.d), dtype=torch.float64)
    before = mine.clone()
    with forbid(p3.global_loss, p3.train_step,
                exercise="send the loss along the pp and dp groups yourself"):
        got = fn(mine, mesh)
    # The caller still needs its own loss after logging it (backward, its own statistics).
    return float(got), before.item(), mine.item()


def check_global_loss(fn):
    shapes = [(2, 2, 2), (3, 1, 1), (1, 3, 1)]
    for dp, pp, tp in shapes:
        expected = [_expected_global_loss(rank, dp, pp, tp) for rank in range(dp * pp * tp)]
        try:
            got = learner_run(_losses_on_mesh, dp * pp * tp, dp, pp, tp, fn, name="global_loss",
                              timeout=60, hang_rule="every rank must call the same collectives "
                              "on its pp group and then its dp group.")
        except (NotImplementedError, CheckFailed):
            raise
        except Exception as e:  # a crash inside the learner's code: say where, in one line
            raise CheckFailed(f"global_loss on dp={dp} x pp={pp} x tp={tp} failed: "
                              f"{str(e).splitlines()[0]}") from None
        for rank in range(dp * pp * tp):
            value, before, after = got[rank]
            compare(value, expected[rank], f"global_loss on dp={dp} x pp={pp} x tp={tp}, "
                    f"rank {rank}", atol=1e-12, rtol=1e-12)
            if after != before:
                raise CheckFailed(f"global_loss on dp={dp} x pp={pp} x tp={tp} returned the "
                                  f"right value, but changed rank {rank}'s shard_loss in place "
                                  f"({before:g} became {after:g}); the caller still needs its "
                                  f"own loss: reduce a clone.")
    passed(f"global_loss gives every rank the replicas' mean of the last stage's loss on meshes "
           f"{sizes_phrase(['x'.join(map(str, s)) for s in shapes])}.")


# ---- exercise 3: one training step on a dp x pp x tp mesh you build ------------------------------

STEP_CFG = dict(vocab=32, d_model=16, n_heads=2, n_layers=4, seq_len=8)
STEP_LR = 0.1
STEP_MESHES = ((2, 2, 2), (1, 3, 1))          # every parallelism at once; a middle stage
STEP_BATCH = 8


def _step_data():
    return token_data(n=STEP_BATCH, seq_len=STEP_CFG["seq_len"], vocab=STEP_CFG["vocab"], seed=1)


def _reference_step():
    """One process: the dense model, the whole batch, one SGD step."""
    gpt = make_gpt(seed=0, **STEP_CFG).double()
    x, y = _step_data()
    loss = lm_loss(gpt(x), y)
    loss.backward()
    with torch.no_grad():
        for p in gpt.parameters():
            p.add_(p.grad, alpha=-STEP_LR)
    return gpt, loss.item()


def _course_3d_code():
    return (p3.train_step, p3.Mesh3D, p3.global_loss, _mesh.HandMesh, _mesh.device_mesh,
            _dp.average_gradients, _reference_step)


def _step_on_mesh(rank, world_size, dp, pp, tp, fn):
    gpt = make_gpt(seed=0, **STEP_CFG).double()
    x, y = _step_data()
    with forbid(*_course_3d_code(), exercise="build the groups and take the step yourself"):
        answer = fn(gpt, x.clone(), y.clone(), dp, pp, tp, STEP_LR)
    if not (isinstance(answer, tuple) and len(answer) == 2 and isinstance(answer[0], p3.Stage3D)):
        return {"error": f"step_3d should return (stage, loss): this rank's p3.Stage3D and "
                         f"the global loss; rank {rank} returned {type(answer).__name__}."}
    stage, loss = answer
    ref, ref_loss = _reference_step()
    # This rank's shard of every dense parameter after the reference's step.
    params = {name: (p.detach().clone(), stage.shard_of(name, ref.get_parameter(
        stage.dense_name(name)).detach())) for name, p in stage.named_parameters()}
    loss = loss.item() if isinstance(loss, torch.Tensor) else loss
    return {"loss": loss, "ref_loss": ref_loss, "params": params}


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


def check_step_3d(fn):
    """fn(gpt, x, y, dp, pp, tp, lr) on every rank -> (its Stage3D after one SGD step, the loss)."""
    name = getattr(fn, "__name__", "step_3d")
    for dp, pp, tp in STEP_MESHES:
        got = learner_run(_step_on_mesh, dp * pp * tp, dp, pp, tp, fn, name=name, timeout=20,
                          hang_rule="every send needs the matching recv on the neighbouring "
                          "stage, and every rank must create every group in the same order.")
        where = f"on dp={dp} x pp={pp} x tp={tp}"
        _check_step_structure(got.trace, dp, pp, tp, name)
        for rank, result in enumerate(got):
            if "error" in result:
                raise CheckFailed(result["error"])
            compare(result["loss"], result["ref_loss"], f"{name} {where}: rank {rank}'s loss "
                    f"(the global batch's mean, as one process computes it)", 1e-10, 1e-10)
            for pname, (mine, expected) in result["params"].items():
                compare(mine, expected, f"{name} {where}: rank {rank}'s {pname} after the step "
                        f"(against its shard of one process's)", 1e-10, 1e-9)
    passed(f"{name} equals one process's SGD step on meshes "
           f"{sizes_phrase(['x'.join(map(str, s)) for s in STEP_MESHES])}, with messages only "
           f"between neighbouring stages and gradients averaged over each dp group.")


# ---- exercise 4: choosing the layout for a model and a cluster ----------------------------------

# (model, nodes, GPUs per node, global batch): the chapter's two cases, then clusters where a
# constraint bites — 70B's fastest layouts do not fit; 4-GPU nodes cap tp at 4; GPT-2 XL's 25
# heads leave tp = 1 on 8-GPU nodes; a batch of 24 rules out dp = 16.
LAYOUT_CASES = [("Llama-2 13B", 4, 8, 512), ("Llama-2 70B", 4, 8, 512),
                ("Llama-2 13B", 4, 4, 96), ("GPT-2 XL 1.5B", 2, 8, 64), ("Llama-2 7B", 2, 8, 24)]


def _why_not(model, nodes, per_node, batch, choice):
    """The sentence that says why `choice` is not a layout of this model on this cluster."""
    from .. import layout
    shape, _ = layout.shape_of(model)
    n = nodes * per_node
    if not (isinstance(choice, tuple) and len(choice) == 3
            and all(isinstance(v, int) and not isinstance(v, bool) and v >= 1 for v in choice)):
        return f"return a tuple of three whole numbers (dp, pp, tp); got {choice!r}"
    dp, pp, tp = choice
    if dp * pp * tp != n:
        return f"dp·pp·tp = {dp * pp * tp}, but the cluster has {n} GPUs"
    if per_node % tp:
        return f"tp={tp} does not divide a node's {per_node} GPUs: its all-reduces would cross nodes"
    if shape.heads % tp:
        return f"tp={tp} does not split {shape.heads} attention heads evenly"
    if shape.layers % pp:
        return f"pp={pp} does not cut {shape.layers} layers into equal stages"
    if batch % dp:
        return f"dp={dp} does not split a global batch of {batch} sequences evenly"
    return None


def check_choose_layout(fn):
    """The learner's choose_layout(model, nodes, gpus_per_node, global_batch) against the
    planner's own ranking, on five clusters."""
    from .. import layout
    for model, nodes, per_node, batch in LAYOUT_CASES:
        where = f"{model} on {nodes} nodes × {per_node} GPUs (global batch {batch})"
        with refusing(layout.rank_layouts, layout.best, layout.candidates,
                      exercise="enumerate the layouts and choose one yourself (layout.price "
                      "prices one layout)"):
            got = call_learner(fn, model, nodes, per_node, batch, name="choose_layout")
        if isinstance(got, list):
            got = tuple(got)
        wrong = _why_not(model, nodes, per_node, batch, got)
        if wrong:
            raise CheckFailed(f"for {where} you chose {got!r}: {wrong}.")
        best = layout.best(model, nodes=nodes, gpus_per_node=per_node, global_batch=batch)
        want = (best["dp"], best["pp"], best["tp"])
        if got == want:
            continue
        mine = layout.price(model, *got, gpus_per_node=per_node, global_batch=batch)
        yours = f"dp={got[0]} pp={got[1]} tp={got[2]}"
        if not mine["fits"]:
            raise CheckFailed(f"for {where} you chose {yours}: it needs {mine['gb']:.0f} GB per "
                              f"GPU at its peak, more than a GPU's 80 GB — a layout must fit "
                              f"before its speed counts.")
        raise CheckFailed(f"for {where} you chose {yours}, {mine['step_s']:.2f} s per step; "
                          f"dp={want[0]} pp={want[1]} tp={want[2]} fits too and takes "
                          f"{best['step_s']:.2f} s — did you try every (dp, pp, tp) whose "
                          f"product is the GPU count?")
    passed("choose_layout picks the planner's best layout on all five clusters: memory first, "
           "then time, within tp's, pp's and dp's constraints.")
