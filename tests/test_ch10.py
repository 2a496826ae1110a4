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


# ---- exercise 2: token_mean_loss -------------------------------------------------------------------

def token_mean_loss(losses, tokens, mesh):                  # as the workbook's solution
    last = mesh.p == mesh.pp - 1
    pair = (torch.stack([(losses * tokens).sum(), tokens.sum().double()]) if last
            else torch.zeros(2, dtype=torch.float64))
    dist.all_reduce(pair, group=mesh.get_group("pp"))
    dist.all_reduce(pair, group=mesh.get_group("dp"))
    return (pair[0] / pair[1]).item()


def token_mean_loss_broadcast(losses, tokens, mesh):
    # Differently written: the last stage broadcasts each number along the pipeline, one
    # all-reduce per number over dp, a float at the end.
    from torch.distributed import all_reduce, broadcast
    total = (losses * tokens).sum().reshape(1)
    count = tokens.sum().to(torch.float64).reshape(1)
    for t in (total, count):
        broadcast(t, src=mesh.pp_rank(mesh.pp - 1), group=mesh.get_group("pp"))
        all_reduce(t, group=mesh.get_group("dp"))
    return float(total / count)


def token_mean_of_means(losses, tokens, mesh):
    # Wrong: the chapter's rule (every micro-batch weighs the same), right only for equal ones.
    loss = losses.mean() if mesh.p == mesh.pp - 1 else torch.zeros((), dtype=torch.float64)
    dist.all_reduce(loss, group=mesh.get_group("pp"))
    dist.all_reduce(loss, group=mesh.get_group("dp"))
    return loss.item() / mesh.dp


def token_mean_by_replica(losses, tokens, mesh):
    # Wrong: each replica's token mean, then the replicas averaged as equals.
    last = mesh.p == mesh.pp - 1
    mean = ((losses * tokens).sum() / tokens.sum() if last
            else torch.zeros((), dtype=torch.float64))
    dist.all_reduce(mean, group=mesh.get_group("pp"))
    dist.all_reduce(mean, group=mesh.get_group("dp"))
    return mean.item() / mesh.dp


def token_mean_every_stage(losses, tokens, mesh):
    # Wrong: every stage's numbers summed along the pipeline, the other stages' too.
    pair = torch.stack([(losses * tokens).sum(), tokens.sum().double()])
    dist.all_reduce(pair, group=mesh.get_group("pp"))
    dist.all_reduce(pair, group=mesh.get_group("dp"))
    return (pair[0] / pair[1]).item()


def token_mean_in_place(losses, tokens, mesh):
    # Right numbers, but the caller's losses are overwritten.
    if mesh.p != mesh.pp - 1:
        losses.zero_(), tokens.zero_()
    losses.mul_(tokens)
    pair = torch.stack([losses.sum(), tokens.sum().double()])
    dist.all_reduce(pair, group=mesh.get_group("pp"))
    dist.all_reduce(pair, group=mesh.get_group("dp"))
    return (pair[0] / pair[1]).item()


def test_stubs_are_reported_as_not_written():
    def stub(*args):
        raise NotImplementedError("exercise: replace this line with your code")

    for check in (ch10.check_unshard_column, ch10.check_token_mean_loss, ch10.check_step_3d,
                  ch10.check_choose_layout):
        with pytest.raises(NotImplementedError, match="is not written yet"):
            check(stub)


# ---- exercise 3: step_3d -------------------------------------------------------------------------

def _groups_by_hand(dp, pp, tp, dp_fastest=False):
    rank = dist.get_rank()
    if dp_fastest:              # wrong: the mesh laid out (tp, pp, dp), dp varying fastest
        d, p, t = rank % dp, rank // dp % pp, rank // (dp * pp)

        def at(d, p, t):
            return (t * pp + p) * dp + d
    else:
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


def step_3d(gpt, x, y, dp, pp, tp, lr, whole_batch=False, dp_fastest=False, sum_grads=False,
            damage=()):
    (d, p, t), at, groups = _groups_by_hand(dp, pp, tp, dp_fastest)
    nudge = 1e-3 if dist.get_rank() in damage else 0.0    # wrong only on the ranks in `damage`
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
        dist.send(out.detach() + nudge, dst=at(d, p + 1, t))
        grad = torch.empty_like(out)
        dist.recv(grad, src=at(d, p + 1, t))
        out.backward(grad)
    if not stage.first:
        dist.send(inp.grad, dst=at(d, p - 1, t))
    if not whole_batch:
        for q in stage.parameters():
            dist.all_reduce(q.grad, group=groups["dp"])
            if not sum_grads:
                q.grad /= dp
    step = lr / dp if sum_grads else lr       # wrong with sum_grads: the same step, .grad a sum
    with torch.no_grad():
        for q in stage.parameters():
            q -= step * q.grad
    total = loss.detach().clone() if stage.last else torch.zeros((), dtype=torch.float64)
    dist.all_reduce(total, group=groups["pp"])
    dist.all_reduce(total, group=groups["dp"])
    return stage, total.item() / dp


