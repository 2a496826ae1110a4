"""Meta tensors under emulation: full-size shapes without values (see distlab._tracer)."""

import torch
from torch.overrides import TorchFunctionMode

from .ops import _tensors


class MetaValueError(RuntimeError):
    """Code needed the values of a meta tensor (see the module's docstring)."""


def _value_sentence(what):
    return (f"{what} needs the values of a tensor on the meta device, and an emulated run on "
            f"meta tensors computes shapes and times, not values: run this code on real tensors "
            f"at a small size to see values.")


def _meta(xs):
    return any(t.is_meta for t in _tensors(xs))


def _on_meta(func, args, kwargs):
    """func on meta tensors, with a sentence where it needs their values."""
    name = func.__name__.split(".")[0]
    if name == "_local_scalar_dense":
        raise MetaValueError(_value_sentence("`.item()` (or float(), int(), bool(), an `if` on a "
                                             "tensor)"))
    try:
        return func(*args, **kwargs)
    except NotImplementedError:
        if name in ("_to_copy", "copy_", "_copy_from"):
            what = "copying a meta tensor into real memory (.tolist(), .cpu(), .numpy(), .to())"
        else:
            what = f"aten.{name} (its result depends on the values: nonzero, unique, masks)"
        raise MetaValueError(_value_sentence(what)) from None


class _MetaFunctions(TorchFunctionMode):
    """Under emulation: attention on meta tensors takes the kernel the CPU takes with real ones.

    F.scaled_dot_product_attention picks its kernel by device before any op is dispatched: on
    the CPU a fused flash kernel (inputs, output and its row statistics), on meta the unfused
    math path, which materialises the t × t scores: at 4k tokens gigabytes of modeled memory
    traffic a real run never has. Sending meta tensors to the CPU's kernel (it has a meta
    implementation) charges the same ops as real tensors of that shape."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch._C._nn.scaled_dot_product_attention and _meta(args[:3]):
            out = _flash_on_meta(*args, **kwargs)
            if out is not None:
                return out
        return func(*args, **kwargs)


def _flash_on_meta(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False,
                   scale=None, enable_gqa=False):
    """The CPU's flash kernel for the cases the CPU gives it (no mask, no dropout, 4-d inputs
    with one head size); None for the others, which keep the math path."""
    if attn_mask is not None or dropout_p or enable_gqa:
        return None
    if {t.dim() for t in (query, key, value)} != {4} or \
            len({t.shape[-1] for t in (query, key, value)}) != 1:
        return None
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        query, key, value, 0.0, is_causal, scale=scale)[0]
