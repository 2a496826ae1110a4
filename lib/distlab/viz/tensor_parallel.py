"""y = x·W split two ways across tensor-parallel ranks, drawn as coloured blocks.

Colour = the rank that holds the piece; grey = every rank holds the same thing (replicated).
Column-parallel: W split by output features (columns of W), each rank makes a slice of y.
Row-parallel: W split by input features (rows of W) and x likewise; each rank makes a partial
y of full size, and the true y is their sum.
"""
import matplotlib.pyplot as plt
from matplotlib.patches import Rectangle

REPLICATED = "#bdbdbd"


def rank_colour(rank):
    return plt.get_cmap("tab10")(rank % 10)


def _matrix(ax, x0, y0, w, h, owners, split, label, alpha=0.85):
    """A w × h block cut into len(owners) strips ('cols' or 'rows'); owners[i] colours strip i."""
    n = len(owners)
    for i, owner in enumerate(owners):
        colour = REPLICATED if owner is None else rank_colour(owner)
        if split == "cols":
            r = Rectangle((x0 + i * w / n, y0), w / n, h)
        else:  # strip 0 on top, as rows of a matrix are read
            r = Rectangle((x0, y0 + h - (i + 1) * h / n), w, h / n)
        r.set(facecolor=colour, edgecolor="black", linewidth=1, alpha=alpha)
        ax.add_patch(r)
        if owner is not None and n > 1:
            cx = x0 + (i + 0.5) * w / n if split == "cols" else x0 + w / 2
            cy = y0 + h / 2 if split == "cols" else y0 + h - (i + 0.5) * h / n
            ax.text(cx, cy, f"r{owner}", ha="center", va="center", fontsize=8, color="white",
                    fontweight="bold")
    ax.text(x0 + w / 2, y0 - 0.25, label, ha="center", va="top", fontsize=9)


def _symbol(ax, x, y, text):
    ax.text(x, y, text, ha="center", va="center", fontsize=22, fontweight="bold")


def linear_split(kind, tp=2, ax=None):
    """Draw y = x·W split 'column' or 'row' wise over `tp` ranks, with the collective it needs."""
    if kind not in ("column", "row"):
        raise ValueError(f"kind must be 'column' or 'row'; got {kind!r}.")
    if ax is None:
        _, ax = plt.subplots(figsize=(9, 2.8))
    ranks = list(range(tp))
    xw, xh = 2.0, 1.4          # x: batch (rows) × in features (columns)
    ww, wh = 2.4, 2.0          # W: in features (rows) × out features (columns)
    y0 = 0.3
    if kind == "column":
        _matrix(ax, 0, y0 + 0.3, xw, xh, [None], "cols", "x (the same on every rank)")
        _symbol(ax, 2.45, y0 + 1.0, "·")
        _matrix(ax, 2.9, y0, ww, wh, ranks, "cols", "W split by output features")
        _symbol(ax, 5.75, y0 + 1.0, "=")
        _matrix(ax, 6.2, y0 + 0.3, ww, xh, ranks, "cols", "rank r holds y[:, slice r]")
        ax.annotate("all-gather\n→ the whole y", xy=(8.8, y0 + 1.0), xytext=(9.3, y0 + 1.0),
                    fontsize=9, va="center", arrowprops=dict(arrowstyle="<-"))
        ax.set_title(f"column-parallel over {tp} ranks: no communication until y is needed whole",
                     fontsize=10)
    else:
        _matrix(ax, 0, y0 + 0.3, xw, xh, ranks, "cols", "x split by input features")
        _symbol(ax, 2.45, y0 + 1.0, "·")
        _matrix(ax, 2.9, y0, ww, wh, ranks, "rows", "W split by input features")
        _symbol(ax, 5.75, y0 + 1.0, "=")
        step = 0.18
        for r in reversed(ranks):  # the partial sums, stacked like cards
            _matrix(ax, 6.2 + r * step, y0 + 0.3 + r * step, ww, xh, [r], "cols",
                    "Σ of full-size partial y's" if r == 0 else "", alpha=0.75)
        ax.annotate("all-reduce\n→ y", xy=(8.8 + tp * step, y0 + 1.0),
                    xytext=(9.3 + tp * step, y0 + 1.0), fontsize=9, va="center",
                    arrowprops=dict(arrowstyle="<-"))
        ax.set_title(f"row-parallel over {tp} ranks: each rank's product is a partial sum of y",
                     fontsize=10)
    ax.set_xlim(-0.2, 11.2)
    ax.set_ylim(-0.5, 2.7)
    ax.set_aspect("equal")
    ax.axis("off")
    return ax


