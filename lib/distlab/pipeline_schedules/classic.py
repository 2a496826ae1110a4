"""The one-chunk-at-a-time schedules: GPipe, 1F1B, and Megatron's interleaved 1F1B."""
from .actions import Action, _check


def gpipe(p, m):
    """All forwards, then all backwards: every stage holds all m micro-batches' activations."""
    _check(p, m)
    return [[Action("F", i) for i in range(m)] + [Action("B", i) for i in range(m)]
            for _ in range(p)]


def one_f_one_b(p, m):
    """1F1B: a short warm-up of forwards, then one forward / one backward, then the cool-down.

    Stage r runs p - 1 - r forwards ahead, so it never holds more than p - r micro-batches.
    """
    _check(p, m)
    schedule = []
    for r in range(p):
        warmup = min(p - 1 - r, m)
        actions = [Action("F", i) for i in range(warmup)]
        for i in range(m - warmup):
            actions += [Action("F", warmup + i), Action("B", i)]
        actions += [Action("B", i) for i in range(m - warmup, m)]
        schedule.append(actions)
    return schedule


def interleaved_1f1b(p, m, v=2):
    """Megatron's interleaved 1F1B: v model chunks per stage, micro-batches in groups of p."""
    _check(p, m)
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise ValueError(f"v (chunks per stage) must be a whole number >= 1; got {v!r}.")
    if m % p:
        raise ValueError(f"interleaved 1F1B sends micro-batches round in groups of p={p}, so m "
                         f"must be a multiple of {p}; got m={m}.")
    total = m * v

    def nth(k, backward):
        chunk = (k // p) % v
        return Action("B" if backward else "F", (k // (p * v)) * p + k % p,
                      v - 1 - chunk if backward else chunk)

    schedule = []
    for r in range(p):
        # Deeper warm-up than 1F1B: the first backward needs every virtual stage's forward.
        warmup = min((p - 1 - r) * 2 + (v - 1) * p, total)
        actions = [nth(k, False) for k in range(warmup)]
        for k in range(total - warmup):
            actions += [nth(warmup + k, False), nth(k, True)]
        actions += [nth(k, True) for k in range(total - warmup, total)]
        schedule.append(actions)
    return schedule
