"""Choosing a (dp, pp, tp) layout — or (dp, pp, cp, tp) with context parallelism — every candidate
priced with the α-β model and the memory model.

    rows = rank_layouts("Llama-2 13B", nodes=4, gpus_per_node=8)
    print(table(rows))

Assumptions, stated once (a planning model, not a simulator; measure before you believe it):
- mesh order (dp, pp, tp), tp fastest: a tp group is tp neighbouring GPUs, inside one node when
  tp divides the GPUs per node; a pp group spans pp·tp neighbouring GPUs and crosses nodes only
  when pp·tp exceeds a node; dp groups cross nodes as soon as the job does;
- memory per GPU: model states (bf16 mixed precision, Adam; ZeRO-`zero_stage` over dp) of
  1/(tp·pp) of the parameters, plus activations: with 1F1B the first stage holds pp micro-batches
  of its layers/pp layers, i.e. one micro-batch of ALL layers, split 1/tp by tensor parallelism
  (with full activation checkpointing by default, as models of this size are trained);
- compute: 6·N·tokens FLOPs (2 forward + 4 backward per parameter per token), plus one more
  forward, 2·N·tokens, when full activation checkpointing recomputes it in backward: 8·N·tokens
  in all; at `mfu` of `peak_flops`, spread over every GPU;
- the pipeline bubble adds (pp-1)/m of that compute, m = micro-batches per data-parallel rank:
  chapter 08's bubble FRACTION (pp-1)/(m+pp-1) is the same thing measured against the stretched
  step, since ideal·(m+pp-1)/m = ideal·(1 + (pp-1)/m);
- communication, none of it overlapped with compute (an upper bound):
  tp: 4 ring all-reduces of one micro-batch's activations (s·b·h, bf16) per layer per micro-batch;
  pp: 2 sends (activation forward, gradient back) of the same size per micro-batch, m + pp - 1
      of them on the critical path;
  dp: one ring all-reduce of this rank's bf16 gradients per step (reduce-scatter + all-gather
      under ZeRO: the same bytes).
- context parallelism (`cps=(1, 2, 4, ...)` in rank_layouts; chapter 12), mesh order
  (dp, pp, cp, tp): each rank holds 1/cp of every sequence, so activations shrink by cp; ring
  attention sends, per layer and micro-batch, (cp-1) hops of this rank's K and V blocks forward
  and of K, V and their gradients backward (2 + 4 blocks of s/cp·h values), again not
  overlapped; gradients are averaged over the dp·cp ranks that hold the same shard.
"""
from . import cost, memory


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


def _link(group_span, gpus_per_node, intra, inter):
    """The slowest link a group uses: inter-node as soon as it spans more than one node."""
    return intra if group_span <= gpus_per_node else inter


