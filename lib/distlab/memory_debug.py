"""Debugging GPU memory on a machine without a GPU: what a training step allocates and frees,
what PyTorch's CUDA caching allocator makes of it, and where the peak of a pipeline sits.

On a GPU, `torch.cuda.memory._record_memory_history()` records every allocation and free of the
caching allocator, `torch.cuda.memory._dump_snapshot("snap.pickle")` saves them with the
allocator's segments, and https://pytorch.org/memory_viz draws them. A laptop has no CUDA
allocator, so the course builds the same two pieces from what it can see:

- `record_step` watches a real training step (on the `meta` device at full size, or on the CPU)
  with a TorchDispatchMode and logs every tensor storage it creates and frees, in order, each
  with the op that made it and a category (parameters, activations, gradients, optimizer
  state, temporaries): the allocation stream a GPU would see, in the order eager PyTorch
  issues it. It does not see what a library allocates outside torch (NCCL's buffers, cuBLAS's
  workspace) nor the CUDA context.
- `CachingAllocator` replays that stream through a MODEL of the caching allocator's rules
  (c10/cuda/CUDACachingAllocator.cpp, sizes from c10/core/AllocatorConfig.h, torch 2.13): sizes
  rounded to 512 bytes; requests of at most 1 MiB served from 2 MiB segments (the small pool),
  of up to 10 MiB from 20 MiB segments, larger ones from a segment of their own size rounded up
  to 2 MiB; the smallest cached free block that fits is used (best fit) and split if what is
  left is worth keeping (>= 512 bytes in the small pool, > 1 MiB in the large one); freed
  blocks merge with free neighbours of the same segment; when the device is full the allocator
  releases the segments that are entirely free and tries again, and only then raises. With
  `expandable_segments=True` each pool is one segment that grows by mapping pages (2 MiB in the
  small pool, 20 MiB in the large one) and, under pressure, unmaps every page no live block
  touches. One stream, no CUDA graphs, no `max_split_size_mb`. Its `snapshot()` has the layout
  of `torch.cuda.memory._snapshot()`, so torch's own tools read it
  (`torch.cuda._memory_viz.segsum`, `trace_plot`, and pytorch.org/memory_viz).

The allocator here is a model, run on a real step's allocation stream: it shows the mechanism
(reserved vs allocated, a fragmented segment, what expandable segments change), not the bytes a
given GPU, driver and torch build will report.
"""
import contextlib
import math

import torch

MiB = 2 ** 20
GiB = 2 ** 30

# c10/core/AllocatorConfig.h (torch 2.13): the caching allocator's size classes
MIN_BLOCK = 512                 # kMinBlockSize: every size is rounded up to a multiple of 512 B
SMALL_SIZE = 1 * MiB            # kSmallSize: the largest request served from the small pool
SMALL_BUFFER = 2 * MiB          # kSmallBuffer: a small-pool segment
MIN_LARGE_ALLOC = 10 * MiB      # kMinLargeAlloc: requests below this share a 20 MiB segment
LARGE_BUFFER = 20 * MiB         # kLargeBuffer
ROUND_LARGE = 2 * MiB           # kRoundLarge: larger requests get a segment rounded to 2 MiB

CATEGORIES = ("parameters", "optimizer state", "gradients", "activations", "temporaries")


# ---- 1. the allocation stream of a real step ---------------------------------------------------

