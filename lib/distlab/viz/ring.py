"""Pictures of chapter 03: the ring step by step, the broadcast tree, measured vs modelled time.

The ring picture is computed from the same schedule functions the real ring all-reduce uses
(`distlab.collectives.reduce_scatter_step` / `all_gather_step`), so it cannot drift from the code.
"""
import matplotlib.pyplot as plt
from matplotlib.patches import Rectangle

from ..collectives import all_gather_step, reduce_scatter_step
from ..cost import predict


def ring_states(world_size):
    """Replay the ring all-reduce on sets instead of tensors.

    Returns [(label, state, moves)]: state[r][c] is the set of ranks whose contribution chunk c
    of rank r holds after that step; moves lists (src, dst, chunk) sent during it.
    """
    n = world_size
    state = [[{r} for _ in range(n)] for r in range(n)]
    frames = [("start", [[set(s) for s in row] for row in state], [])]
    for phase, step_fn, combine in (("reduce-scatter", reduce_scatter_step, True),
                                    ("all-gather", all_gather_step, False)):
        for step in range(n - 1):
            moves = []
            sent = []
            for r in range(n):
                send_c, _ = step_fn(r, step, n)
                sent.append((r, (r + 1) % n, send_c, set(state[r][send_c])))
            for src, dst, c, payload in sent:
                state[dst][c] = state[dst][c] | payload if combine else payload
                moves.append((src, dst, c))
            frames.append((f"{phase} step {step + 1}", [[set(s) for s in row] for row in state],
                           moves))
    return frames


def tree_rounds(world_size, src=0):
    """[[(sender, receiver), ...] per round] of the binomial-tree broadcast from `src`."""
    rounds, mask = [], 1
    while mask < world_size:
        rounds.append([((v + src) % world_size, (v + mask + src) % world_size)
                       for v in range(mask) if v + mask < world_size])
        mask *= 2
    return rounds


def draw_ring(world_size=4, figsize=None):
    """One row per step: each rank's N chunks, shaded by how many ranks' data they hold.

    A chunk with a thick red edge just arrived (from the rank on the left, i.e. rank - 1);
    the label under each rank says which chunk it sent to its right neighbour.
    """
    n = world_size
    frames = ring_states(n)
    cmap = plt.get_cmap("YlGn")
    width = n * (n + 1)
    fig, ax = plt.subplots(figsize=figsize or (1.1 + 0.55 * width, 0.95 * len(frames) + 0.6))
    for row, (label, state, moves) in enumerate(frames):
        y = -1.3 * row
        received = {(dst, c) for _, dst, c in moves}
        sent = {src: c for src, _, c in moves}
        ax.text(-0.4, y + 0.4, label, ha="right", va="center", fontsize=9)
        for r in range(n):
            x0 = r * (n + 1)
            for c in range(n):
                holders = state[r][c]
                hot = (r, c) in received
                ax.add_patch(Rectangle((x0 + c, y), 0.95, 0.8, facecolor=cmap(0.15 + 0.8 * len(holders) / n),
                                       edgecolor="crimson" if hot else "grey",
                                       linewidth=2.2 if hot else 0.6))
                ax.text(x0 + c + 0.475, y + 0.4, "".join(map(str, sorted(holders))),
                        ha="center", va="center", fontsize=8 if n <= 5 else 6,
                        color="white" if len(holders) == n else "black")
            if r in sent:
                ax.text(x0 + n / 2, y - 0.22, f"sent chunk {sent[r]} → rank {(r + 1) % n}",
                        ha="center", va="center", fontsize=8, color="dimgray")
    for r in range(n):
        ax.text(r * (n + 1) + n / 2, 1.1, f"rank {r}", ha="center", fontsize=10, weight="bold")
    ax.set_xlim(-4.2, width)
    ax.set_ylim(-1.3 * (len(frames) - 1) - 0.45, 1.5)
    ax.axis("off")
    ax.set_title(f"Ring all-reduce on {n} ranks: boxes are chunks 0..{n - 1}, digits say whose "
                 f"data a chunk holds", fontsize=10)
    fig.tight_layout()
    return fig


def plot_measured_vs_model(series, title="all_reduce: measured (dots) and α-β model (lines)"):
    """series: [{"label", "collective", "world_size", "sizes", "seconds", "link"}], log-log axes.
    A series' optional "kind" names where its dots come from ("measured", the default, or e.g.
    "emulated"): an emulated time must never be labelled a measurement."""
    fig, ax = plt.subplots(figsize=(10, 4.5))
    for i, s in enumerate(series):
        color = f"C{i}"
        ax.loglog(s["sizes"], s["seconds"], "o", color=color, label=f"{s['label']} ({s.get('kind', 'measured')})")
        lo, hi = min(s["sizes"]), max(s["sizes"])
        xs = [lo * (hi / lo) ** (k / 60) for k in range(61)]
        ax.loglog(xs, [predict(s["collective"], x, s["world_size"], s["link"]) for x in xs], "-",
                  color=color, alpha=0.7,
                  label=f"{s['label']} (model: α = {s['link'].alpha * 1e6:.3g} µs, "
                        f"B = {s['link'].bandwidth / 1e9:.3g} GB/s)")
    ax.set_xlabel("message size (bytes)")
    ax.set_ylabel("seconds per call")
    ax.set_title(title, fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    # Beside the axes, never over a data point.
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    return fig
