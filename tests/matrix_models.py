"""The equivalence matrix's axes, the models its features need, and its pairwise covering design.

Pure (no process group): tests/test_matrix.py runs the cases on ranks; the design's coverage is
tested on its own there. Every model is built deterministically (same seed, same weights in
every process), small (widths 8-16) and float64 unless the feature is bf16.
"""
import torch
import torch.nn as nn
import torch.nn.functional as F

STRATEGIES = ("ddp", "torch_ddp", "zero1", "zero2", "zero3", "fsdp2", "tp", "tp_sp", "vocab",
              "pipeline", "ep", "cp_ring", "cp_allgather", "ulysses", "3d", "4d")
FEATURES = ("plain", "frozen", "tied", "reused", "root_param", "inplace", "buffer", "empty",
            "uneven", "bf16")
WORLD_SIZES = (1, 2, 3, 5, 6)

DATA_PARALLEL = ("ddp", "torch_ddp", "zero1", "zero2", "zero3", "fsdp2")
ATTENTION = ("cp_ring", "cp_allgather", "ulysses")
_BLOCK = ("plain", "frozen", "tied", "reused", "root_param", "inplace", "buffer", "empty",
          "uneven", "bf16")
APPLICABLE = {
    **{s: FEATURES for s in DATA_PARALLEL},
    "tp": _BLOCK, "tp_sp": _BLOCK,
    "vocab": ("plain", "frozen", "tied", "empty", "uneven"),
    "pipeline": ("plain", "frozen", "tied", "reused", "inplace", "buffer", "empty", "uneven",
                 "bf16"),
    "ep": ("plain", "frozen", "empty", "uneven", "bf16"),
    **{s: ("plain", "empty", "uneven", "bf16") for s in ATTENTION},
    "3d": ("plain", "frozen", "tied", "uneven"),
    "4d": ("plain", "frozen", "tied", "uneven"),
}
# Why a (strategy, feature) pair is not in the matrix: the strategy has no place for the feature
# (a function without parameters, a runtime that trains model.net only), or it does not claim it
# (bf16 is in the matrix where a strategy takes a dtype: DP, ZeRO, FSDP2, TP, the pipeline
# runtime, EP, the attention functions).
NOT_EXPRESSIBLE = {
    **{(s, f): "an attention function has no parameters, buffers or modules to give the feature"
       for s in ATTENTION for f in FEATURES if f not in APPLICABLE[s]},
    **{(s, f): "the vocab-parallel embedding/head/loss trio has no place for it"
       for s in ("vocab",) for f in FEATURES if f not in APPLICABLE[s]},
    ("pipeline", "root_param"): "pp.train pipelines model.net (an nn.Sequential) only",
    **{("ep", f): "ExpertParallelMoE takes an MoE layer: no place for it" for f in
       ("tied", "reused", "root_param", "inplace", "buffer")},
    **{(s, f): "Stage3D/Stage4D take a TinyGPT: no place for it"
       for s in ("3d", "4d") for f in ("reused", "root_param", "inplace", "buffer", "empty")},
    **{(s, "bf16"): "not claimed" for s in ("3d", "4d")},
}

# (3D) dp, pp, tp and (4D) dp, pp, cp, tp per world size.
LAYOUT_3D = {1: (1, 1, 1), 2: (1, 2, 1), 3: (1, 3, 1), 5: (5, 1, 1), 6: (1, 3, 2)}
LAYOUT_4D = {1: (1, 1, 1, 1), 2: (1, 2, 1, 1), 3: (1, 1, 3, 1), 5: (1, 1, 5, 1), 6: (1, 1, 3, 2)}
PIPELINE_SCHEDULES = ("GPipe", "1F1B", "interleaved 1F1B", "ZB-H1", "ZB-V", "DualPipeV",
                      "DualPipe")


def pairs_of(case):
    s, f, w = case
    return {("strategy-feature", s, f), ("strategy-world", s, w), ("feature-world", f, w)}


def required_pairs():
    need = {("strategy-feature", s, f) for s in STRATEGIES for f in APPLICABLE[s]}
    need |= {("strategy-world", s, w) for s in STRATEGIES for w in WORLD_SIZES}
    need |= {("feature-world", f, w) for f in FEATURES for w in WORLD_SIZES}
    return need


