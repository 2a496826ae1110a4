"""Pipeline × FSDP: every pipeline stage sharded ZeRO-3 style over its own data-parallel group,
and the choice that decides what it costs: when a stage's parameters are gathered and its
gradients reduce-scattered.

    mesh = pp_dp_mesh(pp=2, dp=2)               # every rank: rank d * pp + s is stage s of copy d
    stage = ShardedStage(split_model(model.net, 2), mesh, (16,), policy="whole step")
    loss = stage.step(actions, x_mine, y_mine, m, loss_fn)   # this copy's rows of the batch
    stage.sgd_step(lr)                          # every rank updates its own shards

dp copies of a pp-stage pipeline. The ranks that hold the same stage form its dp group and share
its parameters: each parameter is flattened and rank d of the group keeps [d·c, (d+1)·c),
c = ceil(numel / dp), as distlab.sharding does (a tiny parameter leaves some ranks an empty
shard). Every module with trainable parameters of its own is a unit, as FSDP wraps each block:
one all-gather makes all of a unit's parameters whole, one reduce-scatter sums its gradients
over the dp group and leaves each rank the gradient of its shard. Frozen parameters stay whole on
every rank. Each rank's loss is its share of the global batch (n_mine / n_all of the mean), so
the SUM over the group is the global batch's gradient (with equal shares: FSDP's average).

`policy` says when (the names are those of ps.parameter_gathers, which counts from the lists):

  "every action"  FSDP's default, blind to the pipeline: a unit is gathered before its forward
                  and freed after it, gathered again before its backward, its gradient
                  reduce-scattered and freed at once: per step 2·m gathers and m reduce-scatters
                  of every unit (m micro-batches); one unit whole at a time.
  "whole step"    torchtitan's choice with a pipeline (fully_shard(reshard_after_forward=False);
                  torch's pipelining turns the gradient sync off for all backwards but the
                  last): a unit is gathered at its first forward and stays whole; its gradient
                  accumulates whole over the micro-batches and is reduce-scattered once, after
                  its last backward: 1 gather and 1 reduce-scatter per unit and step, and the
                  whole stage, with its whole gradient, held for the step.

`train_sharded` trains with it; `unshard` (in the parent) puts the ranks' shards back together.
"""
import math
from collections import Counter

import torch
import torch.distributed as dist
import torch.nn.functional as F

from .. import _argcheck as check
from ..devices import device
from ..mesh import HandMesh
from ..pipeline_schedules import n_pieces, normalize, placement_of
from ..sharding import chunk_bounds
from .stage import PipelineStage, micro_batch_sizes, split_model

POLICIES = ("every action", "whole step")
OPS = ("all_gather", "reduce_scatter")


def pp_dp_mesh(pp, dp):
    """The groups of dp copies of a pp-stage pipeline, built by hand on every rank (HandMesh of
    shape (dp, pp)): rank d·pp + s is stage s of copy d; its "pp" group is its own pipeline,
    its "dp" group the ranks holding the same stage (s, s + pp, ...)."""
    pp, dp = check.whole(pp, "pp", at_least=1), check.whole(dp, "dp", at_least=1)
    world = dist.get_world_size()
    if pp * dp != world:
        raise ValueError(f"pp × dp = {pp} × {dp} = {pp * dp} ranks, but this run has {world}: "
                         f"launch {pp * dp} ranks, or choose pp and dp whose product is {world}.")
    return HandMesh((dp, pp), ("dp", "pp"))


class _Unit:
    """One module's trainable parameters, sharded over the dp group."""

    def __init__(self, module, d, dp):
        self.module = module
        self.params = [q for q in module.parameters(recurse=False) if q.requires_grad]
        self.c = [math.ceil(q.numel() / dp) for q in self.params]    # each rank's padded slice
        self.bounds = [chunk_bounds(q.numel(), dp, d) for q in self.params]
        self.shards = [q.detach().reshape(-1)[lo:hi].clone() for q, (lo, hi) in
                       zip(self.params, self.bounds)]
        self.grads = [None] * len(self.params)                        # the shards' gradients
        self.whole, self.ready = True, 0


