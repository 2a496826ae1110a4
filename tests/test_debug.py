"""Chapter 11: the detectors find each bug class, the correct loop equals one process, and the
workbook's checkers pass the fixes and reject the broken versions with the right sentence."""
import re

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import distlab
from distlab import debug
from distlab.checks import ch11
from distlab.models import make_mlp

from checker_battery import battery, ring_all_reduce

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
    from distlab import nan_debug
    model, batches = debug.problem()
    x, y = batches[0]
    torch.nn.functional.mse_loss(model(x), y).backward()
    finite = nan_debug.first_nonfinite_gradient(model)          # must not flag
    with torch.no_grad():
        if rank >= 1:            # ranks 1.. : the last one's inf comes after rank 1's nan
            model.net[2 if rank == 1 else 0].weight.grad[0, 0] = float(
                "nan" if rank == 1 else "inf")
    nonfinite = nan_debug.first_nonfinite_gradient(model)       # must catch: the first rank
    model.zero_grad()
    clean = debug.replicas_out_of_sync(model)
    with torch.no_grad():
        if rank == world_size - 1:
            model.net[2].bias[1] += 1e-13
    bias_only = debug.replicas_out_of_sync(model)
    with torch.no_grad():
        if rank == 0:
            w = model.net[0].weight
            w[0, 0], w[0, 1] = w[0, 1].clone(), w[0, 0].clone()
    return clean, bias_only, debug.replicas_out_of_sync(model), finite, nonfinite


@pytest.mark.parametrize("world_size", [2, 3])
def test_replicas_out_of_sync_names_parameters_on_every_rank(world_size):
    # also nan_debug.first_nonfinite_gradient (chapter 11 §5a): nothing on finite gradients;
    # rank 1's NaN in net.2.weight before any later rank's inf, the same on every rank
    got = distlab.run(_perturbed, world_size, timeout=T)
    for clean, bias_only, both, finite, nonfinite in got:
        assert finite is None
        assert nonfinite[:2] == (1, "net.2.weight") and nonfinite[2] != nonfinite[2]
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
    # Every number chapter 11b's straggler prose quotes, re-computed on the calibrated preset.
    import pathlib
    import nbformat
    from distlab import cost, emulate
    path = pathlib.Path(__file__).resolve().parent.parent / "notebooks" / "11b_performance.ipynb"
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
    # §5: the compute rate counted as 6·N FLOPs a token sits a little above the matmul cap (the
    # MAMF calibration row), by less than the first layer's uncomputed input gradient (1/12)
    from distlab import hardware, nan_debug
    rate = nan_debug.flops_per_token(params, REAL["layers"], h, seq_len=0) * REAL["tokens"] / compute
    mamf = hardware.H100.gemm_max * hardware.H100.peak(torch.bfloat16)
    assert 1.0 < rate / mamf < 12 / 11
    assert f"It comes out {round(100 * (rate / mamf - 1))} % above that row" in text


# ---- the workbook's checkers, each through the battery (tests/checker_battery.py): the solution
# ---- and a differently written answer pass; a wrong one, a cheat and a decoy are refused, each in
# ---- one sentence (the solutions themselves also pass under nbval) ------------------------------
# The checkers judge traffic by the one rule (distlab/checks/_traffic.py): messages of send/recv
# count as the collective of the same bytes, and what the calls DELIVERED must hold the answer's
# data, so some answers below go by hand-written messages, and some decoys send zeros.

def report_reduced(loss, rank, world_size):
    # The workbook's way: a sum, a max, and the lowest rank offering the max.
    total, top = loss.detach().clone(), loss.detach().clone()
    dist.all_reduce(total)
    dist.all_reduce(top, op=dist.ReduceOp.MAX)
    offer = torch.tensor(rank if loss.item() == top.item() else world_size)
    dist.all_reduce(offer, op=dist.ReduceOp.MIN)
    return total.item() / world_size, offer.item()


