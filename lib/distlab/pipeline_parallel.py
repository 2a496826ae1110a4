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

The core of a step is two methods: `forward` (receive, run the chunk, send) and `backward`
(receive the gradient, autograd, send the input's gradient back); `step` adds the accounting
around them. Placements: "loop" (interleaved), "v" (ZB-V, DualPipeV) and "dual" (the
bidirectional DualPipe: every piece on two ranks, their gradients summed by `sum_dual_copies`).

ZB's split backward works layer by layer, as production implementations do: `I` asks autograd
for the input's gradient and the gradient at every layer output that feeds a weight (autograd
then skips the weight-gradient products), `W` multiplies each by its layer's input.

Real size: a model built on the meta device runs as is (shapes, no values) under emulation;
`real_size_step` is a pipeline of Llama-2 7B blocks for the chapter's bubble at real size.
"""
import time

import torch
import torch.distributed as dist
import torch.nn as nn

from .devices import device
from . import trace
from .pipeline_schedules import n_pieces, normalize, placement_of, stage_of, virtual_stage

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


def _output_shapes(parts, in_shape, dtype, where):
    """Shape (without the batch dimension) leaving each part: what a receiver must allocate.

    Every rank holds the whole model before it keeps its own pieces, so one sample pushed through
    all of them (cheap, no autograd) tells every rank every shape without asking its neighbours.
    (On the meta device the sample costs no time either: the clock starts at the first action.)
    """
    shapes = []
    with torch.no_grad():
        x = torch.zeros((1, *in_shape), dtype=dtype, device=where)
        for part in parts:
            x = part(x)
            shapes.append(tuple(x.shape[1:]))
    return shapes


class PipelineStage:
    """This rank's chunks of the model: chunk c is virtual stage c * world_size + rank; with
    placement="v" (two chunks: ZB-V, DualPipeV) virtual stages rank and 2 * world_size - 1 - rank;
    with placement="dual" (DualPipe: `parts` is the whole model in world_size pieces, each held
    twice) pieces rank and world_size - 1 - rank, for the micro-batches entering at stage 0 and
    at stage world_size - 1. `step` leaves each copy's own gradient in .grad (`train` sums the two)."""

    def __init__(self, parts, rank, world_size, in_shape, dtype=torch.float32, group=None,
                 placement="loop"):
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

    def parameters(self):
        return [p for c in sorted(self.chunks) for p in self.chunks[c].parameters()]

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
        vs, rows = self._vs(chunk), self._rows[mb]
        if vs == 0:
            inp = x[rows]
        elif self._mine(vs - 1, chunk):
            inp = self._state[self._local(vs - 1, chunk), mb]["out"].detach().requires_grad_()
        else:
            inp = self._recv(vs - 1, chunk, (len(y[rows]), *self.shapes[vs - 1]),
                             ACTIVATION).requires_grad_()
        self._start = _now()                     # the action's time starts once its input is here
        out = self.chunks[chunk](inp)
        if vs == self.n - 1:                     # the micro-batch's mean loss x its share of the batch
            out = loss_fn(out, y[rows]) * (len(y[rows]) / len(y))
        elif not self._mine(vs + 1, chunk):
            self._send(out, vs + 1, chunk, ACTIVATION)
        self._state[chunk, mb] = {"inp": inp, "out": out}
        return out

    def backward(self, chunk, mb, split=False):
        """B (or, split, I: the input's gradient only; W comes later): get the output's gradient
        (none after the loss, our other chunk's, or a message), run autograd, send the input's back."""
        vs, s = self._vs(chunk), self._state[chunk, mb]
        if vs == self.n - 1:
            s["grad"] = None
        elif self._mine(vs + 1, chunk):
            s["grad"] = self._state[self._local(vs + 1, chunk), mb]["inp"].grad
        else:
            s["grad"] = self._recv(vs + 1, chunk, s["out"].shape, GRADIENT)
        self._start = _now()
        if split:
            _input_gradients(s)
        elif s["out"].requires_grad:             # a first piece without weights has nothing to do
            _vjp_root(s["out"], s["grad"]).backward()
        if vs > 0 and not self._mine(vs - 1, chunk):
            self._send(s["inp"].grad, vs - 1, chunk, GRADIENT)

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
        self._pending, self._state, total = [], {}, None
        held, self._held_bytes = {}, 0
        self.timeline, self.peak_activation_bytes, self.peak_in_flight = [], 0, 0
        # Saved tensors that are weights are not activations. (Meta tensors have no storage
        # to tell apart: there, every saved tensor that is not a parameter counts.)
        param_storages = {p.untyped_storage().data_ptr() for p in self.parameters()
                          if not p.is_meta}
        param_ids = {id(p) for p in self.parameters()}
        t0 = _common_clock(self.group)

        for a in actions:
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
                    del self._state[key]  # the piece before on this rank still reads inp.grad
            self.timeline.append(dict(stage=self.rank, kind=a.kind, mb=a.mb, chunk=a.chunk,
                                      start=self._start - t0, end=_now() - t0))
        for work, _ in self._pending:
            work.wait()
        return total


