"""The small models and data shared by the course, and the single-process reference training.

Every strategy chapter proves "equal to one process" against `train_reference`, so everything
here is deterministic: a model built with the same seed has the same weights in every process,
and a dataset built with the same seed has the same samples.
"""
import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from . import _argcheck as check


def _seeded(seed, build):
    # fork_rng: building a model must not move the caller's global random state.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return build()


# ---- an MLP for regression --------------------------------------------------------------------

class MLP(nn.Module):
    """Linear → GELU → ... → Linear, as an nn.Sequential named `net` (easy to split into stages)."""

    def __init__(self, sizes=(16, 64, 64, 4)):
        super().__init__()
        sizes = _check_sizes(sizes)
        layers = []
        for i, (a, b) in enumerate(zip(sizes[:-1], sizes[1:])):
            layers.append(nn.Linear(a, b))
            if i < len(sizes) - 2:
                layers.append(nn.GELU())
        self.net = nn.Sequential(*layers)

    def forward(self, x):
        return self.net(x)


def make_mlp(sizes=(16, 64, 64, 4), seed=0):
    return _seeded(seed, lambda: MLP(sizes))


def regression_data(n=256, in_dim=16, out_dim=4, seed=0):
    """(x, y) with y a fixed random nonlinear function of x, plus noise."""
    n, in_dim, out_dim = (check.whole(v, name, at_least=1) for v, name in
                          ((n, "n"), (in_dim, "in_dim"), (out_dim, "out_dim")))
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, in_dim, generator=g)
    w = torch.randn(in_dim, out_dim, generator=g) / math.sqrt(in_dim)
    y = torch.tanh(x @ w) + 0.05 * torch.randn(n, out_dim, generator=g)
    return x, y


def _check_sizes(sizes):
    """The layer widths as ints; one size alone would build an MLP with no layer at all."""
    if isinstance(sizes, (str, bytes)) or not hasattr(sizes, "__len__"):
        raise TypeError(f"sizes are the layer widths in order, like (16, 64, 64, 4); got "
                        f"{sizes!r}.")
    if len(sizes) < 2:
        raise ValueError(f"sizes needs at least two widths (input and output), like "
                         f"(16, 64, 64, 4); got {tuple(sizes)}.")
    try:
        return tuple(check.whole(s, "every width", at_least=1) for s in sizes)
    except TypeError:
        raise TypeError(f"sizes must be whole numbers, like (16, 64, 64, 4); got "
                        f"{tuple(sizes)}.") from None
    except ValueError:
        raise ValueError(f"every width in sizes must be at least 1; got {tuple(sizes)}.") from None


def _check_tokens(idx, vocab):
    if not isinstance(idx, torch.Tensor) or idx.is_floating_point() or idx.dtype == torch.bool:
        raise TypeError(f"TinyGPT takes token ids as an integer tensor (batch, tokens); got "
                        f"{getattr(idx, 'dtype', type(idx).__name__)}.")
    if idx.dim() != 2:
        raise ValueError(f"TinyGPT takes token ids of shape (batch, tokens); got shape "
                         f"{tuple(idx.shape)} (add a batch axis with idx[None]).")
    if idx.numel() and idx.device.type != "meta" \
            and not 0 <= int(idx.min()) <= int(idx.max()) < vocab:
        raise ValueError(f"every token id must be from 0 to {vocab - 1} (vocab = {vocab}); got "
                         f"{int(idx.min())} .. {int(idx.max())}.")


# ---- a tiny GPT ---------------------------------------------------------------------------------

class Attention(nn.Module):
    def __init__(self, d_model, n_heads):
        super().__init__()
        if d_model % n_heads:
            raise ValueError(f"d_model={d_model} must be a multiple of n_heads={n_heads}.")
        self.n_heads = n_heads
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(x).split(d, dim=-1)
        q, k, v = (z.view(b, t, self.n_heads, d // self.n_heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, d))


class GroupedQueryAttention(nn.Module):
    """Causal grouped-query attention (GQA, Ainslie et al. 2023): n_heads query heads and
    n_kv_heads key/value heads; K/V head j serves query heads j·g ... (j+1)·g − 1, with
    g = n_heads / n_kv_heads (n_kv_heads = n_heads is multi-head attention, 1 multi-query).
    One stacked projection `qkv` (q, then k, then v), as in Attention; K and V are n_kv_heads
    heads wide, so it has d_model + 2·n_kv_heads·d_head outputs."""

    def __init__(self, d_model, n_heads, n_kv_heads):
        super().__init__()
        if d_model % n_heads or n_kv_heads < 1 or n_heads % n_kv_heads:
            raise ValueError(f"d_model={d_model} must be a multiple of n_heads={n_heads}, and "
                             f"n_heads a multiple of n_kv_heads={n_kv_heads} (each K/V head "
                             f"serves a group of query heads).")
        self.n_heads, self.n_kv_heads, self.head_dim = n_heads, n_kv_heads, d_model // n_heads
        kv = n_kv_heads * self.head_dim
        self.qkv = nn.Linear(d_model, d_model + 2 * kv)
        self.proj = nn.Linear(d_model, d_model)

    def forward(self, x):
        b, t, d = x.shape
        kv = self.n_kv_heads * self.head_dim
        q, k, v = self.qkv(x).split([d, kv, kv], dim=-1)
        q = q.view(b, t, self.n_heads, self.head_dim).transpose(1, 2)
        k, v = (z.view(b, t, self.n_kv_heads, self.head_dim).transpose(1, 2) for z in (k, v))
        group = self.n_heads // self.n_kv_heads   # each K/V head, copied for its query heads
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, d))


