"""Pipeline × FSDP (pipeline_parallel.fsdp): stages sharded over their data-parallel group equal
one process — loss, every gradient (None-ness included) and every parameter after several SGD
steps — at world sizes 4 (2 × 2) and 6 (3 × 2 and 2 × 3), with a frozen layer, pieces that do
not divide over the stages, parameter lengths that do not divide over dp, a one-element
parameter whose shard is empty on all ranks but one, and a batch that does not divide over dp.
The all-gathers and reduce-scatters per step are counted (by the stage, and from the trace) and
held against the schedule's lists. One launch per world size."""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import distlab
from distlab import pipeline_parallel as pp
from distlab import pipeline_schedules as ps
from distlab.models import batches_of, regression_data
from distlab.pipeline_parallel import fsdp

LR, STEPS = 0.05, 3
x, y = regression_data(96, 8, 4, seed=1)
BATCHES = batches_of(x, y, 29, STEPS)     # 29 samples: 15 + 14 over 2 copies, 10 + 10 + 9 over 3


class Gate(nn.Module):
    """A one-element parameter: every dp rank but the first holds an empty shard of it."""

    def __init__(self):
        super().__init__()
        self.g = nn.Parameter(torch.tensor([0.9]))

    def forward(self, h):
        return h * self.g


class Net(nn.Module):
    """8 pieces (uneven over 3 stages), widths 11 (divides neither 2 nor 3), the second Linear
    frozen, a one-element gate."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(8, 11), nn.GELU(), nn.Linear(11, 11), nn.GELU(),
                                 nn.Linear(11, 11), Gate(), nn.GELU(), nn.Linear(11, 4))
        self.net[2].requires_grad_(False)

    def forward(self, h):
        return self.net(h)


def make_net():
    with torch.random.fork_rng(devices=[]):
        return Net().double()


SCHEDULES = {"GPipe": ps.gpipe, "1F1B": ps.one_f_one_b,
             "interleaved": lambda p, m: ps.interleaved_1f1b(p, m, 2)}
# (pp, dp, schedule, m, policy) per world size
CASES = {4: [(2, 2, "1F1B", 4, "every action"), (2, 2, "1F1B", 4, "whole step"),
             (2, 2, "GPipe", 3, "whole step"), (2, 2, "interleaved", 2, "every action"),
             (2, 2, "interleaved", 2, "whole step")],
         6: [(3, 2, "1F1B", 3, "every action"), (3, 2, "1F1B", 3, "whole step"),
             (3, 2, "GPipe", 3, "every action"), (2, 3, "1F1B", 4, "every action"),
             (2, 3, "interleaved", 4, "whole step")]}


def _cases(rank, world_size):
    meshes = {}
    out = {}
    for case in CASES[world_size]:
        p, d, name, m, policy = case
        if (p, d) not in meshes:
            meshes[p, d] = fsdp.pp_dp_mesh(p, d)
        with distlab.trace.span(repr(case)):
            out[case] = fsdp.train_sharded(rank, world_size, p, d, SCHEDULES[name], make_net(),
                                           BATCHES, m, (8,), v=2 if name == "interleaved" else 1,
                                           policy=policy, lr=LR, dtype=torch.float64,
                                           mesh=meshes[p, d])
    refusals = []
    mesh = meshes[2, world_size // 2]
    for attempt in (lambda: fsdp.pp_dp_mesh(world_size, 2),
                    lambda: fsdp.train_sharded(rank, world_size, 2, world_size // 2,
                                               ps.one_f_one_b, make_net(), BATCHES, 4, (8,),
                                               policy="while in use", mesh=mesh),
                    lambda: fsdp.train_sharded(rank, world_size, 2, world_size // 2, ps.zb_h1,
                                               make_net(), BATCHES, 4, (8,), mesh=mesh),
                    lambda: fsdp.train_sharded(rank, world_size, 2, world_size // 2,
                                               ps.one_f_one_b, make_net(), [(x[:6], y[:6])], 4,
                                               (8,), mesh=mesh)):
        try:
            attempt()
            refusals.append(None)
        except ValueError as e:
            refusals.append(str(e))
    return out, refusals


def _reference():
    model = make_net()
    out = []
    for xb, yb in BATCHES:
        model.zero_grad(set_to_none=True)
        loss = F.mse_loss(model(xb.double()), yb.double())
        loss.backward()
        out.append(dict(loss=loss.item(),
                        grads={n: None if q.grad is None else q.grad.clone()
                               for n, q in model.named_parameters()}))
        with torch.no_grad():
            for q in model.parameters():
                if q.grad is not None:
                    q.add_(q.grad, alpha=-LR)
        out[-1]["params"] = {n: q.detach().clone() for n, q in model.named_parameters()}
    return out


def _expected_counts(case, stage, actions):
    """(all-gathers, reduce-scatters) per step on `stage`: one of each per unit (a module with
    trainable parameters of its own) for every action / every B ("every action"), or once per
    unit ("whole step")."""
    p, _, name, m, policy = case
    v = 2 if name == "interleaved" else 1
    pieces = pp.split_model(make_net().net, p * v)
    units = [sum(any(q.requires_grad for q in mod.parameters(recurse=False))
                 for mod in piece.modules()) for piece in pieces]
    of = [units[ps.virtual_stage(stage, c, p)] for c in range(v)]
    if policy == "whole step":
        return sum(of), sum(of), of
    return (sum(of[a.chunk] for a in actions),
            sum(of[a.chunk] for a in actions if a.kind == "B"), of)


def _check(results, world_size, trace=None):
    expected = _reference()
    for case in CASES[world_size]:
        p, d, name, m, policy = case
        per_rank = [r[0][case] for r in results]
        got = fsdp.unshard(per_rank)
        for step, (g, e) in enumerate(zip(got, expected)):
            assert abs(g["loss"] - e["loss"]) < 1e-12, (case, step)
            assert set(g["params"]) == set(e["params"]), case
            for n in e["params"]:
                assert (g["grads"][n] is None) == (e["grads"][n] is None), (case, step, n)
                if e["grads"][n] is not None:
                    torch.testing.assert_close(g["grads"][n], e["grads"][n], rtol=0, atol=1e-12)
                torch.testing.assert_close(g["params"][n], e["params"][n], rtol=0, atol=1e-12)
        actions = SCHEDULES[name](p, m)
        for rank, steps in enumerate(per_rank):
            stage = rank % p
            ag, rs, units = _expected_counts(case, stage, actions[stage])
            assert all(s["counts"] == {"all_gather": ag, "reduce_scatter": rs} for s in steps), \
                (case, rank, steps[0]["counts"])
            if name != "interleaved":           # one chunk: the simulator's count x its units
                assert ag == ps.parameter_gathers(actions[stage], policy)[0] * units[0], case
            if trace is not None:
                ops = [e["op"] for e in trace.comm(rank) if e["label"] == [repr(case)]]
                assert ops.count("all_gather") == STEPS * ag, (case, rank)
                assert ops.count("reduce_scatter") == STEPS * rs, (case, rank)


def _check_memory(results):
    """"every action" holds one unit whole (its parameters and its gradient) at most;
    "whole step" the whole stage's."""
    for r in results:
        every = r[0][(2, 2, "1F1B", 4, "every action")][0]
        whole = r[0][(2, 2, "1F1B", 4, "whole step")][0]
        sizes = {n: torch.Size(s).numel() * 8 for n, s in whole["shapes"].items()}
        trainable = [n for n, (*_, g) in whole["pieces"].items() if g is not None]
        assert whole["peak_whole_bytes"] == 2 * sum(sizes[n] for n in trainable)
        assert every["peak_whole_bytes"] == 2 * max(sizes[n] + sizes.get(n[:-6] + "bias", 0)
                                                    for n in trainable if n.endswith("weight"))


