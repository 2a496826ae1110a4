"""Memory and compute arithmetic of training: where the bytes go, and how long the FLOPs take.

The accounting is the standard one for a model with N parameters (ZeRO paper, §3):
- weights and gradients in the training precision (2 bytes each in bf16, 4 in fp32);
- Adam keeps two moments per parameter in fp32 (8 bytes); under mixed precision it also keeps an
  fp32 master copy of the weights (4 bytes) — so bf16 mixed precision with Adam costs
  2 + 2 + 12 = 16 bytes per parameter, before any activation.
ZeRO stage s shards the optimizer states (s >= 1), gradients (s >= 2) and weights (s = 3)
over the data-parallel ranks.
"""
import math

GB = 1e9  # decimal gigabytes, as GPU memory is sold (an "80 GB" GPU holds 80e9 bytes)

PRECISIONS = ("fp32", "bf16-mixed")
OPTIMIZERS = ("adam", "sgd-momentum", "sgd")


def bytes_per_parameter(precision="bf16-mixed", optimizer="adam"):
    """{"weights", "grads", "optimizer"} bytes that one parameter costs."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS}; got {precision!r}.")
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"optimizer must be one of {OPTIMIZERS}; got {optimizer!r}.")
    weight = 4 if precision == "fp32" else 2
    moments = {"adam": 2, "sgd-momentum": 1, "sgd": 0}[optimizer] * 4
    # Mixed precision updates an fp32 master copy: bf16 weights alone lose small updates.
    master = 4 if precision == "bf16-mixed" else 0
    return {"weights": weight, "grads": weight, "optimizer": moments + master}


def model_state_bytes(n_params, precision="bf16-mixed", optimizer="adam", zero_stage=0,
                      world_size=1):
    """Bytes of weights, gradients and optimizer states held by ONE rank."""
    if zero_stage not in (0, 1, 2, 3):
        raise ValueError(f"zero_stage must be 0, 1, 2 or 3; got {zero_stage!r}.")
    if world_size < 1:
        raise ValueError(f"world_size must be at least 1; got {world_size}.")
    per = bytes_per_parameter(precision, optimizer)
    sharded = {"optimizer": zero_stage >= 1, "grads": zero_stage >= 2, "weights": zero_stage >= 3}
    return {k: n_params * per[k] / (world_size if sharded[k] else 1) for k in per}


def training_flops(n_params, tokens):
    """~6·N·D: 2 FLOPs per parameter per token forward, 4 backward (Kaplan et al. 2020)."""
    return 6 * n_params * tokens


def training_days(n_params, tokens, n_gpus, peak_flops=989e12, mfu=0.4):
    """Days to train on n_gpus that each reach `mfu` of `peak_flops` (H100 dense bf16 by default)."""
    seconds = training_flops(n_params, tokens) / (n_gpus * peak_flops * mfu)
    return seconds / 86400


def gpus_to_hold(n_bytes, gpu_bytes=80 * GB):
    """The fewest GPUs whose memory adds up to n_bytes (if it could be split perfectly)."""
    return math.ceil(n_bytes / gpu_bytes)


def activation_bytes(seq_len, batch, hidden, layers, heads, checkpointing=False):
    """Activations a transformer keeps for backward, in 16-bit precision, without tensor parallel.

    Per layer s·b·h·(34 + 5·a·s/h) bytes (Korthikanti et al. 2022, "Reducing Activation
    Recomputation in Large Transformer Models", eq. 1); with full activation checkpointing only
    each layer's input is kept, 2·s·b·h bytes, and the rest is recomputed during backward.
    """
    sbh = seq_len * batch * hidden
    per_layer = 2 * sbh if checkpointing else sbh * (34 + 5 * heads * seq_len / hidden)
    return layers * per_layer


# (parameters, layers, hidden size, attention heads) of well-known models, for the calculator.
PRESETS = {
    "GPT-2 XL 1.5B": (1.5e9, 48, 1600, 25),
    "Llama-2 7B": (6.7e9, 32, 4096, 32),
    "Llama-2 13B": (13e9, 40, 5120, 40),
    "Llama-2 70B": (69e9, 80, 8192, 64),
    "GPT-3 175B": (175e9, 96, 12288, 96),
}


def per_gpu_bytes(model, precision="bf16-mixed", optimizer="adam", zero_stage=0, world_size=1,
                  seq_len=2048, micro_batch=1, checkpointing=False):
    """Everything one data-parallel GPU holds for a preset model: model states + activations."""
    n, layers, hidden, heads = PRESETS[model]
    out = model_state_bytes(n, precision, optimizer, zero_stage, world_size)
    out["activations"] = activation_bytes(seq_len, micro_batch, hidden, layers, heads,
                                          checkpointing)
    return out
