"""Workbook 06, exercise 3: the peak of a ZeRO-3 step that does not reshard after forward."""
import math

from .. import CheckFailed, call_learner, forbid, passed

# ---- exercise 3: the peak of ZeRO-3 without resharding after forward ---------------------------
#
# Chapter 06's zero3_peak frees each unit's gathered weights after its forward and gathers them
# again for its backward. FSDP2's reshard_after_forward=False keeps them from the unit's forward
# to the end of its backward (no second gather, more memory). The learner writes that step's
# peak, and which moment sets it; the checker compares with its own walk of the moments on
# cases where the peak falls at the turn, at the last unit's backward or at an earlier, smaller
# unit's (gradients in float32 against bf16 weights), at world sizes 2, 3 and 5, with prefetch
# on and off — no constant and no "largest unit" rule matches them all.

def _unit(w, g, a):
    return {"weights": float(w), "grad": float(g), "acts": float(a)}


# (units, world_size, states, flowing, loss, prefetch)
NO_RESHARD_CASES = [
    ([_unit(10, 10, 4), _unit(10, 10, 4), _unit(10, 10, 4)], 2, 100, 1, 30, False),
    ([_unit(10, 10, 4), _unit(10, 10, 4), _unit(10, 10, 4)], 2, 100, 1, 2, True),
    ([_unit(4, 40, 1), _unit(30, 6, 1), _unit(2, 4, 1)], 3, 50, 0.5, 1, False),
    ([_unit(6, 12, 2), _unit(1, 90, 0.5), _unit(8, 16, 3), _unit(2, 4, 1)], 5, 70, 1, 3, True),
    ([_unit(20, 40, 8), _unit(5, 10, 2), _unit(20, 40, 8), _unit(5, 10, 2)], 3, 0, 2, 5, False),
    ([_unit(3, 6, 30), _unit(3, 6, 30), _unit(3, 6, 30)], 5, 10, 4, 50, True),
    ([_unit(8, 8, 1)], 5, 20, 1, 4, False),
    ([_unit(2, 60, 1), _unit(9, 18, 1), _unit(9, 18, 1), _unit(9, 18, 1)], 2, 40, 1, 1, True),
]


def _no_reshard_moments(units, world_size, states, flowing, loss, prefetch):
    """{moment: bytes}: forward i, the turn, backward i (at its reduce-scatter)."""
    n = len(units)
    w = [u["weights"] for u in units]
    a = [u["acts"] for u in units]
    out = {}
    for i in range(n):
        ahead = w[i + 1] if prefetch and i + 1 < n else 0.0
        out[("forward", i)] = states + sum(a[:i + 1]) + sum(w[:i + 1]) + ahead
    out[("turn", None)] = states + sum(a) + sum(w) + loss + flowing
    for i in reversed(range(n)):
        shards = sum(u["grad"] for u in units[i:]) / world_size
        out[("backward", i)] = (states + shards + sum(a[:i]) + sum(w[:i + 1]) + units[i]["grad"]
                                + flowing * (2 if i > 0 else 1))
    return out


def _moment_name(key):
    return "the turn" if key[0] == "turn" else f"unit {key[1]}'s {key[0]}"


def check_no_reshard_peak(fn):
    """fn(units, world_size, states, flowing, loss, prefetch) -> {"peak": bytes, "unit": the
    index of the unit whose backward sets the peak, or None for the turn}."""
    from ... import zero_memory
    name = getattr(fn, "__name__", "no_reshard_peak")
    if not callable(fn):
        raise TypeError(f"the check needs your function, e.g. check_no_reshard_peak({name}); "
                        f"got {fn!r}.")
    for units, ws, states, flowing, loss, prefetch in NO_RESHARD_CASES:
        moments = _no_reshard_moments(units, ws, states, flowing, loss, prefetch)
        peak = max(moments.values())
        where = (f"{name}({len(units)} units, world_size={ws}, prefetch={prefetch})")
        with forbid(zero_memory.zero3_peak, zero_memory.llama_zero3_peak,
                    exercise="write the count yourself"):
            got = call_learner(fn, [dict(u) for u in units], ws, states, flowing, loss, prefetch,
                               name=name)
        if not isinstance(got, dict) or not {"peak", "unit"} <= set(got):
            raise CheckFailed(f"{name} should return a dict with the keys 'peak' (bytes) and "
                              f"'unit' (the unit whose backward sets it, or None for the turn); "
                              f"got {got!r}.")
        try:
            value = float(got["peak"])
        except (TypeError, ValueError):
            raise CheckFailed(f"{where}['peak'] should be a number of bytes; got "
                              f"{got['peak']!r}.") from None
        best = max(moments, key=moments.get)
        if not math.isclose(value, peak, rel_tol=1e-9, abs_tol=1e-9):
            unit_i = best[1] if best[0] == "backward" else None
            hint = ("every unit's weights are still gathered there, since none was freed after "
                    "its forward" if best[0] == "turn" else
                    f"at that moment units 0..{unit_i} still hold their gathered weights (a "
                    f"unit frees them only after its own backward), unit {unit_i}'s full "
                    f"gradient exists beside the shards of units {unit_i}..{len(units) - 1}")
            raise CheckFailed(f"{where}: your peak is {value:,.6g} B, the step's is {peak:,.6g} B "
                              f"at {_moment_name(best)}: {hint}.")
        said = got["unit"]
        key = ("turn", None) if said is None else ("backward", said)
        if key not in moments or not math.isclose(moments[key], peak, rel_tol=1e-9,
                                                  abs_tol=1e-9):
            at = (f"{moments[key]:,.6g} B" if key in moments else "no such moment")
            place = "the turn" if said is None else f"unit {said!r}'s backward"
            raise CheckFailed(f"{where}: the peak is right but you place it at {place} ({at}); "
                              f"it is at {_moment_name(best)}.")
    passed(f"{name} finds the peak of ZeRO-3 without resharding after forward, and the moment "
           f"that sets it, on {len(NO_RESHARD_CASES)} steps (world sizes 2, 3 and 5, prefetch on "
           f"and off; peaks at the turn, at the last unit's backward and at an earlier one's).")
