"""Zero-bubble schedules (Qi et al.): the backward split into I (input gradient) and W
(weight gradient), the W's moved into the bubbles. ZB-H1 on one chunk per stage, ZB-V on two
chunks in a V."""
from .actions import Action, Schedule, _check


def zb_h1(p, m):
    """ZB-H1 (Qi et al., 2023): 1F1B with the backward split into I and W, the W passes delayed.

    Stage r runs p - r forwards (one more than 1F1B's warm-up), then repeats: the input gradient
    I of the oldest micro-batch (the stage before waits for it), the weight gradient W of the
    micro-batch r places further back, the next forward. Delaying W by r fills the idle slots
    1F1B leaves while the gradient travels back, and frees activations later: every stage holds
    up to p micro-batches - what 1F1B's first stage holds, so the peak memory of the pipeline
    is 1F1B's. With F = I = W in time and m >= p the bubble is (p - 1) / (3m + p - 1): a third
    of 1F1B's idle time (see zb_h1_bubble).
    """
    _check(p, m)
    schedule = []
    for r in range(p):
        warmup = min(p - r, m)
        actions = [Action("F", i) for i in range(warmup)]
        w = 0                                   # the next micro-batch whose W is pending
        for i in range(m):
            actions.append(Action("I", i))
            if i >= r:                          # stage r lets r weight gradients wait
                actions.append(Action("W", w))
                w += 1
            if warmup + i < m:
                actions.append(Action("F", warmup + i))
        actions += [Action("W", j) for j in range(w, m)]   # cool-down: the delayed W's
        schedule.append(actions)
    return schedule


def zb_v(p, m):
    """ZB-V (Qi et al., 2024, "Zero Bubble Pipeline Parallelism", section 6): two chunks per
    stage in a V, the backward split into I and W.

    Stage r holds virtual stages r (chunk 0, on the way down) and 2p - 1 - r (chunk 1, on the
    way back up), so the last stage turns a micro-batch around at once and the first stage both
    starts and finishes it: the ramp down and the ramp up meet on the same stage. The warm-up
    runs 2(p - r) - 1 forwards of chunk 0, then r pairs (chunk 1, chunk 0), then p - r rounds of
    F, I, W on chunk 1; the steady state alternates F I W on chunk 0 and on chunk 1; the
    cool-down runs the remaining I's first and the W's last. With F = I = W per chunk its
    bubble is close to zero once m >= 2p - 1, at 1F1B's peak activation memory (p micro-batches:
    2p chunks of half a stage each). The order is torch.distributed.pipelining's
    ScheduleZBVZeroBubble (tests compare the two), written for this course's Actions.
    """
    _check(p, m)
    n = max(2 * p - 1, m)       # fill the pattern as if m were 2p - 1, then drop the extra
    schedule = []
    for r in range(p):
        ops = []
        f, b = [0, 0], [0, 0]           # next forward / input-gradient micro-batch, per chunk

        def add(kind, c, mb=None):
            counter = f if kind == "F" else b if kind == "I" else None
            mb = counter[c] if mb is None else mb
            if counter is not None:
                counter[c] += 1
            ops.append(Action(kind, mb, c))
        for _ in range(2 * (p - r) - 1):
            add("F", 0)
        for _ in range(r):
            add("F", 1)
            add("F", 0)
        for _ in range(p - r):
            add("F", 1)
            add("I", 1)
            add("W", 1, b[1] - 1)
        while f[1] < f[0] or f[0] < n:
            if f[0] < n:
                add("F", 0)
            add("I", 0)
            add("W", 0, b[0] - 1)
            add("F", 1)
            add("I", 1)
            add("W", 1, b[1] - 1)
        w = list(b)                     # the W's of the cool-down come after its I's
        for _ in range(r):
            add("I", 0)
            add("I", 1)
        for _ in range(p - r):
            add("I", 0)
            add("W", 0, w[0])
            w[0] += 1
        ops += [Action("W", j, 1) for j in range(w[1], b[1])]
        ops += [Action("W", j, 0) for j in range(w[0], b[0])]
        schedule.append([a for a in ops if a.mb < m])
    return Schedule(schedule, "v")
