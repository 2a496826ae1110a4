"""A pipeline stage over send/recv: cut the model, hold this rank's chunks, run a schedule's
actions in order (`PipelineStage.forward`, `.backward`, and `.step` around them)."""
import time

import torch
import torch.distributed as dist
import torch.nn as nn

from .. import _argcheck as check
from .. import trace
from ..devices import device
from ..pipeline_schedules import normalize, placement_of, stage_of, virtual_stage
from .shared import holders, sync_copies
from .split_backward import _input_gradients, _vjp_root, _weight_gradients, _weight_inputs

# send/recv pair messages by (peer, tag) in order. Activations and gradients can travel the
# same way between two stages (the V placement: stage r sends chunk 0's activations and chunk
# 1's input gradients to r + 1), so they get tags of their own, and each kind keeps its order.
ACTIVATION, GRADIENT = 0, 1


def split_model(seq, n_parts):
    """Cut an nn.Sequential into n_parts consecutive pieces of (nearly) equal numbers of layers.

    Slicing keeps the layers' names ("3.weight"), so a piece's parameters can be matched with
    the whole model's.
    """
    if not isinstance(seq, nn.Sequential):
        raise TypeError(f"split_model cuts an nn.Sequential; got {type(seq).__name__}.")
    n, n_parts = len(seq), check.whole(n_parts, "n_parts", example=2)
    if not 1 <= n_parts <= n:
        raise ValueError(f"cannot cut {n} layers into {n_parts} stages: every stage needs at "
                         f"least one layer.")
    bounds = [round(i * n / n_parts) for i in range(n_parts + 1)]
    return [seq[a:b] for a, b in zip(bounds, bounds[1:])]