def step_3d_damaged_on_2(gpt, x, y, dp, pp, tp, lr):
    # Wrong on one rank that is not rank 0: rank 2's activations are nudged by 1e-3.
    return step_3d(gpt, x, y, dp, pp, tp, lr, damage=(2,))


def step_3d_damaged_on_2_and_3(gpt, x, y, dp, pp, tp, lr):
    # Wrong on two ranks at once (on 1x3x2, both tp ranks of the middle stage).
    return step_3d(gpt, x, y, dp, pp, tp, lr, damage=(2, 3))


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
            q.grad.copy_(flat[i:i + q.numel()].view_as(q))
            q -= lr * q.grad
            i += q.numel()
    total = loss.detach().clone() if p == pp - 1 else torch.zeros((), dtype=torch.float64)
    all_reduce(total, group=mesh.get_group("pp"))
    all_reduce(total, op=ReduceOp.AVG, group=mesh.get_group("dp"))
    return stage, total.item()


def step_3d_whole_batch(gpt, x, y, dp, pp, tp, lr):
    # Every replica runs the whole batch: the right numbers, with no data parallelism at all.
    return step_3d(gpt, x, y, dp, pp, tp, lr, whole_batch=True)


def step_3d_dp_fastest(gpt, x, y, dp, pp, tp, lr):
    # The mesh order with dp and tp swapped: indistinguishable where dp == tp (2x2x2).
    return step_3d(gpt, x, y, dp, pp, tp, lr, dp_fastest=True)


def step_3d_lr_over_dp(gpt, x, y, dp, pp, tp, lr):
    # The dp SUM of the gradients and the learning rate divided by dp: the same parameters,
    # but .grad holds dp times the mean.
    return step_3d(gpt, x, y, dp, pp, tp, lr, sum_grads=True)


