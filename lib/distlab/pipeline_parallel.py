"""Pipeline parallelism over send/recv: cut a sequential model into stages, run a schedule.

    parts = split_model(model.net, p * v)          # every rank builds the same model, cuts it
    stage = PipelineStage(parts, rank, world_size, in_shape=(16,))
    loss = stage.step(one_f_one_b(p, m)[rank], x, y, m, F.mse_loss)   # grads in .grad

A schedule is a list of actions per stage (distlab.pipeline_schedules). `step` runs this rank's
list in order: a forward receives its input from the previous virtual stage and sends its output
to the next; a backward receives the output's gradient and sends the input's gradient back.
Sends are non-blocking (isend) so a stage never waits for its neighbour to pick a tensor up;
receives block, which is where the bubbles are. Every action's start and end are recorded
(on the rank's virtual clock when the run is emulated: distlab.run(..., emulate=...)).
"""
import time

import torch
import torch.distributed as dist
import torch.nn as nn

from .devices import device
from . import trace
from .pipeline_schedules import normalize


def split_model(seq, n_parts):
    """Cut an nn.Sequential into n_parts consecutive pieces of (nearly) equal numbers of layers.

    Slicing keeps the layers' names ("3.weight"), so a piece's parameters can be matched with
    the whole model's.
    """
    if not isinstance(seq, nn.Sequential):
        raise TypeError(f"split_model cuts an nn.Sequential; got {type(seq).__name__}.")
    n = len(seq)
    if not 1 <= n_parts <= n:
        raise ValueError(f"cannot cut {n} layers into {n_parts} stages: every stage needs at "
                         f"least one layer.")
    bounds = [round(i * n / n_parts) for i in range(n_parts + 1)]
    return [seq[a:b] for a, b in zip(bounds, bounds[1:])]


