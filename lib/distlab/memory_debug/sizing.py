"""Replaying a recorded step through the allocator model, and sizing: the smallest device a
stream runs on, the most bytes alive at once, and where a 1F1B pipeline's peak sits."""
import math

from .allocator import ROUND_LARGE, CachingAllocator, OutOfMemory, whole_bytes

SHAPE = ("each event is {'action': 'alloc', 'id', 'bytes'} or {'action': 'free', 'id'}, as "
         "record_step logs them.")


def checked_stream(events, parameters=()):
    """The stream and the parameters' sizes as lists, or the one sentence that says which event
    is malformed: a hand-made stream would otherwise fail as a KeyError deep in a replay, or
    leak a block silently when an id is allocated twice."""
    if not isinstance(events, (list, tuple)):
        raise TypeError(f"events must be a list of record_step's events (dicts), not "
                        f"{type(events).__name__}.")
    alive = {}
    for k, e in enumerate(events):
        if not isinstance(e, dict):
            raise TypeError(f"events[{k}] is a {type(e).__name__}: {SHAPE}")
        if e.get("action") not in ("alloc", "free"):
            raise ValueError(f"events[{k}] has action {e.get('action')!r}: {SHAPE}")
        if "id" not in e:
            raise ValueError(f"events[{k}] has no 'id': {SHAPE}")
        if e["action"] == "free":
            alive.pop(e["id"], None)      # frees of what was alive before the stream are fine
            continue
        if "bytes" not in e:
            raise ValueError(f"events[{k}] allocates without 'bytes': {SHAPE}")
        whole_bytes(e["bytes"], f"events[{k}]['bytes'] is {e['bytes']!r}")
        if e["id"] in alive:
            raise ValueError(f"events[{k}] allocates id {e['id']!r}, which is still alive since "
                             f"events[{alive[e['id']]}]: free it first, or give each allocation "
                             f"its own id.")
        alive[e["id"]] = k
    if isinstance(parameters, (str, bytes)) or not hasattr(parameters, "__iter__"):
        raise TypeError(f"parameters must be a list of sizes in bytes, not "
                        f"{type(parameters).__name__}.")
    sizes = [whole_bytes(n, f"parameters[{i}] is {n!r}") for i, n in enumerate(parameters)]
    return list(events), sizes


def replay(events, capacity, expandable_segments=False, parameters=()):
    """Run a recorded allocation stream through a CachingAllocator of `capacity` bytes.

    parameters: sizes of the tensors alive before the stream (allocated first, in order).
    Returns {"allocator", "allocated", "reserved" (per event, bytes), "oom" (the message, or
    None), "at" (the event index of the OOM)}."""
    events, parameters = checked_stream(events, parameters)
    alloc = CachingAllocator(capacity, expandable_segments)
    where, allocated, reserved = {}, [], []
    try:
        for i, n in enumerate(parameters):
            alloc.malloc(n, "parameter")
        for k, e in enumerate(events):
            if e["action"] == "alloc":
                where[e["id"]] = alloc.malloc(e["bytes"], f"{e.get('category', '?')}: {e.get('op', '?')}")
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
    events, parameters = checked_stream(events, parameters)
    if isinstance(step, bool) or not isinstance(step, int) or step <= 0:
        raise ValueError(f"step is {step!r} bytes: give the capacity's granularity in bytes, more "
                         f"than 0 (the default is 2 MiB).")
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
    events, _ = checked_stream(events)
    start = whole_bytes(start, f"start is {start!r}")
    sizes, live, peak = {}, start, start
    for e in events:
        if e["action"] == "alloc":
            sizes[e["id"]] = e["bytes"]
            live += e["bytes"]
            peak = max(peak, live)
        elif e["id"] in sizes:
            live -= sizes.pop(e["id"])
    return peak


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

