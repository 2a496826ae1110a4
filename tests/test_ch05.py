"""Checkers of workbook 05 judged as a learner would meet them: for each, a wrong structure, a
cheat (the course's own implementation, or torch's DDP) and a correct answer written differently
(an imported collective, ReduceOp.AVG), with the verdict asserted."""
import pytest
import torch
import torch.distributed as dist

from distlab.checks import CheckFailed, RankFailed, ch05


def _rejected(check, fn, *words, **kwargs):
    with pytest.raises((CheckFailed, RankFailed)) as info:
        check(fn, **kwargs)
    message = str(info.value)
    print(f"{getattr(fn, '__name__', fn)}: {message}")      # shown with pytest -s
    for w in words:
        assert w in message, message
    return message


# ---- exercise 1: average_gradients ---------------------------------------------------------------

def average_with_imported_avg(model):
    from torch.distributed import ReduceOp, all_reduce
    for p in model.parameters():
        all_reduce(p.grad, op=ReduceOp.AVG)


def average_summed(model):
    for p in model.parameters():
        dist.all_reduce(p.grad)


def average_slightly_off(model):
    for p in model.parameters():
        dist.all_reduce(p.grad)
        p.grad /= dist.get_world_size() + 1e-6


def average_by_the_course(model):
    from distlab.data_parallel import average_gradients
    average_gradients(model)


def test_average_gradients_accepts_imported_avg(capsys):
    ch05.check_average_gradients(average_with_imported_avg, world_sizes=(3,))
    assert "✅" in capsys.readouterr().out


def test_average_gradients_rejects_sum_tolerance_and_cheat():
    _rejected(ch05.check_average_gradients, average_summed, "SUM", world_sizes=(2,))
    # A checker with a loose tolerance would let a gradient 1e-6 off through.
    _rejected(ch05.check_average_gradients, average_slightly_off, "expected", world_sizes=(2,))
    _rejected(ch05.check_average_gradients, average_by_the_course, "the exercise is to",
              world_sizes=(2,))


# ---- exercise 2: bucketed hooks ------------------------------------------------------------------

def _hooks(buckets, on_full):
    pending = {}
    for k, bucket in enumerate(buckets):
        for p in bucket:
            def hook(p, k=k):
                left = pending.setdefault(k, {id(q) for q in buckets[k]})
                left.discard(id(p))
                if not left:
                    del pending[k]
                    on_full(k)
            p.register_post_accumulate_grad_hook(hook)


def buckets_imported_avg(model, buckets, world_size):
    """Correct, written differently: imported all_reduce, ReduceOp.AVG, no division."""
    from torch.distributed import ReduceOp, all_reduce
    flight = {}

    def send(k):
        flat = torch.cat([q.grad.reshape(-1) for q in buckets[k]])
        flight[k] = (flat, all_reduce(flat, op=ReduceOp.AVG, async_op=True))
    _hooks(buckets, send)
    return _make_finish(buckets, flight)


def _make_finish(buckets, flight):
    def finish():
        for k in sorted(flight):
            flat, work = flight.pop(k)
            work.wait()
            offset = 0
            for p in buckets[k]:
                p.grad.copy_(flat[offset:offset + p.numel()].view_as(p.grad))
                offset += p.numel()
    return finish


def buckets_one_in_flight(model, buckets, world_size):
    """Correct, written differently: one bucket in flight at a time, each waited for when the
    next one is full; it travelled while backward computed that next bucket's gradients."""
    flight = {}

    def send(k):
        if k - 1 in flight:
            flight[k - 1][1].wait()
        flat = torch.cat([q.grad.reshape(-1) for q in buckets[k]]) / world_size
        flight[k] = (flat, dist.all_reduce(flat, async_op=True))
    _hooks(buckets, send)
    return _make_finish(buckets, flight)


def buckets_at_the_end(model, buckets, world_size):
    """Wrong structure: every bucket sent only when finish() runs (zero overlap)."""
    def finish():
        for bucket in buckets:
            flat = torch.cat([q.grad.reshape(-1) for q in bucket]) / world_size
            dist.all_reduce(flat)
            offset = 0
            for p in bucket:
                p.grad.copy_(flat[offset:offset + p.numel()].view_as(p.grad))
                offset += p.numel()
    return finish


