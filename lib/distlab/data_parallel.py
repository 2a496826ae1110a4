"""Data parallelism from scratch: every rank holds the whole model and a shard of the batch.

Two implementations, the second an optimisation of the first:

- naive:     `broadcast_parameters` once, so every replica starts identical; then, after each
             backward, `average_gradients` all-reduces every gradient, one collective per tensor,
             and divides by the world size. The replicas then take the same optimizer step.
- bucketed:  `BucketedDDP` wraps the model. Autograd hooks see each gradient the moment it is
             accumulated; gradients are packed into buckets of about `bucket_cap_mb`, and a full
             bucket is all-reduced asynchronously while backward goes on computing the gradients
             of earlier layers. That overlap, and paying the per-message latency once per bucket
             instead of once per tensor, is what torch's DistributedDataParallel does.

Both equal single-process training on the global batch, because the mean of the ranks' mean
losses over equal shards IS the mean loss over the whole batch, and gradients are linear.

For the performance lessons: `gpt_step` runs a step of GPT-3 XL's blocks at real size on the
meta device (under emulation), and `predict_step` replays a one-rank BucketedDDP timeline with
each bucket's all-reduce on N ranks' link: the step the code's critical path gives.
"""
import contextlib
import numbers

import torch
import torch.distributed as dist
import torch.nn as nn

from .trace import completed_at, now


def shard_batch(x, rank, world_size):
    """Rank `rank`'s contiguous slice of a global batch; the batch must divide evenly."""
    _check_rank_of(rank, world_size)
    if len(x) % world_size:
        raise ValueError(
            f"a global batch of {len(x)} samples does not split evenly over {world_size} ranks; "
            f"averaging gradients over unequal shards would weight some samples more than others.")
    per_rank = len(x) // world_size
    return x[rank * per_rank:(rank + 1) * per_rank]


def _check_rank_of(rank, world_size):
    """A slice for a rank that does not exist would be empty, or another rank's: refuse it."""
    for name, value in (("world_size", world_size), ("rank", rank)):
        if isinstance(value, bool) or not isinstance(value, numbers.Integral):
            raise TypeError(f"{name} must be a whole number; got {value!r}.")
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"rank must be one of 0..world_size-1 with world_size >= 1; got rank "
                         f"{rank} of world_size {world_size}.")


def _check_module(model, what):
    if not isinstance(model, nn.Module):
        raise TypeError(f"{what} takes the model, a torch.nn.Module; got a "
                        f"{type(model).__name__}.")


def _check_src(src, group):
    n = dist.get_world_size(group)
    if isinstance(src, bool) or not isinstance(src, numbers.Integral) or not 0 <= src < n:
        raise ValueError(f"src must be a rank of the group, 0 to {n - 1}; got {src!r}.")


# ---- naive data parallel ---------------------------------------------------------------------------

def broadcast_parameters(model, src=0, group=None):
    """Copy rank `src`'s parameters and buffers to every rank (replicas must start identical)."""
    _check_module(model, "broadcast_parameters")
    _check_src(src, group)
    with torch.no_grad():
        for tensor in list(model.parameters()) + list(model.buffers()):
            dist.broadcast(tensor, src=src, group=group)


def average_gradients(model, group=None):
    """After backward: replace every gradient by its mean over the ranks, one all_reduce each."""
    _check_module(model, "average_gradients")
    world_size = dist.get_world_size(group)
    for p in model.parameters():
        if p.grad is not None:
            dist.all_reduce(p.grad, group=group)   # sums in place
            p.grad.div_(world_size)                 # sum of means -> mean of means


def max_replica_difference(model, group=None):
    """The largest |difference| between this rank's parameters and rank 0's (0.0: in sync)."""
    _check_module(model, "max_replica_difference")
    if not any(True for _ in model.parameters()):
        raise ValueError("max_replica_difference compares parameters, and this model has none; "
                         "pass the model whose replicas should agree.")
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    reference = flat.clone()
    dist.broadcast(reference, src=dist.get_global_rank(group, 0) if group else 0, group=group)
    worst = (flat - reference).abs().max().reshape(1)
    dist.all_reduce(worst, op=dist.ReduceOp.MAX, group=group)
    return worst.item()


# ---- bucketed data parallel with overlap -----------------------------------------------------------

