"""Real size on meta tensors under emulation: a pipeline of Llama-2 7B blocks, and what one
action, one weight-gradient product and one stage-to-stage message cost."""
import time

import torch
import torch.nn as nn

from .. import trace
from ..pipeline_schedules import (V_SCHEDULES, dualpipe, interleaved_1f1b, make_schedule,
                                  n_pieces, placement_of, virtual_stage)
from .split_backward import _vjp_root, _weight_gradients, _weight_inputs
from .stage import PipelineStage

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
    from ..emulate import comm_seconds, resolve
    cluster = resolve(cluster)
    return comm_seconds("send", nbytes, 2, cluster.link_between(ranks))
