"""Time at full size, in closed form: one ring step's kernel and hop, and the block length
above which the hop hides behind the kernel."""
import torch

from .. import _argcheck as check


#
# The emulator charges ring attention op by op (the flash kernels' FLOPs at the device's attention
# kernel's rate, each message at its link's latency and bandwidth); these closed forms charge the same
# formulas for one step, so an emulated ring set beside them checks the code's critical path (does
# the next block really travel while this one is computed?), not the hardware.

def ring_step_seconds(device, link, block_tokens, heads=32, head_dim=128, kv_heads=None,
                      causal=True, dtype=torch.bfloat16):
    """One ring-attention step of one rank (forward): `compute`, the flash kernel of its
    block_tokens queries against one visiting block of as many keys — 4·c²·heads·head_dim FLOPs,
    half under a causal mask with zig-zag blocks (every step is then half a block: Brandon et al.
    2023, striped / zig-zag load balance) — and `hop`, the two messages (K and V, c·kv_heads·
    head_dim values each) that travel meanwhile. `overlap` is True when the hop hides behind the
    kernel (Liu et al. 2023, Ring Attention, §3: block size ≥ FLOPs / bandwidth)."""
    item = torch.empty((), dtype=dtype).element_size()
    kv = kv_heads or heads
    flops = 4.0 * block_tokens ** 2 * heads * head_dim * (0.5 if causal else 1.0)
    io = item * block_tokens * head_dim * (2 * heads + 2 * kv)           # q, out; k, v
    # the fused attention kernel (hardware.kernels): zig-zag's half blocks are unmasked kernels,
    # so the non-causal rate, on half the FLOPs
    from ..hardware import AttentionShape
    compute = device.seconds(flops, io, dtype, AttentionShape(block_tokens, block_tokens,
                                                              head_dim, heads, False, False))
    hop = 2 * link.seconds("send", item * block_tokens * kv * head_dim, 2)
    return dict(compute=compute, hop=hop, overlap=compute >= hop)


def overlap_condition(peak_flops, bandwidth, heads=32, kv_heads=None, itemsize=2, causal=False):
    """The block length (tokens per rank) above which a ring step's kernel outlasts its hop, from
    peaks alone: 4·f·c²·H·d / P ≥ 2·c·KV·d·item / B  ⇔  c ≥ (P / B)·(KV / H)·(item / 2) / f, with
    f = 1 (f = ½ causal zig-zag). For 16-bit multi-head attention without a mask: c ≥ P / B."""
    _check_rates(peak_flops, bandwidth, heads, kv_heads, itemsize)
    kv = kv_heads or heads
    return peak_flops / bandwidth * (kv / heads) * (itemsize / 2) / (0.5 if causal else 1.0)


def overlap_block_length(device, link, heads=32, head_dim=128, kv_heads=None, causal=True,
                         dtype=torch.bfloat16):
    """The smallest block length (tokens per rank) at which `ring_step_seconds` says the hop
    hides behind the kernel on this device and link (achieved rates, latencies included)."""
    def hidden(c):
        return ring_step_seconds(device, link, c, heads, head_dim, kv_heads, causal, dtype)["overlap"]
    lo, hi = 1, 1
    while not hidden(hi):
        lo, hi = hi, hi * 2
        if hi > 2 ** 26:
            raise ValueError(f"{link} never hides behind {device.name}'s attention kernel "
                             f"below 2**26 tokens per rank.")
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if hidden(mid) else (mid, hi)
    return hi


def _check_rates(peak_flops, bandwidth, heads, kv_heads, itemsize):
    check.positive(peak_flops, "peak_flops", example=9.89e14)
    check.positive(bandwidth, "bandwidth (bytes per second)", example=4.5e11)
    check.positive(itemsize, "itemsize (bytes per value)", example=2)
    heads = check.whole(heads, "heads", at_least=1)
    if kv_heads is not None and heads % check.whole(kv_heads, "kv_heads", at_least=1):
        raise ValueError(f"kv_heads = {kv_heads} must divide heads = {heads} (each key/value "
                         f"head serves a group of query heads).")