class Bucket:
    """Parameters whose gradients travel in one all_reduce, and when that happened."""

    def __init__(self, index, params, names):
        self.index, self.params, self.names = index, params, names
        self.numel = sum(p.numel() for p in params)
        self.buffer = torch.zeros(self.numel, dtype=params[0].dtype, device=params[0].device)
        self.pending = set()
        self.work = None
        self.ready_at = self.launched_at = self.done_at = self.copied_at = None

    def reset(self):
        self.pending = {id(p) for p in self.params}
        self.work = None
        self.ready_at = self.launched_at = self.done_at = self.copied_at = None

    def nbytes(self):
        return self.numel * self.buffer.element_size()


class BucketedDDP(nn.Module):
    """Wrap `module` so that `loss.backward()` also averages its gradients over the ranks.

    bucket_cap_mb: gradients are packed, in reverse order of the parameters (the order backward
                   produces them), into buckets of at least this many MiB (the last one smaller),
                   one dtype and device per bucket; frozen parameters are left out.
    overlap:       True launches each bucket's all_reduce as soon as it is full, while backward
                   still runs; False waits for the end of backward and then sends every bucket
                   (the same messages, no overlap), to measure what overlap buys.
    After each backward, `last_timeline()` says when backward started, when each gradient was
    ready, and when each bucket's all_reduce was launched and finished: seconds on the rank's
    clock (`distlab.trace.now()`, modeled under emulation).
    """

    def __init__(self, module, bucket_cap_mb=25.0, overlap=True, group=None, broadcast=True):
        super().__init__()
        _check_module(module, "BucketedDDP")
        if isinstance(bucket_cap_mb, bool) or not isinstance(bucket_cap_mb, (int, float)) \
                or not bucket_cap_mb > 0:
            raise ValueError(f"bucket_cap_mb must be a positive number of MiB; got {bucket_cap_mb!r}.")
        self.module, self.overlap, self.group = module, overlap, group
        self.world_size = dist.get_world_size(group)
        if broadcast:
            broadcast_parameters(module, group=group)
        self.buckets = self._make_buckets(bucket_cap_mb * 2 ** 20)
        self._bucket_of = {id(p): b for b in self.buckets for p in b.params}
        self._name_of = {id(p): n for b in self.buckets for p, n in zip(b.params, b.names)}
        self._sync = True
        self._in_backward = False
        self._next = 0
        self._backward_started = None
        self._grad_times = []
        for b in self.buckets:
            for p in b.params:
                p.register_post_accumulate_grad_hook(self._grad_ready)

    def _make_buckets(self, cap_bytes):
        # Frozen parameters get no gradient, and named_parameters lists a tied (shared) parameter
        # once: its gradient, summed over every use, is sent once.
        named = [(n, p) for n, p in self.module.named_parameters() if p.requires_grad][::-1]
        # One buffer holds one dtype on one device (a float64 gradient in a float32 buffer would
        # lose digits), so, as in torch's DDP, each (dtype, device) fills buckets of its own.
        full, filling, size = [], {}, {}
        for name, p in named:
            key = (p.dtype, p.device)
            filling.setdefault(key, []).append((name, p))
            size[key] = size.get(key, 0) + p.numel() * p.element_size()
            if size[key] >= cap_bytes:
                full.append(filling.pop(key))
                size[key] = 0
        full += filling.values()
        # Numbered in the order backward starts filling them: the order they are launched in.
        position = {id(p): i for i, (_, p) in enumerate(named)}
        full.sort(key=lambda members: position[id(members[0][1])])
        return [Bucket(i, [p for _, p in members], [n for n, _ in members])
                for i, members in enumerate(full)]

    def forward(self, *args, **kwargs):
        out = self.module(*args, **kwargs)
        if self._sync and torch.is_grad_enabled() and isinstance(out, torch.Tensor) \
                and out.requires_grad:
            # The gradient reaching the output is the first event of this module's backward.
            out.register_hook(self._backward_begins)
        return out

    @contextlib.contextmanager
    def no_sync(self):
        """Accumulate gradients locally (gradient accumulation); the next synced backward sends
        the accumulated sum."""
        self._sync = False
        try:
            yield
        finally:
            self._sync = True

    def _backward_begins(self, grad):
        self._backward_started = now()
        self._start_round()
        return grad

    def _start_round(self):
        self._in_backward = True
        self._next = 0
        self._grad_times = []
        for b in self.buckets:
            b.reset()
        # Runs once autograd has finished the whole backward pass: wait for the last buckets.
        torch.autograd.Variable._execution_engine.queue_callback(self._finish)

    def _grad_ready(self, param):
        if not self._sync:
            return
        if not self._in_backward:       # the output hook did not fire (e.g. a tuple output)
            self._backward_started = now()
            self._start_round()
        t = now()
        bucket = self._bucket_of[id(param)]
        bucket.pending.discard(id(param))
        self._grad_times.append((self._name_of[id(param)], t))
        if not bucket.pending:
            bucket.ready_at = t
            if self.overlap:
                self._launch_ready_buckets()

    def _launch_ready_buckets(self):
        # Every rank must issue the same collectives in the same order, so buckets go strictly
        # by index: a full bucket waits for the ones before it.
        while self._next < len(self.buckets) and not self.buckets[self._next].pending:
            self._launch(self.buckets[self._next])
            self._next += 1

    def _launch(self, bucket):
        offset = 0
        for p in bucket.params:
            n = p.numel()
            bucket.buffer[offset:offset + n].copy_(p.grad.reshape(-1))
            offset += n
        bucket.buffer.div_(self.world_size)    # pre-divide: the sum of the shares is the mean
        bucket.launched_at = now()
        bucket.work = dist.all_reduce(bucket.buffer, group=self.group, async_op=True)

        if completed_at(bucket.work) is None:       # not traced: time it when it completes
            def record_done(future, bucket=bucket):
                bucket.done_at = now()
                return future.value()
            bucket.work.get_future().then(record_done)

    def _finish(self):
        self._in_backward = False
        missing = [n for b in self.buckets for p, n in zip(b.params, b.names) if id(p) in b.pending]
        if missing:
            raise RuntimeError(
                f"BucketedDDP: parameter {missing[0]} got no gradient in this backward, so its "
                f"bucket can never be sent; torch's DDP handles this with "
                f"find_unused_parameters=True.")
        self._launch_ready_buckets()
        for b in self.buckets:
            b.work.wait()
            if b.done_at is None:         # traced, or the future's callback runs a moment later
                b.done_at = completed_at(b.work) or now()
            offset = 0
            for p in b.params:
                n = p.numel()
                p.grad.copy_(b.buffer[offset:offset + n].view_as(p.grad))
                offset += n
            b.copied_at = now()

    def last_timeline(self):
        """What the last synced backward did, in seconds since it started: when each gradient
        was ready; for each bucket when it was full (`ready`), sent (`launched`), averaged
        (`done`) and copied back into p.grad (`copied`)."""
        t0 = self._backward_started
        return {
            "grads": [(name, t - t0) for name, t in self._grad_times],
            "buckets": [dict(index=b.index, names=list(b.names), nbytes=b.nbytes(),
                             ready=b.ready_at - t0, launched=b.launched_at - t0,
                             done=b.done_at - t0, copied=b.copied_at - t0)
                        for b in self.buckets],
            "backward_end": max(t for _, t in self._grad_times) - t0,
        }


