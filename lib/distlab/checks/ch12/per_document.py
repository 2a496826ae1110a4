"""Workbook 12, exercise 6: per-document zig-zag — which tokens each rank holds so that a ring
over packed documents gives every rank the same work.

The learner's placement is asked for every rank in this process, on three packings (documents
of varied lengths, one document, many short ones; ids that are not 0, 1, 2, ...) at world sizes
2, 3, 4 and 1, each document 2N·k tokens long with k ≥ 2 (a chunk of one token against itself is
one full pair, not half a causal square, and would blur the balance). The placements must cover
every position exactly once; then the course's `document_ring_attention` runs on them, one
launch per world size with every packing in it, and each rank's output is held against one
process's masked attention and its log's query-key pairs against the other ranks'. Last, each
rank's positions must be chunks r and 2N−1−r of every document: a balanced layout that maps
chunks to ranks otherwise is refused with the chunks it should hold."""
import torch

from ... import context_parallel as cp
from .. import CheckFailed, call_learner, compare, expect_arguments, forbid, passed, run
from ._common import COURSE

WORLD_SIZES = (2, 3, 4, 1)              # the world sizes where a wrong balance shows come first
# (what the packing is, document ids, each document's length in units of 2N tokens)
PACKINGS = (("documents of varied lengths", (5, 2, 9, 4), (3, 2, 5, 2)),
            ("one document", (7,), (4,)),
            ("many short documents", (3, 1, 4, 0, 8, 6), (2, 2, 2, 2, 2, 2)))
HEADS, HEAD_DIM = 2, 4


def _documents(ids, units, n):
    return torch.cat([torch.full((u * 2 * n,), d, dtype=torch.int64) for d, u in zip(ids, units)])


def _spans(documents):
    """[(first position, end position)] of every document: the runs of equal ids."""
    ids = documents.tolist()
    cuts = [i for i in range(1, len(ids)) if ids[i] != ids[i - 1]]
    return list(zip([0] + cuts, cuts + [len(ids)]))


def _expected_positions(documents, rank, n):
    """Per-document zig-zag, token by token: the chunk of its document each token falls in."""
    pos = torch.arange(len(documents))
    first = torch.ones(len(documents), dtype=torch.bool)
    first[1:] = documents[1:] != documents[:-1]
    which = torch.cumsum(first.long(), 0) - 1
    starts = pos[first]
    lengths = torch.diff(torch.cat([starts, torch.tensor([len(documents)])]))
    chunk = (pos - starts[which]) // (lengths[which] // (2 * n))
    return pos[(chunk == rank) | (chunk == 2 * n - 1 - rank)]


def _inputs(seq_len):
    g = torch.Generator().manual_seed(seq_len)
    return [torch.randn(1, HEADS, seq_len, HEAD_DIM, dtype=torch.float64, generator=g)
            for _ in range(3)]


def _reference_attention(documents):
    pos = torch.arange(len(documents))
    return cp.document_attention(*_inputs(len(documents)), pos, pos, documents, documents, True)


def _ring_rank(rank, world_size, cases):
    """Per packing: this rank's output of the course's document ring on the learner's
    placement, and the query-key pairs its kernels computed (from the ring's log)."""
    done = []
    for documents, held in cases:
        positions = held[rank]
        q, k, v = [t[:, :, positions] for t in _inputs(len(documents))]
        log = []
        out = cp.document_ring_attention(q, k, v, positions, documents[positions], causal=True,
                                         log=log)
        done.append((out, sum(s.pairs for s in log)))
    return done


def _placement(place, documents, rank, n, where):
    """The learner's positions for one rank, as int64, or one sentence on why they are not."""
    with forbid(*COURSE, cp.document_zigzag_positions,
                exercise="work out which tokens each rank holds yourself"):
        got = call_learner(place, documents.clone(), rank, n, name="per_document_zigzag")
    if not torch.is_tensor(got):
        try:
            got = torch.as_tensor(got)
        except (TypeError, ValueError, RuntimeError):
            raise CheckFailed(f"{where}: per_document_zigzag should return a 1-D tensor of "
                              f"positions; rank {rank} returned {type(got).__name__} "
                              f"{got!r:.60}.") from None
    if got.dtype.is_floating_point or got.dtype.is_complex or got.dtype == torch.bool \
            or got.dim() != 1:
        raise CheckFailed(f"{where}: per_document_zigzag should return a 1-D tensor of integer "
                          f"positions; rank {rank} returned one of shape {tuple(got.shape)} and "
                          f"dtype {got.dtype}.")
    return got.to(torch.int64)


