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

One module per idea: `record` (the stream of a real step), `allocator` (the caching allocator,
modelled), `sizing` (replaying a stream, the smallest device, a pipeline's per-stage peaks).
"""
from .allocator import (GiB, LARGE_BUFFER, MIN_BLOCK, MIN_LARGE_ALLOC, MiB,  # noqa: F401
                        ROUND_LARGE, SMALL_BUFFER, SMALL_SIZE, CachingAllocator, OutOfMemory,
                        fmt, round_size, segment_size)
from .record import (CATEGORIES, StepRecorder, categorise, live_bytes, mlp_stack,  # noqa: F401
                     record_step, storage_ids)
from .sizing import live_total, pipeline_stage_peaks, replay, smallest_device  # noqa: F401
