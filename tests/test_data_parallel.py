"""Data parallelism equals one process: naive and bucketed DDP against single-process training.

Every test trains in float64 on real ranks, each rank on its shard of the global batch, and
compares the loss, every gradient and every parameter after each optimizer step with the same
model trained in one process on the whole batch. Replicas must also stay bit-identical.
"""
import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import distlab
from distlab import models
from distlab.data_parallel import (BucketedDDP, average_gradients, broadcast_parameters,
                                   max_replica_difference, shard_batch)

STEPS = 3
GLOBAL = 60                      # divides by 1 to 6
TIGHT = dict(rtol=1e-10, atol=1e-12)


def mlp():
    return models.make_mlp(sizes=(16, 32, 24, 4), seed=0).double()


def mlp_data():
    x, y = models.regression_data(n=STEPS * GLOBAL, seed=1)
    return x.double(), y.double()


def gpt():
    return models.make_gpt(seed=0, vocab=32, d_model=16, n_heads=2, n_layers=2, seq_len=8).double()


def gpt_data():
    return models.token_data(n=STEPS * GLOBAL, seq_len=8, vocab=32, seed=1)


def model_and_data(name):
    if name == "mlp":
        return mlp(), mlp_data(), F.mse_loss
    return gpt(), gpt_data(), models.lm_loss


def reference(name, micro=1):
    """Loss, gradients and parameters of each step, trained in this process on the global batch."""
    model, (x, y), loss_fn = model_and_data(name)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    out = []
    for s in range(STEPS):
        opt.zero_grad()
        loss = loss_fn(model(x[s * GLOBAL:(s + 1) * GLOBAL]), y[s * GLOBAL:(s + 1) * GLOBAL])
        loss.backward()
        grads = [p.grad.clone() for p in model.parameters()]
        opt.step()
        out.append((loss.item(), grads, [p.detach().clone() for p in model.parameters()]))
    return out


def train_on_rank(rank, world_size, name, kind, cap=1.0, overlap=True, micro=1):
    """One rank of data-parallel training; returns the same record as `reference`, per step."""
    torch.manual_seed(100 + rank)  # a different init on every rank: the broadcast must fix it
    model, (x, y), loss_fn = model_and_data(name)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * rank)
    if kind == "naive":
        broadcast_parameters(model)
        wrapped = model
    else:
        wrapped = BucketedDDP(model, bucket_cap_mb=cap, overlap=overlap)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    out = []
    for s in range(STEPS):
        xb = shard_batch(x[s * GLOBAL:(s + 1) * GLOBAL], rank, world_size)
        yb = shard_batch(y[s * GLOBAL:(s + 1) * GLOBAL], rank, world_size)
        opt.zero_grad()
        total = torch.zeros((), dtype=torch.float64)
        for m, (xm, ym) in enumerate(zip(xb.chunk(micro), yb.chunk(micro))):
            # Gradient accumulation: only the last micro-batch's backward synchronises.
            syncing = m == micro - 1 or kind == "naive"
            ctx = wrapped.no_sync() if not syncing else _nothing()
            with ctx:
                loss = loss_fn(wrapped(xm), ym) / micro
                loss.backward()
            total += loss.detach()
        if kind == "naive":
            average_gradients(model)
        dist.all_reduce(total)
        grads = [p.grad.clone() for p in model.parameters()]
        opt.step()
        out.append((total.item() / world_size, grads,
                    [p.detach().clone() for p in model.parameters()],
                    max_replica_difference(model)))
    timeline = wrapped.last_timeline() if kind == "bucketed" else None
    n_buckets = len(wrapped.buckets) if kind == "bucketed" else None
    return out, timeline, n_buckets


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def assert_equal_to_reference(results, expected):
    for rank, (steps, _, _) in enumerate(results):
        for s, ((loss, grads, params, spread), (e_loss, e_grads, e_params)) in \
                enumerate(zip(steps, expected)):
            where = f"rank {rank}, step {s}"
            assert loss == pytest.approx(e_loss, rel=1e-10), where
            for g, e in zip(grads, e_grads):
                torch.testing.assert_close(g, e, **TIGHT, msg=f"gradient, {where}")
            for p, e in zip(params, e_params):
                torch.testing.assert_close(p, e, **TIGHT, msg=f"parameter, {where}")
            assert spread == 0.0, f"replicas differ after {where}"


