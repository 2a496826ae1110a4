"""What the hardware presets claim, measured on this machine: GEMM efficiency at a few shapes,
HBM copy bandwidth, the eager per-op floor (and under a CUDA graph), and with several GPUs the
all_reduce bus bandwidth at a few sizes — each beside the preset of the GPU found
(distlab.hardware), so a lent GPU checks the numbers the emulator charges.

Timing on a GPU uses CUDA events around many repetitions after a warm-up (a kernel launch returns
at once on the host); on the CPU (`--cpu`), perf_counter around the same loops, with no preset to
compare with: it only exercises the code path.
"""
import time

import torch
import torch.distributed as dist

from .. import hardware
from ..cost import bus_bandwidth
from ..devices import device
from ..launch import run

GEMM_SHAPES = ((1024, 1024, 1024), (4096, 4096, 4096), (8192, 8192, 8192), (256, 4096, 4096))
CPU_GEMM_SHAPES = ((128, 128, 128), (512, 512, 512))
ALL_REDUCE_BYTES = (8, 1 << 20, 64 << 20, 1 << 30)


def preset_for(name):
    """The hardware.Device whose name the GPU's name contains (H200 before H100), or None."""
    for key, dev in (("H200", hardware.H200), ("H100", hardware.H100), ("A100", hardware.A100)):
        if key in name:
            return dev
    return None


def _timer(dev):
    """seconds_of(fn, repeats): mean seconds per call of fn, after a warm-up call."""
    def seconds_of(fn, repeats):
        fn()
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(repeats):
                fn()
            end.record()
            end.synchronize()
            return start.elapsed_time(end) / 1e3 / repeats
        started = time.perf_counter()
        for _ in range(repeats):
            fn()
        return (time.perf_counter() - started) / repeats
    return seconds_of


def gemm(dev, shapes, dtype, repeats):
    """[(m, n, k, achieved FLOP/s)] of torch.matmul in `dtype`."""
    seconds_of, out = _timer(dev), []
    for m, n, k in shapes:
        a = torch.randn(m, k, device=dev, dtype=dtype)
        b = torch.randn(k, n, device=dev, dtype=dtype)
        out.append((m, n, k, 2.0 * m * n * k / seconds_of(lambda: a @ b, repeats)))
    return out


def copy_bandwidth(dev, nbytes, repeats):
    """Bytes/s of a device-to-device copy (each byte read once and written once)."""
    x = torch.empty(nbytes // 4, device=dev, dtype=torch.float32)
    y = torch.empty_like(x)
    return 2.0 * x.numel() * 4 / _timer(dev)(lambda: y.copy_(x), repeats)


def op_floor(dev, repeats):
    """(eager seconds per tiny op, seconds per op replayed from a CUDA graph or None)."""
    x = torch.zeros(1, device=dev)
    eager = _timer(dev)(lambda: x.add_(1), repeats)
    if dev.type != "cuda":
        return eager, None
    graph, ops = torch.cuda.CUDAGraph(), 100
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        x.add_(1)                                   # warm-up outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    with torch.cuda.graph(graph):
        for _ in range(ops):
            x.add_(1)
    replayed = _timer(dev)(graph.replay, max(1, repeats // ops)) / ops
    return eager, replayed


def all_reduce_busbw(sizes, repeats):
    """On the ranks of the current process group: [(bytes, seconds, busbw)] of dist.all_reduce."""
    dev, n = device(), dist.get_world_size()
    seconds_of, out = _timer(dev), []
    for nbytes in sizes:
        x = torch.zeros(max(1, nbytes // 4), device=dev)
        t = seconds_of(lambda: dist.all_reduce(x), repeats)
        out.append((x.numel() * 4, t, bus_bandwidth("all_reduce", x.numel() * 4, n, t)))
    return out


def _rank_busbw(rank, world_size, sizes, repeats):
    return all_reduce_busbw(sizes, repeats)


def _g(x):
    return f"{x / 1e9:8.1f}"


def report(out=print, cpu=False):
    """Measure and print the table; return its rows as dicts (what, measured, preset, unit)."""
    if cpu or not torch.cuda.is_available():
        dev, preset, dtype = torch.device("cpu"), None, torch.float32
        shapes, repeats, copy_bytes = CPU_GEMM_SHAPES, 3, 64 << 20
        out("Hardware on this CPU (no preset to compare with: this only runs the code path).")
    else:
        dev = torch.device("cuda", 0)
        name = torch.cuda.get_device_name(dev)
        preset, dtype = preset_for(name), torch.bfloat16
        shapes, repeats, copy_bytes = GEMM_SHAPES, 20, 2 << 30
        out(f"Hardware of {name} against the preset "
            f"{preset.name if preset else '(none: no preset matches this GPU)'}.")
    rows = []

    def line(what, measured, predicted, unit, scale=1e9):
        rows.append(dict(what=what, measured=measured, preset=predicted, unit=unit))
        ratio = f"{measured / predicted:6.2f}" if predicted else "     -"
        shown = f"{predicted / scale:10.1f}" if predicted else "         -"
        out(f"  {what:<38} {measured / scale:10.1f} {shown} {ratio}   {unit}")

    out(f"  {'':<38} {'measured':>10} {'preset':>10} {'ratio':>6}")
    for m, n, k, flops in gemm(dev, shapes, dtype, repeats):
        predicted = (preset.peak(dtype) * preset.gemm_efficiency(m, n, k, dtype)) if preset else None
        unit, scale = ("TFLOP/s", 1e12) if dev.type == "cuda" else ("GFLOP/s", 1e9)
        line(f"GEMM {m}x{n}x{k} {str(dtype)[6:]}", flops, predicted, unit, scale)
    line("HBM copy (read + write)" if dev.type == "cuda" else "memory copy (read + write)", copy_bandwidth(dev, copy_bytes, repeats),
         preset.memory_bandwidth if preset else None, "GB/s")
    eager, graph = op_floor(dev, 1000 if dev.type == "cuda" else 200)
    line("eager op floor (x.add_(1), 1 element)", eager, preset.launch_floor if preset else None,
         "µs", 1e-6)
    if graph is not None:
        line("the same op replayed from a CUDA graph", graph,
             preset.graph_floor if preset else None, "µs", 1e-6)
    if preset is not None:
        out(f"  datasheet: {preset.peak(dtype) / 1e12:.0f} TFLOP/s {str(dtype)[6:]}, "
            f"{(preset.datasheet_memory_bandwidth or preset.memory_bandwidth) / 1e9:.0f} GB/s HBM")
    return rows


def report_all_reduce(world_size, link=None, out=print, timeout=300.0):
    """all_reduce busbw on `world_size` GPUs beside `link`'s (a hardware.Link) prediction."""
    per_rank = run(_rank_busbw, world_size, ALL_REDUCE_BYTES, 20, timeout=timeout)
    rows = []
    out(f"all_reduce on {world_size} GPUs (NCCL){' against ' + str(link) if link else ''}:")
    for nbytes, seconds, busbw in per_rank[0]:
        predicted = link.seconds("all_reduce", nbytes, world_size) if link else None
        rows.append(dict(bytes=nbytes, seconds=seconds, busbw=busbw, preset_seconds=predicted))
        extra = f"   preset {predicted * 1e6:9.1f} µs, ratio {seconds / predicted:5.2f}" \
            if predicted else ""
        out(f"  {nbytes:>12,} B  {seconds * 1e6:9.1f} µs  busbw {busbw / 1e9:7.1f} GB/s{extra}")
    return rows
