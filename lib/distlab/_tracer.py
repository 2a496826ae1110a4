"""Inside a rank: record every communication call and every marked compute span, and (under
emulation) move the rank's virtual clock. `distlab.trace` is the public face of this module.

Two layers, because neither sees everything:
- the methods of torch's `ProcessGroup` are wrapped for the length of the run. Every collective
  and point-to-point call made from Python goes through them (`dist.all_reduce`, `dist.isend`,
  `batch_isend_irecv`, `group.allreduce(...)` called directly, FSDP2's gathers, whatever name the
  function was imported under), so the wrapper sees the group, the peer, the tag and the Work
  handle, and under emulation can make `wait()` complete at the modeled time;
- a TorchDispatchMode sees every tensor operation, including the `c10d::` ops that C++ code
  issues (torch's DDP reducer, DTensor's functional collectives): those are recorded as
  `native`. Under emulation the mode also charges each operation's modeled compute time.
The profiler sees c10d calls too, but not the peer of a message, and it cannot delay a wait.

Meta tensors (full-size runs under emulation): a tensor on the `meta` device has a shape and a
dtype but no memory and no values, so a rank can hold a 7B-parameter layer on a laptop. Under
emulation every op on meta tensors is charged as on real ones (FLOPs from the shapes through
torch's flop counter, bytes from numel·itemsize); a collective or message on meta tensors never
reaches gloo: its wrapper charges the modeled time on the clock (the peers still agree through
the store) and returns a finished handle, the outputs staying meta. What needs a value (`.item()`,
`bool()`/`if` on a tensor, `.tolist()`/`.cpu()`, ops whose output size depends on the values
such as nonzero or boolean masks, a receive from any source) raises MetaValueError with one
sentence; so does communicating meta tensors in a run that is not emulated. Printing a meta
tensor shows `tensor(..., device='meta', size=...)`: no values.
"""
import sys
import threading
import time

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import ProcessGroup
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import flop_registry

_active = None          # the Recorder of this rank while a traced run is going


def _tensors(x):
    if isinstance(x, torch.Tensor):
        return [x]
    if isinstance(x, (list, tuple)):
        return [t for item in x for t in _tensors(item)]
    return []


def _nbytes(x):
    return sum(t.numel() * t.element_size() for t in _tensors(x))


def _dtype(*xs):
    for x in xs:
        ts = _tensors(x)
        if ts:
            return str(ts[0].dtype).replace("torch.", "")
    return None


# ProcessGroup method -> (op, the bytes the op's model needs). For gathers and scatters that is the
# FULL tensor (what all ranks hold together); for all_to_all what this rank sends.
_COLLECTIVES = {
    "allreduce": ("all_reduce", lambda a, n: _nbytes(a[0])),
    "allreduce_coalesced": ("all_reduce", lambda a, n: _nbytes(a[0])),
    "broadcast": ("broadcast", lambda a, n: _nbytes(a[0])),
    "reduce": ("reduce", lambda a, n: _nbytes(a[0])),
    "allgather": ("all_gather", lambda a, n: _nbytes(a[0])),
    "_allgather_base": ("all_gather", lambda a, n: _nbytes(a[0])),
    "all_gather_single": ("all_gather", lambda a, n: _nbytes(a[0])),
    "allgather_coalesced": ("all_gather", lambda a, n: _nbytes(a[0])),
    "allgather_into_tensor_coalesced": ("all_gather", lambda a, n: _nbytes(a[0])),
    "all_gather_single_coalesced": ("all_gather", lambda a, n: _nbytes(a[0])),
    "reduce_scatter": ("reduce_scatter", lambda a, n: _nbytes(a[1])),
    "_reduce_scatter_base": ("reduce_scatter", lambda a, n: _nbytes(a[1])),
    "reduce_scatter_single": ("reduce_scatter", lambda a, n: _nbytes(a[1])),
    "reduce_scatter_tensor_coalesced": ("reduce_scatter", lambda a, n: _nbytes(a[1])),
    "reduce_scatter_single_coalesced": ("reduce_scatter", lambda a, n: _nbytes(a[1])),
    "alltoall": ("all_to_all", lambda a, n: _nbytes(a[1])),
    "alltoall_base": ("all_to_all", lambda a, n: _nbytes(a[1])),
    "all_to_all_single": ("all_to_all", lambda a, n: _nbytes(a[1])),
    "gather": ("gather", lambda a, n: _nbytes(a[1]) * n),
    "scatter": ("scatter", lambda a, n: _nbytes(a[0]) * n),
    "barrier": ("barrier", lambda a, n: 4),
    "monitored_barrier": ("barrier", lambda a, n: 4),
}
_P2P = ("send", "recv", "recv_anysource")
# c10d ops issued from C++ (torch's DDP reducer) and DTensor's functional collectives.
_NATIVE = {f"{method}_": op for method, (op, _) in _COLLECTIVES.items()}
_NATIVE.update(all_reduce="all_reduce", all_gather_into_tensor="all_gather",
               reduce_scatter_tensor="reduce_scatter", all_to_all_single="all_to_all",
               broadcast="broadcast")