@pytest.mark.parametrize("world_size", [1, 2, 3, 4, 5, 6])
def test_naive_data_parallel_equals_one_process(world_size):
    results = distlab.run(train_on_rank, world_size, "mlp", "naive", timeout=120)
    assert_equal_to_reference(results, reference("mlp"))


@pytest.mark.parametrize("world_size", [1, 2, 3, 4, 5, 6])
def test_bucketed_ddp_equals_one_process(world_size):
    # 0.0002 MiB puts one or two tensors in each bucket; overlap off at one world size.
    results = distlab.run(train_on_rank, world_size, "mlp", "bucketed", cap=0.0002,
                          overlap=world_size != 3, timeout=120)
    assert_equal_to_reference(results, reference("mlp"))
    for _, timeline, n_buckets in results:
        assert n_buckets == 4
        buckets = timeline["buckets"]
        assert [b["index"] for b in buckets] == list(range(n_buckets))
        for b in buckets:
            assert 0 <= b["ready"] <= b["launched"] <= b["done"]
        launches = [b["launched"] for b in buckets]
        assert launches == sorted(launches)   # same order on every rank, or collectives mismatch
        # The first bucket holds the LAST layer: backward produces its gradient first.
        assert buckets[0]["names"][0] == "net.4.bias"
        assert len(timeline["grads"]) == sum(len(b["names"]) for b in buckets)


def test_bucketed_ddp_on_a_transformer_with_gradient_accumulation():
    results = distlab.run(train_on_rank, 2, "gpt", "bucketed", cap=0.01, micro=2, timeout=120)
    assert_equal_to_reference(results, reference("gpt"))
    assert results[0][2] > 2


def _bucket_layout(rank, world_size):
    model = mlp()
    sizes = {}
    for cap in (1e-9, 0.004, 100.0):
        ddp = BucketedDDP(models.make_mlp(sizes=(16, 32, 24, 4), seed=0).double(),
                          bucket_cap_mb=cap)
        sizes[cap] = [b.names for b in ddp.buckets]
    names = [n for n, _ in model.named_parameters()][::-1]
    return sizes, names


def test_bucket_size_sets_the_number_of_buckets():
    (sizes, names), = distlab.run(_bucket_layout, 1, timeout=120)
    assert sizes[1e-9] == [[n] for n in names]              # one tensor per bucket
    assert sizes[100.0] == [names]                          # everything in one bucket
    assert 1 < len(sizes[0.004]) < len(names)
    assert sum(sizes[0.004], []) == names                   # reverse order, nothing lost


class _MixedFrozenTied(nn.Module):
    """float64 layers, then a float32 one; a frozen layer; a weight shared by two layers."""

    def __init__(self):
        super().__init__()
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            self.a = nn.Linear(8, 8).double()
            self.frozen = nn.Linear(8, 8).double().requires_grad_(False)
            self.b = nn.Linear(8, 8).double()
            self.b.weight = self.a.weight        # tied: listed once, as a.weight
            self.out = nn.Linear(8, 3)           # float32

    def forward(self, x):
        h = torch.tanh(self.b(torch.tanh(self.frozen(torch.tanh(self.a(x))))))
        return self.out(h.float())


MIXED_NAMES = ["out.bias", "out.weight", "b.bias", "a.bias", "a.weight"]   # backward's order