class ShardedStage(PipelineStage):
    """A PipelineStage (one rank's chunks, over the mesh's pp group) whose parameters are sharded
    over the mesh's dp group; `policy` "every action" or "whole step" (module doc)."""

    def __init__(self, parts, mesh, in_shape, dtype=torch.float32, policy="whole step",
                 placement="loop"):
        if policy not in POLICIES:
            raise ValueError(f"policy must be one of {POLICIES} (ps.parameter_gathers also "
                             f"counts 'while in use', which this runtime does not run); got "
                             f"{policy!r}.")
        if placement_of(None, placement) == "dual":
            raise ValueError("the dual placement (DualPipe) holds every piece twice; sharding "
                             "both copies is not done here: use a 'loop' or 'v' schedule.")
        d, s = mesh.get_coordinate()
        super().__init__(parts, s, mesh.shape[1], in_shape, dtype, group=mesh.get_group("pp"),
                         placement=placement)
        if any(len(pieces) > 1 for _, pieces, _ in self.holders):
            raise ValueError("a parameter in two pieces (tied, or a layer used twice) is held "
                             "as copies by pp.train; ShardedStage does not shard such copies: "
                             "untie it, or keep it in one piece.")
        self.policy, self.dp_group, self.d, self.dp = policy, mesh.get_group("dp"), d, mesh.shape[0]
        self.units = [_Unit(mod, d, self.dp) for c in sorted(self.chunks)
                      for mod in self.chunks[c].modules()
                      if any(q.requires_grad for q in mod.parameters(recurse=False))]
        self.counts, self.peak_whole_bytes = Counter(), 0
        for u in self.units:
            self._free(u)                   # from here on, a unit is whole only when gathered
            u.module.register_forward_pre_hook(lambda mod, args, u=u: self._gather(u))
            u.module.register_forward_hook(lambda mod, args, out, u=u: self._after_forward(u, out))
            for q in u.params:
                q.register_post_accumulate_grad_hook(lambda q, u=u: self._grad_ready(u))

    # -- when: the three hooks and the backward ---------------------------------------------------
    def _after_forward(self, u, out):
        if self.policy == "every action":
            self._free(u)
            if isinstance(out, torch.Tensor) and out.requires_grad:   # gathered again for B
                out.register_hook(lambda grad: self._gather(u))

    def _grad_ready(self, u):
        """After each of u's parameters got this backward's gradient: reduce-scatter now ("every
        action"), or only after the chunk's last backward of the step ("whole step")."""
        u.ready += 1
        if u.ready < len(u.params):
            return
        u.ready = 0
        self._measure()
        if self.policy == "every action" or self._last_backward:
            self._reduce_scatter(u)
            self._free(u)

    def backward(self, chunk, mb, split=False):
        self._last_backward = self._backwards_left[chunk] == 1
        self._backwards_left[chunk] -= 1
        super().backward(chunk, mb, split)

    def step(self, actions, x, y, n_microbatches, loss_fn):
        """PipelineStage.step with the units gathered and reduced as `policy` says. Afterwards
        every unit is sharded again, and its shard's gradient (summed over the dp group) is in
        the unit's `grads`."""
        actions = normalize([actions])[0]
        if any(a.kind in "IW" for a in actions):
            raise ValueError("ShardedStage runs schedules of F and B actions (GPipe, 1F1B, "
                             "interleaved 1F1B, looped BFS); ZB's split backward (I, W) would "
                             "need W to reduce-scatter, which is not done here.")
        self._backwards_left = Counter(a.chunk for a in actions if a.kind == "B")
        loss = super().step(actions, x, y, n_microbatches, loss_fn)
        for u in self.units:                # a unit whose parameters got no gradient
            self._free(u)
        return loss

    # -- what travels: one all-gather, one reduce-scatter per unit --------------------------------
    def _gather(self, u):
        """All of u's parameters whole: the shards side by side (each padded to c), one
        all_gather_single over the dp group, each parameter read out of the dp rows."""
        if u.whole:
            return
        mine = torch.cat([F.pad(s, (0, c - s.numel())) for s, c in zip(u.shards, u.c)])
        rows = torch.empty(self.dp * mine.numel(), dtype=mine.dtype, device=mine.device)
        dist.all_gather_single(rows, mine, group=self.dp_group)
        rows, at = rows.view(self.dp, -1), 0
        for q, c in zip(u.params, u.c):
            q.untyped_storage().resize_(q.numel() * q.element_size())
            q.data.view(-1).copy_(rows[:, at:at + c].reshape(-1)[:q.numel()])
            at += c
        u.whole = True
        self.counts["all_gather"] += 1
        self._measure()

    def _reduce_scatter(self, u):
        """Sum u's whole gradients over the dp group, keep this rank's slices: each gradient
        padded to dp·c and cut into dp rows, the rows side by side, one reduce_scatter_single."""
        cols = [F.pad(q.grad.reshape(-1), (0, self.dp * c - q.numel())).view(self.dp, c)
                for q, c in zip(u.params, u.c)]
        out = torch.empty(sum(u.c), dtype=cols[0].dtype, device=cols[0].device)
        dist.reduce_scatter_single(out, torch.cat(cols, dim=1).reshape(-1), group=self.dp_group)
        at = 0
        for i, (q, c, (lo, hi)) in enumerate(zip(u.params, u.c, u.bounds)):
            g = out[at:at + hi - lo]
            u.grads[i] = g.clone() if u.grads[i] is None else u.grads[i] + g
            q.grad, at = None, at + c       # the whole gradient is not kept
        self.counts["reduce_scatter"] += 1

    def _free(self, u):
        for q in u.params:
            q.untyped_storage().resize_(0)   # the tensor stays (autograd may hold it): refilled
        u.whole = False

    def _measure(self):
        """Bytes of parameters and gradients held whole now, and the peak of the step."""
        now = sum(q.untyped_storage().nbytes() + (0 if q.grad is None else
                                                  q.grad.untyped_storage().nbytes())
                  for u in self.units for q in u.params)
        self.peak_whole_bytes = max(self.peak_whole_bytes, now)

    # -- the optimizer, on the shards ---------------------------------------------------------
    def sgd_step(self, lr):
        """Plain SGD on this rank's shards (a parameter with no gradient is skipped), then the
        shards' gradients cleared."""
        with torch.no_grad():
            for u in self.units:
                for s, g in zip(u.shards, u.grads):
                    if g is not None:
                        s.add_(g, alpha=-lr)
                u.grads = [None] * len(u.params)


