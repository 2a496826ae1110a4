"""Pipeline schedules as plain data, and a simulator that says when each action runs.

A schedule for p stages is a list of p lists: what stage r does, in order. Each entry is an
`Action(kind, mb, chunk)`:

    F  forward of micro-batch `mb` through this stage's model chunk `chunk`
    B  its full backward (input gradient and weight gradient together)
    I  backward for the input gradient only (what the previous stage is waiting for)
    W  backward for the weight gradients only (nobody waits for it: it can fill a bubble)

With v chunks per stage (interleaved schedules) chunk c of stage r is the virtual stage
c * p + r: the model is cut into p * v pieces dealt round-robin to the stages (the "loop"
placement). ZB-V and DualPipeV place two chunks per stage in a V instead: stage r holds virtual
stages r and 2p - 1 - r, so a micro-batch goes down the stages and comes back up, and the last
stage turns it around without a message. Such a schedule is a `Schedule` (a list) whose
`placement` is "v"; every function here reads it from there. The bidirectional DualPipe places
the model twice ("dual"): the first half of the micro-batches enter at stage 0 and run on chunk
0, stage r holding piece r; the second half enter at stage p - 1 and run on chunk 1, stage r
holding piece p - 1 - r. A DualPipe schedule also names its overlapped F&B pairs
(`Schedule.pairs`), which `simulate` can run as one unit (t_fb).

`simulate` executes such lists like the real ranks do - each stage runs its list in order and
waits for the tensors it needs - but with fixed durations, and returns every action's start and
end. The same timeline drawing (distlab.viz.pipeline) is used for simulated and measured runs.
"""
from collections import namedtuple

Action = namedtuple("Action", "kind mb chunk", defaults=(0,))
Action.__repr__ = lambda a: f"{a.kind}{a.mb}" + (f".{a.chunk}" if a.chunk else "")
KINDS = ("F", "B", "I", "W")


class Schedule(list):
    """A schedule (one list of actions per stage) that also says where the chunks sit:
    placement "loop" (chunk c of stage r is virtual stage c * p + r), "v" or "dual" (see module
    doc); and, for DualPipe's schedules, `pairs`: per stage, the positions i at which actions i
    and i + 1 are one overlapped forward-and-backward pair (DualPipe's F&B)."""

    def __init__(self, stages, placement="loop", pairs=None):
        super().__init__(stages)
        if placement not in PLACEMENTS:
            raise ValueError(f"placement must be one of {PLACEMENTS}; got {placement!r}.")
        self.placement = placement
        self.pairs = [set(q) for q in pairs] if pairs is not None else [set() for _ in stages]


PLACEMENTS = ("loop", "v", "dual")


def placement_of(schedule, placement=None):
    """The placement given, else the schedule's own, else "loop" (plain lists)."""
    placement = placement or getattr(schedule, "placement", "loop")
    if placement not in PLACEMENTS:
        raise ValueError(f"placement must be one of {PLACEMENTS}; got {placement!r}.")
    return placement


def virtual_stage(rank, chunk, p, placement="loop"):
    """Which piece of the model chunk `chunk` of stage `rank` is (0 = the first layers)."""
    if placement == "v":
        return rank if chunk == 0 else 2 * p - 1 - rank
    if placement == "dual":
        return rank if chunk == 0 else p - 1 - rank
    return chunk * p + rank


def stage_of(vs, p, placement="loop", chunk=0):
    """(stage, chunk) holding virtual stage `vs`: the inverse of virtual_stage. In the "dual"
    placement every piece is held twice; `chunk` (the micro-batch's direction) says which copy."""
    if placement == "v":
        return (vs, 0) if vs < p else (2 * p - 1 - vs, 1)
    if placement == "dual":
        return (vs, 0) if chunk == 0 else (p - 1 - vs, 1)
    return vs % p, vs // p


def n_pieces(p, v, placement="loop"):
    """How many pieces the model is cut into: p * v (loop), 2p (v), p (dual: held twice)."""
    return p if placement == "dual" else p * v


def direction(mb, m):
    """DualPipe: micro-batch mb of m enters at stage 0 (0, the first half) or p - 1 (1)."""
    return 0 if mb < m // 2 else 1


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


