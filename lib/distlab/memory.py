"""Memory and compute arithmetic of training: where the bytes go, and how long the FLOPs take.

The accounting is the standard one for a model with N parameters (ZeRO paper, §3):
- weights and gradients in the training precision (2 bytes each in bf16, 4 in fp32);
- Adam keeps two moments per parameter in fp32 (8 bytes); under mixed precision it also keeps an
  fp32 master copy of the weights (4 bytes) — so bf16 mixed precision with Adam costs
  2 + 2 + 12 = 16 bytes per parameter, before any activation.
ZeRO stage s shards the optimizer states (s >= 1), gradients (s >= 2) and weights (s = 3)
over the data-parallel ranks.
"""
import math

GB = 1e9  # decimal gigabytes, as GPU memory is sold (an "80 GB" GPU holds 80e9 bytes)

PRECISIONS = ("fp32", "bf16-mixed")
OPTIMIZERS = ("adam", "sgd-momentum", "sgd")


def bytes_per_parameter(precision="bf16-mixed", optimizer="adam"):
    """{"weights", "grads", "optimizer"} bytes that one parameter costs."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS}; got {precision!r}.")
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"optimizer must be one of {OPTIMIZERS}; got {optimizer!r}.")
    weight = 4 if precision == "fp32" else 2
    moments = {"adam": 2, "sgd-momentum": 1, "sgd": 0}[optimizer] * 4
    # Mixed precision updates an fp32 master copy: bf16 weights alone lose small updates.
    master = 4 if precision == "bf16-mixed" else 0
    return {"weights": weight, "grads": weight, "optimizer": moments + master}


def model_state_bytes(n_params, precision="bf16-mixed", optimizer="adam", zero_stage=0,
                      world_size=1):
    """Bytes of weights, gradients and optimizer states held by ONE rank."""
    if zero_stage not in (0, 1, 2, 3):
        raise ValueError(f"zero_stage must be 0, 1, 2 or 3; got {zero_stage!r}.")
    if world_size < 1:
        raise ValueError(f"world_size must be at least 1; got {world_size}.")
    per = bytes_per_parameter(precision, optimizer)
    sharded = {"optimizer": zero_stage >= 1, "grads": zero_stage >= 2, "weights": zero_stage >= 3}
    return {k: n_params * per[k] / (world_size if sharded[k] else 1) for k in per}


def training_flops(n_params, tokens):
    """~6·N·D: 2 FLOPs per parameter per token forward, 4 backward (Kaplan et al. 2020)."""
    return 6 * n_params * tokens


def training_days(n_params, tokens, n_gpus, peak_flops=989e12, mfu=0.4):
    """Days to train on n_gpus that each reach `mfu` of `peak_flops` (H100 dense bf16 by default)."""
    seconds = training_flops(n_params, tokens) / (n_gpus * peak_flops * mfu)
    return seconds / 86400


def gpus_to_hold(n_bytes, gpu_bytes=80 * GB):
    """The fewest GPUs whose memory adds up to n_bytes (if it could be split perfectly)."""
    return math.ceil(n_bytes / gpu_bytes)


ATTENTION = ("flash", "materialized")
RECOMPUTATION = ("none", "selective", "full")
# ... and torchtitan's op-level selective checkpointing ("selective-op"), for the planner
RECOMPUTE_POLICIES = RECOMPUTATION + ("selective-op",)


def activation_breakdown(seq_len, batch, hidden, heads, attention="flash", recompute="none",
                         bytes_per_value=2, dropout=True, ffn_mult=4, tp=1,
                         sequence_parallel=False, kv_heads=None, glu=False):
    """{what: bytes} that ONE transformer layer keeps for backward (no tensor parallelism).

    A GPT block, as Korthikanti et al. (2022, "Reducing Activation Recomputation in Large
    Transformer Models", §4.1) count it, values of `bytes_per_value` bytes (2 in 16-bit):
    the two LayerNorms' inputs, the QKV matmul's input, Q/K/V, the attention output (the output
    projection's input), the MLP's input and its hidden activation before and after GeLU; with
    dropout, a 1-byte mask after attention and after the MLP. That is 34·s·b·h bytes in 16-bit.

    attention="materialized" also keeps the s×s scores of every head: softmax output, and with
    dropout its mask and output — 5·a·s²·b bytes, the paper's 5·a·s/h term. attention="flash"
    (scaled_dot_product_attention, FlashAttention) never stores them: its backward recomputes
    them from Q, K, V and one float32 log-sum-exp per head and query (4·a·s·b bytes).

    recompute="selective" (the paper's selective recomputation) drops exactly the s×s part and
    recomputes it in backward — what flash attention already does inside its kernel, so with
    flash it changes nothing. recompute="full" keeps only the layer's input (s·b·h values) and
    reruns the whole layer's forward in backward.

    Tensor parallelism over `tp` ranks (the paper's §4.2, Table 2): the matrices' outputs (Q, K,
    V, the attention output, the MLP hidden, the s×s scores) are split 1/tp; the LayerNorm
    inputs, the QKV and MLP inputs and the dropout masks — 10·s·b·h of the 34 — are REPLICATED on
    every tp rank unless `sequence_parallel` splits them along the sequence: s·b·h·(10 + 24/t)
    without SP, 34·s·b·h/t with it. Under full recompute the stored layer input is replicated
    (2·s·b·h) without SP and split (2·s·b·h/t) with it.
    `kv_heads` (grouped-query attention, Ainslie et al. 2023): K and V have kv_heads·head_dim
    features instead of hidden. `glu` (SwiGLU, Shazeer 2020): the MLP keeps its gate and up
    projections' outputs and their product (3 × ffn_mult·h values) instead of GeLU's input and
    output (2 × ffn_mult·h).
    """
    if attention not in ATTENTION:
        raise ValueError(f"attention must be one of {ATTENTION}; got {attention!r}.")
    recompute = {False: "none", None: "none", True: "full"}.get(recompute, recompute)
    if recompute not in RECOMPUTE_POLICIES:
        raise ValueError(f"recompute must be one of {RECOMPUTE_POLICIES} (or True/False); "
                         f"got {recompute!r}.")
    if not isinstance(tp, int) or isinstance(tp, bool) or tp < 1:
        raise ValueError(f"tp must be a whole number >= 1; got {tp!r}.")
    sbh, v = seq_len * batch * hidden, bytes_per_value
    # what sequence parallelism splits (and plain tensor parallelism replicates), and what
    # tensor parallelism always splits
    rep = tp if sequence_parallel else 1
    if recompute == "full":
        return {"layer input (the rest is recomputed)": v * sbh / rep}
    kv = (kv_heads or heads) / heads            # K and V are kv/heads of Q's size under GQA
    if recompute == "selective-op":
        return _op_level_saved(sbh, v, heads, seq_len * batch, kv, ffn_mult, glu, tp, rep)
    parts = {
        "LayerNorm inputs": 2 * v * sbh / rep,
        "QKV matmul input": v * sbh / rep,
        "Q, K, V": (1 + 2 * kv) * v * sbh / tp,
        "attention output": v * sbh / tp,
        "MLP input": v * sbh / rep,
    }
    if glu:
        parts["MLP gate, up and their product"] = 3 * ffn_mult * v * sbh / tp
    else:
        parts["MLP hidden, before and after GeLU"] = 2 * ffn_mult * v * sbh / tp
    if dropout:
        parts["dropout masks"] = 2 * sbh / rep
    scores = heads * seq_len * seq_len * batch / tp
    if attention == "materialized" and recompute == "none":
        parts["s×s attention scores"] = (2 * v + 1) * scores if dropout else v * scores
    elif attention == "flash":
        parts["log-sum-exp (float32)"] = 4 * heads * seq_len * batch / tp
    return parts


def _op_level_saved(sbh, v, heads, tokens, kv, ffn_mult, glu, tp, rep):
    """torchtitan's op-level selective checkpointing (torchtitan/distributed/
    activation_checkpoint.py, `_custom_policy`): inside each checkpointed block the outputs of
    the ops in its save list are kept — every matmul except every second one, counted in
    forward order, and the attention kernel's output with its float32 log-sum-exp — plus the
    block's input; norms, rotary embedding, activations and residual adds are recomputed. The
    matmuls in order: q, k, v, the output projection, then SwiGLU's gate and up, or GeLU's up,
    then down; column-parallel outputs split 1/tp, row-parallel ones (output, down) 1/tp only
    with sequence parallelism."""
    mlp = [("MLP gate", ffn_mult, tp), ("MLP up", ffn_mult, tp)] if glu \
        else [("MLP up", ffn_mult, tp)]
    matmuls = [("Q", 1, tp), ("K", kv, tp), ("V", kv, tp), ("attention output projection", 1, rep),
               *mlp, ("MLP down", 1, rep)]
    parts = {"block input": v * sbh / rep}
    for name, width, split in matmuls[0::2]:          # the 1st, 3rd, ... matmul: saved
        parts[f"{name} (matmul output)"] = width * v * sbh / split
    parts["attention output and log-sum-exp (float32)"] = v * sbh / tp + 4 * heads * tokens / tp
    return parts


def activation_bytes(seq_len, batch, hidden, layers, heads, checkpointing=False,
                     attention="flash", bytes_per_value=2, dropout=True, tp=1,
                     sequence_parallel=False, kv_heads=None, glu=False, ffn_mult=4):
    """Activations a transformer keeps for backward, 16-bit by default, without tensor parallel.

    Per layer s·b·h·(34 + 5·a·s/h) bytes with attention="materialized" (Korthikanti et al. 2022,
    eq. 1); about 34·s·b·h with attention="flash" (the default, as scaled_dot_product_attention
    runs), since the s×s scores are never stored. checkpointing: False, "selective" (recompute
    the attention scores) or "full"/True (keep only each layer's input, 2·s·b·h bytes, and
    recompute the rest). activation_breakdown() lists the terms; `tp`, `sequence_parallel`,
    `kv_heads`, `glu` and `ffn_mult` are its (Korthikanti's Table 2 with and without SP).
    """
    parts = activation_breakdown(seq_len, batch, hidden, heads, attention, checkpointing,
                                 bytes_per_value, dropout, ffn_mult, tp, sequence_parallel,
                                 kv_heads, glu)
    return layers * sum(parts.values())


# (parameters, layers, hidden size, attention heads) of well-known models, for the calculator.
PRESETS = {
    "GPT-2 XL 1.5B": (1.5e9, 48, 1600, 25),
    "Llama-2 7B": (6.7e9, 32, 4096, 32),
    "Llama-2 13B": (13e9, 40, 5120, 40),
    "Llama-2 70B": (69e9, 80, 8192, 64),
    "GPT-3 175B": (175e9, 96, 12288, 96),
}
def llama_activations(seq_len, batch, hidden, heads, ffn, bytes_per_value=2, recompute="none",
                      kv_heads=None):
    """{what: bytes} ONE eager Llama block (LlamaBlock) keeps for backward.

    v = bytes_per_value (2 in bf16); nn.RMSNorm computes in float32 whatever the model's dtype
    (n = max(v, 4) bytes a value), so each of the two norms keeps its input cast to float32, the
    normalised value before the weight, and one float32 1/rms per token. Then the norms'
    outputs (the q/k/v and gate/up matmuls' inputs), the q/k/v projection's output (v is a view
    of it, so its whole storage stays), q and k after the rotary embedding, the attention
    output (the output projection's input) and flash attention's float32 log-sum-exp per head
    and query, and SwiGLU's gate and up (one storage), SiLU(gate) and their product (the down
    projection's input). No dropout: Llama has none. recompute="full" keeps the block's input.
    Per token and hidden unit in bf16: 32 + 8·ffn/hidden bytes (53.5 for Llama-2 7B) against
    the GPT block's 34 (memory.activation_breakdown).
    kv_heads (grouped-query attention, Ainslie et al. 2023): K and V are kv_heads/heads of Q's
    size, in the projection's output and after the rotary embedding; scaled_dot_product_attention
    with enable_gqa keeps no repeated copy (measured: tests/test_ch06.py).
    """
    kv = (kv_heads or heads) / heads
    recompute = {False: "none", None: "none", True: "full"}.get(recompute, recompute)
    if recompute not in ("none", "full"):
        raise ValueError(f"recompute must be 'none' or 'full' for this count; got {recompute!r} "
                         f"(flash attention already recomputes the s×s scores: 'selective' "
                         f"changes nothing).")
    sb, v = seq_len * batch, bytes_per_value
    sbh, sbf, n = sb * hidden, sb * ffn, max(bytes_per_value, 4)
    if recompute == "full":
        return {"block input (the rest is recomputed)": v * sbh}
    return {
        "RMSNorm: input and normalised value in float32, 1/rms (two norms)": 2 * (2 * n * sbh
                                                                                 + 4 * sb),
        "norm outputs (the q/k/v and gate/up matmul inputs)": 2 * v * sbh,
        "q/k/v projection output": round((1 + 2 * kv) * v * sbh),
        "q and k after the rotary embedding": round((1 + kv) * v * sbh),
        "attention output": v * sbh,
        "log-sum-exp (float32)": 4 * heads * sb,
        "SwiGLU: gate and up, SiLU(gate), their product": 4 * v * sbf,
    }


# The presets whose activations are a Llama block's (llama_activations, below: RMSNorm in
# float32, rotary embeddings, SwiGLU at this ffn size, no dropout), by their SwiGLU size, and
# their K/V heads where attention is grouped-query: Touvron et al. 2023, table 1 (70B: GQA with
# 8 K/V heads, section 2.2), and the models' config.json (intermediate_size, num_key_value_heads).
# The others are GPT blocks (Korthikanti's count, above).
LLAMA_FFN = {"Llama-2 7B": 11008, "Llama-2 13B": 13824, "Llama-2 70B": 28672}
LLAMA_KV_HEADS = {"Llama-2 70B": 8}


def preset_activation_bytes(model, seq_len=2048, micro_batch=1, checkpointing=False,
                            attention="flash"):
    """Activations of a preset model, 16-bit: a Llama block's count for the LLAMA_FFN presets,
    a GPT block's (activation_bytes) for the others.

    For a Llama block the s×s scores are a term of their own: with attention="materialized" and
    no recomputation the block stores the softmax (a·s²·b values; Llama has no dropout) instead
    of flash's float32 log-sum-exp; "selective" recomputes exactly that part, so with either
    kernel it leaves flash's count; "full" keeps each block's input."""
    _, layers, hidden, heads = PRESETS[model]
    if model not in LLAMA_FFN:
        return activation_bytes(seq_len, micro_batch, hidden, layers, heads, checkpointing,
                                attention)
    if attention not in ATTENTION:
        raise ValueError(f"attention must be one of {ATTENTION}; got {attention!r}.")
    recompute = {False: "none", None: "none", True: "full"}.get(checkpointing, checkpointing)
    if recompute not in RECOMPUTATION:
        raise ValueError(f"recompute must be one of {RECOMPUTATION} (or True/False); "
                         f"got {checkpointing!r}.")
    kept = "full" if recompute == "full" else "none"
    per_block = sum(llama_activations(seq_len, micro_batch, hidden, heads, LLAMA_FFN[model],
                                      recompute=kept,
                                      kv_heads=LLAMA_KV_HEADS.get(model)).values())
    if attention == "materialized" and recompute == "none":
        per_block += 2 * heads * seq_len * seq_len * micro_batch - 4 * heads * seq_len * micro_batch
    return layers * per_block


def per_gpu_bytes(model, precision="bf16-mixed", optimizer="adam", zero_stage=0, world_size=1,
                  seq_len=2048, micro_batch=1, checkpointing=False, attention="flash"):
    """Everything one data-parallel GPU holds for a preset model: model states + activations
    (preset_activation_bytes: a Llama block for the Llama-2 presets)."""
    n = PRESETS[model][0]
    out = model_state_bytes(n, precision, optimizer, zero_stage, world_size)
    out["activations"] = preset_activation_bytes(model, seq_len, micro_batch, checkpointing,
                                                 attention)
    return out


def zero3_step_seconds(gather, forward, backward, reduce_scatter, layers, prefetch):
    """Modeled seconds of ZeRO-3's forward + backward over `layers` equal layers, each costing
    `gather` (all-gather its weights), `forward` / `backward` (compute) and `reduce_scatter`
    (its gradients, synchronous) seconds, on one link per rank.

    Without prefetch nothing overlaps: L·(2·gather + forward + backward + reduce_scatter).
    With prefetch, layer i+1's gather (i-1's in backward) runs during layer i's compute, so each
    layer after the first costs max(compute, gather) instead of their sum.
    """
    g, f, b, r, n = gather, forward, backward, reduce_scatter, layers
    if not prefetch:
        return n * (2 * g + f + b + r)
    return (g + (n - 1) * max(f, g) + f) + (g + (n - 1) * (max(b, g) + r) + b + r)
