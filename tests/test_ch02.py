"""Chapter 02: the collective pictures read real runs, and the checkers pass right answers and
name what is wrong in wrong ones."""
import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import distlab  # noqa: E402
from distlab.checks import CheckFailed, ch02  # noqa: E402
from distlab.viz import collectives as viz  # noqa: E402

WORLD_SIZES = (2, 3, 4)


def _every_collective(rank, world_size):
    """(name, before, after) for each collective the chapter draws, as the notebook returns them."""
    base = lambda n=2: torch.arange(float(n)) + 10 * (rank + 1)  # noqa: E731
    out = []
    x = base(world_size)
    before = x.clone()
    dist.all_reduce(x)
    out.append(("all_reduce", before, x))
    x = base(world_size)
    before = x.clone()
    dist.all_reduce(x, op=dist.ReduceOp.MAX)
    out.append(("all_reduce_max", before, x))
    gathered = [torch.empty(2) for _ in range(world_size)]
    dist.all_gather(gathered, base())
    out.append(("all_gather", base(), gathered))
    x = base(world_size)
    shard = torch.empty(1)
    dist.reduce_scatter_single(shard, x)
    out.append(("reduce_scatter", x, shard))
    x = base(world_size)
    received = torch.empty_like(x)
    dist.all_to_all_single(received, x)
    out.append(("all_to_all", x, received))
    gathered = [torch.empty(2) for _ in range(world_size)] if rank == 0 else None
    dist.gather(base(), gathered, dst=0)
    out.append(("gather", base(), gathered))
    return out


@pytest.fixture(scope="module", params=WORLD_SIZES)
def runs(request):
    results = distlab.run(_every_collective, request.param, timeout=60)
    return request.param, {name: [(b, a) for (n, b, a) in (r[i] for r in results)]
                           for i, (name, _, _) in enumerate(results[0])}


def _after_sources(pairs):
    before = [viz.as_row(b) for b, _ in pairs]
    return [None if a is None else viz.sources(before, viz.as_row(a)[0]) for _, a in pairs]


def test_sources_follow_the_data_of_real_collectives(runs):
    ws, by_name = runs
    # all_gather: chunk j of every rank's output came from rank j.
    for row in _after_sources(by_name["all_gather"]):
        assert row == [j for j in range(ws) for _ in range(2)]
    # all_to_all: rank r's element j came from rank j.
    for row in _after_sources(by_name["all_to_all"]):
        assert row == list(range(ws))
    # a sum is nobody's value; a max is the largest rank's.
    assert all(s is None for row in _after_sources(by_name["all_reduce"]) for s in row)
    assert all(s == ws - 1 for row in _after_sources(by_name["all_reduce_max"]) for s in row)
    gather = _after_sources(by_name["gather"])
    assert gather[0] == [j for j in range(ws) for _ in range(2)]
    assert gather[1:] == [None] * (ws - 1)


def test_before_after_draws_what_every_collective_returns(runs):
    ws, by_name = runs
    for name, pairs in by_name.items():
        fig = viz.before_after(pairs, name, note="a note")
        left, right = fig.axes
        assert [t.get_text() for t in left.get_yticklabels()] == [f"rank {r}" for r in range(ws)]
        # one number per element of every defined row, drawn in the right panel
        drawn = [t.get_text() for t in right.texts]
        expected = [viz._fmt(v) for _, a in pairs if a is not None for v in viz.as_row(a)[0]]
        assert [d for d in drawn if d != "nothing defined on this rank"] == expected
        plt.close(fig)


def test_as_row_lays_pieces_end_to_end():
    assert viz.as_row([torch.tensor([1.0, 2.0]), torch.tensor([3.0])]) == ([1.0, 2.0, 3.0], [2])
    assert viz.as_row(None) is None
    with pytest.raises(TypeError, match="draws tensors"):
        viz.as_row("text")
    with pytest.raises(TypeError, match="one \\(before, after\\) pair"):
        viz.before_after([1, 2])