def train_sharded(rank, world_size, pp, dp, schedule, model, batches, n_microbatches, in_shape,
                  v=1, policy="whole step", loss_fn=None, lr=0.05, dtype=torch.float32,
                  mesh=None, prefix="net."):
    """Train `model.net` on pp stages × dp copies, sharded with `policy`, for len(batches) SGD
    steps; `schedule(pp, m)` as pp.train takes it; copy d trains on its share of each batch
    (sizes as micro_batch_sizes(len(batch), dp) cuts it). Returns, per step: the global loss (on
    the last stage's ranks, else None), this rank's `pieces` {full name: (lo, hi, its shard
    after the step, the shard's gradient or None)} for `unshard`, its `counts` of all-gathers and
    reduce-scatters and its `peak_whole_bytes`."""
    check.rank_in(rank, check.whole(world_size, "world_size", at_least=1))
    if not callable(schedule):
        raise TypeError(f"schedule must be a function of (p, m) such as ps.one_f_one_b; got "
                        f"{schedule!r}.")
    mesh = mesh or pp_dp_mesh(pp, dp)
    if tuple(mesh.shape) != (dp, pp):
        raise ValueError(f"the mesh given holds {mesh.shape[0]} copies of {mesh.shape[1]} stages, "
                         f"not dp={dp} copies of pp={pp}: pass pp_dp_mesh(pp, dp).")
    loss_fn = loss_fn or F.mse_loss
    model = model.to(device=device(), dtype=dtype)
    actions = schedule(pp, n_microbatches)
    placement = placement_of(actions)
    stage = ShardedStage(split_model(model.net, n_pieces(pp, v, placement)), mesh, in_shape,
                         dtype, policy, placement)
    named = {id(q): f"{prefix}{n}" for c in sorted(stage.chunks)
             for n, q in stage.chunks[c].named_parameters()}
    frozen = [(named[id(q)], q) for q in stage.parameters() if not q.requires_grad]
    out = []
    for x, y in batches:
        shares = micro_batch_sizes(len(y), dp)
        if shares[-1] < n_microbatches:
            raise ValueError(f"a batch of {len(y)} samples gives each of the {dp} data-parallel "
                             f"copies at least {shares[-1]} samples, fewer than m = "
                             f"{n_microbatches} micro-batches: use batches of at least "
                             f"{n_microbatches * dp} samples, or fewer micro-batches.")
        first = sum(shares[:stage.d])
        rows, share = slice(first, first + shares[stage.d]), shares[stage.d] / len(y)
        before = Counter(stage.counts)
        stage.peak_whole_bytes = 0
        loss = stage.step(actions[stage.rank], x[rows].to(device(), dtype),
                          y[rows].to(device(), dtype), n_microbatches,
                          lambda o, t: loss_fn(o, t) * share)
        if loss is not None:                # the last stage: the copies' shares summed
            loss = loss.detach().reshape(1)
            dist.all_reduce(loss, group=stage.dp_group)
        grads = [None if g is None else g.clone() for u in stage.units for g in u.grads]
        stage.sgd_step(lr)
        pieces = {named[id(q)]: (lo, hi, s.clone(), g) for (q, (lo, hi), s), g in
                  zip([t for u in stage.units for t in zip(u.params, u.bounds, u.shards)], grads)}
        pieces.update({n: (0, q.numel(), q.detach().reshape(-1).clone(), None)
                       for n, q in frozen})
        out.append(dict(loss=None if loss is None else loss.item(), pieces=pieces,
                        shapes={named[id(q)]: tuple(q.shape) for q in stage.parameters()},
                        counts={op: stage.counts[op] - before[op] for op in OPS},
                        peak_whole_bytes=stage.peak_whole_bytes,
                        stage=stage.rank, copy=stage.d))
    return out


