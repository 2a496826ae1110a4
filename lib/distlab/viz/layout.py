"""Which rank holds what on a (dp, pp, tp) mesh, who talks to whom, and where the nodes end."""
from fractions import Fraction

import matplotlib.pyplot as plt
from matplotlib.patches import ConnectionPatch, FancyArrowPatch, Rectangle

from ..parallel3d import layout_table, stage_bounds

STAGE_COLOURS = ("#4C72B0", "#DD8452", "#55A868", "#C44E52", "#8172B3", "#937860")
# One colour per kind of communication, the same in every panel and in the legend.
TP_COLOUR, PP_COLOUR, DP_COLOUR = "#222222", "#7A1FA2", "#D62728"


def draw_layout(dp=2, pp=2, tp=2, n_layers=4, gpus_per_node=None):
    """Replicas side by side; in each, a row per pipeline stage, a column per tp rank.

    A square names its rank and what it holds: its 1/tp of every matrix of the stage's blocks,
    and, whole (replicated across tp, not split), the embeddings on the first stage and the
    final LayerNorm and head on the last. Same colour = same layers. Arrows: the tp all-reduces
    inside a stage (every layer), the pp sends between stages (every micro-batch), the dp
    all-reduce between replicas (once per step; drawn for one rank position). With
    `gpus_per_node`, a dashed frame marks each node (ranks are numbered node by node).
    """
    rows = layout_table(dp, pp, tp, n_layers)
    bounds = stage_bounds(n_layers, pp)
    fig, axes = plt.subplots(1, dp, figsize=(3.4 * dp * max(1, tp / 2), 1.6 * pp + 1.8),
                             squeeze=False)
    for d, ax in enumerate(axes[0]):
        for rank, (rd, p, t), _ in rows:
            if rd != d:
                continue
            y = pp - 1 - p
            ax.add_patch(Rectangle((t, y), 0.8, 0.78, color=STAGE_COLOURS[p % 6], alpha=0.85))
            a, b = bounds[p]
            blocks = f"blk {a}" if b - a == 1 else f"blk {a}-{b - 1}"
            whole = ["emb"] if p == 0 else []
            whole += ["head"] if p == pp - 1 else []
            ax.text(t + 0.4, y + 0.6, f"rank {rank}", ha="center", va="center", color="white",
                    fontsize=10, fontweight="bold")
            label = f"{blocks}: 1/{tp}" + (f"\n{' + '.join(whole)}: whole" if whole else "")
            ax.text(t + 0.4, y + 0.27, label, ha="center", va="center", color="white",
                    fontsize=8)
        for p in range(pp):                     # tp all-reduce between neighbours of a stage
            y = pp - 1 - p + 0.39
            for t in range(tp - 1):
                ax.add_patch(FancyArrowPatch((t + 0.8, y), (t + 1, y), arrowstyle="<|-|>",
                                             mutation_scale=9, color=TP_COLOUR, lw=1.2))
        for p in range(pp - 1):                 # pp send to the next stage, same tp position
            for t in range(tp):
                ax.add_patch(FancyArrowPatch((t + 0.4, pp - 1 - p), (t + 0.4, pp - 2 - p + 0.78),
                                             arrowstyle="-|>", mutation_scale=9,
                                             color=PP_COLOUR, lw=1.2))
        if gpus_per_node:
            _node_frames(ax, rows, d, pp, gpus_per_node)
        ax.set_xlim(-0.1, tp)
        ax.set_ylim(-0.1, pp + (0.75 if dp > 1 else 0))   # headroom for the dp arc
        ax.set_aspect("equal")
        ax.set_xticks([t + 0.4 for t in range(tp)], [f"tp {t}" for t in range(tp)])
        ax.set_yticks([pp - 1 - p + 0.39 for p in range(pp)],
                      [f"stage {p}" if d == 0 else "" for p in range(pp)])   # one label per row
        ax.tick_params(length=0)
        for s in ax.spines.values():
            s.set_visible(False)
        ax.set_title(f"replica dp={d}: batch part {d + 1} of {dp}", fontsize=10)
    for d in range(dp - 1):                     # dp all-reduce: the same (p, t) in the next replica
        _dp_arc(fig, axes[0][d], axes[0][d + 1], rows, d, pp)
    handles = [FancyArrowPatch((0, 0), (1, 0), color=c, arrowstyle="-|>")
               for c in (TP_COLOUR, PP_COLOUR, DP_COLOUR)[:2 + (dp > 1)]]
    names = ["tp all-reduce (every layer)", "pp send (every micro-batch)",
             "dp all-reduce (once per step)"][:len(handles)]
    if gpus_per_node:
        handles.append(Rectangle((0, 0), 1, 1, fill=False, ls="--", ec="#555555"))
        names.append(f"one node ({gpus_per_node} GPUs)")
    fig.legend(handles, names, loc="lower center", ncol=2, fontsize=9, frameon=False,
               handler_map={FancyArrowPatch: _ArrowHandler()})
    fig.suptitle(f"{dp * pp * tp} ranks as dp={dp} × pp={pp} × tp={tp}", fontsize=11)
    fig.tight_layout(rect=(0, 0.15, 1, 1))
    return fig