class StepRecorder:
    """A TorchDispatchMode context that logs every storage created and freed inside it.

    `events`: [{"action": "alloc" | "free", "id", "bytes", "op", "phase"}] in order; a storage
    freed is noticed after the op during which its last tensor died (the op that made it
    unnecessary). `tensors` given at entry (the parameters) are live from the start and are
    never logged as allocations. Mark the phases with `with rec.phase("forward"): ...`."""

    def __init__(self, tensors=()):
        self._initial = [t for t in tensors if isinstance(t, torch.Tensor)]
        self.events, self.current = [], "setup"
        self.initial_bytes = 0

    @contextlib.contextmanager
    def phase(self, name):
        before, self.current = self.current, name
        try:
            yield
        finally:
            self._sweep()
            self.current = before

    def _sweep(self):
        for key, ref in list(self._refs.items()):
            if ref.expired():
                del self._refs[key]
                self.events.append({"action": "free", "id": key, "phase": self.current})

    def _see(self, t, op):
        st = t.untyped_storage()
        key = st._cdata
        ref = self._refs.get(key)
        if ref is not None and ref.expired():      # a new storage at a freed one's address
            del self._refs[key]
            self.events.append({"action": "free", "id": key, "phase": self.current})
            ref = None
        if ref is None:
            self._refs[key] = self._weak(st)
            self.events.append({"action": "alloc", "id": key, "bytes": st.nbytes(), "op": op,
                                "phase": self.current})

    def __enter__(self):
        from torch.multiprocessing.reductions import StorageWeakRef
        from torch.utils._python_dispatch import TorchDispatchMode
        from torch.utils._pytree import tree_leaves
        self._weak, self._refs, recorder = StorageWeakRef, {}, self
        for t in self._initial:
            st = t.untyped_storage()
            if st._cdata not in self._refs:
                self._refs[st._cdata] = StorageWeakRef(st)
                self.initial_bytes += st.nbytes()
        self.initial_ids = set(self._refs)

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                for t in tree_leaves(out):
                    if isinstance(t, torch.Tensor):
                        recorder._see(t, func.__name__)
                recorder._sweep()
                return out

        self._mode = Mode()
        self._mode.__enter__()
        return self

    def __exit__(self, *exc):
        self._mode.__exit__(*exc)
        self._sweep()
        return False


def categorise(events, gradients=(), optimizer_state=()):
    """Give every allocation of a StepRecorder log a category, in place; returns the log.

    gradients / optimizer_state: the ids (storage `_cdata`) of the .grad tensors after backward
    and of the optimizer's states after its step. A gradient is made in backward and outlives
    it, a state is made in the optimizer step and outlives it; activations are what the
    forward made and still held when the forward ended (what autograd saved for backward, and
    the output); everything else (what died in the phase that made it) is a temporary."""
    pending = {}
    for e in events:
        if e["action"] == "alloc":
            pending[e["id"]] = e
            e["outlived"] = True
        elif e["id"] in pending:
            a = pending.pop(e["id"])
            a["outlived"] = e["phase"] != a["phase"]
    gradients, optimizer_state = set(gradients), set(optimizer_state)
    for e in events:
        if e["action"] != "alloc":
            continue
        kept = e.pop("outlived")
        if kept and e["phase"] == "backward" and e["id"] in gradients:
            e["category"] = "gradients"
        elif kept and e["phase"] == "optimizer" and e["id"] in optimizer_state:
            e["category"] = "optimizer state"
        elif kept and e["phase"] == "forward":
            e["category"] = "activations"
        else:
            e["category"] = "temporaries"
    return events


def storage_ids(tensors):
    return {t.untyped_storage()._cdata for t in tensors if isinstance(t, torch.Tensor)}


def record_step(model, batches, loss_fn, optimizer):
    """Log the allocations of training steps: for each batch of `batches` (one per step),
    forward (model(*batch[:-1]) against the target batch[-1] with loss_fn), backward,
    optimizer.step(), zero_grad(set_to_none=True). Steps of different shapes (sequence
    lengths that vary) are what fragments a cache.

    Returns {"events", "parameters" (bytes alive before: the weights), "peak" (bytes alive at
    most, the weights included)}. Works on meta tensors: the sizes are real, nothing is
    computed."""
    params = list(model.parameters())
    rec = StepRecorder(params)
    grads, states = set(), set()
    with rec:
        for batch in batches:
            with rec.phase("forward"):
                loss = loss_fn(model(*batch[:-1]), batch[-1])
            with rec.phase("backward"):
                loss.backward()
                del loss
            grads |= storage_ids(p.grad for p in params if p.grad is not None)
            with rec.phase("optimizer"):
                optimizer.step()
            states |= storage_ids(v for s in optimizer.state.values() for v in s.values())
            with rec.phase("zero_grad"):
                optimizer.zero_grad(set_to_none=True)
    categorise(rec.events, grads, states)
    live = live_bytes(rec.events, rec.initial_bytes)
    return {"events": rec.events, "parameters": rec.initial_bytes,
            "peak": max(sum(row.values()) for row in live)}


