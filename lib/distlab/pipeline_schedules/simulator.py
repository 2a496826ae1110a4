"""Checking a schedule and simulating it: every stage runs its list in order, waits for the
tensors it needs, and each action takes a fixed time; what a timeline says (bubble, memory)."""
from .. import _argcheck as check
from .actions import (Action, Schedule, _check, direction, n_pieces, normalize, placement_of,
                      stage_of, virtual_stage)


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
    _check_simulate(schedule, m, t_f, t_b, t_w, comm, t_fb)
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
    if not timeline:
        raise ValueError("timeline is empty: pass the list simulate(...) returns, or a run's.")
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


def _check_simulate(schedule, m, t_f, t_b, t_w, comm, t_fb):
    if not isinstance(schedule, (list, tuple)) or not schedule:
        raise ValueError(f"schedule must hold one list of actions per stage, e.g. "
                         f"ps.one_f_one_b(2, 4); got {schedule!r}.")
    _check(len(schedule), m)
    for name, t in (("t_f", t_f), ("t_b", t_b), ("t_fb", t_fb)):
        if t is not None:
            check.positive(t, name, example=1.0)
    check.positive(comm, "comm", allow_zero=True)
    if t_w is not None and not 0 <= check.positive(t_w, "t_w", allow_zero=True) <= t_b:
        raise ValueError(f"t_w (the weight-gradient part of the backward) must be at most "
                         f"t_b = {t_b}; got {t_w}.")


def back_to_back(schedule, m, steps):
    """`steps` training steps of `schedule` run one after the other with no barrier between them:
    step k's micro-batches are numbered k·m … k·m + m − 1, and each stage starts step k + 1 as
    soon as its own list of step k is done. That is what a stage may do when nothing
    synchronises the stages at the optimizer step (ZB-H2's and ZB-V's "post-validation": step
    at once, check the global gradient norm and NaN/inf afterwards, roll back the rare step that
    fails). Simulate it with m·steps micro-batches."""
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(f"steps must be a whole number >= 1; got {steps!r}.")
    stages = [[Action(a.kind, a.mb + k * m, a.chunk) for k in range(steps) for a in actions]
              for actions in normalize(schedule)]
    return Schedule(stages, placement_of(schedule), None) if isinstance(schedule, Schedule) \
        else stages


def steady_bubble(schedule, m, t_f=1.0, t_b=2.0, t_w=None, steps=3):
    """The idle share of one step once steps run back to back (`back_to_back`): 1 − a step's
    work per stage over the period between the ends of the last two steps. Equal to
    `bubble_fraction` of one step when every step must wait for the previous one to end."""
    if steps < 2:
        raise ValueError(f"steady_bubble needs steps >= 2 to measure a period; got {steps!r}.")
    ends = []
    for k in (steps - 1, steps):
        timeline = simulate(back_to_back(schedule, m, k), m * k, t_f, t_b, t_w)
        ends.append(max(e["end"] for e in timeline))
    work = max(sum(e["end"] - e["start"] for e in timeline if e["stage"] == r)
               for r in {e["stage"] for e in timeline}) / steps
    return 1.0 - work / (ends[1] - ends[0])


def parameter_gathers(actions, policy):
    """How many times one stage all-gathers a chunk's parameters in a step when they are sharded
    over a data-parallel group (ZeRO-3 / FSDP), for its list `actions`, and the most chunks it
    holds whole at once: (gathers, peak chunks held). `policy`:

    - "every action": gathered for each action and freed after it (FSDP's reshard after forward
      and after backward, inside a pipeline): F, B (and I) each gather; W too;
    - "while in use": kept while consecutive actions use the same chunk, freed when the stage
      turns to another chunk;
    - "whole step": gathered at a chunk's first use, kept to the end of the step (torchtitan's
      default with PP: no reshard after forward, the parameters resharded after the last
      backward) — the fewest gathers, the most held.
    """
    policies = ("every action", "while in use", "whole step")
    if policy not in policies:
        raise ValueError(f"policy must be one of {policies}; got {policy!r}.")
    actions = normalize([actions])[0]
    gathers, held, peak, previous = 0, set(), 0, None
    for a in actions:
        if policy == "every action":
            gathers, peak = gathers + 1, max(peak, 1)
            continue
        if policy == "while in use" and previous is not None and a.chunk != previous:
            held.discard(previous)
        if a.chunk not in held:
            gathers += 1
            held.add(a.chunk)
        peak, previous = max(peak, len(held)), a.chunk
    return gathers, peak
