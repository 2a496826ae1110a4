"""Meta tensors under emulation: full-size shapes without values (see distlab._tracer)."""

import inspect
import types

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
    """Under emulation: attention on meta tensors is charged as the fused kernel a GPU runs.

    F.scaled_dot_product_attention picks its kernel by device before any op is dispatched: on
    the CPU a fused flash kernel (inputs, output and its row statistics), on meta the unfused
    math path, which materialises the t × t scores: at 4k tokens gigabytes of modeled memory
    traffic a real run never has. On a GPU, SDPA runs a fused kernel for grouped-query
    attention (`enable_gqa`), masks and dropout too (FlashAttention or memory-efficient
    attention), so on meta all of them go to the CPU's fused kernel (it has a meta
    implementation), and the device charges it as its attention kernel
    (hardware.kernels). nn.MultiheadAttention calls SDPA from inside its own function, out of
    this mode's sight: its SDPA is answered the same way, so with need_weights=False it is
    charged the fused kernel; with need_weights=True (its default) it returns the attention
    weights, which every GPU materialises: that path stays unfused, as on a GPU.
    flex_attention refuses meta tensors and compiles itself; under emulation on meta it is
    charged as the dense fused kernel (`install_flex`): its block mask's sparsity lives in
    values that meta tensors do not have."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch._C._nn.scaled_dot_product_attention and _meta(args[:3]):
            out = _flash_on_meta(*args, **kwargs)
            if out is not None:
                return out
        if func is torch.nn.functional.multi_head_attention_forward:
            # its body calls SDPA through torch.nn.functional's global name, with this mode
            # off: that name answers for the call
            functional = torch.nn.functional
            saved = functional.scaled_dot_product_attention
            functional.scaled_dot_product_attention = _sdpa
            try:
                return func(*args, **kwargs)
            finally:
                functional.scaled_dot_product_attention = saved
        return func(*args, **kwargs)

    def __enter__(self):
        install_flex()
        return super().__enter__()

    def __exit__(self, *exc):
        uninstall_flex()
        return super().__exit__(*exc)


def _sdpa(query, key, value, *args, **kwargs):
    out = _flash_on_meta(query, key, value, *args, **kwargs) if _meta((query, key, value)) \
        else None
    return out if out is not None else \
        torch._C._nn.scaled_dot_product_attention(query, key, value, *args, **kwargs)


def _repeat_kv(query, key, value):
    """Key and value with their heads repeated to the query's (grouped-query attention: head h
    reads key/value head h // group). A fused GQA kernel reads each key/value head in place; the
    repeat costs two copies of K and V, about 1 % of a Llama 3 8B layer's attention at 8k."""
    group = query.shape[-3] // key.shape[-3]
    return key.repeat_interleave(group, dim=-3), value.repeat_interleave(group, dim=-3)


def _flash_on_meta(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False,
                   scale=None, enable_gqa=False):
    """The fused kernel's output for SDPA on meta tensors; None where SDPA would refuse the
    call anyway (its own error is the one to see)."""
    if {t.dim() for t in (query, key, value)} != {4} or \
            query.shape[-1] != key.shape[-1]:
        return None
    if key.shape[-3] != query.shape[-3]:
        if not enable_gqa or query.shape[-3] % key.shape[-3] or \
                key.shape[-3] != value.shape[-3]:
            return None
        key, value = _repeat_kv(query, key, value)
    if value.shape[-1] != query.shape[-1]:
        return None
    # A mask: the GPU's memory-efficient kernel applies it block by block, computing every
    # block (the causal half is not skipped): charged as the non-causal fused kernel; reading
    # the mask itself (t × t bytes, ≈ 1 % of the kernel at 8k) is not charged. Dropout: the
    # flash kernel draws it on chip; charged the same.
    causal = bool(is_causal) and attn_mask is None
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        query, key, value, 0.0, causal, scale=scale)[0]


# -- flex_attention on meta --------------------------------------------------------------------
_flex_saved = {}


def install_flex():
    """Make torch's flex_attention, however imported, charge the fused kernel on meta tensors
    (its code object is swapped, as distlab.checks.forbid swaps a function's; the original runs
    for every other input)."""
    try:
        import torch.nn.attention.flex_attention as flex
    except ImportError:            # a torch without flex_attention
        return
    fn = flex.flex_attention
    if fn in _flex_saved or fn.__code__.co_freevars:
        return
    original = types.FunctionType(fn.__code__, fn.__globals__, fn.__name__, fn.__defaults__)
    original.__kwdefaults__ = fn.__kwdefaults__
    _flex_saved[fn] = (fn.__code__, original)
    fn.__code__ = _forwarding_code(fn)


def uninstall_flex():
    for fn, (code, _) in list(_flex_saved.items()):
        fn.__code__ = code
        del _flex_saved[fn]


def _forwarding_code(fn):
    """A code object with fn's exact parameters that calls `_flex_dispatch(fn, <arguments>)`."""
    sig = inspect.signature(fn)
    params, call = [], []
    star = False
    for p in sig.parameters.values():
        if p.kind is p.KEYWORD_ONLY and not star:
            params.append("*")
            star = True
        params.append(p.name if p.default is p.empty else f"{p.name}=None")
        call.append(f"{p.name}={p.name}")
    source = (f"def {fn.__name__}({', '.join(params)}):\n"
              f"    return __import__('distlab._tracer.meta', fromlist=['_flex_dispatch'])"
              f"._flex_dispatch({fn.__name__}, {', '.join(call)})\n")
    namespace = {}
    exec(source, {}, namespace)
    return namespace[fn.__name__].__code__


def _flex_dispatch(fn, **arguments):
    original = _flex_saved[fn][1]
    # the swapped code received None for every default: give the original its own defaults
    sig = inspect.signature(original)
    for name, p in sig.parameters.items():
        if p.default is not p.empty and arguments.get(name) is None:
            arguments[name] = p.default
    query, key, value = arguments["query"], arguments["key"], arguments["value"]
    if not _meta((query, key, value)):
        return original(**arguments)
    if key.shape[-3] != query.shape[-3]:
        if not arguments.get("enable_gqa"):
            return original(**arguments)     # flex's own sentence about head counts
        key, value = _repeat_kv(query, key, value)
    out, logsumexp = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        query, key, value, 0.0, False, scale=arguments.get("scale"))[:2]
    if arguments.get("return_aux") is not None:
        from torch.nn.attention.flex_attention import AuxOutput
        aux = arguments["return_aux"]
        return out, AuxOutput(lse=logsumexp if aux.lse else None,
                              max_scores=torch.empty_like(logsumexp) if aux.max_scores else None)
    if arguments.get("return_lse"):
        return out, logsumexp
    return out
