"""The Llama block as eager PyTorch runs it, its parameters, and what it saves for backward."""
import torch
import torch.nn as nn
import torch.nn.functional as F

from .. import memory


# Llama 2 7B: Touvron et al. 2023 ("Llama 2: Open Foundation and Fine-Tuned Chat Models"),
# table 1, and config.json of meta-llama/Llama-2-7b-hf: 32 layers, hidden 4096, 32 heads,
# SwiGLU intermediate size 11008, vocabulary 32000, untied embedding and LM head, RMSNorm.
LLAMA2_7B = dict(layers=32, hidden=4096, heads=32, ffn=11008, vocab=32000)


class LlamaBlock(nn.Module):
    """One Llama block as eager PyTorch runs it: RMSNorm, fused q/k/v projection, rotary
    embeddings, causal scaled_dot_product_attention (flash), output projection, RMSNorm,
    SwiGLU (fused gate/up projection, SiLU, product, down projection); no biases, no dropout.
    Builds on the meta device as well (`with torch.device("meta")`)."""

    def __init__(self, hidden, heads, ffn, eps=1e-5, dtype=None, kv_heads=None):
        super().__init__()
        kv_heads = kv_heads or heads
        if hidden % heads or heads % kv_heads:
            raise ValueError(f"hidden = {hidden} must split into {heads} heads, and the heads "
                             f"into groups of {kv_heads} K/V heads (grouped-query attention).")
        self.heads, self.kv_heads = heads, kv_heads
        kv = kv_heads * (hidden // heads)
        self.norm1 = nn.RMSNorm(hidden, eps=eps, dtype=dtype)
        self.qkv = nn.Linear(hidden, hidden + 2 * kv, bias=False, dtype=dtype)
        self.out = nn.Linear(hidden, hidden, bias=False, dtype=dtype)
        self.norm2 = nn.RMSNorm(hidden, eps=eps, dtype=dtype)
        self.gate_up = nn.Linear(hidden, 2 * ffn, bias=False, dtype=dtype)
        self.down = nn.Linear(ffn, hidden, bias=False, dtype=dtype)

    def forward(self, x, cos, sin):
        b, s, h = x.shape
        d = h // self.heads
        q, k, v = self.qkv(self.norm1(x)).split([h, self.kv_heads * d, self.kv_heads * d], -1)
        q = q.view(b, s, self.heads, d).transpose(1, 2)
        k, v = (z.view(b, s, self.kv_heads, d).transpose(1, 2) for z in (k, v))
        q, k = rotary(q, cos, sin), rotary(k, cos, sin)
        # enable_gqa: each K/V head serves heads/kv_heads query heads without a repeated copy
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                           enable_gqa=self.kv_heads != self.heads)
        x = x + self.out(y.transpose(1, 2).reshape(b, s, h))
        gate, up = self.gate_up(self.norm2(x)).chunk(2, dim=-1)
        return x + self.down(F.silu(gate) * up)


def rotary(x, cos, sin):
    """Rotary position embedding (Su et al. 2021), the half-split form Llama's code uses."""
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


def rotary_tables(seq_len, head_dim, dtype=None, base=10000.0):
    """cos and sin of the rotary angles, (seq_len, head_dim), in `dtype`."""
    inv = 1.0 / base ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    angles = torch.outer(torch.arange(seq_len, dtype=torch.float32), inv).repeat(1, 2)
    return angles.cos().to(dtype), angles.sin().to(dtype)


def llama_block_params(hidden, ffn):
    """Parameters of one block: q, k, v and output projections, gate/up/down, two norms."""
    return 4 * hidden * hidden + 3 * hidden * ffn + 2 * hidden


def llama_params(layers, hidden, heads, ffn, vocab):
    """All parameters: the blocks, the embedding and the (untied) LM head, the final norm."""
    return layers * llama_block_params(hidden, ffn) + 2 * vocab * hidden + hidden


# The count lives in distlab.memory (the calculator's presets count a Llama block with it, and
# memory must not import this module); this module names which RMSNorm kernel ran.
NORM_KERNELS = ("composite", "fused")


def llama_activations(seq_len, batch, hidden, heads, ffn, bytes_per_value=2, recompute="none",
                      kv_heads=None, norm="composite"):
    """memory.llama_activations, for the RMSNorm kernel that ran.

    norm="composite": what this CPU build runs (and HF's LlamaRMSNorm, which casts to float32
    by hand): each norm keeps its input and its normalised value in float32, and 1/rms.
    norm="fused": torch.rms_norm on a CUDA tensor whose weight has the input's dtype calls
    aten::_fused_rms_norm, whose autograd node (FusedRmsNormBackward0) saves only the input in
    its own dtype, the weight (a parameter, not an activation) and 1/rms per token in float32:
    12·s·b·h bytes less per block in bf16. Counted from that node's saved tensors, not measured
    here (a CPU build has no CUDA kernel to run)."""
    parts = memory.llama_activations(seq_len, batch, hidden, heads, ffn, bytes_per_value,
                                     recompute, kv_heads)
    if norm not in NORM_KERNELS:
        raise ValueError(f"norm must be one of {NORM_KERNELS}; got {norm!r}.")
    key = "RMSNorm: input and normalised value in float32, 1/rms (two norms)"
    if norm == "fused" and key in parts:
        sb = seq_len * batch
        parts = {("RMSNorm (fused): input in its dtype, 1/rms in float32 (two norms)"
                  if k == key else k): (2 * (bytes_per_value * sb * hidden + 4 * sb)
                                        if k == key else v) for k, v in parts.items()}
    return parts


def saved_bytes(module, fn):
    """{storage: (shape, bytes)} of the non-weight tensors autograd saves while fn() runs: what
    the forward keeps for backward, each storage once (a view saved twice costs one storage)."""
    weights = {p.untyped_storage().data_ptr() for p in module.parameters()}
    seen = {}

    def pack(t):
        key = t.untyped_storage().data_ptr()
        if key not in weights and key not in seen:
            seen[key] = (tuple(t.shape), t.untyped_storage().nbytes())
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return seen


def saved_and_recomputed(model, idx, targets, use_checkpoint):
    """(bytes autograd saved, block forwards run, loss) of one forward + backward of a TinyGPT
    (distlab.models), each block wrapped in torch.utils.checkpoint when use_checkpoint."""
    from torch.utils.checkpoint import checkpoint

    from .. import models
    seen = {p.untyped_storage().data_ptr() for p in model.parameters()}  # weights: not activations
    saved, calls = [0], [0]

    def pack(t):
        key = t.untyped_storage().data_ptr()
        if key not in seen:
            seen.add(key)
            saved[0] += t.untyped_storage().nbytes()
        return t
    hooks = [b.register_forward_pre_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
             for b in model.blocks]
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            h = model.tok(idx) + model.pos(torch.arange(idx.shape[1]))
            for block in model.blocks:
                h = checkpoint(block, h, use_reentrant=False) if use_checkpoint else block(h)
            loss = models.lm_loss(model.head(model.ln_f(h)), targets)
        loss.backward()
    finally:
        for hook in hooks:
            hook.remove()
    return saved[0], calls[0], loss.item()
