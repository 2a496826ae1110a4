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


def ring_schedule(world_size=4):
    """Which K/V block each rank holds at each ring step (the block of rank (r − s) mod N at
    step s: every step, every block moves one rank on, to the right neighbour), forward on the
    left; in backward, on the right, the block travels with its dK/dV, to which the holder adds
    its queries' share, and makes one hop more: after N hops every block's gradients are home."""
    n = world_size
    fig, axes = plt.subplots(1, 2, figsize=(10, 0.55 * n + 1.6),
                             gridspec_kw={"width_ratios": [n, n + 1]})
    for ax, backward in zip(axes, (False, True)):
        steps = n + 1 if backward else n
        for s in range(steps):
            for r in range(n):
                owner = (r - s) % n
                home = backward and s == n
                ax.add_patch(plt.Rectangle((s, -r), 0.92, 0.85, color=RANK_COLORS[owner % 8],
                                           alpha=0.45 if home else 1.0))
                label = (f"dK/dV {owner}\nhome" if home else
                         f"K/V {owner}" + ("\n+ dK/dV" if backward else ""))
                ax.text(s + 0.46, -r + 0.42, label, ha="center", va="center", fontsize=8,
                        color="black" if home else "white")
        for r in range(n):
            ax.text(-0.15, -r + 0.42, f"rank {r}", ha="right", va="center", fontsize=8)
        for s in range(steps):
            ax.text(s + 0.46, 1.05, "after\nN hops" if backward and s == n else f"step {s}",
                    ha="center", va="bottom", fontsize=8)
        ax.set_xlim(-1.0, steps + 0.1)
        ax.set_ylim(-n + 0.7, 1.9)
        ax.axis("off")
        ax.set_title("backward: K, V and their gradients travel together" if backward else
                     "forward: each rank's queries meet the block in hand", fontsize=9)
    fig.suptitle(f"ring attention, cp = {n}: the block on rank r at step s is rank (r − s) "
                 f"mod {n}'s; every hop moves it to the right neighbour (r + 1)", fontsize=10)
    fig.tight_layout()
    return fig
