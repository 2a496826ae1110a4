"""The checkers' one traffic rule (lib/distlab/checks/_traffic.py, issue 44 item 4), proven on
real subgroups at two shapes: 4 ranks as groups (0, 1) and (2, 3); 5 ranks as groups (1, 3) and
(0, 2, 4) — a group whose ranks are not 0..k.

Every candidate sums a (weight, bias) pair over its group, as an all-reduce would. All of them
run in ONE launch per shape, each inside its own trace span and its own `Carried` recorder, and a
small judge built only from the rule's questions (on which group, how many bytes, what travelled)
gives each its verdict — the same questions the ported checkers ask:
- accepted where the bytes are equal: two all-reduces, one packed all-reduce of weight and bias
  together, a hand-written ring of send/recv with ONE packed message per hop, the same ring
  through batch_isend_irecv, torch's functional all-reduce;
- refused: the world group where the subgroup was given, an all-to-all of zeros of the right size
  beside inputs rebuilt locally, inputs rebuilt locally with no message at all, a reduce then a
  broadcast (right numbers, more bytes).
The rule also reads a run's trace in the parent: both sources must price every call the same.
"""
import math

import pytest
import torch
import torch.distributed as dist

import distlab
from distlab.checks import _traffic

LAYOUTS = ((4, ((0, 1), (2, 3))), (5, ((1, 3), (0, 2, 4))))
W, B = 10, 2    # a weight of 10 and a bias of 2 values: S = 12 float64 = 96 B (divides by 2, 3)


def _inputs(rank):
    g = torch.Generator().manual_seed(1000 + rank)
    sign = lambda n: torch.randint(0, 2, (n,), generator=g).double() * 2 - 1   # noqa: E731
    return (torch.randint(1, 10, (W,), generator=g).double() * sign(W),   # never zero: a zero
            torch.randint(1, 10, (B,), generator=g).double() * sign(B))   # bias carries nothing


def _members(group):
    return dist.get_process_group_ranks(group)


# ---- candidates: (w, b, group) -> (w_sum, b_sum) --------------------------------------------------

def two_all_reduces(w, b, group):
    dist.all_reduce(w, group=group)
    dist.all_reduce(b, group=group)
    return w, b


def packed_all_reduce(w, b, group):          # one call for weight and bias together
    flat = torch.cat([w, b])
    dist.all_reduce(flat, group=group)
    return flat[:W], flat[W:]


def _ring(flat, group, exchange):
    """Ring reduce-scatter then all-gather of `flat` over the group, ONE message per hop."""
    ranks = _members(group)
    n, me = len(ranks), ranks.index(dist.get_rank())
    right, left = ranks[(me + 1) % n], ranks[(me - 1) % n]
    chunks = list(flat.chunk(n))
    for step in range(n - 1):                                    # reduce-scatter
        out, into = (me - step) % n, (me - step - 1) % n
        got = exchange(chunks[out].clone(), right, left)
        chunks[into] = chunks[into] + got
    for step in range(n - 1):                                    # all-gather
        out, into = (me + 1 - step) % n, (me - step) % n
        chunks[into] = exchange(chunks[out].clone(), right, left)
    return torch.cat(chunks)


def _isend_irecv(send, right, left):
    got = torch.empty_like(send)
    reqs = [dist.isend(send, right), dist.irecv(got, left)]
    for r in reqs:
        r.wait()
    return got


def _batched(send, right, left):
    got = torch.empty_like(send)
    for work in dist.batch_isend_irecv([dist.P2POp(dist.isend, send, right),
                                        dist.P2POp(dist.irecv, got, left)]):
        work.wait()
    return got


def packed_ring(w, b, group):                # a hand-written ring: the all-reduce's bytes
    flat = _ring(torch.cat([w, b]), group, _isend_irecv)
    return flat[:W], flat[W:]


def batched_ring(w, b, group):
    flat = _ring(torch.cat([w, b]), group, _batched)
    return flat[:W], flat[W:]


def functional_all_reduce(w, b, group):
    import torch.distributed._functional_collectives as fc
    flat = fc.all_reduce(torch.cat([w, b]), "sum", group) + 0
    return flat[:W], flat[W:]


def world_group(w, b, group):                # the subgroup ignored: the world's sum
    flat = torch.cat([w, b])
    dist.all_reduce(flat)
    return flat[:W], flat[W:]


