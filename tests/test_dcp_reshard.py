"""DTensor-sharded checkpoints reshard at load like DCP does (issue 31): saved by dp=1 x pp=2 x
tp=2, loaded under three other layouts, every rank's shards of the model and of Adam's moments
equal bit for bit what the dense format gives; each rank reads only the chunks it needs; a
background save (dcp.async_save) writes the state as it was when save returned; the files
consolidate into one torch.save file the dense model loads; grouped-query attention's unequal q, k, v
pieces reshard too; saves started while a background save is still being written lose no
checkpoint and never hang (issue 42). ONE launch of 4 ranks does it all."""
import os

import pytest
import torch

import distlab
from distlab import checkpoint, layout
from distlab import parallel3d as p3
from distlab.models import make_gpt

CFG = dict(vocab=32, d_model=16, n_heads=4, n_layers=2, seq_len=8)
SAVED = (1, 2, 2)
LOADS = [(2, 1, 2), (4, 1, 1), (1, 1, 4)]     # pp 2 -> 1 with dp 1 -> 2; tp 2 -> 1; tp 2 -> 4


def dense_state(cfg=CFG):
    """The dense model, and Adam moments of its shape that no layout could produce by chance."""
    model = make_gpt(seed=0, **cfg).double()
    moments = {n: (p.detach() * 3 + 1, p.detach() ** 2 + 0.5) for n, p in model.named_parameters()}
    return model, moments


def build(dp, pp, tp, cfg=CFG):
    from distlab.train import Adam
    model, moments = dense_state(cfg)
    mesh = p3.Mesh3D(dp, pp, tp)
    stage = p3.Stage3D.from_dense(model, mesh, torch.device("cpu"))
    adam = Adam(stage, lr=0.01)
    for name in adam.state:
        m, v = moments[stage.dense_name(name)]
        adam.state[name]["exp_avg"].copy_(stage.shard_of(name, m))
        adam.state[name]["exp_avg_sq"].copy_(stage.shard_of(name, v))
    adam.steps = 7
    return model, moments, mesh, stage, adam


def zero(stage, adam):
    with torch.no_grad():
        for p in stage.parameters():
            p.fill_(float("nan"))
        for s in adam.state.values():
            s["exp_avg"].fill_(float("nan")), s["exp_avg_sq"].fill_(float("nan"))
    adam.steps = 0


def exact(stage, adam, model, moments):
    """Every shard of this rank equals its slice of the dense tensors, bit for bit."""
    dense = dict(model.named_parameters())
    for name, p in stage.named_parameters():
        full = stage.dense_name(name)
        m, v = moments[full]
        if not (torch.equal(p, stage.shard_of(name, dense[full].detach()))
                and torch.equal(adam.state[name]["exp_avg"], stage.shard_of(name, m))
                and torch.equal(adam.state[name]["exp_avg_sq"], stage.shard_of(name, v))):
            return f"{name} differs"
    return "exact" if adam.steps == 7 else f"Adam's step is {adam.steps}"


def reshard(rank, world_size, folder):
    sharded, dense, background = (os.path.join(folder, f) for f in ("sharded", "dense", "async"))
    model, moments, mesh, stage, adam = build(*SAVED)
    meta = dict(config=CFG)
    checkpoint.save(sharded, 3, stage, mesh, adam, meta)
    checkpoint.save(dense, 3, stage, mesh, adam, meta, sharded=False)
    pending = checkpoint.save(background, 3, stage, mesh, adam, meta, background=True)
    zero(stage, adam)             # training goes on at once: the staged copy must not see it
    pending.wait()
    out = {}
    for shape in LOADS:
        model, moments, mesh, stage, adam = build(*shape)
        row = {}
        kinds = [("sharded", sharded), ("dense", dense)] + [("async", background)] * (shape == LOADS[0])
        for name, folder_ in kinds:
            zero(stage, adam)
            got = checkpoint.load(checkpoint.latest(folder_), stage, mesh, adam)
            row[name] = (exact(stage, adam, model, moments), got["read_bytes"])
        out[shape] = row
    return out, gqa_reshard(os.path.join(folder, "gqa")), save_orders(os.path.join(folder, "orders"))


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    folder = str(tmp_path_factory.mktemp("reshard"))
    # the timeout is what stands between a save order that deadlocks and a hung suite
    results = distlab.run(reshard, 4, folder, timeout=240)
    return folder, [r[0] for r in results], [r[1] for r in results], [r[2] for r in results]


def test_every_layout_loads_the_sharded_save_bit_for_bit_as_the_dense_one(run):
    _, results, _, _ = run
    for rank, rows in enumerate(results):
        for shape, row in rows.items():
            for name, (verdict, _) in row.items():
                assert verdict == "exact", (rank, shape, name, verdict)