def column_and_row(tp=2):
    """Both splits, one above the other."""
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(9, 5.6))
    linear_split("column", tp, top)
    linear_split("row", tp, bottom)
    fig.tight_layout()
    return fig


# ---- a whole block: where every collective sits -------------------------------------------------

SHARDED = "#4C72B0"        # split over the TP ranks by heads / hidden features (a TP region)
SEQUENCE = "#55A868"       # split over the TP ranks along the sequence (an SP region)
COMM = "#C44E52"


def _block_row(sequence_parallel):
    """The boxes and collectives of one transformer block, in order: ("box", label, colour, note
    about its parameters' gradients) or
    ("comm", name, forward, backward). The layout is Megatron-LM's (Shoeybi et al. 2019, fig. 3;
    Korthikanti et al. 2022, fig. 5), as distlab.tensor_parallel.ParallelBlock runs it."""
    outside = SEQUENCE if sequence_parallel else REPLICATED
    if sequence_parallel:
        enter = ("comm", "all-gather", "all-gather\n(sequence)", "reduce-scatter")
        leave = ("comm", "reduce-scatter", "reduce-scatter\n(sequence)", "all-gather")
    else:
        enter = ("comm", "f", "identity", "all-reduce")
        leave = ("comm", "g", "all-reduce", "identity")
    # Under SP a replicated parameter sees only this rank's tokens: its gradient is all-reduced
    # in backward (tensor_parallel.replicated) - the LayerNorms' and the row layers' biases.
    note = "bwd: param grads\nall-reduced" if sequence_parallel else ""
    row = []
    for inner in (("QKV\ncolumn", "attention\n(my heads)", "out proj\nrow"),
                  ("fc1\ncolumn", "GeLU\n(my slice)", "fc2\nrow")):
        row += [("box", "Layer-\nNorm", outside, note), enter]
        row += [("box", label, SHARDED, note if label.endswith("row") else "")
                for label in inner]
        row += [leave, ("box", "residual\n(+ dropout)", outside, "")]
    return row


