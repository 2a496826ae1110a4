"""Which (dp, pp, cp, tp) layouts exist for a number of GPUs, a model and a batch, and how each
can hold its data-parallel states (the families: ZeRO-1, FSDP, HSDP)."""
import numbers


def positive_whole(name, value):
    """`value` as an int, or a one-sentence error: a layout is counted in whole GPUs, layers,
    samples; a float or zero would divide by zero or price a layout that cannot exist."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be a whole number, like 4; got {value!r}.")
    if value < 1:
        raise ValueError(f"{name} must be at least 1; got {value}.")
    return int(value)


def divisors(n):
    return [d for d in range(1, n + 1) if n % d == 0]


def candidates(n_gpus, gpus_per_node, layers, heads, global_batch, micro_batch, cps=(1,),
               seq_len=4096):
    """Every (dp, pp, cp, tp) that multiplies to n_gpus and splits the model, the batch and (for
    zig-zag ring attention) the sequence evenly."""
    for name, value in (("n_gpus", n_gpus), ("gpus_per_node", gpus_per_node), ("layers", layers),
                        ("heads", heads), ("global_batch", global_batch),
                        ("micro_batch", micro_batch), ("seq_len", seq_len)):
        positive_whole(name, value)
    cps = tuple(dict.fromkeys(positive_whole("every context-parallel degree in cps", cp)
                              for cp in cps))          # each degree once
    out = []
    for tp in divisors(n_gpus):
        if heads % tp or gpus_per_node % tp:      # tp stays inside one node
            continue
        for cp in cps:
            # zig-zag cuts the sequence into 2·cp pieces; without cp (cp = 1) nothing is cut
            if (n_gpus // tp) % cp or (cp > 1 and seq_len % (2 * cp)):
                continue
            for pp in divisors(n_gpus // (tp * cp)):
                dp = n_gpus // (tp * cp * pp)
                if layers % pp or global_batch % (dp * micro_batch):
                    continue
                out.append((dp, pp, cp, tp))
    return out


# How the data-parallel ranks hold the model states, as layout.price's options:
# ZeRO-1 (Megatron-LM's distributed optimizer: Adam's states sharded, weights and gradients
# whole, the gradients all-reduced), FSDP (ZeRO-3 over every dp·cp rank: torchtitan's default,
# FSDP2's fully_shard on a 1-D mesh) and HSDP (fully_shard on a 2-D (replicate, shard) mesh:
# sharded inside a node, replicated across nodes).
FAMILIES = ("zero1", "fsdp", "hsdp")


def families(which, dp, pp, cp, tp, gpus_per_node):
    """[(label, price options)] for each way of the families `which` to shard one (dp, pp, cp,
    tp) layout: ZeRO-1 always; FSDP when there is more than one dp·cp rank to shard over; HSDP
    for every dp_shard (1 < dp_shard < dp) whose shard group, dp_shard·cp ranks strided by pp
    and tp, lies inside one node — labelled replicas x shard."""
    which = (which,) if isinstance(which, str) else tuple(which)
    unknown = [f for f in which if f not in FAMILIES]
    if unknown or not which:
        raise ValueError(f"families must name some of {FAMILIES}; got {which!r}.")
    out = []
    if "zero1" in which:
        out.append(("ZeRO-1", dict(zero_stage=1)))
    if "fsdp" in which and dp * cp > 1:
        out.append(("FSDP", dict(zero_stage=3)))
    if "hsdp" in which:
        for shard in divisors(dp)[1:-1]:
            span = shard * pp * cp * tp               # consecutive ranks the shard group spans
            if gpus_per_node % span == 0:
                out.append((f"HSDP {dp // shard}x{shard}", dict(zero_stage=3, dp_shard=shard)))
    return out
