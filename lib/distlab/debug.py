"""Tools for finding distributed bugs: silent ones (replicas that drift apart, data every rank
sees, gradients summed instead of averaged) and loud ones (a collective one rank never reaches).

Silent bugs do not crash: the loss still goes down, just not the loss one process would get. Each
detector here runs on every rank, talks to the other ranks, and returns the SAME answer on every
rank, so it can be dropped into a training loop without creating a hang of its own.
"""
import contextlib
import hashlib
import os
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn.functional as F

from . import trace
from .models import batches_of, make_mlp, regression_data, train_reference


# ---- detectors ------------------------------------------------------------------------------------

def checksums(model):
    """Two float64 numbers per parameter: its sum and a position-weighted sum.

    The plain sum misses a swap of two elements; the weighted one catches it. Both are exact enough
    in float64 that equal replicas give bit-identical checksums.
    """
    return tensor_checksums(model.parameters())


def tensor_checksums(tensors):
    """`checksums` of any tensors (parameters, gradients): one row of two numbers per tensor."""
    rows = []
    for p in tensors:
        flat = p.detach().reshape(-1).double()
        weights = torch.arange(1, flat.numel() + 1, dtype=torch.float64, device=flat.device)
        rows.append(torch.stack([flat.sum(), (flat * weights).sum()]))
    return torch.stack(rows)


def replicas_out_of_sync(model, group=None):
    """Names of the parameters that are not identical on every rank ([] when all replicas agree)."""
    mine = checksums(model)
    everyone = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(everyone, mine, group=group)
    names = [name for name, _ in model.named_parameters()]
    return [names[i] for i in range(len(names))
            if any(not torch.equal(other[i], everyone[0][i]) for other in everyone[1:])]


def sample_fingerprints(x):
    """One stable 63-bit hash per sample (row of x): equal samples, equal fingerprints."""
    rows = x.detach().cpu().contiguous().reshape(len(x), -1)
    return [int.from_bytes(hashlib.blake2b(r.numpy().tobytes(), digest_size=8).digest(), "little")
            >> 1 for r in rows]


def duplicated_samples(x, group=None):
    """How many of this step's samples more than one rank is training on (0 when the ranks'
    batches are disjoint). Duplicates within one rank's own batch are not counted."""
    everyone = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, set(sample_fingerprints(x)), group=group)
    seen, duplicated = set(), set()
    for fingerprints in everyone:
        duplicated |= seen & fingerprints
        seen |= fingerprints
    return len(duplicated)


def gradient_scale(got, expected):
    """The factor between two sets of gradients: ~1 when equal, ~world_size when summed."""
    num = sum((g.double() * e.double()).sum() for g, e in zip(got, expected))
    den = sum((e.double() ** 2).sum() for e in expected)
    return (num / den).item()


def explain_gradient_scale(scale, world_size, tol=1e-3):
    """A sentence about what a gradient scale means for a data-parallel step."""
    if abs(scale - 1) < tol:
        return "gradients equal the single-process ones: they are averaged."
    if abs(scale - world_size) < tol * world_size:
        return (f"gradients are {world_size}x the single-process ones: they were summed, not "
                f"averaged (divide by world_size, or use ReduceOp.AVG).")
    return f"gradients are {scale:.4g}x the single-process ones: they are not a plain average."


def detail_process_group(timeout_s=30):
    """init_process_group with TORCH_DISTRIBUTED_DEBUG=DETAIL in force.

    The variable is read when torch.distributed is imported, and distlab's ranks import torch
    before they see the cell's `env=`: so set the level by hand, then create the group (run with
    `distlab.run(..., init=False)`). DETAIL wraps the group in a checker that compares every
    collective's op type, shapes and dtypes across ranks before running it.
    """
    dist.set_debug_level(dist.DebugLevel.DETAIL)
    dist.init_process_group("gloo", timeout=timedelta(seconds=timeout_s))


# ---- a hand-written data-parallel loop with every piece replaceable --------------------------------

def contiguous_shard(x, y, rank, world_size):
    """Rank r's slice of the global batch: the r-th of world_size equal, contiguous parts."""
    n = len(x) // world_size
    return x[rank * n:(rank + 1) * n], y[rank * n:(rank + 1) * n]


def average_gradients(model):
    for p in model.parameters():
        dist.all_reduce(p.grad)
        p.grad /= dist.get_world_size()


