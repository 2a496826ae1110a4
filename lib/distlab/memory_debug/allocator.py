"""A model of PyTorch's CUDA caching allocator (c10/cuda/CUDACachingAllocator.cpp, torch 2.13),
one device and one stream: size classes and pools, best fit, splitting, merging, releasing
cached segments before giving up, expandable segments, torch's out-of-memory sentence and
the layout of torch.cuda.memory._snapshot(). The package's doc says what it leaves out."""
import numbers

MiB = 2 ** 20
GiB = 2 ** 30

# c10/core/AllocatorConfig.h (torch 2.13): the caching allocator's size classes
MIN_BLOCK = 512                 # kMinBlockSize: every size is rounded up to a multiple of 512 B
SMALL_SIZE = 1 * MiB            # kSmallSize: the largest request served from the small pool
SMALL_BUFFER = 2 * MiB          # kSmallBuffer: a small-pool segment
MIN_LARGE_ALLOC = 10 * MiB      # kMinLargeAlloc: requests below this share a 20 MiB segment
LARGE_BUFFER = 20 * MiB         # kLargeBuffer
ROUND_LARGE = 2 * MiB           # kRoundLarge: larger requests get a segment rounded to 2 MiB
ONE_EXABYTE = 2 ** 60           # NativeCachingAllocator::allocate refuses this much outright


class OutOfMemory(RuntimeError):
    """What torch.OutOfMemoryError says, from the model's numbers."""


def whole_bytes(value, what):
    """`value` as an int number of bytes, or a TypeError / ValueError whose one sentence names
    `what` (e.g. "malloc(-5)", "events[3]['bytes'] is -4") and says what to pass instead."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{what}: a size must be a whole number of bytes (an int), not "
                        f"{type(value).__name__}.")
    if value != value or value in (float("inf"), float("-inf")) or int(value) != value:
        raise ValueError(f"{what}: a size must be a whole number of bytes.")
    if value < 0:
        raise ValueError(f"{what}: a size in bytes cannot be negative; pass the tensor's nbytes "
                         f"(0 or more).")
    return int(value)


def round_size(nbytes):
    """The block size a request gets (every block a multiple of 512 bytes, at least 512)."""
    nbytes = whole_bytes(nbytes, f"round_size({nbytes!r})")
    # integer arithmetic: a float ceil would misround sizes past 2**53
    return max(MIN_BLOCK, -(-nbytes // MIN_BLOCK) * MIN_BLOCK)


def segment_size(size):
    """How much the allocator asks the driver for when no cached block fits a request of
    `size` (already rounded) bytes: get_allocation_size in c10/cuda/CUDACachingAllocator.cpp.
    This, not the request, is the size torch's out-of-memory message says it tried to
    allocate (malloc passes alloc_size to format_size): a 3 MiB tensor reports 20.00 MiB."""
    size = whole_bytes(size, f"segment_size({size!r})")
    if size <= SMALL_SIZE:
        return SMALL_BUFFER
    if size < MIN_LARGE_ALLOC:
        return LARGE_BUFFER
    return -(-size // ROUND_LARGE) * ROUND_LARGE


def fmt(nbytes):
    """Bytes as the OOM message prints them: torch's format_size (CUDACachingAllocator.cpp),
    whose thresholds are inclusive, so 1024 B prints as "1024 bytes" and 1 MiB as "1024.00 KiB"."""
    if nbytes <= 1024:
        return f"{nbytes} bytes"
    for limit, unit, scale in ((MiB, "KiB", 1024), (GiB, "MiB", MiB)):
        if nbytes <= limit:
            return f"{nbytes / scale:.2f} {unit}"
    return f"{nbytes / GiB:.2f} GiB"


class CachingAllocator:
    """A model of PyTorch's CUDA caching allocator on one device and one stream (module doc).

    `capacity`: the device's bytes available to PyTorch. `malloc(nbytes)` returns a handle (the
    block's address), `free(handle)` gives it back; `.allocated` / `.reserved` are what
    torch.cuda.memory_allocated / memory_reserved would say (allocated counts rounded blocks),
    `.peak_allocated` / `.peak_reserved` their maxima. A request that cannot be met raises
    OutOfMemory with torch's sentence."""

    def __init__(self, capacity, expandable_segments=False):
        if isinstance(capacity, bool) or not isinstance(capacity, numbers.Real):
            raise TypeError(f"capacity must be a whole number of bytes (an int), not "
                            f"{type(capacity).__name__}.")
        if capacity != capacity or capacity in (float("inf"), float("-inf")) or \
                int(capacity) != capacity:
            raise ValueError(f"capacity must be a whole number of bytes, not {capacity}.")
        if capacity <= 0:
            raise ValueError(f"capacity is {capacity} bytes: give the device's memory in bytes, "
                             f"more than 0 (e.g. 80 * 2**30).")
        if not isinstance(expandable_segments, bool):
            raise TypeError(f"expandable_segments must be True or False, not "
                            f"{expandable_segments!r}.")
        self.capacity, self.expandable = int(capacity), expandable_segments
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
        """A block for `nbytes` bytes: its address, or 0 for 0 bytes (torch's allocate(0) never
        reaches the allocator: an empty tensor holds a null pointer and no block)."""
        nbytes = whole_bytes(nbytes, f"malloc({nbytes!r})")
        if nbytes >= ONE_EXABYTE:
            raise OutOfMemory("CUDA out of memory. Tried to allocate more than 1EB memory.")
        if nbytes == 0:
            return 0
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
        raise OutOfMemory(self.oom_message(segment_size(size)))

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
        """Give back the block malloc returned at `addr`; 0 (an empty tensor's null) is a
        no-op, as freeing a null pointer is in torch."""
        if isinstance(addr, bool) or not isinstance(addr, numbers.Integral):
            raise TypeError(f"free takes the handle malloc returned (an int), not "
                            f"{type(addr).__name__}.")
        if addr == 0:
            return
        if addr not in self.live:
            raise ValueError(f"free({addr:#x}): no block malloc returned is live at that address "
                             f"(freed already, or never returned by malloc); free each handle "
                             f"once.")
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
    def oom_message(self, alloc_size):
        """torch's OutOfMemoryError text (torch >= 2.2), from the model's own numbers.
        `alloc_size`: what the allocator asked the driver for, segment_size of the rounded
        request, which is what torch reports (not the tensor's size)."""
        free = self.capacity - self.reserved
        return (f"CUDA out of memory. Tried to allocate {fmt(alloc_size)}. GPU 0 has a total capacity "
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

