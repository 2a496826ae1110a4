"""Mixed precision: which copy of the model lives in which dtype, proven on one process.

Mixed-precision training keeps THREE precisions apart:
- the master weights and the optimizer's state in float32: a bf16 weight cannot take an update
  smaller than 1/256 of itself (8 bits of mantissa), so small steps would vanish;
- the compute (forward, backward, activations) in bf16: half the bytes moved, and the tensor
  cores' fast path on a GPU;
- the gradient reduction in a dtype of its own: bf16 halves the bytes on the wire, float32 adds
  the ranks' gradients without rounding each partial sum to 8 bits.

`reference_step` does on ONE process exactly the casts that `distlab.sharding.ZeRO` with
`compute_dtype=` / `reduce_dtype=` does on N ranks, so the two can be compared bit for bit.
`loss_scaled_step` shows why float16 (5 exponent bits: nothing above 65504) needs loss scaling
and bf16 (float32's 8 exponent bits) does not.
"""
import copy

import torch

from . import _argcheck as check


def reference_step(master, optimizer, x, y, loss_fn, world_size, compute_dtype,
                   reduce_dtype=None):
    """One mixed-precision data-parallel step of `world_size` ranks, done on one process.

    `master`: the float32 model the optimizer updates. Rank r's part of the batch is chunk r of
    (x, y); each rank runs a compute_dtype copy of the master; its gradients are cast to
    reduce_dtype (default compute_dtype), summed over the ranks in rank order, divided by
    world_size in reduce_dtype, and cast to float32 for the step. Returns the ranks' losses.
    """
    _check_step(x, y, world_size, compute_dtype, reduce_dtype)
    reduce_dtype = reduce_dtype or compute_dtype
    total, losses = None, []
    for xr, yr in zip(x.chunk(world_size), y.chunk(world_size)):
        model = copy.deepcopy(master).to(compute_dtype)
        loss = loss_fn(model(xr.to(compute_dtype)), yr)
        loss.backward()
        losses.append(loss.item())
        grads = [p.grad.to(reduce_dtype) for p in model.parameters()]
        total = grads if total is None else [t + g for t, g in zip(total, grads)]
    for p, g in zip(master.parameters(), total):
        p.grad = (g / world_size).to(p.dtype)
    optimizer.step()
    optimizer.zero_grad()
    return losses


def _check_step(x, y, world_size, compute_dtype, reduce_dtype):
    # chunk() makes fewer or unequal parts than ranks without a word, and the gradient would
    # still be divided by world_size: every rank must get an equal, non-empty part
    world_size = check.whole(world_size, "world_size", at_least=1)
    check.floating_dtype(compute_dtype, "compute_dtype")
    if reduce_dtype is not None:
        check.floating_dtype(reduce_dtype, "reduce_dtype")
    if len(x) != len(y):
        raise ValueError(f"x and y must hold the same number of samples; got {len(x)} and "
                         f"{len(y)}.")
    if len(x) < world_size or len(x) % world_size:
        raise ValueError(f"a batch of {len(x)} samples does not split into equal parts for "
                         f"{world_size} ranks: pass a batch whose size is a multiple of "
                         f"world_size.")


def loss_scaled_step(model, optimizer, scaler, x, y, loss_fn):
    """One float16 step with torch's GradScaler; (loss, scale used, whether the step was skipped).

    The model's weights stay float32 (GradScaler refuses to unscale float16 gradients: the
    master copy is the point); autocast runs its matmuls in float16. The loss is multiplied by
    the scale before backward so that small gradients do not flush to zero in float16; before
    the step the gradients are divided by it again. If any gradient overflowed to inf/nan, the
    step is SKIPPED (the weights do not move) and the scale halves.
    """
    scale = scaler.get_scale()
    with torch.autocast(x.device.type, dtype=torch.float16):
        loss = loss_fn(model(x), y)
    scaler.scale(loss).backward()
    # Unscale first, so that the gradients GradScaler judges are in hand: it skips the step
    # exactly when one of them is inf or nan. (Weights that did not move would not say it: a
    # step with lr 0, or a gradient of zero, is taken and moves nothing.)
    scaler.unscale_(optimizer)
    grads = [p.grad for group in optimizer.param_groups for p in group["params"]
             if p.grad is not None]
    skipped = scaler.is_enabled() and not all(bool(torch.isfinite(g).all()) for g in grads)
    scaler.step(optimizer)                  # uses the unscaled gradients, does not unscale again
    scaler.update()
    optimizer.zero_grad()
    return loss.item(), scale, skipped
