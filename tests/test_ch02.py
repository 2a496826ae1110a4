"""Chapter 02: the collective pictures read real runs, and the checkers pass right answers and
name what is wrong in wrong ones."""
import math

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import distlab  # noqa: E402
from checker_battery import battery  # noqa: E402
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


# ---- the workbook's checkers, through the battery (tests/checker_battery.py) ---------------------

def stub(*args):
    raise NotImplementedError("exercise: replace this line with your code")


def predict_dispatch(tokens, dest):
    return [torch.cat([t[d == r] for t, d in zip(tokens, dest)]) for r in range(len(tokens))]


def predict_dispatch_by_sorting(tokens, dest):
    # Differently written: sort each sender's tokens by destination, split by counts, regroup.
    n = len(tokens)
    pieces = []
    for t, d in zip(tokens, dest):
        order = torch.argsort(d, stable=True)
        pieces.append(t[order].split(torch.bincount(d, minlength=n).tolist()))
    return [torch.cat([pieces[i][r] for i in range(n)]) for r in range(n)]


def predict_dispatch_by_destination_order(tokens, dest):
    # Receives the right tokens, but sorted by value instead of by sender, then sender order.
    n = len(tokens)
    return [torch.sort(torch.cat([t[d == r] for t, d in zip(tokens, dest)]), descending=True)
            .values for r in range(n)]


def predict_dispatch_from_the_real_run(tokens, dest):
    case = next(c for c in ch02.DISPATCH_CASES
                if c[0] == len(tokens) and list(c[1]) == [len(t) for t in tokens])
    return ch02.real_dispatch(len(tokens))[case]


def predict_dispatch_equal_chunks(tokens, dest):
    # Right when every sender holds its tokens sorted, the same number for every rank.
    n = len(tokens)
    return [torch.cat([t.chunk(n)[r] if len(t) >= n else t[:0] for t in tokens])
            for r in range(n)]


def test_predict_dispatch_battery():
    said = battery(ch02.check_predict_dispatch, correct=[predict_dispatch],
                   different=[predict_dispatch_by_sorting],
                   wrong=[predict_dispatch_by_destination_order],
                   cheat=[predict_dispatch_from_the_real_run],
                   decoy=[predict_dispatch_equal_chunks])
    assert "course's own real_dispatch" in said["cheat"][0]
    assert "(sorted)" not in said["decoy"][0]        # right on the sorted, even cases
    with pytest.raises(NotImplementedError, match="is not written yet"):
        ch02.check_predict_dispatch(stub)


def test_the_dispatch_cases_are_what_they_say():
    for case in ch02.DISPATCH_CASES:
        tokens, dest = ch02.dispatch_inputs(case)
        assert [len(t) for t in tokens] == list(case[1])
        assert all(d.numel() == 0 or int(d.max()) < case[0] for d in dest)
    received = ch02.real_dispatch(4)[(4, (6, 3, 5, 4), "skewed")]
    assert received[2].numel() == 0 and received[3].numel() > 9


def reduce_scatter_from_all_to_all(x, group):
    n = dist.get_world_size(group)
    received = torch.empty_like(x)
    dist.all_to_all_single(received, x, group=group)
    return received.view(n, -1).sum(0)


def reduce_scatter_by_messages(x, group):
    # Differently written: the all-to-all's own messages, as one batch of isend/irecv.
    ranks = dist.get_process_group_ranks(group)
    me = ranks.index(dist.get_rank())
    chunks = list(x.chunk(len(ranks)))
    inbox = [torch.empty_like(chunks[me]) for _ in ranks]
    ops = []
    for k, peer in enumerate(ranks):
        if k == me:
            inbox[k] = chunks[me].clone()
            continue
        ops += [dist.P2POp(dist.isend, chunks[k].contiguous(), peer),
                dist.P2POp(dist.irecv, inbox[k], peer)]
    for work in dist.batch_isend_irecv(ops) if ops else []:
        work.wait()
    return sum(inbox)


def reduce_scatter_forgets_the_group_size(x, group):
    received = torch.empty_like(x)
    dist.all_to_all_single(received, x, group=group)
    return received.view(dist.get_world_size(), -1).sum(0) if len(x) % dist.get_world_size() == 0 \
        else received.view(1, -1).sum(0)