def micro_batch_sizes(batch, m):
    """Sizes of m micro-batches of a batch: equal, or differing by one when m does not divide it."""
    if isinstance(m, bool) or not isinstance(m, int) or m < 1:
        raise ValueError(f"the number of micro-batches must be a whole number >= 1; got {m!r}.")
    if m > batch:
        raise ValueError(f"cannot cut a batch of {batch} samples into {m} micro-batches: some "
                         f"would be empty. Use at most {batch}.")
    return [batch // m + (1 if i < batch % m else 0) for i in range(m)]


def _output_shapes(parts, in_shape, dtype):
    """Shape (without the batch dimension) leaving each part: what a receiver must allocate.

    Every rank holds the whole model before it keeps its own pieces, so one sample pushed through
    all of them (cheap, no autograd) tells every rank every shape without asking its neighbours.
    """
    shapes = []
    with torch.no_grad():
        x = torch.zeros((1, *in_shape), dtype=dtype, device=device())
        for part in parts:
            x = part(x)
            shapes.append(tuple(x.shape[1:]))
    return shapes


class PipelineStage:
    """This rank's chunks of the model: chunk c is virtual stage c * world_size + rank."""

    def __init__(self, parts, rank, world_size, in_shape, dtype=torch.float32, group=None):
        if len(parts) % world_size:
            raise ValueError(f"{len(parts)} model pieces cannot be dealt evenly to {world_size} "
                             f"stages; use a multiple of {world_size}.")
        self.rank, self.p, self.group = rank, world_size, group
        self.v = len(parts) // world_size
        self.n = len(parts)
        self.shapes = _output_shapes(parts, tuple(in_shape), dtype)
        self.in_shape, self.dtype = tuple(in_shape), dtype
        self.chunks = {c: parts[c * world_size + rank] for c in range(self.v)}
        self.timeline, self.peak_activation_bytes, self.peak_in_flight = [], 0, 0

    def parameters(self):
        return [p for c in sorted(self.chunks) for p in self.chunks[c].parameters()]

    # -- talking to the neighbours --------------------------------------------------------------
    def _peer(self, vs):
        return dist.get_global_rank(self.group, vs % self.p) if self.group else vs % self.p

    def _recv(self, shape, vs):
        buf = torch.empty(shape, dtype=self.dtype, device=self._device)
        dist.recv(buf, src=self._peer(vs), group=self.group)
        return buf

    def _send(self, tensor, vs):
        tensor = tensor.detach().contiguous()
        self._pending.append((dist.isend(tensor, dst=self._peer(vs), group=self.group), tensor))

    # -- one training step ------------------------------------------------------------------------
    def step(self, actions, x, y, n_microbatches, loss_fn):
        """Run this stage's actions for one batch; gradients accumulate in .grad.

        x is read by the first stage and y by the last (every stage needs only the batch size).
        Returns the batch's loss on the stage that holds the last layer, else None.
        """
        actions = normalize([actions])[0]
        sizes = micro_batch_sizes(len(y), n_microbatches)
        offsets = [sum(sizes[:i]) for i in range(len(sizes))]
        self._device = device()
        self._pending, state, total = [], {}, None
        held, self._held_bytes = {}, 0
        self.timeline, self.peak_activation_bytes, self.peak_in_flight = [], 0, 0
        param_storages = {p.untyped_storage().data_ptr() for p in self.parameters()}
        t0 = _common_clock(self.group)

        for a in actions:
            if a.chunk not in self.chunks:
                raise ValueError(f"stage {self.rank} has {self.v} chunk(s); {a!r} names chunk "
                                 f"{a.chunk}.")
            vs, mb, part = a.chunk * self.p + self.rank, a.mb, self.chunks[a.chunk]
            n_mb, key = sizes[mb], (a.chunk, a.mb)
            if a.kind == "F":
                if vs == 0:
                    inp = x[offsets[mb]:offsets[mb] + n_mb]
                elif (vs - 1) % self.p == self.rank:      # one stage: the piece before is ours
                    inp = state[(a.chunk - 1, mb)]["out"].detach().requires_grad_()
                else:
                    inp = self._recv((n_mb, *self.shapes[vs - 1]), vs - 1).requires_grad_()
                start = _now()
                held[key] = 0

                def pack(t, key=key):
                    if t.untyped_storage().data_ptr() not in param_storages:
                        held[key] += t.numel() * t.element_size()
                    return t
                with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                    out = part(inp)
                    if vs == self.n - 1:
                        # Each micro-batch's mean loss weighted by its share of the batch: the
                        # sum is the whole batch's mean loss, even for unequal micro-batches.
                        out = loss_fn(out, y[offsets[mb]:offsets[mb] + n_mb]) * (n_mb / len(y))
                        total = out.detach() if total is None else total + out.detach()
                    elif (vs + 1) % self.p != self.rank:
                        self._send(out, vs + 1)
                state[key] = {"inp": inp, "out": out}
                self._held_bytes += held[key]
                self.peak_activation_bytes = max(self.peak_activation_bytes, self._held_bytes)
                self.peak_in_flight = max(self.peak_in_flight, len(held))
            else:
                s = state[key]
                if a.kind in "BI":
                    if vs == self.n - 1:
                        s["grad"] = None
                    elif (vs + 1) % self.p == self.rank:
                        s["grad"] = state[(a.chunk + 1, mb)]["inp"].grad
                    else:
                        s["grad"] = self._recv((n_mb, *self.shapes[vs]), vs + 1)
                start = _now()
                if a.kind == "B":
                    # A first piece without parameters (Flatten) has nothing to differentiate.
                    if s["out"].requires_grad:
                        _vjp_root(s["out"], s["grad"]).backward()
                elif a.kind == "I" and s["inp"].requires_grad:
                    # retain_graph: W walks the same graph again for the weights. (The first
                    # stage skips I unless its input x requires grad, as B would.)
                    (s["inp"].grad,) = torch.autograd.grad(_vjp_root(s["out"], s["grad"]),
                                                           [s["inp"]], retain_graph=True)
                elif a.kind == "W":
                    params = [p for p in part.parameters() if p.requires_grad]
                    root = _vjp_root(s["out"], s["grad"])
                    grads = torch.autograd.grad(root, params) if params else []
                    for p, g in zip(params, grads):
                        p.grad = g if p.grad is None else p.grad + g
                if a.kind in "BI" and vs > 0 and (vs - 1) % self.p != self.rank:
                    self._send(s["inp"].grad, vs - 1)
                if a.kind in "BW":
                    self._held_bytes -= held.pop(key)
                    if vs == 0 or (vs - 1) % self.p != self.rank:
                        del state[key]   # the piece before on this rank still reads inp.grad
            self.timeline.append(dict(stage=self.rank, kind=a.kind, mb=mb, chunk=a.chunk,
                                      start=start - t0, end=_now() - t0))
        for work, _ in self._pending:
            work.wait()
        return total


def _now():
    """The rank's clock: virtual under emulation (distlab.trace.now), else the machine's clock,
    which every process on one machine shares."""
    return trace.now() if trace.emulated() is not None else time.perf_counter()


def _vjp_root(out, grad):
    """A scalar whose backward sends exactly `grad` into `out` (d<out, grad>/d out = grad).

    Same numbers as out.backward(grad); that call imports sympy on first use, ~3 s in every
    fresh rank on a busy 2-core laptop, longer than the whole pipeline step.
    """
    return out if grad is None else (out * grad).sum()


def _common_clock(group):
    """One time origin for all ranks: rank 0's clock after a barrier (exact on one machine)."""
    dist.barrier(group=group)
    t = torch.tensor([_now()], dtype=torch.float64)
    dist.broadcast(t, src=dist.get_global_rank(group, 0) if group else 0, group=group)
    return t.item()


def train(rank, world_size, schedule, model, batches, n_microbatches, in_shape, v=1,
          loss_fn=None, lr=0.05, prefix="net.", dtype=torch.float32):
    """Train `model.net` pipelined with `schedule(p, m)` for len(batches) SGD steps.

    Returns, per step, this rank's loss (last stage, else None), gradients and parameters after
    the step by full-model name, and the timeline; for tests and the notebook.
    """
    import torch.nn.functional as F
    loss_fn = loss_fn or F.mse_loss
    model = model.to(device=device(), dtype=dtype)
    stage = PipelineStage(split_model(model.net, world_size * v), rank, world_size, in_shape,
                          dtype)
    actions = schedule(world_size, n_microbatches)[rank]
    named = [(f"{prefix}{n}", p) for c in sorted(stage.chunks)
             for n, p in stage.chunks[c].named_parameters()]
    out = []
    for x, y in batches:
        for p in stage.parameters():
            p.grad = None
        x, y = x.to(device(), dtype), y.to(device(), dtype)
        loss = stage.step(actions, x, y, n_microbatches, loss_fn)
        grads = {n: p.grad.clone() for n, p in named}
        with torch.no_grad():
            # Plain SGD, as torch.optim.SGD computes it; each stage updates only its own layers.
            # (Building a torch.optim optimizer imports torch._dynamo: seconds in a fresh rank.)
            for p in stage.parameters():
                p.add_(p.grad, alpha=-lr)
        out.append(dict(loss=None if loss is None else loss.item(), grads=grads,
                        params={n: p.detach().clone() for n, p in named},
                        timeline=stage.timeline, peak_bytes=stage.peak_activation_bytes,
                        peak_in_flight=stage.peak_in_flight))
    return out
