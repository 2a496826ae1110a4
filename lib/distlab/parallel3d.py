"""3D parallelism: data, pipeline and tensor parallelism at once, on one (dp, pp, tp) mesh.

    mesh  = Mesh3D(dp=2, pp=2, tp=2)                 # on every rank; groups along each dimension
    stage = Stage3D.from_dense(make_gpt(), mesh)     # this rank's layers, its shard of each matrix
    loss  = train_step(stage, mesh, x, y, n_micro=2, lr=0.05)

Rank r sits at coordinate (d, p, t) of a row-major mesh, tp varying fastest:
- along tp, the ranks of one pipeline stage split every block's matrices (chapter 07's
  ParallelBlock: column-parallel qkv and fc1, row-parallel proj and fc2); the embeddings, the
  LayerNorms and the head are small and replicated;
- along pp, the blocks are cut into consecutive stages that pass activations forward and their
  gradients backward with send/recv, GPipe order: all micro-batch forwards, then all backwards
  (chapter 08);
- along dp, each (pp, tp) position is replicated and sees 1/dp of the global batch; its gradients
  are averaged over the dp group before the step (chapter 05).

Each parallelism talks only inside its own groups, so the three do not interfere: a tp
all-reduce involves the ranks of one stage of one replica, a pipeline send goes to the rank with
the same (d, t) in the next stage, and the dp all-reduce joins ranks holding the same shard.

A head tied to the token embedding (GPT-2) is held twice, by the first stage and by the last, as
Megatron-LM does: the two copies start equal, their gradients are summed (an all-reduce between
the first and the last stage at the same (d, t), or a plain sum when one stage holds both) and
the same step keeps them equal.
"""
import copy

import torch
import torch.distributed as dist
import torch.nn as nn

from . import _argcheck as check
from .data_parallel import BucketedDDP, average_gradients, shard_batch
from .devices import device
from .mesh import HandMesh, coordinate, rank_at, wait_until_connected
from .models import lm_loss
from .tensor_parallel import ColumnParallelLinear, ParallelBlock, RowParallelLinear

NAMES = ("dp", "pp", "tp")


class Mesh3D(HandMesh):
    """A HandMesh of shape (dp, pp, tp), plus this rank's coordinate by name."""

    def __init__(self, dp, pp, tp):
        super().__init__((dp, pp, tp), NAMES)
        self.dp, self.pp, self.tp = dp, pp, tp
        self.d, self.p, self.t = self.get_coordinate()

    def device_mesh(self, device_type="cpu"):
        """torch's DeviceMesh of the same shape, names and rank order (row-major, tp fastest),
        made once: DTensors, and so DCP's sharded checkpoints, need one (collective on first use)."""
        if getattr(self, "_device_mesh", None) is None:
            from torch.distributed.device_mesh import init_device_mesh
            self._device_mesh = init_device_mesh(device_type, (self.dp, self.pp, self.tp),
                                                 mesh_dim_names=NAMES)
        return self._device_mesh

    def pp_rank(self, stage):
        """The global rank of `stage` in this rank's pipeline (same dp and tp coordinates)."""
        return self.ranks["pp"][stage]


def stage_bounds(n_layers, n_stages):
    """[(first block, end), ...]: consecutive blocks, as equal as possible, per stage."""
    if not 1 <= n_stages <= n_layers:
        raise ValueError(f"cannot cut {n_layers} blocks into {n_stages} pipeline stages: every "
                         f"stage needs at least one block.")
    cuts = [round(i * n_layers / n_stages) for i in range(n_stages + 1)]
    return list(zip(cuts, cuts[1:]))


