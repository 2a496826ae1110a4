"""Pictures of chapter 05, drawn from runs (measured or emulated): the compute/communication timeline of one
backward pass per bucket, a bucket-size sweep, loss curves, per-rank step times and (chapter 05b)
the scaling efficiency of a weak-scaling sweep; and the few lines of text printed beside them
(what a run's trace or timelines say, in numbers), so that a cell of the chapter is its idea and
one call, not twenty lines of bookkeeping."""
import csv

import matplotlib.pyplot as plt
import torch
from matplotlib.patches import Patch

from ..data_parallel import jitter_efficiency, predict_step
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


def _step(run):
    """The step's seconds of a distlab.run of (timeline, seconds, ...) per rank: the slowest rank's."""
    return max(r[1] for r in run)


def mlp_step_report(on, off, datasheet_on, datasheet_off, device, widths, batch):
    """Where an emulated data-parallel step of an MLP goes (chapter 05, §4): the step with overlap
    on and off, its matmuls' time by the device model (`device`: an emulate preset's device, the
    same formulas the emulator charges), its bucket all-reduces, and the same two runs at
    datasheet rates.

    `on`, `off`, `datasheet_on`, `datasheet_off`: distlab.run results of a function returning
    (BucketedDDP.last_timeline(), step seconds, ...) per rank; `widths`: the MLP's layer widths;
    `batch`: samples per rank."""
    step_on, step_off = _step(on), _step(off)
    shapes = list(zip(widths[:-1], widths[1:]))           # (in, out) of each Linear layer
    # forward: batch × out × in; backward: the input's gradient (batch × in × out; the first
    # layer needs none) and the weight's (out × in × batch)
    gemms = ([(batch, o, i) for i, o in shapes] + [(batch, i, o) for i, o in shapes[1:]]
             + [(o, i, batch) for i, o in shapes])
    gemm_time = sum(device.gemm_seconds(m, n, k, torch.float32) for m, n, k in gemms)
    wide = max(widths)
    transfers = [b["done"] - b["launched"] for b in on[0][0]["buckets"]]
    ideal_on, ideal_off = _step(datasheet_on), _step(datasheet_off)
    return "\n".join([
        f"one step on {len(on)} ranks: {step_on * 1e6:,.0f} µs with overlap, {step_off * 1e6:,.0f} µs "
        f"without: off / on = {step_off / step_on:.2f}",
        f"its {len(gemms)} matmuls: {gemm_time * 1e6:,.0f} µs; one of {batch}×{wide}×{wide} takes "
        f"{device.gemm_seconds(batch, wide, wide, torch.float32) * 1e6:.0f} µs, at "
        f"{device.gemm_efficiency(batch, wide, wide, torch.float32):.0%} of the fp32 peak; every "
        f"other op costs at least {device.floor * 1e6:.0f} µs",
        f"its {len(transfers)} bucket all-reduces: {sum(transfers) * 1e6:.0f} µs in all "
        f"({sum(transfers) / step_on:.0%} of the step), {min(transfers) * 1e6:.0f}-"
        f"{max(transfers) * 1e6:.0f} µs each",
        f"at datasheet rates: {ideal_on * 1e6:.0f} µs with overlap, {ideal_off * 1e6:.0f} µs "
        f"without: off / on = {ideal_off / ideal_on:.2f}"])


