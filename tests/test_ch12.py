"""Chapter 12's numbers, as the planner prices them (workbook 12's checkers are proven in
tests/test_checks_ch09_12.py)."""
import json
from pathlib import Path

import pytest

from distlab import context_parallel as cp


# ---- chapter 12's long-context comparison, as the planner prices it (stale prose fails) ----------

NOTEBOOKS = [Path(__file__).resolve().parent.parent / "notebooks" / name
             for name in ("12_context_parallelism.ipynb", "12b_cp_at_scale.ipynb")]


def _says(text):
    cells = [c for path in NOTEBOOKS for c in json.loads(path.read_text())["cells"]]
    prose = " ".join(" ".join("".join(c["source"]) for c in cells
                              if c["cell_type"] == "markdown").split())
    assert text in prose, f"chapter 12's prose no longer says {text!r}: recompute and fix it"


def test_context_parallel_against_recompute_and_tp_as_the_chapter_quotes():
    """Section 7's ways to fit 262,144 tokens of Llama-2 7B, priced by layout.price (the planner
    of chapter 10, the one source of these numbers), as the notebook's cell calls it."""
    from distlab import hardware, layout
    model = layout.SHAPES["Llama-2 7B"]
    ways = [dict(dp=4, cp=1, tp=8, checkpointing="none"),
            dict(dp=4, cp=1, tp=8, checkpointing="selective"),
            dict(dp=4, cp=1, tp=8, checkpointing="full", sequence_parallel=False),
            dict(dp=4, cp=1, tp=8, checkpointing="full"),
            dict(dp=2, cp=2, tp=8, checkpointing="none"),
            dict(dp=2, cp=2, tp=8, checkpointing="full"),
            dict(dp=1, cp=4, tp=8, checkpointing="none"),
            dict(dp=1, cp=8, tp=4, checkpointing="none")]
    rows = [layout.price(model, pp=1, global_batch=4, seq_len=262_144, cluster="h100-cluster",
                         **w) for w in ways]
    none, selective, no_sp, full, cp2, cp2_full, cp4, cp8 = rows
    assert [r["fits"] for r in rows] == [False, False, False, True, False, True, True, True]
    for r in rows:       # the peak's parts add up to the peak the planner reports
        assert sum(r["peak_parts"].values()) == pytest.approx(r["gb"], rel=1e-12)
    assert selective["gb"] == none["gb"] and selective["step_s"] == none["step_s"]
    _says(f"TP+SP alone keeps {none['gb']:.0f} GB per GPU")
    device = hardware.PRESETS["h100-cluster"].device
    by_layer = {r: layout.layer_seconds(model, device, 262_144, 1, 8, recompute=r)
                for r in ("none", "full")}
    attention_share = ((by_layer["full"]["attention"] - by_layer["none"]["attention"])
                       / by_layer["full"]["recompute"])
    _says(f"each layer's whole input: {no_sp['gb']:.0f} GB) — {full['gb']:.1f} GB per GPU, but "
          f"every step runs the forward again: {full['step_s']:.1f} s, of which "
          f"{full['recompute_s']:.1f} s recompute ({attention_share * 100:.0f} % of it attention")
    block = 262_144 // 4
    _says(f"cp = 4 without recompute fits at {cp4['gb']:.1f} GB and takes {cp4['step_s']:.1f} s, "
          f"{full['step_s'] / cp4['step_s']:.2f} times faster: the ring's {block:,}-token blocks "
          f"hide their hops behind the attention (cp comm {cp4['cp_s']:.2f} s)")
    assert cp4["cp_s"] == 0.0 and cp2["gb"] > 80
    _says(f"cp = 2 misses 80 GB by {cp2['gb'] - 80:.1f} GB without recompute")
    assert cp2_full["step_s"] > cp4["step_s"]
    assert cp8["step_s"] < cp4["step_s"] and cp8["tp_s"] < cp4["tp_s"]
    _says(f"cp = 8 at tp = 4 is faster still ({cp8['step_s']:.1f} s at {cp8['gb']:.1f} GB): "
          f"halving *tp* cuts tensor parallelism's communication from {cp4['tp_s']:.2f} s to "
          f"{cp8['tp_s']:.2f} s")
    # attention FLOPs at this length: causal 2·s·h per token and layer forward, against 2·N
    per_token = layout.attention_flops(model, 262_144, 1) / 262_144 * model.layers
    ratio = per_token / (2 * model.params())
    assert round(ratio) == 5
    _says("attention at 262k tokens is about five times the dense FLOPs")


def test_the_ulysses_and_grouped_query_numbers_the_chapter_quotes():
    """Section 5's bytes: Q against K + V per token (why a ring rotates K/V), and what ring,
    all-gather and Ulysses send per rank per layer at 131,072 tokens (ulysses'
    communication_per_layer, which test_context_parallel checks against a traced run)."""
    from distlab import ulysses
    q_bytes, kv_bytes = 128 * 128 * 2, 2 * 8 * 128 * 2            # Llama 3 405B, bf16
    _says(f"rotating queries and outputs would move {2 * q_bytes // kv_bytes} times the bytes of "
          f"rotating K and V")
    assert 2 * (32 * 128 * 2) == 2 * 32 * 128 * 2                    # Llama-2 7B: the same

    def sent(way, heads, kv_heads, n):
        return sum(ulysses.communication_per_layer(way, 131_072, n, heads, kv_heads)) / 2 ** 20
    mha = [sent(w, 32, 32, 8) for w in ("ulysses", "ring", "all-gather")]
    _says("at *cp* = 8, Llama-2 7B's Ulysses sends {:,.0f} MiB per rank against the ring's {:,.0f} "
          "and all-gather's {:,.0f}".format(*mha))
    gqa = [sent(w, 128, 8, 8) for w in ("ulysses", "ring", "all-gather")]
    _says("at *cp* = 8 sends {:,.0f} MiB against the ring's {:,.0f} and all-gather's {:,.0f}; past 8 "
          "key/value heads it is refused".format(*gqa))
    with pytest.raises(ValueError, match="8 key/value heads do not split over cp = 16"):
        ulysses.check_heads(128, 8, 16)
    # the ring's bytes per rank hardly fall with cp, Ulysses' shrink as 1/cp
    assert sent("ring", 32, 32, 16) > sent("ring", 32, 32, 2)
    assert sent("ulysses", 32, 32, 16) == pytest.approx(sent("ulysses", 32, 32, 2) * (15 / 16) / (1 / 2) / 8)


def test_the_striped_balance_the_chapter_quotes():
    """Section 4's striped layout: busiest rank / mean over a ring's steps, 4 ranks."""
    ratios = []
    for c in (4, 4_096):
        held = [cp.striped_positions(4 * c, r, 4) for r in range(4)]
        work = [sum(cp.plan_work(cp.block_plan(held[r], held[(r - s) % 4], causal=True))
                    for s in range(4)) for r in range(4)]
        ratios.append(max(work) * 4 / sum(work))
    _says("at 4 tokens per rank the busiest rank does {:.4f} times the mean, at 4,096 tokens per "
          "rank {:.4f} times".format(*ratios))
