"""Chapter 07 and its workbook: the numbers their prose quotes, recomputed (no launch). The
workbook's checkers go through the battery in tests/test_checks_ch07_08.py."""
import math

import torch

from distlab.checks import ch07


def _chapter_cells():
    """The cells of chapter 07 and of its second sitting, 07b, in reading order."""
    import pathlib

    import nbformat
    root = pathlib.Path(__file__).resolve().parent.parent / "notebooks"
    return [c for name in ("07_tensor_parallel", "07b_tensor_parallel_in_practice")
            for c in nbformat.read(root / f"{name}.ipynb", as_version=4).cells]


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
    cells = _chapter_cells()
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
    assert max(abs(m / p - 1) for m, p in zip(model, (138, 142, 135))) < 0.09
    assert "within 9 %" in prose
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
    cells = _chapter_cells()
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


def test_chapter_07_megatron_gqa_and_the_one_line_threshold_are_computed():
    """Megatron-LM's whole-QKV gather priced beside ours (cells after the GQA proof), and the
    one-line comm/compute formula beside the calibrated model's ratios (no launch)."""
    import pathlib

    import nbformat

    from distlab import tensor_parallel as tpm
    from distlab.emulate import PRESETS
    cells = _chapter_cells()
    prose = " ".join("\n".join(c.source for c in cells if c.cell_type == "markdown").split())
    outputs = "\n".join(o.get("text", "") for c in cells if c.cell_type == "code"
                        for o in c.get("outputs", []))
    ours, megatron, base = tpm.gqa_copy_traffic(8192, 64, 8, 16, tokens=1).values()
    assert f"Llama-3 70B, tp=16: ours {ours:>6,.0f} B, Megatron-LM {megatron:>6,.0f} B " \
           f"({megatron / ours:.0f}× ours)" in outputs
    assert round(megatron / ours) == 5 and "Megatron-LM's gather is 5 times ours" in prose
    assert f"it adds {megatron / base:.0%} to the bytes".replace("%", " %") in prose
    assert f"ours {100 * ours / base:g} %" in prose
    assert "all-gathers the **whole** QKV output" in prose and "Megatron's way" not in prose
    assert "(5× the bytes for Llama-3 70B at tp = 16)" in prose
    # the one-line formula against the calibrated model: below each ratio, within an eighth
    d, ffn = 4096, 11008
    for tp, preset in [(2, "h100-node"), (4, "h100-node"), (8, "h100-node"), (16, "h100-2x8")]:
        t = tpm.tp_block_seconds(PRESETS[preset], tp, 4096)
        W = PRESETS[preset].link_between(range(tp)).busbw("all_reduce")
        C = 6 * 4096 * (4 * d * d + 3 * d * ffn) / tp / t["compute"]
        one_line = 2 * (tp - 1) / (9 * d) * C / W * 12 * d * d / (4 * d * d + 3 * d * ffn)
        ratio = t["comm"] / t["compute"]
        assert 0.85 * ratio < one_line < ratio, tp
        assert 1000 < C / W < 1500                         # "over a thousand" FLOPs per byte
    assert "comes within 15 % of every ratio, always below it" in prose
    # the vocabulary loss's recipe is the workbook's exercise: not on the chapter's page
    assert "ReduceOp.MAX" not in prose and "softmax − one-hot" not in prose
