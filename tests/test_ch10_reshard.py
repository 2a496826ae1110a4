"""Workbook 10, exercise 5 (read_plan): the checker's battery. Plans written three ways pass; a
plan off by one row, one that splits the rows by another rule, one right only where lengths
divide, and the reads of whole pieces (or torch's own resharding) are refused in one sentence."""
import pytest

from checker_battery import battery
from distlab.checks import ch10


def read_plan(shape, saved, world_size, rank):              # as the workbook's solution
    rows = shape[0]
    per = -(-rows // world_size)
    first = min(rank * per, rows)
    end = min(first + per, rows)
    plan = []
    for f, (offset, length) in enumerate(saved):
        a, b = max(first, offset), min(end, offset + length)
        if a < b:
            plan.append((f, a - offset, b - a, a - first))
    return plan


def read_plan_row_by_row(shape, saved, world_size, rank):
    """Differently written: walk the shard's rows, find each one's file, extend the last read
    while the next row follows it in the same file."""
    import math
    rows = shape[0]
    per = math.ceil(rows / world_size)
    mine = range(rank * per, min((rank + 1) * per, rows))
    plan = []
    for at, g in enumerate(mine):
        f = next(i for i, (o, n) in enumerate(saved) if o <= g < o + n)
        last = plan[-1] if plan else None
        if last and last[0] == f and last[1] + last[2] == g - saved[f][0]:
            plan[-1] = (f, last[1], last[2] + 1, last[3])
        else:
            plan.append((f, g - saved[f][0], 1, at))
    return plan


def read_plan_by_chunk(shape, saved, world_size, rank):
    """Differently written: this rank's rows from chunk (which returns fewer parts than ranks
    when the rows run out), the files visited in row order."""
    import torch
    parts = torch.arange(shape[0]).chunk(world_size)
    if rank >= len(parts) or len(parts[rank]) == 0:
        return []
    first, end = int(parts[rank][0]), int(parts[rank][-1]) + 1
    plan = []
    for f in sorted(range(len(saved)), key=lambda i: saved[i][0]):
        offset, length = saved[f]
        lo, hi = max(first, offset), min(end, offset + length)
        if hi > lo:
            plan.append([f, lo - offset, hi - lo, lo - first])
    return plan


def read_plan_last_row_missed(shape, saved, world_size, rank):
    """Wrong: off by one, a piece's last row taken as past its end."""
    return [(f, s, c - 1, a) for f, s, c, a in read_plan(shape, saved, world_size, rank) if c > 1]


def read_plan_remainder_first(shape, saved, world_size, rank):
    """Wrong: the loading ranks split the rows as tensor_split does (the remainder to the first
    ranks), not as Shard(0) does — equal whenever the rows divide."""
    rows = shape[0]
    base, extra = divmod(rows, world_size)
    first = rank * base + min(rank, extra)
    end = first + base + (rank < extra)
    plan = []
    for f, (offset, length) in enumerate(saved):
        a, b = max(first, offset), min(end, offset + length)
        if a < b:
            plan.append((f, a - offset, b - a, a - first))
    return plan


def read_plan_whole_pieces(shape, saved, world_size, rank):
    """Cheat: read every piece the shard touches whole, and let it land where it falls."""
    rows = shape[0]
    per = -(-rows // world_size)
    first, end = min(rank * per, rows), min((rank + 1) * per, rows)
    return [(f, 0, n, o - first) for f, (o, n) in enumerate(saved) if o < end and o + n > first]


def read_plan_by_dcp(shape, saved, world_size, rank):
    """Cheat: torch's own resharding (what DCP's load planner calls) does the overlaps."""
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata
    from torch.distributed.checkpoint.resharding import _shards_get_overlap_region_wrt_saved_tensor
    rows = shape[0]
    per = -(-rows // world_size)
    first, end = min(rank * per, rows), min((rank + 1) * per, rows)
    mine = ChunkStorageMetadata(offsets=[first], sizes=[end - first])
    plan = []
    for f, (o, n) in enumerate(saved):
        if o < end and o + n > first:
            (_, start, at, count), = _shards_get_overlap_region_wrt_saved_tensor(
                ChunkStorageMetadata(offsets=[o], sizes=[n]), mine)
            plan.append((f, start, count, at))
    return plan


def read_plan_divisible(shape, saved, world_size, rank):
    """Decoy: every file taken to hold rows // len(saved) rows and every shard rows // world_size
    — the picture in chapter 10b, right wherever both divide."""
    rows = shape[0]
    piece, per = rows // len(saved), rows // world_size
    plan = []
    for g in range(rank * per, (rank + 1) * per, 1):
        f = g // piece
        plan.append((f, g - f * piece, 1, g - rank * per))
    return plan


def read_plan_files_in_row_order(shape, saved, world_size, rank):
    """Decoy: the files' offsets recomputed from their lengths, as if file f came after file f-1
    — right for every checkpoint the chunk rule wrote."""
    offsets = [sum(n for _, n in saved[:f]) for f in range(len(saved))]
    return read_plan(shape, list(zip(offsets, [n for _, n in saved])), world_size, rank)


def _said(said, kind, *words):
    for w in words:
        assert any(w in s for s in said[kind]), f"no {kind} refusal says {w!r}: {said[kind]}"


def test_battery_read_plan():
    said = battery(ch10.check_read_plan, correct=[read_plan],
                   different=[read_plan_row_by_row, read_plan_by_chunk],
                   wrong=[read_plan_last_row_missed, read_plan_remainder_first],
                   cheat=[read_plan_whole_pieces, read_plan_by_dcp],
                   decoy=[read_plan_divisible, read_plan_files_in_row_order])
    _said(said, "cheat", "not whole pieces", "course's own _shards_get_overlap_region")
    _said(said, "wrong", "never fills it", "rank 1 of 3 loading 10 rows")
    _said(said, "decoy", "10 rows", "4 files of 6, 4, 0, 1 rows")


FLAT = [c for c in ch10.RESHARD_CASES if len(c[0]) == 1]
TWO_D = [c for c in ch10.RESHARD_CASES if len(c[0]) == 2]


@pytest.mark.parametrize("cases", [FLAT, TWO_D], ids=["flat", "2-D"])
def test_battery_read_plan_on_each_shape(cases):
    """Each shape alone still tells the answers apart: uneven lengths and empty shards are in
    both, so a divisible-only plan cannot pass on either."""
    battery(ch10.check_read_plan, correct=[read_plan], different=[read_plan_row_by_row],
            wrong=[read_plan_remainder_first], cheat=[read_plan_whole_pieces],
            decoy=[read_plan_divisible], call=lambda check, fn: check(fn, cases=cases))


def test_a_stub_is_reported_as_not_written():
    def stub(*args):
        raise NotImplementedError("exercise: replace this line with your code")

    with pytest.raises(NotImplementedError, match="is not written yet"):
        ch10.check_read_plan(stub)
