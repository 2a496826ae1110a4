"""Workbook 11, exercise 6: sequence parallel's LayerNorm gradients, on a dp x tp mesh."""
import torch
import torch.distributed as dist

from ... import trace as _trace
from ...debug_parallel import SP_DIMS, sp_data as _sp_data
from ...debug_parallel import sp_block_without_ln_sum as _sp_block_without_ln_sync
from .. import CheckFailed, _traffic, passed
from ._common import _close, _refused, _traced


SP_CASES = ((2, 2), (3, 1))                 # (tp, dp): replicas of a tp group; an odd tp
def _sp_groups(rank, tp, dp):
    """Ranks on a (dp, tp) mesh, tp fastest: rank = replica * tp + t."""
    tps = [dist.new_group(list(range(d * tp, (d + 1) * tp))) for d in range(dp)]
    dps = [dist.new_group(list(range(t, tp * dp, tp))) for t in range(tp)]
    return tps[rank // tp], dps[rank % tp]


def _sp_on_ranks(rank, world_size, tp, dp, fn):
    from ...models import Block
    from ...tensor_parallel import dense_shards, sequence_slice
    dense = _seeded_block(Block)
    mean, own = {}, {}
    for replica in range(dp):       # the dense gradient of the mean loss over the replicas
        dense.zero_grad(set_to_none=True)
        x, w = _sp_data(replica)
        (dense(x) * w).sum().backward()
        for n, p in dense.named_parameters():
            mean[n] = mean.get(n, 0) + p.grad / dp
            if replica == rank // tp:
                own[n] = p.grad.clone()
    tp_group, dp_group = _sp_groups(rank, tp, dp)
    block = _sp_block_without_ln_sync().from_dense(dense, tp_group, sequence_parallel=True)
    x, w = _sp_data(rank // tp)
    out = block(sequence_slice(x, tp_group))
    (out * sequence_slice(w, tp_group)).sum().backward()
    with _trace.span("fix"), _refused("sum and average the right gradients yourself",
                                         _seeded_block, _sp_data), _traffic.Carried() as carried:
        fn(block, tp_group, dp_group)
    shards = {}
    for grads in (mean, own):       # what this rank's shard should hold; and its replica's alone
        for n, p in dense.named_parameters():
            p.grad = grads[n]
        shards[id(grads)] = dense_shards(block, dense, grads=True)
    expected, alone = shards[id(mean)], shards[id(own)]
    return {"grads": {n: (p.grad.detach().clone(), expected[n].clone(), alone[n].clone())
                      for n, p in block.named_parameters()},
            "sent": [c for c in carried.records if c["kind"] != "recv"]}


def _seeded_block(Block):
    torch.manual_seed(0)
    return Block(SP_DIMS["d_model"], SP_DIMS["n_heads"], SP_DIMS["hidden"]).double()


def check_sequence_parallel_grads(fn):
    """fn(block, tp_group, dp_group) after backward: every gradient of the sequence-parallel block
    equals the dense block's gradient of the mean loss over the dp replicas (its shard). Judged
    by the checkers' one traffic rule too: every call on the tp or the dp group (a message with
    their members), and what they delivered: over tp the LayerNorms' replica gradients, over dp
    every gradient's mean — an all-reduce and a hand-written exchange alike."""
    name = getattr(fn, "__name__", "sync_grads")
    for tp, dp in SP_CASES:
        where = f"with tp={tp} x dp={dp}"
        got = _traced(_sp_on_ranks, tp * dp, name, tp, dp, fn,
                      rule="every rank of a group must all-reduce the same gradients in the "
                      "same order.")
        for rank in range(tp * dp):
            tp_group = tuple(range(rank // tp * tp, (rank // tp + 1) * tp))
            dp_group = tuple(range(rank % tp, tp * dp, tp))
            for e in _traffic.data_calls(_traffic.records(got.trace, rank, "fix")):
                if _traffic.off_group([e], tp_group)[0] and _traffic.off_group([e], dp_group)[0]:
                    what = (f"{e['op']} ran over ranks {list(e['group'])}" if e["kind"] ==
                            "collective" else f"{e['op']} went to rank {e['peer']}")
                    raise CheckFailed(
                        f"{name} {where}: rank {rank}'s {what}; a LayerNorm's partial gradients "
                        f"live in ONE tp group (ranks {list(tp_group)}), and replicas of a shard "
                        f"in one dp group (ranks {list(dp_group)}).")
            for pname, (mine, expected, alone) in got[rank]["grads"].items():
                if not torch.allclose(mine, expected, atol=1e-10, rtol=1e-9):
                    _explain_sp(name, where, rank, pname, mine, expected, alone, tp, dp)
        for rank in range(tp * dp):
            _judge_carried(name, where, got, rank, tp, dp)
    passed(f"{name} sums the LayerNorms' gradients over tp, averages every gradient over dp and "
           f"leaves the tp shards whole: every gradient equals the dense block's, "
           f"{' and '.join(f'tp={t} x dp={d}' for t, d in SP_CASES)}.")


def _explain_sp(name, where, rank, pname, mine, expected, alone, tp, dp):
    head = f"{name} {where}: rank {rank}'s {pname} gradient"
    ln = pname.startswith(("ln1.", "ln2."))
    if dp > 1 and (_close(mine, alone) or (ln and _close(mine * tp, alone))):
        raise CheckFailed(f"{head} is its own replica's only: average every gradient over the dp "
                          f"group too (each replica saw different data).")
    if dp > 1 and _close(mine, expected * dp):
        raise CheckFailed(f"{head} is {dp}x the dense one: over the dp group average (divide by "
                          f"{dp}), do not sum.")
    if not ln:
        if pname.endswith(("proj.bias", "fc2.bias")):
            raise CheckFailed(
                f"{head} is wrong: the row-parallel biases already sum their gradient over the "
                f"tp group inside backward (sequence parallel's `replicated`); summing again "
                f"counts it twice. Over tp, sum only the LayerNorm gradients.")
        raise CheckFailed(
            f"{head} is wrong: it belongs to a tensor-parallel shard, and each tp rank's is the "
            f"gradient of a different slice of the matrix, already complete; reducing shard "
            f"gradients over tp mixes slices. Over tp, sum only the LayerNorm gradients.")
    if _close(mine * tp, expected):
        raise CheckFailed(f"{head} is 1/{tp} of the dense one: over tp the ranks' parts must be "
                          f"summed, not averaged (each saw a different 1/{tp} of the tokens).")
    scale = (mine.norm() / expected.norm()).item()
    if scale > 1:
        raise CheckFailed(f"{head} is {scale:.2g} times the dense one's norm: it was added up "
                          f"more than once; sum it once over tp, then average over dp.")
    raise CheckFailed(f"{head} is {scale:.2g} times the dense one's norm: each rank's LayerNorm "
                      f"saw only its 1/{tp} of the sequence, so its gradient is a partial sum; "
                      f"all-reduce (sum) it over the tp group.")


def _judge_carried(name, where, got, rank, tp, dp):
    """What the rank's groups delivered (`_traffic.delivered` over each group's calls): over tp
    the LayerNorms' gradients of its replica, over dp the mean of every gradient — not a call of
    zeros beside gradients obtained some other way."""
    groups = (("tp", tuple(range(rank // tp * tp, (rank // tp + 1) * tp)), tp > 1),
              ("dp", tuple(range(rank % tp, tp * dp, tp)), dp > 1))
    for dim, ranks, needed in groups:
        if not needed:
            continue
        inside = {r: [c for c in got[r]["sent"] if (c["group"] == ranks if c["kind"] ==
                                                    "collective" else c["peer"] in ranks)]
                  for r in ranks}
        want = {n: (alone if dim == "tp" else expected) for n, (_, expected, alone)
                in got[rank]["grads"].items() if dim == "dp" or n.startswith(("ln1.", "ln2."))}
        missing = _traffic.missing(_traffic.delivered(inside), list(want.values()), list(want))
        if missing:
            raise CheckFailed(
                f"{name} {where}: rank {rank}'s gradients are right, but what its {dim} group "
                f"(ranks {list(ranks)}) delivered does not hold the {missing} gradient "
                f"{'of its replica' if dim == 'tp' else 'averaged over the replicas'} (times any "
                f"factor): the gradients themselves must travel, not zeros or a copy.")
