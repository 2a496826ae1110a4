"""The map of parallelism strategies: what each one splits across four devices."""
import matplotlib.pyplot as plt
from matplotlib.patches import Rectangle

DEVICE_COLORS = ["#4C72B0", "#DD8452", "#55A868", "#C44E52"]
GREY = "#D0D0D0"

# For each strategy: per device, which cells of a 4-layer x 4-column model it holds, and which
# quarter of the batch it sees. A cell is (layer, column). ZeRO-3 also has cells it only borrows:
# the rest of each layer, gathered for a moment and freed (drawn hatched and pale).
EVERYTHING = [(l, c) for l in range(4) for c in range(4)]

STRATEGIES = [
    ("Data parallel (DDP)", "every device: the whole model,\nits own quarter of the batch",
     lambda d: EVERYTHING, lambda d: [d]),
    ("Sharded data parallel\n(ZeRO-3 / FSDP)", "stores 1/4 of every layer (solid); gathers the\n"
     "rest just to use it (hatched); own batch",
     lambda d: [(l, d) for l in range(4)], lambda d: [d], lambda d: EVERYTHING),
    ("Tensor parallel", "layers in pairs: one split by columns, the next\nby rows (Megatron); "
     "all devices see the same batch",
     lambda d: [(l, d) for l in range(4)], lambda d: [0, 1, 2, 3]),
    ("Pipeline parallel", "consecutive layers per device;\nmicro-batches flow down the stages",
     lambda d: [(d, c) for c in range(4)], lambda d: [0, 1, 2, 3]),
    ("Expert parallel (MoE)", "dense layers replicated, one expert per\ndevice in MoE layers; tokens travel to it",
     lambda d: [(l, c) for l in (0, 2) for c in range(4)] + [(1, d), (3, d)], lambda d: [d]),
]


def strategy_map(figsize=(10, 7.4)):
    """Five panels in two rows (three, then two centred); in each, four devices side by side,
    each showing what it holds. About 10 inches wide: it fits a notebook's column."""
    fig = plt.figure(figsize=figsize)
    grid = fig.add_gridspec(2, 6)
    # Each panel spans two of six columns, so the second row's two panels sit centred.
    axes = [fig.add_subplot(grid[0, 0:2]), fig.add_subplot(grid[0, 2:4]),
            fig.add_subplot(grid[0, 4:6]), fig.add_subplot(grid[1, 1:3]),
            fig.add_subplot(grid[1, 3:5])]
    for ax, (title, caption, holds, batch, *borrowed) in zip(axes, STRATEGIES):
        for d in range(4):
            x0 = d * 1.25
            held = set(holds(d))
            lent = set(borrowed[0](d)) - held if borrowed else set()
            for layer in range(4):
                for col in range(4):
                    cell = (layer, col)
                    color = DEVICE_COLORS[d] if cell in held | lent else "white"
                    if title == "Tensor parallel" and layer % 2 == 1:
                        # Megatron's row-parallel layer: device d holds input rows, a band
                        # across the whole layer (the cell's column index picks the band).
                        ax.add_patch(Rectangle((x0, 3 - layer + 0.9 - (col + 1) * 0.225), 1.0,
                                               0.225, facecolor=color, edgecolor=GREY,
                                               linewidth=0.6))
                        continue
                    ax.add_patch(Rectangle((x0 + col * 0.25, 3 - layer), 0.25, 0.9,
                                           facecolor=color, edgecolor=GREY, linewidth=0.6,
                                           alpha=0.3 if cell in lent else 1.0))
                    if cell in lent:
                        ax.add_patch(Rectangle((x0 + col * 0.25, 3 - layer), 0.25, 0.9,
                                               fill=False, hatch="////", edgecolor="white",
                                               linewidth=0))
            for q in range(4):  # the batch, in quarters, under the device
                seen = q in batch(d)
                ax.add_patch(Rectangle((x0 + q * 0.25, -0.9), 0.25, 0.5,
                                       facecolor="#888888" if seen else "white",
                                       edgecolor=GREY, linewidth=0.6))
            ax.text(x0 + 0.5, 4.05, f"GPU {d}", ha="center", fontsize=8)
        ax.text(-0.15, 1.9, "layers", rotation=90, ha="right", va="center", fontsize=8)
        ax.text(-0.15, -0.65, "batch", ha="right", va="center", fontsize=8)
        ax.set_title(title, fontsize=10)
        ax.text(2.4, -1.25, caption, ha="center", va="top", fontsize=8)
        ax.set_xlim(-0.6, 5.0)
        ax.set_ylim(-2.2, 4.5)
        ax.axis("off")
    fig.suptitle("What each strategy splits across 4 GPUs\n"
                 "(coloured: held by that GPU · grey: the part of the batch it processes)",
                 fontsize=11)
    fig.tight_layout()
    return fig
