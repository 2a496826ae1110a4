"""The peak of a ZeRO-3 step, moment by moment: the largest of what each moment holds."""
from .. import memory
from .llama import LLAMA2_7B, llama_activations, llama_block_params, llama_params


def zero3_peak(units, states, prefetch=False, flowing=0.0, loss=0.0):
    """The peak of a ZeRO-3 step over a stack of units run in order, and when it happens.

    units: one dict per unit (a module gathered at once; "name" optional), in forward order,
    of bytes:
        "weights" (the full gathered weights), "grad" (the full gradient autograd makes before
        the reduce-scatter), "grad_shard" (what the reduce-scatter leaves this rank), "acts"
        (what the unit saves for backward until its own backward).
    states: bytes held throughout (weight shards and optimizer state); flowing: bytes of one
    gradient of an activation (the one arriving at a unit and the one it sends on);
    loss: what the loss holds at the turn from forward to backward (logits and their gradient).

    Moments (each unit's weights are gathered just before it runs and freed right after;
    prefetch gathers the next one, the previous one in backward, during it):
      forward, unit i: states + acts of units < i and i + its weights (+ the next unit's);
      the turn: states + every unit's acts + loss + one flowing gradient;
      backward, unit i, at its reduce-scatter: states + gradient shards of units >= i + acts
        of units < i + its weights + its full gradient (+ the previous unit's weights) + the
        gradient that arrived and the one it sends on (none from the first unit).
    Returns {"peak", "moment", "parts": {what: bytes} at that moment} (parts that are zero at
    that moment are left out)."""
    n = len(units)
    moments = []
    for i, u in enumerate(units):
        ahead = units[i + 1]["weights"] if prefetch and i + 1 < n else 0.0
        moments.append((f"forward, {u.get('name', f'unit {i}')}", {
            "states": states, "saved activations": sum(v["acts"] for v in units[:i + 1]),
            "gathered weights": u["weights"] + ahead}))
    moments.append(("the turn (loss backward)", {
        "states": states, "saved activations": sum(v["acts"] for v in units),
        "loss: logits and their gradient": loss, "flowing gradient": flowing}))
    for i in reversed(range(n)):
        u = units[i]
        behind = units[i - 1]["weights"] if prefetch and i > 0 else 0.0
        moments.append((f"backward, {u.get('name', f'unit {i}')}", {
            "states": states,
            "gradient shards": sum(v["grad_shard"] for v in units[i:]),
            "saved activations": sum(v["acts"] for v in units[:i]),
            "gathered weights": u["weights"] + behind,
            "full gradient before reduce-scatter": u["grad"],
            "recompute working set": u.get("work", 0.0),
            "flowing gradient": flowing * (2 if i > 0 else 1)}))
    moment, parts = max(moments, key=lambda m: sum(m[1].values()))
    parts = {k: v for k, v in parts.items() if v}
    return {"peak": sum(parts.values()), "moment": moment, "parts": parts}


def llama_zero3_peak(world_size, seq_len, micro_batch=1, prefetch=True, recompute="none",
                     shape=None):
    """zero3_peak for a Llama (default Llama-2 7B) trained in bf16 mixed precision with Adam
    under ZeRO-3 over `world_size` ranks, each block one unit (FSDP2's usual wrapping): states
    are 16 B/param sharded (memory.model_state_bytes, gradient shards counted as they fill);
    each block gathers 2 B/param and makes a 2 B/param full gradient; the embedding and the LM
    head are units too. The loss: bf16 logits, their float32 copy for the cross-entropy (which
    keeps its float32 log-softmax) and the float32 gradient coming back, s·b·V·(2 + 4 + 4)
    bytes. recompute="full": a block keeps its input, and its backward first reruns its
    forward — its full activations exist again (the recompute working set)."""
    c = dict(LLAMA2_7B if shape is None else shape)
    L, h, a, f, V = c["layers"], c["hidden"], c["heads"], c["ffn"], c["vocab"]
    n_params = llama_params(L, h, a, f, V)
    st = memory.model_state_bytes(n_params, "bf16-mixed", "adam", 3, world_size)
    states = st["weights"] + st["optimizer"]             # the gradient shards fill in backward
    tokens = seq_len * micro_batch
    full_acts = sum(llama_activations(seq_len, micro_batch, h, a, f).values())
    kept = sum(llama_activations(seq_len, micro_batch, h, a, f, recompute=recompute).values())
    block = llama_block_params(h, f)

    def unit(params, acts):
        return dict(weights=2 * params, grad=2 * params, grad_shard=2 * params / world_size,
                    acts=acts)
    units = ([dict(unit(V * h, 2 * tokens * h), name="the embedding")]       # its output
             + [dict(unit(block, kept), name=f"block {i}") for i in range(L)]
             + [dict(unit(V * h + h, 2 * tokens * h), name="the LM head")])   # its input
    # the recompute working set: a checkpointed block's backward holds its full activations
    if recompute == "full":
        for u in units[1:-1]:
            u["work"] = full_acts - kept
    loss = tokens * V * (2 + 4 + 4)
    return zero3_peak(units, states, prefetch, flowing=2 * tokens * h, loss=loss)


# Llama-2 13B: Touvron et al. 2023, table 1, and config.json of meta-llama/Llama-2-13b-hf.
LLAMA2_13B = dict(layers=40, hidden=5120, heads=40, ffn=13824, vocab=32000)
_PEAK_PRESETS = {"Llama-2 7B": LLAMA2_7B, "Llama-2 13B": LLAMA2_13B}


def preset_zero3_peak(model, precision, optimizer, zero_stage, world_size, seq_len, micro_batch,
                      checkpointing, attention):
    """The step's peak (llama_zero3_peak, prefetch on) for the calculator's settings where that
    count applies — a Llama-2 7B or 13B preset (no grouped-query attention), ZeRO-3, bf16 mixed
    precision with Adam, flash attention — else None: the calculator then shows the steady state
    alone, a lower bound."""
    recompute = {False: "none", None: "none", True: "full", "selective": "none"}.get(
        checkpointing, checkpointing)      # flash attention: selective recomputes nothing more
    if (model not in _PEAK_PRESETS or zero_stage != 3 or precision != "bf16-mixed"
            or optimizer != "adam" or attention != "flash"):
        return None
    return llama_zero3_peak(world_size, seq_len, micro_batch, prefetch=True,
                            recompute=recompute, shape=_PEAK_PRESETS[model])["peak"]
