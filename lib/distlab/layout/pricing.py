"""The price of one layout: seconds per step, split into its parts, and GB per GPU."""
import math

import torch

from .. import hardware, memory
from ..emulate import comm_seconds
from .layer_time import _cluster, _gemm_train, layer_seconds
from .search import divisors, positive_whole
from .shapes import _BF16, _recompute, model_flops, shape_of

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


def _check_layout(shape, dp, pp, tp, cp, gpus_per_node, global_batch, seq_len, micro_batch,
                  value_bytes):
    """Refuse a layout the model cannot be cut into: its price would be computed on fractions
    of heads or tokens (integer division rounds them away without a word)."""
    for name, value in (("dp", dp), ("pp", pp), ("tp", tp), ("cp", cp),
                        ("gpus_per_node", gpus_per_node), ("global_batch", global_batch),
                        ("seq_len", seq_len), ("micro_batch", micro_batch)):
        positive_whole(name, value)
    if shape.heads % tp:
        raise ValueError(f"tp={tp} does not divide the model's {shape.heads} attention heads; "
                         f"choose a tp that does ({', '.join(map(str, divisors(shape.heads)))}).")
    if seq_len % cp:
        raise ValueError(f"cp={cp} does not divide the sequence of {seq_len} tokens; choose a "
                         f"cp that does.")
    if value_bytes not in (2, 4):
        raise ValueError(f"value_bytes must be 2 (bf16) or 4 (fp32); got {value_bytes!r}.")


