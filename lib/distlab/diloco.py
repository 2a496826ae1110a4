"""Local SGD and DiLoCo: communicate every H steps instead of every step.

Data parallelism (chapter 05) averages gradients at every step, so every step waits for an
all-reduce of the whole model. Over a slow link between two sites that is most of the step. Local
SGD lets each replica take H optimizer steps on its own data with no communication at all (the
INNER steps), then brings the replicas back together (the OUTER step):

    global    the parameters every replica agreed on at the last outer step
    delta     global - local, this replica's PSEUDO-GRADIENT: where its H inner steps went, negated
    mean      all-reduce(delta) / N, the only communication, once per H steps
    global    an outer optimizer steps `global` with `mean` as its gradient; every replica copies it

With the outer optimizer plain SGD at learning rate 1 the outer step is `global - mean`, the
average of the replicas' parameters: classic local SGD (periodic model averaging). DiLoCo
(Douillard et al. 2023, arXiv:2311.08105) uses AdamW inside and SGD with Nesterov momentum outside
(lr 0.7, momentum 0.9 in the paper) and communicates every H = 500 steps or so.

H = 1 with outer SGD at lr 1 and inner SGD is exactly DDP: after one inner step
local = global - lr * g_i, so mean = lr * mean(g_i) and the outer step gives global - lr * mean(g),
DDP's step (`tests/test_ch13.py` proves it at 1, 2, 3 and 5 ranks, in float64).

Streaming DiLoCo (Douillard et al. 2025, arXiv:2501.18512) splits the parameters into F fragments
and synchronises fragment f at steps where (step - offset_f) % H == 0, offsets spread over H: the
same bytes per H steps, but in F smaller messages, so the peak bandwidth a link must carry drops
by F. It also overlaps each fragment's all-reduce with the next inner steps: with `overlap=τ` a
fragment's pseudo-gradient is captured and its all-reduce launched (async_op=True) at its turn,
the replica takes τ more inner steps while it travels, and only then does the outer step land.
The replica's parameters moved meanwhile; the paper mixes them with the outer result by a factor
α (α = 0 takes the outer result and drops those τ steps). We keep them: the fragment becomes the
new global copy plus the local drift since the launch, so every inner step counts in exactly one
outer step (τ = 0 is the plain outer step, bit for bit).

Low-bit outer steps: `outer_dtype="int8"` (INTELLECT-1's choice) or `"int4"` (Streaming DiLoCo
sends 4-bit floats) replaces the all-reduce by `compression.LowBitMean`: blockwise absmax
integers, all-gathered and averaged on every rank (1 or 1/2 byte a value plus a 4-byte scale per
`block` values on the wire); the outer optimizer still steps in the parameters' dtype.
"""
import torch
import torch.distributed as dist

from .compression import BITS, LowBitMean


def nesterov(params, lr=0.7, momentum=0.9):
    """DiLoCo's outer optimizer: SGD with Nesterov momentum (the paper's lr and momentum)."""
    return torch.optim.SGD(params, lr=lr, momentum=momentum, nesterov=True)


def plain_average(params):
    """Local SGD's outer step: SGD at lr 1, no momentum, i.e. replace by the replicas' mean."""
    return torch.optim.SGD(params, lr=1.0)