class Stage3D(nn.Module):
    """One rank's part of a TinyGPT: its pipeline stage's blocks, tensor-parallel over tp.

    The first stage also holds the embeddings, the last the final LayerNorm and the head.
    Parameter names follow the dense model's, so `dense_name` maps one onto the other.
    A head tied to the embedding needs `tie_group` (first_last_group) when there are several
    stages; from_dense makes it.
    """

    def __init__(self, gpt, stage, n_stages, tp_group, tie_group=None):
        super().__init__()
        stage, n_stages = _check_stage(gpt, stage, n_stages, tp_group)
        self.stage, self.n_stages = stage, n_stages
        self.first, self.last = stage == 0, stage == n_stages - 1
        self.tied, self.tie_group = tied_embedding(gpt), tie_group
        if self.tied and n_stages > 1 and tie_group is None:
            raise ValueError(f"this TinyGPT's head is tied to its token embedding, and over "
                             f"{n_stages} pipeline stages their gradients must be summed between "
                             f"the first and the last stage: build the stages with "
                             f"Stage3D.from_dense(gpt, mesh), which makes that group, or untie "
                             f"the head.")
        self.start, end = stage_bounds(len(gpt.blocks), n_stages)[stage]
        if self.first:
            self.tok, self.pos = copy.deepcopy(gpt.tok), copy.deepcopy(gpt.pos)
        self.blocks = nn.ModuleList(ParallelBlock.from_dense(b, tp_group)
                                    for b in gpt.blocks[self.start:end])
        if self.last:
            self.ln_f, self.head = copy.deepcopy(gpt.ln_f), copy.deepcopy(gpt.head)

    @classmethod
    def from_dense(cls, gpt, mesh, on=None):
        """This rank's part of the dense `gpt`, on device `on` (default: distlab.device())."""
        _check_mesh(mesh, Mesh3D)
        tie = first_last_group(mesh) if tied_embedding(gpt) and mesh.pp > 1 else None
        return cls(gpt.to(on or device()), mesh.p, mesh.pp, mesh.get_group("tp"), tie)

    def forward(self, x):
        if self.first:
            x = self.tok(x) + self.pos(torch.arange(x.shape[1], device=x.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x)) if self.last else x

    def dense_name(self, name):
        """'blocks.0.attn.qkv.weight' of stage 1 -> 'blocks.2.attn.qkv.weight' of the dense model."""
        if name.startswith("blocks."):
            _, i, rest = name.split(".", 2)
            return f"blocks.{int(i) + self.start}.{rest}"
        return name

    def shard_of(self, name, full):
        """This rank's shard of the dense parameter (or gradient) `full` named `name` here."""
        owner = self.get_submodule(name.rpartition(".")[0])
        return owner.shard_of(full) if hasattr(owner, "shard_of") else full


# ---- a head tied to the embedding -------------------------------------------------------------------

def tied_embedding(gpt):
    """True when `gpt.head.weight` is `gpt.tok.weight` (GPT-2's tie). Ties inside one block
    are ParallelBlock.from_dense's to keep; any other tie is refused in a sentence."""
    uses = {}
    for name, p in gpt.named_parameters(remove_duplicate=False):
        uses.setdefault(id(p), []).append(name)
    tied = False
    for names in (sorted(n) for n in uses.values() if len(n) > 1):
        if names == ["head.weight", "tok.weight"]:
            tied = True
        elif not (names[0].startswith("blocks.") and
                  len({n.split(".", 2)[1] for n in names}) == 1):
            raise ValueError(f"{' and '.join(names)} are tied: the stages keep a head tied to "
                             f"the token embedding, and ties inside one block, not this one; "
                             f"untie them (give each its own nn.Parameter) first.")
    return tied


def first_last_group(mesh):
    """Collective: this rank's group of the first and the last pipeline stage at its other
    coordinates (Megatron-LM's embedding group); a middle stage's rank gets a non-member
    placeholder. Every rank creates every group, as new_group requires."""
    axis, me, mine = mesh.names.index("pp"), dist.get_rank(), None
    for r in range(dist.get_world_size()):
        c = coordinate(r, mesh.shape)
        if c[axis] == 0:
            last = rank_at(c[:axis] + (mesh.shape[axis] - 1,) + c[axis + 1:], mesh.shape)
            group = dist.new_group([r, last])
            if me in (r, last):
                mine = group
    wait_until_connected()
    return mine if mine is not None else dist.GroupMember.NON_GROUP_MEMBER


def sum_tied_gradients(stage):
    """The tied weight's gradient is the sum of its two uses': add the embedding copy's and
    the head copy's, on both copies, so the same step keeps them equal."""
    if not stage.tied or not (stage.first or stage.last):
        return
    mine = stage.tok.weight if stage.first else stage.head.weight
    if not mine.requires_grad:                    # frozen: no gradient on either copy
        return
    if stage.first and stage.last:
        total = stage.tok.weight.grad + stage.head.weight.grad
        stage.tok.weight.grad, stage.head.weight.grad = total, total.clone()
    else:
        dist.all_reduce(mine.grad, group=stage.tie_group)


# ---- one training step -----------------------------------------------------------------------------

