"""Silent bugs beyond data parallelism: one each in tensor, pipeline and expert parallelism, and
the detectors that catch them (chapter 11, section 2b).

Each bug is one wrong reduction or one wrong neighbour in code that otherwise works: the ranks
never hang, the loss stays in range, and only one process (float64) or a detector tells. The
detectors are general, and like those of `distlab.debug` they return the same answer on every
rank of the group they gather over, so they can run inside a training loop:

    disagree(named, group)      tensors that MUST be equal on every rank of `group` and are not
                                (a LayerNorm replicated over tp, a router replicated everywhere)
    coincide(named, group)      tensors that MUST differ across `group` and are equal
                                (the gradients of different experts across an EP group)
    stray_messages(trace, at)   a pipeline's point-to-point messages that leave their replica or
                                do not go to the next or previous stage (read from a run's trace)

The three trainings take the broken piece as an argument, so that the same loop runs with and
without the bug:

    train_sequence_parallel     a transformer block, tensor + sequence parallel over every rank;
                                the bug: its LayerNorms' gradients are not summed over the tp group
    train_pipeline_dp           a pipeline on a (dp, pp) mesh, stages varying fastest; the bug: its
                                groups are built for the other mesh order, (pp, dp)
    train_expert_dp             chapter 09's MoE model on a (dp, ep) mesh; the bug: the two groups
                                of `expert_parallel.reduce_gradients` swapped
"""
import torch
import torch.distributed as dist
import torch.nn.functional as F

from . import expert_parallel as ep_lib
from .debug import tensor_checksums
from .models import Block, regression_data
from .moe import make_moe_model, shard_loss, train_moe_reference
from .pipeline_parallel import PipelineStage
from .pipeline_schedules import gpipe
from .tensor_parallel import (ColumnParallelLinear, ParallelBlock, RowParallelLinear,
                              dense_shards, sequence_slice)


# ---- detectors ------------------------------------------------------------------------------------

def _everyone(tensors, group):
    """Every rank's checksums of `tensors` (two float64 numbers each), rank by rank."""
    mine = tensor_checksums(tensors)
    everyone = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(everyone, mine, group=group)
    return everyone


def disagree(named, group=None):
    """Names of the tensors in `named` ([(name, tensor)], the same names on every rank) that are
    not identical on every rank of `group`: for tensors that must agree there (replicas)."""
    everyone = _everyone([t for _, t in named], group)
    return [name for i, (name, _) in enumerate(named)
            if any(not torch.equal(other[i], everyone[0][i]) for other in everyone[1:])]


def coincide(named, group=None):
    """Names of the tensors in `named` that are identical on two or more ranks of `group`: for
    tensors that must differ there (different shards, different experts). All-zero tensors are
    left out (an expert that received no token has a zero gradient on every rank)."""
    everyone = _everyone([t for _, t in named], group)
    found = []
    for i, (name, _) in enumerate(named):
        rows = [tuple(other[i].tolist()) for other in everyone if other[i].any()]
        if len(set(rows)) < len(rows):
            found.append(name)
    return found


def stray_messages(trace, coordinate):
    """The point-to-point messages of a traced run that a pipeline must not send.

    `coordinate(rank)` -> (replica, stage) on the job's mesh. A message is stray when its two
    ranks belong to different replicas, or when it does not go to the next or previous stage.
    Returns [{"rank", "op", "peer", "why"}], each message seen from both of its ranks.
    """
    stray = []
    for rank in range(trace.world_size):
        replica, stage = coordinate(rank)
        for e in trace.comm(rank):
            if e["op"] not in ("send", "recv"):
                continue
            peer_replica, peer_stage = coordinate(e["peer"])
            why = [w for w, bad in (("leaves its replica", peer_replica != replica),
                                    ("not a neighbouring stage", abs(peer_stage - stage) != 1))
                   if bad]
            if why:
                stray.append({"rank": rank, "op": e["op"], "peer": e["peer"], "why": why})
    return stray


def p2p_count(trace):
    """How many send and recv calls the traced run made, all ranks together."""
    return sum(e["op"] in ("send", "recv") for r in range(trace.world_size)
               for e in trace.comm(r))


