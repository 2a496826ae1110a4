"""The checker's own pipeline simulator: it runs per-rank action lists like the ranks would, with
a cost for every stage and kind, and when a list is wrong it says which rank, which step of its
list, which micro-batch, and which rule is broken.

It is independent of `distlab.pipeline_schedules.simulate` (the chapter's simulator, which the
learner may read and must not call): the learner's schedule is judged by this one, and its
verdicts must agree with the chapter's on every schedule of the course (tests/test_ch08.py).

Schedule: a list of p lists; rank r's list holds actions `(kind, mb)` or `(kind, mb, chunk)`,
kind "F" (forward) or "B" (backward: input and weight gradients together). With v chunks per
rank, chunk c of rank r is virtual stage c * p + r, so a micro-batch visits ranks 0 … p-1, then
0 … p-1 again, v times (Megatron's placement).
"""
from collections import namedtuple

Step = namedtuple("Step", "kind mb chunk")
RULE_ONCE = ("each rank runs one forward and one backward of every micro-batch on every chunk "
             "it holds")
RULE_BEFORE = "a backward needs the activations its own forward saved, so it comes after it"
RULE_ORDER = ("send/recv carry no tags: the messages between two ranks are matched in the "
              "order they are sent, so a rank must receive them in that order")
RULE_DEADLOCK = ("every action waits for the message it needs; when each waiting rank waits for "
                 "one that another waiting rank only sends later, none can move")


class ScheduleError(ValueError):
    """The schedule breaks a rule; the message names the rank, the step and the micro-batch."""


def describe(a, v=1):
    """'F3', or 'B0 of chunk 1' when ranks hold several chunks."""
    name = f"{a.kind}{a.mb}"
    return name + (f" of chunk {a.chunk}" if a.chunk or v > 1 else "")


def normalize(schedule, p=None):
    """Accept tuples ("F", 0) / ("B", 3, 1) (or anything with kind, mb[, chunk]) per rank."""
    if not isinstance(schedule, (list, tuple)) or not schedule:
        raise ScheduleError(f"a schedule is a list with one list of actions per rank; got "
                            f"{type(schedule).__name__}.")
    if p is not None and len(schedule) != p:
        raise ScheduleError(f"a schedule for p={p} ranks has {p} lists; got {len(schedule)}.")
    out = []
    for r, actions in enumerate(schedule):
        if not isinstance(actions, (list, tuple)):
            raise ScheduleError(f"rank {r}'s actions should be a list like [('F', 0), ...]; "
                                f"got {type(actions).__name__}.")
        steps = []
        for k, a in enumerate(actions):
            try:
                a = tuple(a)
                step = Step(a[0], a[1], a[2] if len(a) > 2 else 0)
                ok = len(a) in (2, 3) and step.kind in ("F", "B") and all(
                    isinstance(x, int) and not isinstance(x, bool) for x in step[1:])
            except (TypeError, IndexError):
                ok = False
            if not ok:
                raise ScheduleError(f"rank {r}, step {k}: {actions[k]!r} is not an action like "
                                    f"('F', 0) or ('B', 2, 1) (kind 'F' or 'B', whole numbers).")
            steps.append(step)
        out.append(steps)
    return out


def validate(schedule, m, v=1):
    """Each rank: every (kind, mb, chunk) once, in range, each backward after its forward."""
    for r, steps in enumerate(schedule):
        seen = {}
        for k, a in enumerate(steps):
            if not (0 <= a.mb < m and 0 <= a.chunk < v):
                raise ScheduleError(
                    f"rank {r}, step {k}: {describe(a, v)} names micro-batch {a.mb}, chunk "
                    f"{a.chunk}; there are m={m} micro-batches (0 … {m - 1}) and v={v} chunk"
                    f"{'s' if v > 1 else ''} (0 … {v - 1}).")
            if a in seen:
                raise ScheduleError(f"rank {r} runs {describe(a, v)} twice (steps {seen[a]} and "
                                    f"{k}); {RULE_ONCE}.")
            if a.kind == "B" and Step("F", a.mb, a.chunk) not in seen:
                raise ScheduleError(f"rank {r}, step {k}: {describe(a, v)} comes before its "
                                    f"forward; {RULE_BEFORE}.")
            seen[a] = k
        for c in range(v):
            for i in range(m):
                for kind in "FB":
                    if Step(kind, i, c) not in seen:
                        raise ScheduleError(f"rank {r} never runs {describe(Step(kind, i, c), v)}; "
                                            f"{RULE_ONCE}.")


