"""The allocator model and NaN triage under Hypothesis: random malloc/free sequences against the
caching allocator's invariants and torch's size rules, and spiking_ranks against its definition.
Pure Python, one process; derandomized so a failure reproduces on every machine."""
import math
import statistics

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from distlab import memory_debug as md
from distlab import nan_debug as nd

MiB = md.MiB
FAST = settings(max_examples=80, deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.too_slow])

# sizes from every class: small pool, the 1-10 MiB requests that share 20 MiB, larger ones
SIZES = st.one_of(st.integers(0, 2 * MiB), st.integers(MiB, 11 * MiB),
                  st.integers(10 * MiB, 48 * MiB))
# ("malloc", size) or ("free", which live handle, as a fraction of how many there are)
OPS = st.lists(st.one_of(st.tuples(st.just("malloc"), SIZES),
                         st.tuples(st.just("free"), st.floats(0, 1, exclude_max=True))),
               max_size=40)


def _run(ops, capacity, expandable):
    """Replay ops, checking after each one what must hold at every point; returns the
    allocator, the live handles, and the allocated / reserved seen after each op."""
    a = md.CachingAllocator(capacity, expandable_segments=expandable)
    live, seen = [], []
    for op, arg in ops:
        if op == "malloc":
            before, traced = a.allocated, len(a.trace)
            try:
                h = a.malloc(arg)
            except md.OutOfMemory as e:
                # torch's sentence, with what it asked the driver for; nothing was allocated
                said = md.fmt(md.segment_size(md.round_size(arg)))
                assert str(e).startswith(f"CUDA out of memory. Tried to allocate {said}. ")
                assert a.allocated == before
            else:
                live.append((h, arg))
            # a new segment is what get_allocation_size says for this request, never more
            assert all(t["size"] == md.segment_size(md.round_size(arg))
                       for t in a.trace[traced:] if t["action"] == "segment_alloc")
        elif live:
            h, _ = live.pop(int(arg * len(live)))
            a.free(h)
        assert 0 <= a.allocated <= a.reserved <= a.capacity
        seen.append((a.allocated, a.reserved))
    return a, live, seen


def _block_sizes(a):
    return {addr: b[1] for seg in a.segments for b in seg["blocks"] for addr in [b[0]] if b[2]}


@FAST
@given(OPS, st.integers(2, 160), st.booleans())
def test_random_sequences_keep_the_allocators_invariants(ops, capacity_mib, expandable):
    a, live, seen = _run(ops, capacity_mib * MiB, expandable)
    # the peaks reported are the maxima over the sequence
    assert a.peak_allocated == max((s[0] for s in seen), default=0)
    assert a.peak_reserved == max((s[1] for s in seen), default=0)
    # every live block follows the rounding rules: 512-byte multiples, split off exactly, except
    # that a large-pool block keeps a remainder of at most 1 MiB it was not worth splitting off
    sizes = _block_sizes(a)
    for h, n in live:
        if n == 0:
            assert h == 0                        # an empty tensor holds no block
            continue
        want, got = md.round_size(n), sizes[h]
        if expandable or want <= md.SMALL_SIZE:
            assert got == want
        else:
            assert want <= got <= want + md.SMALL_SIZE
    assert a.allocated == sum(sizes.values())
    # segments: 2 MiB in the small pool; 20 MiB, or a request's own size rounded to 2 MiB (at
    # least 10 MiB), in the large pool; expandable: whole pages of 2 and 20 MiB
    if expandable:
        assert a.reserved == sum(len(s["mapped"]) * (md.SMALL_BUFFER if s["pool"] == "small"
                                                     else md.LARGE_BUFFER) for s in a.segments)
    else:
        for seg in a.segments:
            if seg["pool"] == "small":
                assert seg["size"] == md.SMALL_BUFFER
            else:
                assert seg["size"] == md.LARGE_BUFFER or (
                    seg["size"] >= md.MIN_LARGE_ALLOC and seg["size"] % md.ROUND_LARGE == 0)
        assert a.reserved == sum(seg["size"] for seg in a.segments)
    # freeing everything returns allocated (and the bytes requested) to 0; the cache stays
    cached = a.reserved
    for h, _ in live:
        a.free(h)
    assert a.allocated == 0 and a.requested == 0 and a.live == {} and a.reserved == cached
    assert all(len(seg["blocks"]) == 1 for seg in a.segments)      # every segment merged back


@FAST
@given(st.lists(SIZES, max_size=30))
def test_expandable_segments_pack_a_growing_stream_at_least_as_tightly(sizes):
    # With no frees, expandable segments lay the blocks end to end: the small pool never
    # reserves more than the default's 2 MiB segments, the large pool at most one 20 MiB page
    # less 2 MiB more (a single 12 MiB tensor: a 12 MiB segment, or one 20 MiB page).
    big = 4096 * MiB
    default, expandable = md.CachingAllocator(big), md.CachingAllocator(big, True)
    for n in sizes:
        default.malloc(n)
        expandable.malloc(n)

    def per_pool(a, pool):
        if a.expandable:
            page = md.SMALL_BUFFER if pool == "small" else md.LARGE_BUFFER
            return sum(len(s["mapped"]) * page for s in a.segments if s["pool"] == pool)
        return sum(s["size"] for s in a.segments if s["pool"] == pool)

    assert per_pool(expandable, "small") <= per_pool(default, "small")
    assert per_pool(expandable, "large") <= per_pool(default, "large") + md.LARGE_BUFFER - 2 * MiB
    assert expandable.allocated <= default.allocated


def test_expandable_segments_can_need_more_once_pages_are_pinned():
    # Not "never more than the default": a 20 MiB page of the large pool is unmapped only when
    # no live block touches it (torch's ExpandableSegment maps 20 MiB pages for that pool).
    # Twenty 10 MiB tensors, every other one freed: the default frees the ten empty segments
    # under pressure; each expandable page still holds a live half, so nothing can be unmapped.
    def stream(a):
        hs = [a.malloc(10 * MiB) for _ in range(20)]
        for h in hs[::2]:
            a.free(h)
        a.malloc(100 * MiB)
        return a

    assert stream(md.CachingAllocator(200 * MiB)).reserved == 200 * MiB
    with pytest.raises(md.OutOfMemory) as e:
        stream(md.CachingAllocator(200 * MiB, expandable_segments=True))
    assert "Tried to allocate 100.00 MiB" in str(e.value) and "100.00 MiB is allocated" in str(
        e.value) and "0 bytes is free" in str(e.value)


# ---- spiking_ranks ----------------------------------------------------------------------------

VALUES = st.one_of(st.floats(0, 1e6), st.sampled_from([float("nan"), float("inf"),
                                                         float("-inf"), 0.0]))


@FAST
@given(st.lists(VALUES, min_size=1, max_size=9), st.floats(1.5, 100), st.randoms())
def test_spiking_ranks_is_its_definition_and_permutation_equivariant(values, factor, rnd):
    got = nd.spiking_ranks(values, factor)
    finite = {r: abs(v) for r, v in enumerate(values) if math.isfinite(v)}
    for r, v in enumerate(values):
        others = [w for q, w in finite.items() if q != r]
        spike = not math.isfinite(v) or bool(others) and abs(v) > factor * statistics.median(
            others)
        assert (r in got) == spike, (r, values, got)          # never misses, never invents
    order = list(range(len(values)))
    rnd.shuffle(order)
    shuffled = [values[i] for i in order]
    assert nd.spiking_ranks(shuffled, factor) == sorted(i for i, o in enumerate(order)
                                                        if o in got)