def report_gathered(loss, rank, world_size):
    # Differently written: gather every loss, argmax takes the first maximum.
    losses = [torch.zeros((), dtype=loss.dtype) for _ in range(world_size)]
    dist.all_gather(losses, loss)
    stacked = torch.stack(losses)
    return stacked.mean(), int(stacked.argmax())


def report_own_guess(loss, rank, world_size):
    # Wrong: the mean is right, but each rank names itself or nobody: the ranks disagree.
    top = loss.clone()
    dist.all_reduce(top, op=dist.ReduceOp.MAX)
    total = loss.clone()
    dist.all_reduce(total)
    return total / world_size, rank if loss == top else -1


def report_highest_on_tie(loss, rank, world_size):
    # Decoy: right whenever one rank holds the largest loss; on a tie it names the highest rank.
    total, top = loss.detach().clone(), loss.detach().clone()
    dist.all_reduce(total)
    dist.all_reduce(top, op=dist.ReduceOp.MAX)
    offer = torch.tensor(rank if loss.item() == top.item() else -1)
    dist.all_reduce(offer, op=dist.ReduceOp.MAX)
    return total.item() / world_size, offer.item()


def report_cheat(loss, rank, world_size):
    return ch11._expected_report([loss.item()] * world_size)


def report_objects(loss, rank, world_size):
    # A cheat: the losses pickled through an object collective.
    losses = [None] * world_size
    dist.all_gather_object(losses, loss.item())
    return sum(losses) / world_size, losses.index(max(losses))


def test_loss_report_checker():
    said = battery(ch11.check_loss_report, correct=[report_reduced], different=[report_gathered],
                   wrong=[report_own_guess], cheat=[report_cheat, report_objects],
                   decoy=[report_highest_on_tie])
    assert re.search(r"world_size=2, case 'every rank's loss different', rank \d: worst rank -1",
                     said["wrong"][0])
    assert "checker's own _expected_report" in said["cheat"][0]
    assert "all_gather_object" in said["cheat"][1]
    assert "case 'a tie for the largest loss'" in said["decoy"][0]


def accumulate(model, micro_batches):
    # The workbook's way: the global count first, each micro-batch weighted n_i / N, one sum.
    total = torch.tensor(float(sum(len(x) for x, _ in micro_batches)), dtype=torch.float64)
    dist.all_reduce(total)
    for x, y in micro_batches:
        (F.mse_loss(model(x), y) * (len(x) / total)).backward()
    for p in model.parameters():
        dist.all_reduce(p.grad)


def accumulate_packed_ring(model, micro_batches):
    # Differently written: summed losses, the count packed with the gradients in one flat buffer,
    # summed around a hand-written ring of send/recv (one packed message per hop).
    n = 0
    for x, y in micro_batches:
        F.mse_loss(model(x), y, reduction="sum").div(y.shape[1]).backward()
        n += len(x)
    grads = [p.grad for p in model.parameters()]
    flat = torch.cat([g.flatten() for g in grads] + [grads[0].new_tensor([float(n)])])
    flat = ring_all_reduce(flat, list(range(dist.get_world_size())))
    for g, part in zip(grads, flat[:-1].split([g.numel() for g in grads])):
        g.copy_(part.view_as(g) / flat[-1])


def accumulate_gathered_grads(model, micro_batches):
    # Differently written: every rank's weighted gradients all-gathered and added locally.
    n = torch.tensor([float(sum(len(x) for x, _ in micro_batches))], dtype=torch.float64)
    counts = [torch.empty_like(n) for _ in range(dist.get_world_size())]
    dist.all_gather(counts, n)
    total = sum(counts).item()
    for x, y in micro_batches:
        (F.mse_loss(model(x), y) * len(x) / total).backward()
    for p in model.parameters():
        parts = [torch.empty_like(p.grad) for _ in range(dist.get_world_size())]
        dist.all_gather(parts, p.grad)
        p.grad.copy_(sum(parts))


def accumulate_given(model, micro_batches):
    # Wrong: the workbook's loop, every micro-batch weighted alike.
    for x, y in micro_batches:
        (F.mse_loss(model(x), y) / len(micro_batches)).backward()
    for p in model.parameters():
        dist.all_reduce(p.grad, op=dist.ReduceOp.AVG)


