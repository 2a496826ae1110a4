"""Checkers for workbook 11: each exercise fixes one class of distributed bug.

Every checker runs the learner's fix on real ranks at several world sizes (odd ones too) and
proves it gives what one process gives; a hang is caught by a short timeout and reported as one
sentence naming where the ranks were.
"""
import torch
import torch.distributed as dist

from .. import debug
from .. import trace as _trace
from ..launch import RankFailed, RunTimeout
from . import CheckFailed, compare, forbid, passed, run_learner, sizes_phrase
from .ch01 import learner_run

WORLD_SIZES = (2, 3)       # even and odd: what a fix must survive; 4 catches nothing 3 misses
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


# ---- exercise 6: the wrong pipeline peer -----------------------------------------------------
#
# Ranks sit on a (pp, dp) mesh, dp varying fastest: rank = stage * dp + replica. The next stage of
# the same replica is dp ranks away, not one.

PIPE_SHAPES = ((2, 2), (3, 2))                # (pp, dp): two stages, and a middle stage too


def _stage_fn(stage):
    """Stage `stage` of the toy pipeline: x -> (stage + 2) * x + 1, easy to follow by hand."""
    return lambda x: (stage + 2) * x + 1


def _pipe_input(replica):
    return torch.arange(1.0, 5.0) * (replica + 1)      # replica d starts from (d+1)·[1, 2, 3, 4]


def _pipe_expected(replica, pp):
    x = _pipe_input(replica)
    for stage in range(pp):
        x = _stage_fn(stage)(x)
    return x


def _reference_pipeline_forward(x, stage_fn, rank, pp, dp):
    stage = rank // dp
    if stage > 0:
        dist.recv(x, src=rank - dp)
    y = stage_fn(x)
    if stage < pp - 1:
        dist.send(y, dst=rank + dp)
    return y


def _pipeline_on_ranks(rank, world_size, pp, dp, fn):
    stage, replica = divmod(rank, dp)
    x = _pipe_input(replica) if stage == 0 else torch.zeros(4)
    with forbid(_reference_pipeline_forward, exercise="send to the right peers yourself"):
        y = fn(x, _stage_fn(stage), rank, pp, dp)
    return y if stage == pp - 1 else None


def check_pipeline_forward(fn):
    """fn(x, stage_fn, rank, pp, dp) -> the last stage's output (ranks on a (pp, dp) mesh)."""
    name = getattr(fn, "__name__", "pipeline_forward")
    for pp, dp in PIPE_SHAPES:
        where = f"with pp={pp} stages x dp={dp} replicas"
        got = learner_run(_pipeline_on_ranks, pp * dp, pp, dp, fn, name=name,
                          hang_rule="stage s of replica d is rank s*dp + d, so the next stage "
                          "of the same replica is dp ranks away, not one.")
        trace = got.trace
        for rank in range(pp * dp):
            stage, replica = divmod(rank, dp)
            for e in trace.comm(rank):
                if e["op"] not in ("send", "recv"):
                    continue
                right = rank + dp if e["op"] == "send" else rank - dp
                allowed = stage < pp - 1 if e["op"] == "send" else stage > 0
                if e["peer"] != right or not allowed:
                    sending = e["op"] == "send"
                    to, did = ("to", "sent") if sending else ("from", "received")
                    rule = (f"stage {stage} of replica {replica} only {e['op']}s {to} rank {right}"
                            if allowed else
                            f"stage {stage} is the {'last' if sending else 'first'} and "
                            f"{e['op']}s nothing")
                    raise CheckFailed(f"{name} {where}: rank {rank} {did} {e['bytes']} bytes {to} "
                                      f"rank {e['peer']}; {rule} (rank = stage*dp + replica).")
        for replica in range(dp):
            rank = (pp - 1) * dp + replica
            compare(got[rank], _pipe_expected(replica, pp),
                    f"{name} {where}: the last stage's output of replica {replica} (rank {rank})")
    passed(f"{name} passes each replica's activations to the next stage of the same replica, on "
           f"{' and '.join(f'{pp} stages x {dp} replicas' for pp, dp in PIPE_SHAPES)}.")


# ---- exercise 7: sequence parallel's LayerNorm gradients ---------------------------------------

SP_CASES = ((2, 2), (3, 1))                 # (tp, dp): a tp group inside a larger world; odd tp
SP_DIMS = dict(d_model=24, n_heads=6, hidden=96, seq=12, batch=2)


def _reference_sp_sync(block, group):
    for ln in (block.ln1, block.ln2):
        for p in ln.parameters():
            dist.all_reduce(p.grad, group=group)


