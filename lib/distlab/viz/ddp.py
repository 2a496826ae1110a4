"""Pictures of chapter 05, drawn from runs (measured or emulated): the compute/communication timeline of one
backward pass per bucket, a bucket-size sweep, loss curves and per-rank step times."""
import matplotlib.pyplot as plt
from matplotlib.patches import Patch

from ..trace import _unit

COMPUTE, COMM = "#4C72B0", "#DD8452"


def _axes(ax, size=(9, 3)):
    if ax is None:
        _, ax = plt.subplots(figsize=size)
    return ax


def ddp_timeline(timeline, ax=None, title="one backward pass"):
    """Backward compute on the top row, one all-reduce bar per bucket below (milliseconds).

    `timeline` is what `BucketedDDP.last_timeline()` returns; a tick on the compute row marks the
    moment each bucket's last gradient was ready.
    """
    ax = _axes(ax)
    buckets = timeline["buckets"]
    end = timeline["backward_end"]
    last = max([end] + [b["done"] for b in buckets])
    unit, ms = ("µs", 1e6) if last < 1e-3 else ("ms", 1e3)     # `ms`: the scale of that unit
    ax.barh(0, end * ms, left=0, height=0.6, color=COMPUTE)
    for b in buckets:
        ax.plot([b["ready"] * ms] * 2, [-0.3, 0.3], color="white", lw=1.5)
        row = 1 + b["index"]
        ax.barh(row, (b["done"] - b["launched"]) * ms, left=b["launched"] * ms, height=0.6,
                color=COMM, edgecolor="black", lw=0.5)
        ax.text(b["done"] * ms, row, f" {b['nbytes'] / 2 ** 20:.1f} MiB", va="center", fontsize=8)
    ax.axvline(end * ms, color=COMPUTE, ls=":", lw=1)
    ax.axvline(last * ms, color="black", ls="--", lw=1)
    ax.set_yticks(range(len(buckets) + 1),
                  ["backward"] + [f"bucket {b['index']}" for b in buckets])
    ax.invert_yaxis()
    ax.set_xlim(0, last * ms * 1.15)
    ax.set_xlabel(f"{unit} since backward began")
    ax.set_title(f"{title}: gradients ready at {end * ms:.1f} {unit}, all synced at "
                 f"{last * ms:.1f} {unit}",
                 fontsize=10)
    ax.legend(handles=[Patch(color=COMPUTE, label="backward compute"),
                       Patch(color=COMM, label="all_reduce of a bucket")],
              loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8)
    return ax


def mark_span(ax, trace, start, end, text, rank=0):
    """Name the calls between `start` and `end` (seconds) on `rank`'s communication row of a
    `distlab.viz.trace.timeline(trace)` picture: a bracket under them and `text` beside it, in the
    gap before the next rank's row (that picture draws rank r's calls at r + 0.03 ... r + 0.33)."""
    _, scale = _unit(trace.end())       # the unit timeline() chose for the same trace
    x0, x1 = start * scale, end * scale
    ax.plot([x0, x0, x1, x1], [rank + 0.36, rank + 0.42, rank + 0.42, rank + 0.36], color="black",
            lw=1)
    ax.annotate(text, xy=(x1, rank + 0.42), xytext=(x1 + 0.02 * trace.end() * scale, rank + 0.56),
                fontsize=8, va="center", arrowprops=dict(arrowstyle="-", lw=0.6))
    return ax


def bucket_sweep(caps_mb, step_ms, n_buckets, ax=None, model_ms=None,
                 ylabel="step time (ms, median)", title=None):
    """Step time against bucket size, each point labelled with its number of buckets; `model_ms`
    (optional) draws the cost model's prediction beside it."""
    ax = _axes(ax, (6, 3.5))
    ax.plot(caps_mb, step_ms, "o-", color=COMM, label="run" if model_ms is None else "emulated run")
    if model_ms is not None:
        ax.plot(caps_mb, model_ms, "x--", color="black", lw=1, label="cost model")
        ax.legend(fontsize=8, loc="upper right")
    for cap, t, n in zip(caps_mb, step_ms, n_buckets):
        ax.annotate(f"{n} bucket{'s' if n != 1 else ''}", (cap, t), textcoords="offset points",
                    xytext=(0, 7), ha="center", fontsize=8)
    ax.set_xscale("log")
    ax.set_xlabel("bucket_cap_mb (log scale)")
    ax.set_ylabel(ylabel)
    ax.set_title(title or "bucket size: many small messages vs little overlap", fontsize=10)
    ax.margins(y=0.2)
    return ax


def loss_curves(curves, ax=None, title="training loss", styles=None):
    """`curves`: {label: [loss per step]}. Equal curves are drawn thick then thin so both show."""
    ax = _axes(ax, (7, 3.5))
    styles = styles or {}
    for i, (label, losses) in enumerate(curves.items()):
        style = dict(lw=max(4 - 1.5 * i, 1), alpha=0.8)
        style.update(styles.get(label, {}))
        ax.plot(range(1, len(losses) + 1), losses, label=label, **style)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("loss")
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=8)
    return ax


def step_times(per_rank_ms, ax=None, title="step time per rank"):
    """`per_rank_ms`: one list of step times (ms) per rank, stacked as data / compute / wait."""
    ax = _axes(ax, (7, 3.2))
    parts = ("data", "compute", "wait")
    colors = ("#8172B2", COMPUTE, COMM)
    left = [0.0] * len(per_rank_ms)
    for part, color in zip(parts, colors):
        widths = [r[part] for r in per_rank_ms]
        ax.barh(range(len(per_rank_ms)), widths, left=left, color=color, label=part)
        left = [a + b for a, b in zip(left, widths)]
    ax.set_yticks(range(len(per_rank_ms)), [f"rank {r}" for r in range(len(per_rank_ms))])
    ax.invert_yaxis()
    ax.set_xlabel("milliseconds per step (median)")
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    return ax


def construction_broadcast(ax, trace, link, rank=0):
    """Bracket, on a trace timeline, the broadcasts a DDP constructor made from rank 0, and say
    what they were: how many calls of how many bytes, how long they took, and what the same bytes
    would cost as one broadcast on `link` (an emulate Link)."""
    casts = trace.comm(rank, op="broadcast")
    total = sum(e["bytes"] for e in casts)
    mark_span(ax, trace, casts[0]["start"], casts[-1]["end"],
              f"BucketedDDP(model): {len(casts)} × {casts[0]['op']} from rank 0, "
              f"{total / 2**20:.1f} MiB", rank=rank)
    blocked = ", ".join(f"rank {r} {sum(e['waited'] for e in trace.comm(r, op='broadcast')) * 1e6:.0f}"
                        f" µs" for r in range(trace.world_size))
    return "\n".join([
        f"the first bar: {len(casts)} calls of {casts[0]['op']}, one per tensor, "
        f"{min(e['bytes'] for e in casts):,} to {max(e['bytes'] for e in casts):,} bytes of "
        f"{casts[0]['dtype']}; {total:,} bytes in all ({total / 2**20:.1f} MiB)",
        f"from {casts[0]['start'] * 1e6:.0f} to {casts[-1]['end'] * 1e6:.0f} µs: "
        f"{(casts[-1]['end'] - casts[0]['start']) * 1e6:.0f} µs; blocked in them: {blocked}",
        f"the same bytes as one broadcast: "
        f"{link.seconds('broadcast', total, trace.world_size) * 1e6:.0f} µs; the step's first "
        f"all-reduce starts at {trace.comm(rank, op='all_reduce')[0]['start'] * 1e6:,.0f} µs"])
