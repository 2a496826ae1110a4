"""Chapter 13's proofs, at world sizes beyond the chapter's (it runs 2 ranks and 3 members):
compression, local SGD / DiLoCo, a replica group that survives a lost member, torchft beside ours.

One launch per world size carries every proof that needs ranks (each launch costs seconds)."""
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import distlab
from distlab import compression, diloco, fault_tolerance
from distlab.models import make_mlp, regression_data

STEPS = 4


def _shards(rank, world_size, steps=STEPS, n=8):
    x, y = regression_data(n=n * world_size * steps, in_dim=16, out_dim=4, seed=3)
    x, y = x.double(), y.double()
    return [(x[i:i + n], y[i:i + n]) for i in range(n * rank, len(x), n * world_size)]


def _proofs(rank, world_size):
    out = {}
    batches = _shards(rank, world_size)
    sgd = lambda ps: torch.optim.SGD(ps, lr=0.1)                          # noqa: E731

    # 1. DiLoCo with H = 1 and outer SGD at lr 1 is DDP, step for step.
    ddp, dil = make_mlp(seed=0).double(), make_mlp(seed=0).double()
    diloco.train(ddp, batches, sgd)
    _, wrapper = diloco.train(dil, batches, sgd, H=1, outer=diloco.plain_average)
    out["diloco_h1_vs_ddp"] = max((a - b).abs().max().item()
                                  for a, b in zip(ddp.parameters(), dil.parameters()))
    out["diloco_h1_syncs"] = wrapper.syncs

    # 2. Local SGD (H = 2, lr-1 outer SGD) leaves every replica at the mean of the replicas.
    model = make_mlp(seed=0).double()
    opt = sgd(model.parameters())
    wrap = diloco.DiLoCo(model, 2, diloco.plain_average)
    for i, (x, y) in enumerate(batches):
        opt.zero_grad()
        F.mse_loss(model(x), y).backward()
        opt.step()
        if i % 2 == 1:
            before = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
            mean = before.clone()
            dist.all_reduce(mean)
            mean /= world_size
        wrap.step()
        if i % 2 == 1:
            after = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
            out.setdefault("local_sgd_vs_mean", []).append((after - mean).abs().max().item())

    # 3. Streaming: F fragments, each synced once per H steps, at its own offset; the same bytes.
    model = make_mlp(seed=0).double()
    stream = diloco.DiLoCo(model, 4, fragments=3)
    whole = diloco.DiLoCo(make_mlp(seed=0).double(), 4)
    calls = []
    original = stream.sync
    stream.sync = lambda f=0: (calls.append((stream.inner_steps, f)), original(f))
    for _ in range(8):
        stream.step()
        whole.step()
    out["stream_calls"], out["stream_bytes"] = calls, (stream.bytes_sent, whole.bytes_sent)

    # 4. PowerSGD at full rank is the exact mean (every matrix, also tall and wide ones).
    model = make_mlp((16, 6, 9, 4), seed=0).double()
    x, y = batches[0]
    F.mse_loss(model(x), y).backward()
    exact = [p.grad.clone() for p in model.parameters()]
    for g in exact:
        dist.all_reduce(g)
        g /= world_size
    ps = compression.PowerSGD(model, rank=9, error_feedback=True)
    for step in range(2):                  # twice: the second step adds the error buffers back
        model.zero_grad()
        F.mse_loss(model(x), y).backward()
        ps.average()
        out.setdefault("full_rank", []).append(compression.relative_error(
            [p.grad for p in model.parameters()], exact))

    # 5. Error feedback: the accumulated gap IS the mean error buffer, and it stays bounded.
    common = torch.randn(12, 10, generator=torch.Generator().manual_seed(0), dtype=torch.float64)

    def gradient(step):
        g = torch.Generator().manual_seed(100 * rank + step)
        return common + 0.5 * torch.randn(12, 10, generator=g, dtype=torch.float64)
    out["ef"] = compression.accumulated_gap(gradient, 30, rank=1, error_feedback=True)
    out["no_ef"] = compression.accumulated_gap(gradient, 30, rank=1, error_feedback=False)
    out["gnorm"] = float(common.norm())
    out.update(_low_bit_proofs(rank, world_size))

    # 7. Streaming DiLoCo's overlap: τ inner steps between a fragment's launch and its outer step.
    for tau in OVERLAPS:
        model = make_mlp(seed=0).double()
        _, wrap = diloco.train(model, _shards(rank, world_size, steps=12), sgd, H=4,
                               fragments=3, overlap=tau)
        out[f"overlap_{tau}"] = ([g for frag in wrap.globals for g in frag],
                                 [p.detach() for p in model.parameters()], wrap.syncs)
    plain = make_mlp(seed=0).double()              # no overlap argument: today's DiLoCo
    diloco.train(plain, _shards(rank, world_size, steps=12), sgd, H=4, fragments=3)
    out["overlap_plain"] = [p.detach() for p in plain.parameters()]
    return out


