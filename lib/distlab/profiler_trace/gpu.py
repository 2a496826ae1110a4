"""A GPU job's trace: NCCL kernels are communication, other kernels compute (HTA's rules)."""
import re

from .records import DTYPES, ITEMSIZE, _event, _int, _op_of_method

NCCL_KERNEL = re.compile(r"^nccl.*Kernel")                       # HTA: is_comm_kernel
NOT_COMPUTE = re.compile(r"(^nccl.*Kernel)|(.*(Memcpy)|(Memset))|(.*Sync)")   # HTA: is_compute
GPU_CATS = ("kernel", "gpu_memcpy", "gpu_memset")
NCCL_OPS = dict(AllReduce="all_reduce", AllGather="all_gather", ReduceScatter="reduce_scatter",
                Broadcast="broadcast", Reduce="reduce", SendRecv="send_recv",
                AllToAll="all_to_all")


def _gpu(kernels, groups, sec):
    events, spans, memory = [], [], []
    for k in sorted(kernels, key=lambda k: k["ts"]):
        start, end = sec(k["ts"]), sec(k["ts"] + k.get("dur", 0))
        name, args = k.get("name", ""), k.get("args") or {}
        if NCCL_KERNEL.match(name):
            events.append(_nccl_event(name, args, start, end, groups))
        elif not NOT_COMPUTE.match(name):
            spans.append(dict(kind="compute", name=_short_kernel(name), start=start, end=end,
                              flops=None))
        else:
            memory.append((start, end))          # copies, sets, syncs: busy, not compute
    for i, e in enumerate(events):
        e["seq"] = i
    return events, spans, memory


def _nccl_event(name, args, start, end, groups):
    m = re.match(r"nccl(?:Dev)?Kernel_([A-Za-z]+)", name)
    op = NCCL_OPS.get(m.group(1), m.group(1).lower()) if m else "nccl"
    if args.get("Collective name"):
        op = _op_of_method(args["Collective name"]) or op
    dtype = DTYPES.get(args.get("dtype"), args.get("dtype"))
    elements = max(_int(args.get("In msg nelems")), _int(args.get("Out msg nelems")))
    return _event(op, start, end, bytes=elements * ITEMSIZE.get(dtype, 0), dtype=dtype,
                  group=groups.of(args))


def _short_kernel(name):
    return name.split("(")[0].split("<")[0][:60] or "kernel"