def test_timeline_draws_a_barrier_run():
    def staggered(rank, world_size):
        import time
        start = time.time()
        time.sleep(0.02 * rank)
        arrive = time.time()
        dist.barrier()
        return start, arrive, time.time()

    results = distlab.run(staggered, 3, timeout=60)
    # The barrier lets nobody go before the last rank arrives.
    assert min(leave for _, _, leave in results) >= max(arrive for _, arrive, _ in results)
    fig = viz.timeline([[("work", s, a), ("wait", a, l)] for s, a, l in results], "barrier")
    assert len(fig.axes[0].patches) == 6
    plt.close(fig)


# ---- checkers ------------------------------------------------------------------------------------

def predict_reduce_scatter(inputs):
    total = torch.stack(inputs).sum(0)
    return list(total.chunk(len(inputs)))


def predict_all_to_all(inputs):
    ws = len(inputs)
    chunks = [t.chunk(ws) for t in inputs]
    return [torch.cat([chunks[src][dst] for src in range(ws)]) for dst in range(ws)]


def all_gather_uneven(tensor):
    ws = dist.get_world_size()
    sizes = [torch.zeros(1, dtype=torch.long) for _ in range(ws)]
    dist.all_gather(sizes, torch.tensor([tensor.numel()]))
    longest = max(int(s) for s in sizes)
    padded = torch.zeros(longest, dtype=tensor.dtype)
    padded[:tensor.numel()] = tensor
    out = [torch.empty_like(padded) for _ in range(ws)]
    dist.all_gather(out, padded)
    return [o[:int(s)] for o, s in zip(out, sizes)]


@pytest.mark.parametrize("ws", WORLD_SIZES)
def test_the_answer_key_equals_the_real_collectives(ws):
    inputs = ch02._inputs(ws, 2 * ws, seed=0)
    for collective, predict in (("reduce_scatter", predict_reduce_scatter),
                                ("all_to_all", predict_all_to_all)):
        real = ch02.real(collective, inputs)
        for got, want in zip(predict(inputs), real):
            assert torch.equal(got, want)


def test_checkers_pass_right_answers(capsys):
    ch02.check_predict_reduce_scatter(predict_reduce_scatter)
    ch02.check_all_gather_uneven(all_gather_uneven)
    assert capsys.readouterr().out.count("✅") == 2


def test_a_wrong_prediction_names_world_size_rank_and_element():
    def all_reduce_instead(inputs):  # forgets the scatter: every rank gets the whole sum
        return [torch.stack(inputs).sum(0) for _ in inputs]

    with pytest.raises(CheckFailed,
                       match=r"world_size=2 .*rank 0.*expected shape \(1,\), got \(2,\)"):
        ch02.check_predict_reduce_scatter(all_reduce_instead)

    with pytest.raises(CheckFailed, match="expected 2 items, got 1"):
        ch02.check_predict_reduce_scatter(lambda inputs: [inputs[0]])


def test_all_gather_uneven_without_trimming_is_caught():
    def untrimmed(tensor):
        ws = dist.get_world_size()
        padded = torch.zeros(8)
        padded[:tensor.numel()] = tensor
        out = [torch.empty(8) for _ in range(ws)]
        dist.all_gather(out, padded)
        return out

    with pytest.raises(CheckFailed, match=r"world_size=2 \(lengths .*\), rank 0.*\[0\].*"
                                          r"expected shape"):
        ch02.check_all_gather_uneven(untrimmed)


def test_a_crashing_all_gather_is_reported_in_one_sentence(monkeypatch):
    def plain_all_gather(tensor):  # gloo refuses pieces of different lengths
        pieces = [torch.empty_like(tensor) for _ in range(dist.get_world_size())]
        dist.all_gather(pieces, tensor)
        return pieces

    # gloo either crashes or hangs on uneven pieces; either way one sentence comes back.
    distlab.run(lambda rank, world_size: None, 2)  # the forkserver is up: the limit is all hang
    monkeypatch.setattr(ch02, "TIMEOUT", 4)
    with pytest.raises(CheckFailed, match=r"world_size=2 \(lengths 2, 0\) (failed|hung): "
                                          r".*same shapes on every rank"):
        ch02.check_all_gather_uneven(plain_all_gather)


