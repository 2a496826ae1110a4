"""Pictures of a run's trace: what every rank did when, and who sent how much to whom."""
import textwrap

import matplotlib.pyplot as plt
from matplotlib.patches import Patch

from ..emulate import describe
from ..trace import _unit

COMPUTE, COMM, WAIT = "#4C72B0", "#DD8452", "#C44E52"


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
    for r in range(trace.world_size):
        y = r
        for s in trace.compute(r):
            if s["start"] < end:
                ax.barh(y - 0.18, (min(s["end"], end) - s["start"]) * scale, left=s["start"] * scale,
                        height=0.34, color=COMPUTE, lw=0)
        for e in trace.comm(r):
            if e["start"] is None or e["end"] is None or e["start"] >= end:
                continue
            ax.barh(y + 0.18, (min(e["end"], end) - e["start"]) * scale, left=e["start"] * scale,
                    height=0.3, color=COMM, edgecolor="black", lw=0.3)
            if e["waited"] > 0:
                ax.barh(y + 0.18, e["waited"] * scale, left=(e["end"] - e["waited"]) * scale,
                        height=0.12, color=WAIT, lw=0)
            if labels and (e["end"] - e["start"]) * scale > 0.06 * end * scale:
                ax.text((e["start"] + e["end"]) / 2 * scale, y + 0.18, _short(e), ha="center",
                        va="center", fontsize=8)
    ax.set_yticks(range(trace.world_size), [f"rank {r}" for r in range(trace.world_size)])
    ax.invert_yaxis()
    ax.set_xlim(0, end * scale * 1.02)
    source = getattr(trace, "source", None)     # a torch.profiler trace read back, say so
    if source and trace.emulated is None:
        ax.set_xlabel(f"{unit} since the first event ({source})")
    else:
        ax.set_xlabel(f"{unit} since the function started" +
                      (" (modeled)" if trace.emulated is not None else
                       " (measured on this machine)"))
    heading = title or "what every rank did"
    if trace.emulated is not None:
        # fonts lack the emoji; wrapped, or a multi-link preset's line widens the figure 2×
        heading += "\n" + textwrap.fill(describe(trace.emulated).lstrip("⏱ "), 130)
    ax.set_title(heading, fontsize=9)
    ax.legend(handles=[Patch(color=COMPUTE, label="compute"),
                       Patch(color=COMM, label="communication in flight"),
                       Patch(color=WAIT, label="blocked in a call\n(its own transfer included)")],
              loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8)
    return ax


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
    for unit, size in (("MB", 1e6), ("KB", 1e3)):
        if b >= size:
            return f"{b / size:.3g} {unit}"
    return f"{b} B"
