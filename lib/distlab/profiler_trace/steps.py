"""A GPU job's steps: the kernels each `ProfilerStep#N` and each `## forward/backward/optimizer ##`
range launched, as Kineto projects record_function ranges onto the GPU.

Kineto's own `gpu_user_annotation` events cover only what the annotating thread launched: the
backward's kernels are launched by autograd's thread, so its `## backward ##` covers under 1 ms of
a 100 ms backward. Projected here instead: a range's kernels are those whose launching runtime
call (matched by correlation id) started inside the range, on any thread.
"""
GPU = ("kernel", "gpu_memcpy", "gpu_memset")
PHASES = ("## forward ##", "## backward ##", "## optimizer ##")


def projected_phases(doc):
    """[{"step", "name", "ts", "dur", "kernels", "pid", "tid"}]: each phase of each ProfilerStep
    of the Kineto document `doc`, spanning the GPU events its CPU range launched (µs, the file's
    clock), in time order. A phase that launched nothing is left out."""
    events = [e for e in doc.get("traceEvents", []) if isinstance(e, dict)]
    gpu = [e for e in events if e.get("cat") in GPU and e.get("ph") == "X"]
    launch = {(e.get("args") or {}).get("correlation"): e["ts"] for e in events
              if e.get("cat") == "cuda_runtime" and "correlation" in (e.get("args") or {})}
    steps = [e for e in events if e.get("cat") == "user_annotation"
             and str(e.get("name", "")).startswith("ProfilerStep")]
    # A phase name appears twice per step (main and autograd threads): keep the longest.
    longest = {}
    for e in events:
        if e.get("cat") != "user_annotation" or e.get("name") not in PHASES:
            continue
        step = next((s["name"] for s in steps if s["ts"] <= e["ts"] < s["ts"] + s["dur"]), None)
        key = (step, e["name"])
        if step is not None and (key not in longest or e["dur"] > longest[key]["dur"]):
            longest[key] = e
    out = []
    for (step, name), r in sorted(longest.items(), key=lambda kv: kv[1]["ts"]):
        mine = [k for k in gpu if r["ts"] <= launch.get((k.get("args") or {}).get("correlation"),
                                                        -1) < r["ts"] + r["dur"]]
        if mine:
            start = min(k["ts"] for k in mine)
            end = max(k["ts"] + k["dur"] for k in mine)
            out.append(dict(step=step, name=name, ts=start, dur=end - start, kernels=len(mine),
                            pid=mine[0]["pid"], tid=mine[0]["tid"]))
    return out


def step_ranges(doc):
    """The CPU ProfilerStep ranges and the phases kept of them, for `tools/extract_gpu_trace.py`:
    the longest range of each (step, name)."""
    events = [e for e in doc.get("traceEvents", []) if isinstance(e, dict)]
    ranges = [e for e in events if e.get("cat") == "user_annotation"
              and (str(e.get("name", "")).startswith("ProfilerStep") or e.get("name") in PHASES)]
    steps = [e for e in ranges if e["name"].startswith("ProfilerStep")]
    longest = {}
    for e in ranges:
        step = next((s["name"] for s in steps if s["ts"] <= e["ts"] < s["ts"] + s["dur"]), None)
        key = (step, e["name"])
        if key not in longest or e["dur"] > longest[key]["dur"]:
            longest[key] = e
    return sorted(longest.values(), key=lambda e: e["ts"])
