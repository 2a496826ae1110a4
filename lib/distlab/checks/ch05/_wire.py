"""What travels, not only how much (issue 29 item 6): inside a rank, the values each all-reduce
carries as it leaves the rank, and the handles started but never waited for.

Counting calls and bytes lets a decoy through: an all-reduce of zeros of the right size, sent
while the gradient is computed some other way, looks like "gradients all-reduced". So the
checkers also record the VALUES every summing all-reduce takes in (a TorchDispatchMode sees the
`c10d::allreduce_` op of every call: `dist.all_reduce` under any imported name, a ProcessGroup
method, and torch's DDP reducer in C++ alike), and the parent adds them up over the ranks: that
sum is what the all-reduce delivered. `missing_gradient` then asks whether each parameter's
expected gradient, up to a non-zero factor (a pre-division by N, a sum of N means, a sum
weighted by sample counts), is a contiguous run of what was delivered.
"""
import torch
from torch.utils._python_dispatch import TorchDispatchMode

# c10d's ReduceOp numbering (torch/csrc/distributed/c10d/Types.hpp): SUM 0, AVG 1. Only these
# two deliver a multiple of the ranks' sum; MAX, MIN or PRODUCT do not.
_SUMMING = (0, 1)


class Wire(TorchDispatchMode):
    """`with Wire() as wire:` inside a rank; `wire.sent` lists, per all-reduce in call order, the
    float64 copy of its flattened input (or None for a non-summing op). `wire.mark()` is the
    number of all-reduces so far (to cut the list into steps)."""

    def __init__(self):
        super().__init__()
        self.sent = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "c10d" and func.__name__.startswith("allreduce_"):
            tensors, op = args[0], args[2]
            try:
                summing = op.op() in _SUMMING
            except Exception:       # an unfamiliar ReduceOp (a premul_sum): not a plain sum
                summing = False
            self.sent.append(torch.cat([t.detach().reshape(-1).double() for t in tensors])
                             if summing and not any(t.is_meta for t in tensors) else None)
        return func(*args, **(kwargs or {}))

    def mark(self):
        return len(self.sent)


def delivered(per_rank):
    """The sum over the ranks of each all-reduce's input: what it delivered (None where the op
    did not sum or the ranks' tensors do not line up)."""
    out = []
    for calls in zip(*per_rank):
        if any(c is None for c in calls) or len({c.numel() for c in calls}) != 1:
            out.append(None)
        else:
            out.append(sum(calls))
    return out


def missing_gradient(sums, expected, names):
    """The name of the first parameter whose expected gradient (a tensor) is not, up to a
    non-zero factor, a contiguous run of one delivered all-reduce; None when all are carried."""
    flats = [s for s in sums if s is not None]
    for name, e in zip(names, expected):
        e = e.detach().reshape(-1).double()
        if not any(_carries(s, e) for s in flats if s.numel() >= e.numel()):
            return name
    return None


def _carries(flat, e):
    scale = float(e.abs().max())
    if scale == 0.0:
        return True                 # a zero gradient is carried by anything of its size
    windows = flat.unfold(0, e.numel(), 1)                         # every contiguous run
    c = windows @ e / float(e @ e)                                 # its best factor
    residual = (windows - c[:, None] * e).abs().amax(1)
    fits = (residual <= 1e-7 * c.abs() * scale + 1e-12) & (c.abs() > 1e-9)
    return bool(fits.any())


class Handles:
    """Inside a rank: which all-reduce handles were waited for. The trace completes an event when
    its handle's wait() runs; a learner may also wait through the handle's future or poll
    is_completed(), which this marks too. `unwaited(events)` lists the events (from
    `distlab._tracer._active.events`) that were started asynchronously and never waited for."""

    def __enter__(self):
        from ... import _tracer
        self._cls = _tracer.TracedWork
        self._saved = {name: getattr(self._cls, name) for name in ("get_future", "is_completed")}

        def get_future(work):
            work._event["_waited_another_way"] = True
            return self._saved["get_future"](work)

        def is_completed(work):
            done = self._saved["is_completed"](work)
            if done:
                work._event["_waited_another_way"] = True
            return done
        self._cls.get_future, self._cls.is_completed = get_future, is_completed
        return self

    def __exit__(self, *exc):
        for name, fn in self._saved.items():
            setattr(self._cls, name, fn)

    @staticmethod
    def unwaited(events):
        return [e for e in events if e["op"] == "all_reduce" and not e["native"]
                and e["end"] is None and not e.get("_waited_another_way")]


def never_waited_sentence(where, count):
    return (f"{where}: you started {count} all-reduce(s) with async_op=True but never waited on "
            f"the handle: call work.wait() (in finish(), or before you read the result) — until "
            f"then the tensor may still hold this rank's own values, not the sum.")
