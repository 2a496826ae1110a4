"""Replaying a recorded step through the allocator model, and sizing: the smallest device a
stream runs on, the most bytes alive at once, and where a 1F1B pipeline's peak sits."""
import math

from .allocator import ROUND_LARGE, CachingAllocator, OutOfMemory


def replay(events, capacity, expandable_segments=False, parameters=()):
    """Run a recorded allocation stream through a CachingAllocator of `capacity` bytes.

    parameters: sizes of the tensors alive before the stream (allocated first, in order).
    Returns {"allocator", "allocated", "reserved" (per event, bytes), "oom" (the message, or
    None), "at" (the event index of the OOM)}."""
    alloc = CachingAllocator(capacity, expandable_segments)
    where, allocated, reserved = {}, [], []
    try:
        for i, n in enumerate(parameters):
            alloc.malloc(n, "parameter")
        for k, e in enumerate(events):
            if e["action"] == "alloc":
                where[e["id"]] = alloc.malloc(e["bytes"], f"{e.get('category', '?')}: {e['op']}")
            elif e["id"] in where:
                alloc.free(where.pop(e["id"]))
            allocated.append(alloc.allocated)
            reserved.append(alloc.reserved)
    except OutOfMemory as oom:
        return {"allocator": alloc, "allocated": allocated, "reserved": reserved,
                "oom": str(oom), "at": len(allocated)}
    return {"allocator": alloc, "allocated": allocated, "reserved": reserved, "oom": None,
            "at": None}


def smallest_device(events, expandable_segments=False, parameters=(), step=ROUND_LARGE):
    """The smallest capacity (a multiple of `step` bytes) on which the stream runs without an
    OutOfMemory under the allocator model: bisection between the peak of the bytes requested
    (no allocator can do with less) and a capacity that holds every segment ever made."""
    need = max(live_total(events, sum(parameters)), 1)
    lo = step * (need // step)                     # fails or is exact
    hi = step * math.ceil(2 * need / step) + 64 * step
    while replay(events, hi, expandable_segments, parameters)["oom"]:
        hi *= 2
    while hi - lo > step:
        mid = step * ((lo + hi) // (2 * step))
        if replay(events, mid, expandable_segments, parameters)["oom"]:
            lo = mid
        else:
            hi = mid
    return hi


def live_total(events, start=0):
    """The most bytes alive at once in a recorded stream (`start`: alive before it)."""
    sizes, live, peak = {}, start, start
    for e in events:
        if e["action"] == "alloc":
            sizes[e["id"]] = e["bytes"]
            live += e["bytes"]
            peak = max(peak, live)
        elif e["id"] in sizes:
            live -= sizes.pop(e["id"])
    return peak


# ---- 3. where a pipeline's peak sits ---------------------------------------------------------

def pipeline_stage_peaks(p, m, activation_bytes_per_microbatch, state_bytes_per_stage):
    """{"in_flight", "activations", "peak"}: per stage of a 1F1B pipeline of p stages and m
    micro-batches, the most micro-batches whose activations the stage holds at once (counted
    from the schedule itself, pipeline_schedules.one_f_one_b), their bytes, and the stage's
    peak with its model states. Stage 0 holds min(p, m), the last stage 1."""
    from ..pipeline_schedules import one_f_one_b, peak_in_flight
    in_flight = [peak_in_flight(actions) for actions in one_f_one_b(p, m)]
    acts = [k * activation_bytes_per_microbatch for k in in_flight]
    return {"in_flight": in_flight, "activations": acts,
            "peak": [a + state_bytes_per_stage for a in acts]}