REFUSALS = [r"pp × dp = \d × 2 = \d+ ranks, but this run has \d: launch",
            r"policy must be one of \('every action', 'whole step'\)",
            r"runs schedules of F and B actions",
            r"fewer than m = 4 micro-batches: use batches of at least"]


def _check_refusals(results):
    import re
    for _, refusals in results:
        for pattern, message in zip(REFUSALS, refusals):
            assert message is not None and re.search(pattern, message), (pattern, message)


def test_pipeline_fsdp_at_world_4_equals_one_process_and_counts_its_collectives():
    results = distlab.run(_cases, 4, trace=True, timeout=120)
    _check(results, 4, results.trace)
    _check_memory(results)
    _check_refusals(results)


def test_pipeline_fsdp_at_world_6_equals_one_process():
    results = distlab.run(_cases, 6, timeout=120)
    _check(results, 6)
    _check_refusals(results)


def test_pipeline_fsdp_refuses_what_it_does_not_shard():
    """Refusals before any rank communicates need no process group."""
    class Mesh:
        shape = (2, 2)
    with pytest.raises(ValueError, match="policy must be one of"):
        fsdp.ShardedStage(pp.split_model(make_net().net, 2), Mesh(), (8,), policy="always")
    with pytest.raises(ValueError, match="the dual placement"):
        fsdp.ShardedStage(pp.split_model(make_net().net, 2), Mesh(), (8,), placement="dual")
