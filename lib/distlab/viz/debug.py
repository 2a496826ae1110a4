"""Pictures for chapter 11: where each rank's step time goes when one rank is slow."""
import matplotlib.pyplot as plt


def straggler_bars(runs, ax=None, unit="ms"):
    """Stacked bars per rank, one group per run: own compute vs waiting inside the all-reduce.

    runs: {"label": [ {"compute": [s, ...], "wait": [s, ...]} per rank ]} as `step_times` returns;
    unit: "ms" or "µs".
    """
    scale = {"ms": 1e3, "µs": 1e6}[unit]
    if ax is None:
        _, ax = plt.subplots(figsize=(4 + 2 * len(runs), 3.5))
    x, ticks, labels = 0, [], []
    for label, ranks in runs.items():
        for rank, t in enumerate(ranks):
            compute = scale * sum(t["compute"]) / len(t["compute"])
            wait = scale * sum(t["wait"]) / len(t["wait"])
            ax.bar(x, compute, color="tab:blue", label="own compute" if x == 0 else None)
            ax.bar(x, wait, bottom=compute, color="tab:orange",
                   label="waiting in all_reduce" if x == 0 else None)
            ticks.append(x)
            labels.append(f"r{rank}")
            x += 1
        ax.text(x - len(ranks) / 2 - 0.5, -0.16, label, ha="center", va="top",
                transform=ax.get_xaxis_transform())
        x += 1
    ax.set_xticks(ticks, labels)
    ax.set_ylabel(f"{unit} per step (mean)")
    ax.set_title("Every rank's step takes as long as the slowest rank's", pad=24)
    # Above the axes, under the title: it covers no bar.
    ax.legend(loc="lower center", bbox_to_anchor=(0.5, 1.0), ncol=2, fontsize=8, frameon=False)
    ax.figure.tight_layout()
    return ax


def step_breakdown(ms_per_rank, ax=None):
    """Horizontal stacked bars per rank: forward, backward without communication, communication,
    optimizer (ms per step, from `profile_ddp_steps`)."""
    if ax is None:
        _, ax = plt.subplots(figsize=(7, 0.6 + 0.5 * len(ms_per_rank)))
    colors = {"forward": "tab:green", "backward compute": "tab:blue",
              "communication": "tab:orange", "optimizer": "tab:gray"}
    for rank, ms in enumerate(ms_per_rank):
        parts = {"forward": ms["forward"],
                 "backward compute": max(ms["backward"] - ms["communication"], 0.0),
                 "communication": ms["communication"], "optimizer": ms["optimizer"]}
        left = 0.0
        for name, width in parts.items():
            ax.barh(rank, width, left=left, color=colors[name], label=name if rank == 0 else None)
            left += width
    ax.set_yticks(range(len(ms_per_rank)), [f"rank {r}" for r in range(len(ms_per_rank))])
    ax.invert_yaxis()
    ax.set_xlabel("ms per DDP step")
    # Above the axes: inside, it hid rank 1's communication bar.
    ax.legend(loc="lower center", bbox_to_anchor=(0.5, 1.0), ncol=4, fontsize=8, frameon=False)
    ax.figure.tight_layout()
    return ax