def _mixed_step_records(model, x, y, wrapped=None):
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    out = []
    for _ in range(STEPS):
        opt.zero_grad()
        F.mse_loss((wrapped or model)(x), y).backward()
        out.append(({n: None if p.grad is None else p.grad.clone()
                     for n, p in model.named_parameters()},
                    {n: p.detach().clone() for n, p in model.named_parameters()}))
        opt.step()
    return out


def _mixed_on_rank(rank, world_size, cap):
    # Every rank gets the same shard, so its forward is bit for bit the one-process forward
    # and only the all-reduce can change a gradient: float64 gradients must keep float64 digits.
    x, y = models.regression_data(n=10, in_dim=8, out_dim=3, seed=4)
    model = _MixedFrozenTied()
    ddp = BucketedDDP(model, bucket_cap_mb=cap)
    layout = [(b.names, b.buffer.dtype, [p.dtype for p in b.params]) for b in ddp.buckets]
    return layout, _mixed_step_records(model, x.double(), y.float(), ddp)


@pytest.mark.parametrize("cap, buckets", [
    (100.0, [MIXED_NAMES[:2], MIXED_NAMES[2:]]),      # one bucket per dtype
    (1e-9, [[n] for n in MIXED_NAMES])])               # one tensor per bucket
def test_bucketed_ddp_buckets_by_dtype_skips_frozen_and_sends_tied_weights_once(cap, buckets):
    x, y = models.regression_data(n=10, in_dim=8, out_dim=3, seed=4)
    expected = _mixed_step_records(_MixedFrozenTied(), x.double(), y.float())
    for rank, (layout, steps) in enumerate(distlab.run(_mixed_on_rank, 3, cap, timeout=120)):
        assert [names for names, _, _ in layout] == buckets, f"rank {rank}"
        for names, buffer_dtype, dtypes in layout:
            assert set(dtypes) == {buffer_dtype}, f"rank {rank}: bucket {names} mixes dtypes"
        for s, ((grads, params), (e_grads, e_params)) in enumerate(zip(steps, expected)):
            where = f"rank {rank}, step {s}"
            assert grads["frozen.weight"] is None and grads["frozen.bias"] is None, where
            for name, e in e_grads.items():
                if e is None:
                    continue
                tol = TIGHT if e.dtype == torch.float64 else dict(rtol=1e-6, atol=1e-7)
                torch.testing.assert_close(grads[name], e, **tol, msg=f"{name} grad, {where}")
                torch.testing.assert_close(params[name], e_params[name], **tol,
                                           msg=f"{name}, {where}")


class _Branchy(nn.Module):
    def __init__(self):
        super().__init__()
        self.used = nn.Linear(4, 2)
        self.unused = nn.Linear(4, 2)

    def forward(self, x):
        return self.used(x)


def _unused_parameter(rank, world_size):
    torch.manual_seed(0)
    ddp = BucketedDDP(_Branchy(), bucket_cap_mb=1.0)
    ddp(torch.randn(3, 4)).sum().backward()


def test_unused_parameter_is_a_clear_error():
    with pytest.raises(distlab.RankFailed, match=r"parameter unused\.(weight|bias) got no gradient"):
        distlab.run(_unused_parameter, 2, timeout=120)


def _ours_and_torch(rank, world_size):
    from torch.nn.parallel import DistributedDataParallel
    x, y = mlp_data()
    losses = {}
    for kind in ("ours", "torch"):
        model = mlp()
        wrapped = BucketedDDP(model, bucket_cap_mb=0.002) if kind == "ours" \
            else DistributedDataParallel(model, bucket_cap_mb=0.002)
        opt = torch.optim.SGD(wrapped.parameters(), lr=0.1)
        for s in range(STEPS):
            opt.zero_grad()
            loss = F.mse_loss(wrapped(shard_batch(x[s * GLOBAL:(s + 1) * GLOBAL], rank, world_size)),
                              shard_batch(y[s * GLOBAL:(s + 1) * GLOBAL], rank, world_size))
            loss.backward()
            opt.step()
            losses.setdefault(kind, []).append(loss.item())
        losses[kind + "_params"] = [p.detach().clone() for p in model.parameters()]
    return losses


