"""Workbook 08's checkers pass right answers however they are written, and refuse wrong orders,
wrong communication (read from the trace) and the course's own code, saying which."""
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed import irecv, isend

from distlab import pipeline_parallel as pp
from distlab import pipeline_schedules as ps
from distlab.checks import CheckFailed, ch08


# ---- exercise 1: the 1F1B list of one stage ---------------------------------------------------------

def one_f_one_b_stage(p, m, stage):
    """The workbook's answer."""
    warmup = min(p - 1 - stage, m)
    actions = [("F", i) for i in range(warmup)]
    for i in range(m - warmup):
        actions += [("F", warmup + i), ("B", i)]
    return actions + [("B", i) for i in range(m - warmup, m)]


def one_f_one_b_counters(p, m, stage):
    """Differently written: two counters and Action records, 'forward when allowed'."""
    actions, f, b = [], 0, 0
    while b < m:
        if f < m and f - b < p - stage:
            actions.append(ps.Action("F", f))
            f += 1
        else:
            actions.append(ps.Action("B", b))
            b += 1
    return actions


def gpipe_stage(p, m, stage):
    """Wrong structure: GPipe's order (valid, same bubble, but m micro-batches held)."""
    return [("F", i) for i in range(m)] + [("B", i) for i in range(m)]


def early_backward_stage(p, m, stage):
    """Wrong order within 1F1B's memory: stage 0's first backward one slot early (it waits)."""
    actions = one_f_one_b_stage(p, m, stage)
    if stage == 0 and len(actions) > p + 1:
        i = actions.index(("B", 0))
        actions[i - 1], actions[i] = actions[i], actions[i - 1]
    return actions


def cheat_stage(p, m, stage):
    """Calls the course's schedule."""
    return ps.one_f_one_b(p, m)[stage]


def cheat_make_schedule(p, m, stage):
    from distlab.pipeline_schedules import make_schedule
    return make_schedule("1F1B", p, m)[stage]


# (the workbook's own answers pass in solutions/08 under nbval; here the other ways to write them)
@pytest.mark.parametrize("fn", [one_f_one_b_counters])
def test_1f1b_right_answers_pass(fn, capsys):
    ch08.check_one_f_one_b(fn)
    assert "✅" in capsys.readouterr().out


def test_1f1b_gpipe_order_is_refused_for_its_memory():
    with pytest.raises(CheckFailed, match=r"with p=2, m=4, stage 0 holds 4 micro-batches' "
                                          r"activations at once; 1F1B holds at most p - stage = 2"):
        ch08.check_one_f_one_b(gpipe_stage)


def test_1f1b_wrong_order_is_named_action_by_action():
    with pytest.raises(CheckFailed, match=r"with p=2, m=4, stage 0's action 1 is B0; 1F1B runs "
                                          r"F1 there \(stage 0 runs 1 warm-up forward, then "
                                          r"alternates one forward and one backward"):
        ch08.check_one_f_one_b(early_backward_stage)


@pytest.mark.parametrize("fn", [cheat_stage, cheat_make_schedule])
def test_1f1b_course_schedule_is_refused(fn):
    with pytest.raises(CheckFailed, match="course's own .*one_f_one_b|course's own .*make_schedule"):
        ch08.check_one_f_one_b(fn)
    assert [repr(a) for a in ps.one_f_one_b(2, 2)[0]] == ["F0", "F1", "B0", "B1"]   # restored


def test_1f1b_stub_says_not_written():
    def stub(p, m, stage):
        raise NotImplementedError
    with pytest.raises(NotImplementedError, match="one_f_one_b_stage is not written yet"):
        ch08.check_one_f_one_b(stub)


# ---- exercise 2: the send/recv of one pipeline step -------------------------------------------------

def pipeline_step(stage, x, y, rank, world_size, in_shape):
    """The workbook's answer: blocking send/recv."""
    if rank == 0:
        inp = x
    else:
        inp = torch.empty(in_shape, dtype=x.dtype)
        dist.recv(inp, src=rank - 1)
        inp.requires_grad_()
    out = stage(inp)
    if rank == world_size - 1:
        loss = F.mse_loss(out, y)
        loss.backward()
    else:
        dist.send(out.detach(), dst=rank + 1)
        grad = torch.empty_like(out)
        dist.recv(grad, src=rank + 1)
        out.backward(grad)
        loss = None
    if rank > 0:
        dist.send(inp.grad, dst=rank - 1)
    return None if loss is None else loss.item()


