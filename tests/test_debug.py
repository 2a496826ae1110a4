"""Chapter 11: the detectors find each bug class, the correct loop equals one process, and the
workbook's checkers pass the fixes and reject the broken versions with the right sentence."""
import pytest
import torch
import torch.distributed as dist

import distlab
from distlab import debug
from distlab.checks import CheckFailed, ch11
from distlab.models import make_mlp

T = 120


# ---- the broken pieces (module level: conftest sends them to the ranks by value) -----------------

def no_sampler(x, y, rank, world_size):
    n = len(x) // world_size
    return x[:n], y[:n]


def strided(x, y, rank, world_size):
    return x[rank::world_size], y[rank::world_size]


def summed(model):
    for p in model.parameters():
        dist.all_reduce(p.grad)


def not_reduced(model):
    for p in model.parameters():
        p.grad /= dist.get_world_size()


def rank_seeded(rank):
    return make_mlp((16, 32, 4), seed=rank).double()


def _max_diff(a, b):
    return max((x - y).abs().max().item() for x, y in zip(a, b))


# ---- the loop and the detectors ------------------------------------------------------------------

@pytest.mark.parametrize("world_size", [1, 3, 4])
def test_correct_loop_equals_one_process(world_size):
    ref = debug.reference()
    got = distlab.run(debug.train_data_parallel, world_size, watch=True, timeout=T)
    for r in got:
        assert r["losses"] == pytest.approx(ref["losses"], abs=1e-12, rel=1e-12)
        assert _max_diff(r["params"], ref["params"]) < 1e-12
        assert r["out_of_sync"] == [0] * 4 and r["duplicated"] == [0] * 4


def _three_loops(rank, world_size):
    # One launch, three trainings: duplicated data, drifting replicas, and both fixed.
    return (debug.train_data_parallel(rank, world_size, shard=no_sampler, watch=True),
            debug.train_data_parallel(rank, world_size, build=rank_seeded, watch=True),
            debug.train_data_parallel(rank, world_size, build=rank_seeded,
                                      sync=debug.broadcast_parameters, shard=strided, watch=True))


