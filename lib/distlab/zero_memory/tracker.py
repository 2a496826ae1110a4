"""A tracked allocation peak on real CPU tensors: every storage an op touches, op by op."""
import torch


class PeakTracker:
    """A context that records the peak of the bytes held by tensor storages, op by op.

    Every storage an op reads or writes on this thread is tracked (weakly: a freed storage
    stops counting; a storage shrunk with resize_, as ZeRO-3 frees parameters, counts its
    current size). `tensors` given at entry are tracked from the start: the baseline.
    After the block: .baseline (bytes at entry), .peak (the largest total seen).
    What it does not see: buffers that a communication library allocates outside torch (gloo's,
    NCCL's), and the allocator's rounding and fragmentation (torch.cuda.max_memory_allocated on
    a GPU sees the rounding; memory_reserved the fragmentation)."""

    def __init__(self, tensors=()):
        self._initial = list(tensors)

    def __enter__(self):
        from torch.multiprocessing.reductions import StorageWeakRef
        from torch.utils._python_dispatch import TorchDispatchMode
        from torch.utils._pytree import tree_leaves
        tracker, refs = self, {}

        def track(t):
            st = t.untyped_storage()
            if st._cdata not in refs:
                refs[st._cdata] = StorageWeakRef(st)

        def live():
            total = 0
            for key, ref in list(refs.items()):
                st = torch.UntypedStorage._new_with_weak_ptr(ref.cdata)
                if st is None:           # freed (perhaps by gloo's worker thread, just now)
                    del refs[key]
                else:
                    total += st.nbytes()
            return total

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                for t in tree_leaves((out, args, kwargs)):
                    if isinstance(t, torch.Tensor):
                        track(t)
                tracker.peak = max(tracker.peak, live())
                return out

        for t in self._initial:
            if isinstance(t, torch.Tensor):
                track(t)
        self.baseline = self.peak = live()
        self._mode = Mode()
        self._mode.__enter__()
        return self

    def __exit__(self, *exc):
        self._mode.__exit__(*exc)
        return False