def pipeline_step_async(stage, x, y, rank, world_size, in_shape):
    """Differently written: imported isend/irecv with wait(), autograd.backward, a tensor loss."""
    inp = x
    if rank > 0:
        inp = torch.empty(in_shape, dtype=x.dtype)
        irecv(inp, rank - 1).wait()
        inp.requires_grad_()
    out = stage(inp)
    pending = []
    if rank < world_size - 1:
        pending.append(isend(out.detach().contiguous(), rank + 1))
        grad = torch.empty_like(out)
        irecv(grad, rank + 1).wait()
        torch.autograd.backward(out, grad)
        loss = None
    else:
        loss = F.mse_loss(out, y)
        loss.backward()
    if rank > 0:
        pending.append(isend(inp.grad, rank - 1))
    for work in pending:
        work.wait()
    return loss.detach() if loss is not None else None


def pipeline_step_batched(stage, x, y, rank, world_size, in_shape):
    """Differently written: batch_isend_irecv for every exchange."""
    inp = x
    if rank > 0:
        inp = torch.empty(in_shape, dtype=x.dtype)
        for w in dist.batch_isend_irecv([dist.P2POp(dist.irecv, inp, rank - 1)]):
            w.wait()
        inp.requires_grad_()
    out = stage(inp)
    loss = None
    if rank < world_size - 1:
        grad = torch.empty_like(out)
        ops = [dist.P2POp(dist.isend, out.detach(), rank + 1),
               dist.P2POp(dist.irecv, grad, rank + 1)]
        for w in dist.batch_isend_irecv(ops):
            w.wait()
        out.backward(grad)
    else:
        loss = F.mse_loss(out, y)
        loss.backward()
    if rank > 0:
        for w in dist.batch_isend_irecv([dist.P2POp(dist.isend, inp.grad, rank - 1)]):
            w.wait()
    return None if loss is None else loss.item()


def loss_to_rank0_step(stage, x, y, rank, world_size, in_shape):
    """Wrong structure: right numbers, plus the last rank reports its loss to rank 0."""
    loss = pipeline_step(stage, x, y, rank, world_size, in_shape)
    if rank == world_size - 1:
        dist.send(torch.tensor([loss], dtype=torch.float64), dst=0)
    elif rank == 0:
        dist.recv(torch.empty(1, dtype=torch.float64), src=world_size - 1)
    return loss


def broadcast_forward_step(stage, x, y, rank, world_size, in_shape):
    """Wrong structure: activations passed on with broadcasts (every rank gets every one)."""
    width = 24                                   # the checker's MLP is 24 wide at every cut
    inp = x
    out = None
    for src in range(world_size - 1):
        if rank == src:
            out = stage(inp)
            buf = out.detach().clone()
        else:
            buf = torch.empty(len(x), width, dtype=x.dtype)
        dist.broadcast(buf, src=src)
        if rank == src + 1:
            inp = buf.requires_grad_()
    loss = None
    if rank == world_size - 1:
        loss = F.mse_loss(stage(inp), y)
        loss.backward()
    else:
        grad = torch.empty_like(out)
        dist.recv(grad, src=rank + 1)
        out.backward(grad)
    if rank > 0:
        dist.send(inp.grad, dst=rank - 1)
    return None if loss is None else loss.item()


def course_stage_step(stage, x, y, rank, world_size, in_shape):
    """Cheat: let the course's PipelineStage do it."""
    s = pp.PipelineStage([stage] * world_size, rank, world_size, (x.shape[1],))
    return s.step([("F", 0), ("B", 0)], x, y, 1, F.mse_loss)


def reference_step(stage, x, y, rank, world_size, in_shape):
    """Cheat: the checker's own reference."""
    return ch08._reference([(x, y)])[0]["loss"] if rank == world_size - 1 else None


@pytest.mark.parametrize("fn", [pipeline_step_async, pipeline_step_batched])
def test_step_right_answers_pass(fn, capsys):
    ch08.check_pipeline_step(fn)
    assert "✅" in capsys.readouterr().out


def test_step_extra_message_is_refused_from_the_trace():
    with pytest.raises(CheckFailed, match=r"with world_size=3, rank 2 sent 8 B to rank 0; in a "
                                          r"pipeline, rank r only sends its output to rank r\+1"):
        ch08.check_pipeline_step(loss_to_rank0_step)


def test_step_collective_is_refused_from_the_trace():
    with pytest.raises(CheckFailed, match=r"with world_size=3, rank 0 called broadcast \(the run's "
                                          r"trace shows it\); in a pipeline"):
        ch08.check_pipeline_step(broadcast_forward_step)


@pytest.mark.parametrize("fn, what", [(course_stage_step, "PipelineStage"),
                                      (reference_step, "_reference")])
def test_step_course_code_is_refused(fn, what):
    with pytest.raises(CheckFailed, match=f"your function called the course's own .*{what}; "
                                          f"the exercise is to write the pipeline's send/recv"):
        ch08.check_pipeline_step(fn)


def test_step_stub_says_not_written():
    def stub(stage, x, y, rank, world_size, in_shape):
        raise NotImplementedError
    with pytest.raises(NotImplementedError, match="pipeline_step is not written yet"):
        ch08.check_pipeline_step(stub)