def test_bucketed_ddp_equals_torch_ddp():
    for r in distlab.run(_ours_and_torch, 3, timeout=120):
        assert r["ours"] == pytest.approx(r["torch"], rel=1e-12)
        for a, b in zip(r["ours_params"], r["torch_params"]):
            torch.testing.assert_close(a, b, **TIGHT)


def test_uneven_global_batch_is_refused():
    with pytest.raises(ValueError, match="does not split evenly over 4 ranks"):
        shard_batch(torch.zeros(10, 3), 0, 4)
    assert torch.equal(shard_batch(torch.arange(12), 2, 3), torch.tensor([8, 9, 10, 11]))


def test_bucket_cap_must_be_positive():
    with pytest.raises(distlab.RankFailed, match="bucket_cap_mb must be a positive") as e:
        distlab.run(lambda r, w: BucketedDDP(mlp(), bucket_cap_mb=0), 1, timeout=120)
    assert e.value.exc_type == "ValueError"


# ---- the workbook's checkers: they pass a right answer and name what is wrong in a wrong one ------

# ---- predict_step: the one-rank timeline replayed on N ranks ------------------------------------

class _FixedLink:
    """A link whose all-reduce takes `per_byte` seconds per byte whatever N (a hand-made model)."""

    def __init__(self, per_byte):
        self.per_byte = per_byte

    def seconds(self, op, nbytes, world_size):
        assert op == "all_reduce"
        return 0.0 if world_size == 1 else nbytes * self.per_byte


def test_predict_step_replays_the_buckets_by_hand():
    from distlab.data_parallel import predict_step
    # one rank: bucket 0 launched at 1 s, bucket 1 at 3 s; copying back starts at 3 s (the last
    # launch) and takes 0.5 s per bucket; the step was 5 s.
    timeline = {"buckets": [dict(nbytes=2, launched=1.0, done=1.0, copied=3.5),
                            dict(nbytes=4, launched=3.0, done=3.0, copied=4.0)]}
    # 1 s per byte: bucket 0 travels 1-3 s, bucket 1 3-7 s; copies: 3-3.5, then 7-7.5 s.
    assert predict_step(timeline, 5.0, 2, _FixedLink(1.0)) == pytest.approx(5.0 + 3.5)
    # fast enough to hide: nothing changes
    assert predict_step(timeline, 5.0, 2, _FixedLink(0.1)) == pytest.approx(5.0)


def _mlp_step(rank, world_size, overlap):
    # 2.1 M parameters against 16 samples: 8 MiB of gradients outlast backward on Ethernet
    model = models.make_mlp((512, 2048, 512), seed=0)
    ddp = BucketedDDP(model, bucket_cap_mb=1.0, overlap=overlap)
    x, y = models.regression_data(n=16, in_dim=512, out_dim=512, seed=rank)
    start = distlab.trace.now()
    F.mse_loss(ddp(x), y).backward()
    return ddp.last_timeline(), distlab.trace.now() - start


@pytest.mark.parametrize("overlap", [True, False])
def test_predict_step_equals_the_emulated_run(overlap):
    """The replay of one rank's emulated timeline is the emulated 2-rank step, across nodes
    (a100-ethernet: one GPU per node), where the all-reduces are long enough to matter."""
    from distlab import emulate
    from distlab.data_parallel import predict_step
    alone = distlab.run(_mlp_step, 1, overlap, emulate="a100-ethernet")[0]
    pair = distlab.run(_mlp_step, 2, overlap, emulate="a100-ethernet")
    link = emulate.PRESETS["a100-ethernet"].link_between(range(2))
    predicted = predict_step(*alone, 2, link)
    assert predicted > alone[1]                        # the all-reduces cost something here
    assert max(r[1] for r in pair) == pytest.approx(predicted, rel=1e-9)
