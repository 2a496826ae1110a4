"""Workbook 06's checkers pass right answers however they are written, and refuse wrong results,
wrong communication (read from the trace) and the course's own code, saying which."""
import threading

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed import all_gather, reduce_scatter

from distlab import memory
from distlab.checks import CheckFailed, ch06
from distlab.sharding import chunk_bounds, gather_flat


# ---- ZeRO-1 -------------------------------------------------------------------------------------

def zero1_step(params, shards, optimizer):
    """The workbook's answer: reduce-scatter padded gradients (list form, imported names)."""
    world = dist.get_world_size()
    for p, s in zip(params, shards):
        c = -(-p.numel() // world)
        out = torch.empty(c, dtype=p.grad.dtype)
        reduce_scatter(out, list(F.pad(p.grad.view(-1), (0, c * world - p.numel())).split(c)))
        s.grad = out[:s.numel()] / world
    optimizer.step()
    for p, s in zip(params, shards):
        c = -(-p.numel() // world)
        parts = [torch.empty(c, dtype=s.dtype) for _ in range(world)]
        all_gather(parts, F.pad(s.data, (0, c - s.numel())))
        p.data.view(-1).copy_(torch.cat(parts)[:p.numel()])


def zero1_step_single_avg(params, shards, optimizer):
    """Differently written: reduce_scatter_single with ReduceOp.AVG, all_gather_single."""
    world = dist.get_world_size()
    for p, s in zip(params, shards):
        c = -(-p.numel() // world)
        out = torch.empty(c, dtype=p.grad.dtype)
        dist.reduce_scatter_single(out, F.pad(p.grad.view(-1), (0, c * world - p.numel())),
                                   op=dist.ReduceOp.AVG)
        s.grad = out[:s.numel()].clone()
    optimizer.step()
    for p, s in zip(params, shards):
        c = -(-p.numel() // world)
        full = torch.empty(c * world, dtype=s.dtype)
        dist.all_gather_single(full, F.pad(s.data, (0, c - s.numel())))
        p.data.view(-1).copy_(full[:p.numel()])


def all_reduce_zero1_step(params, shards, optimizer, average=True):
    """Right numbers, wrong structure: all-reduce the full gradients, then all-gather (1.5x DDP)."""
    world, rank = dist.get_world_size(), dist.get_rank()
    for p, s in zip(params, shards):
        dist.all_reduce(p.grad)
        if average:
            p.grad /= world
        lo, hi = chunk_bounds(p.numel(), world, rank)
        s.grad = p.grad.view(-1)[lo:hi]
    optimizer.step()
    for p, s in zip(params, shards):
        c = -(-p.numel() // world)
        parts = [torch.empty(c, dtype=s.dtype) for _ in range(world)]
        dist.all_gather(parts, F.pad(s.data, (0, c - s.numel())))
        p.data.view(-1).copy_(torch.cat(parts)[:p.numel()])


def summed_reduce_scatter_step(params, shards, optimizer):
    world = dist.get_world_size()
    for p, s in zip(params, shards):
        c = -(-p.numel() // world)
        out = torch.empty(c, dtype=p.grad.dtype)
        dist.reduce_scatter_single(out, F.pad(p.grad.view(-1), (0, c * world - p.numel())))
        s.grad = out[:s.numel()].clone()     # forgot to divide by the world size
    optimizer.step()
    for p, s in zip(params, shards):
        p.data.view(-1).copy_(_gather(s.data, p.numel(), world))


def _gather(shard, numel, world):
    c = -(-numel // world)
    full = torch.empty(c * world, dtype=shard.dtype)
    dist.all_gather_single(full, F.pad(shard, (0, c - shard.numel())))
    return full[:numel]


def gather_flat_zero1_step(params, shards, optimizer):
    """A cheat: the course's own gather_flat does the all-gather."""
    world = dist.get_world_size()
    for p, s in zip(params, shards):
        c = -(-p.numel() // world)
        out = torch.empty(c, dtype=p.grad.dtype)
        dist.reduce_scatter_single(out, F.pad(p.grad.view(-1), (0, c * world - p.numel())),
                                   op=dist.ReduceOp.AVG)
        s.grad = out[:s.numel()].clone()
    optimizer.step()
    for p, s in zip(params, shards):
        p.data.view(-1).copy_(gather_flat(s.data, p.numel()))


def test_zero1_accepts_right_answers_however_written(capsys):
    ch06.check_zero1_step(zero1_step, world_sizes=(3,))  # all sizes: nbval of the workbook
    ch06.check_zero1_step(zero1_step_single_avg)
    assert capsys.readouterr().out.count("✅") == 2


def test_zero1_refuses_all_reduce_then_all_gather():
    # The workbook's old answer: right numbers at 1.5x DDP's traffic.
    with pytest.raises(CheckFailed) as e:
        ch06.check_zero1_step(all_reduce_zero1_step)
    message = str(e.value)
    assert message.startswith("with world_size=2, rank 0 sent 5,184 B (all_gather 1,752 B, "
                              "all_reduce 3,432 B; from the run's trace), 1.48× the 3,504 B")
    assert "DDP's all-reduce: 3,432 B" in message and "reduce-scatter the gradients" in message


def test_zero1_refuses_a_summed_gradient():
    # Adam almost hides a gradient scaled by N; the tight comparison still sees it.
    with pytest.raises(CheckFailed, match=r"zero1_step with world_size=2, rank 0, after 3 steps"):
        ch06.check_zero1_step(summed_reduce_scatter_step)


def test_zero1_refuses_the_course_gather():
    with pytest.raises(CheckFailed, match=r"your function called the course's own gather_flat; "
                                          r"the exercise is to write the ZeRO-1 step yourself"):
        ch06.check_zero1_step(gather_flat_zero1_step)


# ---- ZeRO-3: a layer's forward and backward ---------------------------------------------------

def _pad_gather(shard, numel, world):
    c = -(-numel // world)
    parts = [torch.empty(c, dtype=shard.dtype) for _ in range(world)]
    dist.all_gather(parts, F.pad(shard, (0, c - shard.numel())))
    return torch.cat(parts)[:numel]


def _pad_reduce(full, mine, world):
    c = -(-full.numel() // world)
    out = torch.empty(c, dtype=full.dtype)
    reduce_scatter(out, list(F.pad(full.reshape(-1), (0, c * world - full.numel())).split(c)))
    return out[:mine] / world


class ZeRO3Linear(torch.autograd.Function):
    """The workbook's answer: list-form all_gather / reduce_scatter of padded slices."""

    @staticmethod
    def forward(ctx, x, weight_shard, bias_shard, shape):
        world = dist.get_world_size()
        w = _pad_gather(weight_shard, shape[0] * shape[1], world).view(shape)
        b = _pad_gather(bias_shard, shape[0], world)
        ctx.save_for_backward(x, weight_shard)
        ctx.shape, ctx.bias_numel = shape, bias_shard.numel()
        return x @ w.t() + b

    @staticmethod
    def backward(ctx, grad_out):
        world = dist.get_world_size()
        x, weight_shard = ctx.saved_tensors
        w = _pad_gather(weight_shard, ctx.shape[0] * ctx.shape[1], world).view(ctx.shape)
        return (grad_out @ w, _pad_reduce(grad_out.t() @ x, weight_shard.numel(), world),
                _pad_reduce(grad_out.sum(0), ctx.bias_numel, world), None)


class ZeRO3LinearSingle(torch.autograd.Function):
    """Differently written: the _single collectives, ReduceOp.AVG, F.linear, the bias gathered
    again in backward too (FSDP gathers a whole unit), slices padded with torch.cat."""

    @staticmethod
    def _gather(shard, numel):
        world = dist.get_world_size()
        c = -(-numel // world)
        full = torch.empty(c * world, dtype=shard.dtype)
        dist.all_gather_single(full, torch.cat([shard, shard.new_zeros(c - shard.numel())]))
        return full[:numel]

    @staticmethod
    def _reduce(grad, keep):
        world = dist.get_world_size()
        flat = grad.reshape(-1)
        c = -(-flat.numel() // world)
        out = torch.empty(c, dtype=flat.dtype)
        dist.reduce_scatter_single(out, torch.cat([flat, flat.new_zeros(c * world - flat.numel())]),
                                   op=dist.ReduceOp.AVG)
        return out[:keep].clone()

    @staticmethod
    def forward(ctx, x, ws, bs, shape):
        ctx.save_for_backward(x, ws, bs)
        ctx.shape = shape
        return F.linear(x, ZeRO3LinearSingle._gather(ws, ws.new_empty(shape).numel()).view(shape),
                        ZeRO3LinearSingle._gather(bs, shape[0]))

    @staticmethod
    def backward(ctx, g):
        x, ws, bs = ctx.saved_tensors
        n = ctx.shape[0] * ctx.shape[1]
        w = ZeRO3LinearSingle._gather(ws, n).view(ctx.shape)
        ZeRO3LinearSingle._gather(bs, ctx.shape[0])          # not needed, but allowed
        return (g.mm(w), ZeRO3LinearSingle._reduce(g.t().mm(x), ws.numel()),
                ZeRO3LinearSingle._reduce(g.sum(0), bs.numel()), None)


class KeepsTheWeight(ZeRO3Linear):
    """Wrong structure with a decoy: keeps the gathered weight for backward and all-gathers
    zeros there, so the trace shows the backward gather ZeRO-3 needs."""

    @staticmethod
    def forward(ctx, x, weight_shard, bias_shard, shape):
        world = dist.get_world_size()
        w = _pad_gather(weight_shard, shape[0] * shape[1], world).view(shape)
        b = _pad_gather(bias_shard, shape[0], world)
        ctx.save_for_backward(x, w)
        ctx.shards = weight_shard.numel(), bias_shard.numel()
        return x @ w.t() + b

    @staticmethod
    def backward(ctx, grad_out):
        world = dist.get_world_size()
        x, w = ctx.saved_tensors
        _pad_gather(torch.zeros(ctx.shards[0], dtype=w.dtype), w.numel(), world)    # the decoy
        return (grad_out @ w, _pad_reduce(grad_out.t() @ x, ctx.shards[0], world),
                _pad_reduce(grad_out.sum(0), ctx.shards[1], world), None)


class DecoyReduceScatter(ZeRO3Linear):
    """A decoy of zeros: reduce-scatters zeros (the bytes the trace expects), and gets the
    gradient by an all-reduce of the full gradient."""

    @staticmethod
    def backward(ctx, grad_out):
        world, rank = dist.get_world_size(), dist.get_rank()
        x, weight_shard = ctx.saved_tensors
        w = _pad_gather(weight_shard, ctx.shape[0] * ctx.shape[1], world).view(ctx.shape)
        out = []
        for full, mine in ((grad_out.t() @ x, weight_shard.numel()),
                           (grad_out.sum(0), ctx.bias_numel)):
            _pad_reduce(torch.zeros_like(full), mine, world)
            full = full.reshape(-1).clone()
            dist.all_reduce(full)
            lo, hi = chunk_bounds(full.numel(), world, rank)
            out.append(full[lo:hi] / world)
        return (grad_out @ w, *out, None)


class AllReduceGradients(ZeRO3Linear):
    """Wrong structure: all-reduces the full gradients and keeps its slice (no decoy)."""

    @staticmethod
    def backward(ctx, grad_out):
        world, rank = dist.get_world_size(), dist.get_rank()
        x, weight_shard = ctx.saved_tensors
        w = _pad_gather(weight_shard, ctx.shape[0] * ctx.shape[1], world).view(ctx.shape)
        out = []
        for full in (grad_out.t() @ x, grad_out.sum(0)):
            full = full.reshape(-1).clone()
            dist.all_reduce(full)
            lo, hi = chunk_bounds(full.numel(), world, rank)
            out.append(full[lo:hi] / world)
        return (grad_out @ w, *out, None)


class CourseGather(ZeRO3Linear):
    """A cheat: the course's gather_flat."""

    @staticmethod
    def forward(ctx, x, weight_shard, bias_shard, shape):
        ctx.save_for_backward(x, weight_shard)
        ctx.shape, ctx.bias_numel = shape, bias_shard.numel()
        return x @ gather_flat(weight_shard, shape[0] * shape[1]).view(shape).t() + \
            gather_flat(bias_shard, shape[0])


class Unpadded(ZeRO3Linear):
    """Forgets the padding: the last rank's slice is shorter, and gloo fails."""

    @staticmethod
    def forward(ctx, x, weight_shard, bias_shard, shape):
        world = dist.get_world_size()
        parts = [torch.empty_like(weight_shard) for _ in range(world)]
        dist.all_gather(parts, weight_shard)
        return x @ torch.cat(parts)[:shape[0] * shape[1]].view(shape).t()


class LetGoLate(ZeRO3Linear):
    """Right, but another thread holds the gathered weight for 0.1 s after forward returns, as
    gloo's worker thread holds a finished all-gather's tensors a moment after wait() returns
    (the check once read 768 B of them on a loaded 2-core machine and called it kept)."""

    @staticmethod
    def forward(ctx, x, weight_shard, bias_shard, shape):
        world = dist.get_world_size()
        w = _pad_gather(weight_shard, shape[0] * shape[1], world).view(shape)
        held = [w]
        threading.Timer(0.1, held.clear).start()
        ctx.save_for_backward(x, weight_shard)
        ctx.shape, ctx.bias_numel = shape, bias_shard.numel()
        return x @ w.t() + _pad_gather(bias_shard, shape[0], world)


def test_zero3_layer_accepts_right_answers_however_written(capsys):
    ch06.check_zero3_layer(ZeRO3Linear, world_sizes=(3,))  # all sizes: nbval of the workbook
    ch06.check_zero3_layer(ZeRO3LinearSingle, world_sizes=(2,))
    ch06.check_zero3_layer(LetGoLate, world_sizes=(2,))
    assert capsys.readouterr().out.count("✅") == 3


def test_zero3_layer_refuses_wrong_structure_decoys_and_the_course():
    with pytest.raises(CheckFailed, match=r"with world_size=2, rank 0: after layer 0's forward "
                                          r"the rank still holds \d+ B it made during it — as "
                                          r"much as the full 7×9 weight \(504 B in float64\)"):
        ch06.check_zero3_layer(KeepsTheWeight)
    with pytest.raises(CheckFailed, match=r"with world_size=2, rank 0: a reduce-scatter in the "
                                          r"backward carried all zeros"):
        ch06.check_zero3_layer(DecoyReduceScatter)
    with pytest.raises(CheckFailed, match=r"rank 0: the backward called all_reduce; .* an "
                                          r"all-reduce leaves every rank the whole sum"):
        ch06.check_zero3_layer(AllReduceGradients)
    with pytest.raises(CheckFailed, match=r"your function called the course's own gather_flat; "
                                          r"the exercise is to write the ZeRO-3 layer yourself"):
        ch06.check_zero3_layer(CourseGather)


def test_a_gloo_size_mismatch_is_explained():
    with pytest.raises(CheckFailed, match=r"with world_size=2, the ranks' (all_gather calls|"
                                          r"collectives) did not match .* pad each slice to "
                                          r"ceil\(numel / world_size\)"):
        ch06.check_zero3_layer(Unpadded)


# ---- predict, then run: ZeRO-2/3 bytes per GPU --------------------------------------------------

def zero_bytes(units, world_size, stage, bytes_per_param):
    """The workbook's answer: walk backward's moments."""
    w, g, o = (bytes_per_param[k] for k in ("weights", "grads", "optimizer"))
    n, N = sum(units), world_size
    held = (w * n / N if stage == 3 else w * n) + o * n / N
    peak = held
    for i in range(len(units)):
        peak = max(peak, held + g * sum(units[i:]) / N + g * units[i]
                   + (w * units[i] if stage == 3 else 0))
    return {"steady": held + g * n / N, "peak": peak}


def zero_bytes_per_term(units, world_size, stage, bytes_per_param):
    """Differently written: per-unit lists of what each moment adds, numpy-free, stage as a
    set of sharded kinds."""
    sharded = {"optimizer", "grads"} | ({"weights"} if stage == 3 else set())
    steady = sum(bytes_per_param[k] * sum(units) / (world_size if k in sharded else 1)
                 for k in bytes_per_param)
    base = steady - bytes_per_param["grads"] * sum(units) / world_size
    shards_after = [sum(units[i:]) / world_size for i in range(len(units))]
    moments = [base + bytes_per_param["grads"] * (s + u)
               + (bytes_per_param["weights"] * u if "weights" in sharded else 0)
               for s, u in zip(shards_after, units)]
    return {"peak": max(moments), "steady": steady, "note": "extra keys are fine"}


def zero_bytes_no_full_gradient(units, world_size, stage, bytes_per_param):
    """Wrong: the full gradient before the reduce-scatter is forgotten."""
    out = zero_bytes(units, world_size, stage, bytes_per_param)
    w, g = bytes_per_param["weights"], bytes_per_param["grads"]
    n = sum(units)
    held = (w * n / world_size if stage == 3 else w * n) + \
        bytes_per_param["optimizer"] * n / world_size
    out["peak"] = held + g * n / world_size + (w * max(units) if stage == 3 else 0)
    return out


def zero_bytes_no_gathered_layer(units, world_size, stage, bytes_per_param):
    """Wrong: the peak counts ZeRO-3's weights as sharded only."""
    b = dict(bytes_per_param)
    out = zero_bytes(units, world_size, 2 if stage == 3 else stage, dict(b, weights=0))
    n = sum(units)
    w = b["weights"] * n / (world_size if stage == 3 else 1)
    return {"steady": out["steady"] + w, "peak": out["peak"] + w}


def zero_bytes_course(units, world_size, stage, bytes_per_param):
    """A cheat: the course's model."""
    from distlab import zero_memory
    out = zero_bytes(units, world_size, stage, bytes_per_param)
    out["peak"] = zero_memory.zero3_peak([dict(weights=0, grad=0, grad_shard=0, acts=0)], 0)["peak"]
    return out


def test_zero_bytes_accepts_right_answers_however_written(capsys):
    ch06.check_zero_bytes(zero_bytes)
    ch06.check_zero_bytes(zero_bytes_per_term)
    assert capsys.readouterr().out.count("✅") == 2


def test_zero_bytes_names_the_term_that_is_off():
    with pytest.raises(CheckFailed, match=r"stage=3, \.\.\.\): your peak count of the gradients "
                                          r"is off .* this unit's FULL gradient"):
        ch06.check_zero_bytes(zero_bytes_no_full_gradient)
    with pytest.raises(CheckFailed, match=r"your peak count of the weights is off — .* one "
                                          r"unit's full weights, gathered"):
        ch06.check_zero_bytes(zero_bytes_no_gathered_layer)
    with pytest.raises(CheckFailed, match=r"your function called the course's own zero3_peak; "
                                          r"the exercise is to write the count yourself"):
        ch06.check_zero_bytes(zero_bytes_course)
    with pytest.raises(CheckFailed, match=r"should return a dict with the keys 'steady' and "
                                          r"'peak'"):
        ch06.check_zero_bytes(lambda *a: 3.0)


def test_stubs_are_reported_as_not_written():
    def stub(*args):
        raise NotImplementedError("exercise: replace this line with your code")

    class Stub(torch.autograd.Function):
        forward = staticmethod(lambda ctx, *args: stub())
        backward = staticmethod(lambda ctx, *args: stub())
    for check, fn in ((ch06.check_zero1_step, stub), (ch06.check_zero3_layer, Stub),
                      (ch06.check_zero_bytes, stub)):
        with pytest.raises(NotImplementedError, match="is not written yet"):
            check(fn)


# ---- the activation-memory model ----------------------------------------------------------------

@pytest.mark.parametrize("s, b, h, a", [(2048, 1, 4096, 32), (4096, 2, 12288, 96), (256, 1, 64, 4)])
def test_materialized_attention_is_korthikanti_eq1(s, b, h, a):
    assert memory.activation_bytes(s, b, h, 3, a, attention="materialized") == \
        pytest.approx(3 * s * b * h * (34 + 5 * a * s / h))
    # selective recomputation drops exactly the s×s term; full keeps the layer input, 2·s·b·h
    assert memory.activation_bytes(s, b, h, 3, a, "selective", "materialized") == 3 * 34 * s * b * h
    assert memory.activation_bytes(s, b, h, 3, a, True) == 3 * 2 * s * b * h
    assert memory.activation_bytes(s, b, h, 3, a, "full") == 3 * 2 * s * b * h


def test_flash_attention_stores_no_scores_and_selective_changes_nothing():
    s, b, h, a = 2048, 1, 4096, 32
    flash = memory.activation_bytes(s, b, h, 1, a)            # the default
    assert flash == 34 * s * b * h + 4 * a * s * b             # + one float32 log-sum-exp per row
    assert memory.activation_bytes(s, b, h, 1, a, "selective") == flash
    assert memory.per_gpu_bytes("GPT-3 175B", seq_len=2048)["activations"] == \
        96 * memory.activation_bytes(s, b, 12288, 1, 96)
    with pytest.raises(ValueError, match="attention must be one of"):
        memory.activation_bytes(s, b, h, 1, a, attention="sparse")
    with pytest.raises(ValueError, match="recompute must be one of"):
        memory.activation_bytes(s, b, h, 1, a, checkpointing="half")


def _saved_bytes(block, *args):
    weights = {p.untyped_storage().data_ptr() for p in block.parameters()}
    seen = {}

    def pack(t):
        key = t.untyped_storage().data_ptr()
        if key not in weights:
            seen[key] = t.untyped_storage().nbytes()
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        block(*args)
    return sum(seen.values())


def test_the_formula_matches_what_a_block_saves():
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from distlab import models
    s, b, h, a = 128, 2, 32, 4
    block = models.Block(h, a, 4 * h)
    x = torch.randn(b, s, h, requires_grad=True)
    ln_stats = 2 * 2 * s * b * 4                 # mean and 1/std of both LayerNorms, float32
    flash = _saved_bytes(block, x)
    assert flash == sum(memory.activation_breakdown(s, b, h, a, bytes_per_value=4,
                                                    dropout=False).values()) + ln_stats
    with sdpa_kernel(SDPBackend.MATH):   # the reference path stores the s×s softmax
        materialized = _saved_bytes(block, x)
    scores = memory.activation_breakdown(s, b, h, a, "materialized", bytes_per_value=4,
                                         dropout=False)["s×s attention scores"]
    assert scores == a * s * s * b * 4
    # it keeps no log-sum-exp, and may keep a scaled copy of Q and a transposed copy of K
    lse = 4 * a * s * b
    assert scores - lse <= materialized - flash <= scores - lse + 2 * s * b * h * 4


def test_zero3_prefetch_model():
    g, f, b, r = 3.0, 2.0, 4.0, 1.0
    assert memory.zero3_step_seconds(g, f, b, r, 4, False) == 4 * (2 * g + f + b + r)
    on = memory.zero3_step_seconds(g, f, b, r, 4, True)
    assert on == (g + 3 * g + f) + (g + 3 * (b + r) + b + r)
    # with free communication, prefetch or not, the step is its compute and reduce-scatters
    assert memory.zero3_step_seconds(0, f, b, r, 4, True) == \
        memory.zero3_step_seconds(0, f, b, r, 4, False) == 4 * (f + b + r)


# ---- ZeRO-3 prefetch ------------------------------------------------------------------------------

def _zero3_prefetch_run(rank, world_size, prefetch):
    from distlab import models
    from distlab.sharding import ZeRO
    model = models.make_mlp((5, 7, 6, 3), seed=1)
    x, y = models.regression_data(n=12, in_dim=5, out_dim=3, seed=2)
    zero = ZeRO(model, 3, optimizer="adam", lr=0.1, prefetch=prefetch)
    for _ in range(2):
        zero.zero_grad()
        F.mse_loss(model(x.chunk(world_size)[rank]), y.chunk(world_size)[rank]).backward()
        zero.step()
    return zero.full_parameters(), dict(zero.sent)


def test_zero3_prefetch_is_bit_identical_and_gathers_ahead():
    import distlab
    off = distlab.run(_zero3_prefetch_run, 3, False, trace=True)
    on = distlab.run(_zero3_prefetch_run, 3, True, trace=True)
    for rank in range(3):
        assert all(torch.equal(u, v) for u, v in zip(off[rank][0], on[rank][0]))
        assert off[rank][1] == on[rank][1]          # the same bytes, only earlier
    gathers = on.trace.comm(0, "all_gather")
    # per step: 3 layers x 2 tensors gathered in forward and again in backward; all but the
    # first layer in each direction are prefetched: launched async, waited for a layer later
    # (the trace marks async a call with other work between its launch and its wait, so a
    # layer's last tensor, waited right after the one before it, may read as not async)
    assert len(gathers) == 2 * 2 * 3 * 2 + 6        # + full_parameters() at the end
    assert sum(e["async_op"] for e in gathers) >= 2 * 2 * 2
    assert not any(e["async_op"] for e in off.trace.comm(0, "all_gather"))


def test_prefetch_needs_stage_3():
    import distlab

    def build(rank, world_size):
        from distlab import models
        from distlab.sharding import ZeRO
        try:
            ZeRO(models.make_mlp((2, 2), seed=0), 2, prefetch=True)
        except ValueError as e:
            return str(e)
    assert "only stage 3" in distlab.run(build, 2)[0]


# ---- peak memory and Llama's activations (distlab.zero_memory) --------------------------------

def _notebook(name):
    import pathlib

    import nbformat
    path = pathlib.Path(__file__).resolve().parent.parent / "notebooks" / name
    cells = nbformat.read(path, as_version=4).cells
    prose = "\n".join(c.source for c in cells if c.cell_type == "markdown")
    outputs = "\n".join(o.get("text", "") for c in cells if c.cell_type == "code"
                        for o in c.get("outputs", []))
    return " ".join(prose.split()), outputs


def test_llama_count_is_what_a_llama_block_saves():
    from distlab import zero_memory
    s, h, a, f = 64, 32, 4, 88
    for dtype in (torch.float32, torch.bfloat16):
        block = zero_memory.LlamaBlock(h, a, f, dtype=dtype)
        x = torch.randn(1, s, h, dtype=dtype, requires_grad=True)
        cos, sin = zero_memory.rotary_tables(s, h // a, dtype)
        tables = cos.untyped_storage().nbytes() + sin.untyped_storage().nbytes()
        counted = sum(zero_memory.llama_activations(s, 1, h, a, f, dtype.itemsize).values())
        assert _saved_bytes(block, x, cos, sin) - tables == counted
        for kv in (2, 1):           # grouped-query attention: K and V shrink, nothing repeated
            gqa = zero_memory.LlamaBlock(h, a, f, dtype=dtype, kv_heads=kv)
            counted = sum(zero_memory.llama_activations(s, 1, h, a, f, dtype.itemsize,
                                                        kv_heads=kv).values())
            assert _saved_bytes(gqa, x, cos, sin) - tables == counted
    # in bf16 at Llama-2 7B's shape: 32 + 8·ffn/hidden bytes per token and hidden unit
    L2 = zero_memory.LLAMA2_7B
    per = sum(zero_memory.llama_activations(4096, 1, L2["hidden"], L2["heads"], L2["ffn"]).values())
    assert per == 4096 * (L2["hidden"] * (32 + 8 * L2["ffn"] / L2["hidden"]) + 8 + 4 * L2["heads"])
    assert zero_memory.llama_activations(4096, 2, 4096, 32, 11008, recompute="full") == \
        {"block input (the rest is recomputed)": 2 * 4096 * 2 * 4096}
    with pytest.raises(ValueError, match="flash attention already recomputes"):
        zero_memory.llama_activations(4096, 1, 4096, 32, 11008, recompute="selective")


def test_zero3_peak_walks_the_moments():
    from distlab import zero_memory
    u = dict(weights=10.0, grad=10.0, grad_shard=5.0, acts=1.0)
    # no prefetch: backward of unit 0 = states + 2 shards + 10 + 10 + one flowing gradient
    off = zero_memory.zero3_peak([u, u], 100.0, False, flowing=0.5, loss=3.0)
    assert off["moment"] == "backward, unit 0" and off["peak"] == 100 + 10 + 10 + 10 + 0.5
    # prefetch: backward of unit 1 holds unit 0's weights too, one shard, unit 0's acts
    on = zero_memory.zero3_peak([u, u], 100.0, True, flowing=0.5, loss=3.0)
    assert on["moment"] == "backward, unit 1" and on["peak"] == 100 + 5 + 1 + 20 + 10 + 1.0
    # big activations: the last forward holds them all and its weights; a big loss, the turn
    big = dict(u, acts=50.0)
    last = zero_memory.zero3_peak([big, big], 100.0, True, flowing=0.5, loss=3.0)
    assert last["moment"] == "forward, unit 1" and last["peak"] == 100 + 100 + 10
    turn = zero_memory.zero3_peak([big, big], 100.0, True, flowing=0.5, loss=30.0)
    assert turn["moment"] == "the turn (loss backward)" and turn["peak"] == 100 + 100 + 30 + 0.5


def test_unequal_units_reduce_to_the_equal_layer_model():
    from distlab import zero_memory
    g, f, b, r = 3.0, 2.0, 4.0, 1.0
    units = [dict(gather=g, forward=f, backward=b, reduce_scatter=r)] * 4
    for prefetch in (False, True):
        assert zero_memory.zero3_units_seconds(units, prefetch) == \
            memory.zero3_step_seconds(g, f, b, r, 4, prefetch)
    # compute after a unit (attention) adds to its own span: hidden or not by the next gather
    u2 = [dict(gather=1.0, forward=1.0, backward=2.0, reduce_scatter=0.5, forward_after=3.0,
               backward_after=0.25), dict(gather=2.0, forward=1.0, backward=2.0,
                                          reduce_scatter=0.5)]
    assert zero_memory.zero3_units_seconds(u2, True) == \
        1.0 + max(4.0, 2.0) + 1.0 + 2.0 + (max(2.0, 1.0) + 0.5) + (2.0 + 0.5 + 0.25)


def test_peak_tracker_follows_frees_and_resizes():
    from distlab import zero_memory
    keep = torch.empty(1000)                     # 4000 B, held from the start
    with zero_memory.PeakTracker([keep]) as t:
        a = torch.empty(2000).add_(1)            # + 8000
        del a                                    # freed
        b = torch.zeros(500)                     # + 2000
        keep.untyped_storage().resize_(0)        # - 4000 (as ZeRO-3 frees a parameter)
        c = torch.ones(3000)                     # + 12000
        del b, c
    assert t.baseline == 4000 and t.peak == 14000


def _zero3_peak_run(rank, world_size, prefetch):
    from distlab import models, zero_memory
    from distlab.sharding import ZeRO
    d, tokens = 256, 16
    model = models.make_mlp((d,) * 4, seed=0)
    x, y = models.regression_data(n=tokens * world_size, in_dim=d, out_dim=d, seed=0)
    zero = ZeRO(model, 3, optimizer="adam", lr=1e-3, prefetch=prefetch)
    xs, ys = x.chunk(world_size)[rank].clone(), y.chunk(world_size)[rank].clone()
    for _ in range(2):
        zero.zero_grad()
        held = [*model.parameters(), *zero.shards, xs, ys,
                *(v for st in zero.optimizer.state.values() for v in st.values())]
        with zero_memory.PeakTracker(held) as t:
            F.mse_loss(model(xs), ys).backward()
        zero.step()
    return t.baseline, t.peak


def test_course_zero3_peak_is_the_count():
    # The course's ZeRO-3 gathers into the parameter itself and reduce-scatters from the
    # gradient itself (no extra full-size copies): its tracked peak is zero3_peak's.
    import distlab
    from distlab import zero_memory
    d, tokens = 256, 16
    w = (d * d + d) * 4
    units = [dict(weights=w, grad=w, grad_shard=w / 2, acts=tokens * d * 4)] * 3
    res = distlab.run(_zero3_peak_run, 2, True)
    for baseline, peak in res:
        model = zero_memory.zero3_peak(units, baseline, True, flowing=tokens * d * 4)
        assert abs(model["peak"] / peak - 1) < 0.002


def test_chapter_06_prose_numbers_are_computed():
    from distlab import hardware, zero_memory
    from distlab.emulate import PRESETS
    prose, outputs = _notebook("06_memory_and_zero.ipynb")
    L2 = zero_memory.LLAMA2_7B
    h, a, f = L2["hidden"], L2["heads"], L2["ffn"]
    per = sum(zero_memory.llama_activations(2048, 1, h, a, f).values()) / (2048 * h)
    assert f"{per:.1f} bytes per token and hidden unit" in prose
    assert f"{per:.1f}·s·b·h for an eager Llama-2 7B block" in prose

    def gb(x):
        return f"{x / memory.GB:.1f} GB"

    def steady(n, recompute):
        states = memory.model_state_bytes(zero_memory.llama_params(**L2), zero_stage=3,
                                          world_size=n)
        acts = L2["layers"] * sum(zero_memory.llama_activations(4096, 1, h, a, f,
                                                                recompute=recompute).values())
        return sum(states.values()) + acts
    p8, p8f = (zero_memory.llama_zero3_peak(8, 4096, recompute=r) for r in ("none", "full"))
    p64f = zero_memory.llama_zero3_peak(64, 4096, recompute="full")
    assert f"{p8['parts']['saved activations'] / memory.GB:.1f} GB of saved activations" in prose
    assert f"({p8['parts']['loss: logits and their gradient'] / memory.GB:.2f} GB)" in prose
    assert f"{gb(p8['peak'])} on 8 GPUs" in prose
    assert f"steady state ({gb(steady(8, 'none'))})" in prose
    assert p8["moment"] == "the turn (loss backward)" and p8["peak"] < steady(8, "none")
    assert f"peak is {gb(p8f['peak'])} against a steady {gb(steady(8, 'full'))[:-3]}" in prose
    assert f"on 64 GPUs {gb(p64f['peak'])} against {gb(steady(64, 'full'))[:-3]}" in prose
    assert f"{p64f['peak'] / steady(64, 'full'):.1f}× the steady state" in prose
    parts = p64f["parts"]
    for key in ("gathered weights", "full gradient before reduce-scatter", "recompute working set"):
        assert f"({parts[key] / memory.GB:.2f} GB)" in prose, key
    assert f"{gb(p64f['peak'])} at the peak, {gb(steady(64, 'full'))} at rest" in prose
    # the prefetch threshold and the links
    hide = {p: zero_memory.hiding_tokens(PRESETS[p], n)
            for p, n in (("h100-node", 8), ("h100-2x8", 16), ("h100-ib", 2), ("h100-cluster", 64))}
    assert hide["h100-node"] == hide["h100-2x8"] == hide["h100-cluster"] == 2048
    assert hide["h100-ib"] == 8192 and "needs 8192 tokens per GPU" in prose
    assert "hide from 2048 tokens per GPU on" in prose and "about 2048 tokens per GPU" in prose
    assert PRESETS["h100-2x8"].link_between(range(16)).bandwidth == 370e9 == \
        PRESETS["h100-node"].intra.bandwidth
    assert PRESETS["h100-ib"].link_between([0, 1]).bandwidth == 47e9
    assert "370 GB/s either way" in prose and "gets 47 GB/s" in prose
    # the published run beside the closed form
    llama3_8b = hardware.Transformer(32, 4096, 32, 14336, 128256, 8, True)
    titan = hardware.step_seconds(llama3_8b, PRESETS["a100-cluster"], 64, 64, 8192,
                                  recompute="selective-op", fsdp=True, fused=False)
    assert "2,973 tokens/s per GPU" in prose
    assert f"model {64 * 8192 / titan['step'] / 64:,.0f}" in outputs
    assert titan["dp"] < titan["step"]
    # the emulated and CPU numbers the prose quotes are the stored outputs (nbval re-runs them)
    import re
    ratios = re.findall(r"off/on: emulated (\d\.\d\d), closed form (\d\.\d\d)", outputs)
    assert len(ratios) == 2
    (e1, m1), (e2, m2) = ratios
    assert f"off/on {e1} against {m1} inside a node, {e2} against {m2} across nodes" in prose
    assert f"about {float(e1) - 1:.0%}".replace("%", " %") in prose
    assert outputs.count("within 2e-03: True") == 2 and "within 0.2 %" in prose
    assert outputs.count("NOT within 2e-03") == 2 and "tracked peak is higher" in prose


def test_the_widget_counts_llama_as_the_chapter_does():
    # memory_calculator draws memory.per_gpu_bytes: its Llama-2 presets count a Llama block
    # (zero_memory.llama_activations), the number chapter 06 prints for 32 blocks at seq 4096
    from distlab import zero_memory
    L2 = zero_memory.LLAMA2_7B
    h, a, f = L2["hidden"], L2["heads"], L2["ffn"]
    assert memory.LLAMA_FFN["Llama-2 7B"] == f
    for seq, recompute in ((4096, "none"), (2048, "full"), (4096, "full")):
        widget = memory.per_gpu_bytes("Llama-2 7B", zero_stage=3, world_size=8, seq_len=seq,
                                      checkpointing=recompute)["activations"]
        assert widget == 32 * sum(zero_memory.llama_activations(seq, 1, h, a, f,
                                                                recompute=recompute).values())
    widget = memory.per_gpu_bytes("Llama-2 7B", seq_len=4096)["activations"]
    _, outputs = _notebook("06_memory_and_zero.ipynb")
    assert (f"Llama-2 7B, 32 blocks, seq 4096, recompute none: activations "
            f"{widget / memory.GB:5.1f} GB") in outputs
    # not the GPT block's count any more (34·s·b·h + the log-sum-exp)
    assert widget != memory.activation_bytes(4096, 1, h, 32, a)
    # flash's selective changes nothing; materialized scores replace the log-sum-exp
    kw = dict(seq_len=2048, micro_batch=2)
    flash = memory.preset_activation_bytes("Llama-2 13B", **kw)
    assert memory.preset_activation_bytes("Llama-2 13B", checkpointing="selective",
                                          attention="materialized", **kw) == flash
    assert memory.preset_activation_bytes("Llama-2 13B", attention="materialized", **kw) == \
        flash + 40 * (2 * 40 * 2048 ** 2 * 2 - 4 * 40 * 2048 * 2)
    # the 70B preset is a Llama block with grouped-query attention (8 K/V heads), as the prose says
    assert memory.preset_activation_bytes("Llama-2 70B") == 80 * sum(
        zero_memory.llama_activations(2048, 1, 8192, 64, 28672, kv_heads=8).values())
    assert memory.preset_activation_bytes("Llama-2 70B") < 80 * sum(
        zero_memory.llama_activations(2048, 1, 8192, 64, 28672).values())
    prose, _ = _notebook("06_memory_and_zero.ipynb")
    assert "it counts the three Llama-2 models with Llama's own block" in prose
    assert "70B with its grouped-query attention, 8 K/V heads for 64 query heads" in prose
    with pytest.raises(ValueError, match="recompute must be one of"):
        memory.preset_activation_bytes("Llama-2 7B", checkpointing="half")


def test_bytes_per_parameter_conventions():
    from distlab import zero_memory
    got = {k: zero_memory.convention_bytes(k) for k in zero_memory.CONVENTIONS}
    assert got == {"ZeRO paper / distlab.memory": 16, "Megatron-LM (bf16)": 18,
                   "PyTorch AMP (torch.autocast)": 16, "FSDP2, bf16 params, fp32 reduce": 16}
    assert got["ZeRO paper / distlab.memory"] == sum(memory.bytes_per_parameter().values())
    prose, outputs = _notebook("06_memory_and_zero.ipynb")
    megatron = got["Megatron-LM (bf16)"]
    assert f"Megatron's {megatron} B/param is {(megatron / 16 - 1) * 100:.1f} % more" in prose
    for name, total in got.items():          # the table the chapter prints
        assert f"{name:32} {total:2} B/param" in outputs


def test_the_prefetch_figure_says_what_the_prose_says():
    import re
    prose, outputs = _notebook("06_memory_and_zero.ipynb")
    found = re.search(r"prefetch off -> on: forward (\d+\.\d) -> (\d+\.\d) ms, backward "
                      r"(\d+\.\d) -> (\d+\.\d) ms", outputs)
    f0, f1, b0, b1 = map(float, found.groups())
    assert f1 < f0 and b1 < b0 and f0 - f1 > b0 - b1        # "in backward the gain is smaller"
    assert "In backward the gain is smaller" in prose
    # the two halves add up to the emulated step the table above prints for h100-ib
    on = re.search(r"h100-ib   x2: prefetch off (\d+\.\d\d) ms, on (\d+\.\d\d) ms", outputs)
    assert abs(f0 + b0 - float(on.group(1))) < 0.15 and abs(f1 + b1 - float(on.group(2))) < 0.15
