"""ZeRO-1/2/3 from scratch equal single-process Adam training, and hold 1/N of the sharded state."""
import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import distlab
from distlab import models
from distlab.sharding import ZeRO, chunk_bounds

SIZES = (5, 12, 7, 3)  # parameter sizes that do not divide by 2, 3, 4, 5 or 6
STEPS, BATCH, LR = 4, 60, 0.05   # BATCH divides by 1 to 6


def reference():
    torch.set_default_dtype(torch.float64)
    try:
        model = models.make_mlp(SIZES, seed=1)
        x, y = models.regression_data(n=64, in_dim=SIZES[0], out_dim=SIZES[-1], seed=2)
        losses = models.train_reference(model, models.batches_of(x, y, BATCH, STEPS),
                                        optimizer="adam", lr=LR)
        return losses, [p.detach().clone() for p in model.parameters()]
    finally:
        torch.set_default_dtype(torch.float32)


def train_zero(rank, world_size, stages=(1, 2, 3)):
    """{stage: (losses, full parameters, state bytes, bytes sent)} of each stage, one after another."""
    torch.set_default_dtype(torch.float64)
    out = {}
    for stage in stages:
        model = models.make_mlp(SIZES, seed=1)
        x, y = models.regression_data(n=64, in_dim=SIZES[0], out_dim=SIZES[-1], seed=2)
        zero = ZeRO(model, stage, optimizer="adam", lr=LR)
        losses = []
        for gx, gy in models.batches_of(x, y, BATCH, STEPS):
            lx, ly = gx.chunk(world_size)[rank], gy.chunk(world_size)[rank]
            zero.zero_grad()
            loss = F.mse_loss(model(lx), ly)
            loss.backward()
            zero.step()
            # The global loss is the mean of the ranks' losses (equal local batch sizes).
            t = loss.detach().clone()
            dist.all_reduce(t)
            losses.append(t.item() / world_size)
        out[stage] = losses, zero.full_parameters(), zero.state_bytes(), dict(zero.sent)
    return out


def assert_equals_single_process_adam(by_rank):
    ref_losses, ref_params = reference()
    for rank, stages in enumerate(by_rank):
        for stage, (losses, params, _, _) in stages.items():
            where = f"stage {stage}, rank {rank}"
            assert losses == pytest.approx(ref_losses, rel=1e-10, abs=1e-12), where
            for got, want in zip(params, ref_params):
                torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12, msg=where)


@pytest.mark.parametrize("world_size", [1, 2, 3, 5, 6])     # 4: in the next test
def test_zero_equals_single_process_adam(world_size):
    assert_equals_single_process_adam(distlab.run(train_zero, world_size, timeout=120))