def price(model, dp, pp, tp, gpus_per_node=8, global_batch=512, seq_len=4096, micro_batch=1,
          zero_stage=1, checkpointing=True, gpu_bytes=None, peak_flops=None, mfu=None,
          intra=None, inter=None, value_bytes=2, cp=1, *, cluster="h100-cluster",
          sequence_parallel=True, interleave=1, overlap_dp=True, overlap_tp=False,
          overlap_cp=True, vocab_parallel=True, attention="flash", fused=True, sustained=None,
          optimizer="adam", bucket_bytes=BUCKET_BYTES, dp_messages=None, schedule="1f1b",
          dropout=False, scatter_gather=True, overlap_pp=False, grad_bytes=2,
          keep_unsharded=None, dp_shard=None):
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
    `overlap_pp`: messages sent asynchronously (isend), hidden behind the next micro-batch.
    `checkpointing="selective-op"`: torchtitan's op-level policy (memory.activation_breakdown).
    `grad_bytes`: bytes of a gradient (2: bf16; 4: fp32, Megatron-LM's default with --bf16, which
    accumulates and reduces gradients in fp32 `main_grad` buffers). Layers that pp does not
    divide (Llama 3 405B's 126 at pp 8) are priced on the heaviest stage, ceil(layers / pp).
    `keep_unsharded` (zero_stage=3): FSDP keeps a stage's weights gathered from the first
    micro-batch's forward to the last backward and accumulates its unsharded gradients in fp32
    until the last backward reduce-scatters them — one all-gather and one reduce-scatter a step
    for 2 + 4 bytes a parameter held; False: every micro-batch gathers its weights forward and
    again backward and reduce-scatters its gradients (2·m all-gathers, m reduce-scatters).
    None (the default): kept when pp > 1, torchtitan's default (reshard_after_forward = not
    pp_enabled; torch's pipeline stages defer the gradient sync to the last backward).
    `dp_shard` (zero_stage=3): HSDP, FSDP2's fully_shard on a 2-D (replicate, shard) mesh: the
    states sharded over dp_shard·cp ranks only (dp_shard consecutive dp ranks), the weights
    all-gathered and the gradients reduce-scattered inside that group, and each rank's 1/shard
    of the gradients all-reduced over the dp / dp_shard replicas once a step (FSDP2's
    set_requires_all_reduce(False) until the last micro-batch), hidden behind the last
    backward but its last layer's. None (the default): shard over every dp·cp rank."""
    shape, n = shape_of(model)
    _check_layout(shape, dp, pp, tp, cp, gpus_per_node, global_batch, seq_len, micro_batch,
                  value_bytes)
    shard = dp if dp_shard is None else positive_whole("dp_shard", dp_shard)
    if dp % shard or (shard != dp and zero_stage != 3):
        raise ValueError(f"dp_shard={dp_shard} must divide dp={dp}, and shards only under "
                         f"zero_stage=3 (HSDP); got zero_stage={zero_stage}.")
    replicas, zero_world = dp // shard, shard * cp    # HSDP: replicas of a shard group
    cluster = _cluster(cluster, gpus_per_node, intra, inter)
    dev = cluster.device
    recompute = _recompute(checkpointing)
    if schedule not in ("1f1b", "gpipe"):
        raise ValueError(f"schedule must be '1f1b' or 'gpipe'; got {schedule!r}.")
    v = interleave
    if grad_bytes not in (2, 4):
        raise ValueError(f"grad_bytes must be 2 (bf16 gradients) or 4 (fp32); got {grad_bytes!r}.")
    if not isinstance(v, int) or v < 1 or (v > 1 and shape.layers % (pp * v)):
        raise ValueError(f"interleave={v!r}: {shape.layers} layers do not split into "
                         f"{pp} stages × {v} chunks.")
    m = global_batch // (dp * micro_batch)
    if m < 1:
        raise ValueError(f"a global batch of {global_batch} gives each of dp={dp} replicas less "
                         f"than one micro-batch of {micro_batch}.")
    dtype = {2: _BF16, 4: torch.float32}[value_bytes]
    b, s, h, L = micro_batch, seq_len, shape.hidden, shape.layers
    tokens = b * s // cp
    layers_here = -(-L // pp)                   # the heaviest stage's layers

    # ---- memory -------------------------------------------------------------------------
    vocab_rows = shape.vocab / (tp if vocab_parallel else 1)
    # the preset's parameter count, less the embedding and the head, spread over the layers
    per_layer = (n - 2 * shape.vocab * h) / L
    stage_params = layers_here * per_layer / tp
    # the first stage holds the embedding, the last the head; one stage holds both
    first = stage_params + vocab_rows * h * (1 if pp > 1 else 2)
    last = stage_params + vocab_rows * h if pp > 1 else first
    states = {k: sum(memory.model_state_bytes(p, zero_stage=zero_stage,
                                              world_size=zero_world).values())
                 + (grad_bytes - 2) * p / (zero_world if zero_stage >= 2 else 1)
              for k, p in (("first", first), ("last", last))}
    # FSDP (ZeRO-3) holds whole units for a moment: the unit computing now gathered in bf16 with
    # its bf16 gradient and the fp32 copy that is reduce-scattered (torchtitan's
    # MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32): 2 + 2 + 4 bytes a parameter),
    # the largest unit being the head (vocabulary × hidden) or a layer, and the next layer
    # prefetched (2 bytes) — an ESTIMATE of FSDP2's peak buffers, not a measurement
    buffers = 0.0
    fsdp = zero_stage == 3 and zero_world > 1
    keep = fsdp and (pp > 1 if keep_unsharded is None else bool(keep_unsharded))
    if fsdp:
        buffers = 8 * max(per_layer / tp, vocab_rows * h) + 2 * per_layer / tp
    if keep:
        # the stage's bf16 weights and fp32 gradient accumulators, whole, for the whole step
        # (FSDP2 upcasts an unsharded gradient to reduce_dtype when its sync is deferred)
        held = {k: (2 + 4) * p for k, p in (("first", first), ("last", last))}
        states = {k: states[k] + held[k] for k in states}
        buffers = 0.0
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
    # one layer recomputed at a time: all of it (full), what was not kept (op-level)
    working = {"full": whole, "selective-op": whole - saved}.get(recompute, 0.0)
    logits = tokens * vocab_rows * LOGIT_BYTES
    steady = states["first"] + acts_first
    peak_first = steady + working + (logits if pp == 1 else 0.0) + buffers
    peak_last = states["last"] + acts_last + working + logits + buffers
    peak = max(peak_first, peak_last)
    # what the peak is made of, on the stage where it occurs (chapter 12 sets them side by side)
    if peak_first >= peak_last:
        parts = (states["first"], acts_first, working, logits if pp == 1 else 0.0)
    else:
        parts = (states["last"], acts_last, working, logits)
    peak_parts = dict(zip(("states", "activations", "working", "logits"),
                          (x / memory.GB for x in parts)))
    if buffers:
        peak_parts["fsdp buffers"] = buffers / memory.GB
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
        if fsdp:
            # FSDP: weights all-gathered layer by layer and gradients reduce-scattered, once a
            # step (keep) or per micro-batch, all of it prefetched behind the step's compute
            # but the first layer's gather; inside the shard group (every dp·cp rank but HSDP's)
            link = cluster.link_between(group[:zero_world])
            rounds = 1 if keep else m
            total = rounds * comm_seconds("reduce_scatter", grads, zero_world, link)
            total += (1 if keep else 2 * m) * comm_seconds("all_gather", grads, zero_world, link)
            first_gather = comm_seconds("all_gather", item * per_layer / tp, zero_world, link)
            dp_time = max(first_gather, total - compute) if overlap_dp else total
            if replicas > 1:
                # HSDP: this rank's 1/shard of the gradients all-reduced over the replicas, on
                # their own link, during the last backward; its last layer's waits
                span = shard * pp * cp * tp             # consecutive ranks a shard group spans
                rep_group = [r * span for r in range(replicas)]
                rep_link = cluster.link_between(rep_group)
                # every GPU of a node is in one replicate group, all reducing at once: the
                # node's NICs are shared by its min(span, node) groups (link_between prices one)
                nics = getattr(cluster, "nics_per_node", None)
                share = 1.0
                if nics and len({r // gpus_per_node for r in rep_group}) > 1:
                    members = max(1, gpus_per_node // span)
                    share = max(1.0, min(span, gpus_per_node) * min(members, nics) / nics)
                ar = comm_seconds("all_reduce", share * grads / zero_world, replicas, rep_link)
                last_ar = comm_seconds("all_reduce", share * item * per_layer / tp / zero_world,
                                       replicas, rep_link)
                window = compute / m * (2 / 3)      # the last micro-batch's backward
                dp_time += max(last_ar, ar - window) if overlap_dp else ar
        else:
            one_bucket = comm_seconds("all_reduce", grads / messages, dp * cp, dp_link)
            total = messages * one_bucket
            if overlap_dp:
                window = compute / m * (2 / 3)      # the last micro-batch's backward
                dp_time = max(one_bucket, total - window * (1 - 1 / messages))
            else:
                dp_time = total
    if optimizer not in OPTIMIZER_BYTES:
        raise ValueError(f"optimizer must be one of {sorted(OPTIMIZER_BYTES)}; got {optimizer!r}.")
    sharded = zero_world if (zero_stage >= 1 and optimizer == "adam") else 1
    per_param = OPTIMIZER_BYTES[optimizer] * (1 if optimizer == "adam" else item)
    optimizer_s = per_param * max(first, last) / sharded / dev.memory_bandwidth

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
