"""Data parallelism measured on real GPUs, as published (chapters 05 and 05b).

The chapters' performance lessons (overlap, bucket size, weak scaling) run on the course's
calibrated emulator, which charges no contention, no jitter and no straggler. These are the
measurements set beside them: each number as its source prints it, with the source, the sentence
or table it was read from, and what was measured (model, batch per GPU, hardware, software), so
that a reader can judge how far it compares with the emulated curve. Nothing here is recalled or
estimated: efficiencies derived from a throughput table are computed from that table's numbers by
`efficiency_from_throughput`.
"""
from dataclasses import dataclass

DDP_BENCH = ("pytorch/pytorch benchmarks/distributed/ddp/README.md (example output of the DDP "
             "benchmark: PyTorch 1.4.0a0, CUDA 10.0, NCCL, DGX-1 V100 machines with 4x 100Gb "
             "InfiniBand each), https://github.com/pytorch/pytorch/blob/main/benchmarks/distributed/ddp/README.md")

# Per-GPU throughput (p50 ex/sec) of the benchmark's table, batch 32 per GPU; "1 GPUs -- no ddp"
# is the baseline; 16 GPUs are "2M/8G", two machines of 8. The table's sec/iter agrees: 32 / 0.097
# s = 330/s for ResNet-50 on one GPU.
DDP_BENCH_EX_PER_S = {
    "ResNet-50": {1: 329, 2: 310, 4: 310, 8: 307, 16: 306},
    "ResNet-101": {1: 197, 2: 182, 4: 182, 8: 179, 16: 178},
}

# The benchmark's diff of bucket_cap_mb=1 against the default 25: the p75 throughput change (%)
# at each number of GPUs, as its table prints it.
DDP_BENCH_BUCKET_1MB_VS_25MB = {
    "ResNet-50": {1: -0.3, 2: -1.0, 4: -1.6, 8: -2.6, 16: -3.8},
    "ResNet-101": {1: -1.2, 2: -2.1, 4: -2.6, 8: -3.5, 16: -0.1},
}
DDP_BENCH_BUCKET_QUOTE = ("This compares throughput between `bucket_cap_mb=25` (the default) and "
                          "`bucket_cap_mb=1` on 8 DGX machines with V100 GPUs. It confirms that even "
                          "for a relatively small model on machines with a very fast interconnect "
                          "(4x 100Gb InfiniBand per machine), it still pays off to batch allreduce calls.")


def efficiency_from_throughput(per_gpu):
    """{N: per-GPU throughput} -> {N: weak-scaling efficiency}: throughput per GPU at N over that
    of the smallest N (N ranks each doing the same per-GPU work, so speedup / N is that ratio)."""
    base = per_gpu[min(per_gpu)]
    return {n: v / base for n, v in per_gpu.items()}


@dataclass(frozen=True)
class Measured:
    """One published weak-scaling efficiency: `efficiency` at `gpus`, relative to `baseline_gpus`
    (None where the source does not say)."""
    label: str          # short, for a legend
    gpus: int
    efficiency: float
    baseline_gpus: int
    what: str           # model, batch per GPU, hardware, software: what to compare it with
    cite: str           # short, for a printed line
    source: str         # paper / file and where in it, with a URL
    quote: str          # the sentence or table row it was read from


def _ddp_bench_points():
    points = []
    for model, table in DDP_BENCH_EX_PER_S.items():
        for n, eff in efficiency_from_throughput(table).items():
            if n in (8, 16):
                points.append(Measured(
                    f"torch DDP, {model}, V100 (pytorch benchmark)", n, eff, 1,
                    f"{model}, batch 32 per GPU, DGX-1 V100s (16 = 2 machines), NCCL, PyTorch 1.4 "
                    f"DDP; baseline: one GPU without DDP", "pytorch benchmarks/distributed/ddp",
                    DDP_BENCH,
                    f"{n} GPUs: p50 {table[n]} ex/s per GPU against {table[1]} ex/s on 1 GPU, no ddp"))
    return points


