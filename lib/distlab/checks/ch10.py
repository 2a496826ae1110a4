"""Checkers for workbook 10: putting tp shards back together, the loss every rank reports, and
one training step on a dp x pp x tp mesh built by hand."""
import copy

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import ProcessGroup
from torch.utils._python_dispatch import _disable_current_modes

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


# ---- exercise 2: the loss over every real token, micro-batches of unequal length -----------------

# (dp, pp, tp): tp copies of the loss on the last stage (dp != tp); an odd dp (a sum is not a
# mean, the replicas weigh by their tokens); a middle stage (the value comes from the LAST one),
# with fewer micro-batches than stages (m = 2 < p = 3), so no count of micro-batches is built in.
LOSS_MESHES = ((1, 2, 2), (3, 1, 1), (1, 3, 1))


def _n_micro(pp):
    return 2 if pp >= 3 else 3


def _micro_batches(rank, d, last, m=3):
    """(losses, tokens) a rank holds, m micro-batches: on the last stage, each micro-batch's mean
    loss over its real tokens and how many real tokens it had (padding makes them unequal,
    between micro-batches and between replicas); elsewhere numbers that are not losses, which
    must not count."""
    if not last:
        return (torch.tensor([50.0 + rank, 60.0, 70.0], dtype=torch.float64)[:m],
                torch.tensor([7, 1 + rank, 3])[:m])
    losses = torch.tensor([2.0 + 0.5 * d, 3.25 - 0.25 * d, 1.5 + 0.125 * d], dtype=torch.float64)
    tokens = torch.tensor([[5, 16, 9], [12, 3, 16], [1, 8, 2]][d % 3])
    return losses[:m], tokens[:m]


def _token_means(dp, m=3):
    """The right answer and the answers of three wrong rules, by what they compute."""
    rows = [_micro_batches(0, d, True, m) for d in range(dp)]
    weighted = sum(float((l * n).sum()) for l, n in rows)
    count = sum(int(n.sum()) for _, n in rows)
    replica_means = [float((l * n).sum()) / int(n.sum()) for l, n in rows]
    return {"right": weighted / count,
            "the mean of the micro-batches' means (every micro-batch weighs the same, the "
            "chapter's rule for equal micro-batches)": sum(float(l.mean()) for l, _ in rows) / dp,
            "the mean of the replicas' token means (every replica weighs the same, however many "
            "real tokens it had)": sum(replica_means) / dp,
            "the sum of the replicas' token means": sum(replica_means)}


def _token_loss_on_mesh(rank, world_size, dp, pp, tp, fn):
    mesh = p3.Mesh3D(dp, pp, tp)
    losses, tokens = _micro_batches(rank, mesh.d, mesh.p == pp - 1, _n_micro(pp))
    before = (losses.clone(), tokens.clone())
    with forbid(p3.global_loss, p3.train_step, _micro_batches, _token_means,
                exercise="send the sums along the pp and dp groups yourself"):
        got = fn(losses, tokens, mesh)
    if isinstance(got, torch.Tensor) and got.numel() == 1:
        got = got.item()
    # The caller still needs its own numbers after logging the loss (its own statistics).
    changed = not (torch.equal(losses, before[0]) and torch.equal(tokens, before[1]))
    return got, changed


def check_token_mean_loss(fn, meshes=LOSS_MESHES):
    """fn(losses, tokens, mesh) on every rank -> the mean loss over every real token of the global
    batch, as a float, on every rank."""
    name = getattr(fn, "__name__", "token_mean_loss")
    for dp, pp, tp in meshes:
        where = f"{name} on dp={dp} x pp={pp} x tp={tp} ({_n_micro(pp)} micro-batches)"
        means = _token_means(dp, _n_micro(pp))
        try:
            got = learner_run(_token_loss_on_mesh, dp * pp * tp, dp, pp, tp, fn, name=name,
                              timeout=60, hang_rule="every rank must call the same collectives "
                              "on its pp group and then its dp group, the other stages too.")
        except (NotImplementedError, CheckFailed):
            raise
        except Exception as e:  # a crash inside the learner's code: say where, in one line
            raise CheckFailed(f"{where} failed: {str(e).splitlines()[0]}") from None
        for rank, (value, changed) in enumerate(got):
            if not isinstance(value, float):
                raise CheckFailed(f"{where}: rank {rank} returned {type(value).__name__}; return "
                                  f"the loss as a Python float (loss.item()).")
            if abs(value - means["right"]) > 1e-12 * max(1.0, abs(means["right"])):
                rule = next((label for label, v in means.items()
                             if label != "right" and abs(value - v) < 1e-12), None)
                why = (f": that is {rule}; a real token weighs the same wherever it sits, so add "
                       f"up loss × tokens and the tokens over every micro-batch and replica, "
                       f"then divide once" if rule else
                       " — only the last stage's numbers are losses (the other stages' must "
                       "not count), and the mean is over every replica's real tokens")
                raise CheckFailed(f"{where}: rank {rank} returned {value:.6g}, expected "
                                  f"{means['right']:.6g}{why}.")
            if changed:
                raise CheckFailed(f"{where} returned the right value, but changed rank {rank}'s "
                                  f"losses or tokens in place; the caller still needs them: "
                                  f"reduce new tensors.")
    passed(f"{name} gives every rank the mean over every real token of the global batch on "
           f"meshes {sizes_phrase(['x'.join(map(str, s)) for s in meshes])}, micro-batches and "
           f"replicas of unequal token counts, fewer micro-batches than stages on 1x3x1.")


