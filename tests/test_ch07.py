"""Workbook 07's checkers: right answers pass however they are written; wrong structure, wrong
numbers, cheats and the course's own code are refused with a sentence that names the cause."""
import math

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed import ReduceOp, all_reduce

from distlab import tp_comm
from distlab.checks import CheckFailed, ch07


# ---- exercise 1: the sequence-parallel pair ------------------------------------------------------

def _gather_seq(x, group):                    # list-based, along dim 1: another way to write it
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, x.contiguous(), group=group)
    return torch.cat(parts, dim=1)


def _scatter_seq(x, group):
    n = dist.get_world_size(group)
    out = torch.empty_like(x.chunk(n, dim=1)[0], memory_format=torch.contiguous_format)
    dist.reduce_scatter(out, [c.contiguous() for c in x.chunk(n, dim=1)], group=group)
    return out


class GatherListF(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _gather_seq(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _scatter_seq(grad, ctx.group), None


class ScatterListF(torch.autograd.Function):
    @staticmethod
    def forward(ctx, partial, group):
        ctx.group = group
        return _scatter_seq(partial, group)

    @staticmethod
    def backward(ctx, grad):
        return _gather_seq(grad, ctx.group), None


class GatherAllReduceBackF(GatherListF):      # right numbers, twice the bytes in backward
    @staticmethod
    def backward(ctx, grad):
        total = grad.contiguous().clone()
        dist.all_reduce(total, group=ctx.group)
        n, r = dist.get_world_size(ctx.group), dist.get_rank(ctx.group)
        return total.chunk(n, dim=1)[r], None


class GatherSplitBackF(GatherListF):          # the all-gather/split pair: the sum is missing
    @staticmethod
    def backward(ctx, grad):
        n, r = dist.get_world_size(ctx.group), dist.get_rank(ctx.group)
        return grad.chunk(n, dim=1)[r].contiguous(), None


class GatherCourseF(GatherListF):             # a cheat: the course's helper
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return tp_comm._all_gather(x, 1, group, "forward")


def test_sp_pair_accepts_a_differently_written_pair():
    ch07.check_sequence_parallel_pair(GatherListF, ScatterListF, world_sizes=(3,))


def test_sp_pair_refuses_an_all_reduce_where_a_reduce_scatter_belongs():
    with pytest.raises(CheckFailed, match=r"GatherAllReduceBackF with 2 ranks, in step 1's "
                                          r"backward: rank 0 made all_reduce of 192 B .*exactly "
                                          r"one reduce_scatter.*twice the bytes"):
        ch07.check_sequence_parallel_pair(GatherAllReduceBackF, ScatterListF, world_sizes=(2,))


def test_sp_pair_names_the_missing_sum():
    with pytest.raises(CheckFailed, match=r"in front of a column-parallel layer with 2 ranks, "
                                          r"rank 0, step 1, gradient of this rank's tokens.*only "
                                          r"this rank's own term"):
        ch07.check_sequence_parallel_pair(GatherSplitBackF, ScatterListF, world_sizes=(2,))


def test_sp_pair_refuses_the_course_code_stubs_and_bad_arguments():
    with pytest.raises(CheckFailed, match=r"course's own _all_gather"):
        ch07.check_sequence_parallel_pair(GatherCourseF, ScatterListF, world_sizes=(2,))

    class Stub(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, group):
            raise NotImplementedError

        @staticmethod
        def backward(ctx, grad):
            raise NotImplementedError

    with pytest.raises(NotImplementedError, match=r"Stub.forward is not written yet"):
        ch07.check_sequence_parallel_pair(GatherListF, Stub, world_sizes=(2,))
    with pytest.raises(TypeError, match="autograd.Function class itself"):
        ch07.check_sequence_parallel_pair(GatherListF.apply, ScatterListF)


# ---- exercise 2: vocab-parallel cross-entropy ----------------------------------------------------

class SumFwd(torch.autograd.Function):       # a g of one's own: sum forward, identity backward
    @staticmethod
    def forward(ctx, x, group):
        out = x.clone()
        all_reduce(out, op=ReduceOp.SUM, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def ce_gathered_stats(logits_shard, target, vocab_start, group):
    """Differently written: every rank's (max, sum of exps, target logit) all-gathered (3 numbers
    per token per rank), combined with rescaling; autograd differentiates the local terms."""
    n, me = dist.get_world_size(group), dist.get_rank(group)
    m = logits_shard.detach().max(dim=1).values
    s = (logits_shard - m[:, None]).exp().sum(dim=1)
    local = target - vocab_start
    here = (local >= 0) & (local < logits_shard.shape[1])
    z_t = torch.where(here, logits_shard.gather(1, local.clamp(0, logits_shard.shape[1] - 1)
                                                [:, None])[:, 0], torch.zeros_like(m))
    stats = torch.stack([m, s.detach(), z_t.detach()])
    every = [torch.empty_like(stats) for _ in range(n)]
    dist.all_gather(every, stats, group=group)
    M = torch.stack([e[0] for e in every]).max(dim=0).values
    total = sum((s if r == me else e[1]) * (e[0] - M).exp() for r, e in enumerate(every))
    target_logit = sum(z_t if r == me else e[2] for r, e in enumerate(every))
    return total.log() + M - target_logit


def ce_with_own_g(logits_shard, target, vocab_start, group):
    """Differently written: the three all-reduces, the sums through a g of one's own."""
    m = logits_shard.detach().max(dim=1).values
    dist.all_reduce(m, op=ReduceOp.MAX, group=group)
    z = logits_shard - m[:, None]
    local = target - vocab_start
    here = ((local >= 0) & (local < z.shape[1])).double()
    picked = (z * F.one_hot(local.clamp(0, z.shape[1] - 1), z.shape[1]) * here[:, None]).sum(1)
    return SumFwd.apply(z.exp().sum(1), group).log() - SumFwd.apply(picked, group)


def ce_gather_logits(logits_shard, target, vocab_start, group):
    """The cheat: every shard gathered (padded to one size), then dense F.cross_entropy."""
    n, me = dist.get_world_size(group), dist.get_rank(group)
    size = torch.tensor([logits_shard.shape[1]])
    sizes = [torch.zeros_like(size) for _ in range(n)]
    dist.all_gather(sizes, size, group=group)
    width = int(max(sizes))
    padded = F.pad(logits_shard.detach(), (0, width - logits_shard.shape[1]))
    parts = [torch.empty_like(padded) for _ in range(n)]
    dist.all_gather(parts, padded, group=group)
    parts[me] = F.pad(logits_shard, (0, width - logits_shard.shape[1]))
    full = torch.cat([p[:, :int(k)] for p, k in zip(parts, sizes)], dim=1)
    return F.cross_entropy(full, target, reduction="none")


def ce_no_max(logits_shard, target, vocab_start, group):
    local = target - vocab_start
    here = ((local >= 0) & (local < logits_shard.shape[1])).double()
    picked = (logits_shard * F.one_hot(local.clamp(0, logits_shard.shape[1] - 1),
                                       logits_shard.shape[1]) * here[:, None]).sum(1)
    return (SumFwd.apply(logits_shard.exp().sum(1), group).log()
            - SumFwd.apply(picked, group))


def ce_torch_all_reduce(logits_shard, target, vocab_start, group):
    """torch's differentiable all_reduce for the sums: its backward all-reduces the gradient."""
    import torch.distributed.nn.functional as dnf
    m = logits_shard.detach().max(dim=1).values
    dist.all_reduce(m, op=ReduceOp.MAX, group=group)
    z = logits_shard - m[:, None]
    local = target - vocab_start
    here = ((local >= 0) & (local < z.shape[1])).double()
    picked = (z * F.one_hot(local.clamp(0, z.shape[1] - 1), z.shape[1]) * here[:, None]).sum(1)
    world = group or dist.group.WORLD
    return dnf.all_reduce(z.exp().sum(1), group=world).log() - dnf.all_reduce(picked, group=world)


def test_vocab_ce_accepts_differently_written_answers():
    ch07.check_vocab_parallel_cross_entropy(ce_gathered_stats, world_sizes=(3,))
    ch07.check_vocab_parallel_cross_entropy(ce_with_own_g, world_sizes=(2,))


def test_vocab_ce_refuses_gathering_the_logits():
    with pytest.raises(CheckFailed, match=r"in forward, rank 0 made all_gather of 24 B, "
                                          r"all_gather of 840 B .*vocabulary shard's worth.*no "
                                          r"rank ever holds the \(tokens × vocabulary\) logits"):
        ch07.check_vocab_parallel_cross_entropy(ce_gather_logits, world_sizes=(3,))


def ce_course_module(logits_shard, target, vocab_start, group):
    """The cheat: chapter 07's own vocab-parallel loss (distlab.vocab_parallel) called."""
    from distlab import vocab_parallel
    width = torch.tensor([logits_shard.shape[1]])
    dist.all_reduce(width, group=group)
    return vocab_parallel.vocab_parallel_cross_entropy(logits_shard, target, int(width), group)


def test_vocab_ce_refuses_the_chapters_module():
    with pytest.raises(CheckFailed, match=r"course's own"):
        ch07.check_vocab_parallel_cross_entropy(ce_course_module, world_sizes=(2,))


def test_vocab_ce_names_the_missing_max_and_refuses_stubs():
    with pytest.raises(CheckFailed, match=r"logits near 1000\), rank 0, per-token loss.*"
                                          r"overflows.*op=MAX"):
        ch07.check_vocab_parallel_cross_entropy(ce_no_max, world_sizes=(2,))

    with pytest.raises(CheckFailed, match=r"logit-shard gradient.*the gradient is 2× the right "
                                          r"one: every rank computed the same loss"):
        ch07.check_vocab_parallel_cross_entropy(ce_torch_all_reduce, world_sizes=(2,))

    def vocab_parallel_cross_entropy(logits_shard, target, vocab_start, group):
        raise NotImplementedError

    with pytest.raises(NotImplementedError, match="vocab_parallel_cross_entropy is not written"):
        ch07.check_vocab_parallel_cross_entropy(vocab_parallel_cross_entropy, world_sizes=(2,))
    with pytest.raises(TypeError, match="should take 4 arguments"):
        ch07.check_vocab_parallel_cross_entropy(lambda z, t: z)


# ---- exercise 3: predict, then run ---------------------------------------------------------------

def estimate_per_collective(hidden, tokens, tp, dtype, sequence_parallel, link):
    """Differently written: one collective at a time, dtype.itemsize, the ring as N-1 steps."""
    S = hidden * tokens * dtype.itemsize
    if sequence_parallel:
        layer = ["all_gather", "reduce_scatter"] * 4
    else:
        layer = ["all_reduce"] * 4
    total = 0.0
    for op in layer:
        steps = (tp - 1) * (2 if op == "all_reduce" else 1)
        total += link.latency[op] + steps * (S / tp) / link.busbw[op]
    return total


def _variant(**wrong):
    """The right formula with one term wrong."""
    def estimate(hidden, tokens, tp, dtype, sequence_parallel, link):
        size = wrong.get("bytes", torch.empty((), dtype=dtype).element_size())
        S = tokens * hidden * size
        ops = ["all_gather", "reduce_scatter"] if sequence_parallel else ["all_reduce"]
        t = 0.0
        for op in ops:
            factor = (1 if wrong.get("no_ring") else
                      (tp - 1) / tp * (1 if sequence_parallel else 2))
            bw = link.busbw["all_reduce" if wrong.get("ar_busbw") else op]
            lat = 0.0 if wrong.get("no_latency") else link.latency[op]
            t += wrong.get("count", 4) * (lat + factor * S / bw)
        return t
    return estimate


@pytest.mark.parametrize("wrong, phrase", [
    (dict(no_latency=True), r"tp=8, bfloat16, sequence_parallel=False\) on h100-node: your "
                            r"estimate misses the latency: .*15 µs here"),
    (dict(count=2), r"counts 2 collectives' latencies where a layer makes 4"),
    (dict(no_ring=True), r"bandwidth term misses the ring's factor: an all-reduce moves "
                         r"2\(N-1\)/N·S per rank .* = 1.75·S at N = 8"),
    (dict(bytes=4), r"bandwidth term does not change with the dtype: S = tokens × hidden × bytes "
                    r"per element \(bfloat16 2 B, float32 4 B\)"),
    (dict(ar_busbw=True), r"sequence_parallel=True\) on h100-node: your estimate's bandwidth "
                          r"term divides by another collective's bus bandwidth"),
])
def test_estimate_names_the_term_that_is_off(wrong, phrase):
    with pytest.raises(CheckFailed, match=phrase):
        ch07.check_tp_comm_estimate(_variant(**wrong))


def test_estimate_refuses_the_course_link_model_and_stubs():
    from distlab import hardware

    def estimate_cheat(hidden, tokens, tp, dtype, sequence_parallel, link):
        preset = link.name.split(":")[0]
        model = hardware.PRESETS[preset].link_between(range(tp))
        S = tokens * hidden * dtype.itemsize
        ops = ["all_gather", "reduce_scatter"] if sequence_parallel else ["all_reduce"]
        return sum(4 * model.seconds(op, S, tp) for op in ops)

    with pytest.raises(CheckFailed, match=r"course's own Link.seconds"):
        ch07.check_tp_comm_estimate(estimate_cheat)

    def layer_comm_seconds(hidden, tokens, tp, dtype, sequence_parallel, link):
        raise NotImplementedError

    with pytest.raises(NotImplementedError, match="layer_comm_seconds is not written yet"):
        ch07.check_tp_comm_estimate(layer_comm_seconds)


def test_estimate_accepts_a_differently_written_formula_and_runs_the_layer(capsys):
    ch07.check_tp_comm_estimate(estimate_per_collective)
    out = capsys.readouterr().out
    # the emulated layer beside the closed form: the same number, because the same formulas
    runs = ch07._emulated_layers()
    assert len(runs) == 4 and all(math.isclose(
        seconds, ch07._reference_layer_seconds(4096, 4096, 4, torch.bfloat16, sp, cluster),
        rel_tol=1e-6) for (_, sp), (seconds, _, cluster) in runs.items())
    assert "h100 2 nodes × 2, TP + SP" in out and "(8 collectives)" in out
    # what workbook 07 says of the printout: SP's communication is longer inside the H100 node
    # (NVLink SHARP for all_reduce only, twice the latencies) and nearly ties across two nodes
    t = {key: seconds for key, (seconds, _, _) in runs.items()}
    assert t["h100-node", True] > 1.1 * t["h100-node", False]
    assert abs(t["h100 2 nodes × 2", True] / t["h100 2 nodes × 2", False] - 1) < 0.03


def test_workbook_07_prose_numbers_are_computed():
    import pathlib

    import nbformat
    path = pathlib.Path(__file__).resolve().parent.parent / "solutions" / "07_tensor_parallel.ipynb"
    prose = " ".join("\n".join(c.source for c in nbformat.read(path, as_version=4).cells
                               if c.cell_type == "markdown").split())
    logits = 128 * 1024 * 8 * 1024 * torch.finfo(torch.float32).bits // 8     # vocab × tokens
    assert f"{logits / 2**30:.0f} GiB of float32 logits" in prose
    assert f"overflows above {math.floor(math.log(torch.finfo(torch.float64).max))})" in prose
    assert ch07.VOCAB_CASES[2][1][2] == ch07.VOCAB_CASES[3][0][2] == 1000.0
    assert "logits near 1000" in prose


# ---- the real-size lesson: TP's communication against its compute -----------------------------

def test_chapter_07_prose_numbers_are_computed():
    import pathlib
    import re

    import nbformat

    from distlab import hardware
    from distlab import tensor_parallel as tpm
    from distlab.emulate import PRESETS
    path = pathlib.Path(__file__).resolve().parent.parent / "notebooks" / "07_tensor_parallel.ipynb"
    cells = nbformat.read(path, as_version=4).cells
    prose = " ".join("\n".join(c.source for c in cells if c.cell_type == "markdown").split())
    outputs = "\n".join(o.get("text", "") for c in cells if c.cell_type == "code"
                        for o in c.get("outputs", []))
    wide = dict(hidden=8192, heads=64, ffn=28672)
    ratio, ratio_wide = {}, {}
    for tp, preset in [(2, "h100-node"), (4, "h100-node"), (8, "h100-node"), (16, "h100-2x8")]:
        t = tpm.tp_block_seconds(PRESETS[preset], tp, 4096)
        w = tpm.tp_block_seconds(PRESETS[preset], tp, 4096, **wide)
        ratio[tp], ratio_wide[tp] = t["comm"] / t["compute"], w["comm"] / w["compute"]
        assert ratio_wide[tp] < ratio[tp]
    pct = {tp: f"{r:.0%}".replace("%", " %") for tp, r in ratio.items()}
    assert (f"{pct[2]} of the block's matmul and attention time at tp = 2, {pct[4]} at tp = 4 "
            f"and {pct[8]} at tp = 8; across two nodes, at tp = 16, {pct[16]}") in prose
    assert ratio[16] > 1 > ratio[8] and "more than the compute" in prose
    assert (f"{ratio_wide[8]:.0%} at tp = 8, still {ratio_wide[16]:.0%} at tp = 16"
            .replace("%", " %")) in prose
    assert f"{ratio[8]:.0%} of its compute at tp = 8 in a node, {ratio[16]:.0%} at".replace(
        "%", " %") in prose
    node = PRESETS["h100-node"].link_between(range(8)).busbw("all_reduce") / 1e9
    two = PRESETS["h100-2x8"].link_between(range(16)).busbw("all_reduce") / 1e9
    assert f"({node:.0f} → {two:.0f} GB/s" in prose
    comm8 = tpm.tp_block_seconds(PRESETS["h100-node"], 8, 4096)["comm"]
    comm16 = tpm.tp_block_seconds(PRESETS["h100-2x8"], 16, 4096)["comm"]
    assert f"{comm8 * 1e3:.2f} ms (tp = 8) and {comm16 * 1e3:.2f} ms (tp = 16)" in prose
    # the emulated numbers the prose quotes are the stored outputs (nbval re-runs the cell)
    runs = re.findall(r"tp=\s?(\d+) \([\w-]+\): emulated step (\d+\.\d\d) ms, of which all-reduces "
                      r"(\d+\.\d\d) ms", outputs)
    (_, s8, c8), (_, s16, c16) = runs
    assert (c8, c16) == (f"{comm8 * 1e3:.2f}", f"{comm16 * 1e3:.2f}")
    assert f"longer — {s8} ms at tp = 8" in prose and f"from {s8} to {s16} ms" in prose
    gain = f"{1 - float(s16) / float(s8):.0%}".replace("%", " %")      # how much shorter
    assert f"twice the GPUs for {gain}" in prose
    # Megatron-LM beside the closed form
    shares, model = [], []
    for layers, hidden, heads, gpus, tp in ((30, 3072, 32, 64, 2), (36, 4096, 32, 128, 4),
                                            (40, 6144, 48, 256, 8)):
        gpt = hardware.Transformer(layers, hidden, heads, 4 * hidden, 51200)
        batch, seq = (1024 if gpus == 256 else 512), 2048
        parts = hardware.step_seconds(gpt, PRESETS["a100-cluster"], gpus, batch, seq, tp=tp,
                                      recompute="full", flash=False)
        flops = 96 * batch * seq * layers * hidden**2 * (1 + seq / (6 * hidden)
                                                          + 51200 / (16 * layers * hidden))
        model.append(round(flops / parts["step"] / gpus / 1e12))
        shares.append(f"{parts['tp'] / parts['step']:.0%}".replace("%", " %"))
    assert (f"({model[0]} against 138, {model[1]} against 142, {model[2]} against 135 TFLOP/s "
            f"per GPU)") in prose
    assert max(abs(m / p - 1) for m, p in zip(model, (138, 142, 135))) < 0.08
    assert "within 8 %" in prose
    assert f"{shares[0]} at tp = 2, {shares[1]} at tp = 4, {shares[2]} at tp = 8" in prose


def test_chapter_07_vocab_gqa_rng_and_korthikanti_prose_is_computed():
    """The numbers the new sections of chapter 07 quote, recomputed (no launch)."""
    import inspect
    import pathlib
    import re

    import nbformat

    from distlab import memory
    from distlab import tensor_parallel as tpm
    from distlab import vocab_parallel as vp
    path = pathlib.Path(__file__).resolve().parent.parent / "notebooks" / "07_tensor_parallel.ipynb"
    cells = nbformat.read(path, as_version=4).cells
    prose = " ".join("\n".join(c.source for c in cells if c.cell_type == "markdown").split())
    outputs = "\n".join(o.get("text", "") for c in cells if c.cell_type == "code"
                        for o in c.get("outputs", []))
    # GQA: Llama-3's 8 K/V heads; 70B at tp = 16 holds each twice; MQA replicates from tp = 2
    assert "Llama-3 has 8 K/V heads" in prose
    copies = {2: "twice"}[tpm.kv_head_split(64, 8, 16)["copies"]]
    assert f"Llama-3 70B at tp = 16 keeps, on every rank, {copies} the K/V" in prose
    assert tpm.kv_head_split(8, 1, 2)["copies"] > 1 and tpm.kv_head_split(8, 1, 1)["copies"] == 1
    assert "Gemma 2B) replicates K and V on every rank from tp = 2" in prose
    assert "4/1 (×2)" in outputs and "refused" in outputs
    # the GQA layer's run: equal to dense at tp = 2 and 4 on every rank; the K/V gather's bytes
    # (2·b·t·n_kv_heads·d_head float64 = 2·2·8·2·4·8) beside the all-reduced activation (2·8·32·8)
    for tp in (2, 4):
        for rank in range(tp):
            assert re.search(rf"\[rank {rank}\] tp={tp}: .*every grad\): True", outputs), (tp, rank)
    assert f"forward all_gather {2 * 2 * 8 * 2 * 4 * 8:,} B, forward all_reduce {2 * 8 * 32 * 8:,} B" \
        in outputs
    assert "K and V forward and its reduce-scatter backward" in prose and "(2,048 B here," in prose
    assert f"{2 * 8 * 128:,} values per token against the 8,192" in prose   # Llama-3 70B
    assert "so tp = 8 is the largest degree at which they split without copies" in prose
    # the RNG tracker's offset, as the prose and Megatron-LM have it
    assert "seed + 2718 + tp_rank" in prose and "2718" in inspect.getsource(tpm.model_parallel_seed)
    # the vocabulary: the tiny GPT's 64 entries over 3 ranks, padded; Megatron's 128·tp
    assert f"vocabulary of 64 (padded to {vp.padded_vocab_size(64, 3)})" in prose
    assert f"logits shard (2, 6, {vp.padded_vocab_size(64, 3) // 3})" in outputs
    assert f"largest message {2 * 6 * 8 * 8} B" in outputs and "hidden state (2·6·8 float64)" in prose
    assert vp.padded_vocab_size(128256, 8, multiple_of=128) % (128 * 8) == 0
    assert "multiple of 128·tp" in prose
    # Korthikanti beside the measurement: within 2 %, and the formulas' coefficients
    measured = {label.strip(): float(kib) * 1024 for label, kib in re.findall(
        r"^\s*([\w +()]+): +(\d+\.\d) KiB saved for backward per rank", outputs, re.M)}
    assert len(measured) == 3
    s, b, h, a, t = 64, 8, 32, 4, 4
    gathered = 2 * 4 * s * b * h * (1 - 1 / t)
    for label, kw in {"dense (1 rank)": dict(tp=1), "TP": dict(tp=t),
                      "TP + SP": dict(tp=t, sequence_parallel=True)}.items():
        count = sum(memory.activation_breakdown(s, b, h, a, bytes_per_value=4, dropout=False,
                                                **kw).values())
        count += gathered if "SP" in label else 0
        assert abs(measured[label] / count - 1) < 0.02, label
        paper = memory.activation_breakdown(s, b, h, a, attention="materialized", **kw)
        rest = (sum(paper.values()) - paper["s×s attention scores"]) / (s * b * h)
        assert rest == {1: 34, 4: 34 / 4 if "SP" in label else 10 + 24 / 4}[kw["tp"]]
    assert "lands within 2 % of each measurement" in prose
    # the logits at Llama-3's size
    size = vp.logits_bytes(8192, 128256, tp=8)
    assert f"{size['full logits'] / 2**30:.2f} GiB" in outputs