# ---- tensor parallelism: sequence parallel's LayerNorm gradients --------------------------------

SP_DIMS = dict(d_model=24, n_heads=6, hidden=96, seq=12, batch=2)   # also workbook 11's checker's


def sp_block_without_ln_sum():
    """ParallelBlock with the bug workbook 11's exercise 6 states (its checker builds it here)."""
    class SPBlockMissingLNSync(ParallelBlock):
        # The bug: LayerNorm applied to this rank's slice of the sequence, its gradient left as is.
        def _norm(self, ln, x):
            return ln(x)
    return SPBlockMissingLNSync


def sp_data(seed):
    """(x, y): a batch of SP_DIMS' shape and random targets, float64, from generator 5 + seed."""
    g = torch.Generator().manual_seed(5 + seed)
    x = torch.randn(SP_DIMS["batch"], SP_DIMS["seq"], SP_DIMS["d_model"], generator=g,
                    dtype=torch.float64)
    return x, torch.randn(x.shape, generator=g, dtype=torch.float64)


def replicated_over_tp(block):
    """[(name, parameter)] of a ParallelBlock that every tp rank holds whole: the LayerNorms and
    the row-parallel biases. The other parameters are shards and differ by design."""
    out = []
    for name, p in block.named_parameters():
        owner = block.get_submodule(name.rpartition(".")[0])
        sharded = isinstance(owner, ColumnParallelLinear) or (
            isinstance(owner, RowParallelLinear) and name.endswith("weight"))
        if not sharded:
            out.append((name, p))
    return out


def _sp_dense():
    torch.manual_seed(0)
    return Block(SP_DIMS["d_model"], SP_DIMS["n_heads"], SP_DIMS["hidden"]).double()


def _sgd(model, batches, lr):
    """One process: plain SGD on the mean-squared error, one step per (x, y); the losses."""
    losses = []
    for x, y in batches:
        model.zero_grad()
        loss = F.mse_loss(model(x), y)
        loss.backward()
        with torch.no_grad():
            for p in model.parameters():
                p.add_(p.grad, alpha=-lr)
        losses.append(loss.item())
    return losses


def sequence_parallel_reference(steps=3, lr=0.5):
    """One process: the dense block trained with SGD on the batches of `sp_data(step)`."""
    dense = _sp_dense()
    return dense, _sgd(dense, [sp_data(step) for step in range(steps)], lr)


def train_sequence_parallel(rank, world_size, block_class=ParallelBlock, steps=3, lr=0.5):
    """The block tensor + sequence parallel over every rank (tp = world_size), trained with SGD.

    Each rank holds 1/tp of the sequence; its loss is its slice's mean squared error over tp, so
    the ranks' losses add up to the global one. Returns {"losses" (global), "out_of_sync" (per
    step, how many replicated parameters differ across tp), "diff" (the largest difference of this
    rank's parameters from the one-process run's, its shard of them)}.
    """
    group = dist.group.WORLD
    block = block_class.from_dense(_sp_dense(), group, sequence_parallel=True)
    losses, out_of_sync = [], []
    for step in range(steps):
        x, y = (sequence_slice(t, group) for t in sp_data(step))
        out_of_sync.append(len(disagree(replicated_over_tp(block), group)))
        block.zero_grad()
        loss = F.mse_loss(block(x), y) / world_size
        loss.backward()
        with torch.no_grad():
            for p in block.parameters():
                p.add_(p.grad, alpha=-lr)
        total = loss.detach().clone()
        dist.all_reduce(total, group=group)
        losses.append(total.item())
    dense, _ = sequence_parallel_reference(steps, lr)
    want = dense_shards(block, dense)
    diff = max((p.detach() - want[n]).abs().max().item() for n, p in block.named_parameters())
    return {"losses": losses, "out_of_sync": out_of_sync, "diff": diff}


# ---- pipeline parallelism: neighbours from the wrong mesh order ---------------------------------

