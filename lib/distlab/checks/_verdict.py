"""A check's verdict: passed, or CheckFailed with the first difference in one sentence."""
import math
import numbers

import torch


class CheckFailed(AssertionError):
    """The learner's answer differs from the reference; the message says where."""


class UsedCourseCode(CheckFailed):
    """The learner's function called the course's implementation instead of writing its own.
    A CheckFailed, so every refusal reaches the learner as a check's one sentence, however the
    checker called the learner (in this process or on ranks)."""


def passed(message):
    print(f"✅ {message}")


def first_difference(got, expected, atol=1e-6, rtol=1e-5, path=""):
    """None when `got` matches `expected`, else a phrase like 'element [3]: expected 6.0, got 3.0'."""
    where = f"element {path}" if path else "the value"
    if isinstance(expected, torch.Tensor):
        if not isinstance(got, torch.Tensor):
            return f"{where}: expected a tensor, got {type(got).__name__} {got!r}"
        if tuple(got.shape) != tuple(expected.shape):
            return f"{where}: expected shape {tuple(expected.shape)}, got {tuple(got.shape)}"
        g, e = got.detach().double(), expected.detach().double()
        bad = ~torch.isclose(g, e, atol=atol, rtol=rtol, equal_nan=True)
        if bad.any():
            index = tuple(int(i) for i in bad.nonzero()[0])
            label = f"{path}[{', '.join(map(str, index))}]" if index else path
            return f"element {label or '[]'}: " + _expected_got(e[index].item(), g[index].item())
        return None
    if isinstance(expected, (list, tuple)):
        if not isinstance(got, (list, tuple)):
            return f"{where}: expected a {type(expected).__name__}, got {type(got).__name__} {got!r}"
        if len(got) != len(expected):
            return f"{where}: expected {len(expected)} items, got {len(got)}"
        for i, (g, e) in enumerate(zip(got, expected)):
            found = first_difference(g, e, atol, rtol, f"{path}[{i}]")
            if found:
                return found
        return None
    if isinstance(expected, dict):
        if not isinstance(got, dict) or set(got) != set(expected):
            return f"{where}: expected keys {sorted(expected)}, got {got!r}"
        for k in expected:
            found = first_difference(got[k], expected[k], atol, rtol, f"{path}[{k!r}]")
            if found:
                return found
        return None
    if isinstance(expected, numbers.Real) and not isinstance(expected, bool):
        if isinstance(got, torch.Tensor) and got.numel() == 1:
            got = got.item()
        if not isinstance(got, numbers.Real) or isinstance(got, bool):
            return f"{where}: expected a number ({_fmt(expected)}), got {type(got).__name__} {got!r}"
        if not math.isclose(got, expected, rel_tol=rtol, abs_tol=atol):
            return f"{where}: " + _expected_got(expected, got)
        return None
    if got != expected:
        return f"{where}: expected {expected!r}, got {got!r}"
    return None


def _expected_got(expected, got):
    # Enough digits to see the difference: close values look identical at 6 digits.
    for digits in (6, 10, 17):
        e, g = f"{expected:.{digits}g}", f"{got:.{digits}g}"
        if e != g:
            break
    return f"expected {e}, got {g}"


def _fmt(x):
    return f"{x:.6g}" if isinstance(x, float) else repr(x)


def compare(got, expected, context, atol=1e-6, rtol=1e-5):
    """Raise CheckFailed('<context>, element [i]: expected .., got ..') when they differ."""
    found = first_difference(got, expected, atol, rtol)
    if found:
        if found.startswith("the value: "):
            raise CheckFailed(f"{context}: {found[len('the value: '):]}.")
        raise CheckFailed(f"{context}, {found}.")


def sizes_phrase(sizes):
    sizes = list(sizes)
    return ", ".join(map(str, sizes[:-1])) + f" and {sizes[-1]}" if len(sizes) > 1 else str(sizes[0])
