"""Which rank holds what on a (dp, pp, tp) mesh: one panel per data-parallel replica."""
import matplotlib.pyplot as plt
from matplotlib.patches import Rectangle

from ..parallel3d import layout_table, stage_bounds

STAGE_COLOURS = ("#4C72B0", "#DD8452", "#55A868", "#C44E52", "#8172B3", "#937860")


def draw_layout(dp=2, pp=2, tp=2, n_layers=4):
    """Replicas side by side; in each, a row per pipeline stage, a column per tp rank.

    A square names its rank and what it holds: the stage's blocks (1/tp of every matrix), the
    embeddings on the first stage, the head on the last. Same colour = same layers.
    """
    rows = layout_table(dp, pp, tp, n_layers)
    bounds = stage_bounds(n_layers, pp)
    fig, axes = plt.subplots(1, dp, figsize=(3.2 * dp * max(1, tp / 2), 1.4 * pp + 0.9),
                             squeeze=False)
    for d, ax in enumerate(axes[0]):
        for rank, (rd, p, t), _ in rows:
            if rd != d:
                continue
            y = pp - 1 - p
            ax.add_patch(Rectangle((t, y), 0.92, 0.88, color=STAGE_COLOURS[p % 6], alpha=0.85))
            a, b = bounds[p]
            extra = ("emb + " if p == 0 else "") + (f"blk {a}" if b - a == 1 else f"blk {a}-{b - 1}")
            extra += " + head" if p == pp - 1 else ""
            ax.text(t + 0.46, y + 0.58, f"rank {rank}", ha="center", va="center", color="white",
                    fontsize=10, fontweight="bold")
            ax.text(t + 0.46, y + 0.28, f"{extra}\nshard {t + 1}/{tp}", ha="center",
                    va="center", color="white", fontsize=8)
        ax.set_xlim(-0.05, tp)
        ax.set_ylim(-0.05, pp)
        ax.set_aspect("equal")
        ax.set_xticks([t + 0.46 for t in range(tp)], [f"tp {t}" for t in range(tp)])
        ax.set_yticks([pp - 1 - p + 0.44 for p in range(pp)], [f"stage {p}" for p in range(pp)])
        ax.tick_params(length=0)
        for s in ax.spines.values():
            s.set_visible(False)
        ax.set_title(f"replica dp={d}: batch part {d + 1} of {dp}", fontsize=10)
    fig.suptitle(f"{dp * pp * tp} ranks as dp={dp} × pp={pp} × tp={tp}", fontsize=11)
    fig.tight_layout()
    return fig
