"""Gradient compression for data parallelism: send fewer bytes, and keep what was not sent.

Chapter 05's DDP all-reduces every gradient in full: 4 bytes per parameter per step (fp32). Over
a slow link that is the step. Two ways to send less:

- a narrower dtype: cast to fp16/bf16, all-reduce, cast back (torch's `fp16_compress_hook`):
  half the bytes, a rounding error of about 2^-11 (fp16) or 2^-8 (bf16) of each value;
- a low-rank approximation, PowerSGD (Vogels, Karimireddy and Jaggi, NeurIPS 2019): a gradient
  matrix M (n x m) is sent as two thin matrices P (n x r) and Q (m x r), (n + m) r numbers instead
  of n m. One power-iteration step per training step finds them:

      P = M Q          all-reduce P (mean)     P = orthonormal columns spanning P
      Q = M^T P        all-reduce Q (mean)     M is replaced by P Q^T

  Because every rank multiplies by the same Q and P, and the products are linear in M, the two
  all-reduces of thin matrices give the approximation of the MEAN gradient. Q is kept from one
  step to the next (warm start), so the power iteration keeps refining the same subspace.

Error feedback: what the approximation dropped, M - P Q^T, is kept on each rank and added to the
next step's gradient. Then the sum of what was applied over T steps equals the sum of the exact
mean gradients minus the mean of the ranks' error buffers after step T (`PowerSGD` keeps them):
the error no longer accumulates, it stays as large as one buffer.

`PowerSGD.average(model)` replaces chapter 05's `average_gradients` after backward.
"""
import torch
import torch.distributed as dist


def orthonormalize(p):
    """Columns of `p` replaced (in place) by an orthonormal basis of their span, through a
    Householder QR in float64 (Gram-Schmidt in float32 loses orthogonality when P is nearly
    rank-deficient, which a full-rank P of a real gradient is); returns `p`."""
    q, _ = torch.linalg.qr(p.double())
    return p.copy_(q)


class PowerSGD:
    """Low-rank all-reduce of a model's gradients, from scratch.

    rank:            r, the number of columns of P and Q (min(n, m) is exact, below).
    error_feedback:  keep M - P Q^T per rank and add it to the next gradient.
    seed:            Q starts as the same random matrix on every rank (it must: the ranks'
                     products are averaged, which is only meaningful for one shared Q).
    Tensors with fewer than 2 dimensions (biases) and matrices for which (n + m) r >= n m (no
    saving) are all-reduced exactly, as torch's hook does -- except at r >= min(n, m), where a
    matrix still goes as P and Q: no saving, but the case that proves the method exact. `bytes_sent` counts the payload
    this rank put into all-reduces, summed over steps (the compressed and the exact ones).
    """

    def __init__(self, model, rank=1, error_feedback=True, seed=0, group=None):
        if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
            raise ValueError(f"rank must be a whole number >= 1; got {rank!r}.")
        self.model, self.rank, self.error_feedback, self.group = model, rank, error_feedback, group
        self.world_size = dist.get_world_size(group)
        self.errors, self.qs = {}, {}
        self.bytes_sent = 0
        g = torch.Generator().manual_seed(seed)
        for name, p in model.named_parameters():
            if self.compresses(p):
                n, m = p.shape[0], p[0].numel()
                self.qs[name] = torch.randn(m, min(rank, n, m), generator=g, dtype=p.dtype)

    def compresses(self, p):
        """Whether parameter `p`'s gradient goes as P and Q (else it goes whole)."""
        if p.dim() < 2:
            return False
        n, m = p.shape[0], p[0].numel()
        return (n + m) * min(self.rank, n, m) < n * m or self.rank >= min(n, m)

    def _mean(self, t):
        dist.all_reduce(t, group=self.group)
        self.bytes_sent += t.numel() * t.element_size()
        return t.div_(self.world_size)

    def average(self, model=None):
        """After backward: every gradient replaced by (an approximation of) its mean over ranks."""
        for name, p in (model or self.model).named_parameters():
            if p.grad is None:
                continue
            if name not in self.qs:
                self._mean(p.grad)
                continue
            m = p.grad.reshape(p.shape[0], -1)              # a view: writing m writes p.grad
            if self.error_feedback and name in self.errors:
                m += self.errors[name]                      # what earlier steps did not send
            local = m.clone()
            q = self.qs[name]
            pm = self._mean(m @ q)                          # n x r, the mean of M_i Q
            orthonormalize(pm)
            q.copy_(self._mean(m.t() @ pm))                 # m x r, the mean of M_i^T P
            m.copy_(pm @ q.t())                             # the approximation of the mean
            if self.error_feedback:
                self.errors[name] = local - m               # kept here, sent next time
        return self

    def error_norm(self):
        """The norm of this rank's error buffers, all matrices together (0 before any step)."""
        return float(sum((e.double() ** 2).sum() for e in self.errors.values())) ** 0.5