def price(model, dp, pp, tp, gpus_per_node=8, global_batch=512, seq_len=4096, micro_batch=1,
          zero_stage=1, checkpointing=True, gpu_bytes=80 * memory.GB, peak_flops=989e12, mfu=0.4,
          intra=cost.INTRA_NODE, inter=cost.INTER_NODE, value_bytes=2, cp=1):
    """Seconds per step (split into compute, bubble, tp, pp, cp, dp) and GB per GPU of one layout.

    `model` is a name in memory.PRESETS or a tuple (n_params, layers, hidden, heads);
    `value_bytes` is the size of one activation or gradient value (2: bf16, 4: fp32)."""
    n, layers, hidden, heads = memory.PRESETS[model] if isinstance(model, str) else model
    m = global_batch // (dp * micro_batch)
    states = memory.model_state_bytes(n / (tp * pp), zero_stage=zero_stage, world_size=dp * cp)
    acts = memory.activation_bytes(seq_len, micro_batch, hidden, layers, heads,
                                   checkpointing) / (tp * cp)
    gb = (sum(states.values()) + acts) / memory.GB

    flops = memory.training_flops(n, global_batch * seq_len)
    if checkpointing:
        flops += 2 * n * global_batch * seq_len      # full recompute: the forward runs twice
    compute = flops / (dp * pp * cp * tp * peak_flops * mfu)
    recompute = compute * 2 / 8 if checkpointing else 0.0
    bubble = compute * (pp - 1) / m
    act_bytes = value_bytes * seq_len // cp * micro_batch * hidden
    # Group spans in ranks: tp neighbours; a cp group strides by tp, a pp group by cp·tp, a dp
    # group by pp·cp·tp.
    tp_time = m * (layers / pp) * 4 * cost.predict(
        "ring_all_reduce", act_bytes, tp, _link(tp, gpus_per_node, intra, inter))
    cp_link = _link(cp * tp, gpus_per_node, intra, inter)
    cp_time = 0.0 if cp == 1 else m * (layers / pp) * (cp - 1) * 6 * cost.predict(
        "send", act_bytes / tp, 2, cp_link)
    pp_link = _link(pp * cp * tp, gpus_per_node, intra, inter)
    pp_time = 0.0 if pp == 1 else (m + pp - 1) * 2 * cost.predict("send", act_bytes, 2, pp_link)
    dp_time = cost.predict("ring_all_reduce", value_bytes * n / (tp * pp), dp * cp,
                           _link(dp * pp * cp * tp, gpus_per_node, intra, inter))
    total = compute + bubble + tp_time + cp_time + pp_time + dp_time
    return dict(dp=dp, pp=pp, cp=cp, tp=tp, gb=gb, fits=gb <= gpu_bytes / memory.GB,
                step_s=total, compute_s=compute, recompute_s=recompute, bubble_s=bubble,
                tp_s=tp_time, cp_s=cp_time, pp_s=pp_time, dp_s=dp_time)


def rank_layouts(model, nodes=4, gpus_per_node=8, global_batch=512, micro_batch=1, cps=(1,),
                 **kw):
    """Every candidate layout priced; those that fit in memory first, fastest first. `cps`: the
    context-parallel degrees to consider (1 alone: no context parallelism)."""
    _, layers, _, heads = memory.PRESETS[model]
    n_gpus = nodes * gpus_per_node
    seq_len = kw.get("seq_len", 4096)
    rows = [price(model, dp, pp, tp, gpus_per_node, global_batch, micro_batch=micro_batch,
                  cp=cp, **kw)
            for dp, pp, cp, tp in candidates(n_gpus, gpus_per_node, layers, heads, global_batch,
                                             micro_batch, cps, seq_len)]
    if not rows:
        raise ValueError(f"no (dp, pp, tp) splits {model} over {n_gpus} GPUs with a global "
                         f"batch of {global_batch}.")
    return sorted(rows, key=lambda r: (not r["fits"], r["step_s"]))


def table(rows, top=10):
    """The ranking as text: one line per layout, the time split into its parts (cp columns only
    when some layout uses context parallelism)."""
    with_cp = any(r.get("cp", 1) > 1 for r in rows)
    cp_head, cp_comm = (f" {'cp':>3}", f" {'cp comm':>8}") if with_cp else ("", "")
    head = (f"{'dp':>3} {'pp':>3}{cp_head} {'tp':>3} {'GB/GPU':>7} {'fits':>5} {'step s':>7} "
            f"{'compute':>8} {'bubble':>7} {'tp comm':>8}{cp_comm} {'pp comm':>8} {'dp comm':>8}")
    lines = [head, "-" * len(head)]
    for r in rows[:top]:
        cp_cell = f" {r['cp']:>3}" if with_cp else ""
        cp_time = f" {r['cp_s']:>8.2f}" if with_cp else ""
        lines.append(f"{r['dp']:>3} {r['pp']:>3}{cp_cell} {r['tp']:>3} {r['gb']:>7.1f} "
                     f"{'yes' if r['fits'] else 'no':>5} {r['step_s']:>7.2f} "
                     f"{r['compute_s']:>8.2f} {r['bubble_s']:>7.2f} {r['tp_s']:>8.2f}"
                     f"{cp_time} {r['pp_s']:>8.2f} {r['dp_s']:>8.2f}")
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
                         f"{smallest['gb']:.0f} GB per GPU; add GPUs or shard more (zero_stage).")
    return rows[0]
