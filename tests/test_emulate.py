"""The emulated clock under patterns that must not change results: async collectives on two
groups launched in different orders on different ranks (issue 26), and handles asked whether
they are done."""
import pytest
import torch
import torch.distributed as dist

import distlab
from distlab import cost, emulate, trace
from distlab.emulate import PRESETS, comm_seconds

A100 = PRESETS["a100-nvlink"]
N = 250_000                                  # 1 MB of float32 per all_reduce


def _two_groups_crossed(rank, world_size, late):
    """Rank 0 launches on group a then b; rank 1 on b, then (`late` s later) on a."""
    a, b = dist.new_group([0, 1]), dist.new_group([0, 1])
    x = torch.full((N,), float(rank + 1))
    y = torch.full((N,), 10.0 * (rank + 1))
    if rank == 0:
        wa = dist.all_reduce(x, group=a, async_op=True)
        wb = dist.all_reduce(y, group=b, async_op=True)
    else:
        wb = dist.all_reduce(y, group=b, async_op=True)
        if late:
            trace.compute(late)
        wa = dist.all_reduce(x, group=a, async_op=True)
    wa.wait()
    wb.wait()
    return x, y, trace.now()


def test_async_collectives_launched_in_crossed_orders_run_under_emulation():
    plain = distlab.run(_two_groups_crossed, 2, 0.0, timeout=20)
    c = comm_seconds("all_reduce", N * 4, 2, A100.intra)
    for late in (0.0, 1e-3):
        emulated = distlab.run(_two_groups_crossed, 2, late, emulate=A100, timeout=20)
        for p, e in zip(plain, emulated):
            assert torch.equal(p[0], e[0]) and torch.equal(p[1], e[1])
        assert torch.equal(emulated[0][0], torch.full((N,), 3.0))
        t = emulated.trace
        t0 = t.comm(0)[0]["launch"]                   # both ranks launch at t0 (after filling)
        assert t.comm(1)[0]["launch"] == t0
        # The ranks' links disagree on the order: both take them by when the last member
        # launched them (a at t0 + late), ties by rank 0's order (a first).
        if not late:
            expected = {"a": (t0, t0 + c), "b": (t0 + c, t0 + 2 * c)}
        else:
            expected = {"b": (t0, t0 + c), "a": (t0 + late, t0 + late + c)}
        for r, order in ((0, "ab"), (1, "ba")):
            for name, e in zip(order, t.comm(r, op="all_reduce")):
                assert (e["start"], e["end"]) == pytest.approx(expected[name], rel=1e-12), \
                    (late, r, name)
        end = max(v[1] for v in expected.values())
        assert [e[2] for e in emulated] == pytest.approx([end, end], rel=1e-12)


def _poll(rank, world_size, compute_s):
    t = torch.ones(N)
    work = dist.all_reduce(t, async_op=True)
    trace.compute(compute_s)
    done = work.is_completed()
    work.wait()
    return done, trace.completed_at(work), t[0].item()


def test_is_completed_and_completed_at_answer_on_the_virtual_clock():
    c = comm_seconds("all_reduce", N * 4, 2, A100.intra)
    early = distlab.run(_poll, 2, c / 2, emulate=A100, timeout=20)
    late = distlab.run(_poll, 2, 2 * c, emulate=A100, timeout=20)
    assert [r[0] for r in early] == [False, False] and [r[0] for r in late] == [True, True]
    launched = early.trace.comm(0)[0]["launch"]
    assert early[0][1] == pytest.approx(launched + c, rel=1e-12)
    assert [r[2] for r in early + late] == [2.0] * 4


def _never_waited(rank, world_size):
    t = torch.ones(N)
    dist.all_reduce(t, async_op=True)        # dropped: the run's end still learns its times
    return trace.now()


def test_a_transfer_never_waited_for_gets_its_times_at_the_end_of_the_run():
    results = distlab.run(_never_waited, 2, emulate=A100, timeout=20)
    event = results.trace.comm(1)[0]
    c = comm_seconds("all_reduce", N * 4, 2, A100.intra)
    assert event["end"] - event["start"] == pytest.approx(c, rel=1e-12)