def test_each_rank_reads_only_the_chunks_its_new_shard_overlaps(run):
    _, results, _, _ = run
    for rows in results:
        for (dp, pp, tp), row in rows.items():
            sharded, dense = row["sharded"][1], row["dense"][1]
            assert row.get("async", row["sharded"])[1] == sharded
            # the dense format reads every tensor of the stage whole, the sharded its 1/tp
            assert (sharded < dense) == (tp > 1) and sharded <= dense
    # the same rank, the same stage: tp=4 reads about half of what tp=2 reads
    by = {shape: results[0][shape]["sharded"][1] for shape in results[0]}
    assert by[(1, 1, 4)] < by[(2, 1, 2)] < by[(4, 1, 1)]
    assert "async" in results[0][LOADS[0]]


def test_both_formats_hold_the_same_dense_tensors_and_consolidate_for_inference(run, tmp_path):
    folder, _, _, _ = run
    sharded, dense = (checkpoint.read(os.path.join(folder, f)) for f in ("sharded", "dense"))
    assert sharded["layout"] == SAVED and dense["layout"] is None
    for part in ("model", "optim"):
        assert sharded[part].keys() == dense[part].keys()
        for k, v in dense[part].items():
            assert torch.equal(sharded[part][k], v), (part, k)
    file = str(tmp_path / "model.pt")
    checkpoint.consolidate(os.path.join(folder, "sharded"), file)
    model, _ = dense_state()
    fresh = make_gpt(seed=1, **CFG).double()
    fresh.load_state_dict(torch.load(file))                  # strict: every name, every shape
    for (k, a), b in zip(fresh.state_dict().items(), model.state_dict().values()):
        assert torch.equal(a, b), k


def test_a_tp_the_heads_cannot_take_is_refused_in_one_sentence(run):
    folder, _, _, _ = run
    path = checkpoint.latest(os.path.join(folder, "sharded"))
    assert checkpoint.reshard_problem(path, 2, 4) is None
    assert checkpoint.reshard_problem(path, 4, 4) is None
    assert checkpoint.reshard_problem(path, 3, 4) == (
        f"{path} holds a model with 4 attention heads, which 3 tensor-parallel ranks cannot "
        f"share (each computes whole heads); load it with tp in [1, 2, 4].")
    # grouped-query attention: 4 query heads, 2 K/V heads (each shared by 2 ranks at tp=4)
    gqa = checkpoint.latest(os.path.join(folder, "gqa"))
    for tp in (1, 2, 4):
        assert checkpoint.reshard_problem(gqa, tp, 4, n_kv_heads=2) is None, tp
    for tp in (3, 8):
        why = checkpoint.reshard_problem(gqa, tp, 4, n_kv_heads=2)
        assert why.startswith(f"{gqa} holds a model with grouped-query attention: n_heads=4 does "
                              f"not split evenly across {tp} tensor-parallel ranks"), why
        assert why.endswith("one of [1, 2, 4]."), why


def test_the_dense_formats_cost_at_70b_and_the_young_daly_interval():
    shape = layout.SHAPES["Llama-2 70B"]
    c = checkpoint.save_costs(shape, dp=1, pp=8, tp=8)
    # fp32 weights + 2 Adam moments of one eighth of 69 B parameters, on EVERY rank of the stage
    assert 95e9 < c["dense_held"] < 115e9 and c["dense_read"] == c["dense_held"]
    assert c["sharded_held"] < c["dense_held"] / 6           # 1/8, plus the replicated embedding
    assert c["written"] == shape.params() * 12
    # Llama 3: 419 interruptions in 54 days on 16,384 GPUs -> one every ~3.1 h for that job
    m = checkpoint.mtbf_seconds(16384)
    assert m == pytest.approx(54 * 86400 / 419) and 3.0 < m / 3600 < 3.2
    assert checkpoint.mtbf_seconds(64) == pytest.approx(m * 256)
    tau = checkpoint.young_daly(60, m)
    assert tau == pytest.approx((2 * 60 * m) ** 0.5)
    for other in (tau / 2, tau * 2):                        # it is the minimum
        assert checkpoint.lost_fraction(other, 60, m) > checkpoint.lost_fraction(tau, 60, m)


# Grouped-query attention stacks q, k, v of unequal sizes (16, 8, 8 rows here); at tp=4 the two
# K/V heads are each split across 2 ranks. Saved at tp=2, loaded at tp=4 and tp=1, in the same
# launch as the rest (reshard calls it).
GQA = dict(CFG, n_kv_heads=2)


