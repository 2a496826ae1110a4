"""Every checker of workbooks 05 and 10 through the battery (issue 44, tests/checker_battery.py):
it accepts the workbook's solution and one written another way, and refuses a wrong answer, a
cheat and a decoy (numbers right on the obvious case, algorithm wrong), each in one sentence.

The candidates live beside each exercise's older tests (tests/test_ch05.py, tests/test_ch10.py),
which keep the words each refusal must contain; the batteries here replace their accept/reject
runs, so no checker runs twice. Accepted answers run at two world sizes or meshes; a refusal
needs one. Damage is never only on rank 0: some candidates break only the last rank, or two
middle ranks, so a checker that looked at rank 0 alone would pass them.
"""
import contextlib

import torch
import torch.distributed as dist

from checker_battery import battery, ring_all_reduce
from distlab.checks import ch05, ch10

import test_ch05 as t05
import test_ch10 as t10
# A function, not the module: a rank's function that names the module t10 would carry the whole
# module by value (pytest's loader and config with it) once test_ch10 is collected beside it.
from test_ch10 import step_3d as workbook_step_3d


def _said(said, kind, *words):
    """Every word appears in the refusal of the `kind` candidates, in order of the candidates."""
    for sentence, expected in zip(said[kind], words):
        for w in (expected if isinstance(expected, tuple) else (expected,)):
            assert w in sentence, sentence


def _with(**kwargs):
    return lambda check, fn: check(fn, **kwargs)


# ---- workbook 05 ---------------------------------------------------------------------------------

# The checkers judge what travelled by the one traffic rule (distlab/checks/_traffic.py): a
# hand-written ring of send/recv is an all-reduce of the same bytes, and what it delivered is
# what counts, so these answers pass beside the all_reduce ones; a call of zeros beside weights or
# gradients rebuilt locally does not.

def _copy_back(grads, flat):
    for g, part in zip(grads, flat.split([g.numel() for g in grads])):
        g.copy_(part.view_as(g))


def uneven_by_ring(model, n_local):
    """Correct, written differently: the weighted gradients and the count in one flat buffer
    around a hand-written ring — one packed message per hop, the messages of one all-reduce."""
    grads = [p.grad for p in model.parameters()]
    flat = ring_all_reduce(torch.cat([g.reshape(-1) * n_local for g in grads]
                                      + [grads[0].new_tensor([n_local])]))
    _copy_back(grads, flat[:-1] / flat[-1])


class DDPRing(t05.DDPPerParam):
    """Correct, written differently: each gradient around a hand-written ring."""
    def _hook(self, p):
        if self.sync:
            p.grad.copy_(ring_all_reduce(p.grad.reshape(-1)).view_as(p.grad)
                         / dist.get_world_size())


class DDPRankZeroRebuilt(t05.DDPPerParam):
    """A decoy: rank 0's weights rebuilt from its seed (the checker's recipe, retyped) beside a
    broadcast of zeros of their size; the gradients are all-reduced as they should be."""
    broadcast = False

    def __init__(self, module):
        from distlab import models
        module.load_state_dict(models.make_mlp(sizes=(16, 24, 20, 4), seed=3).double()
                               .state_dict())
        dist.broadcast(torch.zeros(sum(p.numel() for p in module.parameters()),
                                   dtype=torch.float64), src=0)
        super().__init__(module)


def test_battery_uneven_average():
    accepted = battery(ch05.check_uneven_average, correct=[t05.uneven_one_message],
                       different=[t05.uneven_avg_count_first], call=_with(world_sizes=(2, 3)),
                       require=("correct", "different"))
    assert "global batches of 12, 11, 13 and 10 samples" in accepted["correct"][0]
    said = battery(ch05.check_uneven_average,
                   wrong=[t05.uneven_equal_weights, t05.uneven_two_messages],
                   cheat=[t05.uneven_by_chapter_11, t05.uneven_decoy],
                   decoy=[t05.uneven_divides_by_twelve],
                   call=_with(world_sizes=(2,)), require=("wrong", "cheat", "decoy"))
    _said(said, "wrong", "each rank weighted the same", "made 2 all_reduce calls")
    _said(said, "cheat", ("average_gradients", "the exercise is to"), "decoy")
    _said(said, "decoy", ("step 1", "divided by 12", "holds 11 samples"))
    last = battery(ch05.check_uneven_average, wrong=[t05.uneven_last_rank_keeps_its_own],
                   different=[uneven_by_ring], call=_with(world_sizes=(3,)),
                   require=("wrong", "different"))
    _said(last, "wrong", "rank 2")