def micro_batch_sizes(batch, m):
    """Sizes of m micro-batches of a batch: equal, or differing by one when m does not divide it."""
    batch = check.whole(batch, "batch", at_least=0)
    if isinstance(m, bool) or not isinstance(m, int) or m < 1:
        raise ValueError(f"the number of micro-batches must be a whole number >= 1; got {m!r}.")
    if m > batch:
        raise ValueError(f"cannot cut a batch of {batch} samples into {m} micro-batches: some "
                         f"would be empty. Use at most {batch}.")
    return [batch // m + (1 if i < batch % m else 0) for i in range(m)]


def _output_shapes(parts, in_shape, dtype, where):
    """Shape (without the batch dimension) leaving each part: what a receiver must allocate.

    Every rank holds the whole model before it keeps its own pieces, so one sample pushed through
    all of them (cheap, no autograd) tells every rank every shape without asking its neighbours.
    (On the meta device the sample costs no time either: the clock starts at the first action.)
    """
    shapes = []
    with torch.no_grad():
        x = torch.zeros((1, *in_shape), dtype=dtype, device=where)
        for i, part in enumerate(parts):
            try:
                x = part(x)
            except RuntimeError as e:        # torch's "mat1 and mat2 ...": say which shape
                raise ValueError(f"in_shape {in_shape} (one sample, without the batch "
                                 f"dimension) does not fit the model: piece {i} raised "
                                 f"{str(e).splitlines()[0]!r}.") from None
            shapes.append(tuple(x.shape[1:]))
    return shapes


def _check_stage(parts, rank, world_size, in_shape, dtype, group):
    if not isinstance(parts, (list, tuple)) or not all(isinstance(q, nn.Module) for q in parts):
        raise TypeError("parts must be a list of modules, e.g. split_model(model.net, p).")
    world_size = check.whole(world_size, "world_size", at_least=1)
    rank = check.rank_in(rank, world_size)
    check.floating_dtype(dtype, "dtype"), check.group(group)
    if isinstance(in_shape, int) and not isinstance(in_shape, bool):
        in_shape = (in_shape,)                 # one feature dimension, as (16,) would say
    if not isinstance(in_shape, (tuple, list)):
        raise TypeError(f"in_shape must be one sample's shape, a tuple like (16,); got "
                        f"{in_shape!r}.")
    return rank, world_size, tuple(check.whole(n, "in_shape's sizes", at_least=1)
                                   for n in in_shape)


class PipelineStage:
    """This rank's chunks of the model: chunk c is virtual stage c * world_size + rank; with
    placement="v" (two chunks: ZB-V, DualPipeV) virtual stages rank and 2 * world_size - 1 - rank;
    with placement="dual" (DualPipe: `parts` is the whole model in world_size pieces, each held
    twice) pieces rank and world_size - 1 - rank, for the micro-batches entering at stage 0 and
    at stage world_size - 1. `step` leaves each copy's own gradient in .grad (`train` sums the two).
    A parameter in two pieces on two stages (tied, or a layer used twice) is held the same way: a
    copy on each, given the lowest holder's values here, summed by `train` (shared.sum_copies)."""

    def __init__(self, parts, rank, world_size, in_shape, dtype=torch.float32, group=None,
                 placement="loop"):
        rank, world_size, in_shape = _check_stage(parts, rank, world_size, in_shape, dtype, group)
        self.placement = placement_of(None, placement)
        dual = self.placement == "dual"
        if dual and (len(parts) != world_size or world_size % 2):
            raise ValueError(f"the dual placement holds every piece twice: it needs an even "
                             f"number of stages and one piece per stage; got {len(parts)} "
                             f"pieces for {world_size} stages.")
        if len(parts) % world_size:
            raise ValueError(f"{len(parts)} model pieces cannot be dealt evenly to {world_size} "
                             f"stages; use a multiple of {world_size}.")
        self.rank, self.p, self.group = rank, world_size, group
        self.v = 2 if dual else len(parts) // world_size
        self.n = len(parts)
        if self.placement == "v" and self.v != 2:
            raise ValueError(f"the V placement gives every stage 2 pieces; {len(parts)} pieces "
                             f"for {world_size} stages are {self.v} each.")
        if self.placement != "loop" and dist.is_initialized() and \
                "nccl" in str(dist.get_backend(group)) and device().type == "cuda":
            # NCCL pairs send/recv between two ranks in posting order and ignores tags; the V
            # and dual schedules post activations and gradients to one neighbour in an order
            # that only tags keep apart (gloo honours them), so the wrong tensors would pair.
            raise ValueError("the V and dual placements (ZB-V, DualPipeV, DualPipe) need "
                             "send/recv tags, which NCCL ignores; run them on gloo, or use "
                             "torch.distributed.pipelining's ScheduleZBVZeroBubble / "
                             "ScheduleDualPipeV on GPUs.")
        # A model built on the meta device (a real-size stage under emulation: shapes, no
        # values) talks in meta tensors; any other runs on the course's device.
        self.meta = any(q.is_meta for part in parts for q in part.parameters())
        self.shapes = _output_shapes(parts, tuple(in_shape), dtype,
                                     "meta" if self.meta else device())
        self.in_shape, self.dtype = tuple(in_shape), dtype
        self.chunks = {c: parts[self._vs(c)] for c in range(self.v)}
        self.timeline, self.peak_activation_bytes, self.peak_in_flight = [], 0, 0
        # a parameter in two pieces (tied, reused) has a copy on each stage holding one
        self.holders = holders(parts, world_size, self.placement)
        sync_copies(self)

    def parameters(self):
        """This stage's parameters, each once (two chunks may share one: one step, not two)."""
        return list({id(p): p for c in sorted(self.chunks)
                     for p in self.chunks[c].parameters()}.values())

    # -- where the pieces are ---------------------------------------------------------------------
    def _vs(self, chunk):
        return virtual_stage(self.rank, chunk, self.p, self.placement)

    def _holder(self, vs, chunk=0):
        """The stage holding virtual stage vs (for the micro-batches of `chunk`)."""
        return stage_of(vs, self.p, self.placement, chunk)[0]

    def _local(self, vs, chunk=0):
        """Our chunk holding virtual stage vs (the piece before or after ours is on this rank)."""
        return stage_of(vs, self.p, self.placement, chunk)[1]

    def _mine(self, vs, chunk):
        """Is virtual stage vs (next to our chunk `chunk`) on this rank too (the V's turn)?"""
        return self._holder(vs, chunk) == self.rank

    # -- talking to the neighbours --------------------------------------------------------------
    def _peer(self, vs, chunk=0):
        holder = self._holder(vs, chunk)
        return dist.get_global_rank(self.group, holder) if self.group else holder

    def _recv(self, vs, chunk, shape, tag):
        buf = torch.empty(shape, dtype=self.dtype, device=self._device)
        dist.recv(buf, src=self._peer(vs, chunk), group=self.group, tag=tag)
        return buf

    def _send(self, tensor, vs, chunk, tag):
        tensor = tensor.detach().contiguous()
        self._pending.append((dist.isend(tensor, dst=self._peer(vs, chunk), group=self.group,
                                         tag=tag), tensor))

    # -- the core: one forward, one backward ----------------------------------------------------
    def forward(self, chunk, mb, x, y, loss_fn):
        """F: get the input (the batch's rows, our other chunk's output, or a message), run the
        chunk, send the output on; the last piece returns its share of the batch's loss."""
        vs, rows, s = self._vs(chunk), self._rows[mb], {}
        if vs == 0:
            inp = x[rows]
        elif self._mine(vs - 1, chunk):
            inp = self._input(self._state[self._local(vs - 1, chunk), mb]["out"].detach(), s)
        else:
            inp = self._input(self._recv(vs - 1, chunk, (len(y[rows]), *self.shapes[vs - 1]),
                                         ACTIVATION), s)
        self._start = _now()                     # the action's time starts once its input is here
        out = self.chunks[chunk](inp)
        if vs == self.n - 1:                     # the micro-batch's mean loss x its share of the batch
            out = loss_fn(out, y[rows]) * (len(y[rows]) / len(y))
        elif not self._mine(vs + 1, chunk):
            self._send(out, vs + 1, chunk, ACTIVATION)
        self._state[chunk, mb] = {**s, "inp": inp, "out": out}
        return out

    def _input(self, t, s):
        """The input as autograd's graph sees it: not a leaf (a leaf that requires grad refuses
        in-place ops, and a stage may begin with ReLU(inplace=True)), no copy either; its
        gradient lands in s["box"] (see _StageInput)."""
        s["anchor"], s["box"] = self._anchor, {"t": t}
        return _StageInput.apply(self._anchor, s["box"])

    def backward(self, chunk, mb, split=False):
        """B (or, split, I: the input's gradient only; W comes later): get the output's gradient
        (none after the loss, our other chunk's, or a message), run autograd, send the input's back."""
        vs, s = self._vs(chunk), self._state[chunk, mb]
        if vs == self.n - 1:
            s["grad"] = None
        elif self._mine(vs + 1, chunk):
            s["grad"] = self._state[self._local(vs + 1, chunk), mb]["in_grad"]
        else:
            s["grad"] = self._recv(vs + 1, chunk, s["out"].shape, GRADIENT)
        self._start = _now()
        if split:
            _input_gradients(s)
        elif s["out"].requires_grad:             # a first piece without weights has nothing to do
            _vjp_root(s["out"], s["grad"]).backward()
        if vs > 0:                               # none: the output ignores the input
            g = s["box"].get("grad")
            s["in_grad"] = torch.zeros_like(s["inp"]) if g is None else g
        if vs > 0 and not self._mine(vs - 1, chunk):
            self._send(s["in_grad"], vs - 1, chunk, GRADIENT)

    # -- one training step ------------------------------------------------------------------------
    def step(self, actions, x, y, n_microbatches, loss_fn):
        """Run this stage's actions for one batch; gradients accumulate in .grad.

        x is read by the first stage and y by the last (every stage needs only the batch size).
        Returns the batch's loss on the stage that holds the last layer, else None (the dual
        placement: on each of the two, the loss of the micro-batches that end there).
        Around `forward` and `backward`: the bytes autograd saves per micro-batch (peak held),
        each layer's output for W, the timeline.
        """
        actions = normalize([actions])[0]
        sizes = micro_batch_sizes(len(y), n_microbatches)
        offsets = [sum(sizes[:i]) for i in range(len(sizes))]
        self._rows = [slice(o, o + n) for o, n in zip(offsets, sizes)]
        self._device = torch.device("meta") if self.meta else device()
        self._pending, self._state = [], {}
        self._anchor = torch.zeros((), dtype=self.dtype, device=self._device, requires_grad=True)
        self.timeline, self.peak_activation_bytes, self.peak_in_flight = [], 0, 0
        t0 = _common_clock(self.group)
        try:
            total = self._run(actions, x, y, loss_fn, t0)
        except Exception as e:      # (a refusal of ours names its stage and action itself)
            if not isinstance(e, ValueError):
                a = self._action
                e.add_note(f"stage {self.rank} raised this in {a!r} (virtual stage "
                           f"{self._vs(a.chunk)}); the stages waiting for its messages are "
                           f"stopped at once by distlab.run, elsewhere at their timeout.")
            raise
        for work, _ in self._pending:
            work.wait()
        return total

    def _run(self, actions, x, y, loss_fn, t0):
        """step's loop: the actions, with the accounting around forward and backward."""
        total, held, self._held_bytes = None, {}, 0
        # Saved tensors that are weights are not activations. (Meta tensors have no storage
        # to tell apart: there, every saved tensor that is not a parameter counts.)
        param_storages = {p.untyped_storage().data_ptr() for p in self.parameters()
                          if not p.is_meta}
        param_ids = {id(p) for p in self.parameters()}
        for a in actions:
            self._action = a
            if a.chunk not in self.chunks:
                raise ValueError(f"stage {self.rank} has {self.v} chunk(s); {a!r} names chunk "
                                 f"{a.chunk}.")
            vs, key = self._vs(a.chunk), (a.chunk, a.mb)
            if a.kind == "F":
                held[key] = 0

                def pack(t, key=key):
                    if id(t) not in param_ids and (
                            t.is_meta or t.untyped_storage().data_ptr() not in param_storages):
                        held[key] += t.numel() * t.element_size()
                    return t
                with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), \
                        _weight_inputs(self.chunks[a.chunk]) as layer_outputs:
                    out = self.forward(a.chunk, a.mb, x, y, loss_fn)
                if vs == self.n - 1:
                    total = out.detach() if total is None else total + out.detach()
                self._state[key]["layers"] = layer_outputs
                self._held_bytes += held[key]
                self.peak_activation_bytes = max(self.peak_activation_bytes, self._held_bytes)
                self.peak_in_flight = max(self.peak_in_flight, len(held))
            elif a.kind in "BI":
                self.backward(a.chunk, a.mb, split=a.kind == "I")
            else:
                self._start = _now()
                _weight_gradients(self.chunks[a.chunk], self._state[key])
            if a.kind in "BW":
                self._held_bytes -= held.pop(key)
                if vs == 0 or not self._mine(vs - 1, a.chunk):
                    del self._state[key]  # the piece before on this rank still reads in_grad
            self.timeline.append(dict(stage=self.rank, kind=a.kind, mb=a.mb, chunk=a.chunk,
                                      start=self._start - t0, end=_now() - t0))
        return total


