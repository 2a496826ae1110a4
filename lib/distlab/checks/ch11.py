"""Checkers for workbook 11: each exercise fixes one class of distributed bug.

Every checker runs the learner's fix on real ranks at several world sizes (odd ones too) and
proves it gives what one process gives; a hang is caught by a short timeout and reported as one
sentence naming where the ranks were.
"""
import torch

from .. import debug
from ..launch import RankFailed, RunTimeout
from . import CheckFailed, compare, passed, run_learner, sizes_phrase

WORLD_SIZES = (2, 3, 4)
TIMEOUT = 60


def _run(fn, world_size, name, *args, **kwargs):
    try:
        return run_learner(fn, world_size, *args, name=name, timeout=TIMEOUT, **kwargs)
    except RunTimeout as e:
        where = "; ".join(line.strip() for line in str(e).splitlines()[1:1 + world_size])
        raise CheckFailed(f"{name} hung with world_size={world_size} ({where}): every rank must "
                          f"call the same collectives.") from None
    except RankFailed as e:
        if not e.peer_lost:
            raise
        # A rank that skipped the collective finished and closed its connections under the
        # ranks still waiting in it: a hang that ended early.
        raise CheckFailed(f"{name} with world_size={world_size}: rank {e.rank} waited in a "
                          f"collective that another rank never called (that rank finished and "
                          f"left): every rank must call the same collectives.") from None


def _compare_training(got, expected, name, world_size):
    for rank, result in enumerate(got):
        compare(result["losses"], expected["losses"],
                f"{name} with world_size={world_size}: rank {rank}'s loss per step", 1e-10, 1e-9)
        compare(result["params"], expected["params"],
                f"{name} with world_size={world_size}: rank {rank}'s parameters after training "
                f"(parameter tensors in model order)", 1e-10, 1e-9)


# ---- exercise 1: a hang -----------------------------------------------------------------------------

def _mean_loss_on_ranks(rank, world_size, fn):
    loss = torch.tensor(float((rank + 1) ** 2), dtype=torch.float64)
    got = fn(loss.clone(), rank, world_size)
    return got.item() if isinstance(got, torch.Tensor) else got


def check_mean_loss(fn):
    """fn(loss, rank, world_size) -> the mean of every rank's loss, returned on every rank."""
    for ws in WORLD_SIZES:
        got = _run(_mean_loss_on_ranks, ws, "mean_loss", fn)
        expected = sum((r + 1) ** 2 for r in range(ws)) / ws
        for rank in range(ws):
            compare(got[rank], expected, f"mean_loss with world_size={ws}, rank {rank}",
                    1e-12, 1e-12)
    passed(f"mean_loss returns the mean loss on every rank, on {sizes_phrase(WORLD_SIZES)} ranks, "
           f"without a hang.")


# ---- exercise 2: duplicated data --------------------------------------------------------------------

def _shard_and_train(rank, world_size, fn):
    _, batches = debug.problem()
    x, y = batches[0]
    xs, _ = fn(x, y, rank, world_size)
    return {"x": xs, "training": debug.train_data_parallel(rank, world_size, shard=fn)}


def check_my_shard(fn):
    """fn(x, y, rank, world_size) -> (x, y) of this rank: equal, disjoint parts of the batch."""
    _, batches = debug.problem()
    x, _ = batches[0]
    everyone = set(debug.sample_fingerprints(x))
    for ws in WORLD_SIZES:
        got = _run(_shard_and_train, ws, "my_shard", fn)
        seen = {}
        for rank, part in enumerate(got):
            xs = part["x"]
            if not isinstance(xs, torch.Tensor) or len(xs) != len(x) // ws:
                size = len(xs) if isinstance(xs, torch.Tensor) else repr(xs)
                raise CheckFailed(f"my_shard with world_size={ws}: rank {rank} should get "
                                  f"{len(x) // ws} of the {len(x)} samples, got {size}.")
            for f in debug.sample_fingerprints(xs):
                if f not in everyone:
                    raise CheckFailed(f"my_shard with world_size={ws}: rank {rank} got a sample "
                                      f"that is not in the global batch.")
                if f in seen and seen[f] != rank:
                    raise CheckFailed(f"my_shard with world_size={ws}: ranks {seen[f]} and {rank} "
                                      f"both got the same sample; each sample belongs to one rank.")
                seen[f] = rank
        _compare_training([part["training"] for part in got], debug.reference(),
                          "training with my_shard", ws)
    passed(f"my_shard splits every batch into disjoint parts, and training equals one process on "
           f"{sizes_phrase(WORLD_SIZES)} ranks.")


