"""Pictures of chapter 12: who computes which part of a causal attention matrix."""
import matplotlib.pyplot as plt
import numpy as np
from matplotlib.colors import ListedColormap

from ..context_parallel import causal_work, contiguous_positions, zigzag_positions

RANK_COLORS = ["#4C72B0", "#DD8452", "#55A868", "#C44E52", "#8172B2", "#937860", "#DA8BC3",
               "#8C8C8C"]


def causal_layouts(seq_len=16, world_size=4):
    """The causal attention matrix (queries down, keys across), each computed cell coloured by
    the rank whose queries it belongs to: contiguous blocks on the left, zig-zag on the right."""
    fig, axes = plt.subplots(1, 2, figsize=(9, 4.2))
    colors = ListedColormap(["white"] + RANK_COLORS[:world_size])
    for ax, (name, layout) in zip(axes, (("contiguous", contiguous_positions),
                                          ("zig-zag", zigzag_positions))):
        positions = [layout(seq_len, r, world_size) for r in range(world_size)]
        owner = np.zeros(seq_len, dtype=int)
        for r, pos in enumerate(positions):
            owner[pos.numpy()] = r + 1
        grid = np.tril(np.ones((seq_len, seq_len), dtype=int)) * owner[:, None]
        ax.imshow(grid, cmap=colors, vmin=0, vmax=world_size, interpolation="nearest")
        work = causal_work(positions)
        ax.set_title(f"{name}: query-key pairs per rank {work}\n"
                     f"busiest / average = {max(work) / (sum(work) / world_size):.2f}",
                     fontsize=9)
        ax.set_xlabel("key position")
        ax.set_ylabel("query position")
        ax.set_xticks([])
        ax.set_yticks([])
    handles = [plt.Rectangle((0, 0), 1, 1, color=RANK_COLORS[r]) for r in range(world_size)]
    fig.legend(handles, [f"rank {r}" for r in range(world_size)], loc="lower center",
               ncol=world_size, fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, 0.07, 1, 1))
    return fig
