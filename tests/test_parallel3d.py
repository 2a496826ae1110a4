"""3D parallelism (dp x pp x tp on one mesh) equals single-process training, step by step."""
import pytest
import torch

import distlab
from distlab import parallel3d as p3
from distlab.models import batches_of, lm_loss, make_gpt, token_data

CFG = dict(vocab=32, d_model=16, n_heads=2, n_layers=4, seq_len=8)
LR = 0.1


def frozen_and_tied(gpt):
    """blocks.0's ln1 and attn.qkv frozen, the head's weight tied to the token embedding."""
    gpt.blocks[0].ln1.requires_grad_(False)
    gpt.blocks[0].attn.qkv.requires_grad_(False)
    gpt.head.weight = gpt.tok.weight
    return gpt


def _train_and_compare(rank, world_size, dp, pp, tp, steps, batch, n_micro, cfg=CFG,
                       odd=False):
    """Train on the mesh and, in the same rank, the dense float64 model on the same batches.
    odd: the model is frozen_and_tied (before, the stages trained the frozen parameters and
    trained the head apart from the embedding).

    Returns per step (3D loss, reference loss) and the largest difference seen between any of
    this rank's gradients or updated parameters and its shard of the reference's.
    """
    mesh = p3.Mesh3D(dp, pp, tp)
    build = frozen_and_tied if odd else (lambda gpt: gpt)
    ref = build(make_gpt(seed=0, **cfg).double())
    stage = p3.Stage3D.from_dense(build(make_gpt(seed=0, **cfg).double()), mesh)
    x, y = token_data(n=4 * batch, seq_len=cfg["seq_len"], vocab=cfg["vocab"], seed=1)
    worst = {"grad": 0.0, "param": 0.0}
    losses = []
    for xb, yb in batches_of(x, y, batch, steps):
        loss = p3.train_step(stage, mesh, xb, yb, n_micro, LR)
        ref.zero_grad()
        ref_loss = lm_loss(ref(xb), yb)
        ref_loss.backward()
        with torch.no_grad():
            for p in ref.parameters():
                if p.grad is not None:
                    p.add_(p.grad, alpha=-LR)
        for name, p in stage.named_parameters():
            full = ref.get_parameter(stage.dense_name(name))
            assert (p.grad is None) == (full.grad is None), f"{name}: a gradient in one only"
            if p.grad is not None:
                worst["grad"] = max(worst["grad"],
                                    (p.grad - stage.shard_of(name, full.grad)).abs().max().item())
            worst["param"] = max(worst["param"],
                                 (p.detach() - stage.shard_of(name, full.detach())).abs().max().item())
        losses.append((loss, ref_loss.item()))
    dense = p3.dense_state_dict(stage, mesh)
    if dense is not None:
        full = ref.state_dict()
        assert set(dense) == set(full)
        worst["gathered"] = max((dense[k] - full[k]).abs().max().item() for k in full)
    return losses, worst


# Grouped-query attention: 4 query heads share 2 K/V heads; at tp=4 each K/V head is split across
# the 2 ranks that share it (tensor_parallel.kv_head_split), at tp=2 each rank holds one whole.
GQA = dict(CFG, n_heads=4, n_kv_heads=2)


@pytest.mark.parametrize("dp, pp, tp, batch, n_micro, cfg", [
    (1, 2, 4, 4, 2, GQA),
    (3, 1, 2, 6, 1, GQA),
])
def test_3d_with_grouped_query_attention_equals_single_process(dp, pp, tp, batch, n_micro, cfg):
    test_3d_equals_single_process(dp, pp, tp, batch, n_micro, False, cfg)


@pytest.mark.parametrize("dp, pp, tp, batch, n_micro, odd", [
    (2, 2, 2, 8, 2, True),      # the full 2x2x2 mesh: 8 ranks; frozen and tied
    (1, 3, 1, 6, 3, True),      # three pipeline stages (odd), micro-batches of 2; frozen and tied
    (3, 1, 1, 6, 1, False),     # three data-parallel replicas (odd)
    (1, 2, 2, 4, 2, False),     # pipeline x tensor without data parallel
    (1, 1, 1, 4, 2, True),      # one rank: both copies of the tied weight on it
    (5, 1, 1, 15, 1, False),    # five replicas
    (1, 3, 2, 6, 3, False),     # six ranks: 4 blocks over 3 stages (1, 2, 1)
])
def test_3d_equals_single_process(dp, pp, tp, batch, n_micro, odd, cfg=CFG):
    results = distlab.run(_train_and_compare, dp * pp * tp, dp, pp, tp, 3, batch, n_micro, cfg,
                          odd, timeout=120)
    for rank, (losses, worst) in enumerate(results):
        for step, (got, expected) in enumerate(losses):
            assert got == pytest.approx(expected, abs=1e-12), f"rank {rank}, step {step}"
        assert worst["grad"] < 1e-12, f"rank {rank}: gradients differ by {worst['grad']}"
        assert worst["param"] < 1e-12, f"rank {rank}: parameters differ by {worst['param']}"
    assert results[0][1]["gathered"] < 1e-12
    # The loss moves: equal curves are not equal because nothing happened.
    assert results[0][0][0][1] != pytest.approx(results[0][0][-1][1], abs=1e-3)


