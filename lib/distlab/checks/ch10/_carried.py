"""What the dp and tp calls of workbook 10's step delivered, by the checkers' one traffic rule.

Each rank records what every call it makes carries (`_traffic.Carried`) and keeps those within its
dp and tp groups; the parent lines them up over each group (`_traffic.delivered`): a dp
all-reduce delivers the sum of the replicas' gradients, a tp all-reduce the sum of the tp ranks'
partial products, and a hand-written ring of send/recv over the same group delivers them in its
chunks — judged alike. A call of zeros (or of a copy) beside a gradient computed some other way
delivers neither, whatever its size.
"""
import torch

from ... import mesh as _mesh
from ... import parallel3d as p3
from .. import _traffic


def _same_values(got, expected, scales):
    """Whether the values `got` are those of `expected` times one of `scales`, in any order and
    cut into any pieces (a flat buffer, one tensor per parameter, several micro-batches); None
    when their counts differ (the trace's byte count then says more)."""
    if got.numel() != expected.numel():
        return None
    g = got.sort().values
    return any(torch.allclose(g, (expected * s).sort().values, atol=1e-9, rtol=1e-7)
               for s in scales)


def _delivered(got, rank, shape, dim):
    ranks = _mesh.peers(rank, shape, dim, p3.NAMES)
    return _traffic.delivered({r: got[r]["inside"][dim] for r in ranks}), list(ranks)


def dp_problem(got, rank, shape, me):
    """None, or the sentence: what the rank's dp group delivered does not hold its shard of the
    replicas' mean gradient (up to a factor: a sum, a mean, a pre-division)."""
    if shape[0] == 1:
        return None
    pieces, ranks = _delivered(got, rank, shape, "dp")
    names, want = zip(*got[rank]["want_dp"])
    missing = _traffic.missing(pieces, want, names)
    if missing is None:
        return None
    return (f"{me}: what its calls over the dp group {ranks} delivered does not hold the "
            f"replicas' gradient of {missing} (its shard, times any factor): all-reduce each "
            f"parameter's .grad (or one buffer of all of them), not a copy or zeros.")


def tp_problem(got, rank, shape, me):
    """None, or the sentence: no call over the rank's tp group delivered a block's sum of the
    tp ranks' partial products."""
    if shape[2] == 1:
        return None
    pieces, ranks = _delivered(got, rank, shape, "tp")
    sums = got[rank]["sums"]
    i = _traffic.missing(pieces, sums, range(len(sums)))
    if i is None:
        return None
    layer = "attention's output projection" if i % 2 == 0 else "the MLP's fc2"
    return (f"{me}: no call over its tp group {ranks} delivered block "
            f"{got[rank]['first_block'] + i // 2}'s {layer} (the sum of the tp ranks' partial "
            f"products): run this rank's p3.Stage3D on its replica's activations — its split "
            f"layers all-reduce the partial sums themselves.")