def _sp_block_without_ln_sync():
    from ..tensor_parallel import ParallelBlock

    class SPBlockMissingLNSync(ParallelBlock):
        # The bug: LayerNorm applied to this rank's slice of the sequence, its gradient left as is.
        def _norm(self, ln, x):
            return ln(x)
    return SPBlockMissingLNSync


def _sp_groups(rank, tp, dp):
    groups = [dist.new_group(list(range(d * tp, (d + 1) * tp))) for d in range(dp)]
    return groups[rank // tp]


def _sp_on_ranks(rank, world_size, tp, dp, fn):
    from ..models import Block
    from ..tensor_parallel import dense_shards, sequence_slice
    dims = SP_DIMS
    dense = _seeded_block(Block, dims)
    g = torch.Generator().manual_seed(5)
    x = torch.randn(dims["batch"], dims["seq"], dims["d_model"], generator=g, dtype=torch.float64)
    w = torch.randn(x.shape, generator=g, dtype=torch.float64)
    (dense(x) * w).sum().backward()
    group = _sp_groups(rank, tp, dp)
    block = _sp_block_without_ln_sync().from_dense(dense, group, sequence_parallel=True)
    out = block(sequence_slice(x, group))
    (out * sequence_slice(w, group)).sum().backward()
    with _trace.span("fix"), forbid(_reference_sp_sync, exercise="all-reduce the right "
                                    "gradients yourself"):
        fn(block, group)
    expected = dense_shards(block, dense, grads=True)
    return {name: (p.grad.detach().clone(), expected[name]) for name, p in block.named_parameters()}


def _seeded_block(Block, dims):
    torch.manual_seed(0)
    return Block(dims["d_model"], dims["n_heads"], dims["hidden"]).double()


def check_sequence_parallel_grads(fn):
    """fn(block, tp_group) after backward: every gradient of the sequence-parallel block right."""
    name = getattr(fn, "__name__", "sync_sequence_parallel_grads")
    for tp, dp in SP_CASES:
        where = f"with tp={tp}" + (f" (inside {tp * dp} ranks: dp={dp})" if dp > 1 else "")
        got = learner_run(_sp_on_ranks, tp * dp, tp, dp, fn, name=name,
                          hang_rule="every rank of the tp group must all-reduce the same "
                          "gradients in the same order.")
        for rank in range(tp * dp):
            tp_group = tuple(range(rank // tp * tp, (rank // tp + 1) * tp))
            for e in got.trace.comm(rank):
                if "fix" in (e["label"] or ()) and e["group"] != tp_group:
                    raise CheckFailed(
                        f"{name} {where}: rank {rank}'s {e['op']} ran over ranks "
                        f"{list(e['group'])}; a LayerNorm's gradient is split over the sequence "
                        f"shards of ONE tp group, ranks {list(tp_group)}: sum it there only.")
            for pname, (mine, expected) in got[rank].items():
                if not torch.allclose(mine, expected, atol=1e-10, rtol=1e-9):
                    _explain_sp(name, where, rank, pname, mine, expected, tp)
    passed(f"{name} sums the LayerNorms' gradients over the tp group and leaves the shards alone: "
           f"every gradient equals the dense block's, {' and '.join(f'tp={t}' for t, _ in SP_CASES)}.")


def _explain_sp(name, where, rank, pname, mine, expected, tp):
    head = f"{name} {where}: rank {rank}'s {pname} gradient"
    if pname.endswith(("proj.bias", "fc2.bias")):
        raise CheckFailed(
            f"{head} is wrong: the row-parallel biases already sum their gradient over the tp "
            f"group inside backward (sequence parallel's `replicated`); summing again counts it "
            f"twice. Sum only the LayerNorm gradients.")
    if not pname.startswith(("ln1.", "ln2.")):
        raise CheckFailed(
            f"{head} is wrong: it belongs to a tensor-parallel shard, and each rank's is the "
            f"gradient of a different slice of the matrix, already complete; all-reducing (or "
            f"averaging) shard gradients mixes slices. Sum only the LayerNorm gradients.")
    if torch.allclose(mine * tp, expected, atol=1e-10, rtol=1e-9):
        raise CheckFailed(f"{head} is 1/{tp} of the dense one: the ranks' parts must be summed, "
                          f"not averaged (each saw a different 1/{tp} of the tokens).")
    scale = (mine.norm() / expected.norm()).item()
    if scale > 1:
        raise CheckFailed(f"{head} is {scale:.2g} times the dense one's norm: it was added up "
                          f"more than once; sum it once, over the tp group.")
    raise CheckFailed(f"{head} is {scale:.2g} times the dense one's norm: each rank's LayerNorm saw "
                      f"only its 1/{tp} of the sequence, so its gradient is a partial sum; "
                      f"all-reduce (sum) it over the tp group.")