def _tp_that_does_not_divide(rank, world_size):
    p3.Stage3D.from_dense(make_gpt(seed=0, **CFG), p3.Mesh3D(1, 1, world_size))


def test_a_tp_size_that_does_not_divide_the_model_is_a_clear_error():
    # d_model 16 with 2 heads: no 5-way split of the heads or of the matrices.
    with pytest.raises(distlab.RankFailed, match=r"does not split evenly across 5 tensor-parallel "
                                                 r"ranks; choose a multiple of 5\."):
        distlab.run(_tp_that_does_not_divide, 5, timeout=120)


def test_ties_the_stages_cannot_keep_are_refused_in_a_sentence():
    """Checked before any collective, so without ranks."""
    gpt = make_gpt(seed=0, **CFG)
    gpt.blocks[1].ln1.weight = gpt.blocks[0].ln1.weight      # across blocks: two stages' blocks
    with pytest.raises(ValueError, match=r"^blocks\.0\.ln1\.weight and blocks\.1\.ln1\.weight "
                                         r"are tied: the stages keep a head tied to the token "
                                         r"embedding, and ties inside one block, not this one; "
                                         r"untie them \(give each its own nn\.Parameter\) "
                                         r"first\.$"):
        p3.Stage3D(gpt, 0, 2, None)
    gpt = frozen_and_tied(make_gpt(seed=0, **CFG))          # a tied head: needs the group
    with pytest.raises(ValueError, match=r"over 2 pipeline stages their gradients must be summed "
                                         r"between the first and the last stage: build the "
                                         r"stages with Stage3D\.from_dense\(gpt, mesh\)"):
        p3.Stage3D(gpt, 1, 2, None)


def test_a_batch_that_does_not_split_into_micro_batches_is_a_clear_error():
    with pytest.raises(distlab.RankFailed, match="each data-parallel rank's 5 samples do not "
                                                 "split into 2 equal micro-batches"):
        distlab.run(_train_and_compare, 1, 1, 1, 1, 1, 5, 2, timeout=120)


def _train_without_dp_average(rank, world_size):
    mesh = p3.Mesh3D(2, 1, 1)
    stage = p3.Stage3D.from_dense(make_gpt(seed=0, **CFG).double(), mesh)
    original = p3.average_gradients
    p3.average_gradients = lambda *a, **k: None   # the bug: replicas step on their own shard
    try:
        x, y = token_data(n=8, seq_len=CFG["seq_len"], vocab=CFG["vocab"], seed=1)
        p3.train_step(stage, mesh, x, y, 1, LR)
    finally:
        p3.average_gradients = original
    return stage.blocks[0].mlp.fc1.weight.detach().clone()


def test_a_missing_dp_average_is_visible():
    """The comparison can fail: without the dp all-reduce the two replicas drift apart."""
    a, b = distlab.run(_train_without_dp_average, 2, timeout=120)
    assert (a - b).abs().max() > 1e-6


def test_stage_bounds():
    assert p3.stage_bounds(4, 2) == [(0, 2), (2, 4)]
    assert p3.stage_bounds(4, 3) == [(0, 1), (1, 3), (3, 4)]
    with pytest.raises(ValueError, match="every stage needs at least one block"):
        p3.stage_bounds(2, 3)


def test_layout_table_names_every_rank():
    rows = p3.layout_table(2, 2, 2, 4)
    assert [r for r, _, _ in rows] == list(range(8))
    assert rows[5] == (5, (1, 0, 1), "embeddings, blocks 0-1 (1/2 of each matrix); batch part 2 of 2")
    assert "ln_f + head" in rows[2][2]


# ---- the layout ranking ----------------------------------------------------------------------------