@pytest.mark.parametrize("world_size", [2, 3])
def test_detectors_tell_the_bugs_apart(world_size):
    ref = debug.reference()
    dup, drift, fixed = zip(*distlab.run(_three_loops, world_size, timeout=T))
    assert all(r["duplicated"] == [12 // world_size] * 4 for r in dup)
    assert all(r["out_of_sync"] == [0] * 4 for r in dup)
    assert _max_diff(dup[0]["params"], ref["params"]) > 1e-4
    assert all(r["out_of_sync"] == [4] * 4 and r["duplicated"] == [0] * 4 for r in drift)
    for r in fixed:
        assert r["out_of_sync"] == [0] * 4 and r["duplicated"] == [0] * 4
        assert _max_diff(r["params"], ref["params"]) < 1e-12


def _first_update(rank, world_size, average):
    model, _ = debug.problem()
    before = [p.detach().clone() for p in model.parameters()]
    after = debug.train_data_parallel(rank, world_size, average=average, steps=1)["params"]
    return [b - a for a, b in zip(after, before)]


def _good_and_summed(rank, world_size):
    return (_first_update(rank, world_size, debug.average_gradients),
            _first_update(rank, world_size, summed))


@pytest.mark.parametrize("world_size", [2, 3])
def test_gradient_scale_names_summed_and_unreduced(world_size):
    model, _ = debug.problem()
    ref = [b - a for a, b in zip(debug.reference(steps=1)["params"], model.parameters())]
    good, bad = distlab.run(_good_and_summed, world_size, timeout=T)[0]
    assert debug.gradient_scale(good, ref) == pytest.approx(1, abs=1e-10)
    scale = debug.gradient_scale(bad, ref)
    assert scale == pytest.approx(world_size, rel=1e-10)
    assert "summed, not averaged" in debug.explain_gradient_scale(scale, world_size)
    assert "averaged" in debug.explain_gradient_scale(1.0, world_size)
    assert "not a plain average" in debug.explain_gradient_scale(0.7, world_size)


def _perturbed(rank, world_size):
    model, _ = debug.problem()
    clean = debug.replicas_out_of_sync(model)
    with torch.no_grad():
        if rank == world_size - 1:
            model.net[2].bias[1] += 1e-13
    bias_only = debug.replicas_out_of_sync(model)
    with torch.no_grad():
        if rank == 0:
            w = model.net[0].weight
            w[0, 0], w[0, 1] = w[0, 1].clone(), w[0, 0].clone()
    return clean, bias_only, debug.replicas_out_of_sync(model)


@pytest.mark.parametrize("world_size", [2, 3])
def test_replicas_out_of_sync_names_parameters_on_every_rank(world_size):
    got = distlab.run(_perturbed, world_size, timeout=T)
    for clean, bias_only, both in got:
        assert clean == []
        assert bias_only == ["net.2.bias"]
        assert both == ["net.0.weight", "net.2.bias"]


def _overlap(rank, world_size):
    # Rank r holds samples r .. r+3 of one list: neighbours share 3, and rank 0's first is its own.
    data = torch.arange(40, dtype=torch.float64).reshape(10, 4)
    mine = data[rank:rank + 4]
    return debug.duplicated_samples(torch.cat([mine, mine[:1]]))  # a repeat within one rank


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_duplicated_samples_counts_overlap_across_ranks_only(world_size):
    expected = len({i for r in range(1, world_size) for i in range(r, r + 4)
                    if any(i in range(q, q + 4) for q in range(r))})
    assert distlab.run(_overlap, world_size, timeout=T) == [expected] * world_size


def test_sample_fingerprints_are_per_row_and_stable():
    x = torch.tensor([[1.0, 2.0], [1.0, 2.0], [2.0, 1.0]])
    f = debug.sample_fingerprints(x)
    assert f[0] == f[1] != f[2] and f == debug.sample_fingerprints(x.clone())
    assert all(0 <= v < 2 ** 63 for v in f)


# ---- hangs: what gloo does, measured ---------------------------------------------------------------

def _mixed_order(rank, world_size):
    debug.detail_process_group(timeout_s=30)
    t = torch.ones(4)
    if rank == 0:
        dist.all_reduce(t)
    else:
        dist.broadcast(t, src=0)


def _mixed_shape(rank, world_size):
    debug.detail_process_group(timeout_s=30)
    dist.all_reduce(torch.ones(3 if rank == 1 else 4))


@pytest.mark.parametrize("fn, aspect", [(_mixed_order, "Op type"), (_mixed_shape, "shapes")])
def test_detail_turns_mismatches_into_errors(fn, aspect):
    with pytest.raises(distlab.RankFailed, match="Detected mismatch between collectives") as e:
        distlab.run(fn, 3, init=False, timeout=60)
    assert aspect in str(e.value)


def test_profile_and_step_times_report_every_rank():
    profiles = distlab.run(debug.profile_ddp_steps, 2, timeout=T)
    for p in profiles:
        assert set(p["ms"]) == {"forward", "backward", "optimizer", "communication"}
        assert p["ms"]["communication"] > 0 and len(p["top"]) == 5
    # Whether the all-reduce makes the top 5 depends on the load; that it is measured does not.
    times = distlab.run(debug.step_times, 3, slow_rank=1, delay=0.01, steps=2, timeout=T)
    assert all(len(t["compute"]) == len(t["wait"]) == 2 for t in times)


REAL = dict(hidden=8192, layers=2, tokens=8192)       # chapter 11's real-size step


def _straggler_lesson(rank, world_size):
    return (debug.step_times(rank, world_size, steps=1, real_size=REAL),
            debug.step_times(rank, world_size, slow_rank=1, slowdown=0.10, steps=1,
                             real_size=REAL))


def test_ch11_straggler_numbers_are_the_emulated_runs():
    # Every number chapter 11's straggler prose quotes, re-computed on the calibrated preset.
    import pathlib
    import nbformat
    from distlab import cost, emulate
    path = pathlib.Path(__file__).resolve().parent.parent / "notebooks" / "11_debugging.ipynb"
    text = " ".join(c.source for c in nbformat.read(path, as_version=4).cells
                    if c.cell_type == "markdown").replace("\n", " ")
    equal, slow = zip(*distlab.run(_straggler_lesson, 8, emulate="h100-node", timeout=T))
    compute, comm = equal[0]["compute"][0], equal[0]["wait"][0]
    assert all(r["compute"] == [compute] and r["wait"] == [comm] for r in equal)
    h = REAL["hidden"]
    params = REAL["layers"] * (2 * 4 * h * h + 5 * h)
    link = emulate.PRESETS["h100-node"].intra
    assert comm == pytest.approx(cost.predict("ring_all_reduce", 2 * params, 8, link), rel=1e-6)
    assert link.busbw("all_reduce") == 480e9
    step = compute + comm
    slow_step = slow[1]["compute"][0] + slow[1]["wait"][0]
    extra = slow[1]["compute"][0] - compute
    # every rank ends the step together: the healthy ones wait the straggler's extra compute
    for r, t in enumerate(slow):
        assert t["compute"][0] + t["wait"][0] == pytest.approx(slow_step, rel=1e-9)
        if r != 1:
            assert t["wait"][0] == pytest.approx(comm + extra, rel=1e-6)
    quoted = (f"a step is {compute * 1e3:.1f} ms of compute and the {comm * 1e3:.1f} ms all-reduce",
              f"figure for {2 * params / 1e9:.1f} GB on NVLink SHARP's achieved 480 GB/s",
              f"its extra {extra * 1e3:.1f} ms of compute lands on **every** rank",
              f"the step grows from {step * 1e3:.1f} to {slow_step * 1e3:.1f} ms",
              f"the size of a {round(params / 1e9)}B-parameter model",
              "one GPU 10 % slow costs")
    for q in quoted:
        assert q in text, q


# ---- the workbook's checkers: fixes pass, broken versions fail with the right sentence -------------

def mean_loss_fixed(loss, rank, world_size):
    dist.all_reduce(loss)
    return loss / world_size


def mean_loss_hangs(loss, rank, world_size):
    if rank == 0:
        dist.all_reduce(loss)
        return loss / world_size
    return loss


def sync_fixed(model):
    debug.broadcast_parameters(model)


def differ_fixed(model):
    return bool(debug.replicas_out_of_sync(model))


def differ_sum_only(model):
    total = torch.stack([p.detach().double().sum() for p in model.parameters()])
    lo, hi = total.clone(), total.clone()
    dist.all_reduce(lo, op=dist.ReduceOp.MIN)
    dist.all_reduce(hi, op=dist.ReduceOp.MAX)
    return not torch.equal(lo, hi)


def test_checkers_pass_the_fixes(capsys):
    ch11.check_mean_loss(mean_loss_fixed)
    ch11.check_my_shard(strided)
    ch11.check_average_gradients(debug.average_gradients)
    ch11.check_sync_replicas(sync_fixed)
    ch11.check_replicas_differ(differ_fixed)
    assert capsys.readouterr().out.count("✅") == 5


def test_checkers_reject_the_bugs(monkeypatch):
    distlab.run(lambda rank, world_size: None, 2)  # the forkserver is up: the limit is all hang
    monkeypatch.setattr(ch11, "TIMEOUT", 4)
    with pytest.raises(CheckFailed, match="mean_loss (hung with|with) world_size=2.*every rank must "
                                          "call the same collectives"):
        ch11.check_mean_loss(mean_loss_hangs)
    monkeypatch.setattr(ch11, "TIMEOUT", 60)
    with pytest.raises(CheckFailed, match="ranks 0 and 1 both got the same sample"):
        ch11.check_my_shard(no_sampler)
    with pytest.raises(CheckFailed, match="gradients are 2x the single-process ones: they were summed"):
        ch11.check_average_gradients(summed)
    with pytest.raises(CheckFailed, match="they are not a plain average"):
        ch11.check_average_gradients(not_reduced)
    with pytest.raises(CheckFailed, match="4 parameter tensors still differ"):
        ch11.check_sync_replicas(lambda model: None)
    with pytest.raises(CheckFailed, match="case 'two elements swapped on rank 1': rank 0 returned False"):
        ch11.check_replicas_differ(differ_sum_only)


def test_unsolved_stub_is_one_line_not_implemented():
    def stub(*args):
        raise NotImplementedError("exercise: replace this line with your code")
    with pytest.raises(NotImplementedError, match="mean_loss is not written yet"):
        ch11.check_mean_loss(stub)


# ---- exercises 6 and 7: TP/PP bugs (issue 14) ------------------------------------------------------

def pipeline_forward(x, stage_fn, rank, pp, dp):
    stage = rank // dp
    if stage > 0:
        dist.recv(x, src=rank - dp)
    y = stage_fn(x)
    if stage < pp - 1:
        dist.send(y, dst=rank + dp)
    return y


def pipeline_forward_batched(x, stage_fn, rank, pp, dp):
    # Differently written: DeviceMesh-free peers from divmod, batch_isend_irecv.
    from torch.distributed import P2POp, batch_isend_irecv, irecv, isend
    stage, replica = divmod(rank, dp)
    if stage > 0:
        for w in batch_isend_irecv([P2POp(irecv, x, (stage - 1) * dp + replica)]):
            w.wait()
    y = stage_fn(x)
    if stage < pp - 1:
        isend(y, (stage + 1) * dp + replica).wait()
    return y


def pipeline_forward_next_rank(x, stage_fn, rank, pp, dp):
    # The bug: the next rank, not the next stage of this replica.
    stage = rank // dp
    if stage > 0:
        dist.recv(x, src=rank - 1)
    y = stage_fn(x)
    if stage < pp - 1:
        dist.send(y, dst=rank + 1)
    return y


def pipeline_forward_relay(x, stage_fn, rank, pp, dp):
    # Right values, wrong route: each stage's replica 0 collects and forwards for everyone.
    stage, replica = divmod(rank, dp)
    if stage > 0 and replica == 0:
        for d in range(dp):
            buf = torch.empty_like(x)
            dist.recv(buf, src=(stage - 1) * dp + d)
            if d == 0:
                x = buf
            else:
                dist.send(buf, dst=stage * dp + d)
    elif stage > 0:
        dist.recv(x, src=stage * dp)
    y = stage_fn(x)
    if stage < pp - 1:
        dist.send(y, dst=(stage + 1) * dp)
    return y


def test_pipeline_forward_checker(capsys):
    ch11.check_pipeline_forward(pipeline_forward)
    ch11.check_pipeline_forward(pipeline_forward_batched)
    assert capsys.readouterr().out.count("✅") == 2
    # A hang, or (when the peer that never answers has already finished) a wait that ended early.
    with pytest.raises(CheckFailed, match=r"world_size=4.*; stage s of replica d is rank "
                                          r"s\*dp \+ d, so the next stage of the same replica is dp "
                                          r"ranks away, not one"):
        ch11.check_pipeline_forward(pipeline_forward_next_rank)
    with pytest.raises(CheckFailed, match=r"pp=2 stages x dp=2 replicas: rank 1 sent 16 bytes to "
                                          r"rank 2; stage 0 of replica 1 only sends to rank 3"):
        ch11.check_pipeline_forward(pipeline_forward_relay)
    with pytest.raises(CheckFailed, match="course's own _reference_pipeline_forward"):
        ch11.check_pipeline_forward(ch11._reference_pipeline_forward)


def sync_sp(block, group):
    for ln in (block.ln1, block.ln2):
        for p in ln.parameters():
            dist.all_reduce(p.grad, group=group)


def sync_sp_flat(block, group):
    # Differently written: one flat buffer, an imported all_reduce, ReduceOp.SUM.
    from torch.distributed import ReduceOp, all_reduce
    grads = [p.grad for ln in (block.ln1, block.ln2) for p in ln.parameters()]
    flat = torch.cat([g.flatten() for g in grads])
    all_reduce(flat, op=ReduceOp.SUM, group=group)
    for g, part in zip(grads, flat.split([g.numel() for g in grads])):
        g.copy_(part.view_as(g))


def sync_everything_averaged(block, group):
    # The data-parallel habit: average every gradient, tensor-parallel shards included.
    for p in block.parameters():
        dist.all_reduce(p.grad, op=dist.ReduceOp.AVG, group=group)


def sync_everything_summed(block, group):
    for p in block.parameters():
        dist.all_reduce(p.grad, group=group)


def sync_sp_world(block, group):
    for ln in (block.ln1, block.ln2):
        for p in ln.parameters():
            dist.all_reduce(p.grad)


def test_sequence_parallel_grads_checker(capsys):
    ch11.check_sequence_parallel_grads(sync_sp)
    ch11.check_sequence_parallel_grads(sync_sp_flat)
    assert capsys.readouterr().out.count("✅") == 2
    with pytest.raises(CheckFailed, match=r"tp=2 \(inside 4 ranks: dp=2\): rank 0's ln1.weight "
                                          r"gradient is 0.\d+ times the dense one's norm: each "
                                          r"rank's LayerNorm saw only its 1/2 of the sequence"):
        ch11.check_sequence_parallel_grads(lambda block, group: None)
    with pytest.raises(CheckFailed, match=r"ln1.weight gradient is 1/2 of the dense one: .*summed, "
                                          r"not averaged"):
        ch11.check_sequence_parallel_grads(sync_everything_averaged)
    with pytest.raises(CheckFailed, match=r"attn.qkv.weight gradient is wrong: it belongs to a "
                                          r"tensor-parallel shard"):
        ch11.check_sequence_parallel_grads(sync_everything_summed)
    with pytest.raises(CheckFailed, match=r"rank 0's all_reduce ran over ranks \[0, 1, 2, 3\]; a "
                                          r"LayerNorm's gradient is split over the sequence shards "
                                          r"of ONE tp group, ranks \[0, 1\]"):
        ch11.check_sequence_parallel_grads(sync_sp_world)
    with pytest.raises(CheckFailed, match="course's own _reference_sp_sync"):
        ch11.check_sequence_parallel_grads(ch11._reference_sp_sync)