class _StageInput(torch.autograd.Function):
    """A stage's input box["t"] (a received buffer, or our other chunk's output) returned as a
    non-leaf that requires grad, through `anchor` (a scalar leaf that requires grad): t itself,
    no copy. Its backward keeps the gradient of the input's value before any in-place op in
    box["grad"]: all the stage must keep to send the input's gradient back. (t travels in the
    box, not as an argument: autograd treats an argument returned as-is, or marked dirty, as a
    view that refuses in-place ops, or bumps its version.)"""

    @staticmethod
    def forward(ctx, anchor, box):
        ctx.box = box               # a dict of its own: the stage's state holds the graph
        return box.pop("t")

    @staticmethod
    def backward(ctx, grad):
        ctx.box["grad"] = grad
        return None, None


def _now():
    """The rank's clock: virtual under emulation (distlab.trace.now), else the machine's clock,
    which every process on one machine shares."""
    return trace.now() if trace.emulated() is not None else time.perf_counter()


def _common_clock(group):
    """One time origin for all ranks: rank 0's clock after a barrier (exact on one machine)."""
    dist.barrier(group=group)
    t = torch.tensor([_now()], dtype=torch.float64)
    dist.broadcast(t, src=dist.get_global_rank(group, 0) if group else 0, group=group)
    return t.item()
