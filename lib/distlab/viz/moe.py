"""Pictures of mixture-of-experts routing: tokens → experts, per-expert load, load over training,
and who sends how many rows to whom in the dispatch all-to-all."""
import matplotlib.pyplot as plt
import numpy as np

_CMAP = plt.get_cmap("tab10")


def expert_color(e):
    return _CMAP(e % 10)


def tokens_to_experts(routing, columns=16, title=None):
    """Left: each token as a square in the colour of its first-choice expert (✕: dropped by every
    expert it chose). Right: each expert's load — kept, and dropped past the capacity."""
    experts, keep = routing.experts.cpu(), routing.keep.cpu()
    n, n_experts = len(experts), routing.n_experts
    rows = -(-n // columns)
    fig, (grid, bars) = plt.subplots(1, 2, figsize=(11, max(2.2, 0.45 * rows + 1.2)),
                                     gridspec_kw={"width_ratios": [1.6, 1]})
    for t in range(n):
        r, c = divmod(t, columns)
        grid.add_patch(plt.Rectangle((c, -r), 0.9, 0.9, color=expert_color(int(experts[t, 0]))))
        if not keep[t].any():
            grid.plot([c + 0.1, c + 0.8], [-r + 0.1, -r + 0.8], color="black", lw=1.5)
            grid.plot([c + 0.1, c + 0.8], [-r + 0.8, -r + 0.1], color="black", lw=1.5)
    grid.set_xlim(-0.2, columns + 0.1)
    grid.set_ylim(-rows + 0.8, 1.1)
    grid.set_aspect("equal")
    grid.axis("off")
    grid.set_title(f"{n} tokens, coloured by first-choice expert (✕ = dropped)", fontsize=10)
    handles = [plt.Rectangle((0, 0), 1, 1, color=expert_color(e)) for e in range(n_experts)]
    grid.legend(handles, [f"expert {e}" for e in range(n_experts)], loc="upper center",
                bbox_to_anchor=(0.5, 0.0), ncol=min(n_experts, 8), fontsize=8, frameon=False)
    load_bars(routing.load(), routing.wanted() - routing.load(), routing.capacity, ax=bars,
              title=f"load per expert (top-{experts.shape[1]})")
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    return fig


def load_bars(kept, dropped=None, capacity=None, ax=None, title=None, ylabel="assignments"):
    """Stacked bars per expert: the assignments it processes, and those dropped past capacity."""
    if ax is None:
        _, ax = plt.subplots(figsize=(5, 3))
    kept = np.asarray(kept, dtype=float)
    x = np.arange(len(kept))
    ax.bar(x, kept, color=[expert_color(e) for e in x], label="processed")
    if dropped is not None and np.asarray(dropped).sum() > 0:
        ax.bar(x, np.asarray(dropped, dtype=float), bottom=kept, color="white",
               edgecolor="grey", hatch="///", label="dropped")
    if capacity is not None:
        ax.axhline(capacity, color="black", linestyle="--", linewidth=1,
                   label=f"capacity {capacity}")
    ax.set_xticks(x, [f"E{e}" for e in x])
    ax.set_ylabel(ylabel)
    top = (kept + (0 if dropped is None else np.asarray(dropped, dtype=float))).max()
    ax.set_ylim(0, 1.35 * max(top, capacity or 0, 1))
    if capacity is not None or (dropped is not None and np.asarray(dropped).sum() > 0):
        ax.legend(fontsize=8, loc="upper right", ncol=3)
    if title:
        ax.set_title(title, fontsize=10)
    return ax


def load_over_steps(fractions, ax=None, title=None):
    """fractions: (steps, E) share of the assignments each expert got at each training step."""
    if ax is None:
        _, ax = plt.subplots(figsize=(5, 3))
    fractions = np.asarray(fractions, dtype=float)
    n_experts = fractions.shape[1]
    for e in range(n_experts):
        ax.plot(fractions[:, e], color=expert_color(e), label=f"E{e}")
    ax.axhline(1 / n_experts, color="black", linestyle="--", linewidth=1, label="fair share")
    ax.set_xlabel("training step")
    ax.set_ylabel("share of assignments")
    ax.set_ylim(-0.02, 1.3)        # headroom: a collapsed router's line sits at 1.0
    ax.legend(fontsize=8, ncol=n_experts + 1, loc="upper center", handlelength=1.2,
              columnspacing=0.8)
    if title:
        ax.set_title(title, fontsize=10)
    return ax


def dispatch_matrix(matrix, ax=None, title="rows sent by the dispatch all-to-all"):
    """matrix[i][j]: rows rank i sends to rank j. The diagonal — rows whose expert lives on their
    own rank — stays home and crosses no wire: drawn hatched and outlined, and labelled."""
    if ax is None:
        _, ax = plt.subplots(figsize=(3.9, 3.6))
    m = np.asarray(matrix, dtype=float)
    ax.imshow(m, cmap="Blues", vmin=0, vmax=max(1.0, m.max()))
    for i in range(m.shape[0]):
        for j in range(m.shape[1]):
            home = i == j
            if home:
                ax.add_patch(plt.Rectangle((j - 0.5, i - 0.5), 1, 1, fill=False, hatch="//",
                                           edgecolor="#C44E52", linewidth=2))
            ax.text(j, i, f"{int(m[i, j])}" + ("\nhome" if home else ""), ha="center",
                    va="center", fontsize=9 if not home else 8,
                    color="white" if m[i, j] > 0.6 * m.max() else "black",
                    fontweight="bold" if home else None)
    ax.set_xticks(range(m.shape[1]), [f"to {j}" for j in range(m.shape[1])])
    ax.set_yticks(range(m.shape[0]), [f"from {i}" for i in range(m.shape[0])])
    off = m.sum() - np.trace(m)
    ax.set_title(f"{title}\nred diagonal: stays home ({int(np.trace(m))} rows); "
                 f"off it: crosses a link ({int(off)})", fontsize=9)
    return ax


def step_vs_load(max_rows, step_us, model_us, ax=None, labels=None,
                 title="MoE layer step vs the busiest rank's load (emulated)"):
    """Emulated step time (points) against the rows the busiest rank received, beside the cost
    model's prediction (line)."""
    if ax is None:
        _, ax = plt.subplots(figsize=(6, 3.4))
    order = np.argsort(max_rows)
    x = np.asarray(max_rows, dtype=float)[order]
    ax.plot(x, np.asarray(model_us, dtype=float)[order], color="#C44E52", linestyle="--",
            label="model: balanced step + extra rows × per-row expert cost")
    ax.scatter(x, np.asarray(step_us, dtype=float)[order], color="#4C72B0", zorder=3,
               label="emulated step (slowest rank)")
    if labels is not None:
        for xi, yi, text in zip(x, np.asarray(step_us, dtype=float)[order],
                                np.asarray(labels, dtype=object)[order]):
            ax.annotate(text, (xi, yi), textcoords="offset points", xytext=(-6, 4), fontsize=8,
                        ha="right", va="bottom")
    ax.set_xlim(x.min() - 0.15 * (x.max() - x.min()), x.max() + 0.05 * (x.max() - x.min()))
    ax.set_xlabel("rows received by the busiest rank")
    ax.set_ylabel("µs per forward + backward")
    ax.set_ylim(0, 1.25 * max(max(step_us), max(model_us)))
    ax.legend(fontsize=8, loc="lower right")
    ax.set_title(title, fontsize=10)
    return ax


def rank_bars(values, ax=None, title=None, ylabel="ms", line=None, line_label=None):
    """One bar per rank (e.g. time in its local experts), with an optional horizontal line."""
    if ax is None:
        _, ax = plt.subplots(figsize=(4, 3))
    x = np.arange(len(values))
    ax.bar(x, values, color="#4C72B0")
    if line is not None:
        ax.axhline(line, color="#C44E52", linestyle="--", linewidth=1)
        if line_label:
            ax.text(len(values) - 0.5, line, line_label, ha="right", va="bottom", fontsize=8)
    ax.set_xticks(x, [f"rank {r}" for r in x])
    ax.set_ylabel(ylabel)
    if title:
        ax.set_title(title, fontsize=10)
    return ax


def experts_per_token(routing, ax=None, title="experts per token"):
    """How many experts each token got: one bar per count (expert-choice routing gives 0..E;
    token-choice top-k gives k, or fewer where capacity dropped some)."""
    if ax is None:
        _, ax = plt.subplots(figsize=(4, 3))
    counts = routing.keep.sum(dim=-1).cpu().numpy()
    values = np.arange(routing.keep.shape[1] + 1)
    ax.bar(values, [(counts == v).sum() for v in values], color="tab:blue")
    ax.set_xticks(values)
    ax.set_xlabel("experts that took the token")
    ax.set_ylabel("tokens")
    ax.set_title(title, fontsize=10)
    return ax


def micro_batch_loads(loads, ax=None, title=None):
    """loads: (micro-batches, E) assignments of each micro-batch: one group of bars per
    micro-batch, coloured by expert; the dashed line is a perfectly balanced share."""
    if ax is None:
        _, ax = plt.subplots(figsize=(5, 3))
    loads = np.asarray(loads, dtype=float)
    n_micro, n_experts = loads.shape
    width = 0.8 / n_experts
    for e in range(n_experts):
        ax.bar(np.arange(n_micro) + (e - (n_experts - 1) / 2) * width, loads[:, e], width,
               color=expert_color(e), label=f"expert {e}")
    ax.axhline(loads.sum() / loads.size, color="black", lw=1, ls="--", label="balanced")
    ax.set_xticks(np.arange(n_micro))
    ax.set_xticklabels([f"micro-batch {m}" for m in range(n_micro)], fontsize=8)
    ax.set_ylabel("assignments")
    if title:
        ax.set_title(title, fontsize=10)
    return ax


def token_permutation(experts_per_rank, keep_per_rank, n_experts, title=None):
    """Who sends which tokens where, for a few ranks' routing ((T, k) experts and keep each):
    left, each rank's tokens in order (a box per assignment, coloured by its expert, ✕ dropped);
    middle, the send buffer after the permutation (sorted by expert, hence by destination rank);
    right, what each rank receives (by source rank, then local expert). Lines: the permutation on
    the rank, then the dispatch all-to-all across ranks (thick: crosses a link). The combine is
    the same lines walked back, and the un-permutation adds each row to its token."""
    from ..expert_parallel import dispatch_plan
    n = len(experts_per_rank)
    local = n_experts // n
    cols = {"tokens": 0.0, "sent": 2.2, "received": 4.6}
    plans = [dispatch_plan(e, k, n_experts, n) for e, k in zip(experts_per_rank, keep_per_rank)]
    # rows each rank receives, in arrival order: (source, place in the source's send buffer)
    received = [[] for _ in range(n)]
    for s, ((order, splits), e) in enumerate(zip(plans, experts_per_rank)):
        dest = e.reshape(-1)[order] // local
        for place, j in enumerate(dest.tolist()):
            received[j].append((s, place))
    heights = [max(e.numel(), len(received[r])) for r, e in enumerate(experts_per_rank)]
    tops = np.cumsum([0] + [h + 1.5 for h in heights])
    fig, ax = plt.subplots(figsize=(9, 0.32 * tops[-1] + 1.2))

    def box(x, y, e, label, dropped=False):
        ax.add_patch(plt.Rectangle((x, -y - 0.9), 1.0, 0.85, color=expert_color(e),
                                   alpha=0.35 if dropped else 1.0))
        ax.text(x + 0.5, -y - 0.48, label, ha="center", va="center", fontsize=8,
                color="black" if dropped else "white")

    sent_y = {}
    for r, (e, k) in enumerate(zip(experts_per_rank, keep_per_rank)):
        top, slots = tops[r], e.shape[1]
        ax.text(-0.3, -top - 0.45, f"rank {r}", ha="right", va="center", fontsize=9,
                fontweight="bold")
        order = plans[r][0].tolist()
        for a in range(e.numel()):
            t, s = divmod(a, slots)
            box(cols["tokens"], top + a, int(e[t, s]), f"t{t}" + ("✕" if not k[t, s] else ""),
                dropped=not bool(k[t, s]))
        for place, a in enumerate(order):
            t, s = divmod(a, slots)
            box(cols["sent"], top + place, int(e[t, s]), f"t{t}")
            sent_y[(r, place)] = top + place
            ax.plot([cols["tokens"] + 1, cols["sent"]], [-top - a - 0.48, -top - place - 0.48],
                    color="#999999", lw=0.7)
    for j in range(n):
        for i, (s, place) in enumerate(received[j]):
            a = plans[s][0][place].item()
            t, slot = divmod(a, experts_per_rank[s].shape[1])
            box(cols["received"], tops[j] + i, int(experts_per_rank[s][t, slot]), f"r{s}·t{t}")
            ax.plot([cols["sent"] + 1, cols["received"]],
                    [-sent_y[(s, place)] - 0.48, -tops[j] - i - 0.48],
                    color="#C44E52" if s != j else "#999999", lw=1.6 if s != j else 0.7)
    for name, x in cols.items():
        ax.text(x + 0.5, 0.6, {"tokens": "tokens (each choice)", "sent": "permuted: by expert",
                               "received": "received: by source, expert"}[name],
                ha="center", fontsize=9)
    handles = [plt.Rectangle((0, 0), 1, 1, color=expert_color(e)) for e in range(n_experts)]
    ax.legend(handles, [f"expert {e} (rank {e // local})" for e in range(n_experts)],
              loc="upper center", bbox_to_anchor=(0.5, 0.0), ncol=min(n_experts, 4), fontsize=8,
              frameon=False)
    ax.set_xlim(-1.4, cols["received"] + 1.3)
    ax.set_ylim(-tops[-1], 1.2)
    ax.axis("off")
    ax.set_title(title or "the permutation and the dispatch all-to-all (red: crosses a link)",
                 fontsize=10)
    fig.tight_layout()
    return fig