def bytes_per_step(model, rank=None, dtype_bytes=4):
    """The all-reduce payload per rank per step: every gradient whole (rank=None), or PowerSGD
    at `rank` (P and Q for each matrix it compresses, the rest whole), `dtype_bytes` per number."""
    total = 0
    for p in model.parameters():
        if not p.requires_grad:
            continue
        if rank is None or p.dim() < 2:
            total += p.numel()
            continue
        n, m = p.shape[0], p[0].numel()
        r = min(rank, n, m)
        total += (n + m) * r if (n + m) * r < n * m or rank >= min(n, m) else n * m
    return total * dtype_bytes


def relative_error(approx, exact):
    """||approx - exact|| / ||exact|| over lists of tensors (gradients of a model)."""
    num = sum(float(((a.double() - e.double()) ** 2).sum()) for a, e in zip(approx, exact))
    den = sum(float((e.double() ** 2).sum()) for e in exact)
    return (num / den) ** 0.5 if den else float(num > 0)



def accumulated_gap(gradient, steps, rank=1, error_feedback=True, group=None):
    """Error feedback, measured. `gradient(step)` gives this rank's gradient matrix at each step;
    PowerSGD at `rank` sends it. Returns, per step, the norm of the accumulated gap
    sum_t (exact mean_t - applied_t) and the norm of the mean of the ranks' error buffers (with
    error feedback the two are equal: the gap is the error still held back, never more)."""
    world_size = dist.get_world_size(group)
    shape = gradient(0).shape
    holder = torch.nn.Linear(shape[1], shape[0], bias=False).to(gradient(0).dtype)
    compressor = PowerSGD(holder, rank=rank, error_feedback=error_feedback, group=group)
    gap, gaps, held = torch.zeros(shape, dtype=holder.weight.dtype), [], []
    for step in range(steps):
        g = gradient(step)
        exact = g.clone()
        dist.all_reduce(exact, group=group)
        holder.weight.grad = g.clone()
        compressor.average()
        gap += exact / world_size - holder.weight.grad
        mean_error = compressor.errors.get("weight", torch.zeros(shape, dtype=gap.dtype)).clone()
        dist.all_reduce(mean_error, group=group)
        gaps.append(float(gap.norm()))
        held.append(float((mean_error / world_size).norm()))
    return gaps, held


# ---- low-bit all-reduce: DiLoCo's outer gradients in int8 or 4 bits --------------------------
#
# INTELLECT-1 (Jaghouar et al. 2024, arXiv:2412.01152) all-reduced its DiLoCo pseudo-gradients with
# "our custom int8 all-reduce"; Streaming DiLoCo (Douillard et al. 2025, arXiv:2501.18512) sends
# its outer gradients in 4-bit floats and accumulates in fp32. Neither scheme is copied here: ours
# is the plainest one that shows the idea, BLOCKWISE ABSMAX integers (each block of `block` values
# gets one fp32 scale, absmax / 127 for int8 or / 7 for 4 bits; a value goes as round(x / scale)).
# The all-reduce is an ALL-GATHER of every rank's compact payload, then each rank dequantizes all
# of them and averages locally, in rank order: every rank gets the same mean, the wire carries
# only low-bit values and scales, and nothing is re-quantized on the way (a reduce-scatter of
# low-bit values would need a partial sum re-quantized at each hop, a second rounding). The price:
# a rank receives N - 1 payloads, where a ring all-reduce receives 2 (N - 1) / N of a buffer -- the
# same at 2 sites, worse with many members.
BITS = {"int8": 8, "int4": 4}