def test_each_stage_shards_what_it_promises_and_sends_what_the_model_says():
    shapes = [n for a, b in zip(SIZES[:-1], SIZES[1:]) for n in (a * b, b)]
    full = sum(shapes) * 8  # float64
    slices = sum(-(-n // 4) for n in shapes) * 8  # one padded slice of every parameter
    by_rank = distlab.run(train_zero, 4, timeout=120)
    assert_equals_single_process_adam(by_rank)
    for stage in (1, 2, 3):
        results = [r[stage] for r in by_rank]
        # Per step: reduce-scatter + all-gather (stages 1-2); one more all-gather (stage 3).
        for rank in range(4):
            sent = results[rank][3]
            assert sent["reduce_scatter"] == STEPS * 3 * slices
            assert sent["all_gather"] == STEPS * 3 * slices * (2 if stage == 3 else 1)
        total = {k: sum(r[2][k] for r in results) for k in ("weights", "grads", "optimizer")}
        # Adam: two moments per element, split over the ranks (plus 0-dim step counters).
        assert total["optimizer"] == 2 * full
        if stage == 1:
            assert total["grads"] == 4 * full           # every rank keeps full gradients
        else:
            assert total["grads"] == full               # one slice per rank
        if stage == 3:
            assert total["weights"] == full             # one slice per rank, full weights freed
        else:
            assert total["weights"] == 4 * full         # replicated (shards are views of them)


def test_chunk_bounds_cover_every_element_once():
    for numel in (1, 3, 7, 64):
        for ws in (1, 2, 3, 4, 5):
            covered = []
            for r in range(ws):
                lo, hi = chunk_bounds(numel, ws, r)
                covered += range(lo, hi)
            assert covered == list(range(numel))


def test_bad_stage_is_refused():
    with pytest.raises(ValueError, match="stage must be 1, 2 or 3"):
        ZeRO(models.make_mlp(), 4)


@pytest.mark.parametrize("kwargs, error, message", [
    (dict(optimizer="lamb"), ValueError, "optimizer must be one of ['adam', 'sgd'], or a class "
     "given as optimizer_class= (e.g. torch.optim.AdamW); got 'lamb'."),
    (dict(optimizer="adam", optimizer_class=torch.optim.AdamW), ValueError,
     "give the optimizer either by name (optimizer='adam') or by class "
     "(optimizer_class=torch.optim.AdamW), not both."),
    (dict(optimizer_class=torch.optim.AdamW([torch.zeros(1, requires_grad=True)])), TypeError,
     "optimizer_class must be a torch.optim.Optimizer class such as torch.optim.AdamW (the class, "
     "not an instance); got AdamW ("),
    (dict(optimizer_class=torch.optim.LBFGS), ValueError,
     "LBFGS looks at whole tensors, but ZeRO gives each rank flat slices of them; use an "
     "optimizer that updates every element on its own, such as SGD, Adam or AdamW."),
])
def test_a_wrong_optimizer_is_one_sentence_before_any_message(kwargs, error, message):
    with pytest.raises(error) as e:
        ZeRO(models.make_mlp(), 1, **kwargs)        # no process group needed to refuse
    assert str(e.value).startswith(message)


@pytest.mark.parametrize("name, value", [
    ("compute_dtype", "bf16"), ("compute_dtype", torch.int64), ("compute_dtype", 16),
    ("reduce_dtype", "float32"), ("reduce_dtype", torch.int32), ("compute_dtype", torch.bool)])
def test_a_wrong_compute_or_reduce_dtype_is_one_sentence_before_any_message(name, value):
    with pytest.raises(ValueError) as e:
        ZeRO(models.make_mlp(), 2, **{name: value})      # no process group needed to refuse
    assert str(e.value) == (f"{name} must be None (the model's own dtype) or one of "
                            f"torch.float16, torch.bfloat16, torch.float32, torch.float64; "
                            f"got {value!r}.")


# ---- any torch.optim class, with frozen, tied and unused parameters --------------------------------

class TiedFrozenUnused(nn.Module):
    """A frozen layer, a weight shared by two layers, a layer that never runs (no gradient)."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(5, 7)
        self.frozen = nn.Linear(7, 7).requires_grad_(False)
        self.a, self.b = nn.Linear(7, 7), nn.Linear(7, 7)
        self.b.weight = self.a.weight
        self.unused = nn.Linear(7, 7)
        self.head = nn.Linear(7, 3)

    def forward(self, x):
        h = torch.tanh(self.frozen(torch.tanh(self.inp(x))))
        return self.head(torch.tanh(self.b(torch.tanh(self.a(h)))))


ADAMW = dict(lr=0.05, weight_decay=0.1, betas=(0.8, 0.95), eps=1e-6)


def _tied_model():
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(3)
        return TiedFrozenUnused().double()


def _tied_batches():
    x, y = models.regression_data(n=60, in_dim=5, out_dim=3, seed=4)
    return models.batches_of(x.double(), y.double(), 30, STEPS)


def _adamw_reference():
    model = _tied_model()
    opt = torch.optim.AdamW(model.parameters(), **ADAMW)
    for x, y in _tied_batches():
        opt.zero_grad()
        F.mse_loss(model(x), y).backward()
        opt.step()
    return {n: p.detach() for n, p in model.named_parameters()}


def _adamw_zero(rank, world_size):
    out = {}
    for stage in (1, 2, 3):
        model = _tied_model()
        zero = ZeRO(model, stage, optimizer_class=torch.optim.AdamW, **ADAMW)
        assert type(zero.optimizer) is torch.optim.AdamW
        assert zero.optimizer.defaults["weight_decay"] == 0.1
        assert zero.optimizer.defaults["betas"] == (0.8, 0.95)
        for x, y in _tied_batches():
            zero.zero_grad()
            F.mse_loss(model(x.chunk(world_size)[rank]), y.chunk(world_size)[rank]).backward()
            zero.step()
        trainable = [n for n, p in model.named_parameters() if p.requires_grad]
        full = dict(zip(trainable, zero.full_parameters()))
        full.update((n, p.detach().clone()) for n, p in model.named_parameters()
                    if not p.requires_grad)
        out[stage] = full
    return out


def _adam_by_name(rank, world_size):
    model = _tied_model()
    zero = ZeRO(model, 1, optimizer="adam", lr=LR)
    x, y = _tied_batches()[0]
    F.mse_loss(model(x.chunk(world_size)[rank]), y.chunk(world_size)[rank]).backward()
    zero.step()
    return {n: p.detach() for n, p in model.named_parameters()}


def test_stage_1_skips_a_parameter_without_gradient():
    model = _tied_model()
    opt = torch.optim.Adam(model.parameters(), lr=LR)
    x, y = _tied_batches()[0]
    F.mse_loss(model(x), y).backward()
    opt.step()
    for params in distlab.run(_adam_by_name, 3, timeout=120):
        for name, p in model.named_parameters():
            torch.testing.assert_close(params[name], p.detach(), rtol=1e-12, atol=1e-13, msg=name)


@pytest.mark.parametrize("world_size", [1, 3, 5])
def test_zero_with_adamw_equals_single_process_adamw(world_size):
    expected = _adamw_reference()
    # named_parameters lists the tied weight once (as a.weight): no "b.weight" anywhere.
    assert "b.weight" not in expected and "frozen.weight" in expected
    for rank, stages in enumerate(distlab.run(_adamw_zero, world_size, timeout=120)):
        for stage, params in stages.items():
            assert set(params) == set(expected), f"stage {stage}"
            for name, want in expected.items():
                torch.testing.assert_close(params[name], want, rtol=1e-12, atol=1e-13,
                                           msg=f"{name}, stage {stage}, rank {rank}")
    initial = _tied_model()
    # The unused layer kept its weights (no gradient, no weight decay), as on one process.
    assert torch.equal(expected["unused.weight"], initial.unused.weight)
    assert not torch.equal(expected["a.weight"], initial.a.weight)


def train_fsdp2(rank, world_size):
    from torch.distributed.fsdp import fully_shard
    torch.set_default_dtype(torch.float64)
    model = models.make_mlp(SIZES, seed=1)
    for layer in model.net:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer)
    fully_shard(model)
    opt = torch.optim.Adam(model.parameters(), lr=LR)
    x, y = models.regression_data(n=64, in_dim=SIZES[0], out_dim=SIZES[-1], seed=2)
    for gx, gy in models.batches_of(x, y, BATCH, STEPS):
        opt.zero_grad()
        F.mse_loss(model(gx.chunk(world_size)[rank]), gy.chunk(world_size)[rank]).backward()
        opt.step()
    return [p.full_tensor() for p in model.parameters()]


@pytest.mark.parametrize("world_size", [2, 3])
def test_fsdp2_averages_gradients_on_gloo(world_size):
    # Some torch versions summed FSDP gradients on gloo; summed gradients would not match here.
    _, ref_params = reference()
    for params in distlab.run(train_fsdp2, world_size, timeout=120):
        for got, want in zip(params, ref_params):
            torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)


# ---- ZeRO-3 prefetch when layers run in another order than they are defined ------------------------

class OutOfOrder(nn.Module):
    """Layers defined in another order than forward runs them, and a parameter on the root module
    (a gate): prefetch follows the definition order, so it gathers layers that already ran."""

    def __init__(self):
        super().__init__()
        self.head = nn.Linear(7, 3)          # defined first, runs last
        self.mid = nn.Linear(7, 7)
        self.inp = nn.Linear(5, 7)           # defined last, runs first
        self.gate = nn.Parameter(torch.linspace(0.5, 1.5, 7))

    def forward(self, x):
        h = torch.tanh(self.inp(x)) * self.gate
        return self.head(torch.tanh(self.mid(h)))


def _out_of_order_model():
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(5)
        return OutOfOrder().double()


def _out_of_order_reference():
    model = _out_of_order_model()
    opt = torch.optim.Adam(model.parameters(), lr=LR)
    for x, y in _tied_batches():
        opt.zero_grad()
        F.mse_loss(model(x), y).backward()
        opt.step()
    return [p.detach() for p in model.parameters()]


def _out_of_order_zero3(rank, world_size):
    model = _out_of_order_model()
    zero = ZeRO(model, 3, optimizer="adam", lr=LR, prefetch=True)
    for x, y in _tied_batches():
        zero.zero_grad()
        F.mse_loss(model(x.chunk(world_size)[rank]), y.chunk(world_size)[rank]).backward()
        zero.step()
    return zero.full_parameters()


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_zero3_prefetch_out_of_order_and_root_parameter_equals_single_process(world_size):
    expected = _out_of_order_reference()
    for rank, params in enumerate(distlab.run(_out_of_order_zero3, world_size, timeout=60)):
        for i, (got, want) in enumerate(zip(params, expected)):
            torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-13,
                                       msg=f"parameter {i}, rank {rank}")
