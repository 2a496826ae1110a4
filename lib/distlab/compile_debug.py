"""Chapter 11b §1b: torch.compile's two performance bugs, read from Dynamo's own records.

A **graph break** (an `.item()` feeding a Python `if`, a `print`, an unsupported call) splits a
function into compiled pieces with eager Python between them; a **recompile** (a new shape, a
changed Python constant the graph was specialised on) compiles the function again. Both are what
`TORCH_LOGS="recompiles,graph_breaks"` prints. `compile_report` runs a function under
`torch.compile(backend="eager")` (Dynamo only: no C++ code is generated, so it is cheap) and
returns the same facts as data: graphs compiled, break reasons, recompile reasons.
"""
import contextlib
import logging
import re

import torch


@contextlib.contextmanager
def _quiet_dynamo():
    # Dynamo warns about each graph break on stderr; the report says it instead.
    logger = logging.getLogger("torch._dynamo")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


def _first_line(reason):
    line = str(reason).strip().splitlines()[0]
    return re.sub(r" at 0x[0-9a-fA-F]+", "", line)


def _reason(text):
    # "0/1: scale == 1.0    # y = x * scale  # file:line in fn\nUser stack trace: ..."
    # -> "scale == 1.0"
    line = _first_line(text).split(": ", 1)[-1]
    return re.split(r"\s{2,}#", line)[0].strip()


def compile_report(fn, calls, **compile_kw):
    """Compile `fn` afresh with Dynamo and call it once per entry of `calls` (a tuple of
    arguments each). Returns {"compiles": [(frame, compile id, recompile reason or None), ...]
    (a graph break adds a resume function, compiled as a frame of its own), "graph_breaks":
    {reason: count}, "results": what each call returned}. Dynamo's caches are reset before and
    after, so every report starts from nothing."""
    import torch._dynamo as dynamo
    from torch._dynamo.utils import clear_compilation_metrics, counters, get_compilation_metrics

    compile_kw.setdefault("backend", "eager")
    dynamo.reset()
    counters.clear()
    clear_compilation_metrics()
    compiled = torch.compile(fn, **compile_kw)
    with _quiet_dynamo():
        results = [compiled(*args) for args in calls]
    breaks = {}
    for reason, n in counters["graph_break"].items():
        breaks[_first_line(reason)] = breaks.get(_first_line(reason), 0) + n
    compiles = [(m.co_name, str(m.compile_id),
                 None if m.recompile_reason is None else _reason(m.recompile_reason))
                for m in get_compilation_metrics()]
    dynamo.reset()
    return {"compiles": compiles, "graph_breaks": breaks, "results": results}


def print_report(label, report):
    """The report in a few lines: what TORCH_LOGS="recompiles,graph_breaks" would tell."""
    recompiles = [c for c in report["compiles"] if c[2] is not None]
    frames = {c[0] for c in report["compiles"]}
    print(f"{label}: {len(report['compiles'])} compile(s) of {len(frames)} frame(s), "
          f"{sum(report['graph_breaks'].values())} graph break(s), "
          f"{len(recompiles)} recompile(s)")
    for reason, n in report["graph_breaks"].items():
        print(f"  graph break x{n}: {reason}")
    for frame, compile_id, reason in recompiles:
        print(f"  recompile {compile_id} of {frame}: {reason}")


def short_last_batch(rank, world_size, batches=(8, 8, 8), short=5, dynamic=None):
    """Data parallelism with a compiled loss: every rank trains on `batches`, except that the last
    rank's last batch holds only `short` samples (its shard of a dataset that does not divide).
    Per step and rank: the batch, the compiles it caused, the seconds in forward+backward and in
    the gradient all-reduce that follows (the wait for the other ranks)."""
    import time

    import torch.distributed as dist
    import torch._dynamo as dynamo
    from torch._dynamo.utils import clear_compilation_metrics, get_compilation_metrics

    dynamo.reset()
    clear_compilation_metrics()
    torch.manual_seed(0)
    model = torch.nn.Linear(16, 4)
    loss_of = torch.compile(lambda x: model(x).square().mean(), backend="eager", dynamic=dynamic)
    steps = []
    with _quiet_dynamo():
        for i, n in enumerate(batches):
            if i == len(batches) - 1 and rank == world_size - 1:
                n = short
            before = len(get_compilation_metrics())
            start = time.perf_counter()
            model.zero_grad()
            loss_of(torch.ones(n, 16)).backward()
            computed = time.perf_counter()
            dist.all_reduce(model.weight.grad)
            steps.append({"batch": n, "compiles": len(get_compilation_metrics()) - before,
                          "compute_s": computed - start, "wait_s": time.perf_counter() - computed})
    dynamo.reset()
    return steps