def test_calling_the_checkers_own_answer_key_is_refused():
    def ask_the_checker(inputs):
        return ch02.real("reduce_scatter", inputs)

    with pytest.raises(CheckFailed, match=r"your function called the course's own real; the "
                                          r"exercise is to predict what reduce_scatter gives"):
        ch02.check_predict_reduce_scatter(ask_the_checker)

    def gather_via_checker(tensor):
        ch02._real_all_to_all(dist.get_rank(), dist.get_world_size(), [tensor])
        return [tensor]

    with pytest.raises(CheckFailed, match=r"own _real_all_to_all; the exercise is to write the "
                                          r"uneven all-gather yourself"):
        ch02.check_all_gather_uneven(gather_via_checker)


def test_differently_written_answers_pass(capsys):
    def predict_by_loops(inputs):            # element by element, no chunk()
        ws, per = len(inputs), len(inputs[0]) // len(inputs)
        return [torch.tensor([sum(float(t[r * per + i]) for t in inputs) for i in range(per)])
                for r in range(ws)]

    def gather_padded_by_hand(tensor):       # lengths as a tensor of all ranks, then one pad
        n = dist.get_world_size()
        lengths = torch.zeros(n, dtype=torch.long)
        lengths[dist.get_rank()] = tensor.numel()
        dist.all_reduce(lengths)
        padded = torch.cat([tensor, tensor.new_zeros(int(lengths.max()) - tensor.numel())])
        pieces = [torch.empty_like(padded) for _ in range(n)]
        dist.all_gather(pieces, padded)
        return [p[:int(k)] for p, k in zip(pieces, lengths)]

    ch02.check_predict_reduce_scatter(predict_by_loops)
    ch02.check_all_gather_uneven(gather_padded_by_hand)
    assert capsys.readouterr().out.count("✅") == 2


@pytest.mark.parametrize("collective", ["all_gather_object", "gather_then_broadcast"])
def test_the_uneven_gather_refuses_object_collectives(collective):
    def gather_objects(tensor):              # the pickling route: the exercise's work done for it
        out = [None] * dist.get_world_size()
        if collective == "all_gather_object":
            from torch.distributed import all_gather_object
            all_gather_object(out, tensor)
        else:
            dist.gather_object(tensor, out if dist.get_rank() == 0 else None, dst=0)
            dist.broadcast_object_list(out, src=0)
        return out

    with pytest.raises(CheckFailed, match=r"your function used dist\.(all_gather|gather)_object, "
                                          r"which pickles each tensor"):
        ch02.check_all_gather_uneven(gather_objects)
    # and the object collectives work again afterwards, outside the check
    assert distlab.run(lambda rank, ws: _gathered_objects(ws), 2)[0] == [0, 1]


def _gathered_objects(ws):
    out = [None] * ws
    dist.all_gather_object(out, dist.get_rank())
    return out


def test_stubs_give_one_line_not_implemented():
    def stub(*args):
        raise NotImplementedError("exercise: replace this line with your code")

    for check in (ch02.check_predict_reduce_scatter, ch02.check_reduce_scatter_from_all_to_all,
                  ch02.check_all_gather_uneven, ch02.check_broadcast_with_grad):
        with pytest.raises(NotImplementedError, match="is not written yet"):
            check(stub)


# ---- exercise 2: reduce_scatter from all_to_all -------------------------------------------------