def test_candidates_split_the_gpus_the_model_and_the_batch():
    from distlab import layout
    found = layout.candidates(32, 8, layers=40, heads=40, global_batch=512, micro_batch=1)
    assert (32, 1, 1, 1) in found and (4, 2, 1, 4) in found
    for dp, pp, cp, tp in found:
        assert dp * pp * tp == 32 and cp == 1 and 8 % tp == 0 and 40 % tp == 0 and 40 % pp == 0
    assert (4, 1, 1, 8) in found and all(tp != 16 for *_, tp in found)   # tp stays in a node
    with_cp = layout.candidates(32, 8, layers=40, heads=40, global_batch=512, micro_batch=1,
                                cps=(1, 4), seq_len=1000)
    assert (2, 1, 4, 4) in with_cp and all(dp * pp * cp * tp == 32 for dp, pp, cp, tp in with_cp)
    # zig-zag needs 2·cp chunks of the sequence: 1000 tokens split into 8 but not into 16
    assert not layout.candidates(32, 8, 40, 40, 512, 1, cps=(8,), seq_len=1000)


def test_context_parallelism_divides_activations_and_pays_ring_traffic():
    from distlab import hardware, layout, memory
    kw = dict(seq_len=32768, global_batch=64, checkpointing="full", zero_stage=1)
    base = layout.price("Llama-2 7B", dp=4, pp=1, tp=8, **kw)
    with_cp = layout.price("Llama-2 7B", dp=1, pp=1, tp=8, cp=4, overlap_cp=False, **kw)
    hidden_cp = layout.price("Llama-2 7B", dp=1, pp=1, tp=8, cp=4, **kw)
    n = memory.PRESETS["Llama-2 7B"][0]
    # each rank keeps the layer inputs of 1/cp of the sequence (split 1/tp by SP)
    saved = memory.activation_breakdown(32768 // 4, 1, 4096, 32, recompute="full", tp=8,
                                        sequence_parallel=True)
    emb = 2 * 32000 * 4096 / 8
    states = sum(memory.model_state_bytes((n - 2 * 32000 * 4096) / 8 + emb, zero_stage=1,
                                          world_size=4).values())
    assert with_cp["steady_gb"] * 1e9 == pytest.approx(states + 32 * sum(saved.values()))
    assert base["cp_s"] == 0.0 and with_cp["cp_s"] > 0
    # ring attention: cp - 1 hops of K, V forward (twice: the recompute) and K, V, dK, dV back
    block = 2 * 32768 // 4 * 4096 / 8
    link = hardware.PRESETS["h100-cluster"].link_between([0, 8, 16, 24])
    hops = 2 * link.seconds("send", 2 * block, 2) + link.seconds("send", 4 * block, 2)
    m = 64
    assert with_cp["cp_s"] == pytest.approx(m * 32 * 3 * hops)
    assert hidden_cp["cp_s"] < with_cp["cp_s"]      # hidden behind attention as far as it lasts


def test_price_follows_the_memory_model_stage_by_stage():
    from distlab import layout, memory
    r = layout.price("Llama-2 7B", dp=4, pp=2, tp=4, gpus_per_node=8, global_batch=64,
                     seq_len=2048, micro_batch=1, zero_stage=0)
    n = memory.PRESETS["Llama-2 7B"][0]
    first = (n - 2 * 32000 * 4096) / 8 + 32000 * 4096 / 4        # half the layers + embedding
    saved = memory.activation_breakdown(2048, 1, 4096, 32, recompute="full", tp=4,
                                        sequence_parallel=True)
    # 1F1B: the first stage holds pp = 2 micro-batches of its 16 layers
    assert r["steady_gb"] * 1e9 == pytest.approx(sum(memory.model_state_bytes(first).values())
                                                 + 2 * 16 * sum(saved.values()))
    assert r["micro_batches"] == 16 and r["gb"] > r["steady_gb"]


def test_rank_layouts_puts_what_fits_first_fastest_first():
    from distlab import layout
    rows = layout.rank_layouts("Llama-2 70B", nodes=4, gpus_per_node=8)
    fits = [r["fits"] for r in rows]
    assert fits == sorted(fits, reverse=True) and True in fits and False in fits
    fitting = [r["step_s"] for r in rows if r["fits"]]
    assert fitting == sorted(fitting)
    with pytest.raises(ValueError, match="no layout of GPT-3 175B fits"):
        layout.best("GPT-3 175B", nodes=1)


