"""Pictures for chapter 11: where each rank's step time goes when one rank is slow; what a
training step holds in memory, and what the caching allocator reserves for it."""
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
            # the bar is the whole time inside the collective: its transfer, plus the wait
            # for the slowest rank (a straggler-free run shows the transfer alone)
            ax.bar(x, wait, bottom=compute, color="tab:orange",
                   label="inside all_reduce (transfer + wait)" if x == 0 else None)
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


_CATEGORY_COLORS = {"parameters": "tab:green", "optimizer state": "tab:purple",
                    "gradients": "tab:orange", "activations": "tab:blue",
                    "temporaries": "tab:gray"}


def memory_timeline(rows, ax=None, title=None, phases=None):
    """The shape of memory_viz's "Active Memory Timeline", from a recorded stream: bytes alive
    after each allocation or free (memory_debug.live_bytes rows), stacked by category.
    phases: [(event index, name)] drawn as labelled lines."""
    if ax is None:
        _, ax = plt.subplots(figsize=(9, 3.4))
    x = range(len(rows))
    names = [c for c in _CATEGORY_COLORS if any(r[c] for r in rows)]
    ax.stackplot(x, *[[r[c] / 2 ** 30 for r in rows] for c in names],
                 colors=[_CATEGORY_COLORS[c] for c in names], labels=names, step="post")
    for at, name in phases or ():
        ax.axvline(at, color="black", lw=0.6, ls=":")
        ax.text(at, 1.0, f" {name}", transform=ax.get_xaxis_transform(), fontsize=8,
                va="top", rotation=90)
    ax.set_xlim(0, len(rows) - 1)
    ax.set_xlabel("allocation / free events, in order")
    ax.set_ylabel("GiB alive")
    ax.set_title(title or "What a training step holds, event by event", pad=22)
    ax.legend(loc="lower center", bbox_to_anchor=(0.5, 1.0), ncol=len(names), fontsize=8,
              frameon=False)
    ax.figure.tight_layout()
    return ax


def allocated_vs_reserved(runs, ax=None, capacity=None):
    """Allocated and reserved bytes per event of allocator replays
    ({label: memory_debug.replay(...)}), one colour per replay; the device's capacity dashed."""
    if ax is None:
        _, ax = plt.subplots(figsize=(9, 3.2))
    colors = ["tab:red", "tab:blue", "tab:green"]
    for (label, run), color in zip(runs.items(), colors):
        ax.plot([b / 2 ** 20 for b in run["reserved"]], color=color, lw=1.2,
                label=f"{label}: reserved")
        ax.plot([b / 2 ** 20 for b in run["allocated"]], color=color, lw=0.8, ls="--",
                label=f"{label}: allocated")
        if run["oom"]:              # where this allocator gave up
            at = len(run["reserved"]) - 1
            ax.plot(at, run["reserved"][at] / 2 ** 20, "x", color=color, ms=9, mew=2)
            ax.annotate(f"{label}: out of memory", (at, run["reserved"][at] / 2 ** 20),
                        xytext=(8, -14), textcoords="offset points", color=color, fontsize=8)
    if capacity is not None:
        ax.axhline(capacity / 2 ** 20, color="black", lw=0.8, ls=":")
        ax.text(0, capacity / 2 ** 20, " device capacity", va="bottom", fontsize=8)
    ax.set_xlabel("allocation / free events, in order")
    ax.set_ylabel("MiB")
    ax.set_title("Reserved (cached by the allocator) vs allocated (held by tensors)", pad=36)
    ax.legend(loc="lower center", bbox_to_anchor=(0.5, 1.0), ncol=2, fontsize=8, frameon=False)
    ax.figure.tight_layout()
    return ax
