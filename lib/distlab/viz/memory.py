"""Stacked bars of where training memory goes, against a GPU's capacity."""
import matplotlib.pyplot as plt
from matplotlib.transforms import blended_transform_factory

COLORS = {"weights": "#4C72B0", "grads": "#DD8452", "optimizer": "#55A868",
          "activations": "#C44E52"}


def memory_bars(columns, capacity=None, capacity_label="one 80 GB GPU", unit=1e9,
                unit_name="GB", title=None, ax=None, log=False):
    """columns: {bar label: {"weights": bytes, "grads": bytes, ...}} drawn as stacked bars."""
    if ax is None:
        _, ax = plt.subplots(figsize=(1.6 + 1.6 * len(columns), 4))
    labels = list(columns)
    parts = [p for p in COLORS if any(p in columns[c] for c in labels)]
    bottoms = [0.0] * len(labels)
    for part in parts:
        heights = [columns[c].get(part, 0) / unit for c in labels]
        ax.bar(labels, heights, bottom=bottoms, color=COLORS[part], label=part, width=0.6)
        bottoms = [b + h for b, h in zip(bottoms, heights)]
    for i, total in enumerate(bottoms):
        label = f"{total:,.0f}" if total >= 10 else f"{total:.2g}"
        ax.text(i, total, f"{label} {unit_name}", ha="center", va="bottom", fontsize=9)
    if capacity is not None:
        ax.axhline(capacity / unit, color="black", linestyle="--", linewidth=1)
        # Just right of the axes, level with its line: clear of the bars and their totals.
        ax.text(1.01, capacity / unit, capacity_label, va="center", ha="left", fontsize=9,
                transform=blended_transform_factory(ax.transAxes, ax.transData))
    if log:
        ax.set_yscale("log")
    ax.set_ylabel(unit_name)
    # Headroom above the tallest bar for its total; the legend sits above the axes, between
    # them and the title, where it can cover neither a bar nor a tick label.
    ax.set_ylim(top=max(bottoms + [capacity / unit if capacity else 0]) * 1.12)
    ax.legend(loc="lower center", bbox_to_anchor=(0.5, 1.0), ncol=len(parts), fontsize=8,
              frameon=False, borderaxespad=0.2)
    if title:
        ax.set_title(title, pad=22)
    return ax


def memory_calculator():
    """A widget: pick a model, precision, optimizer, ZeRO stage, GPUs, sequence and batch,
    activation recomputation (none / selective / full) and the attention kernel (flash, or
    materialized s×s scores); see what one GPU holds at rest and whether it fits in 80 GB — and,
    for ZeRO-3 of a Llama-2 7B/13B preset in bf16 with Adam, the step's peak
    (zero_memory.preset_zero3_peak), which decides."""
    import ipywidgets as w

    from .. import memory
    from ._fallback import NOTE, display_widget, figure_png

    controls = dict(
        model=w.Dropdown(options=list(memory.PRESETS), value="Llama-2 7B"),
        precision=w.Dropdown(options=memory.PRECISIONS, value="bf16-mixed"),
        optimizer=w.Dropdown(options=memory.OPTIMIZERS, value="adam"),
        zero_stage=w.IntSlider(value=0, min=0, max=3, description="ZeRO stage"),
        world_size=w.Dropdown(options=[1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024], value=8,
                              description="GPUs"),
        seq_len=w.Dropdown(options=[512, 1024, 2048, 4096, 8192], value=2048),
        micro_batch=w.IntSlider(value=1, min=1, max=16, description="micro-batch"),
        checkpointing=w.Dropdown(options=memory.RECOMPUTATION, value="none",
                                 description="recompute"),
        attention=w.Dropdown(options=memory.ATTENTION, value="flash"),
    )

    def draw_on(ax, **kw):
        from .. import zero_memory
        parts = memory.per_gpu_bytes(**kw)
        total = sum(parts.values())
        # the step's worst moment where the course counts it (ZeRO-3 on a Llama-2 preset), else
        # the steady state alone, which is a lower bound
        peak = zero_memory.preset_zero3_peak(**kw)
        worst = total if peak is None else max(total, peak)
        verdict = "fits" if worst <= 80 * memory.GB else "does NOT fit"
        title = (f"{total / memory.GB:,.1f} GB per GPU at rest (a lower bound): {verdict}"
                 if peak is None else
                 f"{total / memory.GB:,.1f} GB at rest, peak {peak / memory.GB:,.1f} GB: "
                 f"{verdict}")
        ax = memory_bars({"one GPU": parts}, capacity=80 * memory.GB, ax=ax, title=title)
        if peak is not None:
            ax.axhline(peak / memory.GB, color="#C44E52", linestyle=":", linewidth=1.5)
            ax.text(1.01, peak / memory.GB, "the step's peak\n(ZeRO-3, counted)", va="top",
                    ha="left", fontsize=8, color="#C44E52",
                    transform=blended_transform_factory(ax.transAxes, ax.transData))
            ax.set_ylim(top=max(ax.get_ylim()[1], peak / memory.GB * 1.12))

    def draw(**kw):
        draw_on(None, **kw)
        plt.show()

    for control in controls.values():  # room for the longest option beside its label
        control.style = {"description_width": "90px"}
        control.layout = w.Layout(width="340px")
    widget = w.interactive(draw, **controls)
    # Where no kernel runs (a static page), the default view as a picture instead.
    from matplotlib.figure import Figure
    fig = Figure(figsize=(3.2, 4))
    chosen = {k: c.value for k, c in controls.items()}
    draw_on(fig.add_subplot(), **chosen)
    settings = ", ".join(f"{k} {v}" for k, v in chosen.items())
    import textwrap
    note = "\n".join(textwrap.wrap(f"{NOTE} Shown: {settings}.", 62))
    display_widget(widget, figure_png(fig, note=note))


ZERO3_LANES = {"compute": (2, "#8c8c8c"), "all_gather": (1, "#4C72B0"),
               "reduce_scatter": (0, "#DD8452")}


def zero3_lanes(ax, trace, rank, marks, title):
    """One rank's compute, all-gathers and reduce-scatters, each in its lane, between marks =
    (start, turn to backward, end) in the trace's clock; forward shaded blue, backward orange;
    x in ms from start."""
    t0, turn, t1 = marks

    def ms(t):
        return (t - t0) * 1e3
    ax.axvspan(0, ms(turn), color="#eef2f8", zorder=0)
    ax.axvspan(ms(turn), ms(t1), color="#fbf3ec", zorder=0)
    spans = [("compute", s["start"], s["end"]) for s in trace.compute(rank)
             if s["name"] == "compute"]
    spans += [(e["op"], e["start"], e["end"]) for e in trace.comm(rank) if e["op"] in ZERO3_LANES]
    for kind, a, b in spans:
        if t0 <= a < t1:
            lane, color = ZERO3_LANES[kind]
            ax.broken_barh([(ms(a), ms(b) - ms(a))], (lane - 0.35, 0.7), color=color)
    ax.set_yticks([2, 1, 0], ["compute", "all-gather\n(weights)", "reduce-scatter\n(gradients)"],
                  fontsize=9)
    ax.text(ms(turn) / 2, 2.55, f"forward {ms(turn):.1f} ms", ha="center", fontsize=9)
    ax.text((ms(turn) + ms(t1)) / 2, 2.55, f"backward {ms(t1) - ms(turn):.1f} ms", ha="center",
            fontsize=9)
    ax.set_ylim(-0.6, 2.9)
    ax.set_xlim(0, ms(t1))
    ax.set_title(title, fontsize=10)
    return ax
