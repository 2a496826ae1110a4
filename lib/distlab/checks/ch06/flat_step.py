"""Workbook 06, exercise 1: a sharded optimizer step over one flat buffer, on a process group."""
import torch
import torch.distributed as dist
import torch.nn.functional as F

from ... import models, trace as _trace
from .. import CheckFailed, _traffic, compare, forbid, passed
from ._common import LR, SIZES, STEPS, _Collectives, _course_code, _kb, _run

# ---- exercise 1: ZeRO-2 over one flat buffer, on a process group ------------------------------
#
# The chapter shards each parameter separately (ZeRO.step). Here the shard is a slice of ONE flat
# buffer, all parameters flattened and concatenated (as DeepSpeed and FSDP's flat parameter lay
# them out): a rank's slice starts and ends inside parameters, and the last rank's is shorter.
# The learner writes the step over `group`: the checker runs it on 5 ranks split as [0, 2, 4]
# and [1, 3] (sizes 3 and 2, a group whose ranks are not 0..k), then on all 5 ranks, and judges
# the parameters (float64, against Adam on one process per group), what each collective carried
# (nothing all-zero), on which group it ran, and the bytes (no more than a reduce-scatter of the
# padded flat gradient plus an all-gather of the padded shard).

FLAT_GROUPS = ((0, 2, 4), (1, 3))
FLAT_WORLD, FLAT_BATCH = 5, 30           # 30 rows split evenly over 3, 2 and 5 ranks


