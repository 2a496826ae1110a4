"""torch's own FSDP2 memory tracker, held against the course's ZeRO-3 peak.

`zero_memory.llama_zero3_peak` counts a Llama's ZeRO-3 step moment by moment. Here the real
thing runs instead: FSDP2 (`fully_shard`) trains the same Llama for one step — forward, backward,
Adam — while `torch.distributed._tools.fsdp2_mem_tracker.FSDPMemTracker` files every tensor
storage under what it is for (sharded and unsharded parameters, sharded and unsharded
gradients, optimizer state, activations, backward's temporaries, the all-gather and
reduce-scatter buffers) and keeps the breakdown at its peak.

Nothing is computed and nothing is sent: the model lives in `FakeTensorMode` (shapes and dtypes,
no memory), and the process group is torch's fake one (every collective returns at once), so one
CPU process plays one rank of a full-size job — Llama-2 7B on 8 GPUs in well under a minute.

The setup follows the course's model: each block one FSDP unit, the embedding one, the final
norm and the LM head one (the root holds no parameter of its own: a root's parameters would
stay gathered, and their gradient unreduced, until the end of backward); bf16 compute and bf16
gradient reduction over fp32 shards (MixedPrecisionPolicy); the logits cast to float32 for the
cross-entropy; Adam's moments made before the tracked step, which starts with no gradient.
"""
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from . import zero_memory

# The course's peak terms and the tracker's categories, side by side. Saved activations and
# backward's temporaries are compared as one: the tracker files a tensor by when it was made
# (forward: activation; backward: temporary), so the recomputed block of a checkpointed backward
# is a temporary there and a "recompute working set" here, and the loss's logits are split
# between both; their sum is the same bytes.
TERMS = {
    "model states": (("states", "gradient shards"),
                     ("Sharded Param", "Sharded Grad", "OptState", "Buffer")),
    "gathered weights": (("gathered weights",), ("Unsharded Param", "All Gather")),
    "full gradients": (("full gradient before reduce-scatter",),
                       ("Unsharded Grad", "Reduce Scatter")),
    "activations and temporaries": (
        ("saved activations", "recompute working set", "loss: logits and their gradient",
         "flowing gradient"),
        ("Activation", "Temp", "Inputs")),
}


class Llama(nn.Module):
    """A Llama of `zero_memory.LlamaBlock`s: token embedding, blocks, then the final RMSNorm and
    the (untied) LM head as one submodule, `out` — the units llama_zero3_peak counts."""

    def __init__(self, layers, hidden, heads, ffn, vocab):
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.blocks = nn.ModuleList(zero_memory.LlamaBlock(hidden, heads, ffn)
                                    for _ in range(layers))
        self.out = nn.Sequential(nn.RMSNorm(hidden, eps=1e-5), nn.Linear(hidden, vocab, bias=False))

    def forward(self, tokens, cos, sin):
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x, cos, sin)
        return self.out(x)