def buckets_one_late(model, buckets, world_size):
    """Wrong structure: bucket k launched only when bucket k+1 starts (the last at the end)."""
    flight, started = {}, set()

    def send(k):
        flat = torch.cat([q.grad.reshape(-1) for q in buckets[k]]) / world_size
        flight[k] = (flat, dist.all_reduce(flat, async_op=True))
    ready = []

    def on_full(k):
        ready.append(k)
    pending = {}
    for k, bucket in enumerate(buckets):
        for p in bucket:
            def hook(p, k=k):
                if k not in started:            # the first gradient of bucket k
                    started.add(k)
                    while ready:
                        send(ready.pop(0))
                left = pending.setdefault(k, {id(q) for q in buckets[k]})
                left.discard(id(p))
                if not left:
                    del pending[k]
                    ready.append(k)
            p.register_post_accumulate_grad_hook(hook)
    inner = _make_finish(buckets, flight)

    def finish():
        while ready:
            send(ready.pop(0))
        started.clear()
        inner()
    return finish


def buckets_per_tensor(model, buckets, world_size):
    """Wrong structure: one all_reduce per tensor instead of per bucket."""
    flight = []
    for p in model.parameters():
        def hook(p):
            p.grad /= world_size
            flight.append(dist.all_reduce(p.grad, async_op=True))
        p.register_post_accumulate_grad_hook(hook)

    def finish():
        while flight:
            flight.pop().wait()
    return finish


def buckets_slightly_off(model, buckets, world_size):
    """Right structure, gradients 1e-6 off: a loose tolerance would accept it."""
    flight = {}

    def send(k):
        flat = torch.cat([q.grad.reshape(-1) for q in buckets[k]]) / (world_size + 1e-6)
        flight[k] = (flat, dist.all_reduce(flat, async_op=True))
    _hooks(buckets, send)
    return _make_finish(buckets, flight)


def buckets_by_the_course(model, buckets, world_size):
    from distlab.data_parallel import BucketedDDP
    BucketedDDP(model, bucket_cap_mb=0.001)
    return lambda: None


def buckets_by_torch_ddp(model, buckets, world_size):
    from torch.nn.parallel import DistributedDataParallel
    inner, busy = model.forward, [False]
    wrapped = DistributedDataParallel(model)

    def forward(x):                     # the harness calls model(x): route it through DDP
        if busy[0]:
            return inner(x)             # DDP calling the module back
        busy[0] = True
        try:
            return wrapped(x)
        finally:
            busy[0] = False
    model.forward = forward
    return lambda: None


def test_bucketed_hooks_accepts_imported_collective_with_avg(capsys):
    ch05.check_bucketed_hooks(buckets_imported_avg, world_sizes=(2,))
    assert "✅" in capsys.readouterr().out


def test_bucketed_hooks_accepts_a_bucket_in_flight_waited_for_by_the_next_hook(capsys):
    # The plain trace sees backward's compute between the launch and the wait: in flight.
    ch05.check_bucketed_hooks(buckets_one_in_flight, world_sizes=(2,))
    assert "✅" in capsys.readouterr().out


@pytest.mark.parametrize("fn, words", [
    (buckets_at_the_end, ("after backward had finished", "nothing overlaps")),
    (buckets_one_late, ("first gradient of bucket 1", "only 0 bucket(s)")),
    (buckets_per_tensor, ("all_reduce calls", "one per bucket")),
    (buckets_slightly_off, ("expected",)),
    (buckets_by_the_course, ("BucketedDDP", "the exercise is to")),
    (buckets_by_torch_ddp, ("C++", "own hooks")),
])
def test_bucketed_hooks_rejects(fn, words):
    _rejected(ch05.check_bucketed_hooks, fn, *words, world_sizes=(2,))


# ---- exercise 3: DistributedSampler with set_epoch ------------------------------------------------

def epochs_with_sampler(dataset, epochs):
    from torch.utils.data import DataLoader
    from torch.utils.data.distributed import DistributedSampler
    sampler = DistributedSampler(dataset, shuffle=True, seed=0)
    loader = DataLoader(dataset, batch_size=4, sampler=sampler)
    out = []
    for epoch in range(epochs):
        sampler.set_epoch(epoch)
        out.append(torch.cat([b for (b,) in loader]))      # tensors, not lists: accepted
    return out


def epochs_by_hand(dataset, epochs):
    """Correct, written differently: one shared permutation per epoch, every N-th element."""
    rank, ws = dist.get_rank(), dist.get_world_size()
    return [torch.randperm(len(dataset), generator=torch.Generator().manual_seed(7 + e))
            [rank::ws].tolist() for e in range(epochs)]


def epochs_no_set_epoch(dataset, epochs):
    from torch.utils.data import DataLoader
    from torch.utils.data.distributed import DistributedSampler
    loader = DataLoader(dataset, batch_size=2, sampler=DistributedSampler(dataset, seed=0))
    return [[int(i) for (b,) in loader for i in b] for _ in range(epochs)]


