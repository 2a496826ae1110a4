"""What FSDP2's CPU offload costs a step: the bytes over PCIe and the optimizer step on the CPU.

Read from torch 2.13's `torch/distributed/fsdp/_fully_shard/`: with
`fully_shard(..., offload_policy=CPUOffloadPolicy())` every sharded parameter lives in host
memory, pinned by default (`pin_memory=True`, `_fsdp_param.py`), in its own dtype — fp32 master
weights stay fp32. Before each all-gather FSDP2 copies the rank's shard host→device
(`all_gather_inputs`: `.to(device, non_blocking=True)`, then the cast to `param_dtype` on the GPU),
so with `reshard_after_forward=True` a unit's fp32 shard crosses PCIe twice a step, for forward
and again for backward. After each reduce-scatter the gradient shard, cast back to the parameter's
dtype (fp32) on the GPU, is copied device→host (`_fsdp_collectives.py`; asynchronous from pinned
memory unless gradients accumulate). Adam's states are made by the optimizer beside its CPU
parameters and never cross PCIe; the step runs on the CPU, between backward and the next forward,
while the GPU waits.

The rates below are measured ones, each with its source; what they assume is stated where used.
"""
from . import memory
from .show import text_table

# NVIDIA's nvbandwidth on H100s, one GPU at a time, PCIe Gen5 x16 to pinned host memory:
# host->device 57.06 GB/s (3 of the 4 GPUs of an H100 VM; NVIDIA/nvbandwidth issue #6),
# device->host 52.77 GB/s (device_to_host_memcpy_sm on an 8-GPU H100 node; issue #24).
H2D = 57.06e9
D2H = 52.77e9
# Adam's step on the CPU for an 11.6B-parameter GPT-2: torch's Adam 56 s, DeepSpeed's vectorised
# CPU-Adam 8.2 s (deepspeedai/DeepSpeed PR #735, 2021; the host is not stated).
ADAM_MEASURED_PARAMS = 11.6e9
TORCH_ADAM_SECONDS, CPU_ADAM_SECONDS = 56.0, 8.2


def pcie_bytes(params, n_gpus, shard_bytes=4, gathers=2):
    """Bytes ONE GPU moves over its PCIe link in a step under CPUOffloadPolicy: its shard
    (`shard_bytes` a value: fp32 master weights) host->device before each of `gathers`
    all-gathers, and its gradient shard (the parameters' dtype) device->host once."""
    shard = params / n_gpus
    return {"h2d": gathers * shard_bytes * shard, "d2h": shard_bytes * shard}


def adam_seconds(params, seconds=TORCH_ADAM_SECONDS, measured=ADAM_MEASURED_PARAMS):
    """The CPU's Adam step over `params` parameters at the measured rate (`measured` parameters
    in `seconds`), ASSUMED linear in the parameters and a whole host's rate."""
    return params * seconds / measured


def step(params, n_gpus, compute, gpus_per_host=8, hbm=80e9):
    """One step with and without offload on `n_gpus` GPUs (`gpus_per_host` a host) whose
    step computes for `compute` seconds. Returns model-state GB per GPU without offload
    (FSDP's 16 B a parameter, ZeRO-3), whether they fit `hbm`, the PCIe seconds of each direction
    (each GPU on its own x16 link, ASSUMED not shared), the host's Adam step with torch's and with
    DeepSpeed's CPU Adam, and the step with offload: the copies overlap compute (pinned memory),
    the CPU step does not."""
    states = sum(memory.model_state_bytes(params, "bf16-mixed", "adam", zero_stage=3,
                                          world_size=n_gpus).values())
    moved = pcie_bytes(params, n_gpus)
    h2d, d2h = moved["h2d"] / H2D, moved["d2h"] / D2H
    host_params = params / n_gpus * min(n_gpus, gpus_per_host)
    torch_adam = adam_seconds(host_params)
    ds_adam = adam_seconds(host_params, CPU_ADAM_SECONDS)
    busy = max(compute, h2d + d2h)
    return {"gpus": n_gpus, "states_gb": states / 1e9, "fits": states < hbm,
            "pcie_gb": (moved["h2d"] + moved["d2h"]) / 1e9, "pcie_s": h2d + d2h,
            "adam_torch_s": torch_adam, "adam_ds_s": ds_adam, "compute_s": compute,
            "offload_torch_s": busy + torch_adam, "offload_ds_s": busy + ds_adam}


def format_table(rows):
    """Rows of `step` (each with a "model" name) as text, one line per model and GPU count."""
    return text_table(rows, [
        ("model", "11", lambda r: r["model"]), ("GPUs", ">4", lambda r: r["gpus"]), "|",
        ("states GB/GPU", ">13.1f", lambda r: r["states_gb"]),
        ("fit 80 GB", ">9", lambda r: "yes" if r["fits"] else "no"), "|",
        ("PCIe GB/GPU", ">11.1f", lambda r: r["pcie_gb"]), ("PCIe s", ">6.2f", lambda r: r["pcie_s"]),
        "|", ("Adam s torch", ">12.1f", lambda r: r["adam_torch_s"]),
        ("DS", ">5.1f", lambda r: r["adam_ds_s"]), "|",
        ("compute s", ">9.2f", lambda r: r["compute_s"]), "|",
        ("offload step s torch", ">20.1f", lambda r: r["offload_torch_s"]),
        ("DS", ">5.1f", lambda r: r["offload_ds_s"])])