def draw_reshard(saved_tp=2, loaded=(4, 1), rows=8):
    """DCP's load-time resharding of one column-parallel weight (split by rows): the chunks a
    tp=`saved_tp` run wrote, and for each layout in `loaded` the rows each rank asks for — every
    rank reads only the parts of the saved chunks its own shard overlaps."""
    layouts = [saved_tp, *loaded]
    fig, ax = plt.subplots(figsize=(8.5, 0.9 + 0.8 * len(layouts)))
    writer = lambda r: r * saved_tp // rows                      # noqa: E731 (who wrote row r)
    for k, tp in enumerate(layouts):
        y = len(layouts) - 1 - k
        per = rows // tp
        for rank in range(tp):
            lo, hi = rank * per, (rank + 1) * per
            for r in range(lo, hi):                               # one coloured cell per row:
                ax.add_patch(Rectangle((r, y + 0.15), 1, 0.6,    # the file it is read from
                                       color=STAGE_COLOURS[writer(r)], alpha=0.85 if k else 1))
            ax.add_patch(Rectangle((lo + 0.04, y + 0.15), per - 0.08, 0.6, fill=False, lw=2,
                                   ec="black"))
            files = sorted({writer(r) for r in range(lo, hi)})
            share = Fraction(per * saved_tp, rows)               # of one saved chunk
            what = (f"{share} of chunk {files[0]}" if share < 1 else
                    "chunk " + " + ".join(map(str, files)))
            said = f"rank {rank}: chunk {rank}" if k == 0 else f"rank {rank}:\n{what}"
            ax.text((lo + hi) / 2, y + 0.45, said, ha="center", va="center", fontsize=8,
                    color="white", fontweight="bold")
        ax.text(-0.2, y + 0.45, f"saved by tp={tp}" if k == 0 else f"loaded as tp={tp}",
                ha="right", va="center", fontsize=9)
    ax.set_xlim(-2.6, rows + 0.1)
    ax.set_ylim(0, len(layouts))
    ax.set_xticks([r + 0.5 for r in range(rows)], [f"row {r}" for r in range(rows)], fontsize=8)
    ax.set_yticks([])
    for side in ax.spines.values():
        side.set_visible(False)
    ax.set_title(f"one column-parallel weight ({rows} rows): colour = the saved chunk a row is "
                 f"read from", fontsize=10)
    fig.tight_layout()
    return fig


def _dp_arc(fig, ax_a, ax_b, rows, d, pp):
    """The dp all-reduce of one rank position: from the top of stage 0, tp 0 in replica d over
    to the same square in replica d + 1 (its dp peer), with the two ranks named."""
    peer = {(rd, p, t): rank for rank, (rd, p, t), _ in rows}
    top = pp - 1 + 0.78                         # stage 0's row, the top edge of its squares
    fig.add_artist(ConnectionPatch((0.4, top), (0.4, top), "data", "data", axesA=ax_a,
                                   axesB=ax_b, arrowstyle="<|-|>", mutation_scale=9,
                                   color=DP_COLOUR, lw=1.2, linestyle="--",
                                   connectionstyle="arc3,rad=-0.2"))
    ax_a.text(0.4, top + 0.45, f"rank {peer[(d, 0, 0)]} ↔ rank {peer[(d + 1, 0, 0)]}", ha="left",
              va="bottom", fontsize=8, color=DP_COLOUR)


def _node_frames(ax, rows, d, pp, gpus_per_node):
    """A dashed frame around the squares of each node in replica d's panel."""
    nodes = {}
    for rank, (rd, p, t), _ in rows:
        if rd == d:
            nodes.setdefault(rank // gpus_per_node, []).append((t, pp - 1 - p))
    for node, cells in nodes.items():
        x0, y0 = min(x for x, _ in cells), min(y for _, y in cells)
        x1, y1 = max(x for x, _ in cells) + 0.8, max(y for _, y in cells) + 0.78
        ax.add_patch(Rectangle((x0 - 0.07, y0 - 0.07), x1 - x0 + 0.14, y1 - y0 + 0.14,
                               fill=False, ls="--", lw=1.2, ec="#555555"))
        ax.text(x1 + 0.07, y1 + 0.09, f"node {node}", ha="right", va="bottom", fontsize=8,
                color="#555555")


class _ArrowHandler:
    """Draws a legend entry as the arrow it stands for."""

    def legend_artist(self, legend, orig, fontsize, box):
        arrow = FancyArrowPatch((0, box.height / 2), (box.width, box.height / 2),
                                arrowstyle=orig.get_arrowstyle(), mutation_scale=9,
                                color=orig.get_edgecolor(), lw=1.2,
                                transform=box.get_transform())
        box.add_artist(arrow)
        return arrow