# ---- full size on the meta device (issue 27 item 2) -------------------------------------------

def _tp_layer(rank, world_size, device):
    """A tensor-parallel RMSNorm → column → SiLU → row layer, forward and backward, then a
    gather of one gradient and a message around the ring: every kind of transfer."""
    from distlab.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    torch.manual_seed(0)
    with torch.device(device):
        norm = torch.nn.RMSNorm(64)
        up = ColumnParallelLinear(64, 96, bias=False)
        down = RowParallelLinear(96, 64)
        x = torch.randn(2, 16, 64, requires_grad=True)
    y = down(torch.nn.functional.silu(up(norm(x))))
    y.pow(2).mean().backward()
    out = torch.empty(world_size * down.bias.numel(), device=device)
    dist.all_gather_into_tensor(out, down.bias.grad)
    right, left = (rank + 1) % world_size, (rank - 1) % world_size
    inbox = torch.empty(64, device=device)
    requests = [dist.isend(out[:64].contiguous(), right), dist.irecv(inbox, left)]
    for request in requests:
        request.wait()
    return trace.now(), tuple(out.shape), out.device.type


def _timeline(t, rank):
    return ([(s["name"], s["start"], s["end"], s["flops"]) for s in t.compute(rank)],
            [(e["op"], e["bytes"], e["launch"], e["start"], e["end"], e["waited"])
             for e in t.comm(rank)])


def test_meta_tensors_cost_what_real_tensors_of_the_same_shape_cost(capsys):
    real = distlab.run(_tp_layer, 3, "cpu", emulate=A100, timeout=30)
    assert "values not computed" not in capsys.readouterr().out
    meta = distlab.run(_tp_layer, 3, "meta", emulate=A100, timeout=30)
    assert "values not computed: meta tensors" in capsys.readouterr().out
    assert meta.trace.meta and not real.trace.meta
    assert [r[1:] for r in meta] == [((192,), "meta")] * 3
    for rank in range(3):
        assert _timeline(meta.trace, rank) == _timeline(real.trace, rank)
        assert meta.trace.totals(rank) == real.trace.totals(rank)
    assert [r[0] for r in meta] == [r[0] for r in real]
    assert "values not computed: meta tensors" in meta.trace.summary()


def _attention(rank, world_size, device):
    torch.manual_seed(0)
    with torch.device(device):
        q, k, v = (torch.randn(2, 4, 32, 16, dtype=torch.bfloat16, requires_grad=True)
                   for _ in range(3))
    y = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    y.float().pow(2).mean().backward()
    return trace.now()


def test_attention_on_meta_tensors_takes_the_kernel_real_tensors_take():
    # On meta, torch would take the unfused math path (t × t scores in memory); emulation sends
    # it to the CPU's fused kernel, so both are charged the same ops.
    real = distlab.run(_attention, 1, "cpu", emulate=A100, timeout=30)
    meta = distlab.run(_attention, 1, "meta", emulate=A100, timeout=30)
    assert _timeline(meta.trace, 0) == _timeline(real.trace, 0) and meta[0] == real[0]


def _attention_flops(rank, world_size, causal):
    q, k, v = (torch.randn(2, 4, 64, 16, requires_grad=True) for _ in range(3))
    torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal).sum().backward()


def test_fused_attention_is_charged_its_flops_and_causal_half_of_them():
    """The CPU's flash kernel is not in torch's flop counter: charged as the GPU's flash kernel
    (4·b·h·s²·d forward, 2.5× that backward), half of it when causal (masked blocks skipped)."""
    full, causal = (sum(s["flops"] for s in distlab.run(
        _attention_flops, 1, masked, emulate=A100, timeout=30).trace.compute(0))
        for masked in (False, True))
    forward = 4 * 2 * 4 * 64 * 64 * 16
    assert full >= forward * 3.5                    # forward + backward's 2.5×, plus the sum
    assert causal == pytest.approx(full - (forward * 3.5) / 2, rel=1e-9)


