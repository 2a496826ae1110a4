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
import numbers
from collections import Counter

import torch
import torch.distributed as dist


# The names the chapters use; any other optimizer is given by its class (optimizer_class=).
OPTIMIZERS = {"sgd": torch.optim.SGD, "adam": torch.optim.Adam}
# These look at a whole tensor at once (its matrix shape, a closure over the whole model, sparse
# rows), so on flat slices they would compute something else than on one process.
_NOT_PER_ELEMENT = tuple(getattr(torch.optim, name) for name in
                         ("LBFGS", "Adafactor", "Muon", "SparseAdam") if hasattr(torch.optim, name))


def chunk_bounds(numel, world_size, rank):
    """[lo, hi) of the flattened parameter that `rank` owns."""
    for name, value in (("numel", numel), ("world_size", world_size), ("rank", rank)):
        if isinstance(value, bool) or not isinstance(value, numbers.Integral):
            raise TypeError(f"chunk_bounds takes whole numbers; {name} is {value!r}.")
    if numel < 0 or world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"chunk_bounds needs numel >= 0, world_size >= 1 and a rank from 0 to "
                         f"world_size - 1; got numel={numel}, world_size={world_size}, "
                         f"rank={rank}.")
    c = math.ceil(numel / world_size)
    return min(rank * c, numel), min((rank + 1) * c, numel)


def gather_flat(shard, numel, group=None, out=None):
    """The whole flattened parameter (numel elements) from every rank's slice of it.

    `out`: a flat tensor of numel elements to gather into. When numel divides by the world
    size the slices land in `out` itself (no other full-size buffer); otherwise they land in
    one padded buffer, returned as a view of its first numel elements — never a second copy
    (a full parameter's extra copies are peak memory: zero_memory counts them)."""
    world = dist.get_world_size(group)
    c = math.ceil(numel / world)
    # gloo needs equal sizes; a slice that already has them goes as it is (no copy)
    mine = shard if shard.numel() == c else torch.nn.functional.pad(shard,
                                                                    (0, c - shard.numel()))
    if out is not None and c * world == numel:
        buffer = out
    else:
        buffer = torch.empty(c * world, dtype=mine.dtype, device=mine.device)
    dist.all_gather(list(buffer.split(c)), mine, group=group)
    return buffer[:numel]


# The dtypes a model can compute and reduce gradients in: float8 has no matmul or autograd on
# the CPU, integers no gradients at all.
_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _check_dtype(name, dtype):
    """Refuse, before any rank communicates, a dtype that would fail deep inside a rank."""
    if dtype is not None and dtype not in _FLOAT_DTYPES:
        raise ValueError(f"{name} must be None (the model's own dtype) or one of "
                         f"{', '.join(map(str, _FLOAT_DTYPES))}; got {dtype!r}.")


def _optimizer(optimizer=None, optimizer_class=None, lr=None, **defaults):
    """(class, keyword arguments) of the optimizer ZeRO builds on this rank's slices.

    Either a name ("sgd" or "adam"; lr 1e-2 unless given), or any per-element torch.optim class
    with its keyword arguments, as torch's ZeroRedundancyOptimizer(optimizer_class=, **defaults).
    """
    if optimizer is not None and optimizer_class is not None:
        raise ValueError("give the optimizer either by name (optimizer='adam') or by class "
                         "(optimizer_class=torch.optim.AdamW), not both.")
    if optimizer_class is None:
        if not isinstance(optimizer, str) and optimizer is not None:
            optimizer_class = optimizer                  # a class given in the name's place
        elif (optimizer or "adam") in OPTIMIZERS:
            optimizer_class, lr = OPTIMIZERS[optimizer or "adam"], 1e-2 if lr is None else lr
        else:
            raise ValueError(f"optimizer must be one of {sorted(OPTIMIZERS)}, or a class given as "
                             f"optimizer_class= (e.g. torch.optim.AdamW); got {optimizer!r}.")
    if not (isinstance(optimizer_class, type) and issubclass(optimizer_class, torch.optim.Optimizer)):
        raise TypeError(f"optimizer_class must be a torch.optim.Optimizer class such as "
                        f"torch.optim.AdamW (the class, not an instance); got {optimizer_class!r}.")
    if issubclass(optimizer_class, _NOT_PER_ELEMENT):
        raise ValueError(f"{optimizer_class.__name__} looks at whole tensors, but ZeRO gives each "
                         f"rank flat slices of them; use an optimizer that updates every element "
                         f"on its own, such as SGD, Adam or AdamW.")
    if lr is not None:
        defaults["lr"] = lr
    return optimizer_class, defaults


