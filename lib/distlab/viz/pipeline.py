"""Gantt charts of pipeline schedules: one drawing for simulated and for measured timelines.

A timeline is a list of {stage, kind, mb, chunk, start, end} records, as returned by
distlab.pipeline_schedules.simulate and recorded by distlab.pipeline_parallel.PipelineStage.
"""
import matplotlib.pyplot as plt
from matplotlib.colors import to_rgb

from ..pipeline_schedules import (SCHEDULES, bubble_fraction, make_schedule, simulate, theory,
                                  theory_bubble)

COLORS = {"F": "#4C72B0", "B": "#55A868", "I": "#DD8452", "W": "#8172B3"}
NAMES = {"F": "forward", "B": "backward", "I": "input grad", "W": "weight grad"}


def _shade(color, chunk):
    # Later chunks of an interleaved schedule in lighter tones of the same colour.
    return tuple(c + (1 - c) * min(0.45, 0.3 * chunk) for c in to_rgb(color))


def gantt(timeline, ax=None, title=None, unit="", label_mbs=True):
    """Draw one row per stage, one box per action, labelled with its micro-batch."""
    if ax is None:
        _, ax = plt.subplots(figsize=(10, 0.5 + 0.5 * (1 + max(e["stage"] for e in timeline))))
    begin = min(e["start"] for e in timeline)
    span = max(e["end"] for e in timeline) - begin
    stages = sorted({e["stage"] for e in timeline})
    for e in timeline:
        x, w = e["start"] - begin, e["end"] - e["start"]
        ax.barh(e["stage"], w, left=x, height=0.8, color=_shade(COLORS[e["kind"]], e["chunk"]),
                edgecolor="white", linewidth=0.5)
        if label_mbs and w > span / 60:
            ax.text(x + w / 2, e["stage"], str(e["mb"]), ha="center", va="center",
                    fontsize=8, color="white")
    ax.set_yticks(stages, [f"stage {s}" for s in stages])
    ax.set_ylim(max(stages) + 0.6, min(stages) - 0.6)
    ax.set_xlim(0, span)
    ax.set_xlabel(f"time{f' ({unit})' if unit else ''}")
    kinds = [k for k in COLORS if any(e["kind"] == k for e in timeline)]
    ax.legend(handles=[plt.Rectangle((0, 0), 1, 1, color=COLORS[k]) for k in kinds],
              labels=[NAMES[k] for k in kinds], loc="upper left", bbox_to_anchor=(1.0, 1.0),
              fontsize=8, frameon=False)
    bubble = bubble_fraction(timeline)
    ax.set_title(f"{title + ' — ' if title else ''}bubble {bubble:.0%}", fontsize=10)
    return ax


def side_by_side(simulated, measured, title_sim="simulated", title_meas="measured"):
    """The simulator's chart above the chart of a real run: same schedule, same drawing."""
    p = 1 + max(e["stage"] for e in simulated)
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(10, 1.2 + 1.0 * p))
    gantt(simulated, top, title_sim, unit="units")
    gantt(measured, bottom, title_meas, unit="s")
    fig.tight_layout()
    return fig


def explain(name, p, m, bubble, v=1):
    """One line under a schedule's chart: the simulated bubble beside the formula that applies."""
    base = theory_bubble(p, m)
    line = f"simulated (F = 1, B = I + W = 2): idle {bubble:.0%} of p × span"
    if name in ("GPipe", "1F1B"):
        return f"{line} = (p-1)/(m+p-1) = {base:.0%}"
    if name == "interleaved 1F1B":
        return (f"{line} = (p-1)/(v·m+p-1) = {theory_bubble(p, m, v):.0%} with v = {v} chunks "
                f"(one chunk per stage: (p-1)/(m+p-1) = {base:.0%})")
    zb = theory(name, p, m)
    if zb is None:
        return (f"{line}; with m < p too few micro-batches fill the ramp (1F1B: "
                f"(p-1)/(m+p-1) = {base:.0%})")
    return (f"{line} = (p-1)/(3m+p-1) = {zb:.0%}: a third of 1F1B's idle time "
            f"(1F1B: (p-1)/(m+p-1) = {base:.0%})")


def _schedule_chart(name, p, m, ax=None):
    """The Gantt chart of schedule `name` for p stages and m micro-batches, explained under it."""
    schedule = make_schedule(name, p, m)
    v = 1 + max(a.chunk for s in schedule for a in s)
    timeline = simulate(schedule, m)
    ax = gantt(timeline, title=name, ax=ax)
    ax.figure.text(0.01, 0.005, explain(name, p, m, bubble_fraction(timeline), v),
                   fontsize=8, ha="left", va="bottom")
    ax.figure.subplots_adjust(bottom=min(0.6, 0.8 / ax.figure.get_figheight()))
    return ax


def schedule_widget(p=4, m=8):
    """Sliders for p and m, a menu of schedules: the Gantt chart and its bubble vs theory."""
    import ipywidgets as w
    from matplotlib.figure import Figure

    from ._fallback import NOTE, display_widget, figure_png

    out = w.Output()
    # Fixed widths that fit each label and value; the row wraps on a narrow screen.
    style = {"description_width": "initial"}
    ps = w.IntSlider(value=p, min=1, max=8, description="stages p", style=style,
                     layout=w.Layout(width="260px", min_width="260px"))
    ms = w.IntSlider(value=m, min=1, max=24, description="micro-batches m", style=style,
                     layout=w.Layout(width="340px", min_width="340px"))
    name = w.Dropdown(options=list(SCHEDULES), value="1F1B", description="schedule",
                      style=style, layout=w.Layout(width="300px", min_width="300px"))

    def draw(*_):
        with out:
            out.clear_output(wait=True)
            try:
                _schedule_chart(name.value, ps.value, ms.value)
            except ValueError as e:
                print(e)
                return
            plt.show()

    for control in (ps, ms, name):
        control.observe(draw, names="value")
    draw()
    widget = w.VBox([w.HBox([ps, ms, name], layout=w.Layout(flex_flow="row wrap")), out])
    # Where no kernel runs (a static page), the default view as a picture instead.
    fig = Figure(figsize=(10, 0.5 + 0.5 * (1 + p)))
    _schedule_chart(name.value, p, m, ax=fig.add_subplot())
    display_widget(widget, figure_png(fig, note=f"{NOTE} Shown: p = {p} stages, m = {m} "
                                                 "micro-batches."))