def _input_gradients(s):
    """I: the input's gradient, and on the way the gradient at every layer output that feeds a
    weight (what W needs): autograd skips the weight-gradient products, which nothing asked for.
    retain_graph: W reuses the graph."""
    want = ([s["inp"]] if s["inp"].requires_grad else []) + [o for _, o in s["layers"]]
    got = torch.autograd.grad(_vjp_root(s["out"], s["grad"]), want, retain_graph=True,
                              allow_unused=True) if want else []
    if s["inp"].requires_grad:
        s["inp"].grad, got = got[0], got[1:]
    s["layer_grads"] = list(got)


class _weight_inputs:
    """Inside `with`: record the output of every module of `part` that owns weights (its own,
    not its children's), as (module, output). ZB's split backward then works layer by layer, as
    production implementations do: I stops at these outputs, W multiplies each by its layer's
    input — one weight-gradient product per layer, nothing of the input-gradient work redone."""

    def __init__(self, part):
        self.layers = [m for m in part.modules()
                       if any(q.requires_grad for q in m.parameters(recurse=False))]
        self.outputs = []

    def __enter__(self):
        def keep(module, args, output):
            if isinstance(output, torch.Tensor) and output.requires_grad:
                self.outputs.append((module, output))
        self.handles = [m.register_forward_hook(keep) for m in self.layers]
        return self.outputs

    def __exit__(self, *exc):
        for h in self.handles:
            h.remove()


