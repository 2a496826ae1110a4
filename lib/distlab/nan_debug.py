"""Chapter 11: NaN and loss-spike triage, determinism, and MFU from tokens per second.

A NaN in one rank's gradients reaches every rank in the next all-reduce, so by the time the
loss prints `nan` every rank looks guilty. The detector here runs BEFORE the gradients are
averaged: each rank computes one norm per parameter of its own gradients, the ranks gather
them, and every rank gets the same answer: the first rank and parameter that are not finite.
"""
import re

import torch
import torch.distributed as dist


# ---- which rank, which parameter -----------------------------------------------------------

def local_grad_norms(model):
    """One float64 L2 norm per parameter of this rank's gradient (0 for a missing gradient)."""
    return torch.stack([p.grad.detach().double().norm() if p.grad is not None
                        else torch.zeros((), dtype=torch.float64) for p in model.parameters()])


def first_nonfinite_gradient(model, group=None):
    """Before the all-reduce: the first (rank, parameter name, norm) whose local gradient is
    inf or NaN, or None; the same answer on every rank (the norms are all-gathered)."""
    mine = local_grad_norms(model)
    everyone = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(everyone, mine, group=group)
    names = [n for n, _ in model.named_parameters()]
    ranks = dist.get_process_group_ranks(group) if group is not None else \
        range(dist.get_world_size())
    for rank, norms in zip(ranks, everyone):
        bad = (~torch.isfinite(norms)).nonzero()
        if len(bad):
            i = bad[0, 0].item()
            return rank, names[i], norms[i].item()
    return None


def spiking_ranks(norms_by_rank, factor=10.0):
    """Ranks whose total gradient norm is more than `factor` times the median rank's: a loss
    spike starts on the ranks whose data caused it. norms_by_rank: [float per rank]."""
    ordered = sorted(norms_by_rank)
    median = ordered[len(ordered) // 2]
    return [r for r, n in enumerate(norms_by_rank)
            if not (n == n and abs(n) != float("inf")) or n > factor * median]


# ---- anomaly mode --------------------------------------------------------------------------

def anomaly_op(fn):
    """Run fn() (a forward and backward) under torch.autograd.detect_anomaly and return the
    backward function it names ("LogBackward0") and the forward line that created it, or None
    when the backward produced no NaN. Anomaly mode checks every backward op's output for NaN
    and keeps each op's forward traceback: slow, for debugging only."""
    import warnings
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            with torch.autograd.detect_anomaly():
                fn()
        except RuntimeError as e:
            m = re.search(r"Function '(\w+)' returned nan values in its (\d+)th output", str(e))
            if m is None:
                raise
            where = None
            for w in caught:       # the warning carries the forward traceback
                frames = re.findall(r'File "([^"]+)", line (\d+), in (\S+)\n(?:(?!\s*File)(.*)\n)?',
                                    str(w.message) + "\n")
                frames = [f for f in frames if f[0] != __file__]
                if frames:
                    file, line, func, code = frames[-1]
                    # a trailing comment is the author's note, not the op
                    code = re.sub(r"\s+#[^'\"]*$", "", code)
                    where = f"{func}, line {line}: {code.strip()}" if code.strip() else \
                        f"{func}, line {line}"
            return {"function": m.group(1), "output": int(m.group(2)), "forward": where}
    return None


# ---- the low-precision overflow signature --------------------------------------------------

LOW_PRECISION = (torch.float16, torch.bfloat16)


def overflow_report(t):
    """{dtype name: (largest |value| / the dtype's largest finite value, how many values become
    inf when cast)} for fp16 and bf16: what a cast does to this tensor. fp16 tops out at
    65504; bf16 keeps fp32's range (3.4e38) with 8 bits of mantissa instead of 24."""
    big = t.detach().abs().max().item()
    out = {}
    for dtype in LOW_PRECISION:
        cast = t.detach().to(dtype)
        out[str(dtype).replace("torch.", "")] = (big / torch.finfo(dtype).max,
                                                 int(torch.isinf(cast).sum() -
                                                     torch.isinf(t).sum()))
    return out


# ---- MFU from tokens per second ------------------------------------------------------------

def flops_per_token(n_params, layers, hidden, seq_len, causal=False):
    """Training FLOPs per token: 6·N for the weights (2 forward, 4 backward per weight) plus
    attention's 12·L·h·s (Q·Kᵀ and P·V, forward and backward: Chowdhery et al. 2022, PaLM,
    appendix B); `causal` halves the attention term, as a flash kernel skips the masked half
    (most published MFUs count the full term)."""
    attention = 12.0 * layers * hidden * seq_len * (0.5 if causal else 1.0)
    return 6.0 * n_params + attention


def mfu(tokens_per_s, n_gpus, peak_flops, n_params, layers, hidden, seq_len, causal=False):
    """Model FLOPs utilisation: the FLOPs the model needs per token times tokens per second,
    over the GPUs' peak (dense bf16: 989e12 on an H100 SXM). Recomputation is not counted:
    that would be the hardware FLOPs utilisation (HFU)."""
    return tokens_per_s * flops_per_token(n_params, layers, hidden, seq_len, causal) / \
        (n_gpus * peak_flops)
