"""Workbook 12, exercise 2: one hop of the ring."""
import torch

from .. import CheckFailed, compare, forbid, passed, run_learner, sizes_phrase
from ._common import COURSE, WORLD_SIZES, _ring_traffic


def _hop_tensors(rank, seed=0):
    g = torch.Generator().manual_seed(1000 * seed + rank)
    return [torch.randn(2, generator=g, dtype=torch.float64),
            torch.randn(3, 2, generator=g, dtype=torch.float64),
            torch.randint(0, 100, (4,), generator=g)]


def _hop_rank(rank, world_size, ring_hop):
    mine = _hop_tensors(rank)
    with forbid(*COURSE, _hop_tensors, exercise="post the sends and receives yourself"):
        got = ring_hop([t.clone() for t in mine])
    return [t.clone() for t in got] if isinstance(got, (list, tuple)) else got


def check_ring_hop(ring_hop):
    """ring_hop(tensors) sends each tensor to the right neighbour and returns the left one's."""
    hop_bytes = sum(t.numel() * t.element_size() for t in _hop_tensors(0))
    for n in WORLD_SIZES:
        results = run_learner(_hop_rank, n, ring_hop, name="ring_hop", trace=True, timeout=20)
        for rank, got in enumerate(results):
            left = (rank - 1) % n
            compare(got, _hop_tensors(left), f"ring_hop with world_size={n}, rank {rank} (it "
                    f"should hold rank {left}'s tensors, same shapes and dtypes)")
        for rank, nbytes in enumerate(_ring_traffic(results.trace, n, "one ring hop")):
            if nbytes != hop_bytes:
                raise CheckFailed(f"with world_size={n}, rank {rank} sent {nbytes} bytes; one "
                                  f"hop sends its {hop_bytes} bytes of tensors once to the "
                                  f"right, no more.")
    passed(f"ring_hop passes every tensor one step to the right, on {sizes_phrase(WORLD_SIZES)} "
           f"ranks, each byte once, and talks only to its neighbours.")
