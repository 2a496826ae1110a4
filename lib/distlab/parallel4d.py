"""Four dimensions on one mesh: data, pipeline, context and tensor parallelism (dp, pp, cp, tp).

    mesh  = Mesh4D(dp=2, pp=2, cp=2, tp=1)                  # on every rank
    stage = Stage4D.from_dense(make_gpt(), mesh)            # its blocks, its shard of each matrix
    loss  = train_step(stage, mesh, x, y, lr=0.05, n_micro=2)

Rank r sits at (d, p, c, t) of a row-major mesh, tp varying fastest:
- along tp, the ranks split every block's matrices as in chapter 07 (column-parallel qkv and
  fc1, row-parallel proj and fc2), so each runs n_heads/tp heads;
- along cp, the ranks split every sequence of their batch (zig-zag, for balanced causal work):
  each holds its tokens' activations only, and attention meets the other tokens' keys through
  ring attention over the cp group (chapter 12). Everything but attention works token by token
  and needs no communication;
- along pp, the blocks are cut into consecutive stages (chapter 10's Stage3D, GPipe order): a
  stage sends each micro-batch's activations OF ITS OWN TOKENS to the rank of the next stage
  with the same (d, c, t), so the pipeline carries sequence shards and every stage's attention
  runs its own ring over its own cp group;
- along dp, the ranks hold different sequences of the global batch.

A parameter's gradient is a sum over tokens, and the tokens of a batch are spread over the dp AND
cp ranks holding the same (stage, tp shard): those gradients are averaged over that combined
group (torchtitan's "dp_shard_cp" mesh dimension). Each parallelism talks only inside its own
groups: tp all-reduces inside a stage's (d, c), ring hops inside a stage's (d, t), pipeline
sends between stages at the same (d, c, t), the gradient all-reduce over (d, c) at the same
(p, t). torchtitan orders its mesh pp outermost (pp, dp, cp, tp); any order is correct, the
innermost dimensions are the ones a cluster keeps inside a node.
"""
import copy

import torch
import torch.distributed as dist

from .context_parallel import ring_attention, zigzag_positions
from .data_parallel import shard_batch
from .devices import device
from .mesh import HandMesh, rank_at
from .models import lm_loss
from .parallel3d import (Stage3D, _check_mesh, _check_step, first_last_group, sum_tied_gradients,
                         tied_embedding)
from .tensor_parallel import ParallelAttention

NAMES = ("dp", "pp", "cp", "tp")


class Mesh4D(HandMesh):
    """A HandMesh of shape (dp, pp, cp, tp), plus the group of ranks that share a (stage, tp
    shard): the dp × cp ranks whose gradients are averaged together.

    Three sizes are read as (dp, cp, tp) with pp = 1: the dp × cp × tp mesh this module held
    before pipeline stages joined it (distlab.gpu_check still builds it so)."""

    def __init__(self, dp, pp, cp, tp=None):
        if tp is None:
            dp, pp, cp, tp = dp, 1, pp, cp
        super().__init__((dp, pp, cp, tp), NAMES)
        self.dp, self.pp, self.cp, self.tp = dp, pp, cp, tp
        self.d, self.p, self.c, self.t = self.get_coordinate()
        # Every rank must create every group, in the same order, even those it is not in.
        self.shard_group = None
        for p in range(pp):
            for t in range(tp):
                ranks = [rank_at((d, p, c, t), self.shape) for d in range(dp) for c in range(cp)]
                group = dist.new_group(ranks)
                if (p, t) == (self.p, self.t):
                    self.shard_group = group

    def pp_rank(self, stage):
        """The global rank of `stage` in this rank's pipeline (same d, c and t)."""
        return self.ranks["pp"][stage]


class ContextParallelAttention(ParallelAttention):
    """Chapter 07's tensor-parallel attention, attending over the whole sequence by ring: the
    same projections (grouped-query K/V included), only the attention itself differs."""

    def attend(self, q, k, v):
        return ring_attention(q, k, v, self.positions, causal=True, group=self.cp_group)


