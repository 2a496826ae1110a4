"""ZeRO stages 1, 2 and 3 from scratch: data parallelism that shards the model states.

Every rank trains on its own part of the batch, as in DDP. What changes is who KEEPS what:

    stage 1: each rank keeps the optimizer state (Adam's moments) of 1/N of every parameter;
             after backward, gradients are reduce-scattered (each rank receives the average of
             its slice), each rank updates its slice, and the slices are all-gathered.
    stage 2: + gradients are reduce-scattered as soon as autograd produces them, so each rank
             keeps only the gradient slice it will use.
    stage 3: + the parameters themselves are sharded: a layer's full weights exist only while it
             runs forward or backward (all-gathered just before, freed right after).

Sharding is per parameter: flattened, rank r owns elements [r*c, (r+1)*c) with c = ceil(numel/N)
(the last ranks may own fewer, or none). Collectives pad to c*N elements because gloo's
all_gather and reduce_scatter need equal sizes.
"""
import math
from collections import Counter

import torch
import torch.distributed as dist

from .models import make_optimizer


def chunk_bounds(numel, world_size, rank):
    """[lo, hi) of the flattened parameter that `rank` owns."""
    c = math.ceil(numel / world_size)
    return min(rank * c, numel), min((rank + 1) * c, numel)


def gather_flat(shard, numel, group=None):
    """The whole flattened parameter (numel elements) from every rank's slice of it."""
    world = dist.get_world_size(group)
    c = math.ceil(numel / world)
    mine = torch.nn.functional.pad(shard, (0, c - shard.numel()))  # gloo needs equal sizes
    parts = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(parts, mine, group=group)
    return torch.cat(parts)[:numel]


