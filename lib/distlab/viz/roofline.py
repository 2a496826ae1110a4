"""The roofline of one GPU (chapter 00): the FLOP/s a kernel can reach against its arithmetic
intensity, the FLOPs it does per byte it moves.

Every number comes from `distlab.hardware`: the flat roof is the achieved bf16 FLOP/s of a large
GEMM, each slanted roof a bandwidth (HBM, the node's NVLink, one NIC), and the ridge points where
they meet are `hardware.overview.flop_per_byte`'s, the last columns of chapter 00's table. The
labelled kernels are placed where the course's emulator prices them (`Device.gemm_seconds`,
`Device.seconds`), so they sit on or under the roof, never above it.
"""
import matplotlib.pyplot as plt
import numpy as np
import torch

from ..hardware import PRESETS
from ..hardware.overview import flop_per_byte

ROOF_COLORS = {"HBM": "#4C72B0", "NVLink": "#55A868", "NIC": "#C44E52"}


def ridge_points(cluster):
    """{"HBM", "NVLink", "NIC"} -> FLOPs per byte where that bandwidth's roof meets the flat one,
    for `cluster`'s device, intra-node link and one inter-node NIC; and the achieved FLOP/s."""
    achieved, ratios = flop_per_byte(cluster.device, cluster.intra, cluster.inter)
    return dict(zip(ROOF_COLORS, ratios)), achieved


def example_kernels(device):
    """[(label, FLOPs per HBM byte, modeled FLOP/s)] for chapter 00's examples, in bf16: square
    GEMMs on either side of the HBM ridge, a layer's matmul with few tokens (`B` FLOPs per byte)
    (64 tokens through an 8192 × 8192 weight) and an elementwise add (one FLOP per 6 bytes)."""
    bf16 = torch.bfloat16
    kernels = []
    for label, (m, n, k) in (("GEMM 8192³", (8192, 8192, 8192)),
                             ("GEMM 512³", (512, 512, 512)),
                             ("64 tokens", (64, 8192, 8192))):
        flops, nbytes = 2.0 * m * n * k, 2.0 * (m * k + k * n + m * n)
        kernels.append((label, flops / nbytes, flops / device.gemm_seconds(m, n, k, bf16)))
    n = 2 ** 28                                   # a + b: read two bf16 tensors, write one
    flops, nbytes = float(n), 6.0 * n
    kernels.append(("elementwise add", flops / nbytes,
                    flops / device.seconds(flops, nbytes, bf16, mnk=(n, 1, 1))))
    return kernels


def roofline(cluster=None, ax=None):
    """Log-log roofline of `cluster`'s GPU (default: the H100 cluster preset): achieved bf16
    FLOP/s against FLOPs per byte, one slanted roof per bandwidth, and chapter 00's kernels."""
    cluster = cluster if cluster is not None else PRESETS["h100-cluster"]
    device = cluster.device
    made = ax is None
    if made:
        _, ax = plt.subplots(figsize=(7.5, 4.4))
    ridges, achieved = ridge_points(cluster)
    bandwidths = {"HBM": device.memory_bandwidth, "NVLink": cluster.intra.bandwidth,
                  "NIC": cluster.inter.bandwidth}
    peak = device.peak(torch.bfloat16)
    x = np.logspace(-1.5, 5.5, 400)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlim(x[0], x[-1])
    ax.set_ylim(1e11, 3e15)
    ax.set_xlabel("arithmetic intensity: FLOPs per byte moved (through HBM, NVLink or one NIC)")
    ax.set_ylabel("achievable bf16 FLOP/s")
    ax.set_title(f"Roofline of one {device.name.removeprefix('NVIDIA ')} "
                 f"(ridge points: FLOPs per byte)", fontsize=10)
    if made:
        ax.figure.tight_layout()      # before the angles below are read off the axes
    for (name, bw), label_y in zip(bandwidths.items(), (2e13, 4e12, 2e12)):
        color = ROOF_COLORS[name]
        ax.plot(x, np.minimum(achieved, x * bw), color=color, lw=2, zorder=2)
        ridge = ridges[name]
        ax.plot([ridge] * 2, [1e11, achieved], color=color, lw=0.8, ls=":", zorder=1)
        ax.text(ridge, 1.25e11, f" {ridge:,.0f}", color=color, fontsize=8, ha="left")
        # the roof's name along its slanted part, at the angle the line has on screen
        (x0, y0), (x1, y1) = ax.transData.transform([(label_y / bw, label_y),
                                                     (10 * label_y / bw, 10 * label_y)])
        ax.text(label_y / bw, label_y * 1.15, f"{name} {bw / 1e9:,.0f} GB/s", color=color,
                fontsize=8, ha="center", va="bottom", rotation_mode="anchor",
                rotation=np.degrees(np.arctan2(y1 - y0, x1 - x0)))
    ax.axhline(peak, color="0.5", lw=0.8, ls="--", zorder=1)
    ax.text(x[0] * 1.3, peak * 1.1, f"datasheet peak {peak / 1e12:,.0f} TFLOP/s", fontsize=8,
            color="0.4", va="bottom")
    ax.text(x[0] * 1.3, achieved / 1.1, f"achieved {achieved / 1e12:,.0f} TFLOP/s", fontsize=8,
            color="0.2", va="top")
    for label, intensity, rate in example_kernels(device):
        ax.plot(intensity, rate, "o", color="black", ms=5, zorder=3)
        below = label.startswith("GEMM 512")    # between two roofs: its name goes under it
        ax.annotate(label, (intensity, rate), xytext=(0, -7) if below else (6, -4),
                    textcoords="offset points", fontsize=8, va="top",
                    ha="center" if below else "left")
    return ax
