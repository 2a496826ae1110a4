"""The handles a traced call returns: the real Work inside, the modeled completion beside."""

import torch
import torch.distributed as dist

from .ops import _tensors


class _NoTransfer:
    """The finished inner handle of a communication on meta tensors: nothing was sent."""

    def __init__(self, args):
        self._outputs = _tensors(args[0]) if args else []

    def wait(self, timeout=None):
        return True

    def is_completed(self):
        return True

    def is_success(self):
        return True

    def exception(self):
        return None

    def result(self):
        return self._outputs

    def synchronize(self):
        return None

    def block_current_stream(self):
        return None

    def get_future(self):
        future = torch.futures.Future()
        future.set_result(self._outputs)
        return future


class TracedWork(dist.Work):
    """The Work handle a traced call returns: the real one inside, the event to complete beside."""

    def __init__(self, inner, event, recorder):
        super().__init__()
        self._inner, self._event, self._recorder = inner, event, recorder
        self._finished = False

    def wait(self, timeout=None):
        if self._finished:
            return True
        called, seen = self._recorder.now(), self._recorder._marker()
        ok = self._recorder.backend(self._inner.wait, *([] if timeout is None else [timeout]))
        self._recorder.finish(self._event, self._inner, called, seen)
        self._finished = True
        return ok

    def is_completed(self):
        rec = self._recorder
        if rec.clock is None or self._finished:
            return self._inner.is_completed()
        # Emulated: done when the modeled transfer is (this learns the peers' start times).
        end = rec.completion(self._event)
        if end is None or end > rec.clock.now:
            return False
        rec.backend(self._inner.wait)   # every member launched it: the result is moments away
        return True

    def is_success(self):
        return self._inner.is_success()

    def exception(self):
        return self._inner.exception()

    def source_rank(self):
        return self._inner.source_rank()

    def _source_rank(self):
        return self._inner._source_rank()

    def result(self):
        return self._inner.result()

    def synchronize(self):
        return self._inner.synchronize()

    def get_future(self):
        return self._inner.get_future()

    def block_current_stream(self):
        return self._inner.block_current_stream()
