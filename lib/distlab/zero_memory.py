"""Peak memory of ZeRO-3, moment by moment, and what a Llama block keeps for backward.

distlab.memory counts the steady state: sharded model states plus stored activations. A step
needs more at its worst moment: ZeRO-3 gathers a unit's full weights (two units' with
prefetch), autograd produces the unit's FULL gradient before the reduce-scatter cuts it to a
shard, the gradient flowing backward is an activation-sized tensor, and the loss holds the
logits and their gradient. `zero3_peak` walks the step's moments and returns the largest;
`PeakTracker` measures the same thing on real CPU tensors (a tracked allocation peak: every
tensor storage the rank's thread allocates, alive or freed, op by op).

`llama_activations` counts what an eager PyTorch Llama block (`LlamaBlock`: RMSNorm, rotary
embeddings, flash attention, SwiGLU, no dropout, no biases) saves for backward — measured
against the block in chapter 06 and in tests/test_ch06.py, to the byte. Korthikanti et al.'s
34·s·b·h is a GPT block with dropout; Llama's is another count.
"""
import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from . import memory

# Llama 2 7B: Touvron et al. 2023 ("Llama 2: Open Foundation and Fine-Tuned Chat Models"),
# table 1, and config.json of meta-llama/Llama-2-7b-hf: 32 layers, hidden 4096, 32 heads,
# SwiGLU intermediate size 11008, vocabulary 32000, untied embedding and LM head, RMSNorm.
LLAMA2_7B = dict(layers=32, hidden=4096, heads=32, ffn=11008, vocab=32000)


# ---- the block, and what it saves for backward --------------------------------------------------

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

    from . import models
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


# ---- peak memory, moment by moment ------------------------------------------------------------

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


# ---- a tracked allocation peak on real CPU tensors ----------------------------------------------

class PeakTracker:
    """A context that records the peak of the bytes held by tensor storages, op by op.

    Every storage an op reads or writes on this thread is tracked (weakly: a freed storage
    stops counting; a storage shrunk with resize_, as ZeRO-3 frees parameters, counts its
    current size). `tensors` given at entry are tracked from the start: the baseline.
    After the block: .baseline (bytes at entry), .peak (the largest total seen).
    What it does not see: buffers that a communication library allocates outside torch (gloo's,
    NCCL's), and the allocator's rounding and fragmentation (torch.cuda.max_memory_allocated on
    a GPU sees the rounding; memory_reserved the fragmentation)."""

    def __init__(self, tensors=()):
        self._initial = list(tensors)

    def __enter__(self):
        from torch.multiprocessing.reductions import StorageWeakRef
        from torch.utils._python_dispatch import TorchDispatchMode
        from torch.utils._pytree import tree_leaves
        tracker, refs = self, {}

        def track(t):
            st = t.untyped_storage()
            if st._cdata not in refs:
                refs[st._cdata] = StorageWeakRef(st)

        def live():
            total = 0
            for key, ref in list(refs.items()):
                st = torch.UntypedStorage._new_with_weak_ptr(ref.cdata)
                if st is None:           # freed (perhaps by gloo's worker thread, just now)
                    del refs[key]
                else:
                    total += st.nbytes()
            return total

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                for t in tree_leaves((out, args, kwargs)):
                    if isinstance(t, torch.Tensor):
                        track(t)
                tracker.peak = max(tracker.peak, live())
                return out

        for t in self._initial:
            if isinstance(t, torch.Tensor):
                track(t)
        self.baseline = self.peak = live()
        self._mode = Mode()
        self._mode.__enter__()
        return self

    def __exit__(self, *exc):
        self._mode.__exit__(*exc)
        return False


# ---- ZeRO-3's time per block, closed form ----------------------------------------------------

def zero3_block_seconds(cluster, world_size, tokens, shape=None, dtype=torch.bfloat16):
    """{"gather", "forward", "backward", "reduce_scatter"}: modeled seconds of one Llama block
    under ZeRO-3 on the first `world_size` ranks of `cluster` with `tokens` tokens per rank:
    its matmuls at the device's shape-dependent rate (Device.gemm_seconds), causal flash
    attention at the rate of its (s × s × head_dim) shape, backward twice the forward; the
    all-gather of its bf16 weights and the reduce-scatter of its bf16 gradient on the link the
    group sees (Cluster.link_between: one ring per NIC across nodes). The same formulas the
    emulator charges; elementwise work (norms, rotary, SiLU) is left out."""
    c = dict(LLAMA2_7B if shape is None else shape)
    h, a, f = c["hidden"], c["heads"], c["ffn"]
    dev = cluster.device
    mm = sum(dev.gemm_seconds(tokens, n, k, dtype) for n, k in
             ((3 * h, h), (h, h), (2 * f, h), (h, f)))
    d = h // a
    attn_flops = 4.0 * tokens * tokens * d * a * 0.5         # causal: half the s×s blocks
    attn = attn_flops / (dev.peak(dtype) * dev.gemm_efficiency(tokens, tokens, d, dtype, a))
    nbytes = torch.empty((), dtype=dtype).element_size() * llama_block_params(h, f)
    link = cluster.link_between(range(world_size))
    return {"gather": link.seconds("all_gather", nbytes, world_size),
            "forward": mm + attn, "backward": 2 * (mm + attn),
            "reduce_scatter": link.seconds("reduce_scatter", nbytes, world_size)}


def hiding_tokens(cluster, world_size, shape=None, dtype=torch.bfloat16):
    """The fewest tokens per rank (a power of two) at which one block's forward takes at least
    as long as its all-gather: from there on prefetching can hide ZeRO-3's gathers."""
    tokens = 64
    while tokens < 2 ** 20:
        t = zero3_block_seconds(cluster, world_size, tokens, shape, dtype)
        if t["forward"] >= t["gather"]:
            return tokens
        tokens *= 2
    return math.inf