_COMM_NAMESPACES = ("c10d", "_c10d_functional", "c10d_functional", "_dtensor")


class MetaValueError(RuntimeError):
    """Code needed the values of a meta tensor (see the module's docstring)."""


def _value_sentence(what):
    return (f"{what} needs the values of a tensor on the meta device, and an emulated run on "
            f"meta tensors computes shapes and times, not values: run this code on real tensors "
            f"at a small size to see values.")


def _meta(xs):
    return any(t.is_meta for t in _tensors(xs))


class _NoTransfer:
    """The finished inner handle of a communication on meta tensors: nothing was sent."""

    def __init__(self, args):
        self._outputs = _tensors(args[0]) if args else []

    def wait(self, timeout=None):
        return True

    def is_completed(self):
        return True

    def is_success(self):
        return True

    def exception(self):
        return None

    def result(self):
        return self._outputs

    def synchronize(self):
        return None

    def block_current_stream(self):
        return None

    def get_future(self):
        future = torch.futures.Future()
        future.set_result(self._outputs)
        return future


class TracedWork(dist.Work):
    """The Work handle a traced call returns: the real one inside, the event to complete beside."""

    def __init__(self, inner, event, recorder):
        super().__init__()
        self._inner, self._event, self._recorder = inner, event, recorder
        self._finished = False

    def wait(self, timeout=None):
        if self._finished:
            return True
        called, seen = self._recorder.now(), self._recorder._marker()
        ok = self._recorder.backend(self._inner.wait, *([] if timeout is None else [timeout]))
        self._recorder.finish(self._event, self._inner, called, seen)
        self._finished = True
        return ok

    def is_completed(self):
        rec = self._recorder
        if rec.clock is None or self._finished:
            return self._inner.is_completed()
        # Emulated: done when the modeled transfer is (this learns the peers' start times).
        end = rec.completion(self._event)
        if end is None or end > rec.clock.now:
            return False
        rec.backend(self._inner.wait)   # every member launched it: the result is moments away
        return True

    def is_success(self):
        return self._inner.is_success()

    def exception(self):
        return self._inner.exception()

    def source_rank(self):
        return self._inner.source_rank()

    def _source_rank(self):
        return self._inner._source_rank()

    def result(self):
        return self._inner.result()

    def synchronize(self):
        return self._inner.synchronize()

    def get_future(self):
        return self._inner.get_future()

    def block_current_stream(self):
        return self._inner.block_current_stream()


class _DeviceMode(TorchDispatchMode):
    """Sees every tensor op: charges modeled compute, records collectives issued from C++."""

    def __init__(self, recorder):
        super().__init__()
        self.recorder = recorder

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        rec = self.recorder
        if rec.clock is not None and _meta(args):
            rec.meta = True
            out = _on_meta(func, args, kwargs)
        else:
            out = func(*args, **kwargs)
        if func.namespace in _COMM_NAMESPACES:
            name = func.__name__.split(".")[0]
            if not rec.inside and not name.startswith(("wait", "barrier")):
                rec.native(_NATIVE.get(name, name), _nbytes(args), _dtype(args))
        elif not getattr(func, "is_view", False):
            rec.ops += not rec.inside       # work done between a launch and its wait, plainly too
            if rec.clock is not None and not rec.inside:   # backend ops: Recorder.backend
                rec.charge(func, args, kwargs, out)
        return out


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