def _flat_layout(params, n, r):
    """(c, lo, hi): each slice holds c = ceil(total / n) values of the flat buffer; rank r (in
    the group) owns [lo, hi) — the last ranks fewer."""
    total = sum(p.numel() for p in params)
    c = -(-total // n)
    return c, min(r * c, total), min((r + 1) * c, total)


def _flat_phase(fn, group, members, rank, seed):
    """STEPS steps of the learner's flat step over `group` (members: its global ranks)."""
    n, r = len(members), members.index(rank)
    model = models.make_mlp(SIZES, seed=3)
    params = list(model.parameters())
    c, lo, hi = _flat_layout(params, n, r)
    flat = torch.cat([p.detach().reshape(-1) for p in params])
    shard = torch.nn.Parameter(flat[lo:hi].clone())
    optimizer = torch.optim.Adam([shard], lr=LR)
    x, y = models.regression_data(64, SIZES[0], SIZES[-1], seed=seed)
    windows = []
    for gx, gy in models.batches_of(x, y, FLAT_BATCH, STEPS):
        model.zero_grad()
        optimizer.zero_grad()
        F.mse_loss(model(gx.chunk(n)[r]), gy.chunk(n)[r]).backward()
        grad = torch.cat([p.grad.reshape(-1) for p in params])
        start = _trace.now()
        with forbid(*_course_code(), exercise="write the flat sharded step yourself"), \
                _Collectives() as rec:
            fn(params, shard, optimizer, group)
        windows.append((start, _trace.now()))
        where = (f"on the group {list(members)}, rank {rank}" if n < dist.get_world_size()
                 else f"on all {n} ranks, rank {rank}")
        _judge_flat_calls(rec.calls, grad, shard.detach(), n, where)
    states = sum(v.numel() for st in optimizer.state.values() for v in st.values() if v.dim())
    return dict(params=[p.detach().clone() for p in params], shard=shard.detach().clone(),
                states=states, windows=windows, c=c, n=n)


_piece_of = _traffic.carries


def _judge_flat_calls(calls, grad, shard, n, where):
    """What each collective of one step carried: pieces of this rank's flat gradient
    (reduce-scatter) and of its updated shard (all-gather); all-zero messages are decoys."""
    for _, op, values in calls:
        if values is None or not values.numel():
            continue
        if not values.abs().max():
            raise CheckFailed(f"{where}: a {op} carried all zeros; the step needs only the "
                              f"flat gradient (reduce-scattered) and the updated shard "
                              f"(all-gathered).")
        if op == "reduce_scatter" and not _piece_of(values, grad, (1.0, 1.0 / n)):
            raise CheckFailed(f"{where}: a reduce-scatter carried values that are not this "
                              f"rank's flat gradient (the parameters' gradients, flattened and "
                              f"concatenated in order, then padded).")
        if op == "all_gather" and not _piece_of(values, shard, (1.0,)):
            raise CheckFailed(f"{where}: an all-gather carried values that are not this "
                              f"rank's updated shard: step the optimizer first, then gather "
                              f"flat_shard.")


def _flat_rank(rank, world_size, fn):
    torch.set_default_dtype(torch.float64)
    groups = [dist.new_group(list(g)) for g in FLAT_GROUPS]    # every rank creates every group
    mine = next(i for i, g in enumerate(FLAT_GROUPS) if rank in g)
    sub = _flat_phase(fn, groups[mine], list(FLAT_GROUPS[mine]), rank, seed=10 + mine)
    dist.barrier()
    whole = _flat_phase(fn, dist.group.WORLD, list(range(world_size)), rank, seed=20)
    return dict(sub=sub, whole=whole, group=FLAT_GROUPS[mine])


def _flat_reference(seed):
    torch.set_default_dtype(torch.float64)
    try:
        model = models.make_mlp(SIZES, seed=3)
        x, y = models.regression_data(64, SIZES[0], SIZES[-1], seed=seed)
        models.train_reference(model, models.batches_of(x, y, FLAT_BATCH, STEPS),
                               optimizer="adam", lr=LR)
        return [p.detach().clone() for p in model.parameters()]
    finally:
        torch.set_default_dtype(torch.float32)


def _flat_traffic(trace, rank, phase, members):
    """Bytes this rank sent inside its steps, by the checkers' one traffic rule (`_traffic`: a
    collective its ring share, a message its size, a receive nothing), and the first call on
    another group."""
    calls = _traffic.records(trace, rank, lambda e: any(a <= e["launch"] <= b
                                                        for a, b in phase["windows"]))
    per_op = {}
    for c in calls:
        per_op[c["op"]] = per_op.get(c["op"], 0) + c["wire"]
    bad, _ = _traffic.off_group(calls, members)
    elsewhere = None if bad is None else (bad["op"], [bad["peer"]] if bad["kind"] in
                                          _traffic.P2P else bad["group"])
    return _traffic.wire(calls), per_op, elsewhere


def check_flat_zero_step(fn):
    """fn(params, flat_shard, optimizer, group): one ZeRO-2 step over one flat buffer, on `group`;
    run on 5 ranks as groups [0, 2, 4] and [1, 3], then as one group of 5."""
    name = getattr(fn, "__name__", "flat_zero_step")
    got = _run(_flat_rank, FLAT_WORLD, fn, name, rule=(
        "a collective is called by every rank of ONE group with tensors of the same size — pass "
        "group=group to every collective, and pad the flat buffer to c·n values (c = "
        "ceil(total / n), n the group's size, not the world's)."))
    names = [f"net.{i}.{k}" for i in range(0, 2 * (len(SIZES) - 1), 2) for k in ("weight", "bias")]
    cases = [(g, 10 + i, "sub") for i, g in enumerate(FLAT_GROUPS)]
    cases.append((tuple(range(FLAT_WORLD)), 20, "whole"))
    for members, seed, key in cases:
        want = _flat_reference(seed)
        n = len(members)
        label = (f"the group {list(members)}" if key == "sub" else f"all {n} ranks")
        for rank in members:
            phase = got[rank][key]
            for pname, g, w in zip(names, phase["params"], want):
                compare(g, w, f"{name} on {label}, rank {rank}, after {STEPS} steps, parameter "
                        f"{pname}", atol=1e-10, rtol=1e-9)
            r = members.index(rank)
            _, lo, hi = _flat_layout(want, n, r)
            compare(phase["shard"], torch.cat([w.reshape(-1) for w in want])[lo:hi],
                    f"{name} on {label}, rank {rank}: the flat shard after the steps",
                    atol=1e-10, rtol=1e-9)
            total, per_op, elsewhere = _flat_traffic(got.trace, rank, phase, members)
            if elsewhere is not None:
                raise CheckFailed(f"{name} on {label}, rank {rank}: a {elsewhere[0]} ran on the "
                                  f"ranks {list(elsewhere[1])}, not on the group it was given; "
                                  f"pass group=group to every collective (and count ranks and "
                                  f"sizes within the group).")
            allowed = 2 * (n - 1) * phase["c"] * 8 * STEPS
            if total > allowed * (1 + 1e-9):
                calls = ", ".join(f"{op} {_kb(v)}" for op, v in sorted(per_op.items()))
                raise CheckFailed(f"{name} on {label}, rank {rank} sent {_kb(total)} ({calls}; "
                                  f"from the run's trace), {total / allowed:.2f}× the "
                                  f"{_kb(allowed)} of a reduce-scatter of the padded flat "
                                  f"gradient plus an all-gather of the padded shard per step: "
                                  f"each rank needs only the average of its own slice.")
        states = sum(got[rank][key]["states"] for rank in members)
        n_params = sum(w.numel() for w in want)
        if states != 2 * n_params:
            raise CheckFailed(f"on {label} the ranks keep {states} Adam state values in all; "
                              f"sharded Adam keeps 2 per parameter ({2 * n_params}), split "
                              f"between the ranks.")
    passed(f"{name} trains exactly like Adam on one process over one flat buffer whose slices "
           f"cut across parameters — on the groups [0, 2, 4] and [1, 3] and on all 5 ranks — "
           f"each rank keeping only its slice of Adam's state and sending what a reduce-scatter "
           f"plus an all-gather send, on its own group.")
