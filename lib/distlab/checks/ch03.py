"""Checkers of workbook 03: a bidirectional ring all-reduce and a binomial-tree reduce, built
from messages over any process group, and a predicted α-β time.

The two algorithm checkers run the learner's function on 8 real ranks split into two process
groups that run side by side, [1, 2, 4, 6, 7] (5 ranks) and [0, 3, 5] (3 ranks): a function that
talks to the whole world, or takes its group's ranks to be 0..k, is caught. Inputs are readable
(rank r holds 100·(r+1) + 0, 1, 2, ...; sums of them are exact in any order), at several lengths
(some shorter than the group), and the answers are compared with what torch's collective gives.
Then the checker judges WHAT TRAVELLED from the run's trace (`distlab.run(..., trace=True)`),
whatever route the learner's code took, by the checkers' one traffic rule (`_traffic`, read
here as `messages`): every point-to-point message counts with its peer and bytes, and a collective over a pair of ranks counts as the messages it
stands for (send/recv of the same bytes as a collective is the same traffic); a collective of the
learner's group (or of more than two ranks) is the built-in answer, refused.

- bidirectional ring all-reduce: every message goes to a ring neighbour in the group (group rank
  ± 1), each direction carries at most a one-way ring's share of HALF the tensor, both directions
  carry something, and the rounds (the longest chain of messages, each sent after the one before
  it had arrived) are at most 2(N-1): the two rings run at the same time, not one after the other.
  Packing, splitting or skipping empty messages is fine: bytes are counted, not calls.
- binomial-tree reduce: every message stays in the group, and the rounds, counting that a rank
  receives one message at a time (its one port), are at most ceil(log2 N).

And a prediction, `check_hierarchical_estimate`: the learner's α-β formula for a hierarchical
all-reduce, compared term by term (each α and each bandwidth isolated) with the closed form that
the emulator's own `comm_seconds` gives on α-β links built here, then with the algorithm run on
ranks emulated on those links (the run's virtual clocks); it lives in `ch03_estimate`.

The course's own implementations (`distlab.collectives`) and this module's references refuse to
run inside the learner's function (`distlab.checks.forbid`). A deadlock is reported within
TIMEOUT seconds with where each rank waits.
"""
import math

import torch

from . import CheckFailed, _traffic, compare, forbid, passed, run, run_learner, sizes_phrase
from .. import collectives as _collectives
from .. import trace as _trace

WORLD = 8
GROUPS = ([1, 2, 4, 6, 7], [0, 3, 5])      # side by side; neither is 0..k; sizes 5 and 3
LENGTHS = (1, 4, 7, 13, 30)
TIMEOUT = 20       # a learner's deadlock is reported, with where each rank waits, within this
P2P = _traffic.P2P

RING_DEADLOCK = ("In a ring step every rank sends and receives: post every message of the step "
                 "(both directions) before waiting on any, e.g. with dist.batch_isend_irecv; if "
                 "every rank first waits to receive, nobody ever sends.")
TREE_DEADLOCK = ("Every recv needs a matching send in the same round: count ranks from the "
                 "destination (v = (group rank - dst) % N); in round k (mask = 2^k) a rank with "
                 "v % (2·mask) == mask sends to v - mask and the rank v - mask receives from it; "
                 "a rank that has sent is done.")


def _data(rank, length):
    """Readable inputs: rank r holds 100·(r+1) + 0, 1, 2, ... (so sums are easy to check)."""
    return torch.arange(length, dtype=torch.float32) + 100.0 * (rank + 1)


def _group_of(rank):
    return next(g for g in GROUPS if rank in g)


def _course_code():
    """The course's implementations and this module's references: refused in the learner's run."""
    names = ("ring_all_reduce", "ring_reduce_scatter", "ring_all_gather", "tree_broadcast",
             "naive_all_reduce", "all_to_all", "_exchange", "_ring_reduce_scatter_",
             "_ring_all_gather_")
    found = [getattr(_collectives, n) for n in names if callable(getattr(_collectives, n, None))]
    return found + [_reference_sum]


def _reference_sum(group, length):
    """What dist.all_reduce / dist.reduce give over `group` on these inputs (exact)."""
    return sum(_data(r, length) for r in group)