class Recorder:
    """What one rank did: communication events and compute spans, on its clock."""

    def __init__(self, rank, clock=None):
        self.rank, self.clock = rank, clock
        self.events, self.spans = [], []
        self.inside = False          # inside a wrapped call: its c10d op is not recorded twice
        self.ops = 0                 # tensor ops outside communication calls (compute, copies)
        self.meta = False            # the rank computed or communicated on meta tensors
        self.t0 = time.monotonic()
        self._ranks = {}
        self._label = []             # names of the enclosing span()s
        self._open = None            # the compute span being extended op by op (emulation)
        self._thread = threading.get_ident()
        self._mode = None

    # -- the clock ---------------------------------------------------------------------------
    def now(self):
        return self.clock.now if self.clock is not None else time.monotonic() - self.t0

    def _marker(self, now=None):
        """What changes when the rank does anything: its virtual clock, its events and spans, and
        (measured or emulated alike) the tensor ops it ran."""
        clock = None if self.clock is None else (self.now() if now is None else now)
        return clock, len(self.events), len(self.spans), self.ops

    # -- compute -----------------------------------------------------------------------------
    def charge(self, func, args, kwargs, out):
        flops = _flops(func, args, kwargs, out)
        nbytes = _nbytes(args) + _nbytes(out)
        if not flops and not nbytes:
            return
        start = self.clock.now
        self.clock.compute(flops, nbytes, _first_dtype(args),
                           _matmul_shape(func, args) if flops else None)
        name = self._label[-1] if self._label else "compute"
        if self._open is not None and self._open["name"] == name and self._open["end"] == start:
            self._open["end"] = self.clock.now
            self._open["flops"] += flops
        else:
            self._open = dict(kind="compute", name=name, start=start, end=self.clock.now,
                              flops=flops)
            self.spans.append(self._open)

    def span_enter(self, name):
        self._label.append(name)
        self._open = None
        return self.now()

    def span_exit(self, name, started):
        self._label.pop()
        self._open = None
        if self.clock is None:
            self.spans.append(dict(kind="compute", name=name, start=started, end=self.now(),
                                   flops=None))

    def modeled_compute(self, seconds, name):
        """A stretch of compute of known length (a slow rank, a kernel the model cannot see)."""
        self._open = None
        start = self.now()
        if self.clock is not None:
            self.clock.now += seconds
        else:
            time.sleep(seconds)
        self.spans.append(dict(kind="compute", name=name, start=start, end=self.now(),
                               flops=None))

    # -- communication -----------------------------------------------------------------------
    def backend(self, call, *args):
        """call(*args) as the backend's own work: gloo finishes some collectives with tensor ops
        on the caller's thread (reduce_scatter_tensor copies its result out at wait()); on the
        modeled device the collective's time already covers them."""
        inside, self.inside = self.inside, True
        try:
            return call(*args)
        finally:
            self.inside = inside

    def ranks_of(self, pg):
        key = id(pg)
        if key not in self._ranks:
            try:
                ranks = tuple(dist.get_process_group_ranks(pg))
            except Exception:
                ranks = tuple(range(pg.size()))
            self._ranks[key] = (pg, ranks)     # keep pg alive: its id must stay unique
        return self._ranks[key][1]

    def call(self, pg, method, original, args, kwargs):
        ranks = self.ranks_of(pg)
        meta = self._check_meta(method, args, kwargs)
        event = dict(kind="comm", op=None, method=method, group=ranks, peer=None, tag=None,
                     bytes=0, dtype=_dtype(args), launch=self.now(), start=None, end=None,
                     waited=0.0, async_op=None, native=False, label=self._label[-1:] or None,
                     seq=len(self.events))
        if method in _P2P:
            event["op"] = "send" if method == "send" else "recv"
            event["bytes"] = _nbytes(args[0])
            event["tag"] = args[-1] if args else kwargs.get("tag", 0)
            if method != "recv_anysource":
                event["peer"] = ranks[args[1]]
        else:
            op, size = _COLLECTIVES[method]
            event["op"], event["bytes"] = op, size(args, len(ranks))
        self._open = None
        if self.clock is not None:
            # Launch only publishes; its start and end are learned when needed (completion).
            if event["op"] == "send":
                event["_node"] = self.clock.send(event["bytes"], event["peer"], event["tag"])
            elif event["op"] != "recv":
                event["_node"] = self.clock.collective(event["op"], event["bytes"], ranks,
                                                       pg.group_name)
        self.events.append(event)
        event["_marker"] = self._marker()
        if meta:                    # nothing to send: the clock alone carries the transfer
            self.meta = True
            return TracedWork(_NoTransfer(args), event, self)
        self.inside = True
        try:
            work = original(pg, *args, **kwargs)
        finally:
            self.inside = False
        if work is None:
            self.finish(event, None)
            return None
        return TracedWork(work, event, self)

    def _check_meta(self, method, args, kwargs):
        ts = _tensors(list(args) + list(kwargs.values()))
        metas = sum(t.is_meta for t in ts)
        if not metas:
            return False
        op = _COLLECTIVES[method][0] if method in _COLLECTIVES else method
        if self.clock is None:
            raise MetaValueError(
                f"{op} got a tensor on the meta device, which has no values to send: communicate "
                f"meta tensors only under distlab.run(..., emulate=...), which models their time, "
                f"or build real tensors at a small size.")
        if metas < len(ts):
            raise ValueError(f"{op} mixes tensors on the meta device with real ones: build them "
                             f"all on the meta device (emulation then models the time, without "
                             f"values) or all real.")
        if method == "recv_anysource":
            raise MetaValueError("a receive from any source learns its sender from a real "
                                 "message; with meta tensors name the sender: "
                                 "dist.recv(t, src=...).")
        return True

    def finish(self, event, inner, called=None, seen=None):
        """The caller waits for `event`: on the virtual clock, until its modeled completion.
        `seen`: the rank's marker when it called wait() (what the wait itself did not count)."""
        marker = event.pop("_marker", None)
        called = self.now() if called is None else called
        # Async: the caller did something else between launching and waiting.
        event["async_op"] = marker != (self._marker(called) if seen is None else seen)
        if event["op"] == "recv" and event["peer"] is None and inner is not None:
            event["peer"] = event["group"][inner._source_rank()]
        if self.clock is not None:
            self.completion(event)
            event["waited"] = max(0.0, event["end"] - self.clock.now)
            self.clock.now = max(self.clock.now, event["end"])
        else:
            # inner.wait() has returned: the wall clock says when, and how long the caller was blocked.
            event["start"], event["end"] = event["launch"], self.now()
            event["waited"] = event["end"] - called
        self._open = None

    def completion(self, event):
        """When the transfer of `event` completes on the virtual clock, worked out now if not
        known yet (this may wait on the host for peers to launch it); None while a receive from
        any source has not learned its sender."""
        if event["end"] is None:
            if event["op"] == "recv":
                if event["peer"] is None:
                    return None
                arrival = self.clock.arrival(event["peer"], event["tag"])
                event["start"], event["end"] = event["launch"], max(event["launch"], arrival)
            elif "_node" in event:
                event["start"], event["end"] = self.clock.resolve(event.pop("_node"))
        return event["end"]

    def native(self, op, nbytes, dtype):
        """A collective issued from C++ (torch DDP, DTensor). Recorded; under emulation it occupies
        the link for its modeled time, but C++ waits for it, so the clock cannot wait with it."""
        event = dict(
            kind="comm", op=op, method=op, group=None, peer=None, tag=None, bytes=nbytes,
            dtype=dtype, launch=self.now(), start=None, end=None, waited=0.0, async_op=True,
            native=True, label=self._label[-1:] or None, seq=len(self.events))
        if self.clock is not None:
            event["_node"] = self.clock.unsynchronised(op, nbytes)
        self._open = None
        self.events.append(event)

    # -- switching it on and off ---------------------------------------------------------------
    def start(self):
        global _active
        _active = self
        _patch()
        self._mode = _DeviceMode(self)
        self._mode.__enter__()
        self._functions = _MetaFunctions() if self.clock is not None else None
        if self._functions is not None:
            self._functions.__enter__()

    def stop(self):
        global _active
        if getattr(self, "_functions", None) is not None:
            self._functions.__exit__(None, None, None)
            self._functions = None
        if self._mode is not None:
            self._mode.__exit__(None, None, None)
            self._mode = None
        _unpatch()
        _active = None
        if self.clock is not None and sys.exc_info()[0] is None:
            # Transfers launched and never waited for: learn their times now (after a failure
            # the peers may never launch theirs, so they stay unknown then).
            for event in self.events:
                if "_node" in event:
                    self.completion(event)
        return dict(rank=self.rank, events=[_public(e) for e in self.events], spans=self.spans,
                    end=self.now(), meta=self.meta)