class FeedForward(nn.Module):
    def __init__(self, d_model, hidden):
        super().__init__()
        self.fc1 = nn.Linear(d_model, hidden)
        self.fc2 = nn.Linear(hidden, d_model)

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(x)))


class Block(nn.Module):
    """Pre-LayerNorm transformer block; n_kv_heads: grouped-query attention (None: multi-head)."""

    def __init__(self, d_model, n_heads, hidden, n_kv_heads=None):
        super().__init__()
        self.ln1 = nn.LayerNorm(d_model)
        self.attn = (Attention(d_model, n_heads) if n_kv_heads is None
                     else GroupedQueryAttention(d_model, n_heads, n_kv_heads))
        self.ln2 = nn.LayerNorm(d_model)
        self.mlp = FeedForward(d_model, hidden)

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class TinyGPT(nn.Module):
    def __init__(self, vocab=64, d_model=32, n_heads=4, n_layers=2, seq_len=16, hidden=None,
                 n_kv_heads=None):
        super().__init__()
        for name, value in (("vocab", vocab), ("d_model", d_model), ("n_heads", n_heads),
                            ("seq_len", seq_len), ("hidden", hidden or 1)):
            check.whole(value, name, at_least=1)
        check.whole(n_layers, "n_layers", at_least=0)
        self.seq_len = seq_len
        self.tok = nn.Embedding(vocab, d_model)
        self.pos = nn.Embedding(seq_len, d_model)
        self.blocks = nn.ModuleList(Block(d_model, n_heads, hidden or 4 * d_model, n_kv_heads)
                                    for _ in range(n_layers))
        self.ln_f = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab)

    def forward(self, idx):
        _check_tokens(idx, self.tok.num_embeddings)
        t = idx.shape[1]
        if t > self.seq_len:
            raise ValueError(f"sequence of length {t} is longer than seq_len={self.seq_len}.")
        x = self.tok(idx) + self.pos(torch.arange(t, device=idx.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def make_gpt(seed=0, **config):
    return _seeded(seed, lambda: TinyGPT(**config))


def token_data(n=64, seq_len=16, vocab=64, seed=0):
    """(inputs, targets): sequences that follow a fixed random rule, so there is something to learn."""
    n, seq_len = check.whole(n, "n", at_least=1), check.whole(seq_len, "seq_len", at_least=1)
    vocab = check.whole(vocab, "vocab", at_least=2)     # the rule steps by 1 .. vocab - 1
    g = torch.Generator().manual_seed(seed)
    step = torch.randint(1, vocab, (n, 1), generator=g)
    start = torch.randint(0, vocab, (n, 1), generator=g)
    seq = (start + step * torch.arange(seq_len + 1)) % vocab
    return seq[:, :-1], seq[:, 1:]


def lm_loss(logits, targets):
    if tuple(targets.shape) != tuple(logits.shape[:-1]):
        raise ValueError(f"targets must hold one token per position of the logits "
                         f"{tuple(logits.shape[:-1])}; got shape {tuple(targets.shape)}.")
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


# ---- the single-process reference ----------------------------------------------------------------

def make_optimizer(params, name="sgd", lr=0.05):
    if name == "sgd":
        return torch.optim.SGD(params, lr=lr)
    if name == "adam":
        return torch.optim.Adam(params, lr=lr)
    raise ValueError(f"optimizer must be 'sgd' or 'adam'; got {name!r}.")


def train_reference(model, batches, loss_fn=F.mse_loss, optimizer="sgd", lr=0.05):
    """Train `model` in this process on `batches` [(x, y), ...], one optimizer step each.

    Returns the loss of every step; the model is trained in place. This is the ground truth
    every distributed strategy of the course is compared with.
    """
    check.positive(lr, "lr", example=0.05)    # a negative rate would climb the loss
    opt = make_optimizer(model.parameters(), optimizer, lr)
    losses = []
    for x, y in batches:
        opt.zero_grad()
        loss = loss_fn(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def batches_of(x, y, batch_size, steps):
    """`steps` consecutive global batches of `batch_size` samples (wrapping around the data)."""
    batch_size = check.whole(batch_size, "batch_size", at_least=1)
    steps = check.whole(steps, "steps", at_least=0)
    if len(x) != len(y):
        raise ValueError(f"x and y must hold the same number of samples; got {len(x)} and "
                         f"{len(y)}.")
    if not len(x):
        raise ValueError("batches_of got no sample (x is empty): there is nothing to batch.")
    out = []
    for s in range(steps):
        idx = torch.arange(s * batch_size, (s + 1) * batch_size) % len(x)
        out.append((x[idx], y[idx]))
    return out