# ---- exercise 3: one training step on a dp x pp x tp mesh you build ------------------------------

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


class _Snapshot(dist.Work):
    """A Work handle that copies the all-reduce's result when it is waited for."""

    def __init__(self, inner, done):
        super().__init__()
        self._inner, self._done = inner, done

    def wait(self, timeout=None):
        ok = self._inner.wait() if timeout is None else self._inner.wait(timeout)
        self._done()
        return ok

    def is_completed(self):
        return self._inner.is_completed()

    def is_success(self):
        return self._inner.is_success()

    def exception(self):
        return self._inner.exception()

    def result(self):
        return self._inner.result()

    def source_rank(self):
        return self._inner.source_rank()

    def _source_rank(self):
        return self._inner._source_rank()

    def synchronize(self):
        return self._inner.synchronize()

    def get_future(self):
        return self._inner.get_future()

    def block_current_stream(self):
        return self._inner.block_current_stream()


class _Carried:
    """Inside a rank, while the learner's function runs: a copy of what travels. Every message
    sent (by global peer) and every all-reduce's input and result (with its group's ranks), read
    from the ProcessGroup methods every send and all-reduce goes through, however it was called
    (dist.send, isend, batch_isend_irecv, dist.all_reduce imported under any name)."""

    def __init__(self):
        self.sent, self.reduced = {}, []

    @staticmethod
    def _ranks(pg):
        try:
            return tuple(dist.get_process_group_ranks(pg))
        except Exception:
            return tuple(range(pg.size()))

    def __enter__(self):
        self._saved = {m: getattr(ProcessGroup, m) for m in ("send", "allreduce")}
        send, allreduce, me = self._saved["send"], self._saved["allreduce"], self

        def carried_send(pg, tensors, dst, *args, **kwargs):
            peer = me._ranks(pg)[dst]
            me.sent.setdefault(peer, []).extend(t.detach().flatten().double().clone()
                                                for t in tensors)
            return send(pg, tensors, dst, *args, **kwargs)

        def carried_allreduce(pg, tensors, *args, **kwargs):
            entry = {"group": me._ranks(pg), "input": [t.detach().clone() for t in tensors],
                     "result": None}
            me.reduced.append(entry)
            work = allreduce(pg, tensors, *args, **kwargs)

            def done():
                entry["result"] = [t.detach().clone() for t in tensors]
            return work if work is None else _Snapshot(work, done)

        ProcessGroup.send, ProcessGroup.allreduce = carried_send, carried_allreduce
        return self

    def __exit__(self, *exc):
        for method, original in self._saved.items():
            setattr(ProcessGroup, method, original)


def _same_values(got, expected, scales):
    """Whether the values `got` are those of `expected` times one of `scales`, in any order and
    cut into any pieces (a flat buffer, one tensor per parameter, several micro-batches); None
    when their counts differ (the trace's byte count then says more)."""
    if got.numel() != expected.numel():
        return None
    g = got.sort().values
    return any(torch.allclose(g, (expected * s).sort().values, atol=1e-9, rtol=1e-7)
               for s in scales)


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


# ---- exercise 4: choosing the layout for a model and a cluster ----------------------------------

# (model, nodes, GPUs per node, global batch): the chapter's two cases, then clusters where a
# constraint bites — 70B's fastest layouts do not fit; 4-GPU nodes cap tp at 4; GPT-2 XL's 25
# heads leave tp = 1 on 8-GPU nodes; a batch of 24 rules out dp = 16; on 24 GPUs 80 layers rule
# out pp = 3, 6 and 12 (equal stages), so the factor 3 goes to dp; on 48 GPUs GPT-3's 96 layers
# allow pp = 6, which wins (a search over powers of two misses it).
LAYOUT_CASES = [("Llama-2 13B", 4, 8, 512), ("Llama-2 70B", 4, 8, 512),
                ("Llama-2 13B", 4, 4, 96), ("GPT-2 XL 1.5B", 2, 8, 64), ("Llama-2 7B", 2, 8, 24),
                ("Llama-2 70B", 3, 8, 96), ("GPT-3 175B", 6, 8, 96)]


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
    planner's own ranking, on the clusters of LAYOUT_CASES."""
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
    passed(f"choose_layout picks the planner's best layout on all {len(LAYOUT_CASES)} clusters: "
           f"memory first, then time, within tp's, pp's and dp's constraints.")