def zero3_units_seconds(units, prefetch):
    """Modeled seconds of ZeRO-3's forward + backward over unequal units run in order, on one
    link per rank (memory.zero3_step_seconds for equal units generalised).

    units: dicts of seconds — "gather" (its weights' all-gather), "forward", "backward",
    "reduce_scatter" (its gradient, synchronous), and optionally "forward_after" /
    "backward_after": compute that runs after the unit and before the next unit's gather is
    asked for (attention between the q/k/v and output projections).
    Without prefetch nothing overlaps. With prefetch the next unit's gather (the previous one's
    in backward) runs on the link during this unit's compute; the reduce-scatter queues behind it.
    """
    n, total = len(units), 0.0
    get = lambda u, k: u.get(k, 0.0)     # noqa: E731
    for i, u in enumerate(units):            # forward
        compute = u["forward"] + get(u, "forward_after")
        if not prefetch:
            total += u["gather"] + compute
        else:
            total += (u["gather"] if i == 0 else 0.0)
            total += max(compute, units[i + 1]["gather"]) if i + 1 < n else compute
    for i in reversed(range(n)):             # backward
        u = units[i]
        if not prefetch:
            total += u["gather"] + u["backward"] + u["reduce_scatter"] + get(u, "backward_after")
        else:
            total += (u["gather"] if i == n - 1 else 0.0)
            behind = units[i - 1]["gather"] if i > 0 else 0.0
            total += max(u["backward"], behind) + u["reduce_scatter"] + get(u, "backward_after")
    return total


def llama_zero3_units(cluster, world_size, tokens, blocks, shape=None, dtype=torch.bfloat16):
    """The units ZeRO (distlab.sharding) gathers for a stack of LlamaBlocks — every module with
    parameters: norm, q/k/v, output projection, norm, gate/up, down — as zero3_units_seconds
    wants them: matmuls at Device.gemm_seconds, causal flash attention at its (s × s × head_dim)
    rate after the q/k/v unit (forward) and the output projection's reduce-scatter (backward),
    backward twice the forward, gathers and reduce-scatters of bf16 tensors on the group's link.
    Elementwise work (norms' arithmetic, rotary, SiLU, residual adds) is left out."""
    c = dict(LLAMA2_7B if shape is None else shape)
    h, a, f = c["hidden"], c["heads"], c["ffn"]
    dev, link = cluster.device, cluster.link_between(range(world_size))
    item = torch.empty((), dtype=dtype).element_size()
    d = h // a
    attn = (2.0 * tokens * tokens * d * a
            / (dev.peak(dtype) * dev.gemm_efficiency(tokens, tokens, d, dtype, a)))

    def unit(n_out, n_in, matmul=True):
        nbytes = item * n_out * n_in
        fwd = dev.gemm_seconds(tokens, n_out, n_in, dtype) if matmul else 0.0
        return {"gather": link.seconds("all_gather", nbytes, world_size), "forward": fwd,
                "backward": 2 * fwd, "reduce_scatter": link.seconds("reduce_scatter", nbytes,
                                                                     world_size)}
    units = []
    for _ in range(blocks):
        qkv, out = unit(3 * h, h), unit(h, h)
        qkv["forward_after"] = attn                # causal: half of 4·s²·d·a FLOPs
        out["backward_after"] = 2 * attn
        units += [unit(h, 1, False), qkv, out, unit(h, 1, False), unit(2 * f, h), unit(h, f)]
    return units


# ---- what "16 bytes per parameter" means, by framework ------------------------------------

# Bytes per parameter one rank keeps for bf16 training with Adam, unsharded, by convention:
# {name: ({kind: bytes}, what is transient on top, source)}. Sharding (ZeRO/FSDP) divides the
# kept kinds by N as memory.model_state_bytes does.
CONVENTIONS = {
    "ZeRO paper / distlab.memory": (
        {"bf16 weights": 2, "bf16 gradients": 2, "fp32 master weights": 4, "Adam moments": 8},
        "nothing", "Rajbhandari et al. 2020, ZeRO, section 3.1 (2 + 2 + 12)"),
    "Megatron-LM (bf16)": (
        {"bf16 weights": 2, "fp32 main gradients": 4, "fp32 master weights": 4,
         "Adam moments": 8},
        "nothing: backward accumulates straight into the fp32 main_grad buffer",
        "Megatron-LM's DistributedDataParallel (accumulate_allreduce_grads_in_fp32, on with "
        "bf16) and its distributed optimizer's fp32 main params"),
    "PyTorch AMP (torch.autocast)": (
        {"fp32 weights": 4, "fp32 gradients": 4, "Adam moments": 8},
        "a bf16 copy of each weight, cast per op and saved for backward: +2",
        "torch.autocast: parameters and .grad stay fp32; matmuls cast their weight to bf16"),
    "FSDP2, bf16 params, fp32 reduce": (
        {"fp32 weight shards": 4, "fp32 gradient shards": 4, "Adam moments": 8},
        "a unit's bf16 weights and bf16 gradient, unsharded, while it runs",
        "torch.distributed.fsdp.MixedPrecisionPolicy(param_dtype=torch.bfloat16, "
        "reduce_dtype=torch.float32): the sharded parameter stays fp32, its .grad an fp32 "
        "shard"),
}


def convention_bytes(name):
    """Bytes per parameter a convention keeps (CONVENTIONS), unsharded."""
    return sum(CONVENTIONS[name][0].values())