class Stage4D(Stage3D):
    """One rank's part of a TinyGPT: its pipeline stage's blocks (all of them when pp = 1),
    tensor parallel over tp, attending over the sequence split across cp. Parameter names
    follow the dense model's (`dense_name`), as in chapter 10."""

    def __init__(self, gpt, mesh):
        _check_mesh(mesh, Mesh4D)
        tie = first_last_group(mesh) if tied_embedding(gpt) and mesh.pp > 1 else None
        super().__init__(gpt, mesh.p, mesh.pp, mesh.get_group("tp"), tie)
        for block in self.blocks:
            block.attn.__class__ = ContextParallelAttention   # same parameters, ring attention
            block.attn.cp_group = mesh.get_group("cp")

    @classmethod
    def from_dense(cls, gpt, mesh, on=None):
        return cls(copy.deepcopy(gpt).to(on or device()), mesh)

    def forward(self, x, positions):
        """x: token ids (first stage) or activations (b, our tokens, d_model); positions: our
        tokens' places in the sequence (the embedding's and every ring's)."""
        for block in self.blocks:
            block.attn.positions = positions
        if self.first:
            x = self.tok(x) + self.pos(positions)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x)) if self.last else x


ContextParallelGPT = Stage4D          # pp = 1: the whole model (the name chapter 12 used first)


def local_tokens(x, y, mesh):
    """This rank's sequences (its dp shard) and, of each, its tokens (its cp share)."""
    x, y = shard_batch(x, mesh.d, mesh.dp), shard_batch(y, mesh.d, mesh.dp)
    positions = zigzag_positions(x.shape[1], mesh.c, mesh.cp).to(x.device)
    return x[:, positions], y[:, positions], positions


def train_step(stage, mesh, x, y, lr, n_micro=1):
    """Forward and backward of the global batch (x, y) on the 4D mesh (GPipe over pp: every
    micro-batch forward, then every backward), gradients averaged over dp × cp, then SGD.
    Every rank passes the whole batch; returns the global mean loss on every rank."""
    _check_step(stage, mesh, Mesh4D, x, y, n_micro, lr)
    on = next(stage.parameters()).device
    dtype = next(stage.parameters()).dtype
    xs, ys, positions = local_tokens(x.to(on), y.to(on), mesh)
    if len(xs) % n_micro:
        raise ValueError(f"each data-parallel rank's {len(xs)} sequences do not split into "
                         f"{n_micro} equal micro-batches.")
    for p in stage.parameters():
        p.grad = None
    d_model = stage.blocks[0].ln1.normalized_shape[0]
    pending, saved, total = [], [], torch.zeros((), dtype=dtype, device=on)
    for xm, ym in zip(xs.chunk(n_micro), ys.chunk(n_micro)):
        if stage.first:
            inp = xm
        else:                              # the previous stage's activations of OUR tokens
            inp = torch.empty(*xm.shape, d_model, dtype=dtype, device=on)
            dist.recv(inp, src=mesh.pp_rank(stage.stage - 1))
            inp.requires_grad_()
        out = stage(inp, positions)
        if stage.last:
            # Equal micro-batches and equal token shares: the mean of the means is the mean.
            out = lm_loss(out, ym) / n_micro
            total += out.detach()
        else:
            pending.append(dist.isend(out.detach().contiguous(), dst=mesh.pp_rank(stage.stage + 1)))
        saved.append((inp, out))
    for inp, out in saved:
        if stage.last:
            out.backward()
        else:
            grad = torch.empty_like(out)
            dist.recv(grad, src=mesh.pp_rank(stage.stage + 1))
            (out * grad).sum().backward()  # sends exactly `grad` into out (see parallel3d)
        if not stage.first:
            pending.append(dist.isend(inp.grad.contiguous(), dst=mesh.pp_rank(stage.stage - 1)))
    for work in pending:
        work.wait()
    sum_tied_gradients(stage)
    n = mesh.dp * mesh.cp
    trained = [p for p in stage.parameters() if p.requires_grad]   # frozen: no gradient
    for p in trained:
        dist.all_reduce(p.grad, group=mesh.shard_group)
        p.grad.div_(n)
    with torch.no_grad():
        for p in trained:
            p.add_(p.grad, alpha=-lr)
    # the last stage's loss, shared with every stage, averaged over the dp × cp shares
    loss = total if stage.last else torch.zeros_like(total)
    dist.all_reduce(loss, group=mesh.get_group("pp"))
    dist.all_reduce(loss, group=mesh.shard_group)
    return loss.item() / n
