"""Workbook 10, exercise 1: a dense weight from its column-parallel shards."""
import torch

from ... import parallel3d as p3
from .. import call_learner, compare, passed
from ..ch01 import refusing


def _reference_unshard(shards, chunks):
    parts = [s.chunk(chunks, dim=0) for s in shards]
    return torch.cat([torch.cat([p[j] for p in parts], dim=0) for j in range(chunks)])


def check_unshard_column(fn):
    """Cases: q, k, v stacked (chunks=3) over 2 and 4 ranks; a plain layer over 3 ranks; a bias."""
    cases = [(2, 3, (12, 5)), (3, 1, (9, 4)), (4, 3, (24, 2)), (2, 3, (12,))]
    for tp, chunks, shape in cases:
        g = torch.Generator().manual_seed(tp * 10 + chunks)
        dense = torch.randn(shape, generator=g, dtype=torch.float64)
        shards = [torch.cat([m.chunk(tp, dim=0)[r] for m in dense.chunk(chunks, dim=0)])
                  for r in range(tp)]
        with refusing(_reference_unshard, p3._unshard, exercise="put the shards back together "
                      "yourself"):
            got = call_learner(fn, [s.clone() for s in shards], chunks, name="unshard_column")
        compare(got, dense, f"unshard_column with {tp} shards of {chunks} stacked matri"
                f"{'ces' if chunks > 1 else 'x'} of shape {tuple(shape)}", atol=0, rtol=0)
    passed("unshard_column rebuilds the dense weight (and bias) from 2, 3 and 4 shards, "
           "q, k and v kept apart.")