def gqa_reshard(folder):
    model, moments, mesh, stage, adam = build(1, 2, 2, GQA)
    checkpoint.save(folder, 1, stage, mesh, adam, dict(config=GQA))
    out = {}
    for shape in ((1, 1, 4), (4, 1, 1)):
        model, moments, mesh, stage, adam = build(*shape, GQA)
        zero(stage, adam)
        checkpoint.load(checkpoint.latest(folder), stage, mesh, adam)
        out[shape] = exact(stage, adam, model, moments)
        dense = p3.dense_state_dict(stage, mesh)
        if dense is not None:
            out[shape, "gathered"] = all(torch.equal(dense[k], v)
                                         for k, v in model.state_dict().items())
    return out


def test_grouped_query_attention_checkpoints_reshard_with_its_unequal_pieces(run):
    folder, _, results, _ = run
    for rank, rows in enumerate(results):
        for key, verdict in rows.items():
            assert verdict in ("exact", True), (rank, key, verdict)
    assert results[0][(1, 1, 4), "gathered"] and results[0][(4, 1, 1), "gathered"]
    # In the files q, k and v are pieces of their own sizes; read() stacks them back.
    path = checkpoint.latest(os.path.join(folder, "gqa"))
    pieces = {k: tuple(md.size) for k, md in
              checkpoint._reader(path).read_metadata().state_dict_metadata.items()
              if k.startswith("model.blocks.0.attn.qkv.weight")}
    assert pieces == {f"model.blocks.0.attn.qkv.weight.{p}": (n, 16)
                      for p, n in (("q", 16), ("k", 8), ("v", 8))}
    merged = checkpoint.read(path)["model"]
    model, _ = dense_state(GQA)
    for k, v in model.state_dict().items():
        assert torch.equal(merged[k], v), k


def test_a_gqa_head_too_narrow_to_split_or_a_piece_tp_cannot_divide_is_refused(tmp_path):
    """reshard_problem reads the metadata only: a one-process DCP save of the shapes is enough.
    4 query heads of width 2 over 1 K/V head: at tp=4 each K/V head would be split 4 ways."""
    import warnings
    import torch.distributed.checkpoint as dcp
    shapes = {"model.blocks.0.attn.proj.weight": (8, 8), "model.blocks.0.attn.qkv.weight.q": (8, 8),
              "model.blocks.0.attn.qkv.weight.k": (2, 8), "model.blocks.0.attn.qkv.weight.v": (2, 8)}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")          # "assuming ... a single process": yes
        dcp.save({k: torch.zeros(s) for k, s in shapes.items()}, checkpoint_id=str(tmp_path))
    path = str(tmp_path)
    assert checkpoint.reshard_problem(path, 1, 4, n_kv_heads=1) is None
    assert checkpoint.reshard_problem(path, 2, 4, n_kv_heads=1) is None
    assert checkpoint.reshard_problem(path, 4, 4, n_kv_heads=1) == (
        f"{path}: a head is 2 wide, which the 4 ranks that share each K/V head at tp=4 cannot "
        f"split evenly; load it with a tp of at most n_kv_heads = 1.")
    # the same shapes read as multi-head attention: the 2-row k piece cannot take tp=4
    assert checkpoint.reshard_problem(path, 4, 4) == (
        f"{path}: blocks.0.attn.qkv.weight.k has 2 rows, which 4 tensor-parallel ranks cannot "
        f"share evenly; choose a tp that divides 2.")


# ---- saves started while a background save is still being written (issue 42) ----------------------

def save_orders(folder):
    """Each order of saves that lost both checkpoints or hung, in a folder of its own; what every
    rank saw (paths returned, sentences raised). Runs in reshard's launch, under its timeout."""
    _, _, mesh, stage, adam = build(*SAVED)
    out = {}

    def save(sub, step, **kw):
        return checkpoint.save(os.path.join(folder, sub), step, stage, mesh, adam, {}, **kw)

    def said(call):
        try:
            return call()
        except (ValueError, TypeError) as e:
            return f"{type(e).__name__}: {e}"

    # a background save of step 5 still being written, a plain save of step 6, then 5's wait()
    pending = save("newer", 5, background=True)
    out["newer"] = [save("newer", 6), pending.wait()]
    # the same with the steps the other way round: the pending save is the newer one
    pending = save("older", 8, background=True)
    out["older"] = [said(lambda: save("older", 7)), pending.wait()]
    # two background saves before any wait() (both threads used to share one group: deadlock)
    first = save("two", 10, background=True)
    second = save("two", 11, background=True)
    out["two"] = [second.wait(), first.wait()]
    # a commit of an older step after a newer one (as the pending save's wait() used to do)
    out["commit older"] = said(lambda: checkpoint._commit(os.path.join(folder, "newer"),
                                                          "step-000005"))
    # the same step saved three times: each save's folder orders after the last one's
    out["again"] = [os.path.basename(save("again", 3)) for _ in range(3)]
    # a folder that cannot be made: rank 0 finds out, every rank says so (no rank left waiting)
    with open(os.path.join(folder, "a-file"), "w"):
        pass
    out["under a file"] = said(lambda: save(os.path.join("a-file", "ckpt"), 1))
    return out