def epochs_plain_loader(dataset, epochs):
    from torch.utils.data import DataLoader
    loader = DataLoader(dataset, batch_size=2, shuffle=True,
                        generator=torch.Generator().manual_seed(0))
    return [[int(i) for (b,) in loader for i in b] for _ in range(epochs)]


def epochs_seed_per_rank(dataset, epochs):
    from torch.utils.data import DataLoader
    from torch.utils.data.distributed import DistributedSampler
    sampler = DistributedSampler(dataset, seed=dist.get_rank())
    out = []
    for epoch in range(epochs):
        sampler.set_epoch(epoch)
        out.append([int(i) for (b,) in DataLoader(dataset, sampler=sampler) for i in b])
    return out


def epochs_by_the_checker(dataset, epochs):
    return ch05._reference_epochs(dataset, epochs)


@pytest.mark.parametrize("fn", [epochs_with_sampler, epochs_by_hand])
def test_epoch_indices_accepts(fn, capsys):
    ch05.check_epoch_indices(fn, world_sizes=(3,))
    assert "✅" in capsys.readouterr().out


@pytest.mark.parametrize("fn, words", [
    (epochs_no_set_epoch, ("epoch 1 repeats epoch 0", "set_epoch")),
    (epochs_plain_loader, ("read all 12 samples", "DistributedSampler")),
    (epochs_seed_per_rank, ("was read by ranks", "same seed")),
    (epochs_by_the_checker, ("_reference_epochs", "the exercise is to")),
])
def test_epoch_indices_rejects(fn, words):
    _rejected(ch05.check_epoch_indices, fn, *words, world_sizes=(3,))


# ---- exercise 4: global batch and learning rate ---------------------------------------------------

def _scaled_loop(model, x, y, per_rank, base_batch, base_lr, steps, lr_of, sync):
    import torch.nn.functional as F
    rank, ws = dist.get_rank(), dist.get_world_size()
    glob = per_rank * ws
    opt = torch.optim.SGD(model.parameters(), lr=lr_of(base_lr, glob, base_batch, ws))
    for s in range(steps):
        lo = s * glob + rank * per_rank
        opt.zero_grad()
        F.mse_loss(model(x[lo:lo + per_rank]), y[lo:lo + per_rank]).backward()
        sync(model, ws)
        opt.step()


def _linear(base_lr, glob, base_batch, ws):
    return base_lr * glob / base_batch


def _avg(model, ws):
    from torch.distributed import ReduceOp, all_reduce
    for p in model.parameters():
        all_reduce(p.grad, op=ReduceOp.AVG)


def scaled_correct(model, x, y, per_rank, base_batch, base_lr, steps):
    _scaled_loop(model, x, y, per_rank, base_batch, base_lr, steps, _linear, _avg)


def scaled_with_torch_ddp(model, x, y, per_rank, base_batch, base_lr, steps):
    """Correct, written differently: torch's DDP averages, strided slices instead of contiguous."""
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel
    rank, ws = dist.get_rank(), dist.get_world_size()
    glob = per_rank * ws
    ddp = DistributedDataParallel(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=base_lr * per_rank * ws / base_batch)
    for s in range(steps):
        xs, ys = x[s * glob:(s + 1) * glob][rank::ws], y[s * glob:(s + 1) * glob][rank::ws]
        opt.zero_grad()
        F.mse_loss(ddp(xs), ys).backward()
        opt.step()


def scaled_lr_unchanged(model, x, y, per_rank, base_batch, base_lr, steps):
    _scaled_loop(model, x, y, per_rank, base_batch, base_lr, steps,
                 lambda lr, glob, base, ws: lr, _avg)


def scaled_summed(model, x, y, per_rank, base_batch, base_lr, steps):
    """The sum of gradients with lr / N takes the same steps, but the gradient is N× too large
    (wrong with Adam, weight decay or clipping): caught on the gradient itself."""
    def sync(model, ws):
        for p in model.parameters():
            dist.all_reduce(p.grad)
    _scaled_loop(model, x, y, per_rank, base_batch, base_lr, steps,
                 lambda lr, glob, base, ws: _linear(lr, glob, base, ws) / ws, sync)


def scaled_whole_batch_everywhere(model, x, y, per_rank, base_batch, base_lr, steps):
    """Wrong structure: every rank computes the whole global batch, nothing is communicated."""
    import torch.nn.functional as F
    glob = per_rank * dist.get_world_size()
    opt = torch.optim.SGD(model.parameters(), lr=base_lr * glob / base_batch)
    for s in range(steps):
        opt.zero_grad()
        F.mse_loss(model(x[s * glob:(s + 1) * glob]), y[s * glob:(s + 1) * glob]).backward()
        opt.step()