def train_step(stage, mesh, x, y, n_micro, lr, bucket_mb=None):
    """Forward and backward of one global batch (x, y) on the 3D mesh, then plain SGD.

    Every rank passes the whole global batch; it reads its dp shard of it. Returns the global
    batch's mean loss, on every rank. Gradients are left in .grad (averaged over dp).
    `bucket_mb`: None averages every gradient over dp after backward, one all-reduce per
    tensor; a number of MiB packs them into buckets (chapter 05's BucketedDDP over the dp
    group) all-reduced while the last micro-batch's backward still runs, as DDP does.
    """
    _check_step(stage, mesh, Mesh3D, x, y, n_micro, lr)
    buckets = None if bucket_mb is None else dp_buckets(stage, mesh, bucket_mb)
    for p in stage.parameters():
        p.grad = None
    dtype, on = next(stage.parameters()).dtype, next(stage.parameters()).device
    x, y = shard_batch(x, mesh.d, mesh.dp).to(on), shard_batch(y, mesh.d, mesh.dp).to(on)
    if len(x) % n_micro:
        raise ValueError(f"each data-parallel rank's {len(x)} samples do not split into "
                         f"{n_micro} equal micro-batches.")
    xs, ys = x.chunk(n_micro), y.chunk(n_micro)
    d_model = stage.blocks[0].ln1.normalized_shape[0]
    pending, saved, total = [], [], torch.zeros((), dtype=dtype, device=on)

    for xm, ym in zip(xs, ys):                      # GPipe: every forward first ...
        if stage.first:
            inp = xm
        else:
            inp = torch.empty(*xm.shape, d_model, dtype=dtype, device=on)
            dist.recv(inp, src=mesh.pp_rank(stage.stage - 1))
            inp.requires_grad_()
        out = stage(inp)
        if stage.last:
            # Equal micro-batches: the mean of their mean losses is the shard's mean loss.
            out = lm_loss(out, ym) / n_micro
            total += out.detach()
        else:
            # isend: a stage must not wait for its neighbour to pick the activation up.
            pending.append(dist.isend(out.detach().contiguous(), dst=mesh.pp_rank(stage.stage + 1)))
        saved.append((inp, out))

    for i, (inp, out) in enumerate(saved):          # ... then every backward, in the same order
        if buckets is not None:
            # only the last backward produces final gradients: its hooks fill the buckets
            buckets._sync = i == len(saved) - 1
        if stage.last:
            out.backward()
        else:
            grad = torch.empty_like(out)
            dist.recv(grad, src=mesh.pp_rank(stage.stage + 1))
            # (out * grad).sum() sends exactly `grad` into out, without out.backward(grad)'s
            # slow first-call import (see pipeline_parallel._vjp_root).
            (out * grad).sum().backward()
        if buckets is not None:
            buckets._sync = False       # the stage's other backwards leave the hooks alone
        if not stage.first:
            pending.append(dist.isend(inp.grad.contiguous(), dst=mesh.pp_rank(stage.stage - 1)))
    for work in pending:
        work.wait()

    # both sums are linear: the tied copies may be summed before or after the dp average
    sum_tied_gradients(stage)
    if buckets is None:
        average_gradients(stage, group=mesh.get_group("dp"))
    with torch.no_grad():
        # Plain SGD as torch.optim.SGD computes it (building one imports torch._dynamo: seconds).
        for p in stage.parameters():
            if p.grad is not None:                # a frozen parameter has none
                p.add_(p.grad, alpha=-lr)
    if total.is_meta:
        # A full-size run on meta tensors (bench/planner.py, chapter 10): the loss's two
        # collectives are charged as in a real run, but there is no value to read.
        loss = total if mesh.p == mesh.pp - 1 else torch.zeros_like(total)
        dist.all_reduce(loss, group=mesh.get_group("pp"))
        dist.all_reduce(loss, group=mesh.get_group("dp"))
        return loss
    return global_loss(total, mesh)


def dp_buckets(stage, mesh, bucket_mb):
    """The stage's BucketedDDP over the dp group (made on first use, kept with the stage so its
    gradient hooks are registered once): `.last_timeline()` says when each bucket was sent."""
    kept = stage.__dict__.setdefault("_dp_buckets", {})   # not a submodule: no cycle
    if bucket_mb not in kept:
        # broadcast=False: the replicas were cut from one dense model and start equal
        kept[bucket_mb] = BucketedDDP(stage, bucket_cap_mb=bucket_mb, group=mesh.get_group("dp"),
                                      broadcast=False)
        kept[bucket_mb]._sync = False   # silent until train_step's last backward
    return kept[bucket_mb]