def reduce_scatter_itself(x, group):
    out = torch.empty(x.numel() // dist.get_world_size(group))
    dist.reduce_scatter_single(out, x, group=group)
    return out


def reduce_scatter_everything_everywhere(x, group):
    # Right values from all_to_all alone, but every rank sends its whole x to every member.
    n = dist.get_world_size(group)
    received = torch.empty(n * x.numel())
    dist.all_to_all_single(received, x.repeat(n), group=group)
    me = dist.get_process_group_ranks(group).index(dist.get_rank())
    return received.view(n, -1).sum(0).chunk(n)[me]


def test_reduce_scatter_from_all_to_all_battery():
    said = battery(ch02.check_reduce_scatter_from_all_to_all,
                   correct=[reduce_scatter_from_all_to_all], different=[reduce_scatter_by_messages],
                   wrong=[reduce_scatter_forgets_the_group_size], cheat=[reduce_scatter_itself],
                   decoy=[reduce_scatter_everything_everywhere])
    assert "called reduce_scatter" in said["cheat"][0]
    assert "bytes on the wire" in said["decoy"][0]


def all_gather_uneven(tensor, group):
    n = dist.get_world_size(group)
    sizes = [torch.zeros(1, dtype=torch.long) for _ in range(n)]
    dist.all_gather(sizes, torch.tensor([tensor.numel()]), group=group)
    longest = max(int(s) for s in sizes)
    padded = torch.zeros(longest, dtype=tensor.dtype)
    padded[:tensor.numel()] = tensor
    out = [torch.empty_like(padded) for _ in range(n)]
    dist.all_gather(out, padded, group=group)
    return [o[:int(s)] for o, s in zip(out, sizes)]


def all_gather_uneven_by_broadcasts(tensor, group):
    # Differently written: each member broadcasts its length, then its tensor, in turn.
    out = []
    for src in dist.get_process_group_ranks(group):
        mine = src == dist.get_rank()
        n = torch.tensor([tensor.numel() if mine else 0])
        dist.broadcast(n, src=src, group=group)
        piece = tensor.clone() if mine else torch.empty(int(n), dtype=tensor.dtype)
        dist.broadcast(piece, src=src, group=group)
        out.append(piece)
    return out


def all_gather_uneven_untrimmed(tensor, group):
    return [piece for piece in _padded_pieces(tensor, group)]


def _padded_pieces(tensor, group):
    n = dist.get_world_size(group)
    sizes = [torch.zeros(1, dtype=torch.long) for _ in range(n)]
    dist.all_gather(sizes, torch.tensor([tensor.numel()]), group=group)
    padded = torch.zeros(max(int(s) for s in sizes))
    padded[:tensor.numel()] = tensor
    out = [torch.empty_like(padded) for _ in range(n)]
    dist.all_gather(out, padded, group=group)
    return out


def all_gather_uneven_objects(tensor, group):
    every = [None] * dist.get_world_size(group)
    dist.all_gather_object(every, tensor, group=group)
    return every


def all_gather_uneven_world(tensor, group):
    # Right shapes and lengths, but gathers every rank of the world and keeps the group's.
    ws = dist.get_world_size()
    sizes = [torch.zeros(1, dtype=torch.long) for _ in range(ws)]
    dist.all_gather(sizes, torch.tensor([tensor.numel()]))
    padded = torch.zeros(max(int(s) for s in sizes))
    padded[:tensor.numel()] = tensor
    out = [torch.empty_like(padded) for _ in range(ws)]
    dist.all_gather(out, padded)
    return [out[r][:int(sizes[r])] for r in dist.get_process_group_ranks(group)]


def test_all_gather_uneven_battery():
    said = battery(ch02.check_all_gather_uneven, correct=[all_gather_uneven],
                   different=[all_gather_uneven_by_broadcasts],
                   wrong=[all_gather_uneven_untrimmed], cheat=[all_gather_uneven_objects],
                   decoy=[all_gather_uneven_world])
    assert "dist.all_gather_object" in said["cheat"][0]
    assert "ran over ranks [0, 1, 2, 3]" in said["decoy"][0]


def test_a_refused_uneven_gather_is_one_sentence():
    # gloo refuses or loses the connection: either way one sentence, without the C++ file name.
    def naive(tensor, group):
        out = [torch.empty(tensor.numel()) for _ in range(dist.get_world_size(group))]
        dist.all_gather(out, tensor, group=group)
        return out
    with pytest.raises(CheckFailed, match=r"failed: .*same shapes on every rank") as e:
        ch02.check_all_gather_uneven(naive)
    assert "\n" not in str(e.value) and ".cc" not in str(e.value)


class _Broadcast(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, src, group):
        ctx.src, ctx.group = src, group
        y = x.clone()
        dist.broadcast(y, src=src, group=group)
        return y

    @staticmethod
    def backward(ctx, grad):
        s = grad.contiguous().clone()
        dist.reduce(s, dst=ctx.src, group=ctx.group)
        if dist.get_rank() != ctx.src:
            s.zero_()
        return s, None, None


def broadcast_with_grad(x, src, group):
    return _Broadcast.apply(x, src, group)


class _ByAllReduce(torch.autograd.Function):
    # Differently written: forward is an all_reduce of x (zeros off the source), backward an
    # all_reduce of the gradients kept on the source only.
    @staticmethod
    def forward(ctx, x, src, group):
        ctx.src, ctx.group = src, group
        y = x.clone() if dist.get_rank() == src else torch.zeros_like(x)
        dist.all_reduce(y, group=group)
        return y

    @staticmethod
    def backward(ctx, grad):
        s = grad.clone()
        dist.all_reduce(s, group=ctx.group)
        return (s if dist.get_rank() == ctx.src else torch.zeros_like(s)), None, None


def broadcast_by_all_reduce(x, src, group):
    return _ByAllReduce.apply(x, src, group)


class _IdentityBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, src, group):
        y = x.clone()
        dist.broadcast(y, src=src, group=group)
        return y

    @staticmethod
    def backward(ctx, grad):
        return grad, None, None


