"""Checkers for workbook 10: putting tp shards back together, and the loss every rank reports."""
import torch

from .. import parallel3d as p3
from . import CheckFailed, call_learner, compare, passed, run_learner, sizes_phrase


# ---- exercise 1: a dense weight from its column-parallel shards ---------------------------------

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
        got = call_learner(fn, [s.clone() for s in shards], chunks, name="unshard_column")
        compare(got, dense, f"unshard_column with {tp} shards of {chunks} stacked matri"
                f"{'ces' if chunks > 1 else 'x'} of shape {tuple(shape)}", atol=0, rtol=0)
    passed("unshard_column rebuilds the dense weight (and bias) from 2, 3 and 4 shards, "
           "q, k and v kept apart.")


# ---- exercise 2: the loss every rank reports ------------------------------------------------------

def _losses_on_mesh(rank, world_size, dp, pp, tp, fn):
    mesh = p3.Mesh3D(dp, pp, tp)
    # Every rank holds a different number, as if each had computed a loss; only the last
    # stage's are real losses, and they differ between replicas.
    mine = torch.tensor(1.0 + 0.25 * rank + 0.125 * mesh.d, dtype=torch.float64)
    return float(fn(mine, mesh))


def check_global_loss(fn):
    shapes = [(2, 2, 2), (3, 1, 1), (1, 3, 1)]
    for dp, pp, tp in shapes:
        expected = run_learner(_losses_on_mesh, dp * pp * tp, dp, pp, tp, p3.global_loss,
                               timeout=120)
        try:
            got = run_learner(_losses_on_mesh, dp * pp * tp, dp, pp, tp, fn, name="global_loss",
                              timeout=120)
        except (NotImplementedError, CheckFailed):
            raise
        except Exception as e:  # a crash inside the learner's code: say where, in one line
            raise CheckFailed(f"global_loss on dp={dp} x pp={pp} x tp={tp} failed: "
                              f"{str(e).splitlines()[0]}") from None
        for rank in range(dp * pp * tp):
            compare(got[rank], expected[rank], f"global_loss on dp={dp} x pp={pp} x tp={tp}, "
                    f"rank {rank}", atol=1e-12, rtol=1e-12)
    passed(f"global_loss gives every rank the replicas' mean of the last stage's loss on meshes "
           f"{sizes_phrase(['x'.join(map(str, s)) for s in shapes])}.")