def live_bytes(events, parameters=0):
    """After each event, the bytes alive by category: [{category: bytes}], parameters first."""
    live, sizes, rows = {c: 0 for c in CATEGORIES}, {}, []
    live["parameters"] = parameters
    for e in events:
        if e["action"] == "alloc":
            sizes[e["id"]] = (e["bytes"], e["category"])
            live[e["category"]] += e["bytes"]
        elif e["id"] in sizes:
            n, c = sizes.pop(e["id"])
            live[c] -= n
        rows.append(dict(live))
    return rows


# ---- 2. the caching allocator, modelled -------------------------------------------------------

class OutOfMemory(RuntimeError):
    """What torch.OutOfMemoryError says, from the model's numbers."""


def round_size(nbytes):
    """The block size a request gets (every block a multiple of 512 bytes, at least 512)."""
    return max(MIN_BLOCK, MIN_BLOCK * math.ceil(nbytes / MIN_BLOCK))


def segment_size(size):
    """How much the allocator asks cudaMalloc for when no cached block fits
    (get_allocation_size)."""
    if size <= SMALL_SIZE:
        return SMALL_BUFFER
    if size < MIN_LARGE_ALLOC:
        return LARGE_BUFFER
    return ROUND_LARGE * math.ceil(size / ROUND_LARGE)


def fmt(nbytes):
    """Bytes as the OOM message prints them: 170.00 MiB, 22.30 GiB."""
    for unit, scale in (("GiB", GiB), ("MiB", MiB), ("KiB", 1024)):
        if nbytes >= scale:
            return f"{nbytes / scale:.2f} {unit}"
    return f"{nbytes} bytes"


