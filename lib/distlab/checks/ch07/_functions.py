"""Judging a learner's autograd Function: its signature, torch's own refused, what it saves."""
import contextlib

import torch

from .. import _refusing_code


# torch's differentiable collectives: their backward is what the exercises ask for
_TORCH_DIFFERENTIABLE = (
    ("torch.distributed.nn.functional", ("all_gather", "reduce_scatter", "all_reduce",
                                         "all_to_all", "all_to_all_single", "_all_gather_base",
                                         "broadcast", "reduce", "gather", "scatter")),
    ("torch.distributed._functional_collectives", (
        "all_gather_tensor_autograd", "reduce_scatter_tensor_autograd",
        "all_gather_single_autograd", "reduce_scatter_single_autograd",
        "all_to_all_single_autograd")))


@contextlib.contextmanager
def _refuse_differentiable_collectives(exercise):
    """Inside a rank: torch's autograd-aware collectives raise the check's sentence, however
    they were imported (their code is swapped, as `forbid` does for the course's own)."""
    import importlib
    saved = []
    for module_name, names in _TORCH_DIFFERENTIABLE:
        try:
            module = importlib.import_module(module_name)
        except ImportError:
            continue
        for n in names:
            fn = getattr(module, n, None)
            code = getattr(fn, "__code__", None)
            if code is None:
                continue
            message = (f"your code called torch's differentiable {module_name}.{n}, whose "
                       f"backward torch wrote; the exercise is to {exercise}, with the plain "
                       f"collectives of torch.distributed.")
            saved.append((fn, code))
            fn.__code__ = _refusing_code(message, code.co_freevars)
    try:
        yield
    finally:
        for fn, code in reversed(saved):
            fn.__code__ = code


@contextlib.contextmanager
def _saved_for_backward(counter):
    """Count the bytes autograd saves for backward inside the block (each storage once)."""
    seen = set()

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in seen:
            seen.add(storage.data_ptr())
            counter[0] += storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        yield


def _require_function_class(fn, example):
    name = getattr(fn, "__name__", repr(fn))
    if not (isinstance(fn, type) and issubclass(fn, torch.autograd.Function)):
        raise TypeError(f"the check needs your torch.autograd.Function class itself, e.g. "
                        f"{example}; got {fn!r}.")
    import inspect
    for method, wanted in (("forward", ("ctx", "x", "group")), ("backward", ("ctx", "grad"))):
        try:
            params = inspect.signature(getattr(fn, method)).parameters
        except (TypeError, ValueError):
            continue
        if len(params) != len(wanted) and not any(p.kind == p.VAR_POSITIONAL
                                                  for p in params.values()):
            raise TypeError(f"{name}.{method} should take ({', '.join(wanted)}) — a "
                            f"@staticmethod; it takes ({', '.join(params)}).")
    return name