def payload_bytes(numel, bits=32, block=None):
    """Bytes one rank contributes to an outer synchronisation of `numel` values at `bits` bits:
    numel * bits / 8 with no scales (block=None, the closed form `across_sites` prices), plus one
    fp32 scale per block of `block` values when the values go blockwise-quantized."""
    if block is None:
        return numel * bits / 8
    return -(-numel * bits // 8) + 4 * -(-numel // block)


def _check(t, bits, block):
    if not isinstance(t, torch.Tensor) or not t.is_floating_point():
        raise TypeError(f"low-bit quantization needs a floating-point tensor; got "
                        f"{getattr(t, 'dtype', type(t).__name__)}.")
    if bits not in (8, 4):
        raise ValueError(f"bits must be 8 or 4; got {bits!r}.")
    if isinstance(block, bool) or not isinstance(block, int) or block < 1:
        raise ValueError(f"block must be a whole number >= 1; got {block!r}.")
    if bits == 4 and block % 2:
        raise ValueError(f"at 4 bits block must be even (two values share a byte, and a block must "
                         f"not end mid-byte); got {block}.")


def quantize(t, bits=8, block=128):
    """`t` (any shape, floating point) as one uint8 payload: the fp32 scales of its blocks, then
    the values, one byte each (int8) or two to a byte (4 bits, stored as q + 8 in 0..15)."""
    _check(t, bits, block)
    x, qmax = t.detach().reshape(-1), 2 ** (bits - 1) - 1
    blocks = torch.nn.functional.pad(x, (0, -x.numel() % block)).view(-1, block)
    scale = (blocks.abs().amax(1) / qmax).float()                 # fp32: what the wire carries
    s = scale.to(x.dtype)[:, None]
    q = torch.round(blocks / torch.where(s > 0, s, 1)).clamp(-qmax, qmax)
    q = q.reshape(-1)[:x.numel()].to(torch.int8)
    if bits == 8:
        packed = q.view(torch.uint8)
    else:
        u = torch.nn.functional.pad((q + 8).to(torch.uint8), (0, q.numel() % 2))
        packed = u[0::2] | (u[1::2] << 4)
    return torch.cat([scale.view(torch.uint8), packed])


def dequantize(payload, numel, bits=8, block=128, dtype=torch.float32):
    """The `numel` values a `quantize` payload stands for, as `dtype`: q * scale of its block."""
    blocks = -(-numel // block)
    scale = payload[:4 * blocks].clone().view(torch.float32)     # clone: a view needs alignment
    packed = payload[4 * blocks:]
    if bits == 8:
        q = packed.view(torch.int8).to(dtype)
    else:
        q = torch.stack([packed & 15, packed >> 4], 1).reshape(-1)[:numel].to(dtype) - 8
    q = torch.nn.functional.pad(q, (0, -numel % block)).view(blocks, block)
    return (q * scale.to(dtype)[:, None]).reshape(-1)[:numel]


class LowBitMean:
    """The mean over the ranks of `group` of a flat tensor, sent as `bits`-bit blockwise payloads
    (all-gathered, dequantized and averaged in rank order on every rank).

    error_feedback:  as PowerSGD's: add what the quantizer dropped last time (kept per `key`) to
                     the tensor before quantizing, and keep the new remainder.
    `bytes_sent` counts this rank's payloads (`payload_bytes`); the all-gather hands each rank
    the N payloads, N times that."""

    def __init__(self, bits=8, block=128, error_feedback=False, group=None):
        _check(torch.zeros(0), bits, block)
        self.bits, self.block, self.error_feedback, self.group = bits, block, error_feedback, group
        self.world_size = dist.get_world_size(group)
        self.errors, self.bytes_sent = {}, 0

    def mean(self, t, key=0):
        _check(t, self.bits, self.block)
        x = t.reshape(-1)
        if self.error_feedback and key in self.errors:
            x = x + self.errors[key]
        payload = quantize(x, self.bits, self.block)
        gathered = torch.empty(self.world_size * payload.numel(), dtype=torch.uint8)
        dist.all_gather_single(gathered, payload, group=self.group)
        self.bytes_sent += payload.numel()
        values = [dequantize(p, x.numel(), self.bits, self.block, x.dtype)
                  for p in gathered.view(self.world_size, -1)]
        if self.error_feedback:
            self.errors[key] = x - values[dist.get_rank(self.group)]
        total = values[0].clone()
        for v in values[1:]:
            total += v
        return (total / self.world_size).view_as(t)
