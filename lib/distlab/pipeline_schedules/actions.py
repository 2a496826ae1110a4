"""What a schedule is made of: actions, the Schedule list that knows its placement, and where
each chunk of the model sits (the "loop", "v" and "dual" placements of the package doc)."""
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
    _check_chunk(rank, chunk, p, placement)
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


def _check_chunk(rank, chunk, p, placement):
    # a rank or chunk past the end would name another stage's piece without a word
    chunks = "0 or 1" if placement in ("v", "dual") else "at least 0"
    if not 0 <= rank < p:
        raise ValueError(f"rank must be from 0 to {p - 1} ({p} stages); got {rank!r}.")
    if chunk < 0 or (placement in ("v", "dual") and chunk > 1):
        raise ValueError(f"chunk must be {chunks} in the {placement!r} placement; got {chunk!r}.")


def _check(p, m):
    for name, value in (("p (stages)", p), ("m (micro-batches)", m)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a whole number >= 1; got {value!r}.")


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
