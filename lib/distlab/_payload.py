"""Shipping things between the notebook and the ranks, BY VALUE.

A function defined in a notebook cell lives in `__main__`, which no rank process can import, so
the standard pickle (by reference) fails with "Can't get attribute 'fn' on <module '__main__'>".
cloudpickle sends such functions and classes by value instead. The same pickler carries the
ranks' results back, so a rank may return an instance of a class defined in the notebook.
"""
import io
import os
import pickle
import types
from collections import ChainMap

import cloudpickle


def _code_keeping_filename(code):
    # cloudpickle >= 3.1 renames every file to "<dynamic-code>"; keep the real one so a rank's
    # traceback and stack dump can point at the notebook cell and show its line.
    reducer, args = cloudpickle.cloudpickle._code_reduce(code)
    return reducer, tuple(code.co_filename if a == "<dynamic-code>" else a for a in args)


class _Pickler(cloudpickle.Pickler):
    dispatch_table = ChainMap({types.CodeType: _code_keeping_filename},
                              cloudpickle.Pickler.dispatch_table)


def _same(x):
    return x


class _ResultPickler(_Pickler):
    """Tensors anywhere in a result (inside the learner's own objects too) travel detached
    and on the CPU: the notebook cannot use a rank's autograd graph or its GPU."""

    def reducer_override(self, obj):
        import torch
        if isinstance(obj, torch.Tensor) and \
                (obj.requires_grad or obj.device.type not in ("cpu", "meta")):
            return _same, (_detached(obj),)
        return super().reducer_override(obj)


def dumps(obj, result=False):
    """Pickle `obj` by value where it must be (functions and classes of `__main__`); a rank's
    `result` with its tensors detached and on the CPU."""
    buffer = io.BytesIO()
    (_ResultPickler if result else _Pickler)(buffer, protocol=pickle.DEFAULT_PROTOCOL).dump(obj)
    return buffer.getvalue()


loads = pickle.loads   # what cloudpickle writes, plain pickle reads (cloudpickle installed)


def pickle_payload(fn, args, kwargs):
    """The bytes every rank receives: (fn, args, kwargs); what cannot travel is named."""
    try:
        return dumps((fn, args, kwargs))
    except Exception as e:
        culprit = "the function"
        for name, value in [("the function", fn)] + \
                [(f"argument {i + 1}", a) for i, a in enumerate(args)] + \
                [(f"keyword argument {k!r}", v) for k, v in kwargs.items()]:
            try:
                dumps(value)
            except Exception:
                culprit = f"{name} ({type(value).__name__})"
                break
        raise TypeError(
            f"distlab.run cannot send {culprit} to the ranks: it cannot be pickled ({e}). "
            f"Pass plain data (numbers, lists, dicts, tensors) and create things like open files, "
            f"locks or generators inside the function.") from None


def _detached(tensor):
    # A meta tensor (a full-size run under emulation) comes back as it is: a shape and a dtype.
    return tensor.detach() if tensor.is_meta else tensor.detach().cpu()


def to_cpu(obj):
    """A rank's result as the notebook should get it: tensors detached and on the CPU, also
    inside lists, tuples, dicts, named tuples and torch.return_types (y.max(dim=0))."""
    import torch
    if isinstance(obj, torch.Tensor):
        return _detached(obj)
    if type(obj) in (list, tuple):
        return type(obj)(to_cpu(x) for x in obj)
    if isinstance(obj, tuple) and hasattr(type(obj), "n_fields"):      # torch.return_types.*
        return type(obj)([to_cpu(x) for x in obj])
    if isinstance(obj, tuple) and hasattr(type(obj), "_fields"):       # namedtuple
        return type(obj)(*(to_cpu(x) for x in obj))
    if type(obj) is dict:
        return {k: to_cpu(v) for k, v in obj.items()}
    return obj


def cell_sources():
    """Source of notebook cells (files that do not exist on disk), so rank tracebacks show lines."""
    import linecache
    return {name: entry for name, entry in list(linecache.cache.items())
            if len(entry) == 4 and not os.path.exists(name) and not name.startswith("<frozen")
            and sum(len(line) for line in entry[2]) < 200_000}
