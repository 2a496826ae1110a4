"""Chapter 11 §3d-5: the allocator model's rules, the step recorder's categories, the pipeline's
per-stage peaks, anomaly mode (an op it must name, a backward it must not flag), the overflow
report and the MFU arithmetic the prose quotes. No launch: the NaN detector's cases ride on
tests/test_debug.py's existing one."""
import pytest
import torch
from distlab import memory_debug as md
from distlab import nan_debug as nd

MiB = md.MiB


# ---- the caching allocator model ---------------------------------------------------------------

def test_size_classes_are_the_allocators():
    assert md.round_size(1) == 512 and md.round_size(513) == 1024
    assert md.segment_size(md.round_size(4096)) == 2 * MiB          # small pool
    assert md.segment_size(3 * MiB) == 20 * MiB                      # 1-10 MiB share 20 MiB
    assert md.segment_size(11 * MiB) == 12 * MiB                     # rounded up to 2 MiB


def test_small_requests_share_a_segment_and_blocks_merge_back():
    a = md.CachingAllocator(100 * MiB)
    x, y = a.malloc(1000), a.malloc(3000)
    assert len(a.segments) == 1 and a.reserved == 2 * MiB
    assert a.allocated == 1024 + 3072
    a.free(x)
    a.free(y)
    assert a.segments[0]["blocks"] == [[a.segments[0]["address"], 2 * MiB, 0]]   # merged
    assert a.allocated == 0 and a.reserved == 2 * MiB                           # cached


def _fragmenting(alloc):
    # A 40 MiB block is freed; a 20 MiB tensor that lives on is cut from its segment; then a
    # 40 MiB request: 20 MiB are free, but not in one piece.
    a = alloc.malloc(40 * MiB)
    alloc.free(a)
    alloc.malloc(20 * MiB)
    return alloc.malloc(40 * MiB)


def test_fragmentation_fails_the_default_and_not_expandable_segments():
    with pytest.raises(md.OutOfMemory) as e:
        _fragmenting(md.CachingAllocator(70 * MiB))
    assert str(e.value) == (
        "CUDA out of memory. Tried to allocate 40.00 MiB. GPU 0 has a total capacity of 70.00 MiB "
        "of which 30.00 MiB is free. Of the allocated memory 20.00 MiB is allocated by PyTorch, "
        "and 20.00 MiB is reserved by PyTorch but unallocated. If reserved but unallocated memory "
        "is large try setting PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid "
        "fragmentation.")
    exp = md.CachingAllocator(70 * MiB, expandable_segments=True)
    _fragmenting(exp)
    assert exp.allocated == 60 * MiB and exp.reserved == 60 * MiB
    # with room for two segments the default allocator runs too: no false alarm
    ok = md.CachingAllocator(80 * MiB)
    _fragmenting(ok)
    assert ok.reserved == 80 * MiB and ok.free_in_segments() == (20 * MiB, 20 * MiB)


def test_a_wholly_free_segment_is_returned_before_giving_up():
    a = md.CachingAllocator(50 * MiB)
    a.free(a.malloc(40 * MiB))
    a.malloc(44 * MiB)                      # does not fit in 40: the free segment goes back
    assert a.reserved == 44 * MiB and len(a.segments) == 1


def test_torch_reads_the_snapshot():
    from torch.cuda import _memory_viz
    for expandable in (False, True):
        a = md.CachingAllocator(90 * MiB, expandable)
        _fragmenting(a)
        a.malloc(1000)
        text = _memory_viz.segsum(a.snapshot())     # raises when the accounting is off
        assert f"total_reserved: {a.reserved / MiB:.1f}MiB" in text
        assert f"total_allocated: {a.requested / MiB:.1f}MiB" in text


# ---- the step recorder ---------------------------------------------------------------------------

def test_recorder_categories_on_a_real_cpu_step():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(),
                                torch.nn.Linear(256, 8))
    opt = torch.optim.AdamW(model.parameters(), foreach=True)
    batch = (torch.randn(32, 64), torch.randn(32, 8))
    weights = sum(p.numel() * 4 for p in model.parameters())
    log = md.record_step(model, [batch], torch.nn.functional.mse_loss, opt)
    made = {}
    for e in log["events"]:
        if e["action"] == "alloc":
            made[e["category"]] = made.get(e["category"], 0) + e["bytes"]
    assert log["parameters"] == weights                      # the weights are not "made"
    assert made["gradients"] == weights
    # two float32 moments per parameter, and a float32 step count per parameter tensor
    assert made["optimizer state"] == 2 * weights + 4 * 4
    # ReLU's output (saved), the hidden pre-activation is freed: 32x256 floats at least
    assert made["activations"] >= 32 * 256 * 4
    frees = sum(e["action"] == "free" for e in log["events"])
    allocs = sum(e["action"] == "alloc" for e in log["events"])
    alive = md.live_bytes(log["events"], log["parameters"])[-1]
    assert alive["gradients"] == 0 and alive["activations"] == 0 and frees < allocs
    assert alive["optimizer state"] == made["optimizer state"]


