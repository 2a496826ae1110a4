"""The course's names and sizes for what a profiler event records, and the event it becomes."""
from .._tracer import _COLLECTIVES

P2P = dict(send="send", recv="recv", recv_any_source="recv", recvAnySource="recv")
# The profiler's names of element types (record_shapes) -> torch's.
DTYPES = {"float": "float32", "double": "float64", "c10::Half": "float16",
          "c10::BFloat16": "bfloat16", "long int": "int64", "int": "int32", "short int": "int16",
          "signed char": "int8", "unsigned char": "uint8", "bool": "bool",
          "Float": "float32", "Double": "float64", "Half": "float16", "BFloat16": "bfloat16",
          "Long": "int64", "Int": "int32", "Byte": "uint8", "Char": "int8", "Bool": "bool"}
ITEMSIZE = dict(float32=4, float64=8, float16=2, bfloat16=2, int64=8, int32=4, int16=2,
                int8=1, uint8=1, bool=1)


def _event(op, start, end, launch=None, **fields):
    e = dict(kind="comm", op=op, method=op, group=None, peer=None, tag=None, bytes=0,
             dtype=None, launch=start if launch is None else launch, start=start, end=end,
             waited=0.0, async_op=True, native=False, label=None)
    e.update(fields)
    return e


def _int(x):
    try:
        return int(x)
    except (TypeError, ValueError):
        return 0


def _op_of_method(method):
    """The course's op name of a c10d method or collective name ("allreduce_", "_allgather_base")."""
    method = method.removeprefix("c10d::")
    for m in (method, method.rstrip("_"), method.rstrip("_").lstrip("_")):
        if m in P2P:
            return P2P[m]
        if m in _COLLECTIVES:
            return _COLLECTIVES[m][0]
    return None
