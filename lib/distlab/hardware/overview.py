"""The hardware on one screen (chapter 00): what each GPU and its links can do, and how many FLOPs
a kernel must do per byte it moves to keep the GPU busy."""
import torch

BF16, F32 = torch.bfloat16, torch.float32


def flop_per_byte(gpu, nvlink, nic):
    """The achieved bf16 FLOP/s of a large square GEMM (8192³) on `gpu`, divided by each achieved
    bandwidth: HBM, `nvlink`'s bus bandwidth and one `nic`'s. Returns (achieved FLOP/s, [HBM,
    NVLink, NIC] FLOPs per byte)."""
    achieved = gpu.peak(BF16) * gpu.gemm_efficiency(8192, 8192, 8192)
    return achieved, [achieved / bw for bw in (gpu.memory_bandwidth, nvlink.bandwidth,
                                               nic.bandwidth)]


def table(systems):
    """A text table, one row per (Device, NVLink Link, NIC Link) of `systems`: bf16 peak and
    achieved TFLOP/s, fp32 peak, HBM size and bandwidth, NVLink bus bandwidth, NIC GB/s per GPU,
    and `flop_per_byte` of each."""
    lines = [f"{'':22}{'TFLOP/s bf16':>16}{'fp32':>6}{'HBM':>6}{'TB/s':>6}{'NVLink':>8}"
             f"{'NIC GB/s':>10}   FLOP per byte:",
             f"{'':22}{'peak  achieved':>16}{'peak':>6}{'GB':>6}{'achv':>6}{'busbw':>8}"
             f"{'per GPU':>10}   {'HBM':>5} {'NVLink':>6} {'NIC':>6}"]
    for gpu, nvlink, nic in systems:
        achieved, ratios = flop_per_byte(gpu, nvlink, nic)
        name = gpu.name.removeprefix("NVIDIA ")
        lines.append(f"{name:22}{gpu.peak(BF16) / 1e12:7.0f}{achieved / 1e12:9.0f}"
                     f"{gpu.peak(F32) / 1e12:6.1f}{gpu.memory_bytes / 1e9:6.0f}"
                     f"{gpu.memory_bandwidth / 1e12:6.2f}{nvlink.bandwidth / 1e9:8.0f}"
                     f"{nic.bandwidth / 1e9:10.0f}   " + " ".join(f"{r:>6,.0f}" for r in ratios))
    return "\n".join(lines)
