"""Which (dp, pp, cp, tp) layouts exist for a number of GPUs, a model and a batch."""


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
