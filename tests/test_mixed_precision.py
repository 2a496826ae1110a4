"""Mixed precision: ZeRO-1/2/3 and FSDP2 with bf16 compute and fp32 master weights equal a
single-process reference doing the same casts; fp16 loss scaling skips an overflowing step."""
import pytest
import torch
import torch.nn.functional as F

import distlab
from distlab import models
from distlab.mixed_precision import loss_scaled_step, reference_step
from distlab.sharding import ZeRO

SIZES = (5, 12, 7, 3)            # sizes that do not divide by 2 or 3: uneven shards
STEPS, BATCH, LR = 3, 12, 1e-2
BF16 = torch.bfloat16


def loss_fn(out, y):
    return F.mse_loss(out, y.to(out.dtype))


def data():
    x, y = models.regression_data(n=64, in_dim=SIZES[0], out_dim=SIZES[-1], seed=2)
    return models.batches_of(x, y, BATCH, STEPS)


def reference(world_size, reduce_dtype):
    master = models.make_mlp(SIZES, seed=1)
    opt = torch.optim.Adam(master.parameters(), lr=LR, foreach=False)
    losses = [reference_step(master, opt, x, y, loss_fn, world_size, BF16, reduce_dtype)
              for x, y in data()]
    return losses, [p.detach().clone() for p in master.parameters()]


def train_zero(rank, world_size, cases):
    out = {}
    for stage, reduce_dtype in cases:
        model = models.make_mlp(SIZES, seed=1)
        zero = ZeRO(model, stage, optimizer_class=torch.optim.Adam, lr=LR, foreach=False,
                    compute_dtype=BF16, reduce_dtype=reduce_dtype)
        dtypes = {p.dtype for p in model.parameters()} | {s.dtype for s in zero.shards}
        losses = []
        for x, y in data():
            zero.zero_grad()
            loss = loss_fn(model(x.chunk(world_size)[rank]), y.chunk(world_size)[rank])
            loss.backward()
            zero.step()
            losses.append(loss.item())
        out[stage, reduce_dtype] = losses, zero.full_parameters(), dtypes
    return out


def assert_equal_to_reference(world_size, cases):
    by_rank = distlab.run(train_zero, world_size, cases)
    for stage, reduce_dtype in cases:
        ref_losses, ref_params = reference(world_size, reduce_dtype)
        for rank, result in enumerate(by_rank):
            losses, params, dtypes = result[stage, reduce_dtype]
            where = f"ZeRO-{stage}, reduce in {reduce_dtype}, rank {rank}"
            assert dtypes == {BF16, torch.float32}, where     # bf16 model, fp32 master shards
            assert [step[rank] for step in ref_losses] == losses, where
            for got, want in zip(params, ref_params):
                assert got.dtype == torch.float32
                torch.testing.assert_close(got, want, rtol=0, atol=0, msg=where)


def test_zero_stages_in_bf16_equal_the_mixed_precision_reference_at_2_ranks():
    assert_equal_to_reference(2, [(s, r) for s in (1, 2, 3) for r in (BF16, torch.float32)])


def test_zero_stages_in_bf16_with_fp32_reduction_equal_the_reference_at_3_ranks():
    """3 ranks: bf16 partial sums would depend on the ring's order; fp32 sums of bf16 do not."""
    assert_equal_to_reference(3, [(s, torch.float32) for s in (1, 2, 3)])


def fsdp2(rank, world_size, reduce_dtype):
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    model = models.make_mlp(SIZES, seed=1)
    policy = MixedPrecisionPolicy(param_dtype=BF16, reduce_dtype=reduce_dtype)
    for layer in model.net:
        if any(True for _ in layer.parameters()):
            fully_shard(layer, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    opt = torch.optim.Adam(model.parameters(), lr=LR, foreach=False)
    for x, y in data():
        loss = loss_fn(model(x.chunk(world_size)[rank]), y.chunk(world_size)[rank])
        loss.backward()
        opt.step()
        opt.zero_grad()
    return [p.full_tensor() for p in model.parameters()]


@pytest.mark.parametrize("reduce_dtype", [torch.float32, BF16])
def test_fsdp2_mixed_precision_policy_equals_the_same_reference(reduce_dtype):
    _, ref_params = reference(2, reduce_dtype)
    for rank, params in enumerate(distlab.run(fsdp2, 2, reduce_dtype)):
        for got, want in zip(params, ref_params):
            torch.testing.assert_close(got, want, rtol=0, atol=0, msg=f"rank {rank}")


def test_fp16_loss_scaling_skips_the_step_that_overflows_and_halves_the_scale():
    model = models.make_mlp(SIZES, seed=1)           # float32 master; autocast computes in fp16
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 24, growth_interval=1000)
    x, y = next(iter(data()))
    first = loss_scaled_step(model, opt, scaler, x, y, loss_fn)
    assert first[1] == 2.0 ** 24 and first[2], "a 2^24 scale overflows fp16 gradients: skipped"
    assert scaler.get_scale() == 2.0 ** 23                        # halved for the next try
    steps = [loss_scaled_step(model, opt, scaler, x, y, loss_fn) for _ in range(20)]
    taken = [scale for _, scale, skipped in steps if not skipped]
    assert taken, "the scale halves until the gradients fit in fp16, then steps are taken"
    assert all(skipped for _, scale, skipped in steps if scale > taken[0])


def test_a_step_taken_with_lr_0_is_not_reported_as_skipped():
    """lr 0 moves no weight, yet the step was taken (finite gradients, the scale kept)."""
    model = models.make_mlp(SIZES, seed=1)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    scaler = torch.amp.GradScaler("cpu", init_scale=1.0, growth_interval=1000)
    x, y = next(iter(data()))
    before = [p.detach().clone() for p in model.parameters()]
    _, scale, skipped = loss_scaled_step(model, opt, scaler, x, y, loss_fn)
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters()))   # nothing moved
    assert scale == 1.0 and scaler.get_scale() == 1.0                         # no overflow
    assert not skipped
