"""One rank's recorder: the dispatch mode that charges compute, the wrapped ProcessGroup
methods that record communication, and the clock they move."""
import sys
import threading
import time

import torch.distributed as dist
from torch._C._distributed_c10d import ProcessGroup
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils._python_dispatch import TorchDispatchMode

from .ops import (_COLLECTIVES, _COMM_NAMESPACES, _NATIVE, _P2P, _dtype, _first_dtype, _flops,
                  _matmul_shape, _nbytes, _op_bytes, _tensors)
from .meta import MetaValueError, _MetaFunctions, _meta, _on_meta
from .work import TracedWork, _NoTransfer


def _is_dtensor(types):
    # DTensor (with sympy) costs ≈ 0.75 s to import: a torchrun worker or a kernel that never
    # makes one need not pay it, and no DTensor exists before its module is imported.
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and any(issubclass(t, module.DTensor) for t in types)


class _DeviceMode(TorchDispatchMode):
    """Sees every tensor op: charges modeled compute, records collectives issued from C++."""

    def __init__(self, recorder):
        super().__init__()
        self.recorder = recorder

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        # a DTensor op, charged here, would cost its global shapes on every rank: let DTensor
        # run it on its local tensors, which come back here
        if _is_dtensor(types):
            return NotImplemented
        if any(issubclass(t, FakeTensor) for t in types):   # DTensor's shape inference
            return func(*args, **(kwargs or {}))
        kwargs = kwargs or {}
        rec = self.recorder
        if rec.clock is not None and _meta(args):
            rec.meta = True
            out = _on_meta(func, args, kwargs)
        else:
            out = func(*args, **kwargs)
        if func.namespace in _COMM_NAMESPACES:
            name = func.__name__.split(".")[0]
            # _wrap_tensor_autograd (torch 2.13) wraps a functional collective's result for
            # autograd: it follows every DTensor collective and moves no data
            if not rec.inside and not name.startswith(("wait", "barrier",
                                                       "_wrap_tensor_autograd")):
                rec.native(_NATIVE.get(name, name), _nbytes(args), _dtype(args))
                # A functional collective (DTensor's) is waited for where its result is first
                # used: in eager DTensor code, the next op. On meta tensors it has no wait_tensor
                # to see, so under emulation the caller waits for it at once.
                if func.namespace == "_c10d_functional" and rec.clock is not None:
                    rec.finish(rec.events[-1], None)
        elif not getattr(func, "is_view", False):
            rec.ops += not rec.inside       # work done between a launch and its wait, plainly too
            if rec.clock is not None and not rec.inside:   # backend ops: Recorder.backend
                rec.charge(func, args, kwargs, out)
        return out


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
        nbytes = _op_bytes(func, args, out)
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
        _package()._active = self
        _patch()
        self._mode = _DeviceMode(self)
        self._mode.__enter__()
        self._functions = _MetaFunctions() if self.clock is not None else None
        if self._functions is not None:
            self._functions.__enter__()

    def stop(self):
        if getattr(self, "_functions", None) is not None:
            self._functions.__exit__(None, None, None)
            self._functions = None
        if self._mode is not None:
            self._mode.__exit__(None, None, None)
            self._mode = None
        _unpatch()
        _package()._active = None
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

def _package():
    # `_active` is the package's, where distlab.trace reads it (this module is imported by it)
    return sys.modules[__package__]


_originals = {}


def _wrap(method, original):
    def traced(pg, *args, **kwargs):
        rec = _package()._active
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