def test_stage_peaks_follow_the_1f1b_schedule():
    got = md.pipeline_stage_peaks(4, 8, 10, 100)
    assert got["in_flight"] == [4, 3, 2, 1]
    assert got["peak"] == [140, 130, 120, 110]
    assert md.pipeline_stage_peaks(4, 2, 1, 0)["in_flight"] == [2, 2, 2, 1]


# ---- NaN triage ----------------------------------------------------------------------------

# first_nonfinite_gradient's catch and no-flag cases run in tests/test_debug.py's _perturbed
# launch (2 and 3 ranks), which already exists: no launch of its own here.


def test_spiking_ranks():
    assert nd.spiking_ranks([1.0, 1.1, 0.9, 1.0]) == []
    assert nd.spiking_ranks([1.0, 80.0, 0.9, 1.0]) == [1]
    assert nd.spiking_ranks([1.0, float("nan"), 0.9]) == [1]


def test_anomaly_mode_names_the_op_and_the_line():
    def masked_log():
        x = torch.tensor([0.0, 2.0], requires_grad=True)
        torch.where(x > 0, x.log(), torch.zeros_like(x)).sum().backward()

    def fine():
        x = torch.tensor([1.0, 2.0], requires_grad=True)
        (x * 2).sum().backward()

    got = nd.anomaly_op(masked_log)
    assert got["function"] == "LogBackward0"
    assert got["forward"].startswith("masked_log, line") and "x.log()" in got["forward"]
    assert nd.anomaly_op(fine) is None


def test_overflow_report_and_the_formats_quoted():
    rep = nd.overflow_report(torch.tensor([3.0e2, 7.0e4, 1.0e39], dtype=torch.float64))
    assert rep["float16"][1] == 2 and rep["bfloat16"][1] == 1
    assert nd.overflow_report(torch.tensor([3.0e2]))["float16"] == (300 / 65504, 0)
    assert torch.finfo(torch.float16).max == 65504                       # "overflows at 65504"
    assert 256 * torch.finfo(torch.bfloat16).eps == 2                     # "the spacing is 2"
    w = torch.tensor(256.0, dtype=torch.bfloat16)
    assert (w + 1).item() == 256


def test_mfu_formula_and_llama3():
    from distlab import hardware, layout
    shape = layout.SHAPES["Llama-2 7B"]
    n = shape.layers * layout._layer_params(shape)
    # 6N + 12·L·h·s is the course's model_flops without the head, the mask or recompute
    assert nd.flops_per_token(n, shape.layers, shape.hidden, 4096) * 4096 == pytest.approx(
        layout.model_flops(shape, 4096, 4096, recompute="none", causal=False, vocab=False))
    peak = hardware.PRESETS["h100-node"].device.peak(torch.bfloat16)
    assert peak == 989e12
    # Llama 3 405B (Dubey et al. 2024, table 4): 430, 400, 380 TFLOPs/GPU -> 43, 41, 38 % MFU
    L3 = dict(n_params=405e9, layers=126, hidden=16384)
    for tflops, seq, published in ((430, 8192, 0.43), (400, 8192, 0.41), (380, 131072, 0.38)):
        tok = tflops * 1e12 / nd.flops_per_token(seq_len=seq, **L3)
        assert abs(nd.mfu(tok, 1, peak, seq_len=seq, **L3) - published) < 0.01   # "within a point"


def test_chapter_quotes():
    import pathlib

    import nbformat
    path = pathlib.Path(__file__).resolve().parent.parent / "notebooks" / "11_debugging.ipynb"
    text = " ".join(" ".join(c.source.split()) for c in nbformat.read(path, as_version=4).cells)
    for quote in ("BF16 MFU of 38–43 %", "380–430 TFLOPs per GPU", "float16 overflows at 65504",
                  "at 256 the spacing is 2", "the first holds p micro-batches' activations, the "
                  "last one", "x[0, 0] = 1e200", "calls[0] == 3"):
        assert quote in text, quote


def test_an_expandable_segment_under_pressure_lists_only_its_mapped_pages():
    from torch.cuda import _memory_viz
    a = md.CachingAllocator(100 * MiB, expandable_segments=True)
    blocks = [a.malloc(20 * MiB) for _ in range(4)]
    a.free(blocks[1])
    a.free(blocks[2])
    a.malloc(60 * MiB)            # does not fit: pages 1 and 2 are unmapped, the tail grows
    assert a.reserved == 100 * MiB and a.allocated == 100 * MiB
    snap = a.snapshot()
    assert sum(s["total_size"] for s in snap["segments"]) == a.reserved
    assert "total_reserved: 100.0MiB" in _memory_viz.segsum(snap)