def accumulate_per_rank(model, micro_batches):
    # Decoy: right within a rank, and right whenever the ranks hold equal totals.
    n = sum(len(x) for x, _ in micro_batches)
    for x, y in micro_batches:
        (F.mse_loss(model(x), y) * len(x) / n).backward()
    for p in model.parameters():
        dist.all_reduce(p.grad, op=dist.ReduceOp.AVG)


def accumulate_gathers_samples(model, micro_batches):
    # A cheat: a copy of every rank's samples instead of a message of gradients (right values),
    # beside an all-reduce of zeros of the gradients' size (the bytes a count would ask for).
    x = torch.cat([x for x, _ in micro_batches])
    y = torch.cat([y for _, y in micro_batches])
    xy = torch.cat([x, y], dim=1)
    n = torch.tensor([len(x)])
    ns = [torch.zeros_like(n) for _ in range(dist.get_world_size())]
    dist.all_gather(ns, n)
    m = int(max(ns))
    padded = torch.cat([xy, xy.new_zeros(m - len(xy), xy.shape[1])])
    every = [torch.empty_like(padded) for _ in ns]
    dist.all_gather(every, padded)
    whole = torch.cat([e[:int(k)] for e, k in zip(every, ns)])
    F.mse_loss(model(whole[:, :x.shape[1]]), whole[:, x.shape[1]:]).backward()
    dist.all_reduce(torch.zeros(sum(p.numel() for p in model.parameters()), dtype=torch.float64))


def accumulate_course_code(model, micro_batches):
    # A cheat: the course's own averaging.
    for x, y in micro_batches:
        F.mse_loss(model(x), y).backward()
    debug.average_gradients(model)


def accumulate_objects(model, micro_batches):
    counts = [None] * dist.get_world_size()
    dist.all_gather_object(counts, sum(len(x) for x, _ in micro_batches))
    for x, y in micro_batches:
        (F.mse_loss(model(x), y) * len(x) / sum(counts)).backward()
    for p in model.parameters():
        dist.all_reduce(p.grad)


def test_accumulation_checker():
    said = battery(ch11.check_accumulation, correct=[accumulate],
                   different=[accumulate_packed_ring, accumulate_gathered_grads],
                   wrong=[accumulate_given],
                   cheat=[accumulate_gathers_samples, accumulate_course_code, accumulate_objects],
                   decoy=[accumulate_per_rank])
    assert "weighs every micro-batch alike" in said["wrong"][0]
    assert "send the gradients (an all-reduce), not the samples or a copy" in said["cheat"][0]
    assert "course's own average_gradients" in said["cheat"][1]
    assert "all_gather_object" in said["cheat"][2]
    assert "case 'the ranks' last micro-batches differ'" in said["decoy"][0]
    assert "divide by the global count N" in said["decoy"][0]


def test_accumulation_sizes_are_drawn_afresh_and_no_constant_matches():
    # Short last micro-batches, equal totals in one case and pairwise different in the other.
    for ws in (2, 3):
        seen = set()
        for seed in range(20):
            same, differ = ch11._acc_sizes(ws, seed)
            assert len({tuple(s) for s in same}) == 1 and same[0][-1] < same[0][0]
            assert len({sum(s) for s in differ}) == ws
            assert all(s[-1] < s[0] for s in differ)
            seen.add(tuple(map(tuple, differ)))
        assert len(seen) > 5


def sync_state_sorted(model):
    # The workbook's way: one flat buffer per dtype, dtypes sorted by name.
    groups = {}
    for t in model.state_dict().values():
        groups.setdefault(t.dtype, []).append(t)
    for dtype in sorted(groups, key=str):
        flat = torch.cat([t.reshape(-1) for t in groups[dtype]])
        dist.broadcast(flat, src=0)
        with torch.no_grad():
            for t, part in zip(groups[dtype], flat.split([t.numel() for t in groups[dtype]])):
                t.copy_(part.view_as(t))


