"""dp × pp × cp × tp on one mesh equals one process: losses and every parameter shard after SGD
steps. One launch per layout: 2×2×2×1 and 1×2×2×2 are the two 8-rank meshes with every kind of
group (each leaves one dimension at 1; 2×2×2×2 would take 16 ranks), 1×1×3×1 an odd ring, and
1×1×2×4 with grouped-query attention (8 query heads, 2 K/V heads: each K/V head split across
the 2 tp ranks that share it and gathered, then widened to the rank's 2 query heads only inside
the ring's kernels; the ring carries the small K/V). One more 4-rank launch: 11 tokens train at
cp = 1 (1×2×1×2) and are refused at cp = 2 (1×1×2×2) with the sizes that would split them."""
import pytest
import torch

import distlab
from distlab import models
from distlab.parallel4d import Mesh4D, Stage4D, train_step
from test_parallel3d import frozen_and_tied

CONFIG = dict(vocab=32, d_model=16, n_heads=4, n_layers=2, seq_len=12)
GQA = dict(CONFIG, n_heads=8, n_kv_heads=2)
STEPS, LR = 2, 0.1


def _data(seq_len=12):
    return models.token_data(n=4, seq_len=seq_len, vocab=32, seed=1)


def _gpt(config, odd):
    gpt = models.make_gpt(seed=0, **config).double()
    return frozen_and_tied(gpt) if odd else gpt


def _dense(config=CONFIG, seq_len=12, odd=False):
    gpt = _gpt(config, odd)
    x, y = _data(seq_len)
    losses = []
    for _ in range(STEPS):
        gpt.zero_grad()
        loss = models.lm_loss(gpt(x), y)
        loss.backward()
        with torch.no_grad():
            for p in gpt.parameters():
                if p.grad is not None:
                    p.add_(p.grad, alpha=-LR)
        losses.append(loss.item())
    return gpt, losses


def _run_4d(rank, world_size, dp, pp, cp, tp, n_micro, config=CONFIG, seq_len=12, odd=False):
    mesh = Mesh4D(dp, pp, cp, tp)
    stage = Stage4D.from_dense(_gpt(config, odd), mesh)
    x, y = _data(seq_len)
    losses = [train_step(stage, mesh, x, y, LR, n_micro) for _ in range(STEPS)]
    return losses, {stage.dense_name(n): p.detach() for n, p in stage.named_parameters()}


def _odd_lengths(rank, world_size):
    """In one 4-rank launch: 11 tokens on a 1x2x1x2 mesh (cp = 1: any length splits), then on
    a 1x1x2x2 mesh, whose refusal is kept."""
    at_cp1 = _run_4d(rank, world_size, 1, 2, 1, 2, 2, seq_len=11)
    try:
        _run_4d(rank, world_size, 1, 1, 2, 2, 1, seq_len=11)
        refusal = None
    except ValueError as e:
        refusal = str(e)
    return at_cp1, refusal


# odd: blocks.0's ln1 and attn.qkv frozen and the head tied to the embedding (before, the
# stages trained both apart): across two stages at 1x2x2x2, on one stage at 1x1x3x1
@pytest.mark.parametrize("dp,pp,cp,tp,n_micro,config,odd", [
    (2, 2, 2, 1, 2, CONFIG, False), (1, 2, 2, 2, 2, CONFIG, True), (1, 1, 3, 1, 1, CONFIG, True),
    (1, 1, 2, 4, 1, GQA, False)])
def test_dp_pp_cp_tp_equals_one_process(dp, pp, cp, tp, n_micro, config, odd):
    dense, dense_losses = _dense(config, odd=odd)
    results = distlab.run(_run_4d, dp * pp * cp * tp, dp, pp, cp, tp, n_micro, config,
                          odd=odd, timeout=120)
    _equal_dense(results, dense, dense_losses, tp, config)


def _equal_dense(results, dense, dense_losses, tp, config=CONFIG):
    held = set()
    for rank, (losses, params) in enumerate(results):
        assert losses == pytest.approx(dense_losses, rel=1e-12)
        held |= set(params)
        for name, value in params.items():
            full = dense.get_parameter(name).detach()
            # the tp shard of the dense parameter that this rank holds
            expected = _shard(full, name, tp, rank % tp, config)
            torch.testing.assert_close(value, expected, rtol=1e-10, atol=1e-12,
                                       msg=lambda m: f"rank {rank} {name}: {m}")
    # the stages hold every layer, a tied weight under both names
    assert held == {n for n, _ in dense.named_parameters(remove_duplicate=False)}
    assert dense_losses[0] != pytest.approx(dense_losses[-1], abs=1e-3)   # training moved


def _shard(full, name, tp, t, config):
    """Chapter 07's layout: qkv and fc1 split by output rows (qkv per q/k/v: under grouped-query
    attention k and v are n_kv_heads heads wide), proj and fc2 by input columns (bias whole)."""
    if tp == 1:
        return full
    if ".qkv." in name:
        d, kv = config["d_model"], config.get("n_kv_heads") or config["n_heads"]
        kv_rows = kv * d // config["n_heads"]
        return torch.cat([part.chunk(tp, dim=0)[t] for part in full.split((d, kv_rows, kv_rows))])
    if ".fc1." in name:
        return full.chunk(tp, dim=0)[t]
    if (".proj." in name or ".fc2." in name) and name.endswith("weight"):
        return full.chunk(tp, dim=1)[t]
    return full


def test_odd_lengths_train_at_cp_1_and_are_refused_at_cp_2_with_what_to_do():
    results = distlab.run(_odd_lengths, 4, timeout=120)
    dense, dense_losses = _dense(seq_len=11)
    _equal_dense([at_cp1 for at_cp1, _ in results], dense, dense_losses, tp=2)
    for _, refusal in results:
        assert refusal == ("a sequence of 11 tokens does not split into 4 equal chunks for the "
                           "zig-zag layout (2 per rank); pad the sequence to a multiple of 4 "
                           "(padding tokens masked out), or choose a context-parallel size that "
                           "splits it: cp = 1 here.")
