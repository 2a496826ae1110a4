"""dp × cp × tp on one mesh equals one process: losses and every parameter shard after SGD steps."""
import pytest
import torch

import distlab
from distlab import models
from distlab.parallel4d import ContextParallelGPT, Mesh4D, train_step

CONFIG = dict(vocab=32, d_model=16, n_heads=4, n_layers=2, seq_len=12)
STEPS, LR = 2, 0.1


def _data():
    return models.token_data(n=4, seq_len=12, vocab=32, seed=1)


def _dense():
    gpt = models.make_gpt(seed=0, **CONFIG).double()
    x, y = _data()
    losses = []
    for _ in range(STEPS):
        gpt.zero_grad()
        loss = models.lm_loss(gpt(x), y)
        loss.backward()
        with torch.no_grad():
            for p in gpt.parameters():
                p.add_(p.grad, alpha=-LR)
        losses.append(loss.item())
    return gpt, losses


def _run_4d(rank, world_size, dp, cp, tp):
    mesh = Mesh4D(dp, cp, tp)
    model = ContextParallelGPT.from_dense(models.make_gpt(seed=0, **CONFIG).double(), mesh)
    x, y = _data()
    losses = [train_step(model, mesh, x, y, LR) for _ in range(STEPS)]
    return losses, {n: p.detach() for n, p in model.named_parameters()}


@pytest.mark.parametrize("dp,cp,tp", [(1, 3, 1), (1, 2, 2), (2, 2, 2)])
def test_dp_cp_tp_equals_one_process(dp, cp, tp):
    dense, dense_losses = _dense()
    results = distlab.run(_run_4d, dp * cp * tp, dp, cp, tp, timeout=120)
    for rank, (losses, params) in enumerate(results):
        assert losses == pytest.approx(dense_losses, rel=1e-12)
        for name, value in params.items():
            full = dense.get_parameter(name).detach()
            # the tp shard of the dense parameter that this rank holds
            expected = _shard(dense, name, full, tp, rank % tp)
            torch.testing.assert_close(value, expected, rtol=1e-10, atol=1e-12,
                                       msg=lambda m: f"rank {rank} {name}: {m}")


def _shard(dense, name, full, tp, t):
    """Chapter 07's layout: qkv and fc1 split by output rows (qkv per q/k/v), proj and fc2 by
    input columns (their bias whole)."""
    if tp == 1:
        return full
    if ".qkv." in name:
        return torch.cat([part.chunk(tp, dim=0)[t] for part in full.chunk(3, dim=0)])
    if ".fc1." in name:
        return full.chunk(tp, dim=0)[t]
    if (".proj." in name or ".fc2." in name) and name.endswith("weight"):
        return full.chunk(tp, dim=1)[t]
    return full


def test_a_sequence_that_does_not_split_over_cp_is_refused():
    with pytest.raises(distlab.RankFailed, match="does not split into 8 equal chunks"):
        distlab.run(_run_4d, 4, 1, 4, 1)