PIPE_ROWS, PIPE_WIDTH, PIPE_MICRO = 4, 4, 2     # rows per replica and step; 2 micro-batches


def pipe_stage(stage):
    """Stage `stage`: the same Linear(4, 4) and tanh on every replica (seeded by the stage),
    float64; also workbook 11's pipeline exercise's."""
    with torch.random.fork_rng():               # the caller's random stream stays its own
        torch.manual_seed(10 + stage)
        return torch.nn.Sequential(torch.nn.Linear(PIPE_WIDTH, PIPE_WIDTH),
                                   torch.nn.Tanh()).double()


def mesh_groups(dp, pp, order="dp, pp"):
    """(pipeline group, its ranks, data-parallel group, its ranks) of this rank on a mesh of dp
    replicas × pp stages. order "dp, pp": stages vary fastest, stage s of replica d is rank
    d·pp + s; "pp, dp": replicas vary fastest, rank s·dp + d. Collective: every rank calls
    new_group for every group, in the same order."""
    at = {"dp, pp": lambda d, s: d * pp + s, "pp, dp": lambda d, s: s * dp + d}[order]
    mine = [None] * 4
    for d in range(dp):
        ranks = [at(d, s) for s in range(pp)]
        group = dist.new_group(ranks)
        if dist.get_rank() in ranks:
            mine[0:2] = group, ranks
    for s in range(pp):
        ranks = [at(d, s) for d in range(dp)]
        group = dist.new_group(ranks)
        if dist.get_rank() in ranks:
            mine[2:4] = group, ranks
    dist.barrier()              # every rank connected before any leaves (distlab.mesh)
    return tuple(mine)


def pipeline_batch(step, replica):
    """Replica `replica`'s (x, y) at `step`: PIPE_ROWS random rows and their random targets."""
    g = torch.Generator().manual_seed(1000 * step + replica)
    x = torch.randn(PIPE_ROWS, PIPE_WIDTH, generator=g, dtype=torch.float64)
    return x, torch.randn(x.shape, generator=g, dtype=torch.float64)


def pipeline_reference(dp, pp, steps=3, lr=0.2):
    """One process: the pp stages in a row, trained on every replica's rows of each step."""
    model = torch.nn.Sequential(*[pipe_stage(s) for s in range(pp)])
    batches = [[torch.cat(t) for t in zip(*[pipeline_batch(step, d) for d in range(dp)])]
               for step in range(steps)]
    losses = _sgd(model, batches, lr)
    return [[p.detach().clone() for p in stage.parameters()] for stage in model], losses


