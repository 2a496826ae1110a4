"""Seconds of one transformer layer on one rank, on a calibrated device and cluster."""
import torch

from .. import hardware
from .shapes import _BF16, _recompute, attention_flops, layer_gemms


def _cluster(cluster, gpus_per_node, intra, inter):
    """A hardware.Cluster: a preset name or a Cluster; `intra`/`inter` links (the planner's old
    arguments, α-β cost.Links or calibrated ones) replace the preset's, one NIC per group."""
    if isinstance(cluster, str):
        if cluster not in hardware.PRESETS and cluster not in hardware.DATASHEET:
            raise ValueError(f"unknown cluster {cluster!r}; one of {sorted(hardware.PRESETS)} "
                             f"(or its '-datasheet' twin), or a distlab.hardware.Cluster.")
        cluster = {**hardware.PRESETS, **hardware.DATASHEET}[cluster]
    if intra is not None or inter is not None:
        cluster = hardware.Cluster(f"{cluster.name} (links given)", cluster.device,
                                   intra or cluster.intra, inter or cluster.inter or intra,
                                   gpus_per_node)
    elif cluster.ranks_per_node != gpus_per_node:
        cluster = hardware.Cluster(cluster.name, cluster.device, cluster.intra, cluster.inter,
                                   gpus_per_node, cluster.source, cluster.nics_per_node)
    return cluster


def _gemm(device, m, n, k, dtype):
    """Device.seconds of an (m×k)·(k×n) matmul, its operands and output read and written once."""
    item = torch.empty((), dtype=dtype).element_size()
    return device.seconds(2.0 * m * n * k, item * (m * k + k * n + m * n), dtype, (m, n, k))


def _gemm_train(device, m, n, k, dtype):
    """The three matmuls a linear layer runs in training, each in its own shape (what the
    device's tile × depth efficiency sees): forward (m, n, k), input gradient (m, k, n), weight
    gradient (k, n, m) — tokens are the weight gradient's depth."""
    return _gemm(device, m, n, k, dtype) + _gemm(device, m, k, n, dtype) + \
        _gemm(device, k, n, m, dtype)


def layer_seconds(shape, device, seq_len, batch, tp=1, cp=1, sequence_parallel=True,
                  recompute="full", attention="flash", fused=True, dtype=_BF16,
                  attention_backward=2.5):
    """{"gemm", "attention", "elementwise", "recompute"}: seconds of one layer's forward +
    backward (+ recompute) for one micro-batch on one rank, and how much of it is GEMMs (what a
    tp all-reduce can hide behind) and attention (what ring attention's traffic can)."""
    recompute = _recompute(recompute)
    tokens = batch * seq_len // cp
    fwd = sum(_gemm(device, m, n, k, dtype) for m, n, k in layer_gemms(shape, tokens, tp))
    train = sum(_gemm_train(device, m, n, k, dtype) for m, n, k in layer_gemms(shape, tokens, tp))
    heads, head_dim = shape.heads // tp, shape.hidden // shape.heads
    flash = attention == "flash"
    a_flops = attention_flops(shape, seq_len, batch, tp, cp, causal=flash)
    attn_bwd = attention_backward if flash else 2.0
    if flash:
        # the fused kernel (hardware.kernels): its forward and its backward at their own rates
        def rate(backward):
            return device.peak(dtype) * device.attention_efficiency(hardware.AttentionShape(
                seq_len // cp, seq_len, head_dim, batch * heads, True, backward), dtype)
        attn = a_flops / rate(False)
        attn_backward_s = attn_bwd * a_flops / rate(True)
    else:
        attn = a_flops / (device.peak(dtype) * device.gemm_efficiency(
            seq_len // cp, seq_len, head_dim, dtype, batch * heads))
        attn_backward_s = attn_bwd * attn
    # hardware.step_seconds' element-wise bytes: 68·s·b·h fused (Korthikanti's 34 stored bytes
    # written once and read once), 140 unfused; the replicated 10 of 34 without SP
    per_token = 68 if fused else 140
    share = 1 / tp if sequence_parallel else (10 + 24 / tp) / 34
    elementwise = per_token * tokens * shape.hidden * share
    if not flash:      # materialised scores: softmax (and its mask) over a·s² values, read + written
        elementwise += 2 * 5 * heads * (seq_len // cp) * seq_len * batch
    elementwise /= device.memory_bandwidth
    again = {"none": 0.0, "selective": 0.0 if flash else 1.0, "full": 1.0,
             "selective-op": 0.0}[recompute]
    # op-level selective recompute (torchtitan): every second matmul and all element-wise work
    # again in backward, never the attention kernel (its output is saved)
    gemm_again = {"full": 1.0, "selective-op": 0.5}.get(recompute, 0.0)
    ew_again = 1.0 if recompute in ("full", "selective-op") else 0.0
    redo = gemm_again * fwd + ew_again * elementwise + again * attn
    if recompute == "selective" and not flash:
        redo += 2 * 5 * heads * (seq_len // cp) * seq_len * batch / device.memory_bandwidth
    return dict(gemm=train + gemm_again * fwd,
                attention=attn + attn_backward_s + again * attn,
                elementwise=3 * elementwise + ew_again * elementwise,
                recompute=redo)