def _cover(held, documents, where):
    """Every position held by exactly one rank, or the first one that is not, in a sentence."""
    seq_len = len(documents)
    owners = [[] for _ in range(seq_len)]
    for rank, positions in enumerate(held):
        for p in positions.tolist():
            if not 0 <= p < seq_len:
                raise CheckFailed(f"{where}: rank {rank} holds position {p}, outside the "
                                  f"sequence of {seq_len} tokens (positions 0 to {seq_len - 1}).")
            owners[p].append(rank)
    for p, ranks in enumerate(owners):
        if len(ranks) != 1:
            a, b = next(s for s in _spans(documents) if s[0] <= p < s[1])
            token = f"position {p} (token {p - a} of the document at positions {a} to {b - 1})"
            if not ranks:
                raise CheckFailed(f"{where}: no rank holds {token}; every token must be on "
                                  f"exactly one rank.")
            who = (f"twice by rank {ranks[0]}" if len(set(ranks)) == 1 else
                   f"by ranks {' and '.join(map(str, sorted(set(ranks))))}")
            raise CheckFailed(f"{where}: {token} is held {who}; every token must be on exactly "
                              f"one rank — a chunk's positions count from the start of the "
                              f"sequence, not of its document.")


def _balance(work, held, documents, n, where):
    if max(work) - min(work) <= 1e-9 * max(work):
        return
    busiest, idlest = work.index(max(work)), work.index(min(work))
    whole = all(set(h.tolist()) == set(cp.zigzag_positions(len(documents), r, n).tolist())
                for r, h in enumerate(held))
    why = ("that is zig-zag over the whole sequence, which balances a causal mask, not a "
           "document mask, where a query's work grows with its place in its own document; "
           if whole else "")
    raise CheckFailed(
        f"{where}: the ring's kernels computed {max(work):g} query-key pairs on rank {busiest} "
        f"and {min(work):g} on rank {idlest} (busiest / mean "
        f"{max(work) * n / sum(work):.2f}), and every layer waits for the busiest; {why}cut "
        f"every document into {2 * n} equal chunks and give rank r chunks r and {2 * n - 1}−r "
        f"of each.")


def _chunks(held, documents, n, where):
    for rank, positions in enumerate(held):
        got = set(positions.tolist())
        want = set(_expected_positions(documents, rank, n).tolist())
        if got == want:
            continue
        a, b = next((a, b) for a, b in _spans(documents)
                    if got & set(range(a, b)) != want & set(range(a, b)))
        c = (b - a) // (2 * n)
        mine = sorted(got & set(range(a, b)))
        raise CheckFailed(
            f"{where}: the work is balanced, but rank {rank} holds positions {mine} of the "
            f"document at positions {a} to {b - 1}; per-document zig-zag gives rank {rank} "
            f"chunks {rank} and {2 * n - 1 - rank} of {2 * n} of every document: positions "
            f"{a + rank * c} to {a + (rank + 1) * c - 1} and {b - (rank + 1) * c} to "
            f"{b - rank * c - 1} of this one.")


def check_per_document_zigzag(place):
    """place(documents, rank, world_size) -> the positions rank `rank` holds: chunks r and
    2N−1−r of every document of the packed sequence `documents` (one id per token)."""
    expect_arguments(place, 3, "per_document_zigzag(documents, rank, world_size)",
                     name="per_document_zigzag")
    for n in WORLD_SIZES:
        cases, wheres = [], []
        for name, ids, units in PACKINGS:
            documents = _documents(ids, units, n)
            lengths = [u * 2 * n for u in units]
            where = f"{name} ({', '.join(map(str, lengths))} tokens) on {n} rank" + "s" * (n > 1)
            held = [_placement(place, documents, r, n, where) for r in range(n)]
            _cover(held, documents, where)
            cases.append((documents, held))
            wheres.append(where)
        results = run(_ring_rank, n, cases, timeout=60)
        for i, ((documents, held), where) in enumerate(zip(cases, wheres)):
            expected = _reference_attention(documents)
            for rank in range(n):
                compare(results[rank][i][0], expected[:, :, held[rank]],
                        f"{where}: rank {rank}'s output of the ring on your placement", 1e-10,
                        1e-10)
            _balance([results[rank][i][1] for rank in range(n)], held, documents, n, where)
            _chunks(held, documents, n, where)
    passed("per-document zig-zag: on 1, 2, 3 and 4 ranks, with documents of varied lengths, one "
           "document and many short ones, every token is on one rank, the ring over your "
           "placement equals one process's masked attention, and every rank's kernels computed "
           "the same number of query-key pairs.")