def broadcast_identity_backward(x, src, group):
    return _IdentityBackward.apply(x, src, group)


def broadcast_torchs(x, src, group):
    import torch.distributed.nn.functional as F
    return F.broadcast(x, src, group=group)


class _AllReduceBackward(torch.autograd.Function):
    # Right result and right gradient on the source; but every member keeps the summed gradient.
    @staticmethod
    def forward(ctx, x, src, group):
        ctx.group = group
        y = x.clone()
        dist.broadcast(y, src=src, group=group)
        return y

    @staticmethod
    def backward(ctx, grad):
        s = grad.clone()
        dist.all_reduce(s, group=ctx.group)
        return s, None, None


def broadcast_all_reduce_backward(x, src, group):
    return _AllReduceBackward.apply(x, src, group)


def test_broadcast_with_grad_battery():
    said = battery(ch02.check_broadcast_with_grad, correct=[broadcast_with_grad],
                   different=[broadcast_by_all_reduce], wrong=[broadcast_identity_backward],
                   cheat=[broadcast_torchs], decoy=[broadcast_all_reduce_backward])
    assert "course's own broadcast" in said["cheat"][0]
    assert "should be zeros" in said["decoy"][0]


def test_a_plain_broadcast_is_told_to_become_a_function():
    def plain(x, src, group):
        y = x.detach().clone()
        dist.broadcast(y, src=src, group=group)
        return y
    with pytest.raises(CheckFailed, match="does not require grad.*torch.autograd.Function"):
        ch02.check_broadcast_with_grad(plain)


def test_stubs_give_one_line_not_implemented():
    for check in (ch02.check_reduce_scatter_from_all_to_all, ch02.check_all_gather_uneven,
                  ch02.check_broadcast_with_grad):
        with pytest.raises(NotImplementedError, match="is not written yet"):
            check(stub)


# ---- coalescing: N collectives vs one on a packed buffer (distlab.coalescing) ------------------

_GROUPS = ([1], [1, 2], [0, 1, 2])           # 1, 2 and 3 ranks, one launch; group rank != rank
_SHARDS = [(3,), (0,), (2, 2), (1,)]         # uneven, an empty one, one with two dimensions


def _shards(rank, shapes):
    return [torch.arange(float(math.prod(s))).reshape(s) + 100 * rank for s in shapes]


