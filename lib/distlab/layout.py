"""Choosing a (dp, pp, tp) layout — or (dp, pp, cp, tp) with context parallelism — every candidate
priced on the calibrated hardware model (distlab.hardware) and the memory model (distlab.memory).

    rows = rank_layouts("Llama-2 13B", nodes=4, gpus_per_node=8)
    print(table(rows))

A planning model, not a simulator; measure before you believe it. bench/planner.py holds it
against the course's own 3D step run at full size on meta tensors under the emulator (they share
the device and link formulas, so that agreement checks the planner's accounting of the code's
critical path, not the hardware), and against a published configuration.

Mesh order (dp, pp, cp, tp), tp fastest: a tp group is tp neighbouring GPUs (inside one node
when tp divides a node); a cp group strides by tp, a pp group by cp·tp, a dp group by pp·cp·tp.
Each group's link is the calibrated cluster's `link_between` its ranks (NVLink inside a node;
across nodes NCCL's cross-node latency and one ring per NIC).

Time of one step (every term a function below, each pinned by tests/test_layout.py):
- compute, per micro-batch and layer on one rank: every GEMM of the layer (q/k/v with GQA's
  smaller K, V; the output projection; the MLP, SwiGLU's three matrices or GeLU's two), split
  1/tp, at the device's shape-dependent efficiency (Device.seconds with its m, n, k); causal
  flash attention, 4·b·s²·h/tp FLOPs halved by the mask (Dao 2023, FlashAttention-2 §4.1; its
  backward 2.5× the forward); the memory-bound element-wise work at HBM speed (hardware's
  68·s·b·h bytes fused, 140 unfused), split 1/tp only with sequence parallelism — without it the
  norms, residuals and dropout of Korthikanti et al.'s 10 of 34 run replicated on every tp rank.
  Backward runs each matmul's input- and weight-gradient GEMMs in their own shapes (the
  weight gradient's depth is the tokens); `recompute="full"` reruns the whole forward,
  "selective" only the attention core (free with flash attention, whose kernel recomputes it
  anyway); the LM head (vocab-parallel over tp, or whole on every tp rank) on the last stage;
  `sustained` (hardware.SUSTAINED) for what kernels lose inside a training loop;
- the pipeline bubble: (pp − 1)/(v·m) of the stage time, m micro-batches per replica and v
  model chunks per stage (`interleave`; Narayanan et al. 2021 §2.2) — the steady state runs at
  the slowest stage (the last, with the head), the fill and drain through the others;
- tensor parallel: 2 all-reduces of s·b·h per layer in forward, 2 in backward, 2 more when full
  recompute reruns the forward (6 instead of 4: the recomputed forward repeats its two;
  Korthikanti et al. 2022); with sequence
  parallelism each all-reduce is an all-gather plus a reduce-scatter of the same bytes;
  vocab-parallel embedding and head add one all-reduce each (Shoeybi et al. 2019 §3);
  `overlap_tp`: hidden behind the layer's GEMMs as far as they last, else exposed;
- context parallel (ring attention, chapter 12): cp − 1 hops of this rank's K, V blocks forward
  (K, V, dK, dV backward), `overlap_cp`: hidden behind the attention that waits for them as
  far as it lasts;
- pipeline: 2·(v·m + pp − 1) stage-to-stage messages of s·b·h/tp on the critical path
  (`scatter_gather`; of s·b·h without it); `overlap_pp` (isend): only the fill's and the
  drain's 2·(pp − 1), and whatever of the others outlasts a micro-batch's compute;
- data parallel: the bf16 gradients reduced over the dp·cp ranks holding the same shard, in
  buckets (25 MiB, DDP's default); `overlap_dp`: every bucket but the last hides behind the last
  micro-batch's backward (the only backward that produces final gradients), else all exposed;
- the optimizer step: Adam's update reads and writes every (ZeRO-sharded) state at HBM speed.

Memory of one GPU: model states (bf16 weights and gradients, fp32 master and Adam moments;
ZeRO-`zero_stage` over dp·cp) of its stage's layers/tp plus the embedding or head; activations
by memory.activation_breakdown (Korthikanti's accounting with tp, SP, GQA, recompute) for the
micro-batches 1F1B keeps in flight (min(m, pp) on the first stage, × (1 + (pp−1)/(pp·v))
interleaved: Korthikanti §4.2.3); the peak adds what exists only for a moment: with full
recompute one layer's full activations while it is recomputed, and on the last stage the
logits (bf16, their fp32 copy for the loss and its fp32 gradient: 10 bytes per logit).
"""
import math