def sync_state_flattened_messages(model):
    # Differently written: torch's own flatten/unflatten, dtypes in first-seen order, and rank 0
    # sends each dtype's buffer to every rank with send/recv (the broadcast's bytes, by hand).
    from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors
    groups = {}
    for t in model.state_dict().values():
        groups.setdefault(t.dtype, []).append(t)
    for tensors in groups.values():
        flat = _flatten_dense_tensors(tensors)
        if dist.get_rank() == 0:
            for peer in range(1, dist.get_world_size()):
                dist.send(flat, peer)
        else:
            dist.recv(flat, 0)
        with torch.no_grad():
            for t, new in zip(tensors, _unflatten_dense_tensors(flat, tensors)):
                t.copy_(new)


def sync_parameters_only(model):
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    dist.broadcast(flat, 0)
    with torch.no_grad():
        torch.nn.utils.vector_to_parameters(flat, model.parameters())


def sync_state_per_tensor(model):
    # Decoy: every value right, one message per tensor.
    for t in model.state_dict().values():
        dist.broadcast(t, 0)


def sync_state_rebuilt(model):
    # A cheat: rank 0's state rebuilt from its recipe (seed 0, one batch), beside a broadcast of
    # zeros of the state's size (the bytes, not the data).
    with torch.random.fork_rng():
        torch.manual_seed(0)
        twin = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.BatchNorm1d(8),
                                   torch.nn.ReLU(), torch.nn.Linear(8, 3))
    with torch.no_grad():
        twin(torch.randn(5, 6, generator=torch.Generator().manual_seed(100)))
    model.load_state_dict(twin.state_dict())
    dist.broadcast(torch.zeros(sum(t.numel() for t in twin.state_dict().values())), 0)


def sync_state_objects(model):
    state = [model.state_dict()]
    dist.broadcast_object_list(state, src=0)
    model.load_state_dict(state[0])


def test_sync_state_checker():
    said = battery(ch11.check_sync_state, correct=[sync_state_sorted],
                   different=[sync_state_flattened_messages], wrong=[sync_parameters_only],
                   cheat=[debug.broadcast_parameters, sync_state_rebuilt, sync_state_objects],
                   decoy=[sync_state_per_tensor])
    assert "rank 1's buffer 1.running_mean is not rank 0's. Buffers are state too" \
        in said["wrong"][0]
    assert "course's own broadcast_parameters" in said["cheat"][0]
    assert "all of it must travel from rank 0" in said["cheat"][1]
    assert "broadcast_object_list" in said["cheat"][2]
    assert re.search(r"rank 0 made 9 broadcasts, one per tensor; the state holds 9 tensors of 2 "
                     r"dtypes \(float32, int64\)", said["decoy"][0])


def _checksums(named):
    rows = []
    for _, g in named:
        flat = g.detach().double().flatten()
        rows.append(torch.stack([flat.sum(),
                                 (flat * torch.arange(1.0, flat.numel() + 1,
                                                      dtype=torch.float64)).sum()]))
    return torch.stack(rows)


def divergence_min_rank(named):
    # The workbook's way: checksums against rank 0's, the lowest differing rank by a MIN.
    ws, rank = dist.get_world_size(), dist.get_rank()
    mine = _checksums(named)
    zero = mine.clone()
    dist.broadcast(zero, 0)
    who = torch.where((mine != zero).any(dim=1), torch.tensor(rank), torch.tensor(ws))
    dist.all_reduce(who, op=dist.ReduceOp.MIN)
    bad = (who < ws).nonzero()
    return None if len(bad) == 0 else (who[bad[0, 0]].item(), named[bad[0, 0]][0])


def divergence_gathered(named):
    # Differently written: every rank's checksums gathered, compared on every rank.
    ws = dist.get_world_size()
    sums = _checksums(named)
    everyone = [torch.empty_like(sums) for _ in range(ws)]
    dist.all_gather(everyone, sums)
    for i, (name, _) in enumerate(named):
        for r in range(1, ws):
            if not torch.equal(everyone[r][i], everyone[0][i]):
                return r, name
    return None