def _weight_gradients(part, s):
    """W: every weight's gradient from the gradient I left at its layer's output; a weight
    whose layer output was not recorded (a module that returns a tuple) from the stage's
    output instead, walking the graph again. Accumulated into .grad as autograd would."""
    params = [q for q in part.parameters() if q.requires_grad]
    done = set()
    for (module, output), grad in zip(s.get("layers", []), s.get("layer_grads", [])):
        own = [q for q in module.parameters(recurse=False) if q.requires_grad]
        if grad is None or not own:
            continue
        for q, g in zip(own, torch.autograd.grad(output, own, grad, retain_graph=True,
                                                 allow_unused=True)):
            if g is not None:
                q.grad = g if q.grad is None else q.grad + g
        done.update(id(q) for q in own)
    rest = [q for q in params if id(q) not in done]
    if rest and s["out"].requires_grad:
        grads = torch.autograd.grad(_vjp_root(s["out"], s["grad"]), rest, allow_unused=True)
        for q, g in zip(rest, grads):
            if g is not None:
                q.grad = g if q.grad is None else q.grad + g


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
    """Train `model.net` pipelined with `schedule(p, m)` for len(batches) SGD steps (where the
    chunks sit, the schedule says: a ps.Schedule's placement, else "loop"). In the dual placement
    (DualPipe) the model is cut into p pieces, each held by two stages: before the step the two
    copies' gradients are summed (`sum_dual_copies`), and the loss is the sum of the two ends'.

    Returns, per step, this rank's loss (last stage, else None), gradients and parameters after
    the step by full-model name, and the timeline; for tests and the notebook.
    """
    import torch.nn.functional as F
    loss_fn = loss_fn or F.mse_loss
    model = model.to(device=device(), dtype=dtype)
    schedule = schedule(world_size, n_microbatches)
    placement = placement_of(schedule)
    dual = placement == "dual"
    stage = PipelineStage(split_model(model.net, n_pieces(world_size, v, placement)), rank,
                          world_size, in_shape, dtype, placement=placement)
    actions = schedule[rank]
    named = [(f"{prefix}{n}", p) for c in sorted(stage.chunks)
             for n, p in stage.chunks[c].named_parameters()]
    out = []
    for x, y in batches:
        for p in stage.parameters():
            p.grad = None
        x, y = x.to(device(), dtype), y.to(device(), dtype)
        loss = stage.step(actions, x, y, n_microbatches, loss_fn)
        if dual:
            loss = sum_dual_copies(stage, loss)
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


def sum_dual_copies(stage, loss=None):
    """DualPipe holds every piece twice: stage r's chunk 0 and stage p - 1 - r's chunk 1 are
    the same layers, each with the gradient of the micro-batches that crossed it. Swap them with
    the partner stage and add, so both copies hold the whole gradient (and take the same step);
    the two ends' partial losses are summed the same way. Returns the loss on stages 0 and
    p - 1, else None."""
    partner = stage.p - 1 - stage.rank
    peer = dist.get_global_rank(stage.group, partner) if stage.group else partner
    mine = [q.grad if q.grad is not None else torch.zeros_like(q)
            for c in (0, 1) for q in stage.chunks[c].parameters()]
    ends = stage.rank in (0, stage.p - 1)
    if ends:
        mine.append(torch.zeros((), dtype=stage.dtype) if loss is None else loss.detach())
    flat = torch.cat([g.reshape(-1) for g in mine])
    theirs = torch.empty_like(flat)
    send = dist.isend(flat, dst=peer, group=stage.group)
    dist.recv(theirs, src=peer, group=stage.group)
    send.wait()
    sizes = [g.numel() for g in mine]
    ours = sum(q.numel() for q in stage.chunks[0].parameters())    # our chunk 0's numbers
    both = flat.numel() - ends
    # our chunk 0 is the partner's chunk 1 and vice versa: its two parts, swapped
    theirs = torch.cat([theirs[both - ours:both], theirs[:both - ours], theirs[both:]])
    for g, t in zip(mine, theirs.split(sizes)):
        g.add_(t.view_as(g))
    params = [q for c in (0, 1) for q in stage.chunks[c].parameters()]
    for q, g in zip(params, mine):
        q.grad = g
    return mine[-1] if ends else None


# ---- a real-size stage, for the bubble at full size (meta tensors under emulation) ----------------

# Llama-2 7B's block (Touvron et al. 2023, "Llama 2: Open Foundation and Fine-Tuned Chat Models",
# table 1, and config.json of meta-llama/Llama-2-7b-hf): hidden 4096, 32 heads, SwiGLU of 11008,
# RMSNorm, no biases, bf16; 32 blocks. Rotary embeddings are left out (element-wise work on q and
# k, a few per cent of a block's time): a stage here is a pure function of one tensor.
LLAMA2_7B = dict(hidden=4096, heads=32, ffn=11008, layers=32, dtype=torch.bfloat16)


