"""Pipeline schedules as plain data, and a simulator that says when each action runs.

A schedule for p stages is a list of p lists: what stage r does, in order. Each entry is an
`Action(kind, mb, chunk)`:

    F  forward of micro-batch `mb` through this stage's model chunk `chunk`
    B  its full backward (input gradient and weight gradient together)
    I  backward for the input gradient only (what the previous stage is waiting for)
    W  backward for the weight gradients only (nobody waits for it: it can fill a bubble)

With v chunks per stage (interleaved schedules) chunk c of stage r is the virtual stage
c * p + r: the model is cut into p * v pieces dealt round-robin to the stages.

`simulate` executes such lists like the real ranks do - each stage runs its list in order and
waits for the tensors it needs - but with fixed durations, and returns every action's start and
end. The same timeline drawing (distlab.viz.pipeline) is used for simulated and measured runs.
"""
from collections import namedtuple

Action = namedtuple("Action", "kind mb chunk", defaults=(0,))
Action.__repr__ = lambda a: f"{a.kind}{a.mb}" + (f".{a.chunk}" if a.chunk else "")
KINDS = ("F", "B", "I", "W")


def _check(p, m):
    for name, value in (("p (stages)", p), ("m (micro-batches)", m)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a whole number >= 1; got {value!r}.")


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


SCHEDULES = {"GPipe": gpipe, "1F1B": one_f_one_b, "interleaved 1F1B": interleaved_1f1b,
             "ZB-H1": zb_h1}


def make_schedule(name, p, m):
    if name not in SCHEDULES:
        raise ValueError(f"unknown schedule {name!r}; choose one of {list(SCHEDULES)}.")
    return SCHEDULES[name](p, m)


def theory_bubble(p, m, v=1):
    """Idle fraction of GPipe/1F1B with equal stages: (p - 1) / (m + p - 1); v chunks divide it."""
    return (p - 1) / (v * m + p - 1)


def zb_h1_bubble(p, m, t_f=1.0, t_i=1.0, t_w=1.0):
    """Idle fraction of ZB-H1 with equal stages, m >= p and W no longer than F or I: each stage
    idles (p - 1)(t_f + t_i - t_w) - the W's fill part of the ramp - against 1F1B's
    (p - 1)(t_f + t_i + t_w). With t_f = t_i = t_w: (p - 1) / (3m + p - 1)."""
    idle = (p - 1) * (t_f + t_i - t_w)
    return idle / (m * (t_f + t_i + t_w) + idle)


def theory(name, p, m, v=1):
    """The bubble formula of a named schedule (equal stages; F = I = W in time for ZB-H1, B = I + W)."""
    if name == "ZB-H1":
        return zb_h1_bubble(p, m) if m >= p else None
    return theory_bubble(p, m, v if name == "interleaved 1F1B" else 1)


# ---- checking and simulating a schedule -----------------------------------------------------------

def normalize(schedule):
    """Accept tuples like ("F", 0) or ("B", 3, 1) and return lists of Actions."""
    out = []
    for r, actions in enumerate(schedule):
        stage = []
        for a in actions:
            try:
                a = Action(*a)
            except TypeError:
                raise ValueError(f"stage {r}: {a!r} is not an action like ('F', 0) or "
                                 f"('B', 2, 1).") from None
            if a.kind not in KINDS:
                raise ValueError(f"stage {r}: {a!r} has kind {a.kind!r}; use one of {KINDS}.")
            stage.append(a)
        out.append(stage)
    return out


def validate(schedule, m):
    """Raise ValueError unless every stage does each needed action exactly once, in a sane order."""
    schedule = normalize(schedule)
    v = 1 + max((a.chunk for s in schedule for a in s), default=0)
    for r, actions in enumerate(schedule):
        seen = set()
        for a in actions:
            if not (0 <= a.mb < m and 0 <= a.chunk < v):
                raise ValueError(f"stage {r}: {a!r} names micro-batch {a.mb} or chunk {a.chunk}, "
                                 f"but there are {m} micro-batches and {v} chunks.")
            if (a.kind, a.mb, a.chunk) in seen:
                raise ValueError(f"stage {r} runs {a!r} twice.")
            if a.kind in "BI" and ("F", a.mb, a.chunk) not in seen:
                raise ValueError(f"stage {r} runs {a!r} before its forward F{a.mb}.")
            if a.kind == "W" and ("I", a.mb, a.chunk) not in seen:
                raise ValueError(f"stage {r} runs {a!r} before its input-gradient I{a.mb}.")
            if a.kind == "I" and ("B", a.mb, a.chunk) in seen or \
                    a.kind == "B" and ("I", a.mb, a.chunk) in seen:
                raise ValueError(f"stage {r} runs both B and I for micro-batch {a.mb}.")
            seen.add((a.kind, a.mb, a.chunk))
        for c in range(v):
            for i in range(m):
                missing = [k for k in "F" if (k, i, c) not in seen]
                if ("B", i, c) not in seen and not {("I", i, c), ("W", i, c)} <= seen:
                    missing.append("B (or I and W)")
                if missing:
                    where = f" of chunk {c}" if v > 1 else ""
                    raise ValueError(f"stage {r} never runs {' and '.join(missing)} for "
                                     f"micro-batch {i}{where}.")
    return schedule, v


def _messages(schedule, p, v):
    """What each stage sends and receives, in its own order: {(src, dst, what): [(mb, vs)...]}."""
    sends, recvs = {}, {}
    n = p * v
    for r, actions in enumerate(schedule):
        for a in actions:
            vs = a.chunk * p + r
            if a.kind == "F" and vs + 1 < n and (vs + 1) % p != r:
                sends.setdefault((r, (vs + 1) % p, "activation"), []).append((a.mb, vs + 1))
            if a.kind == "F" and vs > 0 and (vs - 1) % p != r:
                recvs.setdefault(((vs - 1) % p, r, "activation"), []).append((a.mb, vs))
            if a.kind in "BI" and vs > 0 and (vs - 1) % p != r:
                sends.setdefault((r, (vs - 1) % p, "gradient"), []).append((a.mb, vs - 1))
            if a.kind in "BI" and vs + 1 < n and (vs + 1) % p != r:
                recvs.setdefault(((vs + 1) % p, r, "gradient"), []).append((a.mb, vs))
    return sends, recvs


def check_message_order(schedule, p, v):
    """send/recv pair messages in order (no tags): a stage must receive in the order they are sent."""
    sends, recvs = _messages(schedule, p, v)
    for key, sent in sends.items():
        got = recvs.get(key, [])
        if sent != got:
            src, dst, what = key
            i = next(i for i, (s, g) in enumerate(zip(sent + [None], got + [None])) if s != g)
            raise ValueError(f"stage {dst} receives {what}s from stage {src} in a different order "
                             f"than they are sent (message {i}: sent for micro-batch "
                             f"{sent[i][0] if i < len(sent) else '-'}, received as micro-batch "
                             f"{got[i][0] if i < len(got) else '-'}), so send/recv would pair "
                             f"the wrong tensors.")


def simulate(schedule, m, t_f=1.0, t_b=2.0, t_w=None, comm=0.0):
    """Start and end of every action when each stage runs its list in order and waits for inputs.

    t_f, t_b: forward / full backward time of one stage (a chunk takes 1/v of it); t_w: the
    weight-gradient part of the backward (default half); comm: time of one send/recv.
    Returns a list of dicts {stage, kind, mb, chunk, start, end}. Raises ValueError on a deadlock.
    """
    schedule, v = validate(schedule, m)
    p = len(schedule)
    check_message_order(schedule, p, v)
    t_w = t_b / 2 if t_w is None else t_w
    cost = {"F": t_f / v, "B": t_b / v, "I": (t_b - t_w) / v, "W": t_w / v}
    n = p * v
    done = {}                       # (kind, mb, virtual stage) -> end time
    pos, free = [0] * p, [0.0] * p
    timeline = []

    def ready(a, r):
        """When the inputs of action a are available, or None if they do not exist yet."""
        vs = a.chunk * p + r
        needs = []
        if a.kind == "F" and vs > 0:
            needs.append(("F", a.mb, vs - 1, (vs - 1) % p != r))
        if a.kind in "BI":
            needs.append(("F", a.mb, vs, False))
            if vs + 1 < n:
                needs.append(("G", a.mb, vs + 1, (vs + 1) % p != r))
        if a.kind == "W":
            needs.append(("I", a.mb, vs, False))
        t = 0.0
        for kind, mb, at, remote in needs:
            if (kind, mb, at) not in done:
                return None
            t = max(t, done[kind, mb, at] + (comm if remote else 0.0))
        return t

    while any(pos[r] < len(schedule[r]) for r in range(p)):
        progressed = False
        for r in range(p):
            while pos[r] < len(schedule[r]):
                a = schedule[r][pos[r]]
                t = ready(a, r)
                if t is None:
                    break
                start = max(t, free[r])
                free[r] = end = start + cost[a.kind]
                vs = a.chunk * p + r
                done[a.kind, a.mb, vs] = end
                if a.kind in "BI":
                    done["G", a.mb, vs] = end      # the input gradient exists
                timeline.append(dict(stage=r, kind=a.kind, mb=a.mb, chunk=a.chunk,
                                     start=start, end=end))
                pos[r] += 1
                progressed = True
        if not progressed:
            stuck = [f"stage {r} waits at {schedule[r][pos[r]]!r}" for r in range(p)
                     if pos[r] < len(schedule[r])]
            raise ValueError("the schedule deadlocks: " + ", ".join(stuck) + ".")
    return timeline


# ---- what a timeline says ----------------------------------------------------------------------------

def bubble_fraction(timeline):
    """Share of stage-time spent idle between the first start and the last end."""
    stages = {e["stage"] for e in timeline}
    begin = min(e["start"] for e in timeline)
    span = max(e["end"] for e in timeline) - begin
    busy = sum(e["end"] - e["start"] for e in timeline)
    return 1.0 - busy / (len(stages) * span)


def peak_in_flight(actions):
    """Most micro-batches whose activations a stage holds at once (freed by B, or by W)."""
    held = peak = 0
    for a in normalize([actions])[0]:
        held += 1 if a.kind == "F" else -1 if a.kind in "BW" else 0
        peak = max(peak, held)
    return peak