def on_disk(folder):
    """(the names in `folder`, what latest names, whether that checkpoint is whole)."""
    name = open(os.path.join(folder, "latest")).read()
    return sorted(os.listdir(folder)), name, checkpoint.damage(os.path.join(folder, name)) is None


def test_a_save_while_a_background_save_is_pending_keeps_the_newest_checkpoint(run):
    """The plain save first finishes the pending one (one save at a time, as torchtitan's
    CheckpointManager does); a commit never removes a step folder that is not older than its
    own, and latest never moves back to an older step."""
    folder, _, _, results = run
    orders = os.path.join(folder, "orders")
    for rank, got in enumerate(results):
        assert got["newer"] == [f"{orders}/newer/step-000006", f"{orders}/newer/step-000005"], rank
    assert on_disk(f"{orders}/newer") == (["latest", "step-000006"], "step-000006", True)
    refused = (f"ValueError: {orders}/older/latest already names step 8, newer than step 7: save "
               f"a step of at least 8, or into another folder.")
    for rank, got in enumerate(results):
        assert got["older"] == [refused, f"{orders}/older/step-000008"], rank
    assert on_disk(f"{orders}/older") == (["latest", "step-000008"], "step-000008", True)
    # what the pending save's wait() used to do: commit step 5 after step 6 had been committed
    for rank, got in enumerate(results):
        assert got["commit older"] == (
            f"ValueError: {orders}/newer/latest already names step-000006, newer than step-000005, "
            f"so step-000005 does not replace it: finish each save (wait()) before starting the "
            f"next."), rank
    assert on_disk(f"{orders}/newer") == (["latest", "step-000006"], "step-000006", True)


def test_each_save_of_the_same_step_orders_after_the_last_one(run):
    """step-3, then step-3.1 (removing step-3), then step-3.2: not step-3 again, which a commit
    would take for older than step-3.1."""
    folder, _, _, results = run
    for rank, got in enumerate(results):
        assert got["again"] == ["step-000003", "step-000003.1", "step-000003.2"], rank
    again = os.path.join(folder, "orders", "again")
    assert on_disk(again) == (["latest", "step-000003.2"], "step-000003.2", True)


def test_a_second_background_save_waits_for_the_first_instead_of_hanging(run):
    folder, _, _, results = run
    two = os.path.join(folder, "orders", "two")
    for rank, got in enumerate(results):
        assert got["two"] == [f"{two}/step-000011", f"{two}/step-000010"], rank
    assert on_disk(two) == (["latest", "step-000011"], "step-000011", True)


def test_a_checkpoint_folder_rank_0_cannot_make_is_one_sentence_on_every_rank(run):
    folder, _, _, results = run
    bad = os.path.join(folder, "orders", "a-file", "ckpt")
    for rank, got in enumerate(results):
        assert got["under a file"] == (f"ValueError: {bad} cannot hold checkpoints (Not a "
                                       f"directory): save into a folder you can write to."), rank


def test_the_reshard_picture_reads_each_row_from_the_chunk_that_holds_it():
    """Issue 45 (10b had no picture): every row of every loaded layout is coloured as the saved
    chunk it lies in, and each loaded rank's frame spans exactly its own rows."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Rectangle
    from distlab.viz.layout import STAGE_COLOURS, draw_reshard
    rows, saved = 8, 2
    fig = draw_reshard(saved_tp=saved, loaded=(4, 1), rows=rows)
    ax = fig.axes[0]
    cells = [p for p in ax.patches if isinstance(p, Rectangle) and p.get_fill()]
    frames = [p for p in ax.patches if isinstance(p, Rectangle) and not p.get_fill()]
    assert len(cells) == 3 * rows and len(frames) == saved + 4 + 1
    for cell in cells:
        row = int(round(cell.get_x()))
        want = matplotlib.colors.to_rgb(STAGE_COLOURS[row * saved // rows])
        assert matplotlib.colors.to_rgb(cell.get_facecolor()) == pytest.approx(want)
    widths = sorted(round(f.get_width() + 0.08) for f in frames)
    assert widths == [2] * 4 + [4] * 2 + [8]
    plt.close(fig)
