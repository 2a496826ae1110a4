"""Context parallelism composed with data and tensor parallelism: a (dp, cp, tp) mesh.

    mesh  = Mesh4D(dp=2, cp=2, tp=2)                       # on every rank
    model = ContextParallelGPT.from_dense(make_gpt(), mesh)  # its shard of every matrix
    loss  = train_step(model, mesh, x, y, lr=0.05)

Rank r sits at (d, c, t) of a row-major mesh, tp varying fastest:
- along tp, the ranks split every block's matrices as in chapter 07 (column-parallel qkv and
  fc1, row-parallel proj and fc2), so each runs n_heads/tp heads;
- along cp, the ranks split every sequence of their batch (zig-zag, for balanced causal work):
  each holds its tokens' activations only, and attention meets the other tokens' keys through
  ring attention over the cp group (chapter 12). Everything but attention works token by token
  and needs no communication;
- along dp, the ranks hold different sequences of the global batch.

A parameter's gradient is a sum over tokens, and the tokens of a batch are spread over the dp AND
cp ranks holding the same tp shard: those gradients are averaged over that combined group (which
is what torchtitan's "dp_shard_cp" mesh dimension is for). With pp as a fourth dimension, each
stage would do the same on its blocks and pass activations as in chapter 10.
"""
import copy

import torch
import torch.distributed as dist
import torch.nn as nn

from .context_parallel import ring_attention, zigzag_positions
from .data_parallel import shard_batch
from .devices import device
from .mesh import HandMesh, rank_at
from .models import lm_loss
from .tensor_parallel import ParallelAttention, ParallelBlock

NAMES = ("dp", "cp", "tp")


class Mesh4D(HandMesh):
    """A HandMesh of shape (dp, cp, tp), plus the group of ranks that share a tp shard."""

    def __init__(self, dp, cp, tp):
        super().__init__((dp, cp, tp), NAMES)
        self.dp, self.cp, self.tp = dp, cp, tp
        self.d, self.c, self.t = self.get_coordinate()
        # Every rank must create every group, in the same order, even those it is not in.
        self.shard_group = None
        for t in range(tp):
            ranks = [rank_at((d, c, t), (dp, cp, tp)) for d in range(dp) for c in range(cp)]
            group = dist.new_group(ranks)
            if t == self.t:
                self.shard_group = group


class ContextParallelAttention(ParallelAttention):
    """Chapter 07's tensor-parallel attention, attending over the whole sequence by ring."""

    def forward(self, x):
        qkv = self.qkv(x)                 # (b, our tokens, 3·d/tp): our tokens, our heads
        b, t, _ = qkv.shape
        q, k, v = (z.view(b, t, self.local_heads, self.head_dim).transpose(1, 2)
                   for z in qkv.chunk(3, dim=-1))
        y = ring_attention(q, k, v, self.positions, causal=True, group=self.cp_group)
        return self.proj(y.transpose(1, 2).reshape(b, t, self.local_heads * self.head_dim))


class ContextParallelGPT(nn.Module):
    """A TinyGPT whose blocks are tensor parallel over tp and whose sequence is split over cp."""

    def __init__(self, gpt, mesh):
        super().__init__()
        self.mesh = mesh
        self.tok, self.pos = copy.deepcopy(gpt.tok), copy.deepcopy(gpt.pos)
        self.ln_f, self.head = copy.deepcopy(gpt.ln_f), copy.deepcopy(gpt.head)
        self.blocks = nn.ModuleList()
        for block in gpt.blocks:
            tp_block = ParallelBlock.from_dense(block, mesh.get_group("tp"))
            attn = tp_block.attn
            attn.__class__ = ContextParallelAttention      # same parameters, ring attention
            attn.cp_group = mesh.get_group("cp")
            self.blocks.append(tp_block)

    @classmethod
    def from_dense(cls, gpt, mesh, on=None):
        return cls(copy.deepcopy(gpt).to(on or device()), mesh)

    def forward(self, idx, positions):
        """idx: (batch, our tokens); positions: their places in the sequence."""
        for block in self.blocks:
            block.attn.positions = positions
        x = self.tok(idx) + self.pos(positions)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))

    def shard_of(self, name, full):
        owner = self.get_submodule(name.rpartition(".")[0])
        return owner.shard_of(full) if hasattr(owner, "shard_of") else full


def local_tokens(x, y, mesh):
    """This rank's sequences (its dp shard) and, of each, its tokens (its cp share)."""
    x, y = shard_batch(x, mesh.d, mesh.dp), shard_batch(y, mesh.d, mesh.dp)
    positions = zigzag_positions(x.shape[1], mesh.c, mesh.cp).to(x.device)
    return x[:, positions], y[:, positions], positions


def train_step(model, mesh, x, y, lr):
    """Forward and backward of the global batch (x, y), gradients averaged over dp × cp, SGD.
    Every rank passes the whole batch; returns the global mean loss on every rank."""
    on = next(model.parameters()).device
    xs, ys, positions = local_tokens(x.to(on), y.to(on), mesh)
    for p in model.parameters():
        p.grad = None
    # Every rank holds as many tokens as any other: the global mean is the mean of the means.
    loss = lm_loss(model(xs, positions), ys)
    loss.backward()
    n = mesh.dp * mesh.cp
    for p in model.parameters():
        dist.all_reduce(p.grad, group=mesh.shard_group)
        p.grad.div_(n)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(p.grad, alpha=-lr)
    total = loss.detach().clone()
    dist.all_reduce(total, group=mesh.shard_group)
    return total.item() / n
