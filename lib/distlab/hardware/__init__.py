"""A calibrated model of GPUs and their links: what real hardware ACHIEVES, beside its datasheet.

The emulated accelerator (`distlab.emulate`) and the cost model charge time with the numbers
here. Datasheet peaks are what the hardware can never quite do; the course's performance
lessons need what it does. So every device and link carries both, and every constant below
names where it comes from (a vendor datasheet, a measurement published by NVIDIA's NCCL
maintainers, a published table of measured matmuls). Where a number is an estimate, its comment
says so. `bench/fidelity.py` holds the model against published measurements.


The package, one module per idea:
- `kernels`: fused attention as its own kernel (AttentionKernel: FlashAttention-2/-3 rates by
  sequence length, head size, mask and direction);
- `devices`: a GPU's kernels (Device: launch floor, GEMM efficiency by shape, HBM) and the
  calibrated A100, H100, H200;
- `fabric`: links and the fabric between GPUs (Link, GroupLink, Cluster.link_between) and the
  calibrated NVLink, InfiniBand and Ethernet links;
- `presets`: the calibrated clusters by name (PRESETS, DATASHEET, CALIBRATED_LEGACY);
- `step`: one training step of a transformer in closed form (Transformer, step_seconds).
"""
from .devices import A100, H100, H100_GRAND_TETON, H200, Device
from .kernels import FA2_A100, FA2_H100, FA3_H100, AttentionKernel, AttentionShape
from .fabric import (ETH_100G, IB_HDR, IB_NDR, NVLINK3, NVLINK4, Cluster, GroupLink, Link,
                     measured)
from .presets import CALIBRATED_LEGACY, DATASHEET, PRESETS
from .step import SUSTAINED, Transformer, step_seconds

__all__ = ["A100", "H100", "H100_GRAND_TETON", "H200", "Device", "FA2_A100", "FA2_H100", "FA3_H100",
           "AttentionKernel", "AttentionShape", "ETH_100G", "IB_HDR", "IB_NDR", "NVLINK3",
           "NVLINK4", "Cluster", "GroupLink", "Link", "measured", "CALIBRATED_LEGACY", "DATASHEET",
           "PRESETS", "SUSTAINED", "Transformer", "step_seconds"]
