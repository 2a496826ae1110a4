"""Pictures of a run's trace: what every rank did when, and who sent how much to whom."""
import matplotlib.pyplot as plt
from matplotlib.patches import Patch

from ..trace import _unit

COMPUTE, COMM, WAIT = "#4C72B0", "#DD8452", "#C44E52"
LABEL = "timeline-event-label"        # the gid of an event's label (tests find them by it)


def timeline(trace, ax=None, title=None, until=None, labels=True):
    """One row per rank: compute (blue) above, communication in flight (orange) below it, and in
    red the time the rank sat blocked inside a call: waiting for its peers AND for the call's own
    transfer (a blocking all-reduce is red for its whole length once every member has arrived).

    Times in the unit that suits the run; under emulation the title says it is modeled.
    """
    end = until or trace.end()
    unit, scale = _unit(end)
    if ax is None:
        _, ax = plt.subplots(figsize=(10, 0.55 * trace.world_size + 1.4))
    placed = []
    for r in range(trace.world_size):
        y = r
        for s in trace.compute(r):
            if s["start"] < end:
                ax.barh(y - 0.18, (min(s["end"], end) - s["start"]) * scale, left=s["start"] * scale,
                        height=0.34, color=COMPUTE, lw=0)
        shown = [e for e in trace.comm(r) if e["start"] is not None and e["end"] is not None
                 and e["start"] < end]
        for e in shown:
            ax.barh(y + 0.18, (min(e["end"], end) - e["start"]) * scale, left=e["start"] * scale,
                    height=0.3, color=COMM, edgecolor="black", lw=0.3)
            if e["waited"] > 0:
                ax.barh(y + 0.18, e["waited"] * scale, left=(e["end"] - e["waited"]) * scale,
                        height=0.12, color=WAIT, lw=0)
        if labels:
            # Concurrent calls (a ring step's send right and receive left) share ONE label,
            # "→1 ←3": drawn at each bar, their labels would sit on top of each other.
            for start, stop, text in _clusters(shown, end):
                placed.append((r, start * scale, stop * scale,
                               ax.text((start + stop) / 2 * scale, y + 0.18, text, ha="center",
                                       va="center", fontsize=8, gid=LABEL)))
    ax.set_yticks(range(trace.world_size), [f"rank {r}" for r in range(trace.world_size)])
    ax.invert_yaxis()
    ax.set_xlim(0, end * scale * 1.02)
    if placed:
        _drop_crowded(ax, placed)
    source = getattr(trace, "source", None)     # a torch.profiler trace read back, say so
    if source and trace.emulated is None:
        ax.set_xlabel(f"{unit} since the first event ({source})")
    else:
        ax.set_xlabel(f"{unit} since the function started" +
                      (" (modeled)" if trace.emulated is not None else
                       " (measured on this machine)"))
    heading = title or "what every rank did"
    if trace.emulated is not None:
        # One line: the run's cell prints the cluster's full description ("⏱ emulated: ...").
        heading += f"\nemulated on {trace.emulated.name}: times modeled, not measured"
    ax.set_title(heading, fontsize=9)
    ax.legend(handles=[Patch(color=COMPUTE, label="compute"),
                       Patch(color=COMM, label="communication in flight"),
                       Patch(color=WAIT, label="blocked in a call\n(its own transfer included)")],
              loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8)
    return ax


def _clusters(events, end):
    """[(start, stop, label)]: the rank's calls that overlap in time, merged, each with the
    short labels of its calls ("→1 ←3"), in the order they were issued."""
    out = []
    for e in sorted(events, key=lambda e: (e["start"], e.get("seq", 0))):
        stop = min(e["end"], end)
        if out and e["start"] < out[-1][1]:
            first, last, names = out[-1]
            if _short(e) not in names:
                names.append(_short(e))
            out[-1] = (first, max(last, stop), names)
        else:
            out.append((e["start"], stop, [_short(e)]))
    return [(a, b, " ".join(names)) for a, b, names in out]


def _drop_crowded(ax, placed):
    """Keep a label only where it fits: inside its own bar's span and clear of every label kept
    before it on its row (a label that does not fit is removed, never drawn over another)."""
    fig = ax.figure
    renderer = fig.canvas.get_renderer()
    kept = {}
    for row, left, right, text in placed:
        box = text.get_window_extent(renderer)
        (x0, _), (x1, _) = ax.transData.transform([(left, 0), (right, 0)])
        clear = all(box.x1 <= other.x0 or box.x0 >= other.x1 for other in kept.get(row, ()))
        if box.width <= (x1 - x0) and clear:
            kept.setdefault(row, []).append(box)
        else:
            text.remove()


def label_boxes(ax):
    """The window extents of the event labels a timeline kept on `ax` (for tests)."""
    renderer = ax.figure.canvas.get_renderer()
    return [t.get_window_extent(renderer) for t in ax.texts if t.get_gid() == LABEL]


def _short(e):
    if e["op"] in ("send", "recv"):
        arrow = "→" if e["op"] == "send" else "←"
        return f"{arrow}{e['peer']}"
    return e["op"].replace("_", " ")


def matrix(trace, ax=None, title="bytes sent by point-to-point messages"):
    """A heat map: row = sender, column = receiver, the bytes each sent the other."""
    m = trace.matrix()
    n = trace.world_size
    if ax is None:
        _, ax = plt.subplots(figsize=(1.0 + 0.6 * n, 0.8 + 0.6 * n))
    top = max(max(row) for row in m) or 1
    ax.imshow(m, cmap="Oranges", vmin=0, vmax=top)
    for i in range(n):
        for j in range(n):
            if m[i][j]:
                ax.text(j, i, _bytes(m[i][j]), ha="center", va="center", fontsize=8,
                        color="white" if m[i][j] > 0.6 * top else "black")
    ax.set_xticks(range(n), [str(j) for j in range(n)])
    ax.set_yticks(range(n), [str(i) for i in range(n)])
    ax.set_xlabel("to rank")
    ax.set_ylabel("from rank")
    ax.set_title(title, fontsize=9)
    return ax


def _bytes(b):
    # Binary units: the tensors' sizes are powers of two (6 × 256 KiB reads 1.5 MiB, not 1.57 MB).
    for unit, size in (("GiB", 2 ** 30), ("MiB", 2 ** 20), ("KiB", 2 ** 10)):
        if b >= size:
            return f"{b / size:.3g} {unit}"
    return f"{b} B"
