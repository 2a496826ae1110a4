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
    materialized s×s scores); see what one GPU holds and whether it fits in 80 GB."""
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
        parts = memory.per_gpu_bytes(**kw)
        total = sum(parts.values())
        verdict = "fits" if total <= 80 * memory.GB else "does NOT fit"
        memory_bars({"one GPU": parts}, capacity=80 * memory.GB, ax=ax,
                    title=f"{total / memory.GB:,.1f} GB per GPU: {verdict} in 80 GB")

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