def _needs(a, r, p, v):
    """(kind, mb, virtual stage, rank) of the action whose result `a` on rank r waits for."""
    vs = a.chunk * p + r
    if a.kind == "F":
        return ("F", a.mb, vs - 1, (vs - 1) % p) if vs > 0 else None
    return ("B", a.mb, vs + 1, (vs + 1) % p) if vs + 1 < p * v else None


def check_message_order(schedule, p, v):
    """Between two ranks the k-th message sent must be the k-th the receiver expects."""
    sent, expected = {}, {}
    for r, steps in enumerate(schedule):
        for k, a in enumerate(steps):
            vs = a.chunk * p + r
            what = "activation" if a.kind == "F" else "gradient"
            nxt = vs + 1 if a.kind == "F" else vs - 1
            if 0 <= nxt < p * v and nxt % p != r:
                sent.setdefault((r, nxt % p, what), []).append((a, k))
            need = _needs(a, r, p, v)
            if need and need[3] != r:
                expected.setdefault((need[3], r, what), []).append((a, k))
    for (src, dst, what), msgs in sent.items():
        wants = expected.get((src, dst, what), [])
        for n, ((a, k), (b, j)) in enumerate(zip(msgs, wants)):
            if a.mb != b.mb:
                raise ScheduleError(
                    f"rank {dst}, step {j} ({describe(b, v)}) receives rank {src}'s {what} message "
                    f"number {n}, but rank {src} sends that one for micro-batch {a.mb} (its step "
                    f"{k}, {describe(a, v)}), not {b.mb}: {RULE_ORDER}.")


def simulate(schedule, m, cost, v=1):
    """Run the lists; cost(rank, step) -> seconds. Returns [{rank, step, kind, mb, chunk, start,
    end}] in the order they ran. Raises ScheduleError naming the broken rule."""
    p = len(schedule)
    validate(schedule, m, v)
    check_message_order(schedule, p, v)
    done = {}                       # (kind, mb, virtual stage) -> end time
    where = {}                      # (kind, mb, virtual stage) -> (rank, step)
    for r, steps in enumerate(schedule):
        for k, a in enumerate(steps):
            where[a.kind, a.mb, a.chunk * p + r] = (r, k)
    pos, free, timeline = [0] * p, [0.0] * p, []
    while True:
        moved = False
        for r in range(p):
            while pos[r] < len(schedule[r]):
                a = schedule[r][pos[r]]
                need = _needs(a, r, p, v)
                if need and need[:3] not in done:
                    break
                ready = done[need[:3]] if need else 0.0
                start = max(ready, free[r])
                free[r] = start + cost(r, a)
                done[a.kind, a.mb, a.chunk * p + r] = free[r]
                timeline.append(dict(rank=r, step=pos[r], kind=a.kind, mb=a.mb, chunk=a.chunk,
                                     start=start, end=free[r]))
                pos[r] += 1
                moved = True
        if all(pos[r] == len(schedule[r]) for r in range(p)):
            return timeline
        if not moved:
            raise ScheduleError(_deadlock(schedule, pos, where, p, v))


def _deadlock(schedule, pos, where, p, v):
    """Follow who waits for whom until a rank repeats: that cycle is the deadlock."""
    r = next(r for r in range(p) if pos[r] < len(schedule[r]))
    chain, visited = [], set()
    while r not in visited:
        visited.add(r)
        a = schedule[r][pos[r]]
        kind, mb, vs, src = _needs(a, r, p, v)
        what = "activation" if kind == "F" else "gradient"
        _, k = where[kind, mb, vs]
        sender = (f"its step {k}, and that step waits too" if k == pos[src] else
                  f"its step {k}, behind its step {pos[src]}, where it waits")
        chain.append(f"rank {r}'s step {pos[r]} ({describe(a, v)}) waits for micro-batch {mb}'s "
                     f"{what} from rank {src}, which rank {src} only sends at {sender}")
        r = src
    return "the schedule deadlocks: " + "; ".join(chain) + f" — {RULE_DEADLOCK}."


def bubble(timeline, p):
    """Idle share of the p ranks' time between the first start and the last end."""
    begin = min(e["start"] for e in timeline)
    span = max(e["end"] for e in timeline) - begin
    return 1.0 - sum(e["end"] - e["start"] for e in timeline) / (p * span)


def peak_held(steps):
    """Most forwards whose activations a rank holds at once (a backward frees one)."""
    held = peak = 0
    for a in steps:
        held += 1 if a.kind == "F" else -1
        peak = max(peak, held)
    return peak
