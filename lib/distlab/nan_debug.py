"""Chapter 11: NaN and loss-spike triage, determinism, and MFU from tokens per second.

A NaN in one rank's gradients reaches every rank in the next all-reduce, so by the time the
loss prints `nan` every rank looks guilty. The detector here runs BEFORE the gradients are
averaged: each rank computes one norm per parameter of its own gradients, the ranks gather
them, and every rank gets the same answer: the first rank and parameter that are not finite.
"""
import math
import numbers
import re
import statistics

import torch
import torch.distributed as dist


# ---- which rank, which parameter -----------------------------------------------------------

def local_grad_norms(model):
    """One float64 L2 norm per parameter of this rank's gradient (0 for a missing gradient)."""
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"local_grad_norms takes the model (a torch.nn.Module), not "
                        f"{type(model).__name__}.")
    params = list(model.parameters())
    if not params:
        raise ValueError("the model has no parameters: there is no gradient to check.")
    return torch.stack([p.grad.detach().double().norm() if p.grad is not None
                        else torch.zeros((), dtype=torch.float64) for p in params])


def first_nonfinite_gradient(model, group=None):
    """Before the all-reduce: the first (rank, parameter name, norm) whose local gradient is
    inf or NaN, or None; the same answer on every rank (the norms are all-gathered)."""
    if not dist.is_initialized():
        raise ValueError("first_nonfinite_gradient gathers every rank's norms: call it on every "
                         "rank inside distlab.run (no process group is initialised here).")
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


def _one_number(value, where):
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise TypeError(f"{where} is a tensor of {value.numel()} values: pass one number per "
                            f"rank.")
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{where} is {value!r}: pass one number per rank.")
    return float(value)


def spiking_ranks(norms_by_rank, factor=10.0):
    """The ranks whose gradient norm (or loss) spikes, in rank order: a loss spike starts on the
    ranks whose data caused it. norms_by_rank: one number per rank (a list or a 1-D tensor).

    A rank is reported when its value is not finite (NaN or ±inf: the strongest signal there
    is), or when its magnitude is more than `factor` times the median magnitude of the OTHER
    ranks' finite values. Non-finite values are left out of every median, so one NaN cannot
    hide a real spike elsewhere (sorting with NaN orders nothing), and each rank is judged
    against the others rather than against a median it sits in itself (with 2 ranks the
    median would otherwise include the spike). A rank with no finite other to compare with is
    reported only when it is not finite."""
    if isinstance(norms_by_rank, torch.Tensor):
        if norms_by_rank.dim() > 1:
            raise TypeError(f"norms_by_rank is a {norms_by_rank.dim()}-D tensor: pass one number "
                            f"per rank (a list or a 1-D tensor).")
        norms_by_rank = list(norms_by_rank.reshape(-1))
    if not isinstance(norms_by_rank, (list, tuple)):
        raise TypeError(f"norms_by_rank must be a list with one number per rank, not "
                        f"{type(norms_by_rank).__name__}.")
    if not norms_by_rank:
        raise ValueError("norms_by_rank is empty: pass one gradient norm (or loss) per rank.")
    if isinstance(factor, bool) or not isinstance(factor, numbers.Real):
        raise TypeError(f"factor must be a number above 1 (the default is 10), not "
                        f"{type(factor).__name__}.")
    if not factor > 1 or math.isinf(factor):
        raise ValueError(f"factor is {factor}: a spike is a value more than `factor` times the "
                         f"others' median; give a number above 1 (the default is 10).")
    values = [_one_number(v, f"norms_by_rank[{r}]") for r, v in enumerate(norms_by_rank)]
    finite = [(r, abs(v)) for r, v in enumerate(values) if math.isfinite(v)]
    spikes = [r for r, v in enumerate(values) if not math.isfinite(v)]
    for r, v in finite:
        others = [w for q, w in finite if q != r]
        if others and v > factor * statistics.median(others):
            spikes.append(r)
    return sorted(spikes)


# ---- anomaly mode --------------------------------------------------------------------------

def anomaly_op(fn):
    """Run fn() (a forward and backward) under torch.autograd.detect_anomaly and return the
    backward function it names ("LogBackward0") and the forward line that created it, or None
    when the backward produced no NaN. Anomaly mode checks every backward op's output for NaN
    and keeps each op's forward traceback: slow, for debugging only."""
    if not callable(fn):
        raise TypeError(f"anomaly_op takes a function that runs a forward and a backward, not "
                        f"{type(fn).__name__}: wrap the step in a def.")
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
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"overflow_report takes a tensor (torch.tensor(values)), not "
                        f"{type(t).__name__}.")
    if t.is_complex():
        raise TypeError(f"overflow_report checks real values, not "
                        f"{str(t.dtype).replace('torch.', '')}: pass t.real or t.abs().")
    if t.numel() == 0:
        raise ValueError("overflow_report needs values: the tensor is empty.")
    big = t.detach().abs().max().item()
    out = {}
    for dtype in LOW_PRECISION:
        cast = t.detach().to(dtype)
        out[str(dtype).replace("torch.", "")] = (big / torch.finfo(dtype).max,
                                                 int(torch.isinf(cast).sum() -
                                                     torch.isinf(t).sum()))
    return out


# ---- MFU from tokens per second ------------------------------------------------------------

def _count(value, name, positive=False):
    """A plain number for the MFU arithmetic, or the sentence that says what is wrong: a
    string would fail as a TypeError deep in a product, a zero GPU count as ZeroDivisionError."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a number, not {type(value).__name__}.")
    if positive and not value > 0:
        raise ValueError(f"{name} is {value}: it must be more than 0.")
    if not value >= 0:
        raise ValueError(f"{name} is {value}: it cannot be negative.")
    return value


def flops_per_token(n_params, layers, hidden, seq_len, causal=False):
    """Training FLOPs per token: 6·N for the weights (2 forward, 4 backward per weight) plus
    attention's 12·L·h·s (Q·Kᵀ and P·V, forward and backward: Chowdhery et al. 2022, PaLM,
    appendix B); `causal` halves the attention term, as a flash kernel skips the masked half
    (most published MFUs count the full term)."""
    for name, value in (("n_params", n_params), ("layers", layers), ("hidden", hidden),
                        ("seq_len", seq_len)):
        _count(value, name)
    attention = 12.0 * layers * hidden * seq_len * (0.5 if causal else 1.0)
    return 6.0 * n_params + attention


def mfu(tokens_per_s, n_gpus, peak_flops, n_params, layers, hidden, seq_len, causal=False):
    """Model FLOPs utilisation: the FLOPs the model needs per token times tokens per second,
    over the GPUs' peak (dense bf16: 989e12 on an H100 SXM). Recomputation is not counted:
    that would be the hardware FLOPs utilisation (HFU)."""
    _count(tokens_per_s, "tokens_per_s")
    _count(n_gpus, "n_gpus", positive=True)
    _count(peak_flops, "peak_flops", positive=True)
    return tokens_per_s * flops_per_token(n_params, layers, hidden, seq_len, causal) / \
        (n_gpus * peak_flops)