def broadcast_parameters(model, src=0):
    with torch.no_grad():
        for p in model.parameters():
            dist.broadcast(p, src=src)


def problem(steps=4, global_batch=12, seed=0, dtype=torch.float64):
    """The shared training problem: an MLP, its data, and the global batches of each step."""
    x, y = regression_data(n=96, seed=seed)
    model = make_mlp((16, 32, 4), seed=seed).to(dtype)
    return model, batches_of(x.to(dtype), y.to(dtype), global_batch, steps)


def train_data_parallel(rank, world_size, shard=contiguous_shard, average=average_gradients,
                        build=None, sync=None, steps=4, global_batch=12, lr=0.1, watch=False):
    """Data-parallel SGD by hand. Returns {"losses", "params", "out_of_sync", "duplicated"}.

    `shard(x, y, rank, world_size)` picks this rank's samples, `average(model)` combines the
    gradients, `build(rank)` makes the replica and `sync(model)` makes replicas equal before
    training: swap one for a broken version and the result shows the bug. `losses` are the global
    means (what one process training on the global batch would print); with `watch=True` the
    detectors run every step.
    """
    model, batches = problem(steps, global_batch)
    if build is not None:
        model = build(rank)
    if sync is not None:
        sync(model)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    losses, out_of_sync, duplicated = [], [], []
    for x, y in batches:
        xs, ys = shard(x, y, rank, world_size)
        if watch:
            out_of_sync.append(len(replicas_out_of_sync(model)))
            duplicated.append(duplicated_samples(xs))
        opt.zero_grad()
        loss = F.mse_loss(model(xs), ys)
        loss.backward()
        average(model)
        opt.step()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        losses.append(mean.item() / world_size)
    return {"losses": losses, "params": [p.detach().clone() for p in model.parameters()],
            "out_of_sync": out_of_sync, "duplicated": duplicated}


def reference(steps=4, global_batch=12, lr=0.1):
    """One process on the global batches: the losses and final parameters to compare with."""
    model, batches = problem(steps, global_batch)
    losses = train_reference(model, batches, F.mse_loss, "sgd", lr)
    return {"losses": losses, "params": [p.detach().clone() for p in model.parameters()]}


# ---- performance: where a step's time goes, and what one slow rank costs ---------------------------

COMMUNICATION = ("c10d::", "gloo:", "nccl:", "record_param_comms")


@contextlib.contextmanager
def _quiet_fds():
    # The profiler's C++ side prints start/stop notices straight to fd 1/2, with pids and clocks.
    saved = [os.dup(1), os.dup(2)]
    with open(os.devnull, "w") as null:
        os.dup2(null.fileno(), 1)
        os.dup2(null.fileno(), 2)
    try:
        yield
    finally:
        for fd, copy in zip((1, 2), saved):
            os.dup2(copy, fd)
            os.close(copy)


def annotated_ddp_step(rank, sizes=(16, 256, 256, 4), batch=64, bucket_cap_mb=25, lr=0.01):
    """A training step of torch's DDP on the course's MLP (`sizes`, this rank's `batch` samples),
    its forward, backward and optimizer marked with `record_function` so that a profile names
    them. Returns `step()`, after the two steps DDP takes to settle: it rebuilds its buckets
    after the first backward and broadcasts the new order at the start of the second, and
    neither belongs in a picture of a steady step. (tools/make_profiler_trace.py profiles it too.)
    """
    from torch.nn.parallel import DistributedDataParallel as DDP
    from torch.profiler import record_function
    model = DDP(make_mlp(sizes, seed=0), bucket_cap_mb=bucket_cap_mb)
    x, y = regression_data(n=batch, in_dim=sizes[0], out_dim=sizes[-1], seed=rank)
    opt = torch.optim.SGD(model.parameters(), lr=lr)

    def step():
        with record_function("forward"):
            loss = F.mse_loss(model(x), y)
        with record_function("backward"):
            loss.backward()
        with record_function("optimizer"):
            opt.step()
            opt.zero_grad()

    step()
    step()
    return step


