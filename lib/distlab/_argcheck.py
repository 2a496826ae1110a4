"""Small checks of a learner's arguments, each failing with one sentence that says what to pass.

Shared by the strategy modules so that a size, a rank or a tensor is judged alike everywhere:
whole numbers may be Python's, numpy's or a 0-d integer tensor's (torch's own APIs take them);
a bool is not a number here (True would pass as 1 and hide a swapped argument).
"""
import math
import numbers
import operator

import torch


def whole(x, name, at_least=None, example=None):
    """x as an int, or a TypeError (not a whole number) / ValueError (below `at_least`)."""
    value = None
    if not isinstance(x, bool) and type(x).__name__ not in ("bool_", "bool"):
        if isinstance(x, torch.Tensor):
            if x.dim() == 0 and not x.is_floating_point() and not x.is_complex() \
                    and x.dtype != torch.bool and x.device.type != "meta":
                value = int(x)
        else:
            try:
                value = operator.index(x)
            except TypeError:
                pass
    hint = f", like {example}" if example is not None else ""
    if value is None:
        raise TypeError(f"{name} must be a whole number{hint}; got {x!r}.")
    if at_least is not None and value < at_least:
        raise ValueError(f"{name} must be at least {at_least}{hint}; got {value}.")
    return value


def rank_in(rank, size, name="rank"):
    """rank as an int from 0 to size - 1 (a negative rank would silently index from the end)."""
    r = whole(rank, name)
    if not 0 <= r < size:
        raise ValueError(f"{name} must be from 0 to {size - 1} ({size} ranks); got {r}.")
    return r


def positive(x, name, allow_zero=False, example=None):
    """x as a finite float above 0 (or at least 0), else a sentence."""
    hint = f", like {example}" if example is not None else ""
    if isinstance(x, bool) or not isinstance(x, numbers.Real):
        raise TypeError(f"{name} must be a number{hint}; got {x!r}.")
    if not math.isfinite(x) or x < 0 or (x == 0 and not allow_zero):
        raise ValueError(f"{name} must be a finite{' non-negative' if allow_zero else ' positive'} "
                         f"number{hint}; got {x!r}.")
    return float(x)


def tensor(x, name):
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor; got a {type(x).__name__} (wrap it in "
                        f"torch.tensor(...)).")
    return x


def floating(x, name):
    tensor(x, name)
    if not x.is_floating_point():
        raise TypeError(f"{name} must be a floating-point tensor (float32, bfloat16, ...); got "
                        f"{x.dtype}: convert it with .float().")
    return x


def integers(x, name):
    """Integer values: a float tensor of whole numbers passes (positions are compared as
    doubles inside); 0.5 would be cut to 0 or compared wrongly without a word."""
    tensor(x, name)
    whole_floats = (x.is_floating_point() and x.device.type != "meta"
                    and bool((x == x.round()).all()))
    if (x.is_floating_point() and not whole_floats) or x.is_complex() or x.dtype == torch.bool:
        raise TypeError(f"{name} must be a tensor of integers (global token indices, e.g. "
                        f"torch.arange(n)); got {x.dtype}.")
    return x


def floating_dtype(dtype, name):
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"{name} must be a torch dtype such as torch.bfloat16; got {dtype!r}.")
    if not dtype.is_floating_point:
        raise TypeError(f"{name} must be a floating-point dtype such as torch.bfloat16; got "
                        f"{dtype}.")
    return dtype


def instance(x, kind, name, what):
    """x when it is a `kind` (a class or a tuple of them); else a TypeError naming `what` was
    expected and what came, before an AttributeError deep inside would hide the swap."""
    if not isinstance(x, kind):
        raise TypeError(f"{name} must be {what}; got a {type(x).__name__}.")
    return x


def group(g, name="group"):
    """None (the default group: every rank) or a ProcessGroup; a mesh dimension's name or a list
    of ranks is neither, and torch would fail on it inside a collective."""
    if g is not None and not isinstance(g, torch.distributed.ProcessGroup):
        raise TypeError(f"{name} must be a ProcessGroup (e.g. mesh.get_group('tp')) or None for "
                        f"every rank; got a {type(g).__name__}.")
    return g


def features(x, n, name, weight=None, at_least_dims=1, shape_hint="(..., features)"):
    """x as a floating tensor of at least `at_least_dims` dims whose last holds `n` features,
    in `weight`'s dtype (unless autocast casts them); torch would say "mat1 and mat2" instead."""
    floating(x, name)
    if x.dim() < at_least_dims:
        raise ValueError(f"{name} must be {shape_hint}; got shape {tuple(x.shape)}.")
    if x.shape[-1] != n:
        raise ValueError(f"{name} must have {n} features in its last dimension; got "
                         f"{x.shape[-1]} (shape {tuple(x.shape)}).")
    if weight is not None and x.dtype != weight.dtype and not _autocast_may_cast(x):
        raise TypeError(f"{name} is {x.dtype} but the layer's weights are {weight.dtype}: convert "
                        f"one with .to({weight.dtype}).")
    return x


def _autocast_may_cast(x):
    """Whether autocast may cast x for the op; where the device has no autocast (meta tensors of
    a full-size emulated run) it cannot say, so nothing is refused on its account."""
    try:
        return torch.is_autocast_enabled(x.device.type)
    except RuntimeError:
        return True


def like(x, attrs, name, what):
    """x when it is a module with the attributes `attrs` (so a learner's look-alike passes too);
    else a TypeError naming `what` was expected."""
    if not isinstance(x, torch.nn.Module) or not all(hasattr(x, a) for a in attrs):
        raise TypeError(f"{name} must be {what} (a module with {', '.join(attrs)}); got a "
                        f"{type(x).__name__}.")
    return x