def covering_design():
    """[(strategy, feature, world size)]: every applicable (strategy, feature), every (strategy,
    world size) and every (feature, world size) in at least one case. Greedy and deterministic:
    each (strategy, feature) takes the world size that covers most pairs still open; on a tie,
    one where the feature means something across ranks (not 1, unless the feature is plain),
    then the smaller (cheaper). The (strategy, world size) and (feature, world size) pairs left
    then get a case each that covers as many open pairs as it can."""
    open_ = required_pairs()
    cases = []

    def take(case):
        cases.append(case)
        open_.difference_update(pairs_of(case))

    for s in STRATEGIES:
        for f in APPLICABLE[s]:
            take(max(((s, f, w) for w in WORLD_SIZES),
                     key=lambda c: (len(pairs_of(c) & open_), c[2] > 1 or f == "plain",
                                    -c[2])))
    for s in STRATEGIES:
        for w in WORLD_SIZES:
            if ("strategy-world", s, w) in open_:
                take(max(((s, f, w) for f in APPLICABLE[s]),
                         key=lambda c: (len(pairs_of(c) & open_), c[1] == "plain")))
    for f in FEATURES:
        for w in WORLD_SIZES:
            if ("feature-world", f, w) in open_:
                take(max(((s, f, w) for s in STRATEGIES if f in APPLICABLE[s]),
                         key=lambda c: (len(pairs_of(c) & open_), c[0] in DATA_PARALLEL)))
    assert not open_, open_
    return cases


# ---- the models -----------------------------------------------------------------------------

def seeded(seed, build):
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return build()


class FeatureNet(nn.Module):
    """An MLP 8 -> w -> w -> 4 (w = 12; 11 under "uneven": no size divides 2, 3, 5 or 6) with
    the feature built in: frozen (the first layer), tied (a second middle layer sharing the
    first's weight), reused (the middle layer twice), root_param (a scale on the root module),
    inplace (mul_/add_ on activations), buffer (a constant and a counter updated in forward),
    empty (a one-element gate: every rank but one holds an empty shard of it)."""

    def __init__(self, feature="plain"):
        super().__init__()
        self.feature = feature
        w = 11 if feature == "uneven" else 12
        self.inp, self.mid, self.out = nn.Linear(8, w), nn.Linear(w, w), nn.Linear(w, 4)
        if feature == "frozen":
            self.inp.requires_grad_(False)
        if feature == "tied":
            self.mid2 = nn.Linear(w, w)
            self.mid2.weight = self.mid.weight
        if feature == "root_param":
            self.scale = nn.Parameter(torch.linspace(0.5, 1.5, w))
        if feature == "buffer":
            self.register_buffer("shift", torch.linspace(-0.2, 0.2, w))
            self.register_buffer("calls", torch.zeros(()))
        if feature == "empty":
            self.gate = nn.Parameter(torch.tensor([0.9]))

    def forward(self, x):
        f = self.feature
        h = F.gelu(self.inp(x))
        if f == "root_param":
            h = h * self.scale
        if f == "buffer":
            h = h + self.shift
            self.calls += 1
        if f == "inplace":
            h = self.mid(h).mul_(0.5).add_(h)
        else:
            h = F.gelu(self.mid(h))
        if f == "tied":
            h = F.gelu(self.mid2(h))
        if f == "reused":
            h = F.gelu(self.mid(h))
        y = self.out(h)
        return y * self.gate if f == "empty" else y


def make_feature_net(feature):
    return seeded(0, lambda: FeatureNet(feature)).double()