class ZeRO:
    """Wraps a model replicated on every rank of `group`; call backward as usual, then step().

    The optimizer: `optimizer="adam"` (or "sgd") and `lr`, or any torch.optim class that updates
    each element on its own, with its keyword arguments:

        ZeRO(model, 2, optimizer_class=torch.optim.AdamW, lr=1e-3, weight_decay=0.1)

    Frozen parameters (requires_grad=False) are neither sharded nor updated; a tied parameter is
    one parameter; one that gets no gradient in a step is skipped, as on one process.

    Stage 3 with `prefetch=True` launches the all-gather of the next layer (in the order the
    modules were defined; the previous one in backward) asynchronously while this layer computes;
    step() drops the gathers of pre-step weights that this order left behind.

    Mixed precision (`compute_dtype=torch.bfloat16`): the shards stay in the model's dtype (fp32
    master weights, and the optimizer's state beside them); the model's own parameters become
    compute_dtype copies, gathered in compute_dtype (the shard is cast, then all-gathered), and
    forward inputs are cast to it. Gradients come out of backward in compute_dtype and are
    reduce-scattered and kept in `reduce_dtype` (default compute_dtype; float32 reduces more
    exactly for twice the bytes), then cast to the master's dtype just before the step.
    """

    def __init__(self, model, stage, group=None, optimizer=None, lr=None, *, optimizer_class=None,
                 prefetch=False, compute_dtype=None, reduce_dtype=None, **defaults):
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"ZeRO wraps a model, a torch.nn.Module; got a {type(model).__name__}.")
        if not any(p.requires_grad for p in model.parameters()):
            raise ValueError("ZeRO shards what training updates, and this model has no parameter "
                             "with requires_grad=True; pass the model to train.")
        if isinstance(stage, bool) or stage not in (1, 2, 3):
            raise ValueError(f"ZeRO stage must be 1, 2 or 3; got {stage!r}.")
        if prefetch and stage != 3:
            raise ValueError(f"prefetch gathers the next layer's parameters, which only stage 3 "
                             f"shards; got prefetch=True with stage {stage}.")
        for name, dtype in (("compute_dtype", compute_dtype), ("reduce_dtype", reduce_dtype)):
            _check_dtype(name, dtype)
        self.prefetch, self._pending = prefetch, {}
        self.compute_dtype = compute_dtype
        self.reduce_dtype = reduce_dtype if reduce_dtype is not None else compute_dtype
        optimizer_class, defaults = _optimizer(optimizer, optimizer_class, lr, **defaults)
        self.model, self.stage, self.group = model, stage, group
        self.rank, self.world = dist.get_rank(group), dist.get_world_size(group)
        self.sent = Counter()  # bytes this rank sent, per collective (ring algorithms)
        self.params = [p for p in model.parameters() if p.requires_grad]
        src = dist.get_global_rank(group, 0) if group is not None else 0
        with torch.no_grad():  # every replica starts from the same weights, frozen ones included
            for t in list(model.parameters()) + list(model.buffers()):
                dist.broadcast(t, src, group=group)
        self.shards = []
        for p in self.params:
            lo, hi = chunk_bounds(p.numel(), self.world, self.rank)
            flat = p.data.view(-1)[lo:hi]
            # Stages 1-2: the shard is a view of the full parameter, updated in place.
            # Stage 3: the full parameter is about to be freed, so the shard owns its memory;
            # so does the master shard of mixed precision (the parameter changes dtype below).
            own = stage == 3 or compute_dtype is not None
            self.shards.append(torch.nn.Parameter(flat.clone() if own else flat))
            if compute_dtype is not None:   # its gradient waits in reduce_dtype until the step
                self.shards[-1].grad_dtype = None
        if compute_dtype is not None:
            with torch.no_grad():
                for p in model.parameters():       # frozen ones too: forward needs one dtype
                    if p.is_floating_point():
                        p.data = p.data.to(compute_dtype)
            model.register_forward_pre_hook(self._cast_inputs)
        self.optimizer = optimizer_class(self.shards, **defaults)
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
        if c * self.world == flat.numel():
            return flat, c                     # no padding: the tensor itself, not a copy
        return torch.nn.functional.pad(flat, (0, c * self.world - flat.numel())), c

    def _all_gather_param(self, p, shard):
        """Fill p (its full storage) from every rank's shard."""
        flat = p.data.view(-1)
        full = gather_flat(shard.data.to(p.dtype), p.numel(), self.group, out=flat)
        if full.untyped_storage().data_ptr() != flat.untyped_storage().data_ptr():
            flat.copy_(full)          # padded: the slices came in a buffer of their own
        self.sent["all_gather"] += math.ceil(p.numel() / self.world) * p.element_size() * \
            (self.world - 1)

    def _reduce_scatter_grad(self, grad, shard):
        """Average `grad` over the ranks, keeping only this rank's slice (in shard.grad)."""
        # No full-size copy unless the padding needs one: a divisible gradient is reduced
        # from its own storage (peak memory: the full gradient exists once).
        padded, c = self._padded(grad.reshape(-1).to(self.reduce_dtype or grad.dtype))
        out = torch.empty(c, dtype=padded.dtype, device=grad.device)
        dist.reduce_scatter(out, list(padded.split(c)), group=self.group)
        self.sent["reduce_scatter"] += c * padded.element_size() * (self.world - 1)
        mine = out.div_(self.world) if c == shard.numel() else out[:shard.numel()] / self.world
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
    def _gather(self, module, backward=False):
        if module in self._pending:  # prefetched while the previous layer computed
            self._finish_prefetch(module)
        for p in self._owner[module]:
            if p.untyped_storage().nbytes() == 0:
                p.untyped_storage().resize_(p.numel() * p.element_size())
                self._all_gather_param(p, self.shards[self._index(p)])
        if self.prefetch:  # the next layer's all-gather runs while this layer computes
            order = list(self._owner)
            i = order.index(module) + (-1 if backward else 1)
            if 0 <= i < len(order):
                self._start_prefetch(order[i])

    def _start_prefetch(self, module):
        works = []
        for p in self._owner[module]:
            if p.untyped_storage().nbytes() == 0 and module not in self._pending:
                p.untyped_storage().resize_(p.numel() * p.element_size())
                shard = self.shards[self._index(p)].data.to(p.dtype)     # compute dtype
                c = math.ceil(p.numel() / self.world)
                mine = shard if shard.numel() == c else torch.nn.functional.pad(
                    shard, (0, c - shard.numel()))                            # equal sizes
                # straight into the parameter when no padding is needed (as gather_flat)
                buffer = (p.data.view(-1) if c * self.world == p.numel() else
                          torch.empty(c * self.world, dtype=mine.dtype, device=mine.device))
                parts = list(buffer.split(c))
                works.append((p, parts, dist.all_gather(parts, mine, group=self.group,
                                                        async_op=True)))
        if works:
            self._pending[module] = works

    def _finish_prefetch(self, module):
        for p, parts, work in self._pending.pop(module):
            work.wait()
            flat = p.data.view(-1)
            if parts[0].untyped_storage().data_ptr() != flat.untyped_storage().data_ptr():
                flat.copy_(torch.cat(parts)[:p.numel()])    # padded: a buffer of their own
            self.sent["all_gather"] += parts[0].numel() * p.element_size() * (self.world - 1)

    def _after_forward(self, module, args, output):
        for p in self._owner[module]:
            _free_storage(p)
        # The gradient of the layer's output arrives just before the layer's own backward:
        # the moment to gather its weights again.
        for t in output if isinstance(output, (tuple, list)) else [output]:
            if isinstance(t, torch.Tensor) and t.requires_grad:
                t.register_hook(lambda grad, m=module: self._gather(m, backward=True))
                break

    def _index(self, p):
        return next(i for i, q in enumerate(self.params) if q is p)

    # ---- the optimizer step ---------------------------------------------------------------
    def step(self):
        if self.stage == 1:  # full gradients exist (as in DDP); each rank takes its averaged slice
            for p, s in zip(self.params, self.shards):
                s.grad = None
                if p.grad is None:  # unused in this step: skipped, as by the optimizer on one process
                    continue
                self._reduce_scatter_grad(p.grad, s)
                if s.grad.dtype != p.grad.dtype:      # reduced in another dtype: its own tensor
                    continue
                lo, hi = chunk_bounds(p.numel(), self.world, self.rank)
                p.grad.view(-1)[lo:hi].copy_(s.grad)  # keep the averaged slice in place...
                s.grad = p.grad.view(-1)[lo:hi]       # ...so it costs no extra memory
        for s in self.shards:                         # mixed precision: the step is in fp32
            if s.grad is not None and s.grad.dtype != s.dtype:
                s.grad = s.grad.to(s.dtype)
        self.optimizer.step()
        if self.stage < 3:  # every rank needs the full updated weights for the next forward
            for p, s in zip(self.params, self.shards):
                self._all_gather_param(p, s)
        else:
            self._forget_full_parameters()

    def _forget_full_parameters(self):
        """Stage 3, after the step: no full parameter may outlive the shards it was gathered from.

        Prefetch follows the order the modules were DEFINED in, not the order forward runs them,
        so it can gather a layer whose backward is already done (a layer defined after the one
        that runs next, a parameter on the root module); that gather of the pre-step shards is
        still pending, or already filled, when the step changes the shards. Were it kept, the
        next forward would take it for the layer's weights and skip the real gather. So: wait
        for every pending gather (every rank launched the same ones; the bytes did travel) and
        free every full parameter, and the next forward gathers the updated shards.
        """
        for module in list(self._pending):
            for p, parts, work in self._pending.pop(module):
                work.wait()
                self.sent["all_gather"] += parts[0].numel() * p.element_size() * (self.world - 1)
        for p in self.params:
            _free_storage(p)

    def _cast_inputs(self, module, args):
        return tuple(a.to(self.compute_dtype) if isinstance(a, torch.Tensor) and
                     a.is_floating_point() else a for a in args)

    def zero_grad(self):
        self.optimizer.zero_grad(set_to_none=True)
        for p in self.params:
            p.grad = None

    def full_parameters(self):
        """Every parameter, whole, in model order (gathers them under stage 3)."""
        out = []
        for p, s in zip(self.params, self.shards):
            full = torch.empty(p.shape, dtype=s.dtype, device=p.device)
            if self.stage == 3 or s.dtype != p.dtype:   # mixed precision: the fp32 master
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
