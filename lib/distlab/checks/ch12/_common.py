"""What workbook 12's checks share: world sizes, the course's code refused, the ring's traffic."""
from ... import context_parallel as cp
from .. import CheckFailed, _traffic


WORLD_SIZES = (3, 5)
COURSE = (cp.merge, cp._shift, cp.ring_attention, cp.RingAttention, cp.block_attention,
          cp.all_gather_attention, cp.dense_attention)
# Scores of about a thousand: exp overflows float64 above 709, so a softmax (or a merge) that
# does not subtract its maximum (or the log-sum-exp) returns inf or nan here.
LARGE = 500.0


def _ring_traffic(trace, world_size, what):
    """Point-to-point messages to the right neighbour only, by the checkers' one traffic rule
    (`_traffic`); returns the bytes each rank sent."""
    sent = []
    for rank in range(world_size):
        right, left = (rank + 1) % world_size, (rank - 1) % world_size
        calls = _traffic.records(trace, rank)
        for c in calls:
            if c["kind"] not in _traffic.P2P:
                raise CheckFailed(f"rank {rank} called {c['op']}; {what} uses only "
                                  f"point-to-point messages to its neighbours.")
            if c["kind"] == "send" and c["peer"] != right:
                raise CheckFailed(f"rank {rank} sent {c['bytes']} bytes to rank "
                                  f"{c['peer']}; in a ring, rank {rank} only sends to its "
                                  f"right neighbour, rank {right}.")
            if c["kind"] == "recv" and c["peer"] not in (None, left):
                raise CheckFailed(f"rank {rank} received from rank {c['peer']}; in a ring, "
                                  f"it only receives from its left neighbour, rank {left}.")
        sent.append(_traffic.wire(calls))
    return sent
