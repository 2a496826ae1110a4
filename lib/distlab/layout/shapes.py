"""The planner's models: the presets' shapes, their parameters, GEMMs and FLOPs."""
import torch

from .. import hardware, memory

_BF16 = torch.bfloat16

# The shapes of the presets, for the hardware model (Touvron et al. 2023, "Llama 2", table 1 and
# the released configs: Llama-2 7B/13B with multi-head attention, 70B with 8 key/value heads;
# SwiGLU widths 11008, 13824, 28672; vocabulary 32000. GPT-3: Brown et al. 2020 table 2.1,
# vocabulary 50257. GPT-2 XL: Radford et al. 2019, 48 layers of 1600.)
SHAPES = {
    "GPT-2 XL 1.5B": hardware.Transformer(48, 1600, 25, 6400, 50257),
    "Llama-2 7B": hardware.Transformer(32, 4096, 32, 11008, 32000, glu=True),
    "Llama-2 13B": hardware.Transformer(40, 5120, 40, 13824, 32000, glu=True),
    "Llama-2 70B": hardware.Transformer(80, 8192, 64, 28672, 32000, kv_heads=8, glu=True),
    "GPT-3 175B": hardware.Transformer(96, 12288, 96, 49152, 50257),
}


def shape_of(model):
    """(hardware.Transformer, parameter count) of a preset name, a Transformer, or a tuple
    (n_params, layers, hidden, heads): a GPT block (MLP 4·hidden) with no vocabulary, the
    parameters spread evenly over the layers."""
    if isinstance(model, str):
        if model not in SHAPES:
            raise ValueError(f"unknown model {model!r}; the planner knows {sorted(SHAPES)}, or "
                             f"pass a distlab.hardware.Transformer or (n_params, layers, hidden, "
                             f"heads).")
        shape = SHAPES[model]
        return shape, memory.PRESETS[model][0]
    if isinstance(model, hardware.Transformer):
        return model, model.params()
    if not isinstance(model, (tuple, list)) or len(model) != 4:
        raise ValueError(f"model must be a preset name ({', '.join(sorted(SHAPES))}), a "
                         f"distlab.hardware.Transformer, or (n_params, layers, hidden, heads); "
                         f"got {model!r}.")
    n, layers, hidden, heads = model
    return hardware.Transformer(int(layers), int(hidden), int(heads), 4 * int(hidden), 0), n


def _layer_params(shape):
    h, kv = shape.hidden, (shape.kv_heads or shape.heads) * shape.hidden // shape.heads
    return 2 * h * h + 2 * h * kv + (3 if shape.glu else 2) * h * shape.ffn


def layer_gemms(shape, tokens, tp):
    """(m, n, k) of one layer's forward matmuls on one tp rank (tokens = b·s on this rank)."""
    h, kv = shape.hidden, (shape.kv_heads or shape.heads) * shape.hidden // shape.heads
    out = [(tokens, (h + 2 * kv) // tp, h), (tokens, h, h // tp)]          # qkv, projection
    out += [(tokens, shape.ffn // tp, h)] * (2 if shape.glu else 1)        # gate (and up)
    out.append((tokens, h, shape.ffn // tp))                               # down / fc2
    return out


def attention_flops(shape, seq_len, batch, tp=1, cp=1, causal=True):
    """Forward FLOPs of one layer's attention core on one rank: Q·Kᵀ and P·V, 2·s·s·h each per
    sequence (4·b·s²·h per layer, the attention term of Narayanan et al. 2021's eq. (3)), 1/tp
    of the heads, 1/cp of the queries against every key, and half of the blocks when the mask
    is causal (a flash kernel skips the masked ones: Dao 2023 §4.1)."""
    return 4.0 * batch * seq_len * seq_len * shape.hidden / (tp * cp) * (0.5 if causal else 1.0)


def model_flops(shape, seq_len, tokens, recompute="none", causal=False, attention_backward=2.0,
                vocab=True):
    """Training FLOPs of `tokens` tokens: every matmul forward (2 per weight per token),
    backward twice that, the attention core (its backward `attention_backward` × its forward),
    and a forward again under full recompute. With recompute="full", causal=False and
    attention_backward=2 this is Narayanan et al. 2021 eq. (3):
    96·B·s·l·h²·(1 + s/(6h) + V/(16·l·h)) for a GPT block (ffn = 4h)."""
    recompute = _recompute(recompute)
    gemm = 2.0 * _layer_params(shape) * tokens
    attn = attention_flops(shape, seq_len, 1, causal=causal) * tokens / seq_len
    again = 1.0 if recompute == "full" else 0.0
    per_layer = gemm * (3 + again) + attn * (1 + attention_backward + again)
    head = 3 * 2.0 * shape.hidden * shape.vocab * tokens if vocab else 0.0
    return shape.layers * per_layer + head


def _recompute(checkpointing):
    r = {False: "none", None: "none", True: "full"}.get(checkpointing, checkpointing)
    if r not in memory.RECOMPUTE_POLICIES:
        raise ValueError(f"checkpointing must be one of {memory.RECOMPUTE_POLICIES} (or True/False); "
                         f"got {checkpointing!r}.")
    return r
