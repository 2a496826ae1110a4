"""Exercise 6 of workbook 05: find and fix the four production bugs of a DDP script, run on 4
ranks standing in for 2 nodes, judged from what each rank read, sent, computed and wrote."""
import contextlib
import os
import tempfile

import torch

from ... import models
from .. import CheckFailed, _traffic, compare, passed, run_learner, sizes_phrase
from ._common import refuse_too, refused
from ._wire import Wire, delivered, missing_gradient
from .sampling import _judge_shuffling


# ---- exercise 6: find and fix the bugs of a DDP script -------------------------------------------

# The script runs on 4 ranks standing in for 2 nodes of 2 processes: each rank's environment says
# what torchrun would set there (RANK = GROUP_RANK × 2 + LOCAL_RANK), so LOCAL_RANK repeats.
NODES, PER_NODE = 2, 2
SEQUENCES, MAX_TOKENS, SCRIPT_EPOCHS, SCRIPT_LR = 16, 4, 2, 0.1


def _token_data():
    """16 sequences of 4 positions, of which the first 1..4 are real tokens (float64)."""
    g = torch.Generator().manual_seed(11)
    x = torch.randn(SEQUENCES, MAX_TOKENS, 4, generator=g, dtype=torch.float64)
    y = torch.tanh(x @ torch.randn(4, 2, generator=g, dtype=torch.float64))
    lengths = torch.randint(1, MAX_TOKENS + 1, (SEQUENCES,), generator=g)
    return x, y, torch.arange(MAX_TOKENS) < lengths[:, None]


def _token_model():
    return models.make_mlp(sizes=(4, 8, 2), seed=4).double()


class Sequences(torch.utils.data.Dataset):
    """(x, y, mask) of one sequence per item.

    Which sequences a rank trained on is read off the model's forward input, not recorded here:
    a DataLoader with num_workers > 0 calls __getitem__ in its worker processes (whatever they
    record is lost to the rank), and ahead of time (prefetching)."""

    def __init__(self, x, y, mask):
        self.x, self.y, self.mask = x, y, mask

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return self.x[i], self.y[i], self.mask[i]


def _fingerprints(x):
    """{bytes of sequence i's inputs: i}: every sequence's x is distinct random float64."""
    return {x[i].numpy().tobytes(): i for i in range(len(x))}


class _Writes:
    """Counts, inside a rank, the checkpoint files written to `path`. Every spelling of torch.save
    (torch.save, `from torch import save`, torch.serialization.save) opens its file through
    torch.serialization's two writers, looked up when save runs: those are watched, not the
    `torch.save` name, which an imported alias bypasses."""

    def __init__(self, path):
        self.path, self.count = os.path.realpath(path), 0

    def _mine(self, f):
        name = f if isinstance(f, (str, os.PathLike)) else getattr(f, "name", None)
        return isinstance(name, (str, os.PathLike)) and os.path.realpath(name) == self.path

    def __enter__(self):
        ser = torch.serialization
        self._saved = ser._open_zipfile_writer, ser._open_file_like
        zipped, file_like = self._saved

        def open_zipfile_writer(f, *args, **kwargs):
            self.count += self._mine(f)
            return zipped(f, *args, **kwargs)

        def open_file_like(f, mode, *args, **kwargs):
            if "w" in mode:
                self.count += self._mine(f)
            return file_like(f, mode, *args, **kwargs)
        ser._open_zipfile_writer, ser._open_file_like = open_zipfile_writer, open_file_like
        return self

    def __exit__(self, *exc):
        torch.serialization._open_zipfile_writer, torch.serialization._open_file_like = \
            self._saved


@contextlib.contextmanager
def _loader_workers_by_fork():
    """A DataLoader's workers, inside a rank, start by fork (as on a plain Linux job), not by the
    forkserver the rank itself came from: a forkserver worker imports torch again (tens of
    seconds here) and under the run's trace it never answers, which a check would otherwise
    report as the learner's deadlock."""
    import multiprocessing
    before = multiprocessing.get_start_method(allow_none=True)
    multiprocessing.set_start_method("fork", force=True)
    try:
        yield
    finally:
        multiprocessing.set_start_method(before, force=True)


