"""What a call moves and what an op costs: the bytes a collective's model needs, the
c10d ops issued from C++, FLOPs and matmul shapes for the device model."""

import torch
from torch.utils.flop_counter import flop_registry

from ..hardware.kernels import AttentionShape


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
    # An in-place matmul (`out.addmm_(a, b)`) does the out-of-place op's work: torch's counter
    # does not list the in-place packets, and without this it was charged its bytes only.
    packet = _IN_PLACE.get(packet, packet)
    formula = flop_registry.get(packet)
    if formula is None:
        return 0
    try:
        flops = formula(*args, **kwargs, out_val=out)
    except Exception:
        return 0
    return flops // 2 if causal else flops


_IN_PLACE = {_aten.addmm_: _aten.addmm, _aten.baddbmm_: _aten.baddbmm}
# where each matmul's operands sit in its arguments (the device's GEMM curve needs m, n, k)
_MATMULS = {_aten.mm: 0, _aten.addmm: 1, _aten.bmm: 0, _aten.baddbmm: 1, _aten.addmm_: 1,
            _aten.baddbmm_: 1}


def _matmul_shape(func, args):
    """(m, n, k, batch) of a matmul op, an AttentionShape of a fused attention kernel (its own
    kind of kernel on the device), None for any other op."""
    packet = func._overloadpacket
    if packet in _ATTENTION:
        backward = packet is not _aten._scaled_dot_product_flash_attention_for_cpu
        at = 1 if backward else 0                                   # the gradient comes first
        q, k = args[at], args[at + 1]
        where = _ATTENTION[packet][1]
        causal = len(args) > where and args[where] is True
        return AttentionShape(q.shape[-2], k.shape[-2], q.shape[-1],
                              q.numel() // (q.shape[-2] * q.shape[-1]), causal, backward)
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


def _op_bytes(func, args, out):
    """Bytes an op moves through memory: its inputs and outputs, except an embedding lookup,
    which reads the rows it gathers (as many as it writes), not the whole table."""
    if func._overloadpacket is _aten.embedding and len(args) >= 2:
        return _nbytes(args[1]) + 2 * _nbytes(out)
    return _nbytes(args) + _nbytes(out)


def _first_dtype(args):
    for t in _tensors(args):
        if t.is_floating_point():
            return t.dtype
    return torch.float32
