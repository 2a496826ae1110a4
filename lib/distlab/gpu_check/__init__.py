"""The GPU self-check: every strategy of the course on NCCL, against the CPU reference, and
the hardware presets' GEMM, HBM, launch-floor (and all_reduce) figures measured on the GPU.

    python -m distlab.gpu_check          # or: make gpu-check
    python -m distlab.gpu_check --cpu    # the same table on gloo, 2 CPU ranks (what CI runs)

On a machine with N GPUs each check runs on N ranks, one GPU each (world size 1 on one GPU):
`distlab.run` then picks "cpu:gloo,cuda:nccl" by itself, so CUDA tensors go over NCCL and CPU
tensors over gloo. Models and tensors live on `distlab.device()` in float32 (TF32 off, so a
matmul is a float32 matmul); every rank also computes the single-process reference on the CPU in
float64 and reports the largest difference. A row passes when that difference is within float32
rounding: TOL_COLLECTIVE for the collectives, TOL_MODEL for training a few steps (losses,
gradients and parameters are of order 1). On a machine without a GPU it says so, lists what it
would run, and exits 0. The exit code is 1 when any row failed.

Timing: an NCCL call returns at once on the host (the work is queued on a CUDA stream), so a row
is timed between two `torch.cuda.synchronize()` calls, never around the calls alone. The seconds
are the slowest rank's, reference included: they say where time goes, not how fast NCCL is.

The parts: `strategies` holds one function per strategy and the table STRATEGIES; `measure`
the hardware measurements; this module the one runner that prints both tables.
"""
import argparse
import math

import torch

from ..devices import choose_backend
from ..launch import RankFailed, RunTimeout, run
from . import measure
from .strategies import STRATEGIES, Strategy, _on_rank, layout_3d, layout_4d  # noqa: F401

COLUMNS = ("strategy", "world", "backend", "device", "max error", "result", "seconds")
WIDTHS = (38, 5, 18, 10, 9, 24, 7)


def _line(cells):
    return "  ".join(str(c).ljust(w) for c, w in zip(cells, WIDTHS)).rstrip()


def _device_label(where, n):
    """"cpu", or the accelerators of the ranks: one per rank, rank r on device r."""
    if where == "cpu":
        return where
    return f"{where}:0" if n == 1 else f"{where}:0-{n - 1}"


def run_checks(world_size, backend=None, timeout=300.0, out=print, checks=None):
    """Run every strategy (default: STRATEGIES) on `world_size` ranks, print the table row by
    row; return the rows as dicts (strategy, world_size, backend, device, error, passed, seconds,
    why)."""
    out(_line(COLUMNS))
    out(_line("-" * w for w in WIDTHS))
    rows = []
    chosen = backend or choose_backend(world_size)

    def add(label, backend_, device, error, passed, seconds, why, shown):
        rows.append(dict(strategy=label, world_size=world_size, backend=backend_, device=device,
                         error=error, passed=passed, seconds=seconds, why=why))
        out(_line((label, world_size, backend_, device) + shown))

    for strategy in checks or STRATEGIES:
        labels = strategy.labels(world_size)
        if world_size < strategy.needs:
            why = f"skipped: needs {strategy.needs} GPUs"
            for label in labels:
                add(label, "-", "-", None, None, None, why, ("-", why, "-"))
            continue
        try:
            results = run(_on_rank, world_size, strategy.check, strategy.config(world_size),
                          backend=backend, timeout=timeout)
        except (RankFailed, RunTimeout) as e:
            why = str(e).splitlines()[0]
            for label in labels:
                add(label, chosen, "?", None, False, None, why, ("-", "FAILED (see below)", "-"))
            continue
        for i, (label, where, _, _) in enumerate(results[0]):
            # The worst rank's error; a NaN anywhere is the worst of all.
            error = max((r[i][2] for r in results), key=lambda e: (math.isnan(e), e))
            seconds = max(r[i][3] for r in results)
            passed = error <= strategy.tol and not math.isnan(error)
            add(label, results.backend, _device_label(where, world_size), error, passed, seconds,
                None if passed else f"error {error:.2g} > {strategy.tol:g}",
                (f"{error:.1e}", "passed" if passed else f"FAILED (> {strategy.tol:g})",
                 f"{seconds:.3f}"))
    failed = [r for r in rows if r["passed"] is False]
    passed = sum(r["passed"] is True for r in rows)
    out(f"\n{passed} of {len(rows)} passed" + (f", {len(failed)} failed:" if failed else "."))
    for r in failed:
        out(f"  {r['strategy']}: {r['why']}")
    return rows


def plan():
    """What the check would run on a machine with GPUs: one line per row."""
    lines = []
    for strategy in STRATEGIES:
        for label in strategy.rows:
            if strategy.name == "3D":
                label = "3D (dp x pp x tp), e.g. on 8 GPUs dp=%d pp=%d tp=%d" % layout_3d(8)
            elif strategy.name == "4D":
                label = "4D (dp x cp x tp), e.g. on 8 GPUs dp=%d cp=%d tp=%d" % layout_4d(8)
            lines.append(f"  {label}" + (f" (needs {strategy.needs} GPUs)"
                                         if strategy.needs > 1 else ""))
    return lines


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m distlab.gpu_check",
                                     description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--cpu", action="store_true",
                        help="run the same tables on gloo with 2 CPU ranks (no GPU needed)")
    parser.add_argument("--timeout", type=float, default=None,
                        help="seconds per row before its ranks are stopped (default 300 on "
                             "GPUs, 60 on CPUs)")
    parser.add_argument("--no-hardware", action="store_true",
                        help="skip the GEMM / HBM / launch-floor measurements")
    args = parser.parse_args(argv)
    if args.cpu:
        print("GPU self-check, CPU path: every strategy on 2 CPU ranks over gloo, float32 "
              "against a float64 single-process reference.")
        rows = run_checks(2, backend="gloo", timeout=args.timeout or 60.0)
        if not args.no_hardware:
            print()
            measure.report(cpu=True)
    elif not torch.cuda.is_available():
        print("No GPU on this machine (torch.cuda.is_available() is False), so there is nothing "
              "to check on NCCL; nothing was run.")
        print("On a machine with N GPUs it runs each of these on N ranks over NCCL "
              "('cpu:gloo,cuda:nccl'), one GPU per rank, and compares with the CPU reference:")
        print("\n".join(plan()))
        print("Then it measures GEMM efficiency, HBM bandwidth and the per-op floor (and "
              "all_reduce busbw with several GPUs) beside the preset of the GPU it finds.")
        print("`python -m distlab.gpu_check --cpu` runs the same tables on gloo with CPU ranks.")
        return 0
    else:
        n = torch.cuda.device_count()
        try:
            nccl = ".".join(map(str, torch.cuda.nccl.version()))
        except Exception:                       # a build without NCCL: the ranks use gloo
            nccl = "not available"
        print(f"GPU self-check: {n} GPU(s) ({torch.cuda.get_device_name(0)}), world size {n}, "
              f"torch {torch.__version__}, CUDA {torch.version.cuda}, NCCL {nccl}; float32 "
              f"against a float64 CPU reference, TF32 off.")
        rows = run_checks(n, timeout=args.timeout or 300.0)
        if not args.no_hardware:
            print()
            measure.report()
            if n > 1:
                from .. import hardware
                preset = measure.preset_for(torch.cuda.get_device_name(0))
                link = hardware.NVLINK4 if preset in (hardware.H100, hardware.H200) else \
                    hardware.NVLINK3 if preset is hardware.A100 else None
                measure.report_all_reduce(n, link)
    return 1 if any(r["passed"] is False for r in rows) else 0
