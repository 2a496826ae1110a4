"""The allocation stream of a real training step: every tensor storage torch creates and frees,
in order, each with the op that made it and a category (parameters, activations, gradients,
optimizer state, temporaries): what a GPU's caching allocator would be asked for, recorded with
a TorchDispatchMode on the `meta` device at full size or on the CPU. It does not see what a
library allocates outside torch (NCCL's buffers, cuBLAS's workspace) nor the CUDA context."""
import contextlib

import torch

CATEGORIES = ("parameters", "optimizer state", "gradients", "activations", "temporaries")


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



def mlp_stack(hidden, layers, dtype=torch.bfloat16):
    """Chapter 11's real-size step (debug.step_times): `layers` blocks hidden -> 4·hidden ->
    hidden with GELU, in `dtype`; build it under `with torch.device("meta"):`."""
    return torch.nn.Sequential(*[m for _ in range(layers) for m in (
        torch.nn.Linear(hidden, 4 * hidden), torch.nn.GELU(),
        torch.nn.Linear(4 * hidden, hidden))]).to(dtype)