def divergence_sums_only(named):
    # Wrong: compared with rank 0 by plain sums, which a swap leaves equal.
    ws, rank = dist.get_world_size(), dist.get_rank()
    sums = torch.stack([g.double().sum() for _, g in named])
    zero = sums.clone()
    dist.broadcast(zero, 0)
    who = torch.where(sums != zero, torch.tensor(rank), torch.tensor(ws))
    dist.all_reduce(who, op=dist.ReduceOp.MIN)
    bad = (who < ws).nonzero()
    return None if len(bad) == 0 else (who[bad[0, 0]].item(), named[bad[0, 0]][0])


def divergence_rank_first(named):
    # Decoy: the first differing rank, then its first differing tensor: right whenever one rank
    # differs, wrong when two ranks differ in different tensors.
    ws = dist.get_world_size()
    sums = _checksums(named)
    everyone = [torch.empty_like(sums) for _ in range(ws)]
    dist.all_gather(everyone, sums)
    for r in range(1, ws):
        for i, (name, _) in enumerate(named):
            if not torch.equal(everyone[r][i], everyone[0][i]):
                return r, name
    return None


def divergence_from_the_schedule(named):
    # Decoy: the answers read off the damage schedule (the checker's cases, retyped; the case and
    # step told by counting the calls), beside an all-reduce of zeros: right numbers, no data.
    n = divergence_from_the_schedule.calls = getattr(divergence_from_the_schedule, "calls", -1) + 1
    case, step = divmod(n, 4)
    last = dist.get_world_size() - 1
    dist.all_reduce(torch.zeros(2 * len(named), dtype=torch.float64))
    first = {1: (2, last, "net.2.bias"), 2: (1, 1, "net.0.weight"), 3: (0, last, "net.0.bias")}
    return first[case][1:] if case in first and step == first[case][0] else None


def divergence_cheat(named):
    module = torch.nn.Module()
    for i, (_, g) in enumerate(named):
        module.register_parameter(f"p{i}", torch.nn.Parameter(g.clone()))
    return debug.replicas_out_of_sync(module) or None


def test_first_divergence_checker():
    said = battery(ch11.check_first_divergence, correct=[divergence_min_rank],
                   different=[divergence_gathered], wrong=[divergence_sums_only],
                   cheat=[divergence_cheat],
                   decoy=[divergence_rank_first, divergence_from_the_schedule])
    assert re.search(r"case 'at step 1, two elements of net.0.weight swapped on rank 1': at step 1 "
                     r"rank 0 returned None, expected \(1, 'net.0.weight'\) \(a plain sum does "
                     r"not see", said["wrong"][0])
    assert "course's own replicas_out_of_sync" in said["cheat"][0]
    assert "world_size=3" in said["decoy"][0]
    assert "call 0 of the detector without sending anything but zeros" in said["decoy"][1]


def pipeline_plain(x, stage, rank, pp, dp):
    # The workbook's way: blocking send/recv to rank ± 1 within the replica.
    s = rank % pp
    if s > 0:
        dist.recv(x, src=rank - 1)
        x.requires_grad_(True)
    y = stage(x)
    loss = None
    if s == pp - 1:
        loss = y.pow(2).sum()
        loss.backward()
    else:
        dist.send(y.detach(), dst=rank + 1)
        grad = torch.empty_like(y)
        dist.recv(grad, src=rank + 1)
        y.backward(grad)
    if s > 0:
        dist.send(x.grad, dst=rank - 1)
    return loss


def pipeline_batched(x, stage, rank, pp, dp):
    # Differently written: P2POp batches, peers from the mesh coordinates.
    from torch.distributed import P2POp, batch_isend_irecv, irecv, isend
    replica, s = divmod(rank, pp)
    first, last = replica * pp, replica * pp + pp - 1
    if rank > first:
        for w in batch_isend_irecv([P2POp(irecv, x, rank - 1)]):
            w.wait()
        x = x.detach().requires_grad_()
    out = stage(x)
    if rank == last:
        loss = (out * out).sum()
        loss.backward()
    else:
        grad = torch.zeros_like(out)
        for w in batch_isend_irecv([P2POp(isend, out.detach(), rank + 1),
                                    P2POp(irecv, grad, rank + 1)]):
            w.wait()
        torch.autograd.backward(out, grad)
        loss = None
    if rank > first:
        isend(x.grad, rank - 1).wait()
    return loss