def arrival_order_buckets(model, world_size, cap_bytes):
    """The workbook's solution."""
    arrived, buckets, bucket_of, missing, in_flight = [], [], {}, [], {}

    def ready(p):
        if not buckets:                         # the first step: note the order
            arrived.append(p)
            return
        k = bucket_of[id(p)]
        missing[k] -= 1
        if missing[k] == 0:                     # its last gradient: send it now
            flat = torch.cat([q.grad.reshape(-1) for q in buckets[k]]) / world_size
            in_flight[k] = (flat, dist.all_reduce(flat, async_op=True))

    for p in model.parameters():
        p.register_post_accumulate_grad_hook(ready)

    def copy_back(params, flat):
        for p, g in zip(params, flat.split([q.numel() for q in params])):
            p.grad.copy_(g.view_as(p.grad))

    def finish():
        if not buckets:
            flat = torch.cat([p.grad.reshape(-1) for p in arrived]) / world_size
            dist.all_reduce(flat)
            copy_back(arrived, flat)
            size = 0
            for p in arrived:
                nbytes = p.numel() * p.element_size()
                if not buckets or size + nbytes > cap_bytes:
                    buckets.append([])
                    size = 0
                buckets[-1].append(p)
                size += nbytes
                bucket_of[id(p)] = len(buckets) - 1
        else:
            for k, bucket in enumerate(buckets):
                flat, work = in_flight.pop(k)
                work.wait()
                copy_back(bucket, flat)
        missing[:] = [len(b) for b in buckets]
    return finish


def test_battery_arrival_buckets():
    battery(ch05.check_arrival_buckets, correct=[arrival_order_buckets],
            different=[t05.arrival_by_tensor_hooks],
            call=_with(world_sizes=(2, 3)), require=("correct", "different"))
    said = battery(ch05.check_arrival_buckets,
                   wrong=[t05.arrival_summed, t05.arrival_over_the_cap,
                          t05.arrival_one_per_gradient],
                   cheat=[t05.arrival_by_the_course, t05.arrival_by_torch_ddp],
                   decoy=[t05.arrival_registration_order, t05.arrival_at_the_end],
                   call=_with(world_sizes=(2,)), require=("wrong", "cheat", "decoy"))
    _said(said, "wrong", "SUM", "over the cap", "within the cap")
    _said(said, "cheat", "BucketedDDP", "C++")
    _said(said, "decoy", ("in the order the gradients arrived", "nothing overlaps"),
          "after backward had finished")


def test_battery_resume_indices():
    said = battery(ch05.check_resume_indices, correct=[t05.resume_by_permutation],
                   different=[t05.resume_with_samplers],
                   wrong=[t05.resume_from_scratch, t05.resume_ignoring_the_epoch,
                          t05.resume_unpadded],
                   cheat=[t05.resume_by_the_checker],
                   decoy=[t05.resume_per_old_rank, t05.resume_blocks])
    _said(said, "wrong", "read twice", "seed plus the epoch", "pad by repeating")
    _said(said, "cheat", "the exercise is to")
    _said(said, "decoy", "had already read", "positions r, r + 3, r + 6")


def test_battery_scaled_training():
    said = battery(ch05.check_scaled_training, correct=[t05.scaled_correct],
                   different=[t05.scaled_with_torch_ddp],
                   wrong=[t05.scaled_lr_unchanged, t05.scaled_summed,
                          t05.scaled_whole_batch_everywhere],
                   cheat=[t05.scaled_by_the_course, t05.scaled_decoy],
                   decoy=[t05.scaled_every_slice_loss_reduced])
    _said(said, "wrong", "linear scaling gives lr 0.1", "divide by the world size",
          "per_rank_batch=4")
    _said(said, "cheat", "the exercise is to", "of zeros")
    _said(said, "decoy", "its own slice")


def test_battery_my_ddp():
    battery(ch05.check_my_ddp, correct=[t05.DDPPerParam], different=[t05.DDPOneBucket],
            call=_with(world_sizes=(2, 3)), require=("correct", "different"))
    said = battery(ch05.check_my_ddp, wrong=[t05.DDPNoBroadcast],
                   cheat=[t05.DDPCourse, t05.DDPChapter11, t05.DDPTorch],
                   decoy=[t05.DDPSyncsAlways, DDPRankZeroRebuilt], different=[DDPRing],
                   call=_with(world_sizes=(3,)), require=("wrong", "cheat", "decoy", "different"))
    _said(said, "wrong", "broadcast rank 0's parameters")
    _said(said, "cheat", "BucketedDDP", "broadcast_parameters", "C++")
    _said(said, "decoy", "inside no_sync()", ("does not hold rank 0's", "rebuilt"))


