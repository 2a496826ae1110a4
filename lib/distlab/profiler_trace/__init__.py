"""A real job's torch.profiler traces in the course's Trace: its timeline, summary and overlap.

    t = distlab.profiler_trace.from_profiler("traces/")   # or [rank0.json, rank1.json, ...]
    distlab.viz.trace.timeline(t)
    print(t.summary())
    t.overlap(0)      # comm, overlapped, exposed, ratio, idle: the definitions of HTA

Input: one Kineto JSON file per rank, as torch writes them with
`profile(on_trace_ready=tensorboard_trace_handler(dir))` (`*.pt.trace.json`, gzipped or not) or
`prof.export_chrome_trace(path)`. The rank of each file is its `distributedInfo.rank` (torch
writes it when a process group exists), else its place in the list; one rank's file of a big job
reads alone (the Trace has the job's world size, the ranks without a file are empty).

What becomes what. Two kinds of trace, read the way Holistic Trace Analysis (HTA) reads them:
- a GPU job (the file has GPU kernels): communication = the NCCL kernels (`nccl*Kernel*`, HTA's
  rule), from kernel start to end; compute = every other kernel except copies and syncs (HTA's
  rule); copies (Memcpy/Memset) count as busy for idle time, neither compute nor communication.
  The CPU side is not used: on a GPU it is launches, not work;
- a CPU job (gloo: no kernels): communication = gloo's own record of each transfer
  (`gloo:all_reduce` ... on its worker threads, `gloo:send`/`gloo:recv` on the caller's), paired
  with the `c10d::` call that launched it (op, bytes from the recorded shapes, peer and tag; a
  peer inside a subgroup is its global rank only where the file tells the group, see `groups`,
  else None);
  compute = the time the ranks' threads spent in operators (`cpu_op`) outside communication
  calls, named after the `record_function` range around it (forward, backward, optimizer).
Times are seconds since the earliest event of all the files, so ranks line up (on one host they
share a clock; across hosts only as well as the hosts' clocks agree).

What a profiler trace does not say: how long the caller sat blocked waiting (torch records no
event for it on gloo, and on a GPU the host does not wait), so `waited` is 0 for every event;
read the exposed communication (`Trace.overlap`) instead: communication no compute hid.

Why not HTA itself: it analyses GPU kernels only (on a CPU trace its overlap is NaN) and pulls in
pandas, plotly and JupyterLab extras; this reader uses its definitions, and tests compare the two
(`make test` installs HTA): on a GPU-shaped trace, and a real GPU job's steps (viz.gpu_trace).
"""
from .chrome import from_chrome
from .files import _base_us, _default_group, _files, _load, _rank_of, _slices, _t0
from .gloo import BYTES_ARG, _arg_bytes, _cpu, _gloo_event, _numels, _pair
from .groups import Groups
from .gpu import GPU_CATS, NCCL_KERNEL, NCCL_OPS, NOT_COMPUTE, _gpu, _nccl_event
from .intervals import _cut, _name_at, _subtract
from .reader import _read_rank, _world_of, from_profiler
from .records import DTYPES, ITEMSIZE, P2P, _event, _int, _op_of_method
from .steps import projected_phases

__all__ = ["from_profiler", "from_chrome"]