def scaled_by_the_course(model, x, y, per_rank, base_batch, base_lr, steps):
    from distlab.data_parallel import average_gradients
    _scaled_loop(model, x, y, per_rank, base_batch, base_lr, steps, _linear,
                 lambda m, ws: average_gradients(m))


@pytest.mark.parametrize("fn", [scaled_correct, scaled_with_torch_ddp])
def test_scaled_training_accepts(fn, capsys):
    ch05.check_scaled_training(fn)
    assert "✅" in capsys.readouterr().out


@pytest.mark.parametrize("fn, words", [
    (scaled_lr_unchanged, ("used lr 0.05", "linear scaling gives lr 0.1")),
    (scaled_summed, ("SUM", "divide by the world size")),
    (scaled_whole_batch_everywhere, ("ran forward on 12 samples", "per_rank_batch=4")),
    (scaled_by_the_course, ("average_gradients", "the exercise is to")),
])
def test_scaled_training_rejects(fn, words):
    _rejected(ch05.check_scaled_training, fn, *words)


# ---- exercise 5: MyDDP with no_sync -----------------------------------------------------------------

import contextlib  # noqa: E402

import torch.nn as nn  # noqa: E402


class DDPPerParam(nn.Module):
    """Correct: broadcast, one synchronous all_reduce per parameter, a flag for no_sync."""
    sync_in_no_sync = False
    broadcast = True

    def __init__(self, module):
        super().__init__()
        self.module, self.sync = module, True
        if self.broadcast:
            for p in module.parameters():
                dist.broadcast(p.data, src=0)
        for p in module.parameters():
            p.register_post_accumulate_grad_hook(self._hook)

    def _hook(self, p):
        if self.sync or self.sync_in_no_sync:
            dist.all_reduce(p.grad)
            p.grad /= dist.get_world_size()

    def forward(self, *args):
        return self.module(*args)

    @contextlib.contextmanager
    def no_sync(self):
        self.sync = False
        try:
            yield
        finally:
            self.sync = True


class DDPOneBucket(nn.Module):
    """Correct, written differently: imported collectives, ReduceOp.AVG, one flat bucket sent from
    a callback queued at the end of backward."""
    def __init__(self, module):
        super().__init__()
        from torch.distributed import broadcast
        self.module, self.skip = module, False
        for p in module.parameters():
            broadcast(p.detach(), 0)
        self.queued = False
        for p in module.parameters():
            p.register_post_accumulate_grad_hook(self._hook)

    def _hook(self, p):
        if not self.skip and not self.queued:
            self.queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._sync)

    def _sync(self):
        from torch.distributed import ReduceOp, all_reduce
        self.queued = False
        params = list(self.module.parameters())
        flat = torch.cat([p.grad.reshape(-1) for p in params])
        all_reduce(flat, op=ReduceOp.AVG)
        for p, g in zip(params, flat.split([p.numel() for p in params])):
            p.grad.copy_(g.view_as(p))

    def forward(self, x):
        return self.module(x)

    @contextlib.contextmanager
    def no_sync(self):
        self.skip = True
        yield
        self.skip = False


class DDPSyncsAlways(DDPPerParam):
    sync_in_no_sync = True


class DDPNoBroadcast(DDPPerParam):
    broadcast = False


class DDPCourse(nn.Module):
    def __init__(self, module):
        super().__init__()
        from distlab.data_parallel import BucketedDDP
        self.inner = BucketedDDP(module)

    def forward(self, x):
        return self.inner(x)

    def no_sync(self):
        return self.inner.no_sync()


class DDPTorch(nn.Module):
    def __init__(self, module):
        super().__init__()
        from torch.nn.parallel import DistributedDataParallel
        self.inner = DistributedDataParallel(module)

    def forward(self, x):
        return self.inner(x)

    def no_sync(self):
        return self.inner.no_sync()


@pytest.mark.parametrize("cls", [DDPPerParam, DDPOneBucket])
def test_my_ddp_accepts(cls, capsys):
    ch05.check_my_ddp(cls, world_sizes=(3,))
    assert "✅" in capsys.readouterr().out


@pytest.mark.parametrize("cls, words", [
    (DDPSyncsAlways, ("inside no_sync()", "nothing is sent")),
    (DDPNoBroadcast, ("still differs from rank 0's", "broadcast rank 0's parameters")),
    (DDPCourse, ("BucketedDDP", "the exercise is to")),
    (DDPTorch, ("C++", "yourself")),
])
def test_my_ddp_rejects(cls, words):
    _rejected(ch05.check_my_ddp, cls, *words, world_sizes=(3,))


