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


# ---- the real-size lesson: TP's communication against its compute -----------------------------

def test_chapter_07_prose_numbers_are_computed():
    import pathlib
    import re

    import nbformat

    from distlab import hardware
    from distlab import tensor_parallel as tpm
    from distlab.emulate import PRESETS
    path = pathlib.Path(__file__).resolve().parent.parent / "notebooks" / "07_tensor_parallel.ipynb"
    cells = nbformat.read(path, as_version=4).cells
    prose = " ".join("\n".join(c.source for c in cells if c.cell_type == "markdown").split())
    outputs = "\n".join(o.get("text", "") for c in cells if c.cell_type == "code"
                        for o in c.get("outputs", []))
    wide = dict(hidden=8192, heads=64, ffn=28672)
    ratio, ratio_wide = {}, {}
    for tp, preset in [(2, "h100-node"), (4, "h100-node"), (8, "h100-node"), (16, "h100-2x8")]:
        t = tpm.tp_block_seconds(PRESETS[preset], tp, 4096)
        w = tpm.tp_block_seconds(PRESETS[preset], tp, 4096, **wide)
        ratio[tp], ratio_wide[tp] = t["comm"] / t["compute"], w["comm"] / w["compute"]
        assert ratio_wide[tp] < ratio[tp]
    pct = {tp: f"{r:.0%}".replace("%", " %") for tp, r in ratio.items()}
    assert (f"{pct[2]} of the block's matmul and attention time at tp = 2, {pct[4]} at tp = 4 "
            f"and {pct[8]} at tp = 8; across two nodes, at tp = 16, {pct[16]}") in prose
    assert ratio[16] > 1 > ratio[8] and "more than the compute" in prose
    assert (f"{ratio_wide[8]:.0%} at tp = 8, still {ratio_wide[16]:.0%} at tp = 16"
            .replace("%", " %")) in prose
    assert f"{ratio[8]:.0%} of its compute at tp = 8 in a node, {ratio[16]:.0%} at".replace(
        "%", " %") in prose
    node = PRESETS["h100-node"].link_between(range(8)).busbw("all_reduce") / 1e9
    two = PRESETS["h100-2x8"].link_between(range(16)).busbw("all_reduce") / 1e9
    assert f"({node:.0f} → {two:.0f} GB/s" in prose
    comm8 = tpm.tp_block_seconds(PRESETS["h100-node"], 8, 4096)["comm"]
    comm16 = tpm.tp_block_seconds(PRESETS["h100-2x8"], 16, 4096)["comm"]
    assert f"{comm8 * 1e3:.2f} ms (tp = 8) and {comm16 * 1e3:.2f} ms (tp = 16)" in prose
    # the emulated numbers the prose quotes are the stored outputs (nbval re-runs the cell)
    runs = re.findall(r"tp=\s?(\d+) \([\w-]+\): emulated step (\d+\.\d\d) ms, of which all-reduces "
                      r"(\d+\.\d\d) ms", outputs)
    (_, s8, c8), (_, s16, c16) = runs
    assert (c8, c16) == (f"{comm8 * 1e3:.2f}", f"{comm16 * 1e3:.2f}")
    assert f"longer — {s8} ms at tp = 8" in prose and f"from {s8} to {s16} ms" in prose
    gain = f"{1 - float(s16) / float(s8):.0%}".replace("%", " %")      # how much shorter
    assert f"twice the GPUs for {gain}" in prose
    # Megatron-LM beside the closed form
    shares, model = [], []
    for layers, hidden, heads, gpus, tp in ((30, 3072, 32, 64, 2), (36, 4096, 32, 128, 4),
                                            (40, 6144, 48, 256, 8)):
        gpt = hardware.Transformer(layers, hidden, heads, 4 * hidden, 51200)
        batch, seq = (1024 if gpus == 256 else 512), 2048
        parts = hardware.step_seconds(gpt, PRESETS["a100-cluster"], gpus, batch, seq, tp=tp,
                                      recompute="full", flash=False)
        flops = 96 * batch * seq * layers * hidden**2 * (1 + seq / (6 * hidden)
                                                          + 51200 / (16 * layers * hidden))
        model.append(round(flops / parts["step"] / gpus / 1e12))
        shares.append(f"{parts['tp'] / parts['step']:.0%}".replace("%", " %"))
    assert (f"({model[0]} against 138, {model[1]} against 142, {model[2]} against 135 TFLOP/s "
            f"per GPU)") in prose
    assert max(abs(m / p - 1) for m, p in zip(model, (138, 142, 135))) < 0.08
    assert "within 8 %" in prose
    assert f"{shares[0]} at tp = 2, {shares[1]} at tp = 4, {shares[2]} at tp = 8" in prose