def train_pipeline_dp(rank, world_size, dp, pp, order="dp, pp", steps=3, lr=0.2):
    """GPipe over each replica's pipeline group, gradients averaged over the data-parallel group,
    SGD. The job's mesh is (dp, pp): the data loader gives rank r the rows of replica r // pp.
    The groups come from `mesh_groups(dp, pp, order)`, a stage is its rank's place in its
    pipeline group. Returns {"losses" (global), "stage", "pipeline" (its group's ranks), "diff"
    (the largest difference of this stage's parameters from one process's)}."""
    pipe, pipe_ranks, data, data_ranks = mesh_groups(dp, pp, order)
    stage = pipe_ranks.index(rank)
    module = PipelineStage([pipe_stage(s) for s in range(pp)], stage, pp, (PIPE_WIDTH,),
                           torch.float64, group=pipe)
    actions = gpipe(pp, PIPE_MICRO)[stage]
    losses = []
    for step in range(steps):
        x, y = pipeline_batch(step, rank // pp)
        for p in module.parameters():
            p.grad = None
        loss = module.step(actions, x, y, PIPE_MICRO, F.mse_loss)
        with torch.no_grad():
            for p in module.parameters():
                dist.all_reduce(p.grad, group=data)
                p.add_(p.grad, alpha=-lr / dp)
        total = torch.zeros((), dtype=torch.float64) if loss is None else loss.detach()
        dist.all_reduce(total)
        losses.append(total.item() / dp)
    want, _ = pipeline_reference(dp, pp, steps, lr)
    diff = max((p.detach() - w).abs().max().item()
               for p, w in zip(module.parameters(), want[stage]))
    return {"losses": losses, "stage": stage, "pipeline": pipe_ranks, "diff": diff}


# ---- expert parallelism: the two groups of reduce_gradients swapped ------------------------------

EP_CONFIG = dict(d_model=8, hidden=16, n_experts=4, top_k=2, capacity_factor=1.0)  # chapter 09's
EP_TOKENS, EP_AUX, EP_LR = 8, 0.1, 0.2


def reduce_gradients_swapped(model, dp_group, world_group=None):
    """`expert_parallel.reduce_gradients` with its two groups swapped: the experts' gradients
    all-reduced over every rank, everything else's over the dp group only."""
    world = dist.get_world_size(world_group)
    experts = {id(p) for p in model.moe.expert_parameters()}
    for p in model.parameters():
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        dist.all_reduce(p.grad, group=world_group if id(p) in experts else dp_group)
        p.grad.div_(world)


def expert_shards(world_size, steps=4):
    """[[(x, y) of each rank] per step]: EP_TOKENS rows per rank (chapter 09's data)."""
    x, y = (t.double() for t in regression_data(n=steps * world_size * EP_TOKENS, seed=7))
    cut = lambda t, s, r: t[(s * world_size + r) * EP_TOKENS:(s * world_size + r + 1) * EP_TOKENS]
    return [[(cut(x, s, r), cut(y, s, r)) for r in range(world_size)] for s in range(steps)]


def expert_reference(world_size, steps=4, n_experts=4):
    """One process: the model trained on every rank's shard of each step; (model, losses)."""
    model = make_moe_model(seed=3, dtype=torch.float64, **dict(EP_CONFIG, n_experts=n_experts))
    history = train_moe_reference(model, expert_shards(world_size, steps), EP_AUX, EP_LR)
    return model, [loss for loss, _ in history]


def train_expert_dp(rank, world_size, dp, ep, reduce=ep_lib.reduce_gradients, steps=4,
                    n_experts=4):
    """Chapter 09's MoE model on a (dp, ep) mesh, `reduce(model, dp_group)` after backward, SGD.

    Each step, after `reduce`, three checks: the replicated parameters agree over every rank
    ("replicated out of sync"), each expert's copies agree over its dp group ("experts out of
    sync"), and the gradients of different experts differ across the EP group ("experts equal").
    Returns {"losses" (global), those three counts per step, "diff" (the largest difference of
    this rank's parameters from one process's)}."""
    mesh = ep_lib.ep_dp_mesh(dp, ep)
    config = dict(EP_CONFIG, n_experts=n_experts)
    model = ep_lib.expert_parallel_model(make_moe_model(seed=3, dtype=torch.float64, **config),
                                         mesh)
    expert_ids = {id(p) for p in model.moe.expert_parameters()}
    experts = [(n, p) for n, p in model.named_parameters() if id(p) in expert_ids]
    replicated = [(n, p) for n, p in model.named_parameters() if id(p) not in expert_ids]
    seen = {"replicated out of sync": [], "experts out of sync": [], "experts equal": []}
    losses = []
    for shards in expert_shards(world_size, steps):
        model.zero_grad()
        loss = shard_loss(model, *shards[rank], aux_coef=EP_AUX)
        loss.backward()
        reduce(model, mesh.get_group("dp"))
        seen["experts equal"].append(len(coincide([(n, p.grad) for n, p in experts],
                                                  mesh.get_group("ep"))))
        with torch.no_grad():
            for p in model.parameters():
                p.add_(p.grad, alpha=-EP_LR)
        seen["replicated out of sync"].append(len(disagree(replicated)))
        seen["experts out of sync"].append(len(disagree(experts, mesh.get_group("dp"))))
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses.append(total.item() / world_size)
    want = dict(expert_reference(world_size, steps, n_experts)[0].named_parameters())
    first = model.moe.first
    diff = max((p.detach() - want[ep_lib.global_name(n, first)].detach()).abs().max().item()
               for n, p in model.named_parameters())
    return {"losses": losses, **seen, "diff": diff}