def global_loss(shard_loss, mesh):
    """The last stage's loss, averaged over dp and shared with every stage."""
    loss = shard_loss.clone() if mesh.p == mesh.pp - 1 else torch.zeros_like(shard_loss)
    dist.all_reduce(loss, group=mesh.get_group("pp"))
    dist.all_reduce(loss, group=mesh.get_group("dp"))
    return loss.item() / mesh.dp


# ---- the dense model back, for checkpoints and comparisons --------------------------------------

def _unshard(module, attr, local, group):
    """The dense tensor from every tp rank's shard of `module.<attr>`."""
    if not isinstance(module, (ColumnParallelLinear, RowParallelLinear)) or \
            (isinstance(module, RowParallelLinear) and attr == "bias"):
        return local
    shards = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
    dist.all_gather(shards, local.contiguous(), group=group)
    if isinstance(module, RowParallelLinear):
        return torch.cat(shards, dim=1)
    # Stacked q, k, v: each rank holds its slice of each (of unequal sizes under grouped-query
    # attention); put every matrix back together.
    parts = [s.split(module.local_sizes, dim=0) for s in shards]
    return torch.cat([torch.cat([p[j] for p in parts], dim=0) for j in range(module.chunks)])


def dense_state_dict(stage, mesh, grads=False):
    """Collective: the dense model's state_dict (or gradients) on global rank 0, None elsewhere.

    tp shards are all-gathered inside each stage; then one replica's stages send their part to
    rank 0. The result does not depend on the layout, so a checkpoint written under one
    (dp, pp, tp) can be resumed under another.
    """
    mine = {}
    for name, p in stage.named_parameters():
        owner = stage.get_submodule(name.rpartition(".")[0])
        value = p.grad if grads else p.detach()
        mine[stage.dense_name(name)] = _unshard(owner, name.rpartition(".")[2], value,
                                                mesh.get_group("tp")).cpu()
    keep = mesh.d == 0 and mesh.t == 0          # one copy of each stage is enough
    parts = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(mine if keep else {}, parts, dst=0)
    if dist.get_rank() != 0:
        return None
    return {k: v for part in parts for k, v in part.items()}


def layout_table(dp, pp, tp, n_layers):
    """Rows (rank, (d, p, t), what it holds) for the picture and the notebook."""
    dp, pp, tp = (check.whole(n, name, at_least=1) for n, name in zip((dp, pp, tp), NAMES))
    bounds = stage_bounds(n_layers, pp)
    rows = []
    for r in range(dp * pp * tp):
        d, p, t = coordinate(r, (dp, pp, tp))
        a, b = bounds[p]
        held = (["embeddings"] if p == 0 else []) + [f"blocks {a}-{b - 1} (1/{tp} of each matrix)"
                                                     if b - a > 1 else
                                                     f"block {a} (1/{tp} of each matrix)"]
        held += ["ln_f + head"] if p == pp - 1 else []
        rows.append((r, (d, p, t), ", ".join(held) + f"; batch part {d + 1} of {dp}"))
    return rows


def _check_stage(gpt, stage, n_stages, tp_group):
    check.like(gpt, ("tok", "pos", "blocks", "ln_f", "head"), "gpt",
               "a distlab.models TinyGPT (make_gpt(...))")
    check.group(tp_group, "tp_group")
    n_stages = check.whole(n_stages, "n_stages", at_least=1)
    return check.rank_in(stage, n_stages, "stage"), n_stages


def _check_mesh(mesh, kind):
    check.instance(mesh, kind, "mesh", f"a {kind.__name__} such as p3.Mesh3D(dp, pp, tp), built "
                   f"on every rank" if kind is Mesh3D else f"a {kind.__name__}")


def _check_step(stage, mesh, kind, x, y, n_micro, lr):
    """What train_step needs, refused before the first collective: a wrong call on one rank
    would otherwise leave the others waiting for it."""
    _check_mesh(mesh, kind)
    check.like(stage, ("blocks",), "stage", "this rank's stage (Stage3D.from_dense(gpt, mesh))")
    for name, t in (("x", x), ("y", y)):
        if check.tensor(t, name).is_floating_point() or t.is_complex() or t.dtype == torch.bool:
            raise TypeError(f"{name} must hold integer token ids (torch.long), not {t.dtype}.")
    if len(x) != len(y):
        raise ValueError(f"x and y must hold the same number of sequences; got {len(x)} and "
                         f"{len(y)}.")
    check.whole(n_micro, "n_micro", at_least=1), check.positive(lr, "lr", allow_zero=True)