def _public(event):
    return {k: v for k, v in event.items() if not k.startswith("_")}


_aten = torch.ops.aten
# The CPU's fused attention kernels, which torch's flop counter does not list, counted as the
# GPU's flash kernels are (the same arguments first); `is_causal` at this position. A causal
# flash kernel skips the blocks above the diagonal: half the score FLOPs (Dao, FlashAttention-2).
_ATTENTION = {
    _aten._scaled_dot_product_flash_attention_for_cpu:
        (_aten._scaled_dot_product_flash_attention, 4),
    _aten._scaled_dot_product_flash_attention_for_cpu_backward:
        (_aten._scaled_dot_product_flash_attention_backward, 7),
}


def _flops(func, args, kwargs, out):
    """FLOPs of one aten op as torch.utils.flop_counter counts them (0 for what it does not)."""
    packet = func._overloadpacket
    causal = False
    if packet in _ATTENTION:
        packet, where = _ATTENTION[packet]
        causal = len(args) > where and args[where] is True
    formula = flop_registry.get(packet)
    if formula is None:
        return 0
    try:
        flops = formula(*args, **kwargs, out_val=out)
    except Exception:
        return 0
    return flops // 2 if causal else flops


# where each matmul's operands sit in its arguments (the device's GEMM curve needs m, n, k)
_MATMULS = {_aten.mm: 0, _aten.addmm: 1, _aten.bmm: 0, _aten.baddbmm: 1}