def dualpipe_v(p, m):
    """DualPipeV (DeepSeek's DualPipe "cut in half", github.com/deepseek-ai/DualPipe): the V
    placement of ZB-V, with DualPipe's eight phases per stage.

    The idea DualPipe adds is the *pair*: in the steady state each stage runs the forward of one
    micro-batch on one chunk next to the full backward of another on its other chunk
    (F0 B1, F1 B0, ...). On a GPU the two run at once and one hides the other's communication
    (DeepSeek-V3 overlaps the MoE all-to-alls of one with the compute of the other); here, and in
    `simulate`, a pair is just F then B one after the other. The cool-down splits some backwards
    into I and W to fill the drain, as zero-bubble schedules do. Needs m >= 2p. The order is
    torch.distributed.pipelining's ScheduleDualPipeV (tests compare the two), each overlapped
    pair written as its forward, then its backward.
    """
    _check(p, m)
    if m < 2 * p:
        raise ValueError(f"DualPipeV needs at least 2p = {2 * p} micro-batches (one per virtual "
                         f"stage, so the two directions of the V both fill); got m={m}.")
    schedule, pairs = [], []
    for r in range(p):
        ops, nxt, pending, paired = [], {}, [], set()   # next mb per (chunk, kind); W's owed

        def pair():                 # the next two actions are one overlapped F&B pair
            paired.add(len(ops))

        def add(kind, c):
            key = (c, "I" if kind in "BI" else kind)
            mb = nxt.get(key, 0)
            nxt[key] = mb + 1
            ops.append(Action(kind, mb, c))
            if kind == "I":
                pending.append((mb, c))

        def owed_w():
            if pending:
                mb, c = pending.pop(0)
                ops.append(Action("W", mb, c))
        for _ in range(2 * (p - r - 1)):                    # 1: F0
            add("F", 0)
        for _ in range(r + 1):                              # 2: F0 F1
            add("F", 0)
            add("F", 1)
        for _ in range(p - r - 1):                          # 3: I1 W F1 (zero bubble)
            add("I", 1)
            owed_w()
            add("F", 1)
        for i in range(m - 2 * p + r + 1):                  # 4: F0 B1 - F1 B0 (the pairs)
            if i > 0 or r < p - 1:      # DualPipe leaves the last stage's first pair apart
                pair()
            add("F", 0)
            add("B", 1)
            pair()
            add("F", 1)
            add("B", 0)
        for _ in range(p - r - 1):                          # 5: B1 - F1 B0
            add("B", 1)
            pair()
            add("F", 1)
            add("B", 0)
        split = False
        for i in range(r + 1):                              # 6: B1 B0, then split
            if i == (r + 1) // 2 and r % 2 == 1:
                split = True
            add("I" if split else "B", 1)
            if i == (r + 1) // 2 and r % 2 == 0:
                split = True
            add("I" if split else "B", 0)
        for _ in range(p - r - 1):                          # 7: W B0
            owed_w()
            add("I" if split else "B", 0)
        for _ in range(r + 1):                              # 8: the W's left
            owed_w()
        schedule.append(ops)
        pairs.append(paired)
    return Schedule(schedule, "v", pairs)


