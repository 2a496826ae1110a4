"""Workbook 07's checkers: right answers pass however they are written; wrong structure, the
in-place all-reduce the chapter forbids and the course's own code are refused with a sentence."""
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed import ReduceOp, all_reduce

from distlab import tp_comm
from distlab.checks import CheckFailed, ch07


# ---- the column-parallel f -----------------------------------------------------------------

class IdentityAllReduce(torch.autograd.Function):          # as the workbook's solution
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class ImportedSumF(torch.autograd.Function):               # imported name, explicit op, a copy
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        summed = torch.empty_like(grad).copy_(grad)
        all_reduce(summed, op=ReduceOp.SUM, group=ctx.group)
        return summed, None


class InPlaceF(torch.autograd.Function):                   # what the chapter forbids
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class GatherThenSumF(torch.autograd.Function):             # right numbers, N× the traffic
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        parts = [torch.empty_like(grad) for _ in range(dist.get_world_size(ctx.group))]
        dist.all_gather(parts, grad.contiguous(), group=ctx.group)
        return torch.stack(parts).sum(0), None


class NoSumF(torch.autograd.Function):                     # the broken example's bug
    @staticmethod
    def forward(ctx, x, group):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class CourseF(tp_comm.IdentityFwdAllReduceBwd):            # a cheat: the course's Function
    pass


def test_column_pair_accepts_right_answers_however_written():
    ch07.check_identity_all_reduce(IdentityAllReduce, world_sizes=(4,))
    ch07.check_identity_all_reduce(ImportedSumF, world_sizes=(3,))


def test_column_pair_refuses_the_in_place_all_reduce():
    with pytest.raises(CheckFailed, match=r"residual-branch gradient.*dist\.all_reduce works in "
                                          r"place; all-reduce a copy"):
        ch07.check_identity_all_reduce(InPlaceF, world_sizes=(3,))


def test_column_pair_refuses_wrong_structure_and_wrong_numbers():
    with pytest.raises(CheckFailed, match=r"in step 1's backward, rank 0 made all_gather of "
                                          r"\d+ B .*exactly one all_reduce"):
        ch07.check_identity_all_reduce(GatherThenSumF, world_sizes=(3,))
    with pytest.raises(CheckFailed, match=r"with 3 ranks, rank 0, step 1, input gradient"):
        ch07.check_identity_all_reduce(NoSumF, world_sizes=(3,))


def test_column_pair_refuses_the_course_code_and_bad_arguments():
    with pytest.raises(CheckFailed, match="course's own IdentityFwdAllReduceBwd.forward"):
        ch07.check_identity_all_reduce(CourseF, world_sizes=(3,))
    with pytest.raises(CheckFailed, match="course's own"):
        ch07.check_identity_all_reduce(tp_comm.IdentityFwdAllReduceBwd)
    with pytest.raises(TypeError, match="autograd.Function class itself"):
        ch07.check_identity_all_reduce(IdentityAllReduce.apply)


# ---- the row-parallel layer --------------------------------------------------------------------

class AllReduceIdentity(torch.autograd.Function):
    @staticmethod
    def forward(ctx, partial, group):
        total = partial.clone()
        dist.all_reduce(total, group=group)
        return total

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def row_parallel_linear(x_shard, weight_shard, bias, group):
    return AllReduceIdentity.apply(F.linear(x_shard, weight_shard), group) + bias


class SumWithBias(torch.autograd.Function):                # differently written: bias inside
    @staticmethod
    def forward(ctx, partial, bias, group):
        out = partial.detach().clone()
        all_reduce(out, op=ReduceOp.SUM, group=group)
        return out + bias

    @staticmethod
    def backward(ctx, grad):
        return grad, grad.sum(0), None


def row_bias_inside(x_shard, weight_shard, bias, group):
    return SumWithBias.apply(x_shard @ weight_shard.T, bias, group)


class GatherSum(torch.autograd.Function):
    @staticmethod
    def forward(ctx, partial, group):
        parts = [torch.empty_like(partial) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, partial.contiguous(), group=group)
        return torch.stack(parts).sum(0)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def row_gathered(x_shard, weight_shard, bias, group):
    return GatherSum.apply(F.linear(x_shard, weight_shard), group) + bias


def row_torch_nn_all_reduce(x_shard, weight_shard, bias, group):
    import torch.distributed.nn.functional as dnf   # its backward all-reduces again
    return dnf.all_reduce(F.linear(x_shard, weight_shard), group=group or dist.group.WORLD) + bias


def row_bias_every_rank(x_shard, weight_shard, bias, group):
    return AllReduceIdentity.apply(F.linear(x_shard, weight_shard, bias), group)


def row_course(x_shard, weight_shard, bias, group):
    return tp_comm.all_reduce_fwd_identity_bwd(F.linear(x_shard, weight_shard), group) + bias


def test_row_layer_accepts_right_answers_however_written():
    ch07.check_row_parallel_linear(row_parallel_linear, world_sizes=(4,))
    ch07.check_row_parallel_linear(row_bias_inside, world_sizes=(3,))


def test_row_layer_refuses_wrong_structure():
    with pytest.raises(CheckFailed, match=r"forward, rank 0 made all_gather of \d+ B.*exactly one "
                                          r"all_reduce"):
        ch07.check_row_parallel_linear(row_gathered, world_sizes=(3,))
    with pytest.raises(CheckFailed, match=r"backward, rank 0 made all_reduce of 96 B.*identity"):
        ch07.check_row_parallel_linear(row_torch_nn_all_reduce, world_sizes=(3,))


def test_row_layer_names_the_bias_counted_n_times_and_refuses_the_course_code():
    with pytest.raises(CheckFailed, match=r"output.*the bias was counted 3 times"):
        ch07.check_row_parallel_linear(row_bias_every_rank, world_sizes=(3,))
    with pytest.raises(CheckFailed, match="course's own all_reduce_fwd_identity_bwd"):
        ch07.check_row_parallel_linear(row_course, world_sizes=(3,))
    with pytest.raises(TypeError, match="should take 4 arguments"):
        ch07.check_row_parallel_linear(lambda x, w, b: x)


# ---- the MLP ---------------------------------------------------------------------------------

def test_megatron_mlp():
    ch07.check_megatron_mlp(ImportedSumF, row_bias_inside, world_sizes=(3,))
    with pytest.raises(CheckFailed, match=r"in step 1's forward, rank 0 made all_gather"):
        ch07.check_megatron_mlp(IdentityAllReduce, row_gathered, world_sizes=(3,))
    with pytest.raises(CheckFailed, match="course's own"):
        ch07.check_megatron_mlp(IdentityAllReduce, row_course, world_sizes=(3,))


def test_stubs_are_reported_as_not_written():
    class Stub(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, group):
            raise NotImplementedError

        @staticmethod
        def backward(ctx, grad):
            raise NotImplementedError

    def stub(x_shard, weight_shard, bias, group):
        raise NotImplementedError

    with pytest.raises(NotImplementedError, match="Stub is not written yet"):
        ch07.check_identity_all_reduce(Stub)
    with pytest.raises(NotImplementedError, match="stub is not written yet"):
        ch07.check_row_parallel_linear(stub)
    with pytest.raises(NotImplementedError, match="Stub is not written yet"):
        ch07.check_megatron_mlp(Stub, row_parallel_linear)