def tp_sp_block(ax=None):
    """One transformer block under tensor parallelism (top) and tensor + sequence parallelism
    (bottom): grey = replicated on every TP rank, blue = split by heads / hidden features, green
    = split along the sequence; each red marker is a collective, with what it does in forward
    and in backward (its conjugate); under SP, the replicated parameters' gradient all-reduces
    are noted below the boxes that hold them."""
    if ax is None:
        _, ax = plt.subplots(figsize=(15, 5.6))
    w, h, gap = 1.1, 0.8, 0.22
    for r, sp in enumerate((False, True)):
        y = 3.3 - r * 2.9
        x = 0.0
        title = ("tensor + sequence parallel: every all-reduce becomes a reduce-scatter and an "
                 "all-gather" if sp else "tensor parallel: f and g, one all-reduce per region "
                 "forward, one backward")
        ax.text(-0.1, y + h + 0.55, title, fontsize=10, fontweight="bold", ha="left")
        centres = []                                     # (left, right) of each element
        for item in _block_row(sp):
            if item[0] == "box":
                _, label, colour, note = item
                if note:
                    # under the collectives' forward/backward lines (a name sits above)
                    ax.text(x + w / 2, y - 0.72, note, ha="center", va="top", fontsize=8,
                            color=COMM, style="italic")
                ax.add_patch(Rectangle((x, y), w, h, facecolor=colour, edgecolor="black",
                                       alpha=0.85))
                ax.text(x + w / 2, y + h / 2, label, ha="center", va="center", fontsize=8,
                        color="white" if colour != REPLICATED else "black")
                centres.append((x, x + w))
                x += w + gap
            else:
                _, name, fwd, bwd = item
                cx = x + 0.3
                ax.plot(cx, y + h / 2, marker="D", markersize=13, color=COMM, zorder=3)
                ax.text(cx, y + h + 0.08, name, ha="center", va="bottom", fontsize=8,
                        color=COMM, fontweight="bold")
                ax.text(cx, y - 0.08, f"fwd: {fwd}\nbwd: {bwd}", ha="center", va="top",
                        fontsize=8, color=COMM)
                centres.append((cx - 0.17, cx + 0.17))
                x += 0.6 + gap
        for (_, a), (b, _) in zip(centres, centres[1:]):   # the data flows left to right
            ax.annotate("", xy=(b, y + h / 2), xytext=(a, y + h / 2),
                        arrowprops=dict(arrowstyle="->", color="black", lw=0.8), zorder=1)
    handles = [Rectangle((0, 0), 1, 1, facecolor=c, edgecolor="black") for c in
               (REPLICATED, SHARDED, SEQUENCE)]
    ax.legend(handles, ["replicated on every TP rank", "split by heads / hidden features",
                        "split along the sequence"], loc="lower center", ncol=3, fontsize=8,
              bbox_to_anchor=(0.5, -0.12), frameon=False)
    ax.set_xlim(-0.2, x + 0.1)
    ax.set_ylim(-1.1, 4.9)
    ax.set_aspect("equal")
    ax.axis("off")
    return ax


def collective_matmul(chunks=4, t_comm=1.0, t_gemm=1.2, ax=None):
    """Async TP / collective matmul as a schedule, on one rank: the sequence-parallel all-gather
    feeding a column-parallel matmul, first one after the other (the matmul waits for the whole
    gather), then cut into `chunks` pieces — piece k + 1 arrives while piece k is multiplied, so
    only the first piece's transfer stays exposed. Times are illustrative units: the gather and
    the matmul each split evenly (t_comm and t_gemm in all). Returns the two step lengths."""
    if ax is None:
        _, ax = plt.subplots(figsize=(9, 2.6))
    comm, gemm = "#C44E52", "#4C72B0"
    rows = {"one after the other": 1.6, f"in {chunks} pieces, overlapped": 0.4}
    serial = t_comm + t_gemm
    for label, y in rows.items():
        if label.startswith("one"):
            spans = [(0.0, t_comm, comm, "all-gather"), (t_comm, t_gemm, gemm, "matmul")]
        else:
            c, g, spans = t_comm / chunks, t_gemm / chunks, []
            done = 0.0                               # when the matmul of the last piece ended
            for k in range(chunks):
                arrived = (k + 1) * c                # transfers run back to back on the link
                start = max(arrived, done)
                spans += [(k * c, c, comm, str(k)), (start, g, gemm, str(k))]
                done = start + g
            overlapped = done
        for start, width, colour, text in spans:
            lane = y + (0.45 if colour == comm else 0.0)
            ax.broken_barh([(start, width)], (lane, 0.4), facecolors=colour, edgecolor="black",
                           linewidth=0.6)
            ax.text(start + width / 2, lane + 0.2, text, ha="center", va="center", fontsize=8,
                    color="white")
    ax.set_yticks([y + 0.42 for y in rows.values()], list(rows))
    ax.set_xlabel("time (illustrative units)")
    ax.set_xlim(0, serial * 1.02)
    ax.set_ylim(0.2, 2.6)
    from matplotlib.patches import Patch
    ax.legend(handles=[Patch(color=comm, label="all-gather (link)"),
                       Patch(color=gemm, label="matmul (SMs)")], loc="upper right", fontsize=8)
    ax.set_title("collective matmul: the gather streamed into the matmul, piece by piece",
                 fontsize=9)
    ax.figure.tight_layout()
    return {"one after the other": serial, "overlapped": overlapped}
