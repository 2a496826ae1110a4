"""The closed forms: each schedule's idle fraction with equal stages (what `simulate` is
checked against)."""
from .. import _argcheck as check
from .actions import _check

# the schedules the package builds (DualPipe's have no closed form here: dualpipe_bubble)
NAMES = ("GPipe", "1F1B", "interleaved 1F1B", "ZB-H1", "ZB-V", "DualPipeV", "DualPipe")


def theory_bubble(p, m, v=1):
    """Idle fraction of GPipe/1F1B with equal stages: (p - 1) / (m + p - 1); v chunks divide it."""
    _check(p, m), check.whole(v, "v (chunks per stage)", at_least=1)
    return (p - 1) / (v * m + p - 1)


def zb_h1_bubble(p, m, t_f=1.0, t_i=1.0, t_w=1.0):
    """Idle fraction of ZB-H1 with equal stages, m >= p and W no longer than F or I: each stage
    idles (p - 1)(t_f + t_i - t_w) - the W's fill part of the ramp - against 1F1B's
    (p - 1)(t_f + t_i + t_w). With t_f = t_i = t_w: (p - 1) / (3m + p - 1)."""
    _check(p, m), _check_times(t_f=t_f, t_i=t_i, t_w=t_w)
    idle = (p - 1) * (t_f + t_i - t_w)
    return idle / (m * (t_f + t_i + t_w) + idle)


def zb_v_bubble(p, m):
    """Idle fraction of ZB-V with equal stages, F = I = W and m >= 2p - 1, as `simulate` finds
    it: each stage idles p - 1 forwards of a chunk — half a stage's, so half ZB-H1's idle time —
    against m (F + I + W) of work: (p - 1) / (6m + p - 1)."""
    _check(p, m)
    return (p - 1) / (6 * m + p - 1)


def theory(name, p, m, v=1):
    """The bubble formula of a named schedule (equal stages; F = I = W in time for ZB-H1 and
    ZB-V, B = I + W)."""
    if name not in NAMES:
        raise ValueError(f"unknown schedule {name!r}; choose one of {list(NAMES)}.")
    if name == "ZB-H1":
        return zb_h1_bubble(p, m) if m >= p else None
    if name == "ZB-V":
        return zb_v_bubble(p, m) if m >= 2 * p - 1 else None
    return theory_bubble(p, m, v if name == "interleaved 1F1B" else 1)


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
    _check_even(p), _check_times(t_f=t_f, t_b=t_b, t_w=t_w)
    t_fb = t_f + t_b if t_fb is None else t_fb
    return (p / 2 - 1) * (t_fb + t_b - 3 * t_w)


def _check_even(p):
    if check.whole(p, "p", at_least=2) % 2:
        raise ValueError(f"DualPipe's p must be even (its ranks, or DualPipeV's chunks: twice its "
                         f"ranks); got {p}.")


def _check_times(**times):
    for name, t in times.items():
        check.positive(t, name, allow_zero=name in ("t_w", "comm"), example=1.0)