# ---- exercise 6: find and fix the bugs of a DDP script -------------------------------------------

import os  # noqa: E402

from torch.nn.parallel import DistributedDataParallel  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402
from torch.utils.data.distributed import DistributedSampler  # noqa: E402


def _script(model, dataset, epochs, path, sampler_rank="RANK", set_epoch=True, loss="global",
            prints_on="RANK", saves_on="RANK"):
    """The DDP script of workbook 05's last exercise, each bug switchable on its own."""
    world_size = int(os.environ["WORLD_SIZE"])
    ddp = DistributedDataParallel(model)
    sampler = DistributedSampler(dataset, num_replicas=world_size,
                                 rank=int(os.environ[sampler_rank]), seed=0)
    loader = DataLoader(dataset, batch_size=2, sampler=sampler)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    for epoch in range(epochs):
        if set_epoch:
            sampler.set_epoch(epoch)
        for x, y, mask in loader:
            opt.zero_grad()
            per_token = (ddp(x) - y).pow(2).sum(-1)[mask]
            if loss == "local mean":
                loss_value = per_token.mean()
            else:
                tokens = torch.tensor(float(len(per_token)), dtype=per_token.dtype)
                dist.all_reduce(tokens)
                loss_value = per_token.sum() / tokens * (world_size if loss == "global" else 1)
            loss_value.backward()
            opt.step()
        if int(os.environ[prints_on]) == 0:
            print(f"epoch {epoch} finished")
    if int(os.environ[saves_on]) == 0:
        torch.save(ddp.module.state_dict(), path)


def script_fixed(model, dataset, epochs, path):
    _script(model, dataset, epochs, path)