import torch

from . import hardware, memory
from .emulate import comm_seconds

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
# DDP's default bucket (torch.nn.parallel.DistributedDataParallel, bucket_cap_mb=25)
BUCKET_BYTES = 25 * 2**20
# Bytes per logit at the loss's peak: bf16 logits kept for backward (2), their fp32 copy for the
# softmax (4), its fp32 gradient (4) — Megatron's vocab-parallel cross-entropy works in fp32;
# an ESTIMATE of what a framework holds at once.
LOGIT_BYTES = 10
# Adam's update, bytes per parameter: read the bf16 gradient (2), fp32 master, m and v (12),
# write master, m, v (12) and the bf16 weight (2). SGD (the course's train_step): read weight
# and gradient, write the weight, in the training dtype.
OPTIMIZER_BYTES = {"adam": 28, "sgd": 3}


def divisors(n):
    return [d for d in range(1, n + 1) if n % d == 0]


def candidates(n_gpus, gpus_per_node, layers, heads, global_batch, micro_batch, cps=(1,),
               seq_len=4096):
    """Every (dp, pp, cp, tp) that multiplies to n_gpus and splits the model, the batch and (for
    zig-zag ring attention) the sequence evenly."""
    out = []
    for tp in divisors(n_gpus):
        if heads % tp or gpus_per_node % tp:      # tp stays inside one node
            continue
        for cp in cps:
            if (n_gpus // tp) % cp or seq_len % (2 * cp):
                continue
            for pp in divisors(n_gpus // (tp * cp)):
                dp = n_gpus // (tp * cp * pp)
                if layers % pp or global_batch % (dp * micro_batch):
                    continue
                out.append((dp, pp, cp, tp))
    return out


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
    if r not in memory.RECOMPUTATION:
        raise ValueError(f"checkpointing must be one of {memory.RECOMPUTATION} (or True/False); "
                         f"got {checkpointing!r}.")
    return r


def _cluster(cluster, gpus_per_node, intra, inter):
    """A hardware.Cluster: a preset name or a Cluster; `intra`/`inter` links (the planner's old
    arguments, α-β cost.Links or calibrated ones) replace the preset's, one NIC per group."""
    if isinstance(cluster, str):
        if cluster not in hardware.PRESETS and cluster not in hardware.DATASHEET:
            raise ValueError(f"unknown cluster {cluster!r}; one of {sorted(hardware.PRESETS)} "
                             f"(or its '-datasheet' twin), or a distlab.hardware.Cluster.")
        cluster = {**hardware.PRESETS, **hardware.DATASHEET}[cluster]
    if intra is not None or inter is not None:
        cluster = hardware.Cluster(f"{cluster.name} (links given)", cluster.device,
                                   intra or cluster.intra, inter or cluster.inter or intra,
                                   gpus_per_node)
    elif cluster.ranks_per_node != gpus_per_node:
        cluster = hardware.Cluster(cluster.name, cluster.device, cluster.intra, cluster.inter,
                                   gpus_per_node, cluster.source, cluster.nics_per_node)
    return cluster


def _gemm(device, m, n, k, dtype):
    """Device.seconds of an (m×k)·(k×n) matmul, its operands and output read and written once."""
    item = torch.empty((), dtype=dtype).element_size()
    return device.seconds(2.0 * m * n * k, item * (m * k + k * n + m * n), dtype, (m, n, k))


def _gemm_train(device, m, n, k, dtype):
    """The three matmuls a linear layer runs in training, each in its own shape (what the
    device's tile × depth efficiency sees): forward (m, n, k), input gradient (m, k, n), weight
    gradient (k, n, m) — tokens are the weight gradient's depth."""
    return _gemm(device, m, n, k, dtype) + _gemm(device, m, k, n, dtype) + \
        _gemm(device, k, n, m, dtype)


def layer_seconds(shape, device, seq_len, batch, tp=1, cp=1, sequence_parallel=True,
                  recompute="full", attention="flash", fused=True, dtype=_BF16,
                  attention_backward=2.5):
    """{"gemm", "attention", "elementwise", "recompute"}: seconds of one layer's forward +
    backward (+ recompute) for one micro-batch on one rank, and how much of it is GEMMs (what a
    tp all-reduce can hide behind) and attention (what ring attention's traffic can)."""
    recompute = _recompute(recompute)
    tokens = batch * seq_len // cp
    fwd = sum(_gemm(device, m, n, k, dtype) for m, n, k in layer_gemms(shape, tokens, tp))
    train = sum(_gemm_train(device, m, n, k, dtype) for m, n, k in layer_gemms(shape, tokens, tp))
    heads, head_dim = shape.heads // tp, shape.hidden // shape.heads
    flash = attention == "flash"
    a_flops = attention_flops(shape, seq_len, batch, tp, cp, causal=flash)
    attn = a_flops / (device.peak(dtype) * device.gemm_efficiency(
        seq_len // cp, seq_len, head_dim, dtype, batch * heads))
    # hardware.step_seconds' element-wise bytes: 68·s·b·h fused (Korthikanti's 34 stored bytes
    # written once and read once), 140 unfused; the replicated 10 of 34 without SP
    per_token = 68 if fused else 140
    share = 1 / tp if sequence_parallel else (10 + 24 / tp) / 34
    elementwise = per_token * tokens * shape.hidden * share
    if not flash:      # materialised scores: softmax (and its mask) over a·s² values, read + written
        elementwise += 2 * 5 * heads * (seq_len // cp) * seq_len * batch
    elementwise /= device.memory_bandwidth
    attn_bwd = attention_backward if flash else 2.0
    again = {"none": 0.0, "selective": 0.0 if flash else 1.0, "full": 1.0}[recompute]
    redo = (fwd + elementwise if recompute == "full" else 0.0) + again * attn
    if recompute == "selective" and not flash:
        redo += 2 * 5 * heads * (seq_len // cp) * seq_len * batch / device.memory_bandwidth
    return dict(gemm=train + (fwd if recompute == "full" else 0.0),
                attention=(1 + attn_bwd) * attn + again * attn,
                elementwise=3 * elementwise + (elementwise if recompute == "full" else 0.0),
                recompute=redo)


def price(model, dp, pp, tp, gpus_per_node=8, global_batch=512, seq_len=4096, micro_batch=1,
          zero_stage=1, checkpointing=True, gpu_bytes=None, peak_flops=None, mfu=None,
          intra=None, inter=None, value_bytes=2, cp=1, *, cluster="h100-cluster",
          sequence_parallel=True, interleave=1, overlap_dp=True, overlap_tp=False,
          overlap_cp=True, vocab_parallel=True, attention="flash", fused=True, sustained=None,
          optimizer="adam", bucket_bytes=BUCKET_BYTES, dp_messages=None, schedule="1f1b",
          dropout=False, scatter_gather=True, overlap_pp=False):
    """Seconds per step (split into compute, bubble, tp, cp, pp, dp, optimizer) and GB per GPU
    (peak and steady; `peak_parts`: the peak's model states, saved activations, one layer
    recomputed under full recompute, and logits, in GB) of one layout, on the calibrated `cluster` (a preset name or a
    hardware.Cluster).

    `model`: a name in SHAPES, a hardware.Transformer, or (n_params, layers, hidden, heads).
    `checkpointing`: True/"full", "selective", False/"none". `interleave`: v model chunks per
    pipeline stage. `schedule`: "1f1b" (pp micro-batches in flight on the first stage) or
    "gpipe" (all m: the course's train_step). `dp_messages`: how many all-reduces the gradient
    reduction uses (default: its bytes in `bucket_bytes` buckets). `value_bytes`: bytes of one
    activation or gradient value. `mfu`: the old planner's fixed fraction of `peak_flops`
    instead of the calibrated device (kept to show the difference). `intra`/`inter`: links that
    replace the cluster's. `dropout`: Korthikanti's dropout masks (Llama trains without).
    `scatter_gather`: stage-to-stage messages of 1/tp of the activation (Megatron's
    optimisation), else the whole activation from every tp rank (the course's train_step).
    `overlap_pp`: messages sent asynchronously (isend), hidden behind the next micro-batch."""
    shape, n = shape_of(model)
    cluster = _cluster(cluster, gpus_per_node, intra, inter)
    dev = cluster.device
    recompute = _recompute(checkpointing)
    if schedule not in ("1f1b", "gpipe"):
        raise ValueError(f"schedule must be '1f1b' or 'gpipe'; got {schedule!r}.")
    v = interleave
    if not isinstance(v, int) or v < 1 or shape.layers % (pp * v):
        raise ValueError(f"interleave={v!r}: {shape.layers} layers do not split into "
                         f"{pp} stages × {v} chunks.")
    m = global_batch // (dp * micro_batch)
    if m < 1:
        raise ValueError(f"a global batch of {global_batch} gives each of dp={dp} replicas less "
                         f"than one micro-batch of {micro_batch}.")
    dtype = {2: _BF16, 4: torch.float32}[value_bytes]
    b, s, h, L = micro_batch, seq_len, shape.hidden, shape.layers
    tokens = b * s // cp
    layers_here = L // pp

    # ---- memory -------------------------------------------------------------------------
    vocab_rows = shape.vocab / (tp if vocab_parallel else 1)
    # the preset's parameter count, less the embedding and the head, spread over the layers
    per_layer = (n - 2 * shape.vocab * h) / L
    stage_params = layers_here * per_layer / tp
    # the first stage holds the embedding, the last the head; one stage holds both
    first = stage_params + vocab_rows * h * (1 if pp > 1 else 2)
    last = stage_params + vocab_rows * h if pp > 1 else first
    states = {k: sum(memory.model_state_bytes(p, zero_stage=zero_stage,
                                              world_size=dp * cp).values())
              for k, p in (("first", first), ("last", last))}
    act_kw = dict(tp=tp, sequence_parallel=sequence_parallel, kv_heads=shape.kv_heads,
                  glu=shape.glu, ffn_mult=shape.ffn / h, dropout=dropout, attention=attention,
                  bytes_per_value=value_bytes)
    saved = sum(memory.activation_breakdown(s // cp, b, h, shape.heads, recompute=recompute,
                                            **act_kw).values())
    whole = sum(memory.activation_breakdown(s // cp, b, h, shape.heads, recompute="none",
                                            **act_kw).values())
    in_flight = m if schedule == "gpipe" else min(m, pp)
    factor = 1 + (pp - 1) / (pp * v) if v > 1 else 1.0        # Korthikanti §4.2.3
    # the first stage holds in_flight micro-batches of its layers; the last one of them (1F1B)
    acts_first = in_flight * layers_here * saved * factor
    acts_last = (m if schedule == "gpipe" else 1) * layers_here * saved
    working = whole if recompute == "full" else 0.0     # one layer recomputed at a time
    logits = tokens * vocab_rows * LOGIT_BYTES
    steady = states["first"] + acts_first
    peak_first = steady + working + (logits if pp == 1 else 0.0)
    peak_last = states["last"] + acts_last + working + logits
    peak = max(peak_first, peak_last)
    # what the peak is made of, on the stage where it occurs (chapter 12 sets them side by side)
    if peak_first >= peak_last:
        parts = (states["first"], acts_first, working, logits if pp == 1 else 0.0)
    else:
        parts = (states["last"], acts_last, working, logits)
    peak_parts = dict(zip(("states", "activations", "working", "logits"),
                          (x / memory.GB for x in parts)))
    limit = gpu_bytes if gpu_bytes is not None else (dev.memory_bytes or 80 * memory.GB)

    # ---- compute --------------------------------------------------------------------------
    item = value_bytes
    kept = hardware.SUSTAINED if sustained is None else sustained
    if mfu is not None:
        # the old planner: 6·N (8·N with full recompute) FLOPs per token at a fixed fraction
        flops = memory.training_flops(n, global_batch * seq_len)
        if recompute == "full":
            flops += 2 * n * global_batch * seq_len
        compute = flops / (dp * pp * cp * tp * (peak_flops or dev.peak(_BF16)) * mfu)
        recompute_s = compute * 2 / 8 if recompute == "full" else 0.0
        lay = dict(gemm=compute / (m * layers_here), attention=0.0)
        head_s = 0.0
    else:
        lay = layer_seconds(shape, dev, s, b, tp, cp, sequence_parallel, recompute, attention,
                            fused, dtype)
        per_mb = layers_here * (lay["gemm"] + lay["attention"] + lay["elementwise"])
        head = 0.0
        if shape.vocab:
            vr = int(vocab_rows)
            head = _gemm_train(dev, tokens, vr, h, dtype)
            # cross-entropy over the logits: read and write them forward and backward in fp32
            head += 4 * 4 * tokens * vr / dev.memory_bandwidth
        compute = m * (per_mb + head) / kept
        head_s = m * head / kept
        recompute_s = m * layers_here * lay["recompute"] / kept

    # ---- communication ---------------------------------------------------------------------
    tp_link = cluster.link_between(range(tp))
    act_bytes = item * tokens * h
    if tp == 1:
        one = 0.0
    elif sequence_parallel:
        one = (comm_seconds("all_gather", act_bytes, tp, tp_link)
               + comm_seconds("reduce_scatter", act_bytes, tp, tp_link))
    else:
        one = comm_seconds("all_reduce", act_bytes, tp, tp_link)
    per_layer_ar = 6 if recompute == "full" else 4
    tp_layer = per_layer_ar * one
    if overlap_tp:
        tp_layer = max(0.0, tp_layer - lay["gemm"])
    vocab_ar = 2 * one if (vocab_parallel and shape.vocab and tp > 1) else 0.0
    tp_time = m * (layers_here * tp_layer + vocab_ar)

    cp_time = 0.0
    if cp > 1:
        kv = (shape.kv_heads or shape.heads) * h // shape.heads
        block = item * tokens * kv / tp                       # this rank's K (or V) block
        cp_link = cluster.link_between([i * tp for i in range(cp)])
        hops = (2 if recompute == "full" else 1) * comm_seconds("send", 2 * block, 2, cp_link)
        hops += comm_seconds("send", 4 * block, 2, cp_link)   # K, V and their gradients
        cp_layer = (cp - 1) * hops
        if overlap_cp:
            cp_layer = max(0.0, cp_layer - lay["attention"])
        cp_time = m * layers_here * cp_layer

    pp_time = 0.0
    if pp > 1:
        pp_link = cluster.link_between([0, cp * tp])
        # Megatron's scatter/gather: each tp rank sends 1/tp of the (replicated) activation and
        # the next stage all-gathers it over NVLink (Narayanan et al. 2021 §4.1); without it
        # every tp rank sends the whole activation
        message = act_bytes / tp if scatter_gather else act_bytes
        one = comm_seconds("send", message, 2, pp_link)
        if overlap_pp:
            # sent asynchronously: each hides behind the stage's next micro-batch (chunk) as far
            # as that lasts; the fill's and the drain's 2·(pp − 1) are waited for
            chunk = (compute - head_s) / (m * v)
            pp_time = 2 * (pp - 1) * one + 2 * v * m * max(0.0, one - chunk)
        else:
            pp_time = 2 * (v * m + pp - 1) * one

    # the steady state runs at the slowest stage (the last: it has the head); the fill and
    # drain add one micro-batch (1/v of one with v chunks) through each OTHER stage: their
    # forwards before the last stage starts, their backwards after it ends
    bubble = (compute - head_s + tp_time + cp_time) * (pp - 1) / (v * m)

    group = [d * pp * cp * tp + c * tp for d in range(dp) for c in range(cp)]
    dp_time = 0.0
    if dp * cp > 1:
        dp_link = cluster.link_between(group)
        grads = item * max(first, last)
        messages = dp_messages or max(1, math.ceil(grads / bucket_bytes))
        one_bucket = comm_seconds("all_reduce", grads / messages, dp * cp, dp_link)
        total = messages * one_bucket
        if zero_stage == 3:        # weights all-gathered forward and backward, prefetched
            total += 2 * comm_seconds("all_gather", grads, dp * cp, dp_link)
        if overlap_dp:
            window = compute / m * (2 / 3)      # the last micro-batch's backward
            dp_time = max(one_bucket, total - window * (1 - 1 / messages))
        else:
            dp_time = total
    if optimizer not in OPTIMIZER_BYTES:
        raise ValueError(f"optimizer must be one of {sorted(OPTIMIZER_BYTES)}; got {optimizer!r}.")
    shard = dp * cp if (zero_stage >= 1 and optimizer == "adam") else 1
    per_param = OPTIMIZER_BYTES[optimizer] * (1 if optimizer == "adam" else item)
    optimizer_s = per_param * max(first, last) / shard / dev.memory_bandwidth

    step = compute + bubble + tp_time + cp_time + pp_time + dp_time + optimizer_s
    n_gpus = dp * pp * cp * tp
    # model FLOPs utilisation as PaLM defines it (Chowdhery et al. 2022, appendix B): the
    # model's FLOPs without recompute, attention over the full square, per GPU-second at peak
    useful = model_flops(shape, s, global_batch * s)
    return dict(dp=dp, pp=pp, cp=cp, tp=tp, gb=peak / memory.GB, steady_gb=steady / memory.GB,
                fits=peak <= limit, step_s=step, compute_s=compute, recompute_s=recompute_s,
                bubble_s=bubble, tp_s=tp_time, cp_s=cp_time, pp_s=pp_time, dp_s=dp_time,
                optimizer_s=optimizer_s, head_s=head_s, micro_batches=m, interleave=v,
                mfu=useful / (step * n_gpus * dev.peak(_BF16)), peak_parts=peak_parts)


def rank_layouts(model, nodes=4, gpus_per_node=8, global_batch=512, micro_batch=1, cps=(1,),
                 **kw):
    """Every candidate layout priced; those that fit in memory first, fastest first. `cps`: the
    context-parallel degrees to consider (1 alone: no context parallelism)."""
    shape, _ = shape_of(model)
    n_gpus = nodes * gpus_per_node
    seq_len = kw.get("seq_len", 4096)
    v = kw.get("interleave", 1)
    rows = [price(model, dp, pp, tp, gpus_per_node, global_batch, micro_batch=micro_batch,
                  cp=cp, **kw)
            for dp, pp, cp, tp in candidates(n_gpus, gpus_per_node, shape.layers, shape.heads,
                                             global_batch, micro_batch, cps, seq_len)
            if shape.layers % (pp * v) == 0]
    if not rows:
        raise ValueError(f"no (dp, pp, tp) splits {model} over {n_gpus} GPUs with a global "
                         f"batch of {global_batch}.")
    return sorted(rows, key=lambda r: (not r["fits"], r["step_s"]))


def table(rows, top=10):
    """The ranking as text: one line per layout, the time split into its parts (cp columns only
    when some layout uses context parallelism)."""
    with_cp = any(r.get("cp", 1) > 1 for r in rows)
    cp_head, cp_comm = (f" {'cp':>3}", f" {'cp comm':>8}") if with_cp else ("", "")
    head = (f"{'dp':>3} {'pp':>3}{cp_head} {'tp':>3} {'GB peak':>7} {'fits':>5} {'step s':>7} "
            f"{'compute':>8} {'bubble':>7} {'tp comm':>8}{cp_comm} {'pp comm':>8} {'dp comm':>8}"
            f" {'MFU':>5}")
    lines = [head, "-" * len(head)]
    for r in rows[:top]:
        cp_cell = f" {r['cp']:>3}" if with_cp else ""
        cp_time = f" {r['cp_s']:>8.2f}" if with_cp else ""
        lines.append(f"{r['dp']:>3} {r['pp']:>3}{cp_cell} {r['tp']:>3} {r['gb']:>7.1f} "
                     f"{'yes' if r['fits'] else 'no':>5} {r['step_s']:>7.2f} "
                     f"{r['compute_s']:>8.2f} {r['bubble_s']:>7.2f} {r['tp_s']:>8.2f}"
                     f"{cp_time} {r['pp_s']:>8.2f} {r['dp_s']:>8.2f} {r['mfu']:>5.0%}")
    if len(rows) > top:
        lines.append(f"... and {len(rows) - top} more")
    return "\n".join(lines)


def best(model, **kw):
    """The fastest layout that fits, or a one-sentence ValueError when none does."""
    rows = rank_layouts(model, **kw)
    if not rows[0]["fits"]:
        smallest = min(rows, key=lambda r: r["gb"])
        cp = f" cp={smallest['cp']}" if smallest.get("cp", 1) > 1 else ""
        raise ValueError(f"no layout of {model} fits: the leanest, dp={smallest['dp']} "
                         f"pp={smallest['pp']}{cp} tp={smallest['tp']}, needs "
                         f"{smallest['gb']:.0f} GB per GPU at its peak; add GPUs or shard more "
                         f"(zero_stage).")
    return rows[0]