def pipeline_logs_to_rank_0(x, stage, rank, pp, dp):
    # Wrong structure: right values, and every replica's last stage sends its loss to rank 0 for
    # logging: a message across replicas.
    loss = pipeline_batched(x, stage, rank, pp, dp)
    lasts = [d * pp + pp - 1 for d in range(dp)]
    if rank in lasts and rank != 0:
        dist.send(loss.detach(), 0)
    if rank == 0:
        for r in lasts:
            if r != 0:
                dist.recv(torch.zeros((), dtype=torch.float64), r)
    return loss


def pipeline_other_order(x, stage, rank, pp, dp):
    # Decoy: the other mesh order (replicas fastest, next stage = rank + dp): right when dp = 1.
    s = rank // dp
    if s > 0:
        dist.recv(x, src=rank - dp)
        x.requires_grad_(True)
    y = stage(x)
    loss = None
    if s == pp - 1:
        loss = y.pow(2).sum()
        loss.backward()
    else:
        dist.send(y.detach(), dst=rank + dp)
        grad = torch.empty_like(y)
        dist.recv(grad, src=rank + dp)
        y.backward(grad)
    if s > 0:
        dist.send(x.grad, dst=rank - dp)
    return loss


def pipeline_recomputed(x, stage, rank, pp, dp):
    # Decoy: every stage recomputes its replica's whole pipeline from the stages' recipe (retyped:
    # Linear(4, 4) and tanh seeded 10 + stage, the input seeded 20 + replica) and sends its
    # neighbours zeros of the right sizes, in the right order: right numbers, nothing carried.
    replica, s = divmod(rank, pp)

    def recipe(k):
        with torch.random.fork_rng():
            torch.manual_seed(10 + k)
            return torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Tanh()).double()
    h = torch.randn(2, 4, generator=torch.Generator().manual_seed(20 + replica),
                    dtype=torch.float64)
    for k in range(pp):
        h = (stage if k == s else recipe(k))(h)
    loss = h.pow(2).sum()
    loss.backward()
    zeros = torch.zeros(2, 4, dtype=torch.float64)
    if s > 0:
        dist.recv(torch.empty_like(zeros), rank - 1)
    if s < pp - 1:
        dist.send(zeros, rank + 1)
        dist.recv(torch.empty_like(zeros), rank + 1)
    if s > 0:
        dist.send(zeros, rank - 1)
    return loss if s == pp - 1 else None