class DiLoCo:
    """Wrap a replica's model: call `step()` after each inner optimizer step.

    H:          inner steps between synchronisations.
    outer:      a function of a parameter list returning the outer optimizer (`nesterov`,
                `plain_average`, or any torch optimizer's constructor).
    fragments:  F > 1 is streaming DiLoCo: the parameters are cut into F contiguous groups, and
                group f synchronises at steps s with (s - f * H // F) % H == 0 (s counted from 1;
                a fragment's first sync after fewer than H steps is allowed).
    group:      the process group of the replicas (the world by default).
    outer_dtype: None (the default) all-reduces the pseudo-gradients in the parameters' dtype;
                "int8" or "int4" sends them blockwise-quantized (`block` values a scale), with
                `error_feedback` optional (what the quantizer dropped joins the next outer step).
    overlap:    τ inner steps between a fragment's launch (pseudo-gradient captured, all-reduce
                async) and its outer step (0 <= τ < H; 0, the default, syncs at once); call
                `finish()` after the last step to land the outer steps still in flight.
    The replicas must start identical (broadcast first). `syncs` counts outer steps, and
    `bytes_sent` the pseudo-gradient bytes this rank put into all-reduces.
    """

    def __init__(self, model, H, outer=nesterov, fragments=1, group=None, outer_dtype=None,
                 block=128, error_feedback=False, overlap=0):
        for name, v, least in (("H", H, 1), ("fragments", fragments, 1), ("overlap", overlap, 0)):
            if isinstance(v, bool) or not isinstance(v, int) or v < least:
                raise ValueError(f"{name} must be a whole number >= {least}; got {v!r}.")
        if overlap >= H:
            raise ValueError(f"overlap={overlap} must be less than H={H}: a fragment's outer step "
                             f"must land before its next turn.")
        if overlap and outer_dtype is not None:
            raise ValueError("overlap runs the fp all-reduce asynchronously; the low-bit mean "
                             "(outer_dtype) is a blocking all-gather: choose one of them.")
        params = [p for p in model.parameters() if p.requires_grad]
        if fragments > len(params):
            raise ValueError(f"fragments={fragments} is more than the model's {len(params)} "
                             f"parameter tensors; every fragment needs at least one.")
        if outer_dtype not in (None, *BITS):
            raise ValueError(f"outer_dtype must be None, 'int8' or 'int4'; got {outer_dtype!r}.")
        self.low_bit = None if outer_dtype is None else \
            LowBitMean(BITS[outer_dtype], block, error_feedback, group)
        self.model, self.H, self.group = model, H, group
        self.world_size = dist.get_world_size(group)
        size = -(-len(params) // fragments)
        self.fragments = [params[i:i + size] for i in range(0, len(params), size)]
        # the agreed (global) copy of each fragment, and its own outer optimizer
        self.globals = [[p.detach().clone() for p in frag] for frag in self.fragments]
        self.outers = [outer(g) for g in self.globals]
        self.offsets = [f * H // len(self.fragments) for f in range(len(self.fragments))]
        self.overlap, self.in_flight = overlap, []    # in flight: (due step, launch's state)
        self.inner_steps = self.syncs = self.bytes_sent = 0

    def step(self):
        """Count an inner step; land the outer steps due now; synchronise (or, with overlap,
        launch) the fragments whose turn it is."""
        self.inner_steps += 1
        while self.in_flight and self.in_flight[0][0] == self.inner_steps:
            self.land(*self.in_flight.pop(0)[1])
        for f in range(len(self.fragments)):
            if (self.inner_steps - self.offsets[f]) % self.H == 0:
                if self.overlap:
                    self.in_flight.append((self.inner_steps + self.overlap, self.launch(f, True)))
                else:
                    self.sync(f)

    def finish(self):
        """Land the outer steps still in flight (after the last inner step)."""
        while self.in_flight:
            self.land(*self.in_flight.pop(0)[1])

    @torch.no_grad()
    def sync(self, f=0):
        """The outer step of fragment f, at once: average the pseudo-gradients (`launch`), step
        the global copy with the outer optimizer, copy it into the model (`land`)."""
        self.land(*self.launch(f, False))

    @torch.no_grad()
    def launch(self, f, async_op):
        """Capture fragment f's pseudo-gradient and start averaging it; with async_op, also keep
        the local parameters as they are now (the drift is measured from them)."""
        local, agreed = self.fragments[f], self.globals[f]
        deltas = torch.cat([(g - p).reshape(-1) for g, p in zip(agreed, local)])
        at_launch = [p.detach().clone() for p in local] if async_op else None
        work = None
        if self.low_bit is None:                            # one message per fragment
            work = dist.all_reduce(deltas, group=self.group, async_op=async_op)
            self.bytes_sent += deltas.numel() * deltas.element_size()
        else:                                               # int8 / int4 payloads, all-gathered
            sent = self.low_bit.bytes_sent
            deltas = self.low_bit.mean(deltas, key=f)
            self.bytes_sent += self.low_bit.bytes_sent - sent
        return f, work, deltas, at_launch

    @torch.no_grad()
    def land(self, f, work, deltas, at_launch):
        """Wait for the sum, step the global copy with the outer optimizer, and set the model's
        fragment to it (plus, with overlap, the local drift since the launch)."""
        local, agreed = self.fragments[f], self.globals[f]
        if work is not None:
            work.wait()
        if self.low_bit is None:
            deltas /= self.world_size
        for g, d in zip(agreed, deltas.split([g.numel() for g in agreed])):
            g.grad = d.view_as(g).clone()
        self.outers[f].step()
        for i, (g, p) in enumerate(zip(agreed, local)):
            if at_launch is None:
                p.copy_(g)
            else:                                           # global + (local now - local then)
                p.sub_(at_launch[i]).add_(g)
        self.syncs += 1


def train(model, batches, inner, H=None, outer=nesterov, fragments=1, group=None, **options):
    """Train this rank's replica on `batches` (a list of (x, y)) with MSE loss: DDP (gradients
    averaged every step) when H is None, DiLoCo with H inner steps otherwise (`options`: DiLoCo's
    outer_dtype, block, error_feedback, overlap; outer steps still in flight land at the end).
    `inner` is a function of the parameters returning the inner optimizer. Returns the per-step
    losses of this rank (before each step) and the DiLoCo wrapper (None for DDP)."""
    import torch.nn.functional as F
    from .data_parallel import average_gradients, broadcast_parameters
    broadcast_parameters(model, group=group)
    opt = inner(model.parameters())
    wrapper = None if H is None else DiLoCo(model, H, outer, fragments, group, **options)
    losses = []
    for x, y in batches:
        opt.zero_grad()
        loss = F.mse_loss(model(x), y)
        loss.backward()
        if wrapper is None:
            average_gradients(model, group=group)
        opt.step()
        if wrapper is not None:
            wrapper.step()
        losses.append(loss.item())
    if wrapper is not None:
        wrapper.finish()
    return losses, wrapper