OVERLAPS = (0, 1, 3)


def _overlap_reference(world_size, tau, H=4, fragments=3, steps=12):
    """One process replays streaming DiLoCo with overlap τ for every rank: at fragment f's turn
    the mean of the ranks' pseudo-gradients (global - local) is captured; τ inner steps later the
    outer Nesterov steps the global copy with it, and each rank's fragment becomes the new global
    plus its drift since the launch. Returns the global copies and each rank's parameters."""
    models = [make_mlp(seed=0).double() for _ in range(world_size)]
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in models]
    data = [_shards(r, world_size, steps=steps) for r in range(world_size)]
    params = [list(m.parameters()) for m in models]
    size = -(-len(params[0]) // fragments)
    cuts = [range(i, min(i + size, len(params[0]))) for i in range(0, len(params[0]), size)]
    glob = [[params[0][i].detach().clone() for i in c] for c in cuts]
    outers = [diloco.nesterov(g) for g in glob]
    flying = []                                     # (due step, fragment, mean, locals at launch)

    def land(f, mean, then):
        for g, m in zip(glob[f], mean):
            g.grad = m
        outers[f].step()
        with torch.no_grad():
            for r in range(world_size):
                for g, i, old in zip(glob[f], cuts[f], then[r]):
                    params[r][i].copy_(params[r][i] - old + g)
    for s in range(1, steps + 1):
        for r in range(world_size):
            opts[r].zero_grad()
            F.mse_loss(models[r](data[r][s - 1][0]), data[r][s - 1][1]).backward()
            opts[r].step()
            models[r].zero_grad(set_to_none=True)
        for f in range(len(cuts)):                  # fragments are disjoint: launch, then land
            if (s - f * H // len(cuts)) % H == 0:
                mean = [sum(glob[f][j] - params[r][i].detach() for r in range(world_size))
                        / world_size for j, i in enumerate(cuts[f])]
                then = [[params[r][i].detach().clone() for i in cuts[f]]
                        for r in range(world_size)]
                flying.append((s + tau, f, mean, then))
        for _, f, mean, then in [x for x in flying if x[0] == s]:
            land(f, mean, then)
        flying = [x for x in flying if x[0] != s]
    for _, f, mean, then in flying:
        land(f, mean, then)
    return [g for frag in glob for g in frag], [[p.detach() for p in ps] for ps in params]


LOW_BIT_BLOCK = 64


def _on_grid(seed, numel, bits):
    """Pseudo-gradients the quantizer carries without loss: integers q * 2^-8 with |q| <= 127
    (int8) or 7 (int4), each block of LOW_BIT_BLOCK holding one |q| = qmax, so its scale is
    exactly 2^-8 and every value is a whole multiple of it."""
    qmax = 2 ** (bits - 1) - 1
    q = torch.randint(-qmax, qmax + 1, (numel,), generator=torch.Generator().manual_seed(seed))
    q[::LOW_BIT_BLOCK] = qmax
    return q.double() * 2 ** -8


def _low_bit_proofs(rank, world_size):
    """6. Low-bit outer steps: lossless on the grid, the all-gathered mean, error feedback,
    the bytes of each sync, and the loss against the fp32 run."""
    out = {}
    # (a) lossless: inner steps replaced by moves onto the grid; params on a 2^-10 grid, outer
    # Nesterov at lr and momentum 1/2, 2 ranks: every sum is exact, so int8/int4 == full precision.
    if world_size in (1, 2):
        for name, bits in compression.BITS.items():
            runs = []
            for outer_dtype in (None, name):
                model = make_mlp(seed=0).double()
                with torch.no_grad():
                    for p in model.parameters():
                        p.copy_(torch.round(p * 1024) / 1024)
                wrap = diloco.DiLoCo(model, 2, lambda ps: diloco.nesterov(ps, 0.5, 0.5),
                                     outer_dtype=outer_dtype, block=LOW_BIT_BLOCK)
                numel = sum(p.numel() for p in model.parameters())
                for step in range(6):
                    d = _on_grid(100 * rank + step // 2, numel, bits)   # one per outer step
                    with torch.no_grad():
                        sizes = [p.numel() for p in model.parameters()]
                        for p, dp in zip(model.parameters(), d.split(sizes)):
                            p -= dp.view_as(p) / 2          # two inner steps, half each
                    wrap.step()
                runs.append(torch.cat([p.detach().reshape(-1) for p in model.parameters()]))
            out[f"lossless_{name}"] = (runs[0] - runs[1]).abs().max().item()

    # (b) the mean against the parent's reference: this rank's input and payload and the result,
    # on the world and on a subgroup whose ranks are not 0..k (world 3: {1, 2}; world 5: {1, 3, 4}).
    members = {3: [1, 2], 5: [1, 3, 4]}.get(world_size)
    sub = dist.new_group(members) if members else None
    x = torch.randn(300, generator=torch.Generator().manual_seed(7 + rank), dtype=torch.float64)
    for where, group in (("world", None), ("sub", sub)):
        if where == "sub" and (sub is None or rank not in members):
            continue
        for name, bits in compression.BITS.items():
            mean = compression.LowBitMean(bits, LOW_BIT_BLOCK, group=group).mean(x)
            out[f"mean_{where}_{name}"] = (x, compression.quantize(x, bits, LOW_BIT_BLOCK), mean)

    # error feedback: sum of (exact mean - applied mean) over steps == mean of the error buffers
    ef = compression.LowBitMean(4, LOW_BIT_BLOCK, error_feedback=True)
    gap = torch.zeros(300, dtype=torch.float64)
    for step in range(5):
        g = torch.randn(300, generator=torch.Generator().manual_seed(50 * rank + step),
                        dtype=torch.float64)
        exact = g.clone()
        dist.all_reduce(exact)
        gap += exact / world_size - ef.mean(g)
    held = ef.errors[0].clone()
    dist.all_reduce(held)
    out["low_bit_ef"] = ((gap - held / world_size).abs().max().item(), gap.abs().max().item())

    # (c) bytes per sync and the loss against the fp32 run: 16 AdamW steps, H = 4 (4 syncs)
    batches = [(a.float(), b.float()) for a, b in _shards(rank, world_size, steps=16)]
    for outer_dtype in (None, "int8", "int4"):
        model = make_mlp(seed=0)
        losses, wrap = diloco.train(model, batches, lambda ps: torch.optim.AdamW(ps, lr=3e-3),
                                    H=4, outer_dtype=outer_dtype, block=LOW_BIT_BLOCK)
        numel = sum(p.numel() for p in model.parameters())
        out[f"run_{outer_dtype}"] = (losses[-4:], wrap.bytes_sent, wrap.syncs, numel)
    return out


@pytest.fixture(scope="module", params=[1, 2, 3, 5])
def proofs(request):
    return request.param, distlab.run(_proofs, request.param, timeout=120)


def test_diloco_h1_with_outer_sgd_lr1_is_ddp(proofs):
    n, results = proofs
    for r, out in enumerate(results):
        assert out["diloco_h1_vs_ddp"] < 1e-12, (n, r, out["diloco_h1_vs_ddp"])
        assert out["diloco_h1_syncs"] == STEPS


def test_local_sgd_is_the_mean_of_the_replicas(proofs):
    n, results = proofs
    for out in results:
        assert len(out["local_sgd_vs_mean"]) == STEPS // 2
        assert max(out["local_sgd_vs_mean"]) < 1e-12


def test_streaming_syncs_each_fragment_once_per_H_at_its_offset(proofs):
    _, results = proofs
    calls, (stream_bytes, whole_bytes) = results[0]["stream_calls"], results[0]["stream_bytes"]
    # offsets 0, 1, 2 (f * 4 // 3): fragment 1 at steps 1 and 5, fragment 2 at 2 and 6, 0 at 4, 8
    assert calls == [(1, 1), (2, 2), (4, 0), (5, 1), (6, 2), (8, 0)]
    assert stream_bytes == whole_bytes


def test_overlap_zero_is_todays_diloco_and_any_overlap_is_the_replayed_schedule(proofs):
    """overlap=0 is the plain streaming DiLoCo bit for bit; for every τ the ranks hold identical
    global copies, equal (1e-12, float64) to one process replaying the schedule, parameters too."""
    n, results = proofs
    for r, out in enumerate(results):
        assert all(torch.equal(a, b) for a, b in zip(out["overlap_0"][1], out["overlap_plain"]))
    for tau in OVERLAPS:
        ref_globals, ref_params = _overlap_reference(n, tau)
        for r, out in enumerate(results):
            globs, params, syncs = out[f"overlap_{tau}"]
            assert syncs == 9                   # 12 steps, 3 fragments, one outer step per 4 steps
            assert all(torch.equal(a, b) for a, b in zip(globs, results[0][f"overlap_{tau}"][0]))
            gap = max((a - b).abs().max().item() for a, b in
                      zip(globs + params, ref_globals + ref_params[r]))
            assert gap < 1e-12, (n, tau, r, gap)
    one, three = (results[0][f"overlap_{t}"][0] for t in (1, 3))
    assert max((a - b).abs().max().item() for a, b in zip(one, three)) > 1e-6   # τ matters


def test_full_rank_powersgd_is_the_exact_mean(proofs):
    _, results = proofs
    for out in results:
        assert max(out["full_rank"]) < 1e-12, out["full_rank"]


def test_error_feedback_keeps_the_accumulated_error_bounded(proofs):
    n, results = proofs
    gaps, held = results[0]["ef"]
    for g, h in zip(gaps, held):          # the gap is exactly what the buffers still hold
        assert abs(g - h) <= 1e-9 * max(1.0, g)
    gnorm = results[0]["gnorm"]
    if n == 1:                            # one rank: rank-1 of the same matrix; gap bounded too
        assert max(gaps) < 10 * gnorm
        return
    assert max(gaps[10:]) < 1.5 * max(gaps[:10]) + 1e-9   # no growth after the first steps
    no_ef = results[0]["no_ef"][0]
    assert no_ef[-1] > 3 * gaps[-1]                        # without it the gap grows with t
    assert no_ef[-1] > 1.8 * no_ef[len(no_ef) // 2 - 1]    # linearly: about doubles from t=15 to 30


def _reference_mean(payloads, numel, bits):
    """The parent's own reading of the payloads (not the lib's dequantize): fp32 scales first,
    then int8 bytes or two 4-bit values a byte (low nibble first, stored as q + 8)."""
    import numpy as np
    blocks = -(-numel // LOW_BIT_BLOCK)
    total = np.zeros(numel)
    for p in payloads:
        raw = p.numpy().tobytes()
        scale = np.frombuffer(raw[:4 * blocks], dtype=np.float32).astype(np.float64)
        body = np.frombuffer(raw[4 * blocks:], dtype=np.uint8)
        if bits == 8:
            q = body.view(np.int8).astype(np.float64)
        else:
            q = np.stack([body & 15, body >> 4], 1).reshape(-1)[:numel].astype(np.float64) - 8
        total += q * np.repeat(scale, LOW_BIT_BLOCK)[:numel]
    return torch.from_numpy(total / len(payloads))


def test_low_bit_diloco_is_lossless_on_the_grid(proofs):
    n, results = proofs
    if n not in (1, 2):         # dividing by 3 or 5 leaves the grid: the proof runs at 1 and 2
        assert "lossless_int8" not in results[0]
        return
    for r in results:
        assert r["lossless_int8"] == 0.0 and r["lossless_int4"] == 0.0


def test_low_bit_mean_is_every_payload_dequantized_and_averaged(proofs):
    """Each rank's result equals the parent's mean of all members' payloads; each payload is
    within half a quantization step of its rank's input; on the world and on a subgroup."""
    n, results = proofs
    groups = {"world": list(range(n)), "sub": {3: [1, 2], 5: [1, 3, 4]}.get(n)}
    for where, members in groups.items():
        if members is None:
            continue
        for name, bits in compression.BITS.items():
            key = f"mean_{where}_{name}"
            assert all(key in results[r] for r in members)
            assert not any(key in results[r] for r in range(n) if r not in members)
            payloads = [results[r][key][1] for r in members]
            ref = _reference_mean(payloads, 300, bits)
            for r in members:
                x, payload, mean = results[r][key]
                assert payload.numel() == compression.payload_bytes(300, bits, LOW_BIT_BLOCK)
                back = compression.dequantize(payload, 300, bits, LOW_BIT_BLOCK, torch.float64)
                assert (x - back).abs().max() <= x.abs().max() / (2 ** (bits - 1) - 1) / 2 * 1.0001
                assert (mean - ref).abs().max() <= 1e-12, (where, name, r)


def test_low_bit_error_feedback_keeps_what_it_dropped(proofs):
    n, results = proofs
    for r in results:
        identity, gap = r["low_bit_ef"]
        assert identity <= 1e-12 * max(gap, 1.0)
        if n > 1:
            assert gap > 1e-3                  # 4 bits do drop something


def test_low_bit_diloco_bytes_and_loss(proofs):
    """Bytes per sync are compression.payload_bytes (the closed form, scales included; without
    scales it is across_sites' params * bits / 8); the last losses stay within 1 % (int8) and
    5 % (int4) of the fp32 run's."""
    n, results = proofs
    for r in results:
        fp32_losses, fp32_bytes, syncs, numel = r["run_None"]
        assert syncs == 4 and fp32_bytes == syncs * compression.payload_bytes(numel, 32)
        for name, bits, tol in (("int8", 8, 0.01), ("int4", 4, 0.05)):
            losses, sent, s, _ = r[f"run_{name}"]
            assert s == 4 and sent == 4 * compression.payload_bytes(numel, bits, LOW_BIT_BLOCK)
            gap = abs(sum(losses) / sum(fp32_losses) - 1)
            assert gap <= tol, (name, gap)


def test_bytes_per_step_and_refusals():
    model = make_mlp((16, 64, 64, 4), seed=0)
    numel = sum(p.numel() for p in model.parameters())
    assert compression.bytes_per_step(model) == 4 * numel
    # rank 1: (n + m) per matrix, biases whole
    assert compression.bytes_per_step(model, rank=1) == 4 * ((64 + 16) + (64 + 64) + (4 + 64)
                                                             + 64 + 64 + 4)
    p = torch.randn(7, 3, dtype=torch.float64)
    q = compression.orthonormalize(p.clone())
    assert torch.allclose(q.t() @ q, torch.eye(3, dtype=torch.float64), atol=1e-12)
    with pytest.raises(ValueError, match="rank must be a whole number"):
        compression.PowerSGD(model, rank=0)
    with pytest.raises(ValueError, match="H must be a whole number"):
        diloco.DiLoCo(model, 0)
    with pytest.raises(ValueError, match="fragments=9 is more than"):
        diloco.DiLoCo(model, 2, fragments=9)
    with pytest.raises(ValueError, match="kill must be"):
        fault_tolerance.run_group(members=3, kill=(3, 1))
    with pytest.raises(ValueError, match="join must be a step after the kill"):
        fault_tolerance.run_group(members=3, steps=8, kill=(2, 5), join=4)
    with pytest.raises(ValueError, match="at 4 bits block must be even"):
        compression.quantize(torch.randn(8), bits=4, block=65)
    with pytest.raises(TypeError, match="needs a floating-point tensor; got torch.int64"):
        compression.quantize(torch.arange(8))
    with pytest.raises(ValueError, match="outer_dtype must be None, 'int8' or 'int4'"):
        diloco.DiLoCo(model, 2, outer_dtype="fp8")
    with pytest.raises(ValueError, match="overlap=2 must be less than H=2"):
        diloco.DiLoCo(model, 2, overlap=2)
    with pytest.raises(ValueError, match="overlap must be a whole number >= 0"):
        diloco.DiLoCo(model, 2, overlap=-1)
    with pytest.raises(ValueError, match="choose one of them"):
        diloco.DiLoCo(model, 2, overlap=1, outer_dtype="int8")
    assert compression.payload_bytes(10, 8) == 10.0 and compression.payload_bytes(10, 4) == 5.0
    assert compression.payload_bytes(129, 4, 64) == 65 + 3 * 4
    from distlab import across_sites as a      # the chapter's closed form is payload_bytes's
    for bits in (32, 8, 4):
        steps, compute = a.step_times(a.INTELLECT_1, a.Sites(), Hs=(100,), bits=bits)
        sync = a.Sites().cross(compression.payload_bytes(a.INTELLECT_1.params(), bits))
        assert abs(steps[f"DiLoCo H=100 ({bits}-bit)"][0] - compute - sync / 100) < 1e-12
    from distlab.across_sites import Sites
    with pytest.raises(ValueError, match="gbit must be a positive number"):
        Sites(gbit=0)


def test_survivors_continue_and_a_newcomer_heals():
    """4 members (the chapter runs 3): member 1 dies inside step 2's all-reduce, a newcomer joins
    at step 4. Every trajectory equals one process that averaged, at each step, exactly the
    members of that step: so the survivors' run from step 2 is a run that never had member 1."""
    steps = 6
    out = fault_tolerance.run_group(members=4, steps=steps, kill=(1, 2), join=4)
    assert sorted(out["trajectories"]) == [0, 2, 3, 4]
    assert [s for s, m, _ in out["failures"]] == [2, 2, 2]
    assert {m for _, m, _ in out["failures"]} == {0, 2, 3}

    def membership(step):
        return [0, 1, 2, 3] if step < 2 else [0, 2, 3] if step < 4 else [0, 2, 3, 4]
    ref = fault_tolerance.reference(membership, steps)
    never_had_1 = fault_tolerance.reference(lambda s: [0, 1, 2, 3] if s < 2 else [0, 2, 3], 4)
    for m, trajectory in out["trajectories"].items():
        assert sorted(trajectory) == (list(range(4, steps)) if m == 4 else list(range(steps)))
        for step, flat in trajectory.items():
            assert (flat - ref[step]).abs().max() < 1e-12, (m, step)
            if step < 4:
                assert (flat - never_had_1[step]).abs().max() < 1e-12
    # and the step after the loss is not what the full group would have done
    full = fault_tolerance.reference(lambda s: [0, 1, 2, 3], 3)
    assert (out["trajectories"][0][2] - full[2]).abs().max() > 1e-6


def test_torchft_diloco_and_local_sgd_equal_ours():
    """torchft's DiLoCo (outer Nesterov) and LocalSGD through its Manager, Lighthouse and gloo
    process group, at 3 replica groups (the chapter runs 2): equal to the course's DiLoCo."""
    pytest.importorskip("torchft", reason="torchft is in the `ft` extra, which make test installs")
    results = distlab.run(_both, 3, timeout=120, env={"RUST_LOG": "error"})
    for diff_d, steps_d, syncs_d, diff_l, steps_l, syncs_l in results:
        assert diff_d < 1e-12 and diff_l < 1e-12
        assert steps_d == syncs_d == 3 and steps_l == syncs_l == 3


def _both(rank, world_size):
    from distlab.torchft_runs import diloco_beside
    return (diloco_beside(rank, world_size, H=2, steps=6)
            + diloco_beside(rank, world_size, H=2, steps=6, local_sgd=True))


def test_torchft_group_survives_a_lost_group_and_heals_a_newcomer():
    """torchft's Manager and Lighthouse, 4 replica groups (the chapter runs 3): group 1 hangs at
    step 2 and is killed; the others' commit fails, they retry without it; group 4 joins at step
    4 and heals from a peer over torchft's HTTP checkpoint transport. Every committed step equals
    one process that averaged the groups that contributed to it."""
    pytest.importorskip("torchft", reason="torchft is in the `ft` extra, which make test installs")
    from distlab.torchft_runs import ft_group, membership
    records = ft_group(groups=4, steps=6, kill=(1, 2), join=(4, 4), timeout=60)
    assert sorted(records) == [0, 2, 3, 4]
    members = membership(records, lost=1)
    assert members[0] == members[1] == [0, 1, 2, 3]
    assert all(1 not in members[s] for s in range(2, 6))
    assert members[5] == [0, 2, 3, 4]
    assert sorted(records[4]) == [s for s in range(6) if 4 in members[s]]
    ref = fault_tolerance.reference(lambda s: members[s], 6)
    for rid, record in records.items():
        for step, (flat, _, _) in record.items():
            assert (flat - ref[step]).abs().max() < 1e-12, (rid, step)


def test_across_sites_model_is_consistent():
    """The modeled two-site step: DDP pays the whole gradient every step, DiLoCo 1/H of it; the
    break-even H and the link for a utilisation invert each other; PowerSGD's count is P and Q."""
    from distlab import across_sites as a
    sites = a.Sites(gbit=1)
    steps, compute = a.step_times(a.INTELLECT_1, sites, Hs=(10, 100))
    ddp = steps["DDP (bf16 gradients)"][0]
    assert abs(ddp - compute - sites.cross(2 * a.INTELLECT_1.params())) < 1e-9
    d10, d100 = steps["DiLoCo H=10 (32-bit)"][0], steps["DiLoCo H=100 (32-bit)"][0]
    assert abs((d10 - compute) - 10 * (d100 - compute)) < 1e-9
    for bits in (32, 8):
        h = a.break_even_H(a.INTELLECT_1, sites, 0.9, bits=bits)
        at = a.step_times(a.INTELLECT_1, sites, Hs=(h - 1, h), bits=bits)[0]
        assert at[f"DiLoCo H={h} ({bits}-bit)"][1] >= 0.9 > at[f"DiLoCo H={h - 1} ({bits}-bit)"][1]
    gbit = a.link_for(a.INTELLECT_1, 0.83, H=100, bits=8)
    assert a.break_even_H(a.INTELLECT_1, a.Sites(gbit=gbit * 1.001), 0.83, bits=8) <= 100
    assert a.break_even_H(a.INTELLECT_1, a.Sites(gbit=gbit * 0.999), 0.83, bits=8) > 100
    from distlab.hardware import Transformer
    p, q = a.powersgd_numbers(Transformer(1, 8, 2, 16, 10), rank=1)
    # q, k, v, o (8x8), two ffn (16x8), two vocab (10x8): rank 1 sends n and m numbers each
    assert (p, q) == (4 * 8 + 2 * 16 + 2 * 10, 8 * 8)


# ---- §4's real-size section: the sourced link constants, the stored tables and prose, emulated ----

def _chapter():
    import json
    from pathlib import Path
    path = Path(__file__).resolve().parents[1] / "notebooks" / "13_slow_links_and_failures.ipynb"
    return json.loads(path.read_text())["cells"]


def _stored(marker, kind="code"):
    """The stored text output (code) or the source (markdown) of the one cell holding `marker`."""
    found = [c for c in _chapter() if c["cell_type"] == kind and marker in "".join(c["source"])]
    assert len(found) == 1, f"{len(found)} {kind} cells of chapter 13 hold {marker!r}"
    if kind == "markdown":
        return "".join(found[0]["source"])
    return "".join("".join(o.get("text", "")) for o in found[0]["outputs"])


def test_cross_site_links_are_the_sourced_ones():
    """Port speeds of AWS Direct Connect's dedicated connections; Azure's top North-American
    round trip (quoted in across_sites' comments, which must keep naming them)."""
    import inspect
    from distlab import across_sites as a
    assert a.LINK_GBIT == (1, 10, 100) and a.RTT_MS == 72.0
    assert a.Sites().rtt_ms == a.RTT_MS and a.Sites().gbit in a.LINK_GBIT
    link = a.Sites(gbit=1).link()
    assert link.bandwidth == 1e9 / 8 and link.latency == 0.072
    text = inspect.getsource(a)
    for quote in ('"Dedicated connection 1 Gbps", "10 Gbps",', '"100 Gbps"',
                  '"5 ms to 72 ms for round trips within North America regions"', "ESTIMATE"):
        assert quote in text, quote
    prose = _stored("AWS\nDirect Connect", kind="markdown")
    assert "72 ms" in prose and "5 ms to 72 ms for round trips within North America regions" in prose


def test_chapter_tables_and_prose_are_the_lib_numbers():
    """Every line of the stored closed-form table is what across_sites computes now, and the
    figures §4's prose quotes follow from it."""
    from distlab import across_sites as a
    stored = _stored("across_sites.step_times(shape")
    shapes = {"1.5B (Llama-3.2 1B's shape, untied)": a.LLAMA_1B, "10B (INTELLECT-1's shape)": a.INTELLECT_1}
    table = {}
    for label, shape in shapes.items():
        for gbit in a.LINK_GBIT:
            steps, compute = a.step_times(shape, a.Sites(gbit=gbit))
            table[label, gbit] = steps
            assert f"{label}, {gbit} Gbit/s: a site's step alone {compute:.2f} s" in stored
            for method, (seconds, u) in steps.items():
                assert (f"   {method:>26}: {seconds:7.2f} s per step, compute utilisation "
                        f"{u:4.0%}") in stored, (label, gbit, method)
    pct = lambda u: round(100 * u)                                        # noqa: E731
    psgd = [pct(t["PowerSGD rank 4 (bf16)"][1]) for t in table.values()]
    prose = _stored("DDP across sites is hopeless", kind="markdown")
    assert f"keeps {min(psgd)}–{max(psgd)} %" in prose
    small = pct(table["1.5B (Llama-3.2 1B's shape, untied)", 100]["PowerSGD rank 4 (bf16)"][1])
    assert f"model at {small} % even on 100 Gbit/s" in prose and "72 ms round trip" in prose
    old = a.step_times(a.LLAMA_1B, a.Sites(gbit=100, rtt_ms=50))[0]["PowerSGD rank 4 (bf16)"][1]
    assert f"it\nkept {pct(old)} %" in prose
    summary = _stored("## Summary", kind="markdown")
    kept = psgd + [pct(table[k]["DiLoCo H=500 (32-bit)"][1]) for k in table if k[1] <= 10]
    assert f"keep {min(kept)}–{max(kept)} %" in summary


def test_emulated_two_site_run_lands_on_the_closed_form():
    """The emulated run (two ranks, one per site, meta tensors at full size, the course's DiLoCo):
    DDP and PowerSGD equal the closed form; DiLoCo pays its outer step's arithmetic on top, under
    1 % and less for larger H. The chapter's stored lines are these numbers."""
    from distlab import across_sites as a
    sites = a.Sites(gbit=10)
    emulated = a.emulated_step_times(a.INTELLECT_1, sites)
    closed = a.step_times(a.INTELLECT_1, sites)[0]
    gaps = {m: emulated[m] / closed[m][0] - 1 for m in closed}
    assert abs(gaps["DDP (bf16 gradients)"]) < 1e-9 and abs(gaps["PowerSGD rank 4 (bf16)"]) < 1e-9
    dil = [gaps[f"DiLoCo H={H} (32-bit)"] for H in (10, 100, 500)]
    assert 0 < dil[2] < dil[1] < dil[0] < 0.01
    stored = _stored("emulated_step_times(")
    assert "⏱ emulated:" in stored and "values not computed: meta tensors" in stored
    for m, seconds in emulated.items():
        verdict = "equal" if abs(gaps[m]) < 1e-9 else f"{gaps[m]:+.2%}"
        assert (f"   {m:>26}: closed form {closed[m][0]:6.2f} s, emulated {seconds:6.2f} s "
                f"({verdict})") in stored, m
    assert "by a quarter of a percent at H = 10" in _stored("DDP and PowerSGD agree", "markdown")
    assert round(100 * dil[0], 2) == 0.26


def test_stored_overlap_run_hides_the_sync_as_the_closed_form_says():
    """The chapter's emulated streaming DiLoCo (H = 100, 4 fragments): each τ's stored step is
    the site's compute plus what of each fragment's all-reduce τ steps of compute do not hide,
    4 times per 100 steps (within 0.5 %: the outer step's arithmetic is charged on top)."""
    import re
    from distlab import across_sites as a
    sites = a.Sites(gbit=10)
    compute, sync = a.inner_step(a.INTELLECT_1, sites, 2 ** 21), sites.cross(a.INTELLECT_1.params())
    stored = _stored("across_sites.emulated_overlap(")
    assert "⏱ emulated:" in stored and "values not computed: meta tensors" in stored
    assert f"a site's step alone {compute:.2f} s; one fragment's all-reduce {sync:.2f} s" in stored
    got = {int(t): float(s) for t, s in re.findall(r"overlap τ = (\d): ([\d.]+) s per step", stored)}
    assert sorted(got) == [0, 1, 2]
    for tau, seconds in got.items():
        closed = compute + 4 * max(0.0, sync - tau * compute) / 100
        assert abs(seconds / closed - 1) < 0.005, (tau, seconds, closed)
    prose = _stored("one inner step\nof overlap hides", kind="markdown")
    assert f"fragment's {sync:.0f} s all-reduce" in prose and f"hides {compute:.1f} s of it" in prose