def test_battery_ddp_script():
    said = battery(ch05.check_ddp_script, correct=[t05.script_fixed],
                   different=[t05.script_by_hand],
                   wrong=[t05.script_local_rank_sampler, t05.script_no_set_epoch,
                          t05.script_local_mean],
                   cheat=[t05.script_without_ddp, t05.script_by_the_checker],
                   decoy=[t05.script_global_count_without_world_size,
                          t05.script_prints_on_local_rank_0, t05.script_saves_on_local_rank_0])
    _said(said, "wrong", "global rank (RANK)", "set_epoch", "global token count")
    _said(said, "cheat", "DistributedDataParallel", "the exercise is to")
    _said(said, "decoy", "multiply the loss", "ranks 0 and 2 printed",
          "ranks 0 and 2 wrote the checkpoint")


def test_battery_step_prediction():
    said = battery(ch05.check_step_prediction, correct=[t05.predict_by_two_clocks],
                   different=[t05.predict_by_recursion],
                   wrong=[t05.predict_without_latency, t05.predict_ring_n_minus_1,
                          t05.predict_bytes_once, t05.predict_parallel_buckets,
                          t05.predict_without_copies],
                   cheat=[t05.predict_by_the_course], decoy=[t05.predict_no_overlap])
    _said(said, "wrong", "latency term", "per-step term", "bandwidth term",
          "one bucket at a time on the link", "the copies back into p.grad")
    _said(said, "cheat", "the exercise is to")
    _said(said, "decoy", "all buckets but the last overlap backward")


# ---- workbook 10 ---------------------------------------------------------------------------------

def unshard_ranks_reversed(shards, chunks):
    """Wrong: the right interleaving, the ranks in reverse order."""
    return t10.unshard_column(shards[::-1], chunks)


def test_battery_unshard_column():
    said = battery(ch10.check_unshard_column, correct=[t10.unshard_column],
                   different=[t10.unshard_column_by_index], wrong=[unshard_ranks_reversed],
                   cheat=[lambda shards, chunks: ch10._reference_unshard(shards, chunks)],
                   decoy=[lambda shards, chunks: torch.cat(shards)])   # right when chunks = 1
    _said(said, "cheat", "course's own _reference_unshard")
    _said(said, "decoy", "2 shards of 3 stacked matrices")


def token_mean_three_micro_batches(losses, tokens, mesh):
    """A decoy: the right sums, over a count of micro-batches fixed at 3 (the count the pipeline
    of two stages uses): fewer micro-batches than stages breaks it."""
    last = mesh.p == mesh.pp - 1
    pair = torch.zeros(2, dtype=torch.float64)
    if last:
        for j in range(3):
            pair += torch.stack([losses[j] * tokens[j], tokens[j].double()])
    dist.all_reduce(pair, group=mesh.get_group("pp"))
    dist.all_reduce(pair, group=mesh.get_group("dp"))
    return (pair[0] / pair[1]).item()


def test_battery_token_mean_loss():
    battery(ch10.check_token_mean_loss, correct=[t10.token_mean_loss],
            different=[t10.token_mean_loss_broadcast], call=_with(meshes=((1, 2, 2), (1, 3, 1))),
            require=("correct", "different"))
    said = battery(ch10.check_token_mean_loss,
                   wrong=[t10.token_mean_by_replica, t10.token_mean_in_place],
                   cheat=[lambda losses, tokens, mesh: p3_global_loss(losses, tokens, mesh)],
                   decoy=[t10.token_mean_of_means], call=_with(meshes=((2, 1, 1),)),
                   require=("wrong", "cheat", "decoy"))
    _said(said, "wrong", "every replica weighs the same", "in place")
    _said(said, "cheat", "course's own global_loss")
    _said(said, "decoy", "every micro-batch weighs the same")
    middle = battery(ch10.check_token_mean_loss,
                     wrong=[t10.token_mean_every_stage, token_mean_three_micro_batches],
                     call=_with(meshes=((1, 3, 1),)), require=("wrong",))
    _said(middle, "wrong", "only the last stage's numbers are losses", "2 micro-batches")


def p3_global_loss(losses, tokens, mesh):
    from distlab import parallel3d as p3
    return p3.global_loss((losses * tokens).sum() / tokens.sum(), mesh)


@contextlib.contextmanager
def _dp_gradients_by(send):
    """Inside a rank: the workbook's step with its dp all-reduce of each gradient (a tensor of more
    than one value over the rank's dp group, ranks not 0..k) done by `send(tensor, ranks, group)`
    instead (`real`: torch's own); every other all-reduce (the tp layers', the loss's) is left
    alone."""
    real = dist.all_reduce

    def all_reduce(t, op=dist.ReduceOp.SUM, group=None, async_op=False):
        ranks = dist.get_process_group_ranks(group) if group is not None else []
        rank, (dp, pp, tp) = dist.get_rank(), _dp_gradients_by.shape
        dp_group = [d * pp * tp + rank % (pp * tp) for d in range(dp)]
        if t.numel() > 1 and ranks == dp_group and len(ranks) > 1:
            return send(t, ranks, group, real)
        return real(t, op=op, group=group, async_op=async_op)
    dist.all_reduce = all_reduce
    try:
        yield
    finally:
        dist.all_reduce = real