def _coalesce_everywhere(rank, world_size):
    from distlab import coalescing
    out = {}
    groups = [dist.new_group(members) for members in _GROUPS]      # every rank makes every group
    for members, group in zip(_GROUPS, groups):
        if rank not in members:
            continue
        for shapes in (_SHARDS, [(0,), (0,)]):
            shards = _shards(rank, shapes)
            with distlab.trace.span(f"each {len(members)}"):
                each = coalescing.gather_each(shards, group)
            with distlab.trace.span(f"packed {len(members)}"):
                packed = coalescing.gather_packed(shards, group)
            with distlab.trace.span(f"managed {len(members)}"):
                managed = coalescing.gather_coalesced(shards, group)
            out[len(members), len(shapes)] = each, packed, managed
    # what gloo itself runs for a coalesced all-gather and all-reduce (the chapter says: one each)
    from torch.profiler import ProfilerActivity, profile
    with distlab.trace.span("profiled"), profile(activities=[ProfilerActivity.CPU]) as prof:
        coalescing.gather_coalesced(_shards(rank, _SHARDS))
        with dist._coalescing_manager():
            for t in _shards(rank, _SHARDS):
                dist.all_reduce(t)
    out["gloo"] = sorted(e.name for e in prof.events() if e.name.startswith("gloo:"))
    # the NCCL-only form fails on gloo and leaves the group coalescing: a later all_reduce is lost
    trap = dist.new_group([0, 1, 2])
    try:
        with dist._coalescing_manager(trap, device=torch.device("cpu")):
            pass
    except Exception as e:
        out["device="] = str(e).splitlines()[0]
    lost = torch.ones(1)
    dist.all_reduce(lost, group=trap)
    out["after"] = lost.item()
    dist.barrier()
    return out


@pytest.fixture(scope="module")
def coalesced():
    return distlab.run(_coalesce_everywhere, 3, trace=True, timeout=60)


def test_one_packed_all_gather_equals_one_per_tensor(coalesced):
    for members in _GROUPS:
        for shapes in (_SHARDS, [(0,), (0,)]):
            expected = [torch.cat([_shards(r, shapes)[i] for r in members])
                        for i in range(len(shapes))]
            for rank in members:
                each, packed, managed = coalesced[rank][len(members), len(shapes)]
                for way in (each, packed, managed):
                    assert [t.shape for t in way] == [t.shape for t in expected]
                    assert all(torch.equal(a, b) for a, b in zip(way, expected))


def test_the_trace_counts_n_calls_against_one(coalesced):
    trace = coalesced.trace
    for members in _GROUPS:
        for rank in members:
            calls = {}
            for e in trace.comm(rank, op="all_gather"):
                if e["group"] == tuple(members):
                    calls.setdefault(e["label"][-1].split()[0], []).append(e["bytes"])
            full = 4 * len(members) * (3 + 0 + 4 + 1)        # float32 bytes of what all hold
            assert [len(calls[w]) for w in ("each", "packed", "managed")] == [4 + 2, 1 + 1, 1 + 1]
            assert sum(calls["each"]) == sum(calls["packed"]) == sum(calls["managed"]) == full


def test_coalescing_refuses_what_it_cannot_pack():
    from distlab import coalescing
    with pytest.raises(TypeError, match="one dtype"):
        coalescing.gather_packed([torch.ones(2), torch.ones(2, dtype=torch.float64)])
    with pytest.raises(TypeError, match="non-empty list"):
        coalescing.gather_packed([])


def test_price_charges_one_latency_per_call():
    from distlab import coalescing, hardware
    sizes = list(coalescing.nbytes(coalescing.LLAMA3_8B_LAYER).values())
    assert len(sizes) == 9 and sum(sizes) == 2 * (2 * 4096 + 2 * 4096 ** 2 + 2 * 1024 * 4096
                                                  + 3 * 14336 * 4096)
    each, one = coalescing.price(sizes, 8, hardware.NVLINK4)
    per_call = hardware.NVLINK4.seconds("all_gather", 0, 8)
    assert each - one == pytest.approx(8 * per_call)


def test_what_gloo_does_with_the_coalescing_manager(coalesced):
    # torch 2.13: the chapter's claims about gloo; a change here means the chapter's prose is stale
    for rank in range(3):
        said = coalesced[rank]
        assert said["gloo"] == ["gloo:all_gather", "gloo:all_reduce"]
        assert said["device="] == "Backend gloo does not implement startCoalescing"
        assert said["after"] == 1.0          # not 3.0: the all_reduce was recorded, never issued


def test_funcol_all_gather_single_gathers_along_gather_dim():
    """Chapter 02's all_gather cell: funcol.all_gather_single(t, gather_dim, group) stacks each
    rank's (2, 1) column into a (2, world_size) matrix, column r from rank r."""
    def cols(rank, world_size):
        import torch.distributed._functional_collectives as funcol
        x = torch.tensor([10.0 * (rank + 1), 10.0 * (rank + 1) + 1]).view(2, 1)
        return funcol.all_gather_single(x, gather_dim=1, group=dist.group.WORLD).clone()
    expected = torch.tensor([[10.0, 20.0, 30.0], [11.0, 21.0, 31.0]])
    assert all(torch.equal(r, expected) for r in distlab.run(cols, 3))
