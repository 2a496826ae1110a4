"""Three ways to run distributed PyTorch on a laptop, and the course's clock beside them, on one
tensor-parallel MLP: fc1 column-parallel → GELU → fc2 row-parallel (chapter 07), written with
DTensor's `parallelize_module` so that every way runs the very same module.

- `real_ranks`: processes on gloo through `distlab.run`. Values, and every message in the
  course's trace; a hang or a straggler happens for real. Time is the laptop's, not a cluster's.
- `local_tensor`: torch's LocalTensorMode plays every rank in ONE process: each tensor holds one
  value per simulated rank, and a collective is done as the mathematics of it on those values.
  Values of every rank; no processes, so no messages, no hang, no time.
- `fake_pg`: one process plays rank 0 of a full-size job on torch's fake process group (every
  collective returns at once) under FakeTensorMode (shapes and dtypes, no storage). The shapes
  and memory of a rank at the real size, and CommDebugMode's count of DTensor's collectives; no
  values, no time.
- `emulated`: the course's emulated accelerator (`distlab.run(..., emulate=preset)`) on meta
  tensors at the same full size: modeled time on the preset's devices and links; no values.

Every rank builds the same dense MLP from the same seed, so each cuts its own shard
(`src_data_rank=None`): no scatter at set-up, and a trace holds only the step's collectives.
"""
import contextlib

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                               parallelize_module)

from .models import FeedForward

# A Llama-like MLP: Llama-3 8B's width and FFN size (config.json), one sequence of 4096 tokens.
FULL = dict(d_model=4096, ffn=14336, tokens=4096)
SMALL = dict(d_model=8, ffn=32, tokens=6)


class RowwiseWithoutReduce(RowwiseParallel):
    """THE BROKEN EXAMPLE: fc2 row-parallel, but each rank keeps its partial sum as if it were
    the output (the forward all-reduce forgotten). Each rank's output is wrong."""

    @staticmethod
    def _prepare_output_fn(output_layouts, use_local_output, mod, outputs, device_mesh):
        return outputs.to_local()


def plan(broken=False):
    """The parallelize_module plan: fc1 colwise (Shard(0) of its (out, in) weight), fc2 rowwise."""
    return {"fc1": ColwiseParallel(),
            "fc2": RowwiseWithoutReduce() if broken else RowwiseParallel()}


def dense_mlp(d_model, ffn, dtype=torch.float64, seed=0):
    """The dense MLP every way starts from (the same weights in every process)."""
    default = torch.get_default_dtype()
    # made in `dtype`, not cast to it: a fake tensor cannot be swapped for its cast
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        torch.set_default_dtype(dtype)
        try:
            return FeedForward(d_model, ffn)
        finally:
            torch.set_default_dtype(default)


def inputs(d_model, tokens, dtype=torch.float64, seed=1, device="cpu"):
    """One sequence of `tokens` tokens, the same in every process; on "meta", shapes only."""
    if device == "meta":
        return torch.empty(1, tokens, d_model, dtype=dtype, device="meta")
    return torch.randn(1, tokens, d_model, dtype=dtype,
                       generator=torch.Generator().manual_seed(seed))


def dense_reference(d_model, ffn, tokens, **_):
    """Output, input gradient and parameter gradients of the dense MLP in one process."""
    mlp, x = dense_mlp(d_model, ffn), inputs(d_model, tokens).requires_grad_()
    y = mlp(x)
    (y ** 2).sum().backward()
    return {"out": y.detach(), "x_grad": x.grad,
            "grads": {n: p.grad for n, p in mlp.named_parameters()}}


def _step(model, x, span=None):
    """Forward and backward (loss: sum of squares), each inside `span(name)` when given."""
    span = span or (lambda name: contextlib.nullcontext())
    with span("forward"):
        y = model(x)
    with span("backward"):
        (y ** 2).sum().backward()
    return y


def _full(t):
    """A DTensor's whole value (gathered), or a plain tensor as it is."""
    return t.full_tensor() if isinstance(t, DTensor) else t


