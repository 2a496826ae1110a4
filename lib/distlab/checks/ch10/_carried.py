"""Inside a rank: a copy of every message sent and every all-reduce's input and result."""
import torch
import torch.distributed as dist
from torch._C._distributed_c10d import ProcessGroup


class _Snapshot(dist.Work):
    """A Work handle that copies the all-reduce's result when it is waited for."""

    def __init__(self, inner, done):
        super().__init__()
        self._inner, self._done = inner, done

    def wait(self, timeout=None):
        ok = self._inner.wait() if timeout is None else self._inner.wait(timeout)
        self._done()
        return ok

    def is_completed(self):
        return self._inner.is_completed()

    def is_success(self):
        return self._inner.is_success()

    def exception(self):
        return self._inner.exception()

    def result(self):
        return self._inner.result()

    def source_rank(self):
        return self._inner.source_rank()

    def _source_rank(self):
        return self._inner._source_rank()

    def synchronize(self):
        return self._inner.synchronize()

    def get_future(self):
        return self._inner.get_future()

    def block_current_stream(self):
        return self._inner.block_current_stream()


class _Carried:
    """Inside a rank, while the learner's function runs: a copy of what travels. Every message
    sent (by global peer) and every all-reduce's input and result (with its group's ranks), read
    from the ProcessGroup methods every send and all-reduce goes through, however it was called
    (dist.send, isend, batch_isend_irecv, dist.all_reduce imported under any name)."""

    def __init__(self):
        self.sent, self.reduced = {}, []

    @staticmethod
    def _ranks(pg):
        try:
            return tuple(dist.get_process_group_ranks(pg))
        except Exception:
            return tuple(range(pg.size()))

    def __enter__(self):
        self._saved = {m: getattr(ProcessGroup, m) for m in ("send", "allreduce")}
        send, allreduce, me = self._saved["send"], self._saved["allreduce"], self

        def carried_send(pg, tensors, dst, *args, **kwargs):
            peer = me._ranks(pg)[dst]
            me.sent.setdefault(peer, []).extend(t.detach().flatten().double().clone()
                                                for t in tensors)
            return send(pg, tensors, dst, *args, **kwargs)

        def carried_allreduce(pg, tensors, *args, **kwargs):
            entry = {"group": me._ranks(pg), "input": [t.detach().clone() for t in tensors],
                     "result": None}
            me.reduced.append(entry)
            work = allreduce(pg, tensors, *args, **kwargs)

            def done():
                entry["result"] = [t.detach().clone() for t in tensors]
            return work if work is None else _Snapshot(work, done)

        ProcessGroup.send, ProcessGroup.allreduce = carried_send, carried_allreduce
        return self

    def __exit__(self, *exc):
        for method, original in self._saved.items():
            setattr(ProcessGroup, method, original)


def _same_values(got, expected, scales):
    """Whether the values `got` are those of `expected` times one of `scales`, in any order and
    cut into any pieces (a flat buffer, one tensor per parameter, several micro-batches); None
    when their counts differ (the trace's byte count then says more)."""
    if got.numel() != expected.numel():
        return None
    g = got.sort().values
    return any(torch.allclose(g, (expected * s).sort().values, atol=1e-9, rtol=1e-7)
               for s in scales)
