"""Workbook 06's checkers pass right answers however they are written, and refuse wrong results,
wrong communication (read from the trace) and the course's own code, saying which."""
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
    world, rank = dist.get_world_size(), dist.get_rank()
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


# ---- ZeRO-3 -------------------------------------------------------------------------------------

def zero3_forward(layer, shards, x):
    """The workbook's answer: list-form all_gather of padded slices."""
    world = dist.get_world_size()
    for name, p in layer.named_parameters():
        c = -(-p.numel() // world)
        parts = [torch.empty(c) for _ in range(world)]
        dist.all_gather(parts, F.pad(shards[name], (0, c - shards[name].numel())))
        p.untyped_storage().resize_(p.numel() * p.element_size())
        p.data.view(-1).copy_(torch.cat(parts)[:p.numel()])
    out = layer(x)
    for p in layer.parameters():
        p.untyped_storage().resize_(0)
    return out


def zero3_forward_single(layer, shards, x):
    """Differently written: all_gather_single, and F.linear on the gathered tensors."""
    world = dist.get_world_size()
    full = {}
    for name, p in layer.named_parameters():
        full[name] = _gather(shards[name], p.numel(), world).view(p.shape)
        p.untyped_storage().resize_(p.numel() * p.element_size())
        p.data.copy_(full[name])
    out = F.linear(x, layer.weight, layer.bias)
    for p in layer.parameters():
        p.untyped_storage().resize_(0)
    return out


def zero3_forward_all_reduce(layer, shards, x):
    """Right numbers, wrong structure: all-reduce zero-filled full copies (2x an all-gather)."""
    world, rank = dist.get_world_size(), dist.get_rank()
    for name, p in layer.named_parameters():
        lo, hi = chunk_bounds(p.numel(), world, rank)
        full = torch.zeros(p.numel())
        full[lo:hi] = shards[name]
        dist.all_reduce(full)
        p.untyped_storage().resize_(p.numel() * p.element_size())
        p.data.view(-1).copy_(full)
    out = layer(x)
    for p in layer.parameters():
        p.untyped_storage().resize_(0)
    return out


def forward_without_freeing(layer, shards, x):
    out = zero3_forward(layer, shards, x)
    for p in layer.parameters():
        p.untyped_storage().resize_(p.numel() * p.element_size())
    return out


def forward_of_the_reference(layer, shards, x):
    return ch06.zero3_forward_reference(layer, shards, x)


def test_zero3_accepts_right_answers_however_written(capsys):
    ch06.check_zero3_forward(zero3_forward, world_sizes=(3,))
    ch06.check_zero3_forward(zero3_forward_single)
    assert capsys.readouterr().out.count("✅") == 2


def test_zero3_refuses_wrong_answers():
    with pytest.raises(CheckFailed, match="still holds the full weights after the forward"):
        ch06.check_zero3_forward(forward_without_freeing)
    with pytest.raises(CheckFailed, match=r"with world_size=2, rank 0 sent 320 B \(all_reduce "
                                          r"320 B; from the run's trace\), 1.90× the 168 B"):
        ch06.check_zero3_forward(zero3_forward_all_reduce)
    with pytest.raises(CheckFailed, match=r"your function called the course's own "
                                          r"zero3_forward_reference; the exercise is to write "
                                          r"the gather yourself"):
        ch06.check_zero3_forward(forward_of_the_reference)


def test_stubs_are_reported_as_not_written():
    def stub(*args):
        raise NotImplementedError("exercise: replace this line with your code")
    for check in (ch06.check_zero1_step, ch06.check_zero3_forward):
        with pytest.raises(NotImplementedError, match="is not written yet"):
            check(stub)


def zero3_forward_unpadded(layer, shards, x):
    """Forgets the padding: rank 1's slice of the bias is shorter, and gloo fails."""
    world = dist.get_world_size()
    for name, p in layer.named_parameters():
        parts = [torch.empty_like(shards[name]) for _ in range(world)]
        dist.all_gather(parts, shards[name])
        p.untyped_storage().resize_(p.numel() * p.element_size())
        p.data.view(-1).copy_(torch.cat(parts)[:p.numel()])
    return layer(x)


def test_a_gloo_size_mismatch_is_explained():
    with pytest.raises(CheckFailed, match=r"with world_size=2, the ranks' (all_gather calls|"
                                          r"collectives) did not match .* pad each slice to "
                                          r"ceil\(numel / world_size\)"):
        ch06.check_zero3_forward(zero3_forward_unpadded)


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
    assert memory.per_gpu_bytes("Llama-2 7B")["activations"] == 32 * flash
    with pytest.raises(ValueError, match="attention must be one of"):
        memory.activation_bytes(s, b, h, 1, a, attention="sparse")
    with pytest.raises(ValueError, match="recompute must be one of"):
        memory.activation_bytes(s, b, h, 1, a, checkpointing="half")


def _saved_bytes(block, x):
    weights = {p.untyped_storage().data_ptr() for p in block.parameters()}
    seen = {}

    def pack(t):
        key = t.untyped_storage().data_ptr()
        if key not in weights:
            seen[key] = t.untyped_storage().nbytes()
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        block(x)
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