def unshard(results):
    """In the parent: the ranks' shards put back together. `results`: one list of steps per rank
    (from train_sharded). Returns per step {"loss", "params": {name: tensor}, "grads": {name:
    tensor, or None where no rank holding it has a gradient}}."""
    steps = []
    for k in range(len(results[0])):
        params, grads, pieces, loss = {}, {}, {}, None
        for r in results:
            s = r[k]
            loss = s["loss"] if s["loss"] is not None else loss
            for name, (lo, hi, shard, g) in s["pieces"].items():
                pieces.setdefault(name, []).append((lo, hi, shard, g))
                params.setdefault(name, torch.zeros(math.prod(s["shapes"][name]),
                                                    dtype=shard.dtype))
        for name, held in pieces.items():
            with_grad = [g is not None for *_, g in held]
            if any(with_grad) and not all(with_grad):
                raise ValueError(f"{name}: some ranks hold a gradient and some none; the "
                                 f"copies of a stage must run the same graph.")
            grads[name] = torch.zeros_like(params[name]) if all(with_grad) else None
            for lo, hi, shard, g in held:
                params[name][lo:hi] = shard
                if g is not None:
                    grads[name][lo:hi] = g
        shapes = {n: sh for r in results for n, sh in r[k]["shapes"].items()}
        steps.append(dict(loss=loss, params={n: t.view(shapes[n]) for n, t in params.items()},
                          grads={n: None if g is None else g.view(shapes[n])
                                 for n, g in grads.items()}))
    return steps
