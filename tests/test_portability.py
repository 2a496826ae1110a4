"""Stored outputs that read the same on every machine.

Instructors run nbval on CPUs we do not choose (AVX2 or AVX-512, MKL or OpenBLAS); a stored
output that prints the round-off digits of a difference (3.0e-08 here, 6.0e-08 there) fails on
the next machine. Two guards:
- a static one: no stored output outside an `# NBVAL_IGNORE_OUTPUT` cell prints a float at
  round-off scale or with more significant digits than float64 keeps across machines;
- a dynamic one: `make test-portable` re-runs nbval under `tests/perturbed.env`; the test below
  shows that environment really changes the last bits here, so a green run under it means
  something.
"""
import glob
import os
import re
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
PERTURBED = ROOT / "tests" / "perturbed.env"

SCIENTIFIC = re.compile(r"(?<![\w.])[-+]?(\d+(?:\.\d+)?)[eE]([-+]?\d+)(?![\w.])")
DECIMAL = re.compile(r"(?<![\w.eE+-])[-+]?(\d+)\.(\d+)(?![\w.])")
TINY = 1e-6           # below this, a printed value is round-off (or a tolerance, see below)
MAX_SIGNIFICANT = 12  # float64 keeps ~16; a few ulps of round-off reach the 13th digit


def perturbed_env():
    """{name: value} of tests/perturbed.env (the Makefile reads the same file)."""
    pairs = (line.split("=", 1) for line in PERTURBED.read_text().splitlines()
             if line.strip() and not line.lstrip().startswith("#"))
    return {k.strip(): v.strip() for k, v in pairs}


def roundoff_in(text):
    """The numbers in `text` that only round-off could have printed."""
    found = []
    for m in SCIENTIFIC.finditer(text):
        mantissa, value = float(m.group(1)), float(m.group(0))
        # a stated tolerance is a power of ten ("within 1e-12"); anything else this small,
        # exact zero included ("0e+00": another CPU prints 4e-16), is a printed difference
        if abs(value) < TINY and mantissa != 1.0:
            found.append(m.group(0))
    for m in DECIMAL.finditer(text):
        digits = (m.group(1) + m.group(2)).lstrip("0")
        if len(digits) > MAX_SIGNIFICANT:
            found.append(m.group(0))
        elif 0 < abs(float(m.group(0))) < TINY:
            found.append(m.group(0))
    return found


def output_texts(cell):
    for out in cell.get("outputs", []):
        if out.output_type == "stream":
            yield out.text
        elif out.output_type in ("execute_result", "display_data"):
            yield out.get("data", {}).get("text/plain", "")


def offenders(path):
    nb = nbformat.read(path, as_version=4)
    code_cell = -1
    for index, cell in enumerate(nb.cells):
        if cell.cell_type != "code":
            continue
        code_cell += 1
        if "NBVAL_IGNORE_OUTPUT" in cell.source or "NBVAL_SKIP" in cell.source:
            continue
        for text in output_texts(cell):
            for line in text.splitlines():
                numbers = roundoff_in(line)
                if numbers:
                    yield (f"{Path(path).relative_to(ROOT)} cell {index} (nbval's Cell "
                           f"{code_cell}): prints {', '.join(numbers)} in {line.strip()[:100]!r}")


NOTEBOOKS = sorted(glob.glob(str(ROOT / "notebooks" / "*.ipynb"))
                   + glob.glob(str(ROOT / "solutions" / "*.ipynb"))
                   + glob.glob(str(ROOT / "exercises" / "*.ipynb")))


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: Path(p).relative_to(ROOT).as_posix())
def test_no_roundoff_in_stored_outputs(path):
    found = list(offenders(path))
    assert not found, (
        "stored outputs print round-off digits, which another CPU prints differently; print a "
        "verdict against a tolerance (distlab.agreement) or mark the cell NBVAL_IGNORE_OUTPUT:\n"
        + "\n".join(found))


def test_the_guard_sees_roundoff_and_lets_verdicts_pass():
    assert roundoff_in("largest gradient difference 3.0e-08") == ["3.0e-08"]
    assert roundoff_in("3   3.5782049741   3.5782049741   0e+00") == ["0e+00"]
    assert roundoff_in("max |difference| = 4.4e-16") == ["4.4e-16"]
    assert roundoff_in("loss 3.641291646512345") == ["3.641291646512345"]
    assert roundoff_in("difference 0.00000003") == ["0.00000003"]
    assert roundoff_in("equal within 1e-12: True") == []
    assert roundoff_in("NOT within 1e-06 (differs by 2.1e-01)") == []
    assert roundoff_in("losses [0.438135, 0.418281] step 3.6412916465, 1.5e+09 FLOP/s") == []


# A few float computations whose last bits depend on the kernels' reduction order and blocking.
_PROBE = """
import torch
g = torch.Generator().manual_seed(0)
a = torch.randn(4099, generator=g)
m = torch.randn(96, 257, dtype=torch.float64, generator=g)
print(repr(a.sum().item()), repr(a.softmax(0).max().item()), repr((m @ m.T).sum().item()),
      repr(torch.nn.functional.layer_norm(m, (257,)).pow(2).sum().item()))
"""


def _probe(extra_env):
    env = {**os.environ, **extra_env}
    out = subprocess.run([sys.executable, "-c", _PROBE], env=env, capture_output=True, text=True,
                         timeout=120, check=True)
    return out.stdout.split()


@pytest.mark.skipif(torch.backends.cpu.get_cpu_capability() == "DEFAULT",
                    reason="this CPU already runs ATen's scalar kernels: nothing to perturb")
def test_the_perturbed_environment_changes_the_last_bits():
    plain, perturbed = _probe({}), _probe(perturbed_env())
    assert plain != perturbed, (
        f"{PERTURBED.name} no longer changes float round-off on this machine ({plain}); "
        "`make test-portable` would then prove nothing: choose variables that do")
    # the same values to well within round-off: only the last bits moved
    for p, q in zip(plain, perturbed):
        assert abs(float(p) - float(q)) <= 1e-4 * max(1.0, abs(float(p)))


# What the chapters run in bf16 (chapter 06's Llama block: grouped-query flash attention, with
# its backward) must also run under the perturbed environment, or test-portable fails on the
# environment rather than on an output: on an AMX/AVX-512 CPU, capping ATen alone makes torch's
# bf16 flash attention refuse to pack ("pack_vnni2 is only supported when avx512 is supported").
_BF16_ATTENTION = """
import torch, torch.nn.functional as F
q = torch.randn(1, 4, 128, 16, dtype=torch.bfloat16, requires_grad=True)
k, v = (torch.randn(1, 2, 128, 16, dtype=torch.bfloat16) for _ in range(2))
F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True).sum().backward()
print("ok")
"""


def test_the_perturbed_environment_runs_bf16_attention():
    env = {**os.environ, **perturbed_env()}
    out = subprocess.run([sys.executable, "-c", _BF16_ATTENTION], env=env, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.split() == ["ok"], (
        f"bf16 flash attention fails under {PERTURBED.name}: {out.stderr[-600:]}")
