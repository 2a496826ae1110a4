"""Our collectives, built from send/recv, equal torch.distributed's own on real ranks.

Every rank computes both ours and torch's on the same inputs and returns both; the parent
compares. World sizes 1 to 6, lengths 1, 7, 64, 1000 (1 and 7 are shorter than or not divisible
by most world sizes, so chunks are uneven or empty), sum and mean (and max/min for the ring).
"""
import pytest
import torch
import torch.distributed as dist

import distlab
from distlab import collectives as C

WORLD_SIZES = [1, 2, 3, 4, 5, 6]
LENGTHS = [1, 7, 64, 1000]
TORCH_OP = {"sum": dist.ReduceOp.SUM, "mean": dist.ReduceOp.AVG,
            "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}
# float32 tolerances of torch.testing: the ring adds in a different order than gloo does.
TOL = dict(rtol=1.3e-6, atol=1e-5)


def data(rank, length, integers=False, dtype=torch.float32):
    g = torch.Generator().manual_seed(7919 * rank + length)
    if integers:  # sums of small whole numbers are exact in any order: equality, not closeness
        return torch.randint(-50, 50, (length,), generator=g).to(dtype)
    return torch.randn(length, generator=g, dtype=dtype)


def assert_pairs_equal(results, exact=False):
    for rank, pairs in enumerate(results):
        for case, ours, theirs in pairs:
            if exact:
                assert torch.equal(ours, theirs), f"rank {rank}, {case}: {ours} != {theirs}"
            else:
                torch.testing.assert_close(ours, theirs, **TOL, msg=lambda m: f"rank {rank}, {case}: {m}")


# ---- all-reduce ---------------------------------------------------------------------------------

def all_reduce_pairs(rank, world_size, ops, integers):
    pairs = []
    for n in LENGTHS:
        for op in ops:
            x = data(rank, n, integers)
            ours, theirs = x.clone(), x.clone()
            returned = C.ring_all_reduce(ours, op)
            assert returned is ours  # in place, like dist.all_reduce
            dist.all_reduce(theirs, op=TORCH_OP[op])
            pairs.append(((n, op), ours, theirs))
    return pairs


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_ring_all_reduce_matches_torch(world_size):
    assert_pairs_equal(distlab.run(all_reduce_pairs, world_size, ["sum", "mean", "max", "min"], False))


@pytest.mark.parametrize("world_size", [3, 5])
def test_ring_all_reduce_sum_is_exact_on_whole_numbers(world_size):
    assert_pairs_equal(distlab.run(all_reduce_pairs, world_size, ["sum", "max"], True), exact=True)


def all_reduce_shapes(rank, world_size):
    pairs = []
    base = data(rank, 60).reshape(3, 4, 5)
    for case, x in [("3-d", base.clone()), ("transposed", base.clone().transpose(0, 2)),
                    ("scalar", torch.tensor(float(rank + 1))), ("empty", torch.zeros(0)),
                    ("int64", torch.arange(11) * (rank + 1)),
                    ("float64", data(rank, 9, dtype=torch.float64))]:
        ours, theirs = x, x.clone()
        C.ring_all_reduce(ours, dist.ReduceOp.SUM)
        dist.all_reduce(theirs)
        pairs.append((case, ours.clone(), theirs))
        assert ours.shape == theirs.shape
    return pairs


@pytest.mark.parametrize("world_size", [2, 3])
def test_ring_all_reduce_any_shape_layout_and_dtype(world_size):
    assert_pairs_equal(distlab.run(all_reduce_shapes, world_size))


def naive_pairs(rank, world_size):
    pairs = []
    for n in LENGTHS:
        for op in ("sum", "mean"):
            x = data(rank, n)
            ours, theirs = C.naive_all_reduce(x.clone(), op), x.clone()
            dist.all_reduce(theirs, op=TORCH_OP[op])
            pairs.append(((n, op), ours, theirs))
    return pairs


@pytest.mark.parametrize("world_size", [1, 3, 4, 6])
def test_naive_all_reduce_matches_torch(world_size):
    assert_pairs_equal(distlab.run(naive_pairs, world_size))


# ---- reduce-scatter and all-gather -------------------------------------------------------------

def reduce_scatter_pairs(rank, world_size):
    pairs = []
    for n in LENGTHS:
        for op in ("sum", "mean"):
            x = data(rank, n)
            kept = x.clone()
            ours = C.ring_reduce_scatter(x, op)
            assert torch.equal(x, kept)  # the input is not consumed, as in dist.reduce_scatter
            chunks = [c.clone() for c in torch.tensor_split(x, world_size)]
            theirs = torch.empty_like(chunks[rank])
            dist.reduce_scatter(theirs, chunks, op=TORCH_OP[op])
            pairs.append(((n, op), ours, theirs))
    return pairs


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_ring_reduce_scatter_matches_torch(world_size):
    assert_pairs_equal(distlab.run(reduce_scatter_pairs, world_size))


def all_gather_pairs(rank, world_size):
    pairs = []
    for n in LENGTHS:
        x = data(rank, n)
        ours = C.ring_all_gather(x)
        theirs = [torch.empty_like(x) for _ in range(world_size)]
        dist.all_gather(theirs, x)
        pairs += [((n, f"from rank {i}"), o, t) for i, (o, t) in enumerate(zip(ours, theirs))]
        assert len(ours) == world_size
    x = data(rank, 6).reshape(2, 3)
    theirs = [torch.empty_like(x) for _ in range(world_size)]
    dist.all_gather(theirs, x)
    pairs += [(("2x3", i), o, t) for i, (o, t) in enumerate(zip(C.ring_all_gather(x), theirs))]
    return pairs


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_ring_all_gather_matches_torch(world_size):
    assert_pairs_equal(distlab.run(all_gather_pairs, world_size), exact=True)


# ---- broadcast and all-to-all ----------------------------------------------------------------

def broadcast_pairs(rank, world_size):
    pairs = []
    for src in range(world_size):
        for n in LENGTHS:
            x = data(rank, n)
            ours, theirs = x.clone(), x.clone()
            assert C.tree_broadcast(ours, src) is ours
            dist.broadcast(theirs, src)
            pairs.append(((n, f"src {src}"), ours, theirs))
    x = data(rank, 12).reshape(3, 4).t()  # not contiguous
    theirs = x.clone()
    C.tree_broadcast(x, world_size - 1)
    dist.broadcast(theirs, world_size - 1)
    pairs.append(("transposed", x, theirs))
    return pairs


@pytest.mark.parametrize("world_size", WORLD_SIZES + [8])
def test_tree_broadcast_matches_torch(world_size):
    assert_pairs_equal(distlab.run(broadcast_pairs, world_size), exact=True)


def split_sizes(world_size, n):
    """How many elements rank i sends to rank j: uneven, and zero for some pairs."""
    return [[(n + 3 * i + 5 * j) % (n + 2) for j in range(world_size)] for i in range(world_size)]


def all_to_all_pairs(rank, world_size):
    pairs = []
    for n in LENGTHS:
        sizes = split_sizes(world_size, n)
        send = [sizes[rank][j] for j in range(world_size)]
        recv = [sizes[i][rank] for i in range(world_size)]
        x = data(rank, sum(send))
        ours = C.all_to_all([torch.empty(k) for k in recv], list(torch.split(x, send)))
        theirs = torch.empty(sum(recv))
        dist.all_to_all_single(theirs, x, output_split_sizes=recv, input_split_sizes=send)
        pairs.append(((n, "uneven"), torch.cat(ours), theirs))
        # The equal-size form of dist.all_to_all, with 2-D pieces.
        ins = [data(rank * world_size + j, 6).reshape(2, 3) for j in range(world_size)]
        theirs = [torch.empty(2, 3) for _ in range(world_size)]
        dist.all_to_all(theirs, [t.clone() for t in ins])
        ours = C.all_to_all([torch.empty(2, 3) for _ in range(world_size)], ins)
        pairs += [((n, f"2x3 from {i}"), o, t) for i, (o, t) in enumerate(zip(ours, theirs))]
    return pairs


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_all_to_all_matches_torch(world_size):
    assert_pairs_equal(distlab.run(all_to_all_pairs, world_size), exact=True)


# ---- any layout: strided views, scalars, empty tensors -------------------------------------------

def layouts(rank):
    """{case: a fresh tensor in that layout}: the same numbers on every call for a given rank.

    Factories, because a clone of a strided view is contiguous: each collective must get the
    view itself. Every rank can build every other rank's inputs, so the expected results are
    computed locally, without any collective.
    """
    return {
        "3-d": lambda: data(rank, 60).reshape(3, 4, 5),
        "transposed": lambda: data(rank, 60).reshape(3, 4, 5).transpose(0, 2),
        "matrix column": lambda: data(rank, 21).reshape(7, 3)[:, 1],
        "every other element": lambda: data(rank, 15)[::2],
        "scalar": lambda: torch.tensor(float(rank + 1)),
        "empty": lambda: torch.zeros(0),
        "empty 2-d": lambda: torch.zeros(3, 0),
    }


def odd_layout_pairs(rank, world_size):
    pairs, root = [], world_size - 1
    everyone = [layouts(r) for r in range(world_size)]
    for case, make in layouts(rank).items():
        inputs = [lay[case]() for lay in everyone]
        total = torch.stack(inputs).sum(0) if inputs[0].numel() else inputs[0].clone()
        for name, run, expected in [
                ("ring_all_reduce", lambda t: C.ring_all_reduce(t), total),
                ("ring_all_reduce max", lambda t: C.ring_all_reduce(t, "max"),
                 torch.stack(inputs).amax(0) if total.numel() else total),
                ("naive_all_reduce", lambda t: C.naive_all_reduce(t, "mean", root=root),
                 total / world_size),
                ("tree_broadcast", lambda t: C.tree_broadcast(t, root), inputs[root])]:
            x = make()
            if case == "matrix column":      # the view's neighbours in memory stay untouched
                parent = x._base.view(7, 3)
                others = parent[:, [0, 2]].clone()
            assert run(x) is x, f"{name} on {case}: the result must be the input, in place"
            pairs.append(((case, name), x.clone(), expected.contiguous()))
            if case == "matrix column":
                pairs.append(((case, name, "other columns"), parent[:, [0, 2]], others))
        x = make()
        scattered = C.ring_reduce_scatter(x)
        pairs.append(((case, "ring_reduce_scatter"), scattered,
                      total.reshape(-1).tensor_split(world_size)[rank]))
        pairs.append(((case, "reduce_scatter keeps its input"), x, make()))
        gathered = C.ring_all_gather(make())
        pairs += [((case, "ring_all_gather", i), g, e) for i, (g, e) in enumerate(zip(gathered, inputs))]
        # all_to_all: piece j of rank i is rank i's tensor plus j (add_ keeps the layout).
        outs = [make() for _ in range(world_size)]
        C.all_to_all(outs, [make().add_(j) for j in range(world_size)])
        pairs += [((case, "all_to_all from", i), o, everyone[i][case]() + rank)
                  for i, o in enumerate(outs)]
    return pairs


@pytest.mark.parametrize("world_size", [1, 3, 5])
def test_every_collective_takes_any_layout(world_size):
    assert_pairs_equal(distlab.run(odd_layout_pairs, world_size))


# ---- groups, and refusing what cannot work ------------------------------------------------------

def subgroup_pairs(rank, world_size):
    members = [1, 3, 4]           # an odd group whose ranks are not 0..N-1 of the world
    group = dist.new_group(members)
    if rank not in members:
        return []
    pairs = []
    for n in LENGTHS:
        x = data(rank, n)
        theirs = x.clone()
        dist.all_reduce(theirs, group=group)
        pairs.append(((n, "all_reduce"), C.ring_all_reduce(x.clone(), group=group), theirs))
        theirs = x.clone()
        dist.broadcast(theirs, group_src=2, group=group)
        pairs.append(((n, "broadcast"), C.tree_broadcast(x.clone(), 2, group=group), theirs))
        theirs = [torch.empty_like(x) for _ in members]
        dist.all_gather(theirs, x, group=group)
        pairs.append(((n, "all_gather"), torch.stack(C.ring_all_gather(x, group=group)),
                      torch.stack(theirs)))
        chunks = [c.clone() for c in torch.tensor_split(x, len(members))]
        theirs = torch.empty_like(chunks[dist.get_rank(group)])
        dist.reduce_scatter(theirs, chunks, group=group)
        pairs.append(((n, "reduce_scatter"), C.ring_reduce_scatter(x, group=group), theirs))
    return pairs


def test_collectives_speak_in_ranks_of_the_group_they_are_given():
    results = distlab.run(subgroup_pairs, 5)
    assert [len(r) > 0 for r in results] == [False, True, False, True, True]
    assert_pairs_equal(results)


def bad_calls(rank, world_size):
    import numpy as np
    messages = []
    for call in (lambda: C.ring_all_reduce(torch.arange(4), "mean"),
                 lambda: C.ring_all_reduce(torch.ones(4), "median"),
                 lambda: C.tree_broadcast(torch.ones(4), src=world_size),
                 lambda: C.all_to_all([torch.ones(1)], [torch.ones(1)] * world_size),
                 # A root outside the group: torch's send to it kills the process (SIGSEGV).
                 lambda: C.naive_all_reduce(torch.ones(4), root=5),
                 lambda: C.naive_all_reduce(torch.ones(4), root=-1),
                 lambda: C.naive_all_reduce(torch.ones(4), root=1.0),
                 lambda: C.tree_broadcast(torch.ones(4), src="0"),
                 lambda: C.tree_broadcast(torch.ones(4), src=True)):
        try:
            call()
            messages.append(None)
        except (TypeError, ValueError) as e:
            messages.append(str(e))
    # A numpy integer is a rank like any other.
    messages.append(C.naive_all_reduce(torch.ones(2), root=np.int64(world_size - 1)).tolist())
    return messages


def test_bad_calls_get_one_sentence_before_any_message_is_sent():
    messages = distlab.run(bad_calls, 3)[0]
    assert "floating-point" in messages[0]
    assert "median" in messages[1]
    assert messages[2] == "src must be a rank of the group, 0 to 2; got 3."
    assert "one input and one output tensor per rank" in messages[3]
    assert messages[4:9] == [
        "root must be a rank of the group, 0 to 2; got 5.",
        "root must be a rank of the group, 0 to 2; got -1.",
        "root must be a rank of the group, 0 to 2; got 1.0.",
        "src must be a rank of the group, 0 to 2; got '0'.",
        "src must be a rank of the group, 0 to 2; got True."]
    assert messages[9] == [3.0, 3.0]


# ---- the schedule the picture shows is the one the code runs ----------------------------------

@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 8])
def test_ring_schedule_sends_each_chunk_once_per_step_and_ends_complete(n):
    from distlab.viz.ring import ring_states
    frames = ring_states(n)
    assert len(frames) == 1 + 2 * (n - 1)
    for _, _, moves in frames[1:]:
        assert sorted(c for _, _, c in moves) == list(range(n))  # every link busy, no chunk twice
        assert all(dst == (src + 1) % n for src, dst, _ in moves)
    after_rs = frames[n - 1][1]
    for r in range(n):  # after reduce-scatter, rank r owns the complete chunk r
        assert after_rs[r][r] == set(range(n))
    assert all(s == set(range(n)) for row in frames[-1][1] for s in row)


@pytest.mark.parametrize("n", [1, 2, 3, 5, 6, 8, 13])
def test_tree_reaches_every_rank_once_in_ceil_log2_rounds(n):
    import math
    from distlab.viz.ring import tree_rounds
    for src in {0, n - 1, n // 2}:
        rounds = tree_rounds(n, src)
        assert len(rounds) == (math.ceil(math.log2(n)) if n > 1 else 0)
        have = {src}
        for pairs in rounds:
            assert all(s in have and d not in have for s, d in pairs)
            have |= {d for _, d in pairs}
        assert have == set(range(n))


@pytest.mark.parametrize("length, n", [(0, 3), (1, 5), (7, 3), (1000, 7), (64, 4)])
def test_chunk_bounds_cut_like_tensor_split(length, n):
    x = torch.arange(length)
    assert [x[a:b].tolist() for a, b in C.chunk_bounds(length, n)] == \
        [c.tolist() for c in torch.tensor_split(x, n)]