def step_3d_dp_by_ring(gpt, x, y, dp, pp, tp, lr):
    """Correct, written differently: the replicas' gradients summed by a hand-written ring of
    send/recv over the dp group (the same bytes as its all-reduce)."""
    _dp_gradients_by.shape = (dp, pp, tp)
    with _dp_gradients_by(lambda t, ranks, group, real: t.copy_(
            ring_all_reduce(t.reshape(-1), ranks).view_as(t))):
        return workbook_step_3d(gpt, x, y, dp, pp, tp, lr)


def step_3d_dp_zeros(gpt, x, y, dp, pp, tp, lr):
    """A decoy: the pipeline as it should be, but over dp an all-reduce of zeros of each
    gradient's size, and the replicas' mean taken from a dense copy run on the whole batch."""
    import copy
    from distlab.models import lm_loss
    dense = copy.deepcopy(gpt)
    _dp_gradients_by.shape = (dp, pp, tp)
    with _dp_gradients_by(lambda t, ranks, group, real: real(torch.zeros_like(t), group=group)):
        stage, loss = workbook_step_3d(gpt, x, y, dp, pp, tp, lr)
    lm_loss(dense(x), y).backward()
    with torch.no_grad():
        for name, q in stage.named_parameters():
            full = dense.get_parameter(stage.dense_name(name))
            q.grad = stage.shard_of(name, full.grad).clone()
            q.copy_(stage.shard_of(name, full - lr * full.grad))
    return stage, loss


def test_battery_step_3d():
    battery(ch10.check_step_3d, correct=[t10.step_3d], different=[t10.step_3d_device_mesh],
            call=_with(meshes=((2, 2, 1), (1, 3, 2))), require=("correct", "different"))
    said = battery(ch10.check_step_3d,
                   wrong=[t10.step_3d_dp_fastest, t10.step_3d_lr_over_dp],
                   cheat=[t10.step_3d_with_the_course, t10.step_3d_dense_with_decoys],
                   decoy=[t10.step_3d_whole_batch, step_3d_dp_zeros],
                   different=[step_3d_dp_by_ring], call=_with(meshes=((2, 2, 1),)),
                   require=("wrong", "cheat", "decoy", "different"))
    _said(said, "wrong", "rank 2", "SUM over the dp group")
    _said(said, "cheat", "course's own Mesh3D", "not its stage's output")
    _said(said, "decoy", "its replica's part of the batch",
          ("rank 0 (dp 0, pp 0, tp 0): what its calls over the dp group [0, 2] delivered", 
           "not a copy or zeros"))
    # damage on one rank that is not rank 0, and on two middle-stage ranks at once
    one = battery(ch10.check_step_3d, wrong=[t10.step_3d_damaged_on_2],
                  call=_with(meshes=((2, 2, 1),)), require=("wrong",))
    _said(one, "wrong", "rank 2")
    two = battery(ch10.check_step_3d, wrong=[t10.step_3d_damaged_on_2_and_3],
                  call=_with(meshes=((1, 3, 2),)), require=("wrong",))
    _said(two, "wrong", "rank 2")


def choose_layout_powers_of_two(model, nodes, gpus_per_node, global_batch):
    """A decoy: every rule applied, but only powers of two tried for pp and tp — right on every
    cluster of 2^k GPUs, blind to pp = 3 or 6."""
    from distlab import layout
    shape = layout.SHAPES[model]
    n = nodes * gpus_per_node
    best = None
    for tp in (1, 2, 4, 8, 16):
        for pp in (1, 2, 4, 8, 16, 32, 64):
            if n % (tp * pp) or gpus_per_node % tp or shape.heads % tp or shape.layers % pp:
                continue
            dp = n // (tp * pp)
            if global_batch % dp:
                continue
            r = layout.price(model, dp, pp, tp, gpus_per_node, global_batch)
            key = (not r["fits"], r["step_s"])           # what fits first, then the fastest
            if best is None or key < best[0]:
                best = (key, (dp, pp, tp))
    return best[1]


def test_battery_choose_layout():
    said = battery(ch10.check_choose_layout, correct=[t10.choose_layout],
                   different=[t10.choose_layout_by_product],
                   wrong=[t10.choose_layout_fastest, t10.choose_layout_any_batch],
                   cheat=[lambda model, nodes, g, b: tuple(
                       t10.distlab_layout().best(model, nodes=nodes, gpus_per_node=g,
                                                 global_batch=b)[k] for k in ("dp", "pp", "tp"))],
                   decoy=[choose_layout_powers_of_two])
    _said(said, "wrong", "more than a GPU's 80 GB", "dp=16 does not split a global batch of 24")
    _said(said, "cheat", "course's own best")
    _said(said, "decoy", "on 6 nodes")