# ---- (a) real ranks on gloo ---------------------------------------------------------------------

def _rank(rank, world_size, shape, broken):
    from . import trace
    from torch.distributed.device_mesh import init_device_mesh
    mesh = init_device_mesh("cpu", (world_size,))
    model = parallelize_module(dense_mlp(shape["d_model"], shape["ffn"]), mesh, plan(broken),
                               src_data_rank=None)
    x = inputs(shape["d_model"], shape["tokens"]).requires_grad_()
    y = _step(model, x, trace.span)
    with trace.span("gather"):          # for the comparison only: not part of the step
        grads = {n: _full(p.grad) for n, p in model.named_parameters()}
        shards = {n: tuple(p.to_local().shape) for n, p in model.named_parameters()}
    return {"out": _full(y).detach(), "x_grad": x.grad, "grads": grads, "shards": shards}


def real_ranks(tp=4, shape=SMALL, broken=False, timeout=60):
    """The MLP on `tp` processes on gloo. {"per_rank": each rank's out, x_grad, grads (gathered)
    and local shard shapes; "comm": {"forward"/"backward": {op: calls}} on rank 0 and
    "messages": [(pass, op, bytes)] of rank 0 from the course's trace}."""
    from .launch import run
    res = run(_rank, tp, dict(shape), broken, trace=True, timeout=timeout)
    return {"per_rank": list(res), **_from_trace(res.trace, rank=0)}


def _from_trace(t, rank):
    comm = {"forward": {}, "backward": {}}
    messages = []
    for e in t.comm(rank):
        where = (e.get("label") or [None])[-1]
        if where in comm:
            comm[where][e["op"]] = comm[where].get(e["op"], 0) + 1
            messages.append((where, e["op"], e["bytes"]))
    return {"comm": comm, "messages": messages}


# ---- torch's fake process group: one process plays the ranks -----------------------------------

def _fake_group(world_size):
    from torch.testing._internal.distributed.fake_pg import FakeStore
    if dist.is_initialized():
        raise RuntimeError("the LocalTensor and fake-process-group ways start a fake process group "
                           "of their own, and this process already has a default process group: "
                           "call them from a process without one (the notebook's kernel, not a "
                           "rank).")
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)
    from torch.distributed.device_mesh import init_device_mesh
    # the mesh reads its rank list as values: built before LocalTensor or fake mode
    return init_device_mesh("cpu", (world_size,))


def _counts(cdm):
    """CommDebugMode's collectives, by pass: {"forward"/"backward": {op: calls}}."""
    counts = cdm.comm_module_counts["Global"]
    return {k: {_op_name(op): n for op, n in counts[k].items()} for k in ("forward", "backward")}


def _op_name(op):
    # c10d_functional.all_reduce → all_reduce; the names the course's trace uses
    name = str(op).split(".")[-1]
    return {"all_gather_into_tensor": "all_gather",
            "reduce_scatter_tensor": "reduce_scatter"}.get(name, name)


# ---- (b) LocalTensor: every rank's values in one process ----------------------------------------

def local_tensor(tp=4, shape=SMALL, broken=False):
    """The MLP for `tp` simulated ranks in this process. {"per_rank": [{"out", "x_grad", "grads"
    (gathered), "shards" (the rank's own gradient shards)}] in rank order, "comm":
    CommDebugMode's counts by pass}."""
    from torch.distributed._local_tensor import LocalTensor, LocalTensorMode
    from torch.distributed.tensor.debug import CommDebugMode
    # built before the mode: inside it, torch's random functions draw for each rank apart
    dense, x = dense_mlp(shape["d_model"], shape["ffn"]), inputs(shape["d_model"], shape["tokens"])
    mesh = _fake_group(tp)
    try:
        with LocalTensorMode(tp):
            model = parallelize_module(dense, mesh, plan(broken), src_data_rank=None)
            x.requires_grad_()
            with CommDebugMode() as cdm:
                y = _step(model, x)
            out = _full(y)
            grads = {n: _full(p.grad) for n, p in model.named_parameters()}
            local = {n: p.grad.to_local() for n, p in model.named_parameters()}

        def of(t, r):       # rank r's value of a LocalTensor (a plain tensor is every rank's)
            return t._local_tensors[r] if isinstance(t, LocalTensor) else t

        per_rank = [{"out": of(out, r).detach(), "x_grad": of(x.grad, r),
                     "grads": {n: of(g, r) for n, g in grads.items()},
                     "shards": {n: of(g, r) for n, g in local.items()}} for r in range(tp)]
        return {"per_rank": per_rank, "comm": _counts(cdm)}
    finally:
        dist.destroy_process_group()