def overlap_report(big, alone, cluster, nodes=2):
    """Overlap at real size (chapter 05, §4): for overlap on and off, when the emulated N-rank
    run's backward ended and its buckets were synced, its step, and the step predicted from the
    one-rank run (`predict_step` on the cluster's link of N ranks); then off / on for the N ranks
    and, predicted, for the ranks of one node.

    `big`: {overlap: distlab.run result of gpt_step on N ranks}; `alone`: {overlap: gpt_step's
    (timeline, seconds) on one rank}; `cluster`: the emulate preset the N ranks ran on, `nodes`
    of them."""
    n = big[True].trace.world_size
    every, one_node = (cluster.link_between(range(k)) for k in (n, n // nodes))
    lines = []
    for overlap in (True, False):
        tl, _ = big[overlap][0]
        lines.append(
            f"{n} ranks, overlap {'on ' if overlap else 'off'}: backward done at "
            f"{tl['backward_end'] * 1e3:.2f} ms, all buckets synced at "
            f"{max(b['done'] for b in tl['buckets']) * 1e3:.2f} ms; step {_step(big[overlap]) * 1e3:.2f} ms "
            f"(predicted from one rank {predict_step(*alone[overlap], n, every) * 1e3:.2f}; "
            f"one rank alone {alone[overlap][1] * 1e3:.2f})")
    in_node = {overlap: predict_step(*alone[overlap], n // nodes, one_node) for overlap in (True, False)}
    lines.append(f"overlap off / on: {n} ranks on {'two' if nodes == 2 else nodes} nodes "
                 f"{_step(big[False]) / _step(big[True]):.2f} (emulated); {n // nodes} ranks in one "
                 f"node {in_node[False] / in_node[True]:.2f} (predicted)")
    return "\n".join(lines)


def scaling_efficiency(world_sizes, speedup, jitter=None, node=8, styles=None, ax=None,
                       title="weak scaling"):
    """Scaling efficiency (speedup / N) against N on a log2 axis, one line per curve of `speedup`
    ({label: [speedup at each N of world_sizes]}, `distlab.data_parallel.weak_scaling`): 1 is
    perfect, and a bend shows as a drop (a log-log speedup hides it). The first curve is drawn
    wide with open circles, so a curve that coincides with it stays visible on top; `styles`
    ({label: plot keywords}) changes any curve's look. `jitter`: also draw
    `jitter_efficiency(N, jitter)`, the cost of waiting for the slowest rank when each rank's step
    varies by that fraction (an assumption); `node`: where the ranks stop fitting in one node."""
    ax = _axes(ax, (7.5, 4))
    styles = styles or {}
    for i, (label, ys) in enumerate(speedup.items()):
        look = dict(ls="-", marker="o", ms=9, mfc="none", lw=3, alpha=0.5) if i == 0 else \
            dict(ls="-", marker=".")
        look.update(styles.get(label, {}))
        ax.plot(world_sizes, [y / n for y, n in zip(ys, world_sizes)], label=f"{label} (predicted)",
                **look)
    if jitter is not None:
        percent = f"{round(jitter * 100, 6):g} %"
        ax.plot(world_sizes, [jitter_efficiency(n, jitter) for n in world_sizes], ":",
                color="grey", label=f"overlap on, if each rank's step varied by {percent} (assumed)")
    ax.axvline(node, color="black", lw=0.8, ls=":")
    ax.annotate("one node | across nodes", (node, 1.01), ha="center", fontsize=8)
    ax.set_xscale("log", base=2)
    ax.set_ylim(0.75, 1.02)
    ax.set_xlabel("ranks (GPUs)")
    ax.set_ylabel("scaling efficiency (speedup / N)")
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=8, loc="lower left")
    return ax


# nccl-tests' all_reduce bus bandwidth on A100 nodes, rows of bench/published.csv, beside the
# emulate preset (and its number of ranks) that models the same GPUs
NCCL_TESTS_A100 = (("8xA100 all_reduce busbw (large)", "a100-node", 8),
                   ("2x DGX A100 all_reduce busbw (8 HDR NICs each)", "a100-2x8", 16))


def busbw_beside_nccl_tests(published_csv, cases=NCCL_TESTS_A100):
    """One line per (case, emulate preset, ranks) of `cases`: the preset's all_reduce bus
    bandwidth between that many ranks beside what nccl-tests measured (the row `case` of
    `published_csv`, bench/published.csv, with its source)."""
    from ..emulate import PRESETS       # on first use: the emulator imports DTensor and sympy
    with open(published_csv) as f:
        published = {row["case"]: row for row in csv.DictReader(f)}
    lines = []
    for case, preset, n in cases:
        row = published[case]
        cluster = PRESETS[preset]
        gpu = cluster.device.name.removeprefix("NVIDIA ").split()[0]     # "A100"
        model = cluster.link_between(range(n)).busbw()
        lines.append(f"all_reduce busbw, {n} {gpu}s: model {model / 1e9:.0f} GB/s, nccl-tests "
                     f"{float(row['value']):.1f} GB/s ({row['source']})")
    return "\n".join(lines)


def measured_points(ax, points, ymin=0.6):
    """Draw published weak-scaling measurements (`distlab.published_dp.Measured`) on a
    `scaling_efficiency` picture: one marker style per source label, filled and black-edged so
    they read as measurements beside the model's lines; the axes widen to hold them. The legend
    moves outside, right of the plot, with every label marked predicted, assumed or measured."""
    markers = "sDv^P*X"
    by_label = {}
    for p in points:
        by_label.setdefault(p.label, []).append(p)
    for i, (label, group) in enumerate(by_label.items()):
        ax.plot([p.gpus for p in group], [p.efficiency for p in group], ls="none",
                marker=markers[i % len(markers)], ms=8, mec="black", mew=0.8,
                label=f"{label} (measured)")
    lo, hi = ax.get_xlim()
    ax.set_xlim(lo, max(hi, 1.3 * max(p.gpus for p in points)))
    ax.set_ylim(min(ymin, min(p.efficiency for p in points) - 0.03), 1.02)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    return ax