class CachingAllocator:
    """A model of PyTorch's CUDA caching allocator on one device and one stream (module doc).

    `capacity`: the device's bytes available to PyTorch. `malloc(nbytes)` returns a handle (the
    block's address), `free(handle)` gives it back; `.allocated` / `.reserved` are what
    torch.cuda.memory_allocated / memory_reserved would say (allocated counts rounded blocks),
    `.peak_allocated` / `.peak_reserved` their maxima. A request that cannot be met raises
    OutOfMemory with torch's sentence."""

    def __init__(self, capacity, expandable_segments=False):
        self.capacity, self.expandable = capacity, expandable_segments
        self.segments = []          # {"address", "size", "pool", "blocks": [[addr, size, req]]}
        self.live = {}              # address -> (segment, block)
        self.allocated = self.reserved = self.peak_allocated = self.peak_reserved = 0
        self.requested = 0
        self.trace = []             # torch's device_traces entries
        self._next_address = 1 << 40
        self.ooms = 0

    # -- segments ---------------------------------------------------------------------------
    def _new_segment(self, size, pool):
        seg = {"address": self._next_address, "size": size, "pool": pool,
               "blocks": [[self._next_address, size, 0]],   # [address, size, requested or 0]
               "mapped": set()}
        self._next_address += size + (1 << 30)
        self.segments.append(seg)
        return seg

    def _pages(self, seg, start, size):
        page = SMALL_BUFFER if seg["pool"] == "small" else LARGE_BUFFER
        first = (start - seg["address"]) // page
        last = (start + size - 1 - seg["address"]) // page
        return set(range(first, last + 1)), page

    def _release_cached(self):
        """What the allocator does before it gives up: free every wholly free segment
        (release_cached_blocks), or with expandable segments unmap every free page."""
        if self.expandable:
            for seg in self.segments:
                used = set()
                for addr, size, req in seg["blocks"]:
                    if req:
                        used |= self._pages(seg, addr, size)[0]
                page = SMALL_BUFFER if seg["pool"] == "small" else LARGE_BUFFER
                gone = seg["mapped"] - used
                seg["mapped"] = used
                self.reserved -= len(gone) * page
                for _ in gone:
                    self.trace.append({"action": "segment_unmap", "addr": seg["address"],
                                       "size": page, "stream": 0, "frames": []})
            return
        keep = []
        for seg in self.segments:
            if len(seg["blocks"]) == 1 and not seg["blocks"][0][2]:
                self.reserved -= seg["size"]
                self.trace.append({"action": "segment_free", "addr": seg["address"],
                                   "size": seg["size"], "stream": 0, "frames": []})
            else:
                keep.append(seg)
        self.segments = keep

    # -- malloc / free ----------------------------------------------------------------------
    def _best_fit(self, size, pool):
        best = None
        for seg in self.segments:
            if seg["pool"] != pool:
                continue
            for i, (addr, bsize, req) in enumerate(seg["blocks"]):
                if not req and bsize >= size and (best is None or (bsize, addr) < best[0]):
                    best = ((bsize, addr), seg, i)
        return best

    def _grow_cost(self, seg, addr, size):
        """Bytes of new pages an expandable segment must map to hold [addr, addr + size)."""
        pages, page = self._pages(seg, addr, size)
        return len(pages - seg["mapped"]) * page, pages

    def malloc(self, nbytes, name=""):
        size = round_size(nbytes)
        pool = "small" if size <= SMALL_SIZE else "large"
        for attempt in (0, 1):
            if self.expandable:
                got = self._malloc_expandable(size, pool)
            else:
                got = self._malloc_cached(size, pool)
            if got is not None:
                seg, i = got
                return self._take(seg, i, size, nbytes, name)
            if attempt == 0:
                self._release_cached()
        self.ooms += 1
        self.trace.append({"action": "oom", "addr": 0, "size": size, "stream": 0, "frames": [],
                           "device_free": self.capacity - self.reserved})
        raise OutOfMemory(self.oom_message(size))

    def _malloc_cached(self, size, pool):
        best = self._best_fit(size, pool)
        if best is not None:
            return best[1], best[2]
        want = segment_size(size)
        if self.reserved + want > self.capacity:
            return None
        seg = self._new_segment(want, pool)
        self.reserved += want
        self.trace.append({"action": "segment_alloc", "addr": seg["address"], "size": want,
                           "stream": 0, "frames": []})
        return seg, 0

    def _malloc_expandable(self, size, pool):
        seg = next((s for s in self.segments if s["pool"] == pool), None)
        if seg is None:     # one segment per pool, of a virtual size nothing fills (1 TiB)
            seg = self._new_segment(1 << 40, pool)
        # the free range that costs the fewest new pages (then the smallest, as best fit does)
        options = []
        for i, (addr, bsize, req) in enumerate(seg["blocks"]):
            if not req and bsize >= size:
                cost, _ = self._grow_cost(seg, addr, size)
                options.append((cost, bsize, addr, i))
        cost, _, addr, i = min(options)
        if self.reserved + cost > self.capacity:
            return None
        pages, page = self._pages(seg, addr, size)
        for _ in pages - seg["mapped"]:
            self.trace.append({"action": "segment_map", "addr": seg["address"], "size": page,
                               "stream": 0, "frames": []})
        seg["mapped"] |= pages
        self.reserved += cost
        return seg, i

    def _take(self, seg, i, size, nbytes, name):
        addr, bsize, _ = seg["blocks"][i]
        rest = bsize - size
        split = rest >= MIN_BLOCK if seg["pool"] == "small" else rest > SMALL_SIZE
        if self.expandable:
            split = rest > 0    # one contiguous range: what is left stays a free range
        if split:
            seg["blocks"][i:i + 1] = [[addr, size, nbytes], [addr + size, rest, 0]]
        else:
            size = bsize
            seg["blocks"][i] = [addr, size, nbytes]
        self.live[addr] = (seg, name)
        self.allocated += size
        self.requested += nbytes
        self.peak_allocated = max(self.peak_allocated, self.allocated)
        self.peak_reserved = max(self.peak_reserved, self.reserved)
        self.trace.append({"action": "alloc", "addr": addr, "size": size, "stream": 0,
                           "frames": [{"filename": name or "?", "line": 0, "name": name or "?"}]})
        return addr

    def free(self, addr):
        seg, _ = self.live.pop(addr)
        blocks = seg["blocks"]
        i = next(j for j, b in enumerate(blocks) if b[0] == addr)
        size, req = blocks[i][1], blocks[i][2]
        self.allocated -= size
        self.requested -= req
        self.trace.append({"action": "free_requested", "addr": addr, "size": size, "stream": 0,
                           "frames": []})
        self.trace.append({"action": "free_completed", "addr": addr, "size": size, "stream": 0,
                           "frames": []})
        blocks[i][2] = 0
        # merge with free neighbours of the same segment
        if i + 1 < len(blocks) and not blocks[i + 1][2]:
            blocks[i][1] += blocks.pop(i + 1)[1]
        if i > 0 and not blocks[i - 1][2]:
            blocks[i - 1][1] += blocks.pop(i)[1]

    # -- what torch reports -----------------------------------------------------------------
    def oom_message(self, size):
        """torch's OutOfMemoryError text (torch >= 2.2), from the model's own numbers."""
        free = self.capacity - self.reserved
        return (f"CUDA out of memory. Tried to allocate {fmt(size)}. GPU 0 has a total capacity "
                f"of {fmt(self.capacity)} of which {fmt(free)} is free. Of the allocated memory "
                f"{fmt(self.allocated)} is allocated by PyTorch, and "
                f"{fmt(self.reserved - self.allocated)} is reserved by PyTorch but unallocated. "
                f"If reserved but unallocated memory is large try setting "
                f"PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid fragmentation.")

    def snapshot(self):
        """The allocator's state in the layout of torch.cuda.memory._snapshot(): "segments"
        (each with its blocks: active_allocated or inactive) and "device_traces"."""
        pieces = []             # (address, size, blocks, pool) of each segment as torch lists it
        for seg in self.segments:
            if not self.expandable:
                pieces.append((seg["address"], seg["size"], seg["blocks"], seg["pool"]))
                continue
            # an expandable segment: each run of mapped pages, its blocks clipped to the run
            page = SMALL_BUFFER if seg["pool"] == "small" else LARGE_BUFFER
            pages = sorted(seg["mapped"])
            runs = []
            for k in pages:
                if runs and runs[-1][1] == k - 1:
                    runs[-1][1] = k
                else:
                    runs.append([k, k])
            for first, last in runs:
                start = seg["address"] + first * page
                end = seg["address"] + (last + 1) * page
                clipped = [[max(a, start), min(a + s, end) - max(a, start), r]
                           for a, s, r in seg["blocks"] if a < end and a + s > start]
                pieces.append((start, end - start, clipped, seg["pool"]))
        segments = []
        for address, total, blocks, pool in pieces:
            out = [{"address": a, "size": s, "requested_size": r or s,
                    "state": "active_allocated" if r else "inactive",
                    "frames": [{"filename": self.live[a][1] or "?", "line": 0,
                                "name": self.live[a][1] or "?"}] if r else []}
                   for a, s, r in blocks]
            segments.append({"device": 0, "address": address, "total_size": total,
                             "stream": 0, "segment_type": pool,
                             "allocated_size": sum(b["size"] for b in out
                                                   if b["state"] == "active_allocated"),
                             "active_size": sum(b["size"] for b in out
                                                if b["state"] == "active_allocated"),
                             "requested_size": sum(b["requested_size"] for b in out
                                                   if b["state"] == "active_allocated"),
                             "expandable": self.expandable, "blocks": out})
        return {"segments": segments, "device_traces": [list(self.trace)]}

    def free_in_segments(self):
        """Bytes reserved but not allocated, and the largest free block among them: when a
        request is larger than that block, it cannot be served from the cache."""
        largest = 0
        for seg in self.snapshot()["segments"]:
            for b in seg["blocks"]:
                if b["state"] == "inactive":
                    largest = max(largest, b["size"])
        return self.reserved - self.allocated, largest


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
    from .pipeline_schedules import one_f_one_b, peak_in_flight
    in_flight = [peak_in_flight(actions) for actions in one_f_one_b(p, m)]
    acts = [k * activation_bytes_per_microbatch for k in in_flight]
    return {"in_flight": in_flight, "activations": acts,
            "peak": [a + state_bytes_per_stage for a in acts]}


def mlp_stack(hidden, layers, dtype=torch.bfloat16):
    """Chapter 11's real-size step (debug.step_times): `layers` blocks hidden -> 4·hidden ->
    hidden with GELU, in `dtype`; build it under `with torch.device("meta"):`."""
    return torch.nn.Sequential(*[m for _ in range(layers) for m in (
        torch.nn.Linear(hidden, 4 * hidden), torch.nn.GELU(),
        torch.nn.Linear(4 * hidden, hidden))]).to(dtype)