# ---- the step on N ranks, predicted from a run on one --------------------------------------------

def predict_step(timeline, step, world_size, link):
    """Seconds of a BucketedDDP step on `world_size` ranks, predicted from one rank's run.

    `timeline` (BucketedDDP.last_timeline()) and `step` come from a run on ONE rank, where an
    all-reduce costs nothing: they say when each bucket was launched (overlap on: during
    backward, as soon as it was full and packed; off: after backward) and how long copying its
    averaged values back into p.grad took. On N ranks each bucket's all-reduce takes
    `link.seconds("all_reduce", bytes, N)`, one bucket at a time on the link, in launch order
    (every rank issues them in the same order), and a bucket is copied back once it has
    arrived and the bucket before it is copied:

        end_i    = max(launched_i, end_{i-1}) + all_reduce_i(N)
        copied_i = max(end_i, copied_{i-1}) + (its copy-back time on one rank)

    (copying back begins once the last bucket is launched).

    The step grows by how much later the last copy ends than on one rank. It charges the
    emulator's own link formulas: agreement with an emulated run checks that the code's
    critical path (hook order, bucket launch order, what waits for what) is this one; it says
    nothing about hardware."""
    # Copying back starts once backward has ended and the last bucket is launched.
    copying = max(bucket["launched"] for bucket in timeline["buckets"])
    end, copied, copied_alone = 0.0, copying, copying
    for bucket in timeline["buckets"]:
        copy_back = bucket["copied"] - max(bucket["done"], copied_alone)
        copied_alone = bucket["copied"]
        end = max(bucket["launched"], end) + link.seconds("all_reduce", bucket["nbytes"],
                                                           world_size)
        copied = max(end, copied) + copy_back
    return step + max(0.0, copied - copied_alone)