def script_by_hand(model, dataset, epochs, path):
    """Correct, written differently: no DDP (broadcast, then an all_reduce SUM of one flat
    gradient), the sampler takes rank and size from the group, batches of 4, tokens counted by
    an imported all_reduce, the rank asked of the group."""
    from torch.distributed import ReduceOp, all_reduce, broadcast
    for p in model.parameters():
        broadcast(p.detach(), 0)
    sampler = DistributedSampler(dataset, seed=0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for epoch in range(epochs):
        sampler.set_epoch(epoch)
        for x, y, mask in DataLoader(dataset, batch_size=4, sampler=sampler):
            opt.zero_grad()
            count = mask.sum().double()
            all_reduce(count, op=ReduceOp.SUM)
            ((model(x) - y).pow(2).sum(-1) * mask).sum().div(count).backward()
            flat = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
            all_reduce(flat)
            params = list(model.parameters())
            for p, g in zip(params, flat.split([p.numel() for p in params])):
                p.grad.copy_(g.view_as(p))
            opt.step()
    if dist.get_rank() == 0:
        print("done")
        torch.save(model.state_dict(), path)


def script_local_rank_sampler(model, dataset, epochs, path):
    _script(model, dataset, epochs, path, sampler_rank="LOCAL_RANK")


def script_no_set_epoch(model, dataset, epochs, path):
    _script(model, dataset, epochs, path, set_epoch=False)


def script_local_mean(model, dataset, epochs, path):
    _script(model, dataset, epochs, path, loss="local mean")


def script_global_count_without_world_size(model, dataset, epochs, path):
    _script(model, dataset, epochs, path, loss="global count, DDP's division kept")


def script_prints_on_local_rank_0(model, dataset, epochs, path):
    _script(model, dataset, epochs, path, prints_on="LOCAL_RANK")


def script_saves_on_local_rank_0(model, dataset, epochs, path):
    _script(model, dataset, epochs, path, saves_on="LOCAL_RANK")


def script_without_ddp(model, dataset, epochs, path):
    """Wrong structure: the sampler and the loss are right, but no gradient is ever reduced."""
    sampler = DistributedSampler(dataset, seed=0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for epoch in range(epochs):
        sampler.set_epoch(epoch)
        for x, y, mask in DataLoader(dataset, batch_size=2, sampler=sampler):
            opt.zero_grad()
            (model(x) - y).pow(2).sum(-1)[mask].mean().backward()
            opt.step()
    if dist.get_rank() == 0:
        torch.save(model.state_dict(), path)


def script_by_the_checker(model, dataset, epochs, path):
    """A cheat: the checker's single-process reference, copied into the weights."""
    ch05._token_reference([[list(range(16))]])


@pytest.mark.parametrize("fn", [script_fixed, script_by_hand])
def test_ddp_script_accepts(fn, capsys):
    ch05.check_ddp_script(fn)
    assert "✅" in capsys.readouterr().out


@pytest.mark.parametrize("fn, words", [
    (script_local_rank_sampler, ("ranks 0 and 2", "same sequences", "global rank (RANK)")),
    (script_no_set_epoch, ("epoch 1 repeats epoch 0", "set_epoch")),
    (script_local_mean, ("mean over its own tokens", "global token count")),
    (script_global_count_without_world_size, ("divided by 4", "multiply the loss")),
    (script_prints_on_local_rank_0, ("ranks 0 and 2 printed", "once per node")),
    (script_saves_on_local_rank_0, ("ranks 0 and 2 wrote the checkpoint", "once per node")),
    (script_without_ddp, ("all-reducing 0 bytes", "hold 464 bytes", "DistributedDataParallel")),
    (script_by_the_checker, ("_token_reference", "the exercise is to")),
])
def test_ddp_script_rejects(fn, words):
    _rejected(ch05.check_ddp_script, fn, *words)


# ---- chapter 05's performance lessons: every number its prose quotes, recomputed ----------------

def _chapter_text():
    import pathlib
    import nbformat
    path = pathlib.Path(__file__).resolve().parent.parent / "notebooks" / "05_data_parallel.ipynb"
    cells = nbformat.read(path, as_version=4).cells
    return " ".join("\n".join(c.source for c in cells if c.cell_type == "markdown").split())


DEEP = (256,) + (512,) * 8 + (256,)


def _mlp_step(rank, world_size, overlap=True):
    """The chapter's timeline_run: the deep MLP, 128 samples per rank, 2 MiB buckets."""
    import distlab
    from distlab import models
    from distlab.data_parallel import BucketedDDP
    import torch.nn.functional as F
    model = models.make_mlp(DEEP, seed=0)
    ddp = BucketedDDP(model, bucket_cap_mb=2.0, overlap=overlap)
    xb, yb = models.regression_data(n=128, in_dim=256, out_dim=256, seed=rank)
    start = distlab.trace.now()
    F.mse_loss(ddp(xb), yb).backward()
    return ddp.last_timeline(), distlab.trace.now() - start


def _straggler(rank, world_size, delay_s=1e-3, steps=2):
    import distlab
    from distlab import models
    from distlab.data_parallel import BucketedDDP
    import torch.nn.functional as F
    model = models.make_mlp(DEEP, seed=0)
    ddp = BucketedDDP(model, bucket_cap_mb=2.0)
    xb, yb = models.regression_data(n=128, in_dim=256, out_dim=256, seed=rank)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
    for _ in range(steps):
        if rank == 1:
            distlab.trace.compute(delay_s, name="slow data loading")
        opt.zero_grad()
        F.mse_loss(ddp(xb), yb).backward()
        opt.step()


def test_performance_numbers_the_prose_quotes():
    """Re-runs the chapter's emulated lessons (the multi-rank real-size steps through
    predict_step, which equals the emulated runs: tests/test_data_parallel.py) and checks each
    number of the cells on overlap, buckets, stragglers, speedup and accumulation."""
    import distlab
    from distlab import cost, emulate, models
    from distlab.data_parallel import GPT3_XL, gpt_step, predict_step
    text = _chapter_text()
    P = emulate.PRESETS
    # -- the MLP on a calibrated A100 node: launch-bound, overlap buys nothing -------------------
    device, intra = P["a100-node"].device, P["a100-node"].intra
    assert f"memory traffic at the measured {device.memory_bandwidth / 1e12:.1f} TB/s" in text
    assert f"at least {device.floor * 1e6:.0f} µs per op" in text
    assert f"on 8 A100s ({intra.bandwidth / 1e9:.0f} GB/s)" in text
    small = {n: P[preset].link_between(range(n)).seconds("all_reduce", 4, n) * 1e6
             for n, preset in ((2, "a100-node"), (8, "a100-node"), (64, "a100-cluster"))}
    assert f"(≈ {small[2]:.0f}-{small[8]:.0f} µs for a small one)" in text
    assert f"NCCL's is about {small[2]:.0f}-{small[8]:.0f} µs inside a node" in text
    assert f"is {small[8]:.0f} µs on 8 GPUs and {small[64]:.0f} µs on 64" in text
    mlp = models.make_mlp(DEEP)
    assert (f"(9 layers, {sum(p.numel() for p in mlp.parameters()) / 1e6:.1f} M parameters, "
            f"{sum(p.numel() for p in mlp.parameters()) * 4 / 2**20:.1f} MiB of fp32 gradients in "
            f"{len(list(mlp.parameters()))} tensors)") in text
    steps, timelines = {}, {}
    for preset in ("a100-node", "a100-node-datasheet"):
        for overlap in (True, False):
            ranks = distlab.run(_mlp_step, 2, overlap=overlap, emulate=preset)
            steps[preset, overlap] = max(r[1] for r in ranks)
            timelines[preset, overlap] = ranks[0][0]
            if (preset, overlap) == ("a100-node", True):
                # the construction broadcast, one per tensor, before the step
                casts = [e for e in ranks.trace.comm(0) if e["op"] == "broadcast"]
                took = casts[-1]["end"] - casts[0]["start"]
                assert f"({len(casts)} broadcasts, {took * 1e6:.0f} µs;" in text
    ratio = steps["a100-node", False] / steps["a100-node", True]
    assert f"Overlap off / on is **{ratio:.2f}**" in text and f"{ratio:.2f}" == "1.00"
    assert (f"at datasheet rates the same code shows off / on = "
            f"{steps['a100-node-datasheet', False] / steps['a100-node-datasheet', True]:.2f}"
            in text.replace("At datasheet", "at datasheet"))
    assert f"it runs at {device.gemm_efficiency(128, 512, 512, torch.float32):.0%}".replace(
        "%", " %") in text
    buckets = timelines["a100-node", True]["buckets"]
    transfers = [b["done"] - b["launched"] for b in buckets]
    assert f"together {sum(transfers) / steps['a100-node', True]:.0%}".replace("%", " %") in text
    # "each takes less time than the launch-bound copies that pack the next bucket": one copy per
    # tensor and one division, each at least the launch floor
    assert all(t < (len(b["names"]) + 1) * device.floor
               for t, b in zip(transfers[:-1], buckets[1:]))
    assert f"The {['one', 'two', 'three', 'four', 'five'][len(buckets) - 1]} all-reduces" in text
    # -- GPT-3 XL's blocks at real size -------------------------------------------------------
    with torch.device("meta"):
        full = models.TinyGPT(**GPT3_XL)
        blocks = models.TinyGPT(**dict(GPT3_XL, n_layers=2, vocab=64))
    assert f"has {sum(p.numel() for p in full.parameters()) / 1e9:.2f} B parameters" in text
    assert f"2 of its {GPT3_XL['n_layers']} blocks" in text
    assert f"the full model has {GPT3_XL['n_layers'] // 2} times as many" in text
    grad_mb = 2 * sum(p.numel() for p in blocks.parameters()) / 1e6
    alone = {overlap: distlab.run(gpt_step, 1, overlap=overlap, emulate="a100-node")[0]
             for overlap in (True, False)}
    two_nodes = P["a100-2x8"].link_between(range(16))
    one_node = P["a100-2x8"].link_between(range(8))
    s16 = {o: predict_step(*alone[o], 16, two_nodes) for o in (True, False)}
    s8 = {o: predict_step(*alone[o], 8, one_node) for o in (True, False)}
    all_reduce16 = two_nodes.seconds("all_reduce", grad_mb * 1e6, 16)
    assert (f"the {grad_mb:.0f} MB of gradients take about {all_reduce16 * 1e3:.0f} ms against a "
            f"{alone[False][0]['backward_end'] * 1e3:.0f} ms backward") in text
    assert s16[True] == pytest.approx(alone[True][1], rel=1e-12)       # "all of it is hidden"
    assert f"{s16[False] / s16[True] - 1:.0%} longer on two nodes".replace("%", " %") in text
    assert f"about {s8[False] / s8[True] - 1:.0%}".replace("%", " %") in text
    assert f"off is {s16[False] / s16[True] - 1:.0%} slower".replace("%", " %") in text
    # -- per tensor, buckets, one message: the whole gradient ----------------------------------
    tensors = [p.numel() * 2 for p in full.parameters()]
    extra = {}
    for n, preset in ((8, "a100-node"), (64, "a100-cluster")):
        link = P[preset].link_between(range(n))
        per_tensor = sum(cost.predict("ring_all_reduce", s, n, link) for s in tensors)
        one = cost.predict("ring_all_reduce", sum(tensors), n, link)
        extra[n] = per_tensor - one
        if n == 64:
            ab = sum(cost.predict("ring_all_reduce", s, n, link.alpha_beta()) for s in tensors)
            assert f"says {ab * 1e3:.0f} ms per tensor at 64 ranks" in text
            assert 8.5 < ab / per_tensor < 11.5, "about ten times too much"
    assert (f"costs {extra[8] * 1e3:.1f} ms more than one message on 8 GPUs, and "
            f"{extra[64] * 1e3:.1f} ms more on 64") in text
    # -- the bucket sweep (16 ranks, two nodes) -------------------------------------------------
    sweep = {cap: distlab.run(gpt_step, 1, bucket_cap_mb=cap, emulate="a100-node")[0]
             for cap in (0.001, 1000.0)}
    tiny = sweep[0.001][0]
    assert (f"the {len(tiny['grads'])} gradient tensors travel in {len(tiny['buckets'])} "
            f"buckets: the head's bias, {blocks.head.bias.numel() * 2} bytes in bf16") in text
    for cap, words in ((0.001, "the step is {:.0%} longer than at 25 MiB"),
                       (1000.0, "before backward ends: {:.0%} longer")):
        growth = predict_step(*sweep[cap], 16, two_nodes) / s16[True] - 1
        assert words.format(growth).replace("%", " %") in text
    # -- the straggler --------------------------------------------------------------------------
    slow = distlab.run(_straggler, 3, emulate="a100-node").trace
    waited = slow.totals(0)["waited"] - slow.totals(1)["waited"]
    assert f"blocked {waited * 1e6:,.0f} µs longer than rank 1" in text
    assert f"The other {(2e-3 - waited) / 2 * 1e6:.0f} µs per step is slack" in text
    spread = slow.totals(1)["end"] - min(slow.totals(r)["end"] for r in range(3))
    assert slow.totals(1)["end"] == max(slow.totals(r)["end"] for r in range(3))
    assert f"within {spread * 1e6:.0f} µs of each other" in text
    # -- speedup ---------------------------------------------------------------------------------
    def curve(device_preset, cluster, tokens, overlap):
        one = alone[overlap] if (device_preset, tokens) == ("a100-node", 2048) else \
            distlab.run(gpt_step, 1, tokens=tokens, overlap=overlap, emulate=device_preset)[0]
        cl = P[cluster]
        return one, {n: n * one[1] / predict_step(*one, n, cl.link_between(range(n)))
                     for n in (8, 16, 64, 128, 256)}
    _, a100_on = curve("a100-node", "a100-cluster", 2048, True)
    _, a100_off = curve("a100-node", "a100-cluster", 2048, False)
    h100, h100_on = curve("h100-node", "h100-cluster", 2048, True)
    h100_512, h100_small = curve("h100-node", "h100-cluster", 512, True)
    assert all(a100_on[n] == pytest.approx(n) and h100_on[n] == pytest.approx(n) for n in a100_on)
    assert (f"{a100_off[8]:.1f} at 8 GPUs, {a100_off[16]:.1f} at 16" in text
            and f"{a100_off[256]:.0f} at 256" in text)
    assert f"runs these blocks {alone[True][1] / h100[1]:.1f} times faster" in text
    h100_link = P["h100-cluster"].link_between(range(16))
    assert (f"only {all_reduce16 / h100_link.seconds('all_reduce', grad_mb * 1e6, 16):.1f} times "
            f"faster ({h100_link.bandwidth / 1e9:.0f} GB/s against the A100s' "
            f"{two_nodes.bandwidth / 1e9:.0f})") in text
    assert f"backward, {h100_512[0]['backward_end'] * 1e3:.1f} ms" in text
    assert h100_small[64] == pytest.approx(64) and h100_small[128] < 127
    assert f"({h100_small[256]:.0f} at 256)" in text
    assert (f"(2.1 ms across A100 nodes)" in text and f"{all_reduce16 * 1e3:.1f}" == "2.1"
            and f"backward ({alone[True][0]['backward_end'] * 1e3:.1f} ms)" in text)
    assert f"keep {two_nodes.bandwidth / 1e9:.0f} GB/s across A100 nodes" in text
    assert "(nccl-tests measured 192 GB/s on two DGX A100s)" in text   # bench/published.csv
    # -- Ethernet, and accumulation --------------------------------------------------------------
    ethernet = P["a100-ethernet"].link_between(range(2))
    eth = predict_step(*alone[True], 2, ethernet)
    assert 2 * alone[True][1] / eth < 1, "2 ranks process fewer tokens per second than one"
    eth_all_reduce = ethernet.seconds("all_reduce", grad_mb * 1e6, 2)
    assert f"takes about {round(eth_all_reduce * 1e3, -1):.0f} ms on Ethernet" in text
    assert round(eth_all_reduce / alone[False][0]["backward_end"]) == 4, "four times the backward"
    # what the comparisons validate
    assert "share formulas" in text and "critical path" in text
    assert "(measured)" not in text and "the shape is the same" not in text