def zeros_beside_rebuilt(w, b, group):       # bytes of the right size, no data in them
    ranks = _members(group)
    n = len(ranks)
    fake = torch.zeros(n * math.ceil(2 * (W + B) / n), dtype=torch.float64)   # about 2 S
    dist.all_to_all_single(torch.empty_like(fake), fake, group=group)
    pairs = [_inputs(r) for r in ranks]            # the others' inputs, rebuilt locally
    return sum(p[0] for p in pairs), sum(p[1] for p in pairs)


def rebuilt_no_message(w, b, group):
    pairs = [_inputs(r) for r in _members(group)]
    return sum(p[0] for p in pairs), sum(p[1] for p in pairs)


def reduce_then_broadcast(w, b, group):      # right numbers, S more bytes than a ring
    flat = torch.cat([w, b])
    root = _members(group)[0]
    dist.reduce(flat, root, group=group)
    dist.broadcast(flat, root, group=group)
    return flat[:W], flat[W:]


def gathered_then_summed(w, b, group):     # every piece gathered, added up locally
    flat = torch.cat([w, b])
    pieces = [torch.empty_like(flat) for _ in _members(group)]
    dist.all_gather(pieces, flat, group=group)
    flat = sum(pieces)
    return flat[:W], flat[W:]


def max_beside_rebuilt(w, b, group):         # a reduction that delivers no sum
    dist.all_reduce(torch.cat([w, b]), op=dist.ReduceOp.MAX, group=group)
    return rebuilt_no_message(w, b, group)


ACCEPTED = (two_all_reduces, packed_all_reduce, packed_ring, batched_ring, functional_all_reduce)
REFUSED = (world_group, zeros_beside_rebuilt, rebuilt_no_message, reduce_then_broadcast)
# judged only by what they delivered (`_traffic.delivered`, `holds`)
DELIVERED = (gathered_then_summed, max_beside_rebuilt)


def _on_ranks(rank, world_size, layout):
    groups = [dist.new_group(list(g)) for g in layout]
    group = groups[next(i for i, g in enumerate(layout) if rank in g)]
    out = {}
    for fn in ACCEPTED + REFUSED + DELIVERED:
        w, b = _inputs(rank)
        with distlab.trace.span(fn.__name__), _traffic.Carried() as carried:
            got = fn(w.clone(), b.clone(), group)
        out[fn.__name__] = (torch.cat([t.reshape(-1) for t in got]), carried.records)
        dist.barrier()
    return out


@pytest.fixture(scope="module", params=LAYOUTS, ids=lambda p: f"{p[0]}ranks")
def run(request):
    ws, layout = request.param
    return ws, layout, distlab.run(_on_ranks, ws, layout, trace=True, timeout=60)


# ---- a judge made only of the rule's questions ------------------------------------------------------

def judge(calls, ranks, mine):
    """None (accepted) or why refused: every call on the group, the data travelled (no call of
    zeros; this rank's own input left it in some call), and the bytes of a ring all-reduce of S."""
    bad, what = _traffic.off_group(calls, ranks)
    if bad is not None:
        return f"made {what}, outside its group {list(ranks)}"
    data = _traffic.data_calls(calls)
    if any(_traffic.carried_nothing(c) for c in data):
        return "a call carried only zeros"
    if not any(_traffic.carries(c["values"], mine) or _traffic.carries(mine, c["values"])
               for c in data if c["values"] is not None):
        return "nothing of this rank's input travelled"
    S = mine.numel() * mine.element_size()
    want = _traffic.ring_share("all_reduce", S, len(ranks))
    if not math.isclose(_traffic.wire(calls), want):
        return f"sent {_traffic.wire(calls):g} B where a ring all-reduce sends {want:g} B"
    return None


def _verdicts(ws, layout, results):
    out = {}
    for fn in ACCEPTED + REFUSED:
        for rank in range(ws):
            ranks = next(g for g in layout if rank in g)
            got, calls = results[rank][fn.__name__]
            out.setdefault(fn.__name__, []).append(judge(calls, ranks, torch.cat(_inputs(rank))))
            if fn not in (world_group,):
                want = sum(torch.cat(_inputs(r)) for r in ranks)
                assert torch.equal(got, want), f"{fn.__name__} on rank {rank}: wrong values"
    return out


def test_the_rule_accepts_equal_bytes_however_sent(run):
    ws, layout, results = run
    verdicts = _verdicts(ws, layout, results)
    for fn in ACCEPTED:
        assert verdicts[fn.__name__] == [None] * ws, (fn.__name__, verdicts[fn.__name__])