def profile_ddp_steps(rank, world_size, width=256, steps=3, batch=64):
    """torch.profiler around `steps` DDP training steps of an MLP on this rank.

    Returns {"ms": {"forward", "backward", "optimizer", "communication"}, "top": [op names by self
    time]}. Communication is the self time of the c10d/gloo/nccl ops, which run inside backward
    (DDP all-reduces its buckets while the rest of backward is still going).
    """
    from torch.profiler import ProfilerActivity, profile
    step = annotated_ddp_step(rank, (16, width, width, 4), batch)
    with _quiet_fds(), profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            step()
    averages = prof.key_averages()
    ms = {k: 0.0 for k in ("forward", "backward", "optimizer", "communication")}
    for e in averages:
        if e.key in ("forward", "backward", "optimizer"):
            ms[e.key] = e.cpu_time_total / 1000 / steps
        elif e.key.startswith(COMMUNICATION):
            ms["communication"] += e.self_cpu_time_total / 1000 / steps
    ops = sorted((e for e in averages if e.key not in ("forward", "backward", "optimizer")),
                 key=lambda e: -e.self_cpu_time_total)
    return {"ms": ms, "top": [e.key for e in ops[:5]]}


def step_times(rank, world_size, slow_rank=None, delay=0.05, steps=5, width=128, slowdown=None,
               real_size=None):
    """Per-step seconds of data-parallel training on this rank: its own compute, then the time it
    waits inside the gradient all-reduce. `slow_rank` spends `delay` more per step, or, with
    `slowdown`, that fraction of its own compute more (a straggler: a throttled GPU, a noisy
    neighbour, a rank that also writes the checkpoint).

    `real_size`: a dict (hidden, layers, tokens) for a step at real size on meta tensors (run it
    under emulation): `layers` MLP blocks hidden -> 4·hidden -> hidden in bf16, `tokens` rows per
    rank; `width` is then unused. The gradients leave in one all-reduce after backward (no
    overlap), so the step is compute + all-reduce + whatever the slowest rank adds.

    Times are read from `distlab.trace.now()`: the wall clock in a plain run, the modeled clock
    under `distlab.run(..., emulate=...)`, where the straggler's delay is modeled compute too."""
    if real_size is None:
        model = make_mlp((16, width, width, 4), seed=0)
        x, y = regression_data(n=32, seed=rank)
    else:
        h, tokens = real_size["hidden"], real_size["tokens"]
        with torch.device("meta"):
            model = torch.nn.Sequential(*[m for _ in range(real_size["layers"]) for m in (
                torch.nn.Linear(h, 4 * h), torch.nn.GELU(), torch.nn.Linear(4 * h, h))])
            model = model.to(torch.bfloat16)
            x = torch.empty(tokens, h, dtype=torch.bfloat16)
            y = torch.empty(tokens, h, dtype=torch.bfloat16)
    compute, wait = [], []
    dist.barrier()
    for _ in range(steps):
        start = trace.now()
        with trace.span("forward+backward"):
            model.zero_grad()
            F.mse_loss(model(x), y).backward()
        if rank == slow_rank:
            extra = delay if slowdown is None else slowdown * (trace.now() - start)
            trace.compute(extra, name="straggler")
        grads = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
        done = trace.now()
        dist.all_reduce(grads)
        compute.append(done - start)
        wait.append(trace.now() - done)
    return {"compute": compute, "wait": wait}


def slow_ranks(compute, tolerance=0.05):
    """Per-rank step telemetry: the ranks whose own compute (the time before they enter the
    step's collective) exceeds the median rank's by more than `tolerance`, slowest first.

    `compute`: one number per rank (seconds of one step, or a mean over steps). A rank's whole
    step time cannot find a straggler in synchronous training: every rank leaves the gradient
    all-reduce together, so every step lasts as long as the slowest. Time the part before the
    collective, gather it, and compare."""
    if len(compute) == 0:
        raise ValueError("slow_ranks needs one compute time per rank; got none.")
    times = [float(t) for t in compute]
    ordered = sorted(times)
    mid = len(ordered) // 2
    median = ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2
    slow = [r for r, t in enumerate(times) if t > median * (1 + tolerance)]
    return sorted(slow, key=lambda r: -times[r])


# ---- a trace's communication: the link's time, or one rank's late thread? ----------------------