# ---- exercise 3: summed gradients ------------------------------------------------------------------

def _first_update(rank, world_size, fn):
    model, _ = debug.problem()
    before = [p.detach().clone() for p in model.parameters()]
    after = debug.train_data_parallel(rank, world_size, average=fn, steps=1)["params"]
    return [b - a for a, b in zip(after, before)]


def check_average_gradients(fn):
    """fn(model) -> None: after it, every rank's .grad is the mean of the ranks' gradients."""
    for ws in WORLD_SIZES:
        got = _run(debug.train_data_parallel, ws, "average_gradients", average=fn)
        expected = debug.reference()
        try:
            _compare_training(got, expected, "training with average_gradients", ws)
        except CheckFailed as e:
            # An SGD update is -lr * gradient: the ratio of updates is the ratio of gradients.
            ours = _run(_first_update, ws, "average_gradients", fn)[0]
            model, _ = debug.problem()
            before = [p.detach().clone() for p in model.parameters()]
            ref = [b - a for a, b in zip(debug.reference(steps=1)["params"], before)]
            scale = debug.gradient_scale(ours, ref)
            raise CheckFailed(f"{e} On the first step the "
                              f"{debug.explain_gradient_scale(scale, ws)}") from None
    passed(f"average_gradients makes data-parallel training equal one process on "
           f"{sizes_phrase(WORLD_SIZES)} ranks.")


# ---- exercise 4: replicas that never were equal ----------------------------------------------------

def _build_rank_seeded(rank):
    from ..models import make_mlp
    # The bug on purpose: each rank initialises its replica from its own seed.
    return make_mlp((16, 32, 4), seed=rank).double()


def check_sync_replicas(fn):
    """fn(model) -> None: afterwards every rank holds rank 0's parameters."""
    for ws in WORLD_SIZES:
        got = _run(debug.train_data_parallel, ws, "sync_replicas", build=_build_rank_seeded,
                   sync=fn, watch=True)
        for rank, result in enumerate(got):
            if any(result["out_of_sync"]):
                raise CheckFailed(f"sync_replicas with world_size={ws}: after it, "
                                  f"{result['out_of_sync'][0]} parameter tensors still differ "
                                  f"between ranks (rank {rank} sees it too).")
        _compare_training(got, debug.reference(), "training after sync_replicas", ws)
    passed(f"sync_replicas gives every rank rank 0's weights; training equals one process on "
           f"{sizes_phrase(WORLD_SIZES)} ranks.")


# ---- exercise 5: a drift detector ------------------------------------------------------------------

CASES = ("all equal", "one element of the last rank off by 1e-12", "two elements swapped on rank 1")


def _detector_cases(rank, world_size, fn):
    answers = []
    for case in CASES:
        model, _ = debug.problem()
        with torch.no_grad():
            w = model.net[0].weight
            if case == CASES[1] and rank == world_size - 1:
                w[3, 5] += 1e-12
            if case == CASES[2] and rank == 1:
                w[0, 0], w[0, 1] = w[0, 1].clone(), w[0, 0].clone()
        answer = fn(model)
        if isinstance(answer, torch.Tensor) and answer.numel() == 1:
            answer = bool(answer.item())
        answers.append(answer)
    return answers


def check_replicas_differ(fn):
    """fn(model) -> True on every rank when any parameter differs anywhere, else False."""
    for ws in WORLD_SIZES:
        got = _run(_detector_cases, ws, "replicas_differ", fn)
        for i, case in enumerate(CASES):
            expected = case != CASES[0]
            for rank in range(ws):
                if got[rank][i] is not expected:
                    raise CheckFailed(f"replicas_differ with world_size={ws}, case '{case}': "
                                      f"rank {rank} returned {got[rank][i]!r}, expected {expected}.")
    passed(f"replicas_differ finds a 1e-12 difference and a swap, and agrees on every rank, on "
           f"{sizes_phrase(WORLD_SIZES)} ranks.")