WEAK_SCALING = tuple(_ddp_bench_points()) + (
    Measured("Goyal et al. 2017, ResNet-50, P100 (from 8 GPUs)", 256, 0.90, 8,
             "ResNet-50, Caffe2, minibatch 8192 on 256 GPUs (32 per GPU), Tesla P100; efficiency "
             "relative to 8 GPUs, not 1", "Goyal et al. 2017",
             "Goyal et al., 'Accurate, Large Minibatch SGD: Training ImageNet in 1 Hour', "
             "arXiv:1706.02677, abstract, https://arxiv.org/abs/1706.02677 (P100: "
             "https://developer.nvidia.com/facebook-trains-imagenet-1-hour)",
             "Using commodity hardware, our implementation achieves ~90% scaling efficiency when "
             "moving from 8 to 256 GPUs."),
    Measured("Horovod, Inception V3 / ResNet-101, Pascal", 512, 0.90, None,
             "Inception V3 and ResNet-101, Horovod (ring all-reduce), 128 servers of 4 Pascal GPUs, RoCE 25 Gbit/s",
             "horovod README",
             "horovod/horovod README.rst, 'Why Horovod?', https://github.com/horovod/horovod "
             "(Sergeev & Del Balso 2018, arXiv:1802.05799)",
             "a benchmark that was done on 128 servers with 4 Pascal GPUs each connected by "
             "RoCE-capable 25 Gbit/s network [...] Horovod achieves 90% scaling efficiency for both "
             "Inception V3 and ResNet-101, and 68% scaling efficiency for VGG-16."),
    Measured("Horovod, VGG-16, Pascal", 512, 0.68, None,
             "VGG-16, Horovod (ring all-reduce), 128 servers of 4 Pascal GPUs, RoCE 25 Gbit/s",
             "horovod README",
             "horovod/horovod README.rst, 'Why Horovod?', https://github.com/horovod/horovod "
             "(Sergeev & Del Balso 2018, arXiv:1802.05799)",
             "Horovod achieves 90% scaling efficiency for both Inception V3 and ResNet-101, and 68% "
             "scaling efficiency for VGG-16."),
    Measured("Megatron-LM 2019, GPT-2 up to 8.3B (tensor x data parallel)", 512, 0.76, 1,
             "not pure data parallelism: tensor parallel x data parallel, the model grown with the "
             "GPUs (8.3 B parameters at 512 GPUs); baseline one GPU at 39 TFLOP/s",
             "Shoeybi et al. 2019",
             "Shoeybi et al., 'Megatron-LM: Training Multi-Billion Parameter Language Models Using "
             "Model Parallelism', arXiv:1909.08053, abstract, https://arxiv.org/abs/1909.08053",
             "We sustain 15.1 PetaFLOPs across the entire application with 76% scaling efficiency "
             "when compared to a strong single GPU baseline that sustains 39 TeraFLOPs, which is 30% "
             "of peak FLOPs."),
)

# Overlap on GPUs: the only measured on/off comparisons found (no number of the DDP paper,
# Li et al. VLDB 2020, could be read here; its abstract says "near-linear scalability using 256 GPUs").
OVERLAP = (
    ("4x A100 (PCIe), modded-nanogpt track 3: torch DDP (NCCL on its own stream, overlapping "
     "backward) instead of all-reduces issued on the compute stream", "10 % less wall-clock per step",
     "KellerJordan/modded-nanogpt#263 (alint77), https://github.com/KellerJordan/modded-nanogpt/issues/263",
     "On this 4xA100 PCIE system saves 10% wallclock per step with same loss curve"),
    ("4x A100 (interconnect not stated), the same change", "628 ms/step without DDP, 624 with: < 1 %",
     "KellerJordan/modded-nanogpt#263 (KellerJordan)",
     "on 4xA100, I'm seeing 628ms/step without DDP, and 624ms/step with DDP"),
    ("DeepSpeed overlap_comm (backward and gradient all-reduce), an SFT job (setup not stated)",
     "1.05x end to end", "deepspeedai/DeepSpeedExamples#846, https://github.com/deepspeedai/DeepSpeedExamples/pull/846",
     "This produces 1.05x end-to-end speedup in SFT training with my settings."),
)


def bucket_report():
    """The DDP benchmark's measured cost of 1 MiB buckets instead of 25, one line per model."""
    lines = [f"measured, bucket_cap_mb=1 against 25 (p75 throughput change; batch 32 per GPU, "
             f"V100s, NCCL): {DDP_BENCH.split(' (')[0]}"]
    for model, diff in DDP_BENCH_BUCKET_1MB_VS_25MB.items():
        lines.append(f"  {model:>10}: " + ", ".join(f"{n} GPUs {d:+.1f} %" for n, d in diff.items()))
    return "\n".join(lines)


def overlap_report():
    """The measured overlap on/off comparisons, one line each with its source."""
    return "\n".join(f"measured: {setup}: {effect} ({source})" for setup, effect, source, _ in OVERLAP)


def weak_scaling_report(points=WEAK_SCALING):
    """One line per measured point: efficiency, GPUs, baseline, what was measured, source."""
    return "\n".join(
        f"{p.efficiency:5.3f} at {p.gpus:3d} GPUs "
        f"({f'vs {p.baseline_gpus}' if p.baseline_gpus else 'baseline not stated'}): {p.what} "
        f"[{p.cite}]"
        for p in points)