def reduce_scatter_by_list_all_to_all(x):
    # Differently written: the list form of all_to_all, then a stack and a sum.
    ws = dist.get_world_size()
    received = [torch.empty(x.numel() // ws) for _ in range(ws)]
    dist.all_to_all(received, list(x.chunk(ws)))
    return torch.stack(received).sum(0)


def reduce_scatter_by_all_gather(x):
    # Right values, wrong structure: every rank gathers every whole tensor and adds its chunk.
    ws = dist.get_world_size()
    every = [torch.empty_like(x) for _ in range(ws)]
    dist.all_gather(every, x)
    return torch.stack(every).sum(0).chunk(ws)[dist.get_rank()]


def reduce_scatter_itself(x):
    # The cheat: the collective the exercise is to build.
    out = torch.empty(x.numel() // dist.get_world_size())
    dist.reduce_scatter_single(out, x)
    return out


def reduce_scatter_by_the_ring(x):
    from distlab.collectives import ring_reduce_scatter
    return ring_reduce_scatter(x)


def reduce_scatter_keeping_the_wrong_chunk(x):
    # Wrong: all_to_all, then the sum of the received chunks... of the chunk it sent itself.
    ws = dist.get_world_size()
    received = torch.empty_like(x)
    dist.all_to_all_single(received, x)
    return x.view(ws, -1).sum(0)


def test_reduce_scatter_from_all_to_all(capsys, monkeypatch):
    monkeypatch.setattr(ch02, "WORLD_SIZES", (3,))
    ch02.check_reduce_scatter_from_all_to_all(reduce_scatter_by_list_all_to_all)
    assert "✅ reduce_scatter_by_list_all_to_all gives what reduce_scatter" in \
        capsys.readouterr().out
    with pytest.raises(CheckFailed, match=r"world_size=3: the values are right, but rank 0 called "
                                          r"all_gather; the exercise is to build reduce_scatter "
                                          r"from all_to_all and local sums only"):
        ch02.check_reduce_scatter_from_all_to_all(reduce_scatter_by_all_gather)
    with pytest.raises(CheckFailed, match=r"rank 0 called reduce_scatter itself"):
        ch02.check_reduce_scatter_from_all_to_all(reduce_scatter_itself)
    with pytest.raises(CheckFailed, match=r"course's own ring_reduce_scatter; the exercise is to "
                                          r"build reduce_scatter from all_to_all yourself"):
        ch02.check_reduce_scatter_from_all_to_all(reduce_scatter_by_the_ring)
    with pytest.raises(CheckFailed, match=r"world_size=3 and 1 element\(s\) per chunk, rank 0, "
                                          r"element \[0\]: expected "):
        ch02.check_reduce_scatter_from_all_to_all(reduce_scatter_keeping_the_wrong_chunk)


# ---- exercise 4: a broadcast that autograd sees -------------------------------------------------

class _BroadcastAllReduceBackward(torch.autograd.Function):
    # Differently written: backward all-reduces (more bytes than a reduce, the same values on
    # the source) and masks the other ranks with a multiplication.
    @staticmethod
    def forward(ctx, x, src):
        ctx.src = src
        out = torch.empty_like(x).copy_(x)
        dist.broadcast(out, src)
        return out

    @staticmethod
    def backward(ctx, g):
        g = g.clone()
        dist.all_reduce(g)
        return g * float(dist.get_rank() == ctx.src), None


def broadcast_all_reduce_backward(x, src):
    return _BroadcastAllReduceBackward.apply(x, src)


def broadcast_in_place(x, src):
    # The chapter's trap: dist.broadcast outside autograd's graph.
    y = x.detach().clone()
    dist.broadcast(y, src=src)
    return y


class _BroadcastLocalBackward(torch.autograd.Function):
    # Wrong structure: forward right, backward keeps each rank's own gradient.
    @staticmethod
    def forward(ctx, x, src):
        y = x.clone()
        dist.broadcast(y, src=src)
        return y

    @staticmethod
    def backward(ctx, g):
        return g, None


def broadcast_local_backward(x, src):
    return _BroadcastLocalBackward.apply(x, src)


def broadcast_by_torch(x, src):
    import torch.distributed.nn.functional as F
    return F.broadcast(x, src)


def test_broadcast_with_grad(capsys, monkeypatch):
    monkeypatch.setattr(ch02, "BROADCAST_CASES", ((3, 1),))
    ch02.check_broadcast_with_grad(broadcast_all_reduce_backward)
    assert "✅ broadcast_all_reduce_backward broadcasts" in capsys.readouterr().out
    with pytest.raises(CheckFailed, match=r"world_size=3, src=1: rank 0's result does not require "
                                          r"grad, so autograd cannot reach x"):
        ch02.check_broadcast_with_grad(broadcast_in_place)
    with pytest.raises(CheckFailed, match=r"world_size=3, src=1, rank 0's x.grad \(should be "
                                          r"zeros: only rank 1's x reached the result\), element "
                                          r"\[0\]: expected 0, got 1"):
        ch02.check_broadcast_with_grad(broadcast_local_backward)
    with pytest.raises(CheckFailed, match=r"course's own broadcast; the exercise is to write the "
                                          r"broadcast's backward yourself"):
        ch02.check_broadcast_with_grad(broadcast_by_torch)