class ZeRO:
    """Wraps a model replicated on every rank of `group`; call backward as usual, then step()."""

    def __init__(self, model, stage, group=None, optimizer="adam", lr=1e-2):
        if stage not in (1, 2, 3):
            raise ValueError(f"ZeRO stage must be 1, 2 or 3; got {stage!r}.")
        self.model, self.stage, self.group = model, stage, group
        self.rank, self.world = dist.get_rank(group), dist.get_world_size(group)
        self.sent = Counter()  # bytes this rank sent, per collective (ring algorithms)
        self.params = [p for p in model.parameters() if p.requires_grad]
        src = dist.get_global_rank(group, 0) if group is not None else 0
        for p in self.params:  # every replica starts from the same weights
            dist.broadcast(p.data, src, group=group)
        self.shards = []
        for p in self.params:
            lo, hi = chunk_bounds(p.numel(), self.world, self.rank)
            flat = p.data.view(-1)[lo:hi]
            # Stages 1-2: the shard is a view of the full parameter, updated in place.
            # Stage 3: the full parameter is about to be freed, so the shard owns its memory.
            self.shards.append(torch.nn.Parameter(flat.clone() if stage == 3 else flat))
        self.optimizer = make_optimizer(self.shards, optimizer, lr)
        if stage >= 2:
            for p, s in zip(self.params, self.shards):
                p.register_post_accumulate_grad_hook(self._make_grad_hook(p, s))
        if stage == 3:
            self._owner = {}
            for module in model.modules():
                own = [p for p in module.parameters(recurse=False) if p.requires_grad]
                if own:
                    module.register_forward_pre_hook(lambda m, args: self._gather(m))
                    module.register_forward_hook(self._after_forward)
                    self._owner[module] = own
                    for p in own:
                        _free_storage(p)

    # ---- communication, padded to equal sizes -------------------------------------------------
    def _padded(self, flat):
        c = math.ceil(flat.numel() / self.world)
        return torch.nn.functional.pad(flat, (0, c * self.world - flat.numel())), c

    def _all_gather_param(self, p, shard):
        """Fill p (its full storage) from every rank's shard."""
        p.data.view(-1).copy_(gather_flat(shard.data, p.numel(), self.group))
        self.sent["all_gather"] += math.ceil(p.numel() / self.world) * p.element_size() * \
            (self.world - 1)

    def _reduce_scatter_grad(self, grad, shard):
        """Average `grad` over the ranks, keeping only this rank's slice (in shard.grad)."""
        padded, c = self._padded(grad.reshape(-1))
        out = torch.empty(c, dtype=grad.dtype, device=grad.device)
        dist.reduce_scatter(out, list(padded.split(c)), group=self.group)
        self.sent["reduce_scatter"] += c * grad.element_size() * (self.world - 1)
        mine = out[:shard.numel()] / self.world
        shard.grad = mine if shard.grad is None else shard.grad + mine

    # ---- stage 2 and 3: gradients leave as soon as they are ready ---------------------------
    def _make_grad_hook(self, p, shard):
        def hook(param):
            self._reduce_scatter_grad(param.grad, shard)
            param.grad = None  # the full gradient is never kept
            if self.stage == 3:
                _free_storage(param)
        return hook

    # ---- stage 3: parameters exist only around their layer's forward and backward -----------
    def _gather(self, module):
        for p in self._owner[module]:
            if p.untyped_storage().nbytes() == 0:
                p.untyped_storage().resize_(p.numel() * p.element_size())
                self._all_gather_param(p, self.shards[self._index(p)])

    def _after_forward(self, module, args, output):
        for p in self._owner[module]:
            _free_storage(p)
        # The gradient of the layer's output arrives just before the layer's own backward:
        # the moment to gather its weights again.
        for t in output if isinstance(output, (tuple, list)) else [output]:
            if isinstance(t, torch.Tensor) and t.requires_grad:
                t.register_hook(lambda grad, m=module: self._gather(m))
                break

    def _index(self, p):
        return next(i for i, q in enumerate(self.params) if q is p)

    # ---- the optimizer step ---------------------------------------------------------------
    def step(self):
        if self.stage == 1:  # full gradients exist (as in DDP); each rank takes its averaged slice
            for p, s in zip(self.params, self.shards):
                s.grad = None
                self._reduce_scatter_grad(p.grad, s)
                lo, hi = chunk_bounds(p.numel(), self.world, self.rank)
                p.grad.view(-1)[lo:hi].copy_(s.grad)  # keep the averaged slice in place...
                s.grad = p.grad.view(-1)[lo:hi]       # ...so it costs no extra memory
        self.optimizer.step()
        if self.stage < 3:  # every rank needs the full updated weights for the next forward
            for p, s in zip(self.params, self.shards):
                self._all_gather_param(p, s)

    def zero_grad(self):
        self.optimizer.zero_grad(set_to_none=True)
        for p in self.params:
            p.grad = None

    def full_parameters(self):
        """Every parameter, whole, in model order (gathers them under stage 3)."""
        out = []
        for p, s in zip(self.params, self.shards):
            full = torch.empty(p.shape, dtype=p.dtype, device=p.device)
            if self.stage == 3:
                full.view(-1).copy_(gather_flat(s.data, p.numel(), self.group))
            else:
                full.copy_(p.data)
            out.append(full)
        return out

    def state_bytes(self):
        """Bytes this rank holds now, measured on its real tensors."""
        return measure_state_bytes(self.params + self.shards,
                                   [p.grad for p in self.params] + [s.grad for s in self.shards],
                                   self.optimizer)


def measure_state_bytes(weights, grads, optimizer):
    """{"weights", "grads", "optimizer"}: bytes of the storages these tensors really occupy.

    Storage shared by several tensors (a shard that is a view of its parameter) counts once,
    and a freed storage (ZeRO-3 between layers) counts zero.
    """
    seen = set()

    def size(tensors):
        total = 0
        for t in tensors:
            if t is None:
                continue
            storage = t.untyped_storage()
            if storage.nbytes() == 0 or storage.data_ptr() in seen:
                continue
            seen.add(storage.data_ptr())
            total += storage.nbytes()
        return total

    # 0-dim tensors are Adam's step counters: bookkeeping, not state that scales with the model.
    states = [v for st in optimizer.state.values() for v in st.values()
              if isinstance(v, torch.Tensor) and v.dim() > 0]
    return {"weights": size(weights), "grads": size(grads), "optimizer": size(states)}


def _free_storage(p):
    # Autograd may hold this tensor; resizing its storage frees the memory but keeps the
    # tensor object, so the same storage can be refilled before backward needs it.
    p.untyped_storage().resize_(0)