class BlockNet(nn.Module):
    """A transformer Block (models.Block or its tensor-parallel copy) with the feature around
    it: root_param (a scale on the input; under sequence parallel its gradient is summed over
    the ranks with tensor_parallel.replicated), buffer (a constant added to the input), reused
    (the block twice), inplace (mul_ on the block's output). frozen and tied are set on the
    dense block (ln1 and attn.qkv frozen; ln2's weight is ln1's)."""

    def __init__(self, block, feature, d):
        super().__init__()
        self.block, self.feature, self.group, self.sp = block, feature, None, False
        if feature == "root_param":
            self.scale = nn.Parameter(torch.linspace(0.5, 1.5, d, dtype=torch.float64))
        if feature == "buffer":
            self.register_buffer("shift", torch.linspace(-0.2, 0.2, d, dtype=torch.float64))

    def forward(self, x):
        f = self.feature
        if f == "root_param":
            from distlab.tensor_parallel import replicated
            x = x * (replicated(self.scale, self.group) if self.sp else self.scale).to(x.dtype)
        if f == "buffer":
            x = x + self.shift.to(x.dtype)
        y = self.block(x)
        if f == "reused":
            y = self.block(y)
        if f == "inplace":
            y.mul_(0.5)
        return y


def block_shape(feature, ws):
    """(n_heads, d_model, hidden): one head per rank (two at ws 1); "uneven": ws + 1 heads,
    which ws > 1 ranks cannot share; "empty": 1 head, which leaves a rank without one."""
    heads = {"uneven": ws + 1, "empty": 1}.get(feature, max(2, ws))
    return heads, 2 * heads, 4 * heads


def make_block_net(feature, ws):
    from distlab.models import Block
    heads, d, hidden = block_shape(feature, ws)

    def build():
        block = Block(d, heads, hidden).double()
        if feature == "frozen":
            block.ln1.requires_grad_(False)
            block.attn.qkv.requires_grad_(False)
        if feature == "tied":
            block.ln2.weight = block.ln1.weight
        return BlockNet(block, feature, d)
    return seeded(0, build)


class Shift(nn.Module):
    """x + a constant buffer (a pipeline piece with a buffer)."""

    def __init__(self, w):
        super().__init__()
        self.register_buffer("shift", torch.linspace(-0.2, 0.2, w, dtype=torch.float64))

    def forward(self, x):
        return x + self.shift


class HalfInPlace(nn.Module):
    """A linear layer whose output is scaled in place."""

    def __init__(self, w):
        super().__init__()
        self.lin = nn.Linear(w, w)

    def forward(self, x):
        return self.lin(x).mul_(0.5)


class PipeNet(nn.Module):
    """model.net: Linear/GELU pieces, as many as `n_pieces` needs, with the feature: frozen (the
    second Linear), tied (the third Linear's weight is the first's), reused (the first Linear
    object again in third place), buffer (a Shift piece), inplace (every other Linear a
    HalfInPlace, and ReLU(inplace=True) for GELU: a stage may begin with an in-place op)."""

    def __init__(self, feature, n_pieces, w=8):
        super().__init__()
        n_linear = max(3, (n_pieces + 2) // 2)
        layers = []
        for i in range(n_linear):
            if i:
                layers.append(nn.ReLU(inplace=True) if feature == "inplace" else nn.GELU())
            layers.append(HalfInPlace(w) if feature == "inplace" and i % 2 else nn.Linear(w, w))
        if feature == "buffer":
            layers.insert(1, Shift(w))
        if feature == "frozen":
            layers[2].requires_grad_(False)
        if feature == "tied":
            layers[4].weight = layers[0].weight
        if feature == "reused":
            layers[4] = layers[0]
        self.net = nn.Sequential(*layers)

    def forward(self, x):
        return self.net(x)


def make_pipe_net(feature, n_pieces):
    return seeded(0, lambda: PipeNet(feature, n_pieces)).double()


# ---- what a cell expects --------------------------------------------------------------------

def expected_refusal(strategy, feature, ws):
    """The sentence (a regex) a cell must be refused with, or None when it must equal one
    process."""
    if strategy in ("tp", "tp_sp") and feature in ("uneven", "empty"):
        heads = block_shape(feature, ws)[0]
        if heads % ws:
            return rf"does not split evenly across {ws} tensor-parallel ranks"
    if strategy == "pipeline" and feature == "empty":
        return r"cannot cut a batch of \d+ samples into \d+ micro-batches"
    if strategy == "4d" and feature == "uneven" and LAYOUT_4D[ws][2] > 1:
        return rf"does not split into {2 * LAYOUT_4D[ws][2]} equal chunks"
    return None
