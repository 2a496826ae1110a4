"""A Llama block at real size, tensor parallel, and its time in closed form."""
import torch
import torch.nn as nn
import torch.nn.functional as F

from .. import _argcheck as check
from .layers import ColumnParallelLinear, RowParallelLinear, per_rank


class ParallelLlamaBlock(nn.Module):
    """A Llama block (distlab.zero_memory.LlamaBlock: RMSNorm, rotary, causal flash attention,
    SwiGLU, no biases) tensor parallel over `group`, Megatron's layout: q/k/v and gate/up
    column-parallel (each stacked matrix split on its own), the output and down projections
    row-parallel: one all-reduce after attention and one after the MLP in forward, one into
    each region's input in backward. Builds on the meta device for real sizes."""

    def __init__(self, hidden, heads, ffn, group=None, eps=1e-5, dtype=None):
        super().__init__()
        self.local_heads, self.head_dim = per_rank(heads, group, "heads"), hidden // heads
        self.norm1 = nn.RMSNorm(hidden, eps=eps, dtype=dtype)
        self.qkv = ColumnParallelLinear(hidden, 3 * hidden, group, bias=False, chunks=3,
                                        dtype=dtype)
        self.out = RowParallelLinear(hidden, hidden, group, bias=False, dtype=dtype)
        self.norm2 = nn.RMSNorm(hidden, eps=eps, dtype=dtype)
        self.gate_up = ColumnParallelLinear(hidden, 2 * ffn, group, bias=False, chunks=2,
                                            dtype=dtype)
        self.down = RowParallelLinear(ffn, hidden, group, bias=False, dtype=dtype)

    def forward(self, x, cos, sin):
        from ..zero_memory import rotary
        b, s, _ = x.shape
        q, k, v = (z.view(b, s, self.local_heads, self.head_dim).transpose(1, 2)
                   for z in self.qkv(self.norm1(x)).chunk(3, dim=-1))
        q, k = rotary(q, cos, sin), rotary(k, cos, sin)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.out(y.transpose(1, 2).reshape(b, s, self.local_heads * self.head_dim))
        gate, up = self.gate_up(self.norm2(x)).chunk(2, dim=-1)
        return x + self.down(F.silu(gate) * up)


def tp_block_seconds(cluster, tp, tokens, hidden=4096, heads=32, ffn=11008,
                     dtype=torch.bfloat16):
    """{"compute", "comm"}: modeled seconds of one ParallelLlamaBlock's forward + backward on the
    first `tp` ranks of `cluster` with `tokens` tokens: each rank's matmul slices at the
    device's shape-dependent rate (Device.gemm_seconds) and its heads' causal flash attention,
    backward twice the forward; four all-reduces of the (tokens × hidden) activation on the
    link the group sees (Cluster.link_between: NVLink SHARP inside an H100 node, one ring per
    NIC across nodes). The formulas the emulator charges; elementwise work is left out."""
    tp = _check_split(tp, tokens, hidden, heads, ffn)
    dev = cluster.device
    mm = sum(dev.gemm_seconds(tokens, n, k, dtype) for n, k in
             ((3 * hidden // tp, hidden), (hidden, hidden // tp), (2 * ffn // tp, hidden),
              (hidden, ffn // tp)))
    d, a = hidden // heads, heads // tp
    attn = 2.0 * tokens * tokens * d * a / (dev.peak(dtype)
                                            * dev.gemm_efficiency(tokens, tokens, d, dtype, a))
    nbytes = tokens * hidden * torch.empty((), dtype=dtype).element_size()
    link = cluster.link_between(range(tp))
    comm = 4 * link.seconds("all_reduce", nbytes, tp) if tp > 1 else 0.0
    return {"compute": 3 * (mm + attn), "comm": comm}


def _check_split(tp, tokens, hidden, heads, ffn):
    tp = check.whole(tp, "tp", at_least=1)
    check.whole(tokens, "tokens", at_least=1)
    for name, n in (("heads", heads), ("hidden", hidden), ("ffn", ffn)):
        if check.whole(n, name, at_least=1) % tp:
            raise ValueError(f"tp={tp} does not divide {name}={n}: each rank holds 1/tp of "
                             f"them; choose a tp that divides {name}.")
    return tp


def comm_bound_width(tp, rate, busbw, weights_per_d2=12.0):
    """The hidden size d below which a tensor-parallel block is communication-bound: its four
    all-reduces (forward and backward) take longer than its matmuls. Tokens cancel.

    Per block and T tokens, with hidden size d and k·d² weights (k = 12 for a GPT block, 4d²
    attention + 8d² MLP; 4 + 3·ffn/d for Llama's SwiGLU): each rank computes 6·k·d²·T/tp FLOPs
    (forward + backward) at the achieved rate C, and sends four all-reduces of the bf16
    activation, S = 2·T·d bytes, each 2(tp−1)/tp · S through every GPU at the bus bandwidth W:

        comm / compute = [4 · 2(tp−1)/tp · 2Td / W] / [6·k·d²·T / (tp·C)]
                       = 8(tp−1)·C / (3·k·d·W)         (2(tp−1)C / (9dW) for k = 12)

    equal to 1 at

        d* = 8(tp−1)·C / (3·k·W).

    T appears on both sides and cancels: unlike data parallelism and ZeRO, more tokens per GPU
    do not rescue TP — only a wider model or a faster link. Written as chapter 07 writes it,
    each all-reduce is waited on by the next op, so below d* the step is mostly waiting; above
    it the communication is still on the critical path (comm/compute < 1, not 0) unless the
    matmuls are split to overlap it (async TP). Attention's own FLOPs and the collectives'
    latency are left out."""
    if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
        raise ValueError(f"tp must be a whole number >= 1; got {tp!r}.")
    for name, value in (("rate", rate), ("busbw", busbw), ("weights_per_d2", weights_per_d2)):
        if not (isinstance(value, (int, float)) and value == value and 0 < value < float("inf")):
            raise ValueError(f"{name} must be a positive number; got {value!r}.")
    return 8 * (tp - 1) * rate / (3 * weights_per_d2 * busbw)


def tp_width_step(rank, world_size, widths, tokens):
    """For each hidden size d in `widths`: this rank's emulated seconds of a column-parallel
    (d → 4d) then row-parallel (4d → d) pair of bf16 matmuls, forward + backward, over all
    ranks on meta tensors — Megatron's MLP without its nonlinearity, so that the compute is the
    matmuls the closed form counts: one all-reduce forward, one backward, for 8·d² weights
    (as four per 16·d²: comm_bound_width(..., weights_per_d2=16)). Each width runs inside a
    trace span named f"d={d}" (the notebook reads its all-reduces from the trace)."""
    from .. import trace
    out = []
    for d in widths:
        with torch.device("meta"):
            up = ColumnParallelLinear(d, 4 * d, bias=False, dtype=torch.bfloat16)
            down = RowParallelLinear(4 * d, d, bias=False, dtype=torch.bfloat16)
            x = torch.randn(tokens, d, dtype=torch.bfloat16, requires_grad=True)
        start = trace.now()
        with trace.span(f"d={d}"):
            y = down(up(x))
            y.backward(torch.ones_like(y))
        out.append(trace.now() - start)
    return out
