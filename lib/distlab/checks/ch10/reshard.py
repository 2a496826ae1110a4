"""Workbook 10, exercise 5: the read plan of one loading rank, for a tensor saved at another world
size (chapter 10b's resharding, which DCP's load planner does for every rank).

Judged in this process, no ranks: the learner's plan is carried out against the saved files, and
the shard it builds is compared, row by row, with the rows the rank holds; the bytes it reads are
counted against the shard's own, so reading whole pieces and slicing afterwards is refused.
"""
import operator
import sys

import torch

from .. import CheckFailed, call_learner, passed
from ..ch01 import refusing


def _expected_pieces(rows, n):
    """[(offset, length)] of n ranks splitting `rows` as DTensor's Shard(0) does."""
    sizes = [len(part) for part in torch.arange(rows).chunk(n)] if rows else []
    sizes += [0] * (n - len(sizes))             # chunk returns fewer parts than asked for
    starts = [sum(sizes[:i]) for i in range(n)]
    return list(zip(starts, sizes))


def _expected_rows(rows, world_size, rank):
    """(first, end) of the rows `rank` holds among `world_size` loading ranks."""
    first, length = _expected_pieces(rows, world_size)[rank]
    return first, first + length


# (global shape, the saving run's pieces: a number of chunk-rule ranks or a list of (offset,
# length), the loading world size). Divisible both ways; lengths that divide neither; the same
# world size with an empty last shard (9 rows over 4 ranks: 3, 3, 3, 0); more ranks than rows on
# either side; one loading rank; pieces another sharding wrote, out of row order, one empty.
RESHARD_CASES = [
    ((8,), 2, 4), ((8, 3), 4, 2), ((10,), 4, 3), ((10, 3), 3, 4), ((9, 2), 4, 4),
    ((5,), 2, 4), ((3, 4), 5, 2), ((7,), 3, 7), ((6, 2), 6, 1), ((1,), 1, 3),
    ((11, 2), [(5, 6), (0, 4), (4, 0), (4, 1)], 3),
]


def _tensor(shape):
    """Row g holds g·100 + its column: which row landed where is read off the values."""
    cols = 1
    for d in shape[1:]:
        cols *= d
    dtype = torch.float64 if len(shape) == 1 else torch.float32
    values = torch.arange(shape[0], dtype=dtype)[:, None] * 100 + torch.arange(cols, dtype=dtype)
    return values.reshape(shape)


def _dcp_helpers():
    """torch's own resharding, where the learner's code has imported it (importing it here would
    cost every check a second)."""
    found = []
    for module, names in (("torch.distributed.checkpoint.resharding",
                           ("_shards_get_overlap_region_wrt_saved_tensor",
                            "_check_shard_metadata_pair_overlap")),
                          ("torch.distributed.checkpoint.planner_helpers",
                           ("create_read_items_for_chunk_list", "_create_read_items"))):
        loaded = sys.modules.get(module)
        found += [getattr(loaded, n) for n in names if loaded is not None and hasattr(loaded, n)]
    return found


def _whole(v):
    """v as an int where it is a whole number (a numpy or 0-d torch integer too), else None."""
    if isinstance(v, bool) or getattr(v, "is_floating_point", lambda: False)():
        return None
    try:
        return operator.index(v)
    except TypeError:
        return None


def _rows(first, end):
    return f"rows {first}-{end - 1}" if end > first else "no rows"


def _one_rank(fn, shape, saved, world_size, rank, files, row_bytes):
    rows = shape[0]
    first, end = _expected_rows(rows, world_size, rank)
    lengths = ", ".join(str(n) for _, n in saved)
    where = (f"rank {rank} of {world_size} loading {rows} rows (shape {tuple(shape)}) from "
             f"{len(saved)} files of {lengths} rows holds {_rows(first, end)}")
    call = f"read_plan({tuple(shape)}, {saved}, {world_size}, {rank})"
    with refusing(*_dcp_helpers(), exercise="find the overlaps yourself"):
        try:
            plan = call_learner(fn, tuple(shape), list(saved), world_size, rank, name="read_plan")
        except (CheckFailed, NotImplementedError):
            raise
        except Exception as e:                  # noqa: BLE001 (the learner's own error, named)
            said = " ".join(str(e).split())
            raise CheckFailed(f"{call} raised {type(e).__name__}: {said} — {where}; call it "
                              f"yourself with these arguments to see where.") from None
    if not isinstance(plan, (list, tuple)) or not all(
            isinstance(r, (list, tuple)) and len(r) == 4 and None not in map(_whole, r)
            for r in plan):
        raise CheckFailed(f"{call} should return a list of (file, start, count, at) tuples of "
                          f"whole numbers; got {plan!r}.")
    plan = [tuple(map(_whole, r)) for r in plan]
    for f, start, count, at in plan:
        if not 0 <= f < len(saved):
            raise CheckFailed(f"{where}, but its plan reads file {f}: the files are numbered "
                              f"0-{len(saved) - 1}, in the order of `saved`.")
        offset, length = saved[f]
        if count < 0 or start < 0 or start + count > length:
            raise CheckFailed(f"{where}, but its plan reads {count} rows of file {f} from its row "
                              f"{start}, and file {f} has {length} rows (global rows {offset} "
                              f"on): start counts from the file's first row.")
    read = sum(count for _, _, count, _ in plan)
    if read > end - first:
        raise CheckFailed(f"{where}, but its plan reads {read * row_bytes} bytes for a shard of "
                          f"{(end - first) * row_bytes}: read from each file only the rows it "
                          f"shares with the shard, not whole pieces.")
    shard = torch.full((end - first,) + tuple(shape[1:]), float("nan"), dtype=files[0].dtype)
    for f, start, count, at in plan:
        if at < 0 or at + count > end - first:
            raise CheckFailed(f"{where}, but its plan puts {count} rows of file {f} at row {at} "
                              f"of a shard of {end - first} rows: at counts from the shard's "
                              f"first row.")
        shard[at:at + count] = files[f][start:start + count]
    for k in range(end - first):
        got = shard[k].reshape(-1)[0]
        f = next(i for i, (o, n) in enumerate(saved) if o <= first + k < o + n)
        want = f"global row {first + k} (file {f}, its row {first + k - saved[f][0]})"
        if torch.isnan(got):
            raise CheckFailed(f"{where}; its row {k} should be {want}, and the plan never "
                              f"fills it.")
        if int(got) // 100 != first + k:
            raise CheckFailed(f"{where}; its row {k} should be {want}, and the plan puts global "
                              f"row {int(got) // 100} there.")


def check_read_plan(fn, cases=RESHARD_CASES):
    """Every loading rank of every case: the learner's plan, carried out, rebuilds exactly the
    rank's shard and reads no byte more."""
    for shape, writers, world_size in cases:
        saved = (_expected_pieces(shape[0], writers) if isinstance(writers, int)
                 else [tuple(p) for p in writers])
        whole = _tensor(shape)
        files = [whole[o:o + n].clone() for o, n in saved]
        for rank in range(world_size):
            _one_rank(fn, shape, saved, world_size, rank, files,
                      whole.element_size() * whole[0].numel())
    passed(f"read_plan rebuilds every loading rank's shard on {len(cases)} checkpoints, flat and "
           f"2-D, reading only the rows each shard shares with each file: lengths that divide and "
           f"that do not, empty shards, the same world size, pieces out of row order.")
