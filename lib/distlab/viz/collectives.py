"""Pictures of collectives, drawn from what the ranks of a real run returned.

    results = distlab.run(fn, 4)            # each rank returns (before, after)
    before_after(results, "all_reduce(SUM)")
    plt.show()

Ranks are rows and tensor elements are cells. A cell of the "after" table takes the colour of the
rank whose "before" table held that exact value (the picture works out where data travelled by
looking, it is never told); values no single rank held - sums, averages - are grey. Give each
rank distinct values (rank r holds 10*(r+1) + i) and the colours tell the whole story. Looking
can be fooled by a coincidence - the average of 10, 20 and 30 is rank 1's 20 - so choose inputs
whose reductions are nobody's value.

`timeline` draws per-rank spans (barrier arrivals, compute next to communication).
"""
import math

import matplotlib.pyplot as plt
from matplotlib.patches import Patch, Rectangle

MIXED = "#d9d9d9"      # a value no single rank held before: reduced from several
UNKNOWN = "#ffffff"
_CELL_W, _CELL_H = 0.52, 0.42


def rank_colour(rank):
    return plt.get_cmap("tab10")(rank % 10)


def _light(colour, amount=0.55):
    r, g, b = colour[:3]
    return (r + (1 - r) * amount, g + (1 - g) * amount, b + (1 - b) * amount, 1.0)


def as_row(x):
    """(values, chunk boundaries) of what one rank holds; None stays None (nothing to show).

    A tensor is flattened; a list of tensors (all_gather's list, scatter's chunks) is laid end to
    end, with a boundary after each piece so the chunks stay visible.
    """
    if x is None:
        return None
    if hasattr(x, "detach"):
        return [float(v) for v in x.detach().reshape(-1).tolist()], []
    if isinstance(x, (list, tuple)):
        values, bounds = [], []
        for piece in x:
            row = as_row(piece)
            if row is None:
                raise TypeError("a list of pieces may not contain None; show the whole row as None")
            values += row[0]
            bounds.append(len(values))
        return values, bounds[:-1]
    if isinstance(x, (int, float)):
        return [float(x)], []
    raise TypeError(f"before_after draws tensors, lists of tensors, numbers or None; "
                    f"got {type(x).__name__}.")


def sources(before_rows, values):
    """For each value, the rank whose `before` row held it (if exactly one did), else None."""
    owners = {}
    for rank, row in enumerate(before_rows):
        if row is None:
            continue
        for v in row[0]:
            owners.setdefault(_key(v), set()).add(rank)
    found = []
    for v in values:
        ranks = owners.get(_key(v), set())
        found.append(next(iter(ranks)) if len(ranks) == 1 else None)
    return found


def _key(v):
    # Values travel bit-exact through every data-moving collective; rounding only merges
    # float noise such as 0.1 + 0.2 printed back.
    return round(v, 6)


def _fmt(v):
    if math.isnan(v):
        return "nan"
    if v == int(v) and abs(v) < 1e6:
        return str(int(v))
    return f"{v:.3g}"


def _draw_table(ax, rows, colours, title, ncols):
    n = len(rows)
    for r, row in enumerate(rows):
        y = n - 1 - r
        if row is None:
            ax.add_patch(Rectangle((0, y), max(ncols, 1), 1, facecolor="white", edgecolor="#999999",
                                   hatch="///", linewidth=0.8))
            ax.text(max(ncols, 1) / 2, y + 0.5, "nothing defined on this rank", ha="center",
                    va="center", fontsize=8, color="#555555",
                    bbox=dict(facecolor="white", edgecolor="none", pad=1))
            continue
        values, bounds = row
        for c, v in enumerate(values):
            ax.add_patch(Rectangle((c, y), 1, 1, facecolor=colours[r][c], edgecolor="white",
                                   linewidth=1.5))
            ax.text(c + 0.5, y + 0.5, _fmt(v), ha="center", va="center", fontsize=9)
        for b in bounds:
            ax.plot([b, b], [y, y + 1], color="black", linewidth=2)
    ax.set_xlim(0, max(ncols, 1))
    ax.set_ylim(0, n)
    ax.set_yticks([n - 1 - r + 0.5 for r in range(n)])
    ax.set_yticklabels([f"rank {r}" for r in range(n)])
    ax.set_xticks([])
    ax.tick_params(length=0)
    for side in ax.spines.values():
        side.set_visible(False)
    ax.set_title(title, fontsize=10)