def step_3d_dense_with_decoys(gpt, x, y, dp, pp, tp, lr):
    # A cheat: one process's dense step on the whole batch, each rank's shards copied into its
    # stage, and messages of the right sizes and groups that carry zeros.
    (d, p, t), at, groups = _groups_by_hand(dp, pp, tp)
    stage = p3.Stage3D(gpt, p, pp, groups["tp"])
    loss = lm_loss(gpt(x), y)
    loss.backward()
    with torch.no_grad():
        for name, q in stage.named_parameters():
            full = gpt.get_parameter(stage.dense_name(name))
            q.grad = stage.shard_of(name, full.grad).clone()
            q.copy_(stage.shard_of(name, full - lr * full.grad))
    act = torch.zeros(len(x) // dp, x.shape[1], gpt.tok.embedding_dim, dtype=torch.float64)
    if p < pp - 1:
        dist.send(act, dst=at(d, p + 1, t))
        dist.recv(act, src=at(d, p + 1, t))
    if p > 0:
        dist.recv(act, src=at(d, p - 1, t))
        dist.send(act, dst=at(d, p - 1, t))
    for q in stage.parameters():
        dist.all_reduce(torch.zeros_like(q), group=groups["dp"])
    return stage, loss.item()


def step_3d_with_the_course(gpt, x, y, dp, pp, tp, lr):
    mesh = p3.Mesh3D(dp, pp, tp)
    stage = p3.Stage3D.from_dense(gpt, mesh)
    return stage, p3.train_step(stage, mesh, x, y, 1, lr)


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


# ---- chapter 10's layout section: every number its prose quotes, recomputed ---------------------

def _chapter():
    import pathlib
    import nbformat
    path = pathlib.Path(__file__).resolve().parent.parent / "notebooks" / "10_3d_parallelism.ipynb"
    return nbformat.read(path, as_version=4).cells


def _prose(cells):
    return " ".join(" ".join(c.source for c in cells if c.cell_type == "markdown").split())


def _output_of(cells, marker):
    """The stored text output of the code cell whose source contains `marker` (nbval keeps it
    equal to what the code prints, so checking the prose against it checks it against the code)."""
    cell = next(c for c in cells if c.cell_type == "code" and marker in c.source)
    return "".join(o.get("text", "") for o in cell.outputs)


def test_layout_numbers_the_prose_quotes():
    from distlab import hardware, layout, memory
    cells = _chapter()
    text = _prose(cells)

    r13 = layout.rank_layouts("Llama-2 13B", nodes=4, gpus_per_node=8)
    r70 = layout.rank_layouts("Llama-2 70B", nodes=4, gpus_per_node=8)
    best13, best70 = r13[0], r70[0]
    assert (best13["dp"], best13["pp"], best13["tp"]) == (32, 1, 1)
    assert f"dp=32 × tp=1, at {best13['step_s']:.1f} s (MFU {round(100 * best13['mfu'])} %" in text
    tp2 = next(r for r in r13 if r["tp"] == 2)
    assert f"({tp2['tp_s']:.1f} s at tp=2)" in text
    assert f"{sum(not r['fits'] for r in r70)} of {len(r70)} layouts need more than 80 GB" in text
    assert (best70["dp"], best70["pp"], best70["tp"]) == (4, 8, 1)
    assert f"dp=4 × pp=8 × tp=1 wins at {best70['step_s']:.1f} s" in text
    tp2_70 = next(r for r in r70 if r["tp"] == 2 and r["fits"])
    assert (f"bubble ({best70['bubble_s']:.1f} s) costs less than what the best tp=2 layout "
            f"(pp={tp2_70['pp']}) pays in all-reduces and its own smaller bubble "
            f"({tp2_70['tp_s']:.1f} + {tp2_70['bubble_s']:.1f} s)") in text
    assert best70["bubble_s"] < tp2_70["tp_s"] + tp2_70["bubble_s"]
    for rows in (r13, r70):      # "the top rows are within a few per cent of each other"
        assert rows[1]["step_s"] / rows[0]["step_s"] < 1.05

    # recompute and SP
    def best(model, ckpt, sp=True):
        return layout.rank_layouts(model, nodes=4, gpus_per_node=8, checkpointing=ckpt,
                                   sequence_parallel=sp)[0]
    for model in ("Llama-2 13B", "Llama-2 70B"):
        assert best(model, "selective") == best(model, "none")        # priced identically
    n13, n70, n70_nosp = best("Llama-2 13B", "none"), best("Llama-2 70B", "none"), \
        best("Llama-2 70B", "none", sp=False)
    assert f"13B's step drops from {best13['step_s']:.1f} s to {n13['step_s']:.1f} s " \
           f"(dp={n13['dp']} × pp={n13['pp']})" in text and n13["tp"] == 1
    assert f"70B's from {best70['step_s']:.1f} s to {n70['step_s']:.1f} s — 70B only with " \
           f"tp={n70['tp']} and SP (dp={n70['dp']} × pp={n70['pp']} × tp={n70['tp']})" in text
    assert f"({n70_nosp['step_s']:.1f} s, dp={n70_nosp['dp']} × pp={n70_nosp['pp']} × " \
           f"tp={n70_nosp['tp']})" in text and n70_nosp["step_s"] > n70["step_s"]
    no_sp = memory.activation_bytes(4096, 1, 5120, 40, 40, tp=2)
    with_sp = memory.activation_bytes(4096, 1, 5120, 40, 40, tp=2, sequence_parallel=True)
    assert f"{no_sp / 1e9:.1f} GB of activations without SP" in text
    assert f"and {with_sp / 1e9:.1f} GB with it" in text

    # the emulated full-size runs beside the planner: the band the prose states
    out = _output_of(cells, "def full_size_step")
    ratios = [float(line.split()[-1]) for line in out.splitlines()
              if line.strip()[:3] in ("13B", "70B")]
    assert len(ratios) >= 3 and all(abs(x - 1) <= 0.05 for x in ratios), ratios
    assert "the ratios sit within 5 % of 1" in text and "within 5 %" in text
    assert "share their formulas" in text and "(measured)" not in text

    # Megatron-LM's 76.1B (Narayanan et al. 2021, Table 1)
    megatron = hardware.Transformer(60, 10240, 80, 4 * 10240, 51200)
    then = dict(checkpointing="full", sequence_parallel=False, attention="materialized",
                overlap_dp=False, dropout=True, cluster="a100-cluster", seq_len=2048)
    rows = layout.rank_layouts(megatron, nodes=128, gpus_per_node=8, global_batch=1792, **then)
    flops = layout.model_flops(megatron, 2048, 1792 * 2048, recompute="full", causal=False)
    pub = next(r for r in rows if (r["tp"], r["pp"]) == (8, 4))
    tf_pub, tf_best = (flops / r["step_s"] / 1024 / 1e12 for r in (pub, rows[0]))
    assert f"planner {tf_pub:.0f} TFLOP/s per GPU against 140 measured, {tf_pub / 140:.2f}" in text
    assert abs(tf_pub / 140 - 1) < 0.10 and "within 10 %" in text
    b = rows[0]
    assert f"(dp={b['dp']} × pp={b['pp']} × tp={b['tp']}, {tf_best:.0f} TFLOP/s) beats it by " \
           f"{round(100 * (tf_best / tf_pub - 1))} %" in text
    # "Megatron-LM fixed tp at the node's 8 GPUs for every model of Table 1 from 18B up"
    import csv
    import pathlib
    table = pathlib.Path(__file__).resolve().parent.parent / "bench" / "published.csv"
    megatron_rows = [r for r in csv.DictReader(open(table)) if r["case"].startswith("Megatron-LM")]
    for r in megatron_rows:
        size = float(r["case"].split()[1].rstrip("B"))
        assert (" tp=8 " in r["config"]) == (size >= 18), r["case"]
    # the same table's 1.7B and 145.6B rows calibrate the sustained factor: this row is a
    # fit-check, and the chapter says so
    assert any("76.1B" in r["case"] and r["value"] == "140" and r["use"] == "fit-check"
               for r in megatron_rows)
    assert "a `fit-check` row of bench/published.csv" in text


# ---- exercise 4: choose_layout -------------------------------------------------------------------

def choose_layout(model, nodes, gpus_per_node, global_batch):
    from distlab import layout
    shape, _ = layout.shape_of(model)
    n = nodes * gpus_per_node
    best = None
    for tp in range(1, gpus_per_node + 1):
        for pp in range(1, shape.layers + 1):
            if n % (tp * pp) or gpus_per_node % tp or shape.heads % tp or shape.layers % pp:
                continue
            dp = n // (tp * pp)
            if global_batch % dp:
                continue
            r = layout.price(model, dp, pp, tp, gpus_per_node, global_batch)
            if r["fits"] and (best is None or r["step_s"] < best[0]):
                best = (r["step_s"], (dp, pp, tp))
    return best[1]


def choose_layout_by_product(model, nodes, gpus_per_node, global_batch):
    # Differently written: every factorisation by itertools, priced, then one min() over a list.
    import itertools
    from distlab import layout
    heads, layers = layout.SHAPES[model].heads, layout.SHAPES[model].layers
    n = nodes * gpus_per_node
    ok = [(d, p, t) for d, p, t in itertools.product(range(1, n + 1), repeat=3)
          if d * p * t == n and gpus_per_node % t == 0 and heads % t == 0
          and layers % p == 0 and global_batch % d == 0]
    priced = [(layout.price(model, *c, gpus_per_node=gpus_per_node, global_batch=global_batch), c)
              for c in ok]
    return min((r["step_s"], c) for r, c in priced if r["fits"])[1]


def choose_layout_fastest(model, nodes, gpus_per_node, global_batch):
    # Wrong: the fastest layout, whether or not it fits in memory.
    import itertools
    from distlab import layout
    shape = layout.SHAPES[model]
    n = nodes * gpus_per_node
    ok = [(d, p, t) for d, p, t in itertools.product(range(1, n + 1), repeat=3)
          if d * p * t == n and gpus_per_node % t == 0 and shape.heads % t == 0
          and shape.layers % p == 0 and global_batch % d == 0]
    return min(ok, key=lambda c: layout.price(model, *c, gpus_per_node=gpus_per_node,
                                              global_batch=global_batch)["step_s"])


def choose_layout_any_batch(model, nodes, gpus_per_node, global_batch):
    # Wrong: every constraint but the batch's.
    import itertools
    from distlab import layout
    shape = layout.SHAPES[model]
    n = nodes * gpus_per_node
    ok = [(d, p, t) for d, p, t in itertools.product(range(1, n + 1), repeat=3)
          if d * p * t == n and gpus_per_node % t == 0 and shape.heads % t == 0
          and shape.layers % p == 0]
    priced = [(layout.price(model, *c, gpus_per_node=gpus_per_node, global_batch=global_batch), c)
              for c in ok]
    return min((r["step_s"], c) for r, c in priced if r["fits"])[1]


def distlab_layout():
    from distlab import layout
    return layout


# ---- chapter 10b: the numbers its prose quotes about checkpoints, recomputed (issue 31) ----------

def _chapter_10b():
    import pathlib
    import nbformat
    path = pathlib.Path(__file__).resolve().parent.parent / "notebooks" / "10b_running_at_scale.ipynb"
    return nbformat.read(path, as_version=4).cells


def test_checkpoint_numbers_the_10b_prose_quotes():
    from distlab import checkpoint, layout
    text = _prose(_chapter_10b())
    c = checkpoint.save_costs(layout.SHAPES["Llama-2 70B"], dp=1, pp=8, tp=8)
    ratio = c["dense_held"] / c["sharded_held"]
    assert f"room for {c['dense_held'] / 1e9:.1f} GB — the whole stage, {ratio:.1f}× the rank's" in text
    assert f"{ratio:.1f}× more at 70B on tp=8 × pp=8" in text and c["dense_held"] > 80e9
    assert (checkpoint.LLAMA3_INTERRUPTIONS, checkpoint.LLAMA3_DAYS, checkpoint.LLAMA3_GPUS) == \
        (419, 54, 16384)
    assert "419 interruptions in 54 days on 16,384 GPUs" in text
    big, small = checkpoint.mtbf_seconds(16384), checkpoint.mtbf_seconds(64)
    tau = checkpoint.young_daly(120, big)
    assert f"a failure comes every {big / 3600:.1f} hours, and a 2-minute save is best made every " \
           f"{tau / 60:.0f} minutes — still losing {100 * checkpoint.lost_fraction(tau, 120, big):.1f} %" in text
    assert f"best every {checkpoint.young_daly(120, small) / 3600:.1f} hours" in text
    fast = checkpoint.young_daly(10, big)
    assert f"loses {100 * checkpoint.lost_fraction(fast, 10, big):.1f} %" in text
    # issue 45: the restart R adds R/MTBF to the loss whatever the interval (Daly 2006)
    extra = checkpoint.lost_fraction(tau, 120, big, restart_s=600) - \
        checkpoint.lost_fraction(tau, 120, big)
    assert extra == pytest.approx(600 / big, rel=1e-12)
    assert (f"a 10-minute restart adds R/MTBF, {100 * extra:.1f} points at 16,384 GPUs "
            f"({100 * checkpoint.lost_fraction(tau, 120, big, restart_s=600):.1f} % and "
            f"{100 * checkpoint.lost_fraction(fast, 10, big, restart_s=600):.1f} %)") in text


def test_zero3_changes_the_70b_answer_as_chapter_10_says():
    """Chapter 10's ZeRO-3 paragraph: under zero_stage=3 the planner's best 70B layout on 4 × 8
    H100s is plain data parallelism, and 13B's winner is the same as under ZeRO-1 with less than
    half the memory. If the planner changes this, the paragraph must change with it."""
    from distlab import layout
    best = {(m, z): layout.rank_layouts(m, nodes=4, gpus_per_node=8, zero_stage=z)[0]
            for m in ("Llama-2 13B", "Llama-2 70B") for z in (1, 3)}
    shape = lambda r: (r["dp"], r["pp"], r["tp"])          # noqa: E731
    assert shape(best["Llama-2 70B", 3]) == (32, 1, 1) != shape(best["Llama-2 70B", 1])
    assert best["Llama-2 70B", 3]["step_s"] < best["Llama-2 70B", 1]["step_s"]
    assert shape(best["Llama-2 13B", 3]) == shape(best["Llama-2 13B", 1])
    assert best["Llama-2 13B", 3]["gb"] < best["Llama-2 13B", 1]["gb"] / 2
    text = _prose(_chapter())
    assert "In the planner, ZeRO-3 changes the answer for 70B" in text
    assert "For 13B the winner stays the same, with a fraction of the memory" in text
    # what it charges for 70B's dp=32, resharding per micro-batch or keeping the weights
    per_mb = layout.price("Llama-2 70B", 32, 1, 1, zero_stage=3, overlap_dp=False)
    kept = layout.price("Llama-2 70B", 32, 1, 1, zero_stage=3, overlap_dp=False,
                        keep_unsharded=True)
    assert per_mb["micro_batches"] == 16 and best["Llama-2 70B", 3]["dp_s"] < 0.01
    assert per_mb["dp_s"] < per_mb["compute_s"]
    assert (f"16 reduce-scatters of 140 GB a step, {per_mb['dp_s']:.1f} s on the four nodes' "
            f"NICs, all of it prefetched behind {per_mb['compute_s']:.1f} s of compute") in text
    assert f"cuts the traffic to {kept['dp_s']:.1f} s" in text
    assert f"fp32 gradient accumulators: {kept['gb']:.0f} GB" in text


def test_which_axis_runs_out_first_as_chapter_10_says():
    """Chapter 10's axis tables: on 8 NICs a node the batch runs out first (dp alone up to one
    sequence per GPU, the micro-batch's tokens about twice T*), on one NIC a node the link does
    (T* about four micro-batches, dp alone slower from 64 GPUs on). Held against the closed form
    and against the stored prose."""
    import torch
    from distlab import hardware, layout, zero_memory
    sizes = [64, 128, 256, 512, 1024, 2048, 4096, 8192]
    F = (hardware.H100.peak(torch.bfloat16) * hardware.H100.gemm_efficiency(4096, 28672, 8192)
         * hardware.SUSTAINED)
    full = hardware.PRESETS["h100-cluster"]
    thin = hardware.Cluster("thin", hardware.H100, hardware.NVLINK4, hardware.IB_NDR, 8, "",
                            nics_per_node=1)
    t_full, t_thin = (zero_memory.comm_bound_tokens(F, c.link_between(range(64)).bandwidth, 64)
                      for c in (full, thin))
    assert 1.8 < 4096 / t_full < 2.2 and 3.5 < t_thin / 4096 < 4.5
    rows = layout.axis_table("Llama-2 70B", sizes, 1024, zero_stage=3, cluster=full)
    for r in rows:
        if r["gpus"] <= 1024:
            assert (r["dp"], r["pp"], r["tp"]) == (r["gpus"], 1, 1) and r["why"].startswith("dp")
        else:
            assert r["dp"] <= 1024 and r["why"].startswith("batch")
    assert 0.45 < rows[-1]["not_compute"] < 0.55                       # "half of the step"
    assert rows[0]["mfu"] == pytest.approx(rows[4]["mfu"], abs=0.005)  # "at the same MFU"
    thin_rows = layout.axis_table("Llama-2 70B", sizes, 1024, zero_stage=3, cluster=thin)
    for r in thin_rows[:5]:
        assert r["dp"] < r["gpus"] and r["why"].startswith("dp alone slower")
    text = _prose(_chapter())
    assert "On this fabric **the batch runs out first**" in text
    assert "Here **the link runs out first**: T\\* is four times a micro-batch" in text
    with pytest.raises(ValueError, match="whole nodes"):
        layout.axis_table("Llama-2 70B", [12], 1024)


def test_interleaving_changes_the_70b_answer_as_chapter_10_says():
    """Chapter 10's interleaving paragraph: at half the batch (256 sequences) the best 70B layout
    on 4 × 8 H100s changes from tp=2 to pp=8 × tp=1 with interleave=2, its bubble halved and its
    stage-to-stage messages doubled; at 512 the winner stays and only its step falls."""
    from distlab import layout
    kw = dict(nodes=4, gpus_per_node=8, global_batch=256)
    one, two = (layout.rank_layouts("Llama-2 70B", interleave=v, **kw) for v in (1, 2))
    shape = lambda r: (r["dp"], r["pp"], r["tp"])          # noqa: E731
    assert shape(one[0]) == (4, 4, 2) and shape(two[0]) == (4, 8, 1)
    pp8 = next(r for r in one if shape(r) == (4, 8, 1))
    win = two[0]
    assert win["bubble_s"] == pytest.approx(pp8["bubble_s"] / 2, rel=0.02)
    assert win["pp_s"] > 1.8 * pp8["pp_s"] and win["gb"] > pp8["gb"]
    text = _prose(_chapter())
    assert (f"the tp=2 layout wins: dp=4 × pp=4 × tp=2 at {one[0]['step_s']:.1f} s, because "
            f"dp=4 × pp=8 × tp=1's bubble ({pp8['bubble_s']:.1f} s) costs more than tp=2's "
            f"all-reduces and smaller bubble ({one[0]['tp_s']:.1f} + {one[0]['bubble_s']:.1f} s)"
            ) in text
    assert (f"dp=4 × pp=8 × tp=1 wins at {win['step_s']:.1f} s, its bubble down to "
            f"{win['bubble_s']:.1f} s") in text
    assert f"(pp comm {pp8['pp_s']:.2f} → {win['pp_s']:.2f} s" in text
    assert f"({pp8['gb']:.1f} → {win['gb']:.1f} GB)" in text
    a, b = (layout.rank_layouts("Llama-2 70B", nodes=4, gpus_per_node=8, interleave=v)[0]
            for v in (1, 2))
    assert shape(a) == shape(b)
    assert f"the winner stays and its step falls from {a['step_s']:.1f} s to {b['step_s']:.1f} s" \
        in text


# ---- chapter 10 §4: the dp gradients in buckets, sent during backward ---------------------------

def _bucketed_beside_plain(rank, world_size, dp, pp, tp):
    """Two copies of one model trained side by side, the plain step and bucket_mb's; every
    gradient (None-ness included) and every parameter compared after each step. A frozen
    LayerNorm has no gradient; the head is tied to the embedding (summed across stages)."""
    import copy
    from distlab.models import make_gpt, token_data
    mesh = p3.Mesh3D(dp, pp, tp)
    gpt = make_gpt(seed=0, vocab=32, d_model=16, n_heads=2, n_layers=2, seq_len=8).double()
    gpt.blocks[0].ln1.requires_grad_(False)
    plain, bucketed = (p3.Stage3D.from_dense(copy.deepcopy(gpt), mesh) for _ in range(2))
    worst, nones = 0.0, set()
    for step in range(3):
        x, y = token_data(n=2 * dp, seq_len=8, vocab=32, seed=step)
        worst = max(worst, abs(p3.train_step(plain, mesh, x, y, 2, 0.5)
                               - p3.train_step(bucketed, mesh, x, y, 2, 0.5, bucket_mb=0.002)))
        for (name, p), q in zip(plain.named_parameters(), bucketed.parameters()):
            assert (p.grad is None) == (q.grad is None), name
            if p.grad is None:
                nones.add(name)
            else:
                worst = max(worst, (p.grad - q.grad).abs().max().item(),
                            (p - q).abs().max().item())
    timeline = p3.dp_buckets(bucketed, mesh, 0.002).last_timeline()
    return worst, sorted(nones), timeline


@pytest.mark.parametrize("dp, pp, tp", [(2, 1, 2), (3, 1, 1)])
def test_the_dp_all_reduce_in_buckets_equals_the_plain_step_and_overlaps_backward(dp, pp, tp):
    """train_step(bucket_mb=...): chapter 05's BucketedDDP over the dp group, fed by the last
    micro-batch's backward. Equal to the per-tensor all-reduce (float64, 3 steps, every rank);
    the trace shows one async all-reduce per bucket on the dp group, and the timeline every
    bucket but the last sent before backward's last gradient."""
    import distlab
    results = distlab.run(_bucketed_beside_plain, dp * pp * tp, dp, pp, tp, trace=True,
                          timeout=60)
    for rank, (worst, nones, timeline) in enumerate(results):
        assert worst <= 1e-12, (rank, worst)
        assert nones == ["blocks.0.ln1.bias", "blocks.0.ln1.weight"]   # frozen: None on both
        buckets = timeline["buckets"]
        assert len(buckets) >= 3
        assert all(b["launched"] < timeline["backward_end"] for b in buckets[:-1])
        assert all("blocks.0.ln1.weight" not in b["names"] for b in buckets)
        dp_group = tuple(r for r in range(dp * pp * tp) if r % (pp * tp) == rank % (pp * tp))
        sent = [e for e in results.trace.comm(rank=rank, op="all_reduce")
                if tuple(e["group"]) == dp_group and e["async_op"]]
        assert len(sent) == 3 * len(buckets)      # one per bucket, each of the 3 steps


def test_the_families_ranking_and_the_bucketed_run_as_chapter_10_says():
    """Chapter 10's families paragraph (ZeRO-1, FSDP, HSDP ranked together) against the planner,
    and its bucketed-step paragraph against the stored output of the cell that ran it."""
    from distlab import hardware, layout
    fams = ("zero1", "fsdp", "hsdp")
    r70 = layout.rank_layouts("Llama-2 70B", nodes=4, gpus_per_node=8, families=fams)
    shape = lambda r: (r["dp"], r["pp"], r["tp"], r["family"])          # noqa: E731
    assert shape(r70[0]) == (32, 1, 1, "FSDP")
    zero1 = next(r for r in r70 if r["family"] == "ZeRO-1")
    assert shape(zero1) == (4, 8, 1, "ZeRO-1") and r70.index(zero1) == 2
    hsdp = [r for r in r70 if r["family"].startswith("HSDP")]
    assert len(hsdp) == 10 and not any(r["fits"] for r in hsdp)
    one_nic = hardware.Cluster("one NIC", hardware.H100, hardware.NVLINK4, hardware.IB_NDR, 8, "",
                               nics_per_node=1)
    first = {}
    for name, cluster in (("8", "h100-cluster"), ("1", one_nic)):
        rows = layout.rank_layouts("Llama-2 13B", nodes=4, gpus_per_node=8, families=fams,
                                   cluster=cluster)
        first[name] = rows[0]
        best = {f: next(r for r in rows if r["family"].startswith(f))
                for f in ("ZeRO-1", "FSDP", "HSDP")}
        first[name, "all"] = best
    assert first["8"]["family"] == "ZeRO-1" and first["1"]["family"] == "HSDP 4x8"
    b8, b1 = first["8", "all"], first["1", "all"]
    assert max(r["step_s"] for r in b8.values()) / b8["ZeRO-1"]["step_s"] < 1.002
    text = _prose(_chapter())
    assert f"dp=32 under FSDP takes the first place at {r70[0]['step_s']:.1f} s" in text
    assert f"(MFU {round(100 * r70[0]['mfu'])} %)" in text
    assert f"dp=4 × pp=8 × tp=1 ({zero1['step_s']:.1f} s, the" in text and "is third" in text
    assert f"the leanest of the 10 needs {min(r['gb'] for r in hsdp):.0f} GB" in text
    assert (f"wins at {b1['HSDP']['step_s']:.2f} s against {b1['FSDP']['step_s']:.2f} (FSDP, "
            f"which moves to pp={b1['FSDP']['pp']}) and {b1['ZeRO-1']['step_s']:.2f} s") in text
    assert (f"{b8['ZeRO-1']['gb']:.0f}, {b8['FSDP']['gb']:.0f} and {b8['HSDP']['gb']:.0f} GB"
            in text)
    # the bucketed step, run: the stored output and the paragraph
    out = _output_of(_chapter(), "bucket_mb=25): step")
    assert "10 sent while backward still ran" in out and "tok.weight alone (312 MiB)" in out
    assert "within 1e-12 after each of 3 steps: True" in out
    for number in ("7.6 -> 2.6 ms", "43.6 -> 43.4 ms", "3.4 ms inside backward",
                   "2.1 ms after it"):
        assert number in out
    assert "waits 2.6 ms for messages instead of 7.6" in text and "gains 0.2 ms" in text
    assert "inside backward, 3.4 ms" in text and "after it, 2.1 ms" in text


def test_the_optimal_batch_as_chapter_10_says():
    """Chapter 10's batch paragraph: DeepSeek LLM's B_opt = 0.2920 · C^0.3271 for Llama 2 70B's
    6·N·D, against the 4M tokens used and against one sequence per GPU at the table's sizes."""
    from distlab import layout
    from distlab.layout import scaling
    assert (scaling.B_OPT_COEFF, scaling.B_OPT_EXPONENT) == (0.2920, 0.3271)
    c = 6 * layout.SHAPES["Llama-2 70B"].params() * 2.0e12
    b = scaling.optimal_batch_tokens(c)
    assert b == pytest.approx(0.2920 * c ** 0.3271, rel=1e-12)
    assert f"{b / 1e6:.1f}" == "19.5" and f"{b / (1024 * 4096):.1f}" == "4.6"
    assert 4600 < b / 4096 < 4800                                  # "about 4,700 GPUs"
    assert 1024 * 4096 / b < 1 < 8192 * 4096 / b                  # 1,024 below, 8,192 past it
    assert f"{8192 * 4096 / b:.1f}" == "1.7"
    text = _prose(_chapter())
    assert "**B_opt = 0.2920 · C^0.3271** tokens" in text
    assert "one sequence each is a batch 1.7 times B_opt" in text
    assert "about 4,700 GPUs" in text and "about 19.5 M tokens, 4.6 times the 4M" in text
    for bad in (0, -1.0, True, "1e24"):
        with pytest.raises(ValueError, match="positive compute budget"):
            scaling.optimal_batch_tokens(bad)


def test_the_optimal_batch_grows_with_the_compute_budget():
    """Property: B_opt rises with C (a positive exponent), and doubling C multiplies it by
    2^0.3271 whatever C is."""
    from hypothesis import given, settings
    from hypothesis import strategies as st
    from distlab.layout.scaling import B_OPT_EXPONENT, optimal_batch_tokens

    @settings(max_examples=200, deadline=None)
    @given(st.floats(1e15, 1e28), st.floats(1.0001, 1e3))
    def grows(c, factor):
        small, big = optimal_batch_tokens(c), optimal_batch_tokens(c * factor)
        assert big > small
        assert optimal_batch_tokens(2 * c) / small == pytest.approx(2 ** B_OPT_EXPONENT, rel=1e-9)

    grows()


def test_restart_read_from_storage_or_a_peer_as_10b_says():
    """Chapter 10b's restart-read paragraph: every rank's 16 GB through Llama 3's 2 TB/s storage
    against the same bytes over one NDR NIC, and what each adds to the time lost."""
    from distlab import checkpoint, hardware, layout
    from distlab.checkpoint import costs
    assert (costs.LLAMA3_STORAGE_SUSTAINED, costs.LLAMA3_STORAGE_PEAK) == (2e12, 7e12)
    shards = checkpoint.save_costs(layout.SHAPES["Llama-2 70B"], dp=1, pp=8, tp=8)["sharded_read"]
    nic = hardware.PRESETS["h100-cluster"].inter.bandwidth
    assert nic == hardware.IB_NDR.bandwidth == 47e9
    r = costs.restart_read(shards, 16384, nic)
    assert r["storage"] == pytest.approx(shards * 16384 / 2e12) and r["peer"] == shards / nic
    peak = costs.restart_read(shards, 16384, nic, storage_bps=7e12)["storage"]
    mtbf = checkpoint.mtbf_seconds(16384)
    tau = checkpoint.young_daly(10, mtbf)
    extra = (checkpoint.lost_fraction(tau, 10, mtbf, restart_s=r["storage"])
             - checkpoint.lost_fraction(tau, 10, mtbf))
    text = _prose(_chapter_10b())
    assert (f"{r['storage']:.0f} s per failure, about {86400 / mtbf * r['storage'] / 60:.0f} "
            f"minutes a day") in text
    assert f"{100 * extra:.1f} % of the job on top of the " \
           f"{100 * checkpoint.lost_fraction(tau, 10, mtbf):.1f} % above" in text
    assert f"peak, {peak:.0f} s)" in text and r["peer"] < 0.5 < 1 < r["storage"]
    assert "From a peer it is a third of a second" in text
    assert "Chapter 13's section 3" in text
    for bad in (dict(bytes_per_rank=0), dict(gpus=0), dict(nic_bps=-1)):
        args = {**dict(bytes_per_rank=shards, gpus=8, nic_bps=nic), **bad}
        with pytest.raises(ValueError, match="restart_read's"):
            costs.restart_read(**args)