def test_the_rule_refuses_wrong_group_missing_data_and_extra_bytes(run):
    ws, layout, results = run
    verdicts = _verdicts(ws, layout, results)
    for fn in REFUSED:
        assert all(v is not None for v in verdicts[fn.__name__]), fn.__name__
    assert all("outside its group" in v for v in verdicts["world_group"])
    assert all("only zeros" in v for v in verdicts["zeros_beside_rebuilt"])
    assert all("nothing of this rank's input" in v for v in verdicts["rebuilt_no_message"])
    # a reduce then a broadcast: 2 S where a ring sends 2(n-1)/n S
    assert all("ring all-reduce sends" in v for v in verdicts["reduce_then_broadcast"])


def test_the_trace_and_the_recorder_price_every_call_the_same(run):
    ws, layout, results = run
    for rank in range(ws):
        for fn in ACCEPTED + REFUSED:
            if fn is functional_all_reduce:
                continue                    # issued from C++: the trace does not see its group
            traced = _traffic.records(results.trace, rank, fn.__name__)
            carried = results[rank][fn.__name__][1]
            assert [(c["op"], c["group"], c["peer"], c["wire"]) for c in traced] == \
                [(c["op"], c["group"], c["peer"], c["wire"]) for c in carried], fn.__name__


def test_a_pair_collective_is_a_message_each_way():
    call = _traffic._record("collective", "all_reduce", (2, 5), None, 64)
    msgs = _traffic.as_messages([call], 5)
    assert [(m["kind"], m["src"], m["dst"], m["bytes"]) for m in msgs] == \
        [("send", 5, 2, 64), ("recv", 2, 5, 64)]
    wide = _traffic._record("collective", "all_reduce", (1, 3, 4), None, 64)
    assert _traffic.as_messages([wide], 3)[0]["kind"] == "collective"
    assert _traffic._record("recv", "recv", (0, 1), 1, 64)["wire"] == 0
    assert _traffic._record("send", "send", (0, 1), 1, 64)["wire"] == 64


def test_what_the_ranks_delivered_holds_the_sum_however_it_travelled(run):
    """`delivered` over a group's records (lined up across its ranks) and `holds`: the group's sum
    travelled in an all-reduce, a packed one, a send/recv ring (its chunks, cut anywhere), a
    functional all-reduce, an all-gather summed locally, a reduce then a broadcast; not in an
    all-to-all of zeros, a MAX all-reduce, no message, or the world's sum."""
    ws, layout, results = run
    for fn in ACCEPTED + REFUSED + DELIVERED:
        for ranks in layout:
            pieces = _traffic.delivered({r: results[r][fn.__name__][1] for r in ranks})
            total = sum(torch.cat(_inputs(r)) for r in ranks)
            travelled = _traffic.holds(pieces, total)
            assert travelled == (fn not in (world_group, zeros_beside_rebuilt, rebuilt_no_message,
                                            max_beside_rebuilt)), (fn.__name__, ranks)
            assert _traffic.missing(pieces, [total * 0, total[:W], total[W:]],
                                    ["zero", "w", "b"]) == (None if travelled else "w")
    assert [_traffic.ring_messages("all_reduce", n) for n in (1, 2, 3)] == [0, 2, 4]
    for rank in range(ws):          # one packed message per hop: one all-reduce's messages
        n = len(next(g for g in layout if rank in g))
        assert _traffic.messages(results[rank]["packed_ring"][1]) == \
            _traffic.messages(results[rank]["packed_all_reduce"][1]) == \
            _traffic.ring_messages("all_reduce", n)


def test_a_small_tensor_cut_into_single_values_still_travels():
    """A 4-value bias around a ring of 3 ranks arrives in chunks of 2, 1 and 1 values, too few
    neighbouring pairs: `holds` then finds most of its values times one factor. One of its values
    (a loss-sized decoy) or unrelated values do not pass; a zero tensor travels in anything."""
    bias = torch.tensor([0.3, -1.7, 2.9, 0.05], dtype=torch.float64)
    assert _traffic.holds(list((bias * 3).tensor_split(3)), bias)    # a sum of 3, in chunks
    assert not _traffic.holds([bias[2:3] * 3], bias)
    assert not _traffic.holds([torch.tensor([0.7, 1.1, -2.0], dtype=torch.float64)], bias)
    assert _traffic.holds([], bias * 0) and not _traffic.holds([], bias)