class LlamaBlock(nn.Module):
    """x + attention(norm(x)), then + SwiGLU(norm(x)): one pre-norm Llama block, causal."""

    def __init__(self, hidden, heads, ffn, dtype=torch.bfloat16, **_):
        super().__init__()
        self.heads = heads
        self.norm1 = nn.RMSNorm(hidden, eps=1e-5, dtype=dtype)
        self.qkv = nn.Linear(hidden, 3 * hidden, bias=False, dtype=dtype)
        self.out = nn.Linear(hidden, hidden, bias=False, dtype=dtype)
        self.norm2 = nn.RMSNorm(hidden, eps=1e-5, dtype=dtype)
        self.gate_up = nn.Linear(hidden, 2 * ffn, bias=False, dtype=dtype)
        self.down = nn.Linear(ffn, hidden, bias=False, dtype=dtype)

    def forward(self, x):
        import torch.nn.functional as F
        b, t, d = x.shape
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2)
                   for z in self.qkv(self.norm1(x)).chunk(3, dim=-1))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.out(y.transpose(1, 2).reshape(b, t, d))
        gate, up = self.gate_up(self.norm2(x)).chunk(2, dim=-1)
        return x + self.down(F.silu(gate) * up)


def llama_parts(n_parts, blocks_per_part, mine=None, config=LLAMA2_7B, device="meta"):
    """`n_parts` pipeline pieces of `blocks_per_part` Llama blocks each; only the pieces in
    `mine` are built (on `device`), the others are shape-keeping stand-ins (nn.Identity: a block
    keeps its input's shape), which only tell the receivers what to allocate."""
    with torch.device(device):
        return [nn.Sequential(*(LlamaBlock(**config) for _ in range(blocks_per_part)))
                if mine is None or i in mine else nn.Identity() for i in range(n_parts)]


def real_size_step(rank, world_size, schedule, m, blocks_per_stage=2, tokens=4096, v=1,
                   config=LLAMA2_7B):
    """One training step of a Llama-shaped pipeline on meta tensors: `world_size` stages of
    `blocks_per_stage` blocks (in v chunks), m micro-batches of one `tokens`-long sequence;
    returns this stage's timeline (virtual clock). `schedule`: a name of SCHEDULES, or the
    per-stage lists. Stage 0's input requires grad, so every stage does the same work (the
    bubble formulas assume equal stages); the loss is the output's mean square. A V schedule
    ("ZB-V", "DualPipeV", or a ps.Schedule with placement "v") gets v = 2 chunks in a V;
    "DualPipe" (placement "dual") two whole stages' pieces per rank, r and world_size - 1 - r."""
    from .pipeline_schedules import V_SCHEDULES, dualpipe, interleaved_1f1b, make_schedule
    if isinstance(schedule, str):
        schedule = dualpipe(world_size, m) if schedule == "DualPipe" else \
            V_SCHEDULES[schedule](world_size, m) if schedule in V_SCHEDULES else \
            interleaved_1f1b(world_size, m, v) if v > 1 else \
            make_schedule(schedule, world_size, m)
    placement = placement_of(schedule)
    v = 2 if placement in ("v", "dual") else v
    n = n_pieces(world_size, v, placement)
    parts = llama_parts(n, blocks_per_stage * world_size // n,
                        {virtual_stage(rank, c, world_size, placement) for c in range(v)}, config)
    stage = PipelineStage(parts, rank, world_size, (tokens, config["hidden"]),
                          dtype=config["dtype"], placement=placement)
    with torch.device("meta"):
        x = torch.empty(m, tokens, config["hidden"], dtype=config["dtype"], requires_grad=True)
        y = torch.empty(m, tokens, config["hidden"], dtype=config["dtype"])
    stage.step(schedule[rank], x, y, m, lambda out, target: (out - target).square().mean())
    return stage.timeline