# ---- (c) the fake process group at full size: shapes, memory, collectives ----------------------

def fake_pg(tp=8, shape=FULL, dtype=torch.bfloat16, broken=False):
    """Rank 0 of the MLP at full size on a fake process group under FakeTensorMode.
    {"shards": {name: rank 0's local shape}, "param_bytes": the rank's parameter bytes,
    "peak_bytes": torch's MemTracker peak over forward and backward (parameters, gradients,
    activations), "comm": CommDebugMode's counts by pass, "activation_bytes": the output's
    bytes, which is what each all-reduce carries}."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed._tools.mem_tracker import MemTracker
    from torch.distributed.tensor.debug import CommDebugMode
    mesh = _fake_group(tp)
    try:
        with FakeTensorMode():      # fake CPU tensors: init and ops run on shapes, no storage
            model = parallelize_module(dense_mlp(shape["d_model"], shape["ffn"], dtype), mesh,
                                       plan(broken), src_data_rank=None)
            x = torch.empty(1, shape["tokens"], shape["d_model"], dtype=dtype,
                            requires_grad=True)
            tracker = MemTracker()
            tracker.track_external(model, x)
            with tracker, CommDebugMode() as cdm:
                y = _step(model, x)
            (peak,) = tracker.get_tracker_snapshot("peak").values()
            shards = {n: tuple(p.to_local().shape) for n, p in model.named_parameters()}
            param_bytes = sum(p.to_local().numel() * p.element_size()
                              for p in model.parameters())
            act = y.numel() * y.element_size()
    finally:
        dist.destroy_process_group()
    return {"shards": shards, "param_bytes": param_bytes, "peak_bytes": peak["Total"],
            "comm": _counts(cdm), "activation_bytes": act}


# ---- (d) the course's clock at full size --------------------------------------------------------

def _meta_rank(rank, world_size, shape, dtype):
    from . import trace
    from torch.distributed.device_mesh import init_device_mesh
    mesh = init_device_mesh("cpu", (world_size,))
    with torch.device("meta"):
        model = parallelize_module(dense_mlp(shape["d_model"], shape["ffn"], dtype), mesh, plan(),
                                   src_data_rank=None)
        x = inputs(shape["d_model"], shape["tokens"], dtype, device="meta").requires_grad_()
    start = trace.now()
    _step(model, x, trace.span)
    return trace.now() - start


def emulated(tp=8, shape=FULL, preset="h100-node", dtype=torch.bfloat16, timeout=120):
    """The MLP at full size on meta tensors under `emulate=preset`. {"step": modeled seconds of
    forward + backward (the slowest rank), "comm_seconds": rank 0's collectives' time from launch
    to end, "comm": counts by pass, "messages", "cluster": the preset's description}."""
    from .launch import run
    res = run(_meta_rank, tp, dict(shape), dtype, emulate=preset, timeout=timeout)
    t = res.trace
    seen = _from_trace(t, rank=0)
    comm_s = sum(e["end"] - e["launch"] for e in t.comm(0)
                 if (e.get("label") or [None])[-1] in ("forward", "backward"))
    return {"step": max(res), "comm_seconds": comm_s, **seen, "trace": t}