def fsdp2_peak(world_size, seq_len, micro_batch=1, recompute="none", shape=None):
    """{"peak": bytes, "parts": {category: bytes}}: FSDPMemTracker's peak for one rank of a
    Llama (default Llama-2 7B) trained with FSDP2 over `world_size` ranks, and its breakdown at
    that moment (categories that hold nothing left out). recompute="full" wraps each block in
    checkpoint_wrapper before sharding it."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if recompute not in ("none", "full"):
        raise ValueError(f"recompute must be 'none' or 'full'; got {recompute!r}.")
    if dist.is_initialized():
        raise RuntimeError("fsdp2_peak plays one rank on a fake process group of its own, and "
                           "this process already has a default process group: call it from a "
                           "process without one (the notebook's kernel, not a rank).")
    c = dict(zero_memory.LLAMA2_7B if shape is None else shape)
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)
    try:
        # the mesh reads its rank list as values: built before fake mode, which has none
        mesh = init_device_mesh("cpu", (world_size,))
        with FakeTensorMode():
            with torch.device("meta"):
                model = Llama(**c)
            if recompute == "full":
                for i, block in enumerate(model.blocks):
                    model.blocks[i] = checkpoint_wrapper(block)
            policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16)
            for unit in (model.embed, *model.blocks, model.out, model):
                fully_shard(unit, mesh=mesh, mp_policy=policy)
            model.to_empty(device="cpu")
            optimizer = torch.optim.Adam(model.parameters(), lr=1e-4)
            cos, sin = zero_memory.rotary_tables(seq_len, c["hidden"] // c["heads"], torch.bfloat16)
            tokens = torch.randint(0, c["vocab"], (micro_batch, seq_len))
            targets = torch.randint(0, c["vocab"], (micro_batch, seq_len))

            def step():
                logits = model(tokens, cos, sin)
                F.cross_entropy(logits.float().flatten(0, 1), targets.flatten()).backward()
                optimizer.step()
                optimizer.zero_grad()

            # Adam makes its moments at its first step; a step on zero gradients makes them
            # without a forward and backward, so the tracked step starts from the steady state
            for p in model.parameters():
                p.grad = torch.zeros_like(p)
            optimizer.step()
            optimizer.zero_grad()
            tracker = FSDPMemTracker(model, optimizer)
            tracker.track_inputs((tokens, targets, cos, sin))
            with tracker:
                step()
            (snapshot,) = tracker.get_tracker_snapshot("peak").values()
    finally:
        dist.destroy_process_group()
    peak = snapshot.pop("Total")
    return {"peak": peak, "parts": {getattr(k, "value", k): v for k, v in snapshot.items() if v}}


def held_against_tracker(world_size, seq_len, micro_batch=1, recompute="none", shape=None):
    """The course's ZeRO-3 peak (llama_zero3_peak, prefetch on: FSDP2 prefetches) and the
    tracker's (fsdp2_peak) for the same Llama, and the terms side by side:
    {"course", "tracker", "terms": {term: (course bytes, tracker bytes)}} (TERMS says which
    parts make each term)."""
    course = zero_memory.llama_zero3_peak(world_size, seq_len, micro_batch, prefetch=True,
                                          recompute=recompute, shape=shape)
    tracker = fsdp2_peak(world_size, seq_len, micro_batch, recompute, shape)
    for side, parts, i in (("course's", course["parts"], 0), ("tracker's", tracker["parts"], 1)):
        unfiled = set(parts) - set().union(*(t[i] for t in TERMS.values()))
        if unfiled:       # a new term on either side must be given its place in TERMS
            raise AssertionError(f"TERMS does not file the {side} {sorted(unfiled)}")
    terms = {name: (sum(course["parts"].get(k, 0) for k in ours),
                    sum(tracker["parts"].get(k, 0) for k in theirs))
             for name, (ours, theirs) in TERMS.items()}
    return {"course": course, "tracker": tracker, "terms": terms}


def report(held, unit=1e9, unit_name="GB"):
    """held_against_tracker's result as lines: the two peaks, then each term, the course's
    beside the tracker's, with the tracker's categories that make it."""
    course, tracker = held["course"], held["tracker"]
    lines = [f"course {course['peak'] / unit:.2f} {unit_name} ({course['moment']}), "
             f"FSDPMemTracker {tracker['peak'] / unit:.2f} {unit_name}: "
             f"course / tracker = {course['peak'] / tracker['peak']:.3f}",
             f"   {'':28} {'course':>7} {'tracker':>7}   (the tracker's categories)"]
    for name, (ours, theirs) in held["terms"].items():
        cats = ", ".join(f"{k} {tracker['parts'][k] / unit:.2f}"
                         for k in TERMS[name][1] if k in tracker["parts"])
        lines.append(f"   {name:28} {ours / unit:7.2f} {theirs / unit:7.2f}   {cats}")
    return "\n".join(lines)