def dualpipe(p, m):
    """The bidirectional DualPipe (DeepSeek-V3 technical report, arXiv:2412.19437, section
    3.2.1; github.com/deepseek-ai/DualPipe): micro-batches 0 .. m/2 - 1 enter at stage 0 and run
    on chunk 0 (stage r holds piece r), micro-batches m/2 .. m - 1 enter at stage p - 1 and run on
    chunk 1 (stage r holds piece p - 1 - r). Every piece is held twice, by stages r and
    p - 1 - r, whose two gradients are summed before the optimizer step.

    Stages r and p - 1 - r run the same eight phases, mirrored: those of DualPipeV's stage
    min(r, p - 1 - r) with p/2 stages and m/2 micro-batches, where DualPipeV's chunk 0 is the
    direction that reaches the stage first (for r < p/2 chunk 0, else chunk 1). That is the
    "cut in half": fold stage p - 1 - r onto stage r and the two directions become one V.
    Needs p even and m even, m >= 2p (as DualPipe's code asserts).
    """
    _check(p, m)
    if p % 2 or m % 2 or m < 2 * p:
        raise ValueError(f"DualPipe needs an even number of stages and an even number of "
                         f"micro-batches, at least 2p = {2 * p} (half enter at each end); got "
                         f"p={p}, m={m}.")
    half = dualpipe_v(p // 2, m // 2)
    schedule = []
    for r in range(p):
        flip = int(r >= p // 2)                 # the second half meets direction 1 first
        schedule.append([Action(a.kind, a.mb + (m // 2) * (a.chunk ^ flip), a.chunk ^ flip)
                         for a in half[min(r, p - 1 - r)]])
    return Schedule(schedule, "dual", [half.pairs[min(r, p - 1 - r)] for r in range(p)])


def dualpipe_bubble(p, t_f, t_b, t_w, t_fb=None):
    """DualPipe's idle time per stage (DeepSeek-V3 technical report, arXiv:2412.19437, table 2;
    the DualPipe repository's table, DualPipeV included): (p/2 - 1)(t_fb + t_b - 3 t_w), where
    t_fb is the time of one overlapped forward-and-backward pair of chunks (at most t_f + t_b:
    what the overlap hides is communication) and t_f, t_b, t_w are a chunk's forward, full
    backward and weight-gradient times. Beside it, the same table's 1F1B: (p - 1)(t_f + t_b),
    and ZB1P (ZB-H1): (p - 1)(t_f + t_b - 2 t_w). Here p is DualPipe's number of ranks (DualPipeV:
    twice its ranks, the number of chunks).

    The report does not derive it. It is exactly `simulate`'s idle time per stage of `dualpipe`
    and `dualpipe_v` when each F&B pair runs as one unit (t_fb=, as DualPipe's code runs a pair)
    and the input-gradient part of the backward takes as long as the forward (t_b - t_w = t_f,
    with t_w <= t_f). With the pairs run apart (the default) the idle is lower, (p/2 - 1)
    (t_f + t_b - 2 t_w) at I = F; with I != F the formula is off the simulated ramp."""
    t_fb = t_f + t_b if t_fb is None else t_fb
    return (p / 2 - 1) * (t_fb + t_b - 3 * t_w)


V_SCHEDULES = {"ZB-V": zb_v, "DualPipeV": dualpipe_v}


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


def zb_v_bubble(p, m):
    """Idle fraction of ZB-V with equal stages, F = I = W and m >= 2p - 1, as `simulate` finds
    it: each stage idles p - 1 forwards of a chunk — half a stage's, so half ZB-H1's idle time —
    against m (F + I + W) of work: (p - 1) / (6m + p - 1)."""
    return (p - 1) / (6 * m + p - 1)


def theory(name, p, m, v=1):
    """The bubble formula of a named schedule (equal stages; F = I = W in time for ZB-H1 and
    ZB-V, B = I + W)."""
    if name == "ZB-H1":
        return zb_h1_bubble(p, m) if m >= p else None
    if name == "ZB-V":
        return zb_v_bubble(p, m) if m >= 2 * p - 1 else None
    return theory_bubble(p, m, v if name == "interleaved 1F1B" else 1)


# ---- checking and simulating a schedule -----------------------------------------------------------

def normalize(schedule):
    """Accept tuples like ("F", 0) or ("B", 3, 1) and return lists of Actions (a Schedule keeps
    its placement)."""
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
    return Schedule(out, schedule.placement, schedule.pairs) if isinstance(schedule, Schedule) \
        else out


def validate(schedule, m, placement=None):
    """Raise ValueError unless every stage does each needed action exactly once, in a sane order."""
    placement = placement_of(schedule, placement)
    schedule = normalize(schedule)
    v = 1 + max((a.chunk for s in schedule for a in s), default=0)
    if placement in ("v", "dual") and v != 2:
        raise ValueError(f"the {'V' if placement == 'v' else 'dual'} placement holds exactly 2 "
                         f"chunks per stage; this schedule names {v}.")
    if placement == "dual" and (len(schedule) % 2 or m % 2):
        raise ValueError(f"the dual placement needs an even number of stages and of "
                         f"micro-batches (half enter at each end); got {len(schedule)} and {m}.")
    for r, actions in enumerate(schedule):
        seen = set()
        for a in actions:
            if not (0 <= a.mb < m and 0 <= a.chunk < v):
                raise ValueError(f"stage {r}: {a!r} names micro-batch {a.mb} or chunk {a.chunk}, "
                                 f"but there are {m} micro-batches and {v} chunks.")
            if placement == "dual" and a.chunk != direction(a.mb, m):
                raise ValueError(f"stage {r}: {a!r} runs micro-batch {a.mb} on chunk {a.chunk}, "
                                 f"but in the dual placement it travels on chunk "
                                 f"{direction(a.mb, m)}.")
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
                if placement == "dual" and direction(i, m) != c:
                    continue
                missing = [k for k in "F" if (k, i, c) not in seen]
                if ("B", i, c) not in seen and not {("I", i, c), ("W", i, c)} <= seen:
                    missing.append("B (or I and W)")
                if missing:
                    where = f" of chunk {c}" if v > 1 else ""
                    raise ValueError(f"stage {r} never runs {' and '.join(missing)} for "
                                     f"micro-batch {i}{where}.")
    return schedule, v


def _messages(schedule, p, v, placement="loop"):
    """What each stage sends and receives, in its own order: {(src, dst, what): [(mb, vs)...]}."""
    sends, recvs = {}, {}
    n = n_pieces(p, v, placement)
    for r, actions in enumerate(schedule):
        for a in actions:
            vs = virtual_stage(r, a.chunk, p, placement)
            after = stage_of(vs + 1, p, placement, a.chunk)[0] if vs + 1 < n else r
            before = stage_of(vs - 1, p, placement, a.chunk)[0] if vs > 0 else r
            if a.kind == "F" and after != r:
                sends.setdefault((r, after, "activation"), []).append((a.mb, vs + 1))
            if a.kind == "F" and before != r:
                recvs.setdefault((before, r, "activation"), []).append((a.mb, vs))
            if a.kind in "BI" and before != r:
                sends.setdefault((r, before, "gradient"), []).append((a.mb, vs - 1))
            if a.kind in "BI" and after != r:
                recvs.setdefault((after, r, "gradient"), []).append((a.mb, vs))
    return sends, recvs


def check_message_order(schedule, p, v, placement=None):
    """send/recv pair the messages of one kind (activations, or gradients: the runtime tags them
    apart) between two stages in order: a stage must receive them in the order they are sent."""
    sends, recvs = _messages(schedule, p, v, placement_of(schedule, placement))
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


def simulate(schedule, m, t_f=1.0, t_b=2.0, t_w=None, comm=0.0, placement=None, t_fb=None):
    """Start and end of every action when each stage runs its list in order and waits for inputs.

    t_f, t_b: forward / full backward time of one stage (a chunk takes 1/v of it; in the dual
    placement a micro-batch crosses one piece per stage, 1/p of the model, which takes the whole
    time); t_w: the weight-gradient part of the backward (default half); comm: time of one
    send/recv;
    placement: where the chunks sit (default: the schedule's own, else "loop").
    t_fb: None (default) runs an overlapped pair of a DualPipe schedule (`Schedule.pairs`) as
    its F, then its B, each as soon as its own input is there. A number runs each pair as one
    unit of that time, as DualPipe's code does: the pair starts once both its inputs are there
    (its activation and its gradient) and both its outputs exist at its end (t_fb = t_f + t_b:
    no overlap gained, t_fb < t_f + t_b: the overlap hides that much). A pair is drawn as its F
    then its B, splitting its time in the ratio t_f : t_b.
    Returns a list of dicts {stage, kind, mb, chunk, start, end}. Raises ValueError on a deadlock.
    """
    placement = placement_of(schedule, placement)
    pairs = getattr(schedule, "pairs", None) if t_fb is not None else None
    schedule, v = validate(schedule, m, placement)
    p = len(schedule)
    check_message_order(schedule, p, v, placement)
    t_w = t_b / 2 if t_w is None else t_w
    share = 1 if placement == "dual" else v         # of a stage's time, one action's
    cost = {"F": t_f / share, "B": t_b / share, "I": (t_b - t_w) / share, "W": t_w / share}
    n = n_pieces(p, v, placement)
    done = {}                       # (kind, mb, virtual stage) -> end time
    pos, free = [0] * p, [0.0] * p
    timeline = []

    def ready(a, r):
        """When the inputs of action a are available, or None if they do not exist yet."""
        vs = virtual_stage(r, a.chunk, p, placement)
        needs = []
        if a.kind == "F" and vs > 0:
            needs.append(("F", a.mb, vs - 1, stage_of(vs - 1, p, placement, a.chunk)[0] != r))
        if a.kind in "BI":
            needs.append(("F", a.mb, vs, False))
            if vs + 1 < n:
                needs.append(("G", a.mb, vs + 1,
                              stage_of(vs + 1, p, placement, a.chunk)[0] != r))
        if a.kind == "W":
            needs.append(("I", a.mb, vs, False))
        t = 0.0
        for kind, mb, at, remote in needs:
            if (kind, mb, at) not in done:
                return None
            t = max(t, done[kind, mb, at] + (comm if remote else 0.0))
        return t

    def finish(a, r, start, end, drawn_end):
        vs = virtual_stage(r, a.chunk, p, placement)
        done[a.kind, a.mb, vs] = end
        if a.kind in "BI":
            done["G", a.mb, vs] = end      # the input gradient exists
        timeline.append(dict(stage=r, kind=a.kind, mb=a.mb, chunk=a.chunk,
                             start=start, end=drawn_end))

    while any(pos[r] < len(schedule[r]) for r in range(p)):
        progressed = False
        for r in range(p):
            while pos[r] < len(schedule[r]):
                a = schedule[r][pos[r]]
                if pairs and pos[r] in pairs[r]:          # an F&B pair, run as one unit
                    b = schedule[r][pos[r] + 1]
                    ta, tb = ready(a, r), ready(b, r)
                    if ta is None or tb is None:
                        break
                    start = max(ta, tb, free[r])
                    free[r] = end = start + t_fb / share
                    split = start + (end - start) * cost[a.kind] / (cost[a.kind] + cost[b.kind])
                    finish(a, r, start, end, split)
                    finish(b, r, split, end, end)
                    pos[r] += 2
                    progressed = True
                    continue
                t = ready(a, r)
                if t is None:
                    break
                start = max(t, free[r])
                free[r] = end = start + cost[a.kind]
                finish(a, r, start, end, end)
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