def matched_calls(run_trace):
    """The trace's collectives matched across ranks: the i-th call on a group on every rank of
    that group is one collective. Returns one dict per collective, in launch order of its first
    rank: op, bytes, group, and per rank its `start` and `end` (seconds)."""
    calls = {}
    for rank in range(run_trace.world_size):
        seen = {}
        for e in run_trace.comm(rank):
            if e["op"] in ("send", "recv") or e["start"] is None or e["end"] is None:
                continue
            group = tuple(e["group"])
            i = seen[group] = seen.get(group, -1) + 1
            call = calls.setdefault((group, i), {"op": e["op"], "bytes": e["bytes"],
                                                  "group": group, "start": {}, "end": {}})
            call["start"][rank], call["end"][rank] = e["start"], e["end"]
    return sorted(calls.values(), key=lambda c: min(c["start"].values()))


def completion_skew(run_trace):
    """Per matched collective, how long after the group's first rank each rank recorded its end
    (seconds). The ranks of one collective finish together, within a message latency: the last
    byte one rank needs is the last byte another sends. An end that trails the group's first by
    milliseconds is that rank's own delay (its communication thread not scheduled, a host busy
    elsewhere, the profiler), not time on the link."""
    return [{**c, "tail": {r: end - min(c["end"].values()) for r, end in c["end"].items()}}
            for c in matched_calls(run_trace)]


def communication_until_group_done(run_trace, rank):
    """Rank `rank`'s communication with each call cut at the end its group's first rank recorded:
    {"comm", "overlapped", "exposed", "tail"} in seconds, with the definitions of
    `Trace.overlap` (union of transfers in flight; the part of it during compute). `tail` is
    what the cut removed: time the rank's records ran on after the collective was complete."""
    from .trace import _intersection, _union
    cut = []
    for c in matched_calls(run_trace):
        if rank in c["start"]:
            done = min(c["end"].values())
            cut.append((c["start"][rank], max(c["start"][rank], done)))
    whole = [(c["start"][rank], c["end"][rank]) for c in matched_calls(run_trace)
             if rank in c["start"]]
    compute = [(s["start"], s["end"]) for s in run_trace.compute(rank)]
    comm, hidden = _union(cut), _intersection(cut, compute)
    return dict(comm=comm, overlapped=hidden, exposed=comm - hidden,
                tail=_union(whole) - comm)


# ---- memory: a real-size step's allocations, recorded on the meta device -----------------------

def record_meta_step(hidden, layers, token_counts):
    """A real-size data-parallel replica's steps (an MLP stack in pure bf16: bf16 weights,
    gradients and AdamW moments, no fp32 master copy), one step per entry of `token_counts`,
    recorded by memory_debug.StepRecorder on meta tensors: real sizes, nothing computed.

    Returns memory_debug.record_step's log plus "weights" (bytes per parameter tensor), "made"
    (bytes each category allocated during the steps) and "peak_at" (the event index where the
    live bytes peak)."""
    from . import memory_debug
    with torch.device("meta"):
        model = memory_debug.mlp_stack(hidden, layers)
        opt = torch.optim.AdamW(model.parameters(), foreach=True)
        batches = [(torch.empty(n, hidden, dtype=torch.bfloat16),
                    torch.empty(n, hidden, dtype=torch.bfloat16)) for n in token_counts]
        log = memory_debug.record_step(model, batches, F.mse_loss, opt)
    log["weights"] = [p.untyped_storage().nbytes() for p in model.parameters()]
    made = {}
    for e in log["events"]:
        if e["action"] == "alloc":
            made[e["category"]] = made.get(e["category"], 0) + e["bytes"]
    log["made"] = made
    rows = memory_debug.live_bytes(log["events"], log["parameters"])
    log["rows"] = rows
    log["peak_at"] = max(range(len(rows)), key=lambda i: sum(rows[i].values()))
    return log


def ruler_reading(run_trace, rank):
    """What one drag in Perfetto reads off a rank's rows, from its first transfer's start to its
    last one's end: {"window" (the ruler), "slices" (the Slices tab's sum of the transfers'
    durations: transfers in flight together count twice), "compute_inside" (the compute slices
    inside the selection)}, in seconds."""
    transfers = [(e["start"], e["end"]) for e in run_trace.comm(rank)]
    first, last = min(a for a, _ in transfers), max(b for _, b in transfers)
    inside = sum(min(s["end"], last) - max(s["start"], first) for s in run_trace.compute(rank)
                 if s["end"] > first and s["start"] < last)
    return {"window": last - first, "slices": sum(b - a for a, b in transfers),
            "compute_inside": inside}