def _tree_cases(size):
    return [(dst, n) for dst in sorted({0, size - 1, size // 2}) for n in (1, 5, 12)]


# ---- what runs on the ranks ----------------------------------------------------------------------

def _on_ranks(rank, world_size, fn, kind):
    """Both groups built on every rank (in the same order), then the learner's function called on
    this rank's group, each case inside a trace span named 'case i'."""
    import torch.distributed as dist
    groups = [dist.new_group(g) for g in GROUPS]
    members = _group_of(rank)
    group = groups[GROUPS.index(members)]
    if kind == "ring":
        cases = [(_data(rank, n),) for n in LENGTHS]
        exercise = "write the bidirectional ring from send/recv yourself"
    else:
        cases = [(_data(rank, n), dst) for dst, n in _tree_cases(len(members))]
        exercise = "write the tree reduce from send/recv yourself"
    out = []
    with forbid(*_course_code(), exercise=exercise):
        for i, args in enumerate(cases):
            with _trace.span(f"case {i}"):
                got = fn(*args, group)
            out.append(got.detach().clone() if isinstance(got, torch.Tensor) else got)
    dist.barrier()         # no rank leaves while a peer of the other group still talks to it
    return out


def _ready(rank, world_size):
    return rank


def _run(fn, kind, name, deadlock_rule):
    run(_ready, WORLD, timeout=60)        # a warm launcher: TIMEOUT is for the learner's code
    return run_learner(_on_ranks, WORLD, fn, kind, name=name, timeout=TIMEOUT, trace=True,
                       deadlock_rule=deadlock_rule)


# ---- the traffic rule: what travelled, as messages -------------------------------------------------

# The checkers' one traffic rule (`_traffic`): a collective over two ranks IS a message (or two),
# counted as the point-to-point traffic it stands for, so a learner may use either; a rooted one
# (broadcast, reduce) does not say its root in the trace: it counts both ways.
ring_share = _traffic.ring_share


def messages(trace, rank, case):
    """[dict(src, dst, bytes, launch, end, kind)] of what `rank` sent and received in `case`, by
    one rule for messages and collectives; a data collective that is not between two ranks is
    returned as dict(kind='collective', op, group) for the caller to judge."""
    return _traffic.as_messages(_traffic.records(trace, rank, f"case {case}"), rank)


def _no_collective(trace, ranks, case, name, what):
    for rank in ranks:
        for m in messages(trace, rank, case):
            if m["kind"] == "collective":
                how = "from C++" if m["native"] else "through dist or a process group"
                raise CheckFailed(
                    f"{name}: rank {rank} called the built-in collective {m['op']} over ranks "
                    f"{m['group']} ({how}, as the run's trace shows); the exercise is to build "
                    f"{what} from messages (send/recv, isend/irecv, batch_isend_irecv).")


def rounds(trace, ranks, case, one_port=False):
    """The longest chain of messages among `ranks` in `case`, each sent after the one before it
    had arrived at its sender (a receive whose wait returned before the send was issued); with
    `one_port`, a rank also receives one message at a time (its receives in the order it posted
    them). Returns (length, [(src, dst), ...])."""
    sent, got = {}, {}
    for r in ranks:
        for m in messages(trace, r, case):
            if m["kind"] in P2P:
                book = sent if m["kind"] == "send" else got
                book.setdefault((m["src"], m["dst"], m["tag"]), []).append(m)
    pair = {}
    for key, recvs in got.items():
        for recv, send in zip(recvs, sent.get(key, [])):
            pair[id(recv)] = send
    received = {r: [m for key in got if key[1] == r for m in got[key]] for r in ranks}
    for r in received:
        received[r].sort(key=lambda m: (m["launch"], m["seq"]))
    memo = {}

    def depth(send):                      # (length, chain) of the longest chain ending in send
        if id(send) in memo:
            return memo[id(send)]
        memo[id(send)] = (1, [(send["src"], send["dst"])])      # guards a cycle in bad data
        best = (0, [])
        for recv in received.get(send["src"], ()):
            if recv["end"] is not None and recv["end"] <= send["launch"] and id(recv) in pair:
                best = max(best, depth(pair[id(recv)]), key=lambda d: d[0])
        if one_port:
            into = received.get(send["dst"], [])
            mine = next((i for i, m in enumerate(into) if pair.get(id(m)) is send), None)
            if mine:
                before = into[mine - 1]
                if id(before) in pair:
                    best = max(best, depth(pair[id(before)]), key=lambda d: d[0])
        memo[id(send)] = (best[0] + 1, best[1] + [(send["src"], send["dst"])])
        return memo[id(send)]

    found = [depth(m) for sends in sent.values() for m in sends]
    return max(found, key=lambda d: d[0], default=(0, []))


def _size(nbytes):
    return f"{nbytes} B ({nbytes // 4} float32 element{'s' if nbytes != 4 else ''})"


def _values_of(got, rank, i, name, context, expected):
    value = got[rank][i]
    if not isinstance(value, torch.Tensor):
        raise CheckFailed(f"{name} should return the tensor; on rank {rank} it returned "
                          f"{type(value).__name__} ({context}).")
    compare(value.reshape(-1), expected, f"{name}, {context}: on rank {rank}", atol=1e-4,
            rtol=1e-6)


# ---- exercise 1: the bidirectional ring all-reduce -------------------------------------------------

def check_bidirectional_all_reduce(bidirectional_all_reduce):
    """`bidirectional_all_reduce(tensor, group)` returns the sum over `group`'s ranks of a 1-D
    tensor, half of it carried round the group's ring one way and half the other way, at once."""
    name = getattr(bidirectional_all_reduce, "__name__", "bidirectional_all_reduce")
    got = _run(bidirectional_all_reduce, "ring", name, RING_DEADLOCK)
    trace = got.trace
    for members in GROUPS:
        n = len(members)
        for case, length in enumerate(LENGTHS):
            context = f"group {members}, length {length}"
            _no_collective(trace, members, case, f"{name} ({context})",
                           "the bidirectional ring")
            for r in members:
                _values_of(got, r, case, name, context, _reference_sum(members, length))
            half = math.ceil(length / 2)
            most = 2 * (n - 1) * math.ceil(half / n) * 4       # one way round, half the tensor
            for g, r in enumerate(members):
                right, left = members[(g + 1) % n], members[(g - 1) % n]
                out = [m for m in messages(trace, r, case) if m["kind"] == "send"]
                for m in out:
                    if m["dst"] not in (left, right):
                        raise CheckFailed(
                            f"{name} ({context}): rank {r} sent {_size(m['bytes'])} to rank "
                            f"{m['dst']}; in a ring over the group {members}, rank {r} sends "
                            f"only to its neighbours in the group, ranks {left} and {right}.")
                each = {d: sum(m["bytes"] for m in out if m["dst"] == d) for d in {left, right}}
                for d, way in ((right, "right"), (left, "left")):
                    cap = most * (2 if left == right else 1)
                    if each[d] > cap:
                        raise CheckFailed(
                            f"{name} ({context}): rank {r} sent {each[d]} B to rank {d} (its "
                            f"{way} neighbour); each direction carries only half the tensor round "
                            f"its ring, at most 2(N-1)·ceil({half}/{n}) = {cap // 4} elements "
                            f"({cap} B) here: send one half right and the other half left.")
                if length >= 2 * n and left != right and not (each[left] and each[right]):
                    idle = left if not each[left] else right
                    raise CheckFailed(
                        f"{name} ({context}): rank {r} sent nothing to rank {idle}; a "
                        f"bidirectional ring uses both neighbours: one half of the tensor goes "
                        f"round to the right, the other half round to the left.")
            steps, chain = rounds(trace, members, case)
            if length >= 2 * n and steps > 2 * (n - 1):
                path = ", ".join(f"{a}→{b}" for a, b in chain)
                raise CheckFailed(
                    f"{name} ({context}): the messages took {steps} rounds (the longest chain, "
                    f"each sent after the one before it arrived: {path}); the two rings run at "
                    f"the same time, 2(N-1) = {2 * (n - 1)} rounds: post a step's messages in "
                    f"both directions before waiting on any of them.")
    sizes = " and ".join(str(len(g)) for g in GROUPS)
    passed(f"{name} sums over the group on every rank (groups {' and '.join(map(str, GROUPS))} "
           f"side by side, lengths {sizes_phrase(LENGTHS)}), and the trace shows two rings at "
           f"once: messages only to group neighbours, at most half the tensor's ring share each "
           f"way, 2(N-1) rounds at N = {sizes}.")


# ---- exercise 2: the binomial-tree reduce ----------------------------------------------------------

def check_tree_reduce(tree_reduce):
    """`tree_reduce(tensor, dst, group)` returns, on the group's rank `dst` (a group rank), the sum
    over the group's ranks, in ceil(log2 N) rounds."""
    name = getattr(tree_reduce, "__name__", "tree_reduce")
    got = _run(tree_reduce, "tree", name, TREE_DEADLOCK)
    trace = got.trace
    for members in GROUPS:
        n = len(members)
        allowed = math.ceil(math.log2(n))
        for case, (dst, length) in enumerate(_tree_cases(n)):
            context = f"group {members}, dst={dst} (rank {members[dst]}), length {length}"
            _no_collective(trace, members, case, f"{name} ({context})", "the tree reduce")
            _values_of(got, members[dst], case, name, context, _reference_sum(members, length))
            for r in members:
                for m in messages(trace, r, case):
                    if m["kind"] == "send" and m["dst"] not in members:
                        raise CheckFailed(
                            f"{name} ({context}): rank {r} sent {_size(m['bytes'])} to rank "
                            f"{m['dst']}, outside its group {members}; a reduce over a group "
                            f"talks only to the group's ranks (dist.get_global_rank(group, i) "
                            f"turns a group rank into the rank to send to).")
            steps, chain = rounds(trace, members, case, one_port=True)
            if steps > allowed:
                path = ", ".join(f"{a}→{b}" for a, b in chain)
                raise CheckFailed(
                    f"{name} ({context}): the sum took {steps} rounds (the longest chain of "
                    f"messages, each waiting for the one before, a rank receiving one at a "
                    f"time: {path}); a binomial tree needs only ceil(log2 {n}) = {allowed}: in "
                    f"every round, half the ranks still holding a partial sum send it to the "
                    f"other half.")
    passed(f"{name} gives the group's sum on dst (groups {' and '.join(map(str, GROUPS))} side "
           f"by side, several dst and lengths), and the trace shows a tree: messages inside the "
           f"group, ceil(log2 N) rounds, a rank receiving one message at a time.")


# The prediction exercise lives in its own module (this one stays one sitting long).
from .ch03_estimate import (ESTIMATE_CASES, RUN_CASES,  # noqa: E402,F401
                            _hierarchical_reference, check_hierarchical_estimate)