def _bucketed_ddp(rank, world_size, device):
    import torch.nn.functional as F
    from distlab.data_parallel import BucketedDDP
    with torch.device(device):
        torch.manual_seed(0)
        model = torch.nn.Sequential(*[torch.nn.Linear(128, 128) for _ in range(4)])
        x, y = torch.randn(16, 128), torch.randn(16, 128)
    ddp = BucketedDDP(model, bucket_cap_mb=0.1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(2):
        opt.zero_grad()
        F.mse_loss(ddp(x), y).backward()
        opt.step()
    return trace.now()


def test_the_course_ddp_on_meta_tensors_has_the_timeline_of_real_ones():
    real = distlab.run(_bucketed_ddp, 2, "cpu", emulate=A100, timeout=30)
    meta = distlab.run(_bucketed_ddp, 2, "meta", emulate=A100, timeout=30)
    assert len(real.trace.comm(0, op="all_reduce")) >= 4          # several buckets per step
    for rank in range(2):
        assert _timeline(meta.trace, rank) == _timeline(real.trace, rank)
    assert list(meta) == list(real)


HUGE = 25_000_000_000                    # float32 elements: 100 GB, far more than this machine


def _huge(rank, world_size):
    t = torch.empty(HUGE, device="meta")
    dist.all_reduce(t)
    gathered = torch.empty(world_size * HUGE, device="meta")
    dist.all_gather_into_tensor(gathered, t, async_op=True).wait()
    if rank == 0:
        dist.send(t, 1)
    else:
        dist.recv(t, 0)
    return trace.now()


def test_meta_communication_never_reaches_gloo():
    results = distlab.run(_huge, 2, emulate=A100, timeout=30)
    link = A100.intra
    for rank, op, nbytes in ((0, "all_reduce", HUGE * 4), (1, "all_gather", 2 * HUGE * 4),
                             (0, "send", HUGE * 4)):
        e = results.trace.comm(rank, op=op)[0]
        assert e["bytes"] == nbytes
        assert e["end"] - e["start"] == pytest.approx(comm_seconds(op, nbytes, 2, link), rel=1e-9)
    assert results[1] >= results.trace.comm(0, op="send")[0]["end"]


def _needs_a_value(rank, world_size):
    return torch.ones(4, device="meta").sum().item()


def test_code_that_needs_a_value_of_a_meta_tensor_gets_a_sentence():
    with pytest.raises(distlab.RankFailed, match="raised MetaValueError: `.item\\(\\)`.* needs "
                       "the values of a tensor on the meta device.*run this code on real tensors "
                       "at a small size"):
        distlab.run(_needs_a_value, 1, emulate=A100, timeout=20)


def _said(rank, world_size):
    x = torch.ones(4, device="meta")
    tries = {"item": lambda: x.sum().item(), "tolist": lambda: x.tolist(),
             "if": lambda: 1 if x.sum() > 0 else 0, "mask": lambda: x[x > 0]}
    said = {}
    for name, needs in tries.items():
        try:
            needs()
        except trace.MetaValueError as e:
            said[name] = str(e)
    return said


def test_every_way_of_reading_a_meta_value_gets_the_sentence():
    said = distlab.run(_said, 1, emulate=A100, timeout=20)[0]
    assert sorted(said) == ["if", "item", "mask", "tolist"]
    for sentence in said.values():
        assert sentence.endswith("run this code on real tensors at a small size to see values.")
        assert sentence.count(". ") == 0                         # one sentence


def test_meta_tensors_in_a_run_that_is_not_emulated_get_a_sentence():
    with pytest.raises(distlab.RankFailed, match="all_reduce got a tensor on the meta device.*"
                       "emulate="):
        distlab.run(_huge, 2, trace=True, timeout=20)


def _fullsize():
    import importlib.util
    import os
    import sys
    import cloudpickle
    path = os.path.join(os.path.dirname(__file__), "..", "bench", "fullsize.py")
    spec = importlib.util.spec_from_file_location("distlab_bench_fullsize", path)
    module = sys.modules.setdefault(spec.name, importlib.util.module_from_spec(spec))
    spec.loader.exec_module(module)
    cloudpickle.register_pickle_by_value(module)      # the ranks cannot import bench/
    return module


def test_the_full_size_benchmark_runs_a_small_llama_block():
    fullsize = _fullsize()
    config = dict(fullsize.LLAMA2_7B, hidden=256, heads=4, ffn=688)
    r = fullsize.measure(2, "h100-nvlink", config, tokens=128, timeout=60)
    assert r["meta"] and r["collectives"] == 4                 # 2 forward, 2 backward
    assert r["comm_bytes"] == 4 * 128 * 256 * 2
    assert r["flops"] == r["closed_form_flops"]
    assert r["seconds"] > 0 and r["ratio"] >= 1.0


def test_the_full_size_benchmark_runs_a_small_data_parallel_step():
    fullsize = _fullsize()
    config = dict(fullsize.TINYLLAMA, layers=2, hidden=128, heads=4, ffn=344, vocab=512)
    r = fullsize.measure_dp(2, "h100-nvlink", config, tokens=64, timeout=60)
    assert r["meta"] and r["buckets"] >= 1
    assert r["comm_bytes"] == r["params"] * 2                  # every bf16 gradient, once
    assert r["seconds"] > 0 and r["flops"] > 0


def _returns_meta(rank, world_size):
    with torch.device("meta"):
        w = torch.nn.Linear(8, 4)
    return w(torch.ones(2, 8, device="meta"))


def test_a_meta_tensor_a_rank_returns_comes_back_as_its_shape():
    out = distlab.run(_returns_meta, 1, emulate=A100, timeout=20)[0]
    assert out.is_meta and out.shape == (2, 4) and not out.requires_grad


# ---- what the CPU backend does on its own is not billed as device work (issue 42 item 10) ------

def _collectives_alone(rank, world_size):
    """Each collective between two reads of the clock, nothing else: its time is the link's."""
    x, out = torch.ones(2 * world_size), torch.empty(2)
    times = []
    for call in (lambda: dist.reduce_scatter_tensor(out, x),
                 lambda: dist.reduce_scatter_tensor(out, x, async_op=True).wait(),
                 lambda: dist.barrier()):
        before = trace.now()
        call()
        times.append(trace.now() - before)
    return times, out.tolist()


def test_a_collective_costs_its_modelled_time_and_not_gloos_copies():
    """gloo finishes reduce_scatter_tensor with a copy of its own at wait(), and barrier with a
    scratch tensor: neither is a device op on an H100 (before: each billed the 10 µs floor)."""
    link = PRESETS["h100-node"].intra
    results = distlab.run(_collectives_alone, 2, emulate="h100-node", timeout=30)
    scatter = comm_seconds("reduce_scatter", 4 * 4, 2, link)
    barrier = comm_seconds("barrier", 4, 2, link)
    for times, values in results:
        assert times == pytest.approx([scatter, scatter, barrier], rel=1e-12)
        assert values == [2.0, 2.0]            # the values are gloo's, exact


@pytest.mark.parametrize("call, words", [
    (lambda: emulate.resolve("h100"), "emulate must be the name of a preset"),
    (lambda: emulate.resolve(8), "emulate must be the name of a preset"),
    (lambda: comm_seconds("all_reduce", -1, 4, cost.PRESETS["nvlink4"]), "nbytes.*got -1"),
    (lambda: comm_seconds("all_reduce", float("nan"), 4, A100.intra), "nbytes.*got nan"),
    (lambda: comm_seconds("all_reduce", 1e6, 0, cost.PRESETS["nvlink4"]), "world_size >= 1"),
    (lambda: comm_seconds("allreduce", 1e6, 4, cost.PRESETS["nvlink4"]),
     "unknown collective 'allreduce'"),
    (lambda: comm_seconds("all_reduce", 1e6, 4, None), "link must be"),
])
def test_bad_calls_to_the_emulator_are_refused_in_one_sentence(call, words):
    """Single process: what a learner may call by hand (a preset by name, a link's time)."""
    with pytest.raises(ValueError, match=words) as info:
        call()
    assert "\n" not in str(info.value) and str(info.value).endswith(".")