def action_times(build, in_shape, rows, dtype=torch.bfloat16, where="meta", repeats=1):
    """Seconds of F, B, I and W of one micro-batch of `rows` through `build()` — exactly the work
    PipelineStage charges for each action (B: the full backward from the output's gradient; I
    then W: the split one). "W" is the first micro-batch's (no .grad yet); "W+acc" a later one's,
    which adds its weight gradients into .grad.

    where="meta": on this rank's virtual clock (call it inside distlab.run(..., emulate=...),
    with `build` making a meta-device module). Anything else: real time on that device in this
    process, after one warm-up round (a first call pays one-time costs), the median of `repeats`.
    """
    part = build()
    with torch.device(where):
        x = torch.randn(rows, *in_shape, dtype=dtype, requires_grad=True)
    if where == "meta":
        return _time_actions(part, x, trace.now)
    clock = time.perf_counter
    _time_actions(part, x, clock)                               # warm-up
    runs = [_time_actions(part, x, clock) for _ in range(repeats)]
    return {k: sorted(r[k] for r in runs)[len(runs) // 2] for k in runs[0]}


def _time_actions(part, x, now):
    for q in part.parameters():
        q.grad = None
    times = {}
    start = now()
    out = part(x)
    times["F"] = now() - start
    grad = torch.ones_like(out)
    start = now()
    _vjp_root(out, grad).backward()
    times["B"] = now() - start
    for q in part.parameters():
        q.grad = None
    with _weight_inputs(part) as layers:
        out = part(x)
    s = {"out": out, "grad": grad, "layers": layers}
    start = now()
    got = torch.autograd.grad(_vjp_root(out, grad), [x] + [o for _, o in layers],
                              retain_graph=True)
    s["layer_grads"] = list(got[1:])
    times["I"] = now() - start
    start = now()
    _weight_gradients(part, s)              # .grad is None: the first micro-batch
    times["W"] = now() - start
    start = now()
    _weight_gradients(part, s)              # .grad exists: every later micro-batch adds to it
    times["W+acc"] = now() - start
    return times


def weight_grad_seconds(rows, d_in, d_out, dtype=torch.float32, where="cpu", repeats=5):
    """One Linear layer's weight gradient dW = dYᵀ·X for a micro-batch of `rows`, three ways:

    "GEMM"      the product alone (the first micro-batch: .grad is just set);
    "GEMM, +="  the product, then .grad = .grad + dW (what autograd's accumulation does for every
                later micro-batch: one more pass that reads .grad and dW and writes .grad);
    "fused"     addmm(.grad, dYᵀ, X, out=.grad): the GEMM adds into .grad as it writes (beta = 1), what
                Megatron's gradient_accumulation_fusion does into its fp32 main_grad.

    where="meta": on the virtual clock (inside an emulated run); else real time in this process,
    after a warm-up, the median of `repeats`."""
    with torch.device(where):
        x = torch.randn(rows, d_in, dtype=dtype)
        dy = torch.randn(rows, d_out, dtype=dtype)
        grad = torch.zeros(d_out, d_in, dtype=dtype)
    now = trace.now if where == "meta" else time.perf_counter

    def once():
        nonlocal grad
        times = {}
        start = now()
        dw = dy.t() @ x
        times["GEMM"] = now() - start
        start = now()
        grad = grad + dy.t() @ x
        times["GEMM, +="] = now() - start
        start = now()
        # out= rather than addmm_: the same kernel, and the emulator knows addmm's GEMM shape
        torch.addmm(grad, dy.t(), x, out=grad)
        times["fused"] = now() - start
        del dw
        return times
    if where == "meta":
        return once()
    once()
    runs = [once() for _ in range(repeats)]
    return {k: sorted(r[k] for r in runs)[len(runs) // 2] for k in runs[0]}


def message_seconds(cluster, nbytes, ranks=(0, 1)):
    """What one stage-to-stage message of `nbytes` costs on `cluster` between global `ranks`."""
    from .emulate import comm_seconds, resolve
    cluster = resolve(cluster)
    return comm_seconds("send", nbytes, 2, cluster.link_between(ranks))