def _token_reference(step_reads):
    """One process, step by step, on the global batch (every sequence any rank read for that
    step): the squared error summed over the batch's real tokens, divided by their number.
    Returns per step the gradient, the parameters after SGD, and the gradient the ranks would get
    if each took the mean over its own tokens and DDP averaged those means."""
    model, (x, y, mask) = _token_model(), _token_data()
    params = list(model.parameters())
    opt = torch.optim.SGD(params, lr=SCRIPT_LR)
    out = []
    for per_rank in step_reads:
        def loss_of(ids):
            ids = torch.tensor(sorted(ids), dtype=torch.long)
            return (model(x[ids]) - y[ids]).pow(2).sum(-1)[mask[ids]].mean()
        own_means = [torch.autograd.grad(loss_of(ids), params) for ids in per_rank]
        local = [sum(g) / len(own_means) for g in zip(*own_means)]
        opt.zero_grad()
        loss_of([i for ids in per_rank for i in ids]).backward()
        grads = [p.grad.clone() for p in params]
        opt.step()
        out.append(dict(grads=grads, local=local, params=[p.detach().clone() for p in params],
                        tokens=[int(mask[sorted(ids)].sum()) for ids in per_rank]))
    return out


def check_ddp_script(fn):
    """fn(model, dataset, epochs, ckpt_path): one rank of a DDP training script, started as
    torchrun starts it (RANK, WORLD_SIZE, LOCAL_RANK in the environment; the group is up).

    Run on 4 ranks as 2 nodes × 2 processes. Judged on what the ranks did: which sequences each
    read (every one exactly once per epoch across the ranks, a new order every epoch), the
    gradient the optimizer used and the weights after every step against one process on the
    global batch (the loss averaged over the global batch's tokens, float64), that gradients
    travelled (by the one traffic rule, with their values), and who printed and who wrote the
    checkpoint (global rank 0 only).
    """
    name = getattr(fn, "__name__", "your script")
    ws = NODES * PER_NODE

    def learner(rank, world_size, path):
        import io
        from torch.optim.optimizer import (register_optimizer_step_post_hook,
                                           register_optimizer_step_pre_hook)
        os.environ.update(LOCAL_RANK=str(rank % PER_NODE), LOCAL_WORLD_SIZE=str(PER_NODE),
                          GROUP_RANK=str(rank // PER_NODE), GROUP_WORLD_SIZE=str(NODES))
        model, data = _token_model(), Sequences(*_token_data())
        params = list(model.parameters())
        log = {"steps": [], "saved": 0}
        seen = {"read": 0, "sent": 0}
        which, trained = _fingerprints(data.x), []

        def forward_input(module, args):
            if torch.is_grad_enabled() and args and isinstance(args[0], torch.Tensor):
                rows = args[0].detach().cpu().double()
                trained.extend(which.get(r.numpy().tobytes(), -1) for r in rows)
        model.register_forward_pre_hook(forward_input)

        def before(opt, args, kwargs):
            if any(p is q for g in opt.param_groups for p in g["params"] for q in params):
                log["steps"].append(dict(
                    read=trained[seen["read"]:], kind=type(opt).__name__,
                    sent=wire.records[seen["sent"]:],
                    lr=[g["lr"] for g in opt.param_groups],
                    grads=[p.grad.detach().cpu().clone() if p.grad is not None else None
                           for p in params],
                    # the bytes it put on the wire, by the one rule (a collective its ring
                    # share, a message its size): DDP's buckets or an all-reduce by hand alike
                    wire=_traffic.wire(wire.records[seen["sent"]:])))
                seen.update(read=len(trained), sent=wire.mark())

        def after(opt, args, kwargs):
            if log["steps"] and "params" not in log["steps"][-1]:
                log["steps"][-1]["params"] = [p.detach().cpu().clone() for p in params]

        printed = io.StringIO()
        handles = [register_optimizer_step_pre_hook(before),
                   register_optimizer_step_post_hook(after)]
        wire, writes = Wire(), _Writes(path)
        try:
            with refused("fix the script yourself"), \
                    contextlib.redirect_stdout(printed), _loader_workers_by_fork(), wire, writes:
                fn(model, data, SCRIPT_EPOCHS, path)
        finally:
            for h in handles:
                h.remove()
        log.update(read=list(trained), printed=printed.getvalue(), saved=writes.count,
                   final=[p.detach().cpu().clone() for p in params],
                   grad_bytes=sum(p.numel() * p.element_size() for p in params))
        return log

    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "checkpoint.pt")
        got = run_learner(learner, ws, path, name=name, timeout=30,
                          deadlock_rule="Every rank must make the same collective calls in the "
                                        "same order: a collective under `if rank == 0:` waits "
                                        "forever for the ranks that skipped it.")
        _judge_reads([g["read"] for g in got], ws)
        _judge_script_steps(got, ws)
        _judge_reports(got, path, ws)
    passed(f"{name} reads every sequence once per epoch in a new order across 2 nodes × 2 ranks, "
           f"trains exactly like one process on the global batch, and only global rank 0 prints "
           f"and saves the checkpoint.")


def _node(rank):
    return f"local rank {rank % PER_NODE} of node {rank // PER_NODE}"


def _judge_reads(reads, ws):
    share = SEQUENCES // ws
    for rank, read in enumerate(reads):
        if len(read) == SEQUENCES * SCRIPT_EPOCHS:
            raise CheckFailed(
                f"rank {rank} read all {SEQUENCES} sequences in every epoch: each rank must read "
                f"only its {share}, through a DistributedSampler.")
        if len(read) != share * SCRIPT_EPOCHS:
            raise CheckFailed(
                f"rank {rank} read {len(read)} sequences in {SCRIPT_EPOCHS} epochs; {SEQUENCES} "
                f"sequences over {ws} ranks is {share} per rank per epoch.")
    epochs = [[read[e * share:(e + 1) * share] for e in range(SCRIPT_EPOCHS)] for read in reads]
    for e in range(SCRIPT_EPOCHS):
        owners = {}
        for rank in range(ws):
            for i in epochs[rank][e]:
                owners.setdefault(i, []).append(rank)
        missing = sorted(set(range(SEQUENCES)) - set(owners))
        never = f", and sequences {missing} were read by no rank" if missing else ""
        for a in range(ws):
            for b in range(a + 1, ws):
                if sorted(epochs[a][e]) == sorted(epochs[b][e]) and a % PER_NODE == b % PER_NODE:
                    raise CheckFailed(
                        f"in epoch {e}, ranks {a} and {b} ({_node(a)} and {_node(b)}) trained on "
                        f"the same sequences {sorted(epochs[a][e])}{never}: the sampler needs the "
                        f"global rank (RANK), not LOCAL_RANK, which repeats on every node.")
        twice = sorted(i for i, r in owners.items() if len(r) > 1)
        if twice:
            i = twice[0]
            raise CheckFailed(
                f"in epoch {e}, sequence {i} was read by ranks {owners[i][0]} and {owners[i][1]}"
                f"{never}: the ranks must split one permutation, each with its own global rank "
                f"and the same seed.")
    _judge_shuffling(epochs, ws, SEQUENCES, SCRIPT_EPOCHS, "", "sequences",
                     "the sampler shuffles by default")


def _judge_script_steps(got, ws):
    counts = {len(g["steps"]) for g in got}
    if counts == {0}:
        raise CheckFailed("no rank took an optimizer step: the script must train.")
    if len(counts) > 1:
        raise CheckFailed(f"the ranks took different numbers of optimizer steps "
                          f"({[len(g['steps']) for g in got]}); each step is one global batch.")
    steps = [[g["steps"][s]["read"] for g in got] for s in range(counts.pop())]
    if sum(len(ids) for step in steps for ids in step) != SEQUENCES * SCRIPT_EPOCHS:
        raise CheckFailed("some sequences were read after the last optimizer step: every batch "
                          "read must be trained on.")
    expected = _token_reference(steps)
    names = [n for n, _ in _token_model().named_parameters()]
    for s, want in enumerate(expected):
        for rank in range(ws):
            step = got[rank]["steps"][s]
            need = _traffic.ring_share("all_reduce", got[rank]["grad_bytes"], ws)
            if step["wire"] < need:
                raise CheckFailed(
                    f"rank {rank} took step {s} after putting {step['wire']:,.0f} bytes on the "
                    f"wire; an all-reduce of its gradients ({got[rank]['grad_bytes']:,} bytes) "
                    f"puts {need:,.0f}: wrap the model in DistributedDataParallel (or all-reduce "
                    f"every gradient) before the optimizer steps.")
            where = f"at step {s}, rank {rank}"
            for n, g, e, local in zip(names, step["grads"], want["grads"], want["local"]):
                if isinstance(g, torch.Tensor) and g.shape == e.shape and not _same(g, e):
                    if _same(g, local):
                        raise CheckFailed(
                            f"{where}: the gradient of {n} is the average of each rank's mean "
                            f"over its own tokens, but the ranks held {want['tokens']} of the "
                            f"{sum(want['tokens'])} tokens, so a token counts more on a rank with "
                            f"fewer: divide each rank's summed token loss by the global token "
                            f"count (all_reduce it) and multiply by the world size DDP divides "
                            f"by.")
                    if _same(g * ws, e):
                        raise CheckFailed(
                            f"{where}: the gradient of {n} is one process's divided by {ws}: DDP "
                            f"averages the ranks' gradients, so multiply the loss (summed tokens "
                            f"/ global token count) by the world size.")
                compare(g, e, f"{where}, the gradient of {n} (one process on the global batch's "
                              f"{sum(want['tokens'])} tokens)", atol=1e-12, rtol=1e-9)
            if step["kind"] != "SGD" or any(abs(lr - SCRIPT_LR) > 1e-12 for lr in step["lr"]):
                raise CheckFailed(f"{where} stepped with {step['kind']} at lr {step['lr'][0]:g}; "
                                  f"the script's optimizer is SGD at lr {SCRIPT_LR}: keep it.")
            for n, p, e in zip(names, step["params"], want["params"]):
                compare(p, e, f"{where}, the parameter {n} after the step", atol=1e-12,
                        rtol=1e-9)
        missing = missing_gradient(delivered([g["steps"][s]["sent"] for g in got]),
                                   want["grads"], names)
        if missing:
            raise CheckFailed(
                f"at step {s} every rank has the right gradients, but what the ranks' calls "
                f"delivered does not hold the gradient of {missing} (times any factor): the "
                f"ranks' own gradients must travel (DDP, or an all-reduce of them) — a decoy "
                f"all-reduce does not count.")


def _same(a, b):
    return torch.allclose(a, b, rtol=1e-9, atol=1e-12)


def _judge_reports(got, path, ws):
    for what, said in (("printed", [bool(g["printed"].strip()) for g in got]),
                       ("wrote the checkpoint", [g["saved"] > 0 for g in got])):
        who = [r for r in range(ws) if said[r]]
        if who == [0]:
            continue
        if not who or 0 not in who:
            how = " to the path it was given" if what == "wrote the checkpoint" else ""
            raise CheckFailed(f"rank 0 never {what}{how}: the script reports from global rank 0.")
        other = who[1]
        if all(r % PER_NODE == 0 for r in who):
            why = f"rank {other} is {_node(other)}, so `local_rank == 0` is true once per node"
        else:
            why = f"rank {other} ran it too"
        raise CheckFailed(
            f"ranks {sizes_phrase(who)} {what}: {why}; only global rank 0 (RANK) should.")
    if not os.path.exists(path):
        raise CheckFailed(f"rank 0 wrote no checkpoint at the path it was given ({path}).")
    state = torch.load(path, map_location="cpu")
    values = list(state.values()) if isinstance(state, dict) else None
    final = got[0]["final"]
    if values is None or len(values) != len(final) or not all(
            isinstance(v, torch.Tensor) and v.shape == f.shape and _same(v.double(), f)
            for v, f in zip(values, final)):
        raise CheckFailed("the checkpoint does not hold the trained weights: save the model's "
                          "state_dict() (ddp.module.state_dict()) after the last epoch.")


refuse_too(_token_reference, _token_data, _token_model)