def jitter_efficiency(world_size, spread):
    """Scaling efficiency of a step whose N ranks each take (1 + spread·z) of the time, z drawn
    independently from a standard normal, when every step waits for the slowest rank (§1 of
    chapter 05b): 1 / (1 + spread · E[max of N normals]). An illustration of why the maximum of
    many noisy step times grows with N; `spread` is an assumption, not a measurement.

    E[max] = ∫ x · N·φ(x)·Φ(x)^(N−1) dx, integrated on a fine grid (no sampling: every machine
    prints the same)."""
    n = int(world_size)
    if n < 1 or not 0 <= spread < 1:
        raise ValueError(f"jitter_efficiency needs world_size >= 1 and 0 <= spread < 1, got "
                         f"{world_size} and {spread}")
    x = torch.linspace(-8, 8, 16001, dtype=torch.float64)
    phi = torch.exp(-x * x / 2) / (2 * torch.pi) ** 0.5
    cdf = 0.5 * (1 + torch.erf(x / 2 ** 0.5))
    expected_max = torch.trapezoid(x * n * phi * cdf ** (n - 1), x).item()
    return 1 / (1 + spread * expected_max)


# ---- a real-size step on the meta device (chapter 05's performance lessons) ----------------------

# GPT-3 XL's shape (Brown et al. 2020, "Language Models are Few-Shot Learners", table 2.1:
# 24 layers, d_model 2048, context 2048; 1.3B parameters) as distlab.models.TinyGPT builds it:
# GPT-2's vocabulary (50257), learned positions, an untied head, 16 heads of 128, a 4·d GELU MLP.
GPT3_XL = dict(vocab=50257, d_model=2048, n_heads=16, n_layers=24, seq_len=2048)


def gpt_step(rank, world_size, layers=2, tokens=2048, vocab=64, overlap=True, bucket_cap_mb=25.0,
             micro=1, dtype=torch.bfloat16):
    """One data-parallel step (forward, backward, bucketed gradient all-reduce) of `layers`
    GPT-3 XL blocks at their real size, `tokens` tokens per rank per micro-batch, on the meta
    device (shapes only: run it under `distlab.run(..., emulate=...)`). `vocab`: 64 keeps the
    embedding and head small, so the blocks are what is timed (GPT3_XL["vocab"]: the real
    model's). With micro > 1, gradient accumulation: micro-1 backward passes inside no_sync.
    Returns (BucketedDDP.last_timeline(), the step's seconds on this rank's clock)."""
    from .models import TinyGPT, lm_loss
    with torch.device("meta"):
        model = TinyGPT(**dict(GPT3_XL, n_layers=layers, vocab=vocab)).to(dtype)
        ids = torch.randint(vocab, (1, tokens))
    # broadcast=False: meta tensors have no values to copy, and the step is what is timed
    ddp = BucketedDDP(model, bucket_cap_mb=bucket_cap_mb, overlap=overlap, broadcast=False)
    start = now()
    for i in range(micro):
        with ddp.no_sync() if i < micro - 1 else contextlib.nullcontext():
            lm_loss(ddp(ids).float(), ids).backward()
    return ddp.last_timeline(), now() - start


def weak_scaling(curves, world_sizes, alone, alone_preset="a100-node", shown=(8, 16, 256),
                 say=print):
    """Weak scaling of `gpt_step`, predicted from one-rank runs (chapter 05b, §2): for each curve,
    the speedup N × (one rank's step) / (N ranks' step) at every N of `world_sizes`, the N-rank
    step by `predict_step` on the cluster's link between N ranks.

    `curves`: {label: (device preset of the one-rank run, cluster preset for N ranks, tokens per
    rank, overlap)}; `alone`: {overlap: gpt_step's (timeline, seconds)} already run on one rank of
    `alone_preset` with gpt_step's 2048 tokens, reused instead of run again. Each curve's speedup at
    the ranks of `shown` goes to `say` as soon as it is known (an emulated run prints its one-line
    banner where it happens, between those lines). Returns ({label: [speedup per N]}, {label: the
    one-rank (timeline, seconds)})."""
    from .emulate import PRESETS
    from .launch import run
    speedup, ones = {}, {}
    for label, (device_preset, cluster_name, tokens, overlap) in curves.items():
        one = ones[label] = alone[overlap] if (device_preset, tokens) == (alone_preset, 2048) else \
            run(gpt_step, 1, tokens=tokens, overlap=overlap, emulate=device_preset)[0]
        cluster = PRESETS[cluster_name]
        speedup[label] = [n * one[1] / predict_step(*one, n, cluster.link_between(range(n)))
                          for n in world_sizes]
        say(f"{label:>26}: speedup at {', '.join(map(str, shown))} ranks: "
            + ", ".join(f"{speedup[label][list(world_sizes).index(n)]:.1f}" for n in shown))
    return speedup, ones