def pipeline_cheat(x, stage, rank, pp, dp):
    loss, grads = ch11._pipe_expected(rank // pp, pp)
    return loss


def test_pipeline_step_checker():
    said = battery(ch11.check_pipeline_step, correct=[pipeline_plain],
                   different=[pipeline_batched], wrong=[pipeline_logs_to_rank_0],
                   cheat=[pipeline_cheat], decoy=[pipeline_other_order, pipeline_recomputed])
    assert re.search(r"dp=2 replicas x pp=2 stages: rank 0 \(replica 0, stage 0\) received 8 bytes "
                     r"from rank 3, which is replica 1's stage 1; .* its neighbours are \[1\]",
                     said["wrong"][0])
    assert "checker's own _pipe_expected" in said["cheat"][0]
    assert "dp=2 replicas x pp=2 stages" in said["decoy"][0]
    assert "rank 0 (replica 0, stage 0)'s message to rank 1 did not carry its stage's output" \
        in said["decoy"][1]


def sync_grads_plain(block, tp_group, dp_group):
    # The workbook's way: the LayerNorms summed over tp, then every gradient averaged over dp.
    for ln in (block.ln1, block.ln2):
        for p in ln.parameters():
            dist.all_reduce(p.grad, group=tp_group)
    for p in block.parameters():
        dist.all_reduce(p.grad, group=dp_group)
        p.grad /= dist.get_world_size(dp_group)


def sync_grads_flat_messages(block, tp_group, dp_group):
    # Differently written: one flat buffer per step; the dp mean by messages to the other members
    # of the dp group ({0, 2} and {1, 3} on tp=2 x dp=2: ranks that are not 0..k), each adding up
    # what it received.
    from torch.distributed import ReduceOp, all_reduce
    ln = [p.grad for m in (block.ln1, block.ln2) for p in m.parameters()]
    flat = torch.cat([g.flatten() for g in ln])
    all_reduce(flat, op=ReduceOp.SUM, group=tp_group)
    for g, part in zip(ln, flat.split([g.numel() for g in ln])):
        g.copy_(part.view_as(g))
    grads = [p.grad for p in block.parameters()]
    flat = torch.cat([g.flatten() for g in grads])
    peers = [r for r in dist.get_process_group_ranks(dp_group) if r != dist.get_rank()]
    got = [torch.empty_like(flat) for _ in peers]
    works = [dist.isend(flat, r) for r in peers] + [dist.irecv(g, r) for g, r in zip(got, peers)]
    for w in works:
        w.wait()
    flat = (flat + sum(got)) / (len(peers) + 1)
    for g, part in zip(grads, flat.split([g.numel() for g in grads])):
        g.copy_(part.view_as(g))


def sync_grads_tp_only(block, tp_group, dp_group):
    for m in (block.ln1, block.ln2):
        for p in m.parameters():
            dist.all_reduce(p.grad, group=tp_group)


def sync_grads_world(block, tp_group, dp_group):
    # Decoy: the LayerNorms summed over the whole world: right when the world is one tp group.
    for m in (block.ln1, block.ln2):
        for p in m.parameters():
            dist.all_reduce(p.grad)


def sync_grads_cheat(block, tp_group, dp_group):
    from distlab.models import Block
    ch11._seeded_block(Block)


def test_sequence_parallel_grads_checker():
    # Subgroups: on tp=2 x dp=2 the dp groups are {0, 2} and {1, 3}, a group whose ranks are not
    # 0..k; tp=3 x dp=1 is the second shape.
    said = battery(ch11.check_sequence_parallel_grads, correct=[sync_grads_plain],
                   different=[sync_grads_flat_messages], wrong=[sync_grads_tp_only],
                   cheat=[sync_grads_cheat], decoy=[sync_grads_world])
    assert "tp=2 x dp=2: rank 0's ln1.weight gradient is its own replica's only: average every " \
           "gradient over the dp" in said["wrong"][0]
    assert "course's own _seeded_block" in said["cheat"][0]
    assert "rank 0's all_reduce ran over ranks [0, 1, 2, 3]" in said["decoy"][0]


def test_unsolved_stubs_are_one_line_not_implemented():
    def stub(*args):
        raise NotImplementedError("exercise: replace this line with your code")
    for check, name in ((ch11.check_loss_report, "stub"), (ch11.check_accumulation, "stub"),
                        (ch11.check_pipeline_step, "stub")):
        with pytest.raises(NotImplementedError, match=f"{name} is not written yet"):
            check(stub)


def test_slow_ranks_finds_the_straggler_by_compute_not_by_step_time():
    assert debug.slow_ranks([1.0, 1.1, 1.0, 1.0]) == [1]
    assert debug.slow_ranks([1.0, 1.3, 1.0, 1.2, 1.0]) == [1, 3]       # slowest first
    assert debug.slow_ranks([2.0, 2.0, 2.0]) == []                     # equal steps name no one
    assert debug.slow_ranks([1.0, 1.04], tolerance=0.05) == []
    with pytest.raises(ValueError, match="one compute time per rank"):
        debug.slow_ranks([])


# ---- §2c silent data corruption; 11b §1b torch.compile ----------------------------------------

def test_flip_bit_and_bit_checksums_see_every_single_flip():
    from distlab import sdc
    for dtype, width in ((torch.float64, 64), (torch.float32, 32), (torch.bfloat16, 16)):
        t = torch.linspace(-1.5, 2.0, 7, dtype=dtype)
        clean = sdc.bit_checksums([t])
        for bit in (0, width // 2, width - 2, width - 1):
            u = t.clone()
            before, after = sdc.flip_bit(u, 3, bit)
            assert before == t[3].item() and after == u[3].item() and after != before
            assert not torch.equal(sdc.bit_checksums([u]), clean), (dtype, bit)
            sdc.flip_bit(u, 3, bit)                      # a second flip restores every bit
            assert torch.equal(u.view(-1), t.view(-1))
            assert torch.equal(sdc.bit_checksums([u]), clean)
    # the float64 lowest-bit flip is the case a float sum rounds away (chapter 11 §2c's weight:
    # float32 values widened to float64, whose clean sums are exact)
    w = debug.problem()[0].net[0].weight.detach()
    v = w.clone()
    sdc.flip_bit(v, 5, 0)
    assert torch.equal(debug.tensor_checksums([v]), debug.tensor_checksums([w]))
    assert not torch.equal(sdc.bit_checksums([v]), sdc.bit_checksums([w]))
    swapped = w.clone()
    twisted = swapped.clone()
    twisted[0, :2] = swapped[0, :2].flip(0)
    assert not torch.equal(sdc.bit_checksums([swapped]), sdc.bit_checksums([twisted]))
    assert sdc.bit_checksums([w, w.float(), w.bfloat16()]).shape == (3, 8)
    with pytest.raises(ValueError, match="bits 0..31"):
        sdc.flip_bit(w.float(), 0, 32)
    with pytest.raises(TypeError, match="floating"):
        sdc.bit_checksums([torch.arange(3)])


def test_odd_replicas_names_the_minority_rank_or_says_there_is_no_majority():
    from distlab import sdc
    rows = [torch.tensor([[1, 2], [3, 4]]) for _ in range(3)]
    assert sdc.odd_replicas(rows, ["a", "b"]) == []
    rows[2] = torch.tensor([[1, 2], [3, 5]])
    assert sdc.odd_replicas(rows, ["a", "b"]) == [("b", [2])]
    assert sdc.odd_replicas(rows[1:], ["a", "b"]) == [("b", None)]       # two replicas: no vote
    with pytest.raises(ValueError, match="one row per name"):
        sdc.odd_replicas(rows, ["a"])


def test_compile_report_reads_graph_breaks_and_recompiles_and_the_fix_removes_them():
    from distlab import compile_debug

    def step(x, scale):
        y = torch.tanh(x) * scale
        if y.sum().item() > 0:
            y = y * 2
        return y.sum()

    def fixed(x, scale):
        y = torch.tanh(x) * scale
        return torch.where(y.sum() > 0, y * 2, y).sum()

    calls = [(torch.ones(8), 1.0), (torch.ones(8), 1.0), (torch.ones(9), 1.0), (torch.ones(9), 0.5)]
    got = compile_debug.compile_report(step, calls)
    reasons = [c[2] for c in got["compiles"] if c[2] is not None]
    assert list(got["graph_breaks"]) == ["Unsupported Tensor.item() call with "
                                         "capture_scalar_outputs=False"]
    assert "tensor 'x' size mismatch at index 0. expected 8, actual 9" in reasons
    assert "scale == 1.0" in reasons
    good = compile_debug.compile_report(fixed, calls, dynamic=True)
    assert good["graph_breaks"] == {} and good["compiles"] == [("fixed", "0/0", None)]
    assert all(abs(a - b) < 1e-6 for a, b in zip(got["results"], good["results"]))


def test_a_short_last_batch_recompiles_on_its_rank_only_unless_dynamic():
    def both(rank, world_size):
        from distlab import compile_debug
        return [[s["compiles"] for s in compile_debug.short_last_batch(rank, world_size, dynamic=d)]
                for d in (None, True)]
    got = distlab.run(both, 2, timeout=120)
    assert got[0] == [[1, 0, 0], [1, 0, 0]]
    assert got[1] == [[1, 0, 1], [1, 0, 0]]
