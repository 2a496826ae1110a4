"""The TCPStore rendezvous as a sequence picture: who talks to whom, in which order.

One lifeline for the store (hosted by rank 0, by torchrun's agent, or by distlab.run's parent)
and one per rank; time runs downwards. The steps are those `init_process_group` takes, and
those `distlab.rendezvous.toy_rendezvous` takes by hand.
"""
import matplotlib.pyplot as plt
from matplotlib.patches import FancyArrowPatch
from matplotlib.path import Path

STORE_COLOR, RANK_COLOR, PEER_COLOR = "#4c72b0", "#dd8452", "#55a868"


def rendezvous_sequence(world_size=3, host="rank 0's process", ax=None):
    """Draw the rendezvous of `world_size` ranks through a TCPStore living in `host`."""
    if ax is None:
        _, ax = plt.subplots(figsize=(2.2 * (world_size + 1) + 2.5, 6.2))
    xs = {"store": 0.0, **{r: 1.6 * (r + 1) for r in range(world_size)}}
    phases = [
        ("1. connect", "every rank opens a TCP connection\nto MASTER_ADDR:MASTER_PORT"),
        ("2. publish", "set(key_r, my address)"),
        ("3. wait", "wait(all keys): returns when\nthe last rank has published"),
        ("4. read", "get(key_j) for every peer j"),
        ("5. connect to peers", "ranks open direct connections;\nthe store is no longer in the way"),
        ("6. collectives", "data flows rank to rank"),
    ]
    gap = 0.22                                  # between one rank's message and the next
    pairs = [(a, b) for a in range(world_size) for b in range(a + 1, world_size)]
    # Steps 5 and 6 draw one row per pair of ranks, so no line runs along another.
    heights = [gap * world_size + 0.35] * 4 + [gap * max(len(pairs), 1) + 0.35] * 2
    top = 0.0
    bottom = top - sum(heights) - 0.3

    labels = {"store": f"TCPStore\n(in {host})", **{r: f"rank {r}" for r in range(world_size)}}
    for key, x in xs.items():
        color = STORE_COLOR if key == "store" else RANK_COLOR
        ax.plot([x, x], [top - 0.1, bottom], color=color, lw=1.2, ls="--", zorder=1)
        ax.text(x, top + 0.05, labels[key], ha="center", va="bottom", fontsize=9,
                bbox=dict(boxstyle="round,pad=0.3", fc=color, ec="none", alpha=0.25))

    def arrow(x0, x1, y, color, ls="-", style="-|>"):
        ax.annotate("", xy=(x1, y), xytext=(x0, y), zorder=2,
                    arrowprops=dict(arrowstyle=style, color=color, lw=1.2, ls=ls,
                                    shrinkA=2, shrinkB=2))

    y0 = top - 0.3
    right = xs[world_size - 1] + 0.5
    for i, (title, note) in enumerate(phases):
        rows = [y0 - gap * r for r in range(world_size)]
        middle = y0 - (heights[i] - 0.35) / 2
        ax.text(-0.9, middle, title, ha="right", va="center", fontsize=9, weight="bold")
        ax.text(right, middle, note, ha="left", va="center", fontsize=8, color="0.3")
        for r in range(world_size):
            x, y = xs[r], rows[r]
            if i == 0:
                arrow(x, xs["store"], y, STORE_COLOR)
            elif i == 1:
                arrow(x, xs["store"], y, RANK_COLOR)
                ax.text(x - 0.08, y + 0.03, f"set key_{r}", fontsize=8, ha="right",
                        va="bottom", color=RANK_COLOR)
            elif i == 2:
                # Each rank asks at its own time; the store answers all of them at once, when
                # the last key arrives.
                arrow(x, xs["store"], y, RANK_COLOR, ls=":")
                arrow(xs["store"], x, rows[-1] - gap, STORE_COLOR)
            elif i == 3:
                arrow(xs["store"], x, y, STORE_COLOR)
                ax.text(x - 0.08, y + 0.03, "all keys", fontsize=8, ha="right", va="bottom",
                        color=STORE_COLOR)
        if i == 2:
            ax.text(xs["store"] + 0.08, rows[-1] - gap + 0.03, "ok, all here", fontsize=8,
                    va="bottom", color=STORE_COLOR)
        if i in (4, 5):
            # Every pair of ranks gets its own connection (gloo builds a full mesh), each on its
            # own row. A connection that skips ranks arcs over their lifelines, half a row high
            # whatever its length (so it meets no other row's line), and each lifeline it passes
            # has a short gap there: the line jumps over the rank, it does not stop at it.
            for k, (a, b) in enumerate(pairs):
                y = y0 - gap * k
                span = xs[b] - xs[a]
                style = "<|-|>" if i == 5 else "-"
                if b - a == 1:
                    ax.annotate("", xy=(xs[b], y), xytext=(xs[a], y), zorder=2,
                                arrowprops=dict(arrowstyle=style, color=PEER_COLOR, lw=1.2,
                                                shrinkA=2, shrinkB=2))
                else:
                    # A quadratic curve with its control point a row above the middle: it peaks
                    # half a row above its own, and x runs linearly along it.
                    arc = Path([(xs[a], y), (xs[a] + span / 2, y + gap), (xs[b], y)],
                               [Path.MOVETO, Path.CURVE3, Path.CURVE3])
                    ax.add_patch(FancyArrowPatch(path=arc, arrowstyle=style, color=PEER_COLOR,
                                                 lw=1.2, mutation_scale=10, zorder=2))
                for skipped in range(a + 1, b):
                    t = (xs[skipped] - xs[a]) / span       # x runs linearly along this curve
                    yc = y + 2 * t * (1 - t) * gap
                    ax.plot([xs[skipped]] * 2, [yc - 0.3 * gap, yc + 0.3 * gap], color="white",
                            lw=3, zorder=1.5, solid_capstyle="butt")
                if i == 4:
                    ax.plot([xs[a], xs[b]], [y, y], "o", color=PEER_COLOR, ms=3, zorder=3)
        y0 -= heights[i]
    ax.set_xlim(-3.0, xs[world_size - 1] + 3.2)
    ax.set_ylim(bottom, top + 0.7)
    ax.axis("off")
    ax.set_title(f"Rendezvous of {world_size} ranks through a TCPStore", fontsize=11)
    return ax
