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

Split by idea: ops (bytes and FLOPs), meta (full-size tensors without values), work (the
handles), recorder (the mode, the wrapped methods, the clock). `_active` lives here, in the
package, because distlab.trace and the ch05 checkers read `distlab._tracer._active`.
"""
_active = None          # the Recorder of this rank while a traced run is going

from .ops import _COLLECTIVES, _P2P, _NATIVE, _COMM_NAMESPACES, _flops, _matmul_shape  # noqa: E402,F401,E501
from .meta import MetaValueError  # noqa: E402,F401
from .work import TracedWork  # noqa: E402,F401
from .recorder import Recorder  # noqa: E402,F401