def _matmul_shape(func, args):
    """(m, n, k, batch) of a matmul op, None for any other op."""
    packet = func._overloadpacket
    if packet in _ATTENTION:       # the scores' GEMM: (t_q × head) · (head × t_k), per head
        at = 0 if packet is _aten._scaled_dot_product_flash_attention_for_cpu else 1  # grad first
        q, k = args[at], args[at + 1]
        return q.shape[-2], k.shape[-2], q.shape[-1], q.numel() // (q.shape[-2] * q.shape[-1])
    first = _MATMULS.get(packet)
    if first is None or len(args) < first + 2:
        return None
    a, b = args[first], args[first + 1]
    if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)) or a.dim() != b.dim():
        return None
    if a.dim() == 2:
        return a.shape[0], b.shape[1], a.shape[1], 1
    if a.dim() == 3:
        return a.shape[1], b.shape[2], a.shape[2], a.shape[0]
    return None


def _first_dtype(args):
    for t in _tensors(args):
        if t.is_floating_point():
            return t.dtype
    return torch.float32


_originals = {}


def _wrap(method, original):
    def traced(pg, *args, **kwargs):
        rec = _active
        if rec is None or rec.inside or threading.get_ident() != rec._thread:
            return original(pg, *args, **kwargs)
        return rec.call(pg, method, original, args, kwargs)
    traced.__name__ = method
    return traced


def _patch():
    for method in list(_COLLECTIVES) + list(_P2P):
        if method not in _originals and hasattr(ProcessGroup, method):
            _originals[method] = getattr(ProcessGroup, method)
            setattr(ProcessGroup, method, _wrap(method, _originals[method]))


def _unpatch():
    for method, original in _originals.items():
        setattr(ProcessGroup, method, original)
    _originals.clear()