def test_the_layout_picture_draws_every_communication_and_each_node():
    """Issue 31: arrows for the tp all-reduces, pp sends and dp all-reduce, a frame per node,
    and the replicated embeddings and head labelled whole, not as a tp shard."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import ConnectionPatch, FancyArrowPatch, Rectangle
    from distlab.viz import layout as viz_layout
    dp, pp, tp = 2, 2, 2
    fig = viz_layout.draw_layout(dp, pp, tp, n_layers=4, gpus_per_node=4)
    colours = [matplotlib.colors.to_hex(a.get_edgecolor()) for ax in fig.axes for a in ax.patches
               if isinstance(a, FancyArrowPatch)]
    assert colours.count(viz_layout.TP_COLOUR.lower()) == dp * pp * (tp - 1)
    assert colours.count(viz_layout.PP_COLOUR.lower()) == dp * (pp - 1) * tp
    assert sum(isinstance(a, ConnectionPatch) for a in fig.artists) == dp - 1
    frames = [a for ax in fig.axes for a in ax.patches
              if isinstance(a, Rectangle) and not a.get_fill()]
    assert len(frames) == dp * pp * tp // 4                  # two nodes of four ranks
    texts = [t.get_text() for ax in fig.axes for t in ax.texts]
    assert sum("emb: whole" in t for t in texts) == dp * tp
    assert sum("head: whole" in t for t in texts) == dp * tp
    assert not any("shard" in t for t in texts)
    plt.close(fig)


def _square_ranks(ax):
    """{(x0, y0, x1, y1): rank} of the filled squares of one panel, read from the picture: each
    square's extent, and the rank its 'rank N' label names at its centre."""
    from matplotlib.patches import Rectangle
    squares = {}
    for box in ax.patches:
        if isinstance(box, Rectangle) and box.get_fill():
            x0, y0 = box.get_xy()
            x1, y1 = x0 + box.get_width(), y0 + box.get_height()
            label = [t.get_text() for t in ax.texts if t.get_text().startswith("rank ")
                     and x0 < t.get_position()[0] < x1 and y0 < t.get_position()[1] < y1]
            assert len(label) == 1, f"square at {(x0, y0)} names {label}"
            squares[(x0, y0, x1, y1)] = int(label[0].split()[1])
    return squares


def _rank_at(squares, x, y, slack=0.12):
    """The rank whose square an arrow's end touches (on its edge or within `slack`)."""
    hit = [r for (x0, y0, x1, y1), r in squares.items()
           if x0 - slack <= x <= x1 + slack and y0 - slack <= y <= y1 + slack]
    assert len(hit) == 1, f"an arrow ends at {(x, y)}, touching squares {hit}"
    return hit[0]


@pytest.mark.parametrize("dp, pp, tp", [(2, 2, 2), (3, 2, 2), (2, 3, 2), (2, 1, 4)])
def test_the_layout_pictures_arrows_join_the_groups_they_stand_for(dp, pp, tp):
    """Issue 45: every drawn arrow, read back from its endpoints, joins two ranks of one group
    of its kind (tp arrows: a tp group; pp arrows: neighbouring stages of a pp group; the dp arc:
    dp peers), and every tp and pp neighbour pair is drawn. The dp arrow once joined rank 1 to
    rank 4, which are not dp peers."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import ConnectionPatch, FancyArrowPatch
    from distlab.mesh import all_groups
    from distlab.viz import layout as viz_layout
    fig = viz_layout.draw_layout(dp, pp, tp, n_layers=6, gpus_per_node=pp * tp)
    panels = [ax for ax in fig.axes if any(t.get_text().startswith("rank ") for t in ax.texts)]
    assert len(panels) == dp
    squares = [_square_ranks(ax) for ax in panels]
    groups = {dim: [set(g) for g in lists]
              for dim, lists in all_groups((dp, pp, tp), ("dp", "pp", "tp")).items()}
    drawn = {"tp": set(), "pp": set(), "dp": set()}
    kinds = {viz_layout.TP_COLOUR.lower(): "tp", viz_layout.PP_COLOUR.lower(): "pp"}
    for ax, sq in zip(panels, squares):
        for arrow in ax.patches:
            if isinstance(arrow, FancyArrowPatch):
                kind = kinds[matplotlib.colors.to_hex(arrow.get_edgecolor())]
                (xa, ya), (xb, yb) = arrow._posA_posB
                drawn[kind].add((_rank_at(sq, xa, ya), _rank_at(sq, xb, yb)))
    for arc in fig.artists:
        if isinstance(arc, ConnectionPatch):
            a, b = panels.index(arc.axesA), panels.index(arc.axesB)
            drawn["dp"].add((_rank_at(squares[a], *arc.xy1), _rank_at(squares[b], *arc.xy2)))
    for kind, pairs in drawn.items():
        for a, b in pairs:
            assert a != b and any({a, b} <= g for g in groups[kind]), (
                f"a {kind} arrow joins ranks {a} and {b}, which share no {kind} group")
    coord = {r: (r // (pp * tp), r // tp % pp, r % tp) for r in range(dp * pp * tp)}
    tp_pairs = {(r, r + 1) for r in coord if coord[r][2] < tp - 1}
    pp_pairs = {(r, r + tp) for r in coord if coord[r][1] < pp - 1}
    assert drawn["tp"] == tp_pairs and drawn["pp"] == pp_pairs
    assert len(drawn["dp"]) == dp - 1
    plt.close(fig)