def before_after(results, title="", before=None, after=None, note=None, colour_sources=True):
    """Draw one collective: what every rank held before it and after it. Returns the Figure.

    results: what `distlab.run` returned when each rank returned `(before, after)`; or pass
    `before=` and `after=` lists (one entry per rank) instead. An entry is a tensor, a list of
    tensors (drawn end to end with a bar between pieces) or None (nothing defined on that rank,
    like gather's output off the destination rank).
    """
    if results is not None:
        try:
            before, after = [r[0] for r in results], [r[1] for r in results]
        except (TypeError, IndexError, KeyError):
            raise TypeError("before_after needs one (before, after) pair per rank, e.g. each rank "
                            "returns `before, after`.") from None
    if before is None or after is None or len(before) != len(after):
        raise ValueError("before_after needs a `before` and an `after` entry for every rank.")
    before_rows = [as_row(x) for x in before]
    after_rows = [as_row(x) for x in after]

    before_colours = [None if row is None else [_light(rank_colour(rank))] * len(row[0])
                      for rank, row in enumerate(before_rows)]
    after_colours = []
    for row in after_rows:
        if row is None:
            after_colours.append(None)
        elif colour_sources:
            after_colours.append([MIXED if s is None else _light(rank_colour(s))
                                  for s in sources(before_rows, row[0])])
        else:
            after_colours.append([UNKNOWN] * len(row[0]))

    n = len(before_rows)
    cols_before = max([len(r[0]) for r in before_rows if r is not None] + [1])
    cols_after = max([len(r[0]) for r in after_rows if r is not None] + [1])
    width = (cols_before + cols_after) * _CELL_W + 2.4
    fig, (left, right) = plt.subplots(
        1, 2, figsize=(max(width, 6.0), n * _CELL_H + 1.3),
        gridspec_kw=dict(width_ratios=[cols_before, cols_after], wspace=0.25))
    _draw_table(left, before_rows, before_colours, "before", cols_before)
    _draw_table(right, after_rows, after_colours, "after", cols_after)
    right.set_yticklabels([])
    fig.suptitle(title, fontsize=12, fontweight="bold")
    used = {c for row in after_colours if row for c in row}
    legend = [Patch(facecolor=_light(rank_colour(r)), label=f"from rank {r}") for r in range(n)]
    if MIXED in used:
        legend.append(Patch(facecolor=MIXED, label="combined from several ranks"))
    per_row = min(len(legend), max(2, int(fig.get_figwidth() / 1.9)))
    legend_rows = math.ceil(len(legend) / per_row)
    fig.set_figheight(fig.get_figheight() + 0.22 * (legend_rows - 1))
    fig.legend(handles=legend, loc="lower center", ncol=per_row, fontsize=8, frameon=False)
    height = fig.get_figheight()
    if note:
        fig.text(0.5, 1 - 0.55 / height, note, ha="center", fontsize=9, style="italic")
    fig.subplots_adjust(left=1.0 / fig.get_figwidth(), right=0.98,
                        top=1 - (0.85 if note else 0.65) / height,
                        bottom=(0.25 + 0.22 * legend_rows) / height)
    return fig



def timeline(spans, title="", unit="ms", xlabel=None):
    """Per-rank spans on a shared clock: `spans[rank]` is a list of (label, start, end) in seconds.

    Times may be absolute (time.time() on each rank of one machine); the picture starts at the
    earliest. Each label gets one colour across ranks.
    """
    scale = {"s": 1.0, "ms": 1e3}[unit]
    t0 = min(s for row in spans for _, s, _ in row)
    labels = []
    for row in spans:
        for label, _, _ in row:
            if label not in labels:
                labels.append(label)
    palette = ["#9ecae1", "#fdae6b", "#a1d99b", "#bcbddc", "#fc9272", "#d9d9d9"]
    colours = {label: palette[i % len(palette)] for i, label in enumerate(labels)}
    n = len(spans)
    fig, ax = plt.subplots(figsize=(8, 0.5 * n + 1.3))
    for rank, row in enumerate(spans):
        y = n - 1 - rank
        for label, start, end in row:
            ax.barh(y, (end - start) * scale, left=(start - t0) * scale, height=0.6,
                    color=colours[label], edgecolor="black", linewidth=0.5)
    ax.set_yticks(range(n))
    ax.set_yticklabels([f"rank {r}" for r in reversed(range(n))])
    ax.set_xlabel(xlabel or f"time since the first event ({unit})")
    ax.legend(handles=[Patch(facecolor=colours[k], edgecolor="black", label=k) for k in labels],
              loc="upper center", bbox_to_anchor=(0.5, -0.35 if n < 4 else -0.22),
              ncol=len(labels), frameon=False, fontsize=9)
    ax.set_title(title, fontsize=11, fontweight="bold")
    fig.tight_layout()
    return fig


def _size_label(nbytes):
    for unit, size in (("GiB", 2 ** 30), ("MiB", 2 ** 20), ("KiB", 2 ** 10)):
        if nbytes >= size:
            return f"{nbytes / size:g} {unit}"
    return f"{nbytes:g} B"


def cost_curves(sizes, curves, points=(), ax=None, title=None, bottom_us=1.0):
    """A collective's time against its size, log-log: one line per model in `curves`
    ({label: [seconds for each size]}), published measurements as points [(label, bytes,
    seconds)]; points with the same label (one source) share a marker and one legend entry, and
    the legend sits under the axes, clear of the data. The flat start is the latency floor, the
    slope of 1 the bandwidth regime; the time axis starts at `bottom_us` (a lower bound of a few
    bytes is far below any floor)."""
    if ax is None:
        _, ax = plt.subplots(figsize=(7, 4))
    styles = ["-", "--", ":", "-."]
    for i, (label, seconds) in enumerate(curves.items()):
        ax.loglog(sizes, [t * 1e6 for t in seconds], styles[i % len(styles)], lw=2,
                  label=label)
    groups = {}
    for label, nbytes, seconds in points:
        groups.setdefault(label, []).append((nbytes, seconds * 1e6))
    for i, (label, xy) in enumerate(groups.items()):
        ax.loglog([x for x, _ in xy], [y for _, y in xy], "o^sDvPX"[i % 7], ms=8, color="black",
                  linestyle="none", label=label,
                  markerfacecolor="none" if "calibration" in label else "black")
    ticks = [s for s in sizes if math.log2(s) % 6 == 3]          # 8 B, 512 B, 32 KiB, ...
    ax.set_xticks(ticks, [_size_label(s) for s in ticks])
    ax.set_xlabel("bytes per rank")
    ax.set_ylabel("µs")
    ax.set_ylim(bottom=bottom_us)
    ax.grid(True, which="major", alpha=0.3)
    ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.16), ncol=1,
              frameon=False)
    if title:
        ax.set_title(title, fontsize=10)
    return ax
