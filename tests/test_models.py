"""The shared models and data are deterministic, and the reference training learns."""
import torch

from distlab import models


def test_same_seed_same_weights_and_global_rng_untouched():
    torch.manual_seed(123)
    before = torch.rand(1)
    torch.manual_seed(123)
    a, b = models.make_mlp(seed=3), models.make_mlp(seed=3)
    assert torch.equal(torch.rand(1), before)
    for p, q in zip(a.parameters(), b.parameters()):
        assert torch.equal(p, q)
    c = models.make_mlp(seed=4)
    assert not torch.equal(next(a.parameters()), next(c.parameters()))


def test_gpt_runs_and_data_is_deterministic():
    x, y = models.token_data(n=8, seq_len=16, vocab=64, seed=1)
    x2, _ = models.token_data(n=8, seq_len=16, vocab=64, seed=1)
    assert torch.equal(x, x2) and torch.equal(x[:, 1:], y[:, :-1])
    gpt = models.make_gpt(seed=0)
    assert gpt(x).shape == (8, 16, 64)


def test_reference_training_reduces_the_loss():
    x, y = models.regression_data(n=128, seed=0)
    losses = models.train_reference(models.make_mlp(seed=0), models.batches_of(x, y, 32, 60),
                                    lr=0.2)
    assert losses[-1] < 0.7 * losses[0]
    gx, gy = models.token_data(n=32, seed=0)
    gpt_losses = models.train_reference(models.make_gpt(seed=0), models.batches_of(gx, gy, 16, 20),
                                        loss_fn=models.lm_loss, optimizer="adam", lr=3e-3)
    assert gpt_losses[-1] < gpt_losses[0]
