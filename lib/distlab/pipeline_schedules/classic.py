"""The schedules without a split backward: GPipe, 1F1B, Megatron's interleaved 1F1B, and the
breadth-first looped BFS."""
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


def looped_bfs(p, m, v=2):
    """Looped BFS (Lamy-Poirier 2023, "Breadth-First Pipeline Parallelism"; torch's
    ScheduleLoopedBFS): v chunks per stage in the loop placement, like interleaved 1F1B, but run
    breadth-first — every micro-batch through chunk 0, then every one through chunk 1, …; then
    the backwards, the last chunk first and each chunk's micro-batches last-in first-out.

    Its ramp is paid in chunks, as interleaving's is, but a stage holds all m·v chunks'
    activations at once (GPipe's memory); what it buys is that a chunk's parameters are used by
    all m micro-batches in a row — under ZeRO-3/FSDP, gathered once per chunk and direction
    instead of once per micro-batch (`parameter_gathers`). m need not be a multiple of p."""
    _check(p, m)
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise ValueError(f"v (chunks per stage) must be a whole number >= 1; got {v!r}.")
    forwards = [Action("F", mb, c) for c in range(v) for mb in range(m)]
    backwards = [Action("B", mb, c) for c in reversed(range(v)) for mb in reversed(range(m))]
    return [forwards + backwards for _ in range(p)]
