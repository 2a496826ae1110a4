"""What travels, not only how much (issue 29 item 6, issue 44): inside a rank, what each call
carried as it left the rank, and the handles started but never waited for.

Counting calls and bytes lets a decoy through: an all-reduce of zeros of the right size, sent
while the gradient is computed some other way, looks like "gradients all-reduced". So the
checkers record, by the checkers' one traffic rule (`_traffic.Carried`: a TorchDispatchMode over
the c10d ops, so `dist.*` under any imported name, a ProcessGroup method and torch's DDP reducer
in C++ alike), every collective and message a rank makes with the values it put in; the parent
lines them up over the ranks (`_traffic.delivered`: an all-reduce delivers the sum of its inputs,
an all-gather its pieces and their sum, a message its payload), and `missing_gradient` asks
whether each parameter's expected gradient, up to a non-zero factor (a pre-division by N, a sum
of N means, a sum weighted by sample counts), travelled in what was delivered, in one piece or
in a ring's chunks. An all-reduce, an all-gather added up locally and a hand-written ring of
send/recv are judged alike.
"""
from .. import _traffic


class Wire(_traffic.Carried):
    """`with Wire() as wire:` inside a rank; `wire.records` lists every call in order (the
    one rule's records, with the values each carried); `wire.mark()` is the number of calls so
    far (to cut the list into steps)."""

    def mark(self):
        return len(self.records)


def delivered(per_rank):
    """What the ranks' calls delivered (per_rank[r]: rank r's records of one step)."""
    return _traffic.delivered(dict(enumerate(per_rank)))


def missing_gradient(pieces, expected, names):
    """The name of the first parameter whose expected gradient (a tensor) did not travel in what
    was delivered, up to a non-zero factor; None when all did."""
    return _traffic.missing(pieces, expected, names)


class Handles:
    """Inside a rank: which all-reduce handles were waited for. The trace completes an event when
    its handle's wait() runs; a learner may also wait through the handle's future or poll
    is_completed(), which this marks too. `unwaited(events)` lists the events (from
    `distlab._tracer._active.events`) that were started asynchronously and never waited for."""

    def __enter__(self):
        from ... import _tracer
        self._cls = _tracer.TracedWork
        self._saved = {name: getattr(self._cls, name) for name in ("get_future", "is_completed")}

        def get_future(work):
            work._event["_waited_another_way"] = True
            return self._saved["get_future"](work)

        def is_completed(work):
            done = self._saved["is_completed"](work)
            if done:
                work._event["_waited_another_way"] = True
            return done
        self._cls.get_future, self._cls.is_completed = get_future, is_completed
        return self

    def __exit__(self, *exc):
        for name, fn in self._saved.items():
            setattr(self._cls, name, fn)

    @staticmethod
    def unwaited(events):
        return [e for e in events if e["op"] == "all_reduce" and not e["native"]
                and e["end"] is None and not e.get("_waited_another_way")]


def never_waited_sentence(where, count):
    return (f"{where}: you started {count} all-reduce(s) with async_op=True but never waited on "
            f"the handle: call work.wait() (in finish(), or before you read the result) — until "
            f"then the tensor may still hold this rank's own values, not the sum.")
