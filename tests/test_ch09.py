"""Chapter 09's numbers: every figure its prose quotes, recomputed (workbook 09's checkers are
proven in tests/test_checks_ch09_12.py)."""
import pytest
import torch

from distlab import expert_parallel as ep_lib
from distlab import moe as moe_lib


# ---- chapter 09 at real size: every number its prose quotes, recomputed ---------------------------

CHAPTERS = ("09_expert_parallel.ipynb", "09b_moe_at_scale.ipynb")      # 09b: sections 6-7 of old


def _cells():
    import pathlib
    import nbformat
    notebooks = pathlib.Path(__file__).resolve().parent.parent / "notebooks"
    return [c for name in CHAPTERS for c in nbformat.read(notebooks / name, as_version=4).cells]


def _chapter_text():
    return " ".join(" ".join(c.source for c in _cells() if c.cell_type == "markdown").split())


def test_skewed_rows_keeps_the_assignments_and_refuses_impossible_shares():
    rows = ep_lib.skewed_rows(8192, 2, 8, 4.0)
    assert sum(rows) == 16384 and rows[0] == 4 * 16384 // 8 and max(rows[1:]) - min(rows[1:]) <= 1
    assert ep_lib.skewed_rows(8192, 2, 8, 1.0) == [2048] * 8
    with pytest.raises(ValueError, match="between 1 .balanced. and 8"):
        ep_lib.skewed_rows(8192, 2, 8, 9.0)


def test_real_size_imbalance_and_all_to_all_numbers_the_prose_quotes():
    """The Mixtral-8x7B layer at full size on meta tensors (balanced and 4x), and the all-to-all
    table beside DeepEP's published bandwidths: each claim of the chapter's sections 4 and 5."""
    import distlab
    from distlab.emulate import PRESETS
    text = _chapter_text()
    cfg = ep_lib.MIXTRAL_8X7B
    def both(rank, world_size):
        return [ep_lib.imbalanced_layer_step(rank, world_size, f) for f in (1.0, 4.0)]
    ranks = distlab.run(both, 8, emulate="h100-node", timeout=120)
    runs = {f: [r[i] for r in ranks] for i, f in enumerate((1.0, 4.0))}
    step = {f: max(r[1] for r in runs[f]) for f in runs}
    balanced_rows, balanced_expert = runs[1.0][0][0], runs[1.0][0][2]
    assert balanced_rows == 8192 * 2
    assert f"takes {step[4.0] / step[1.0]:.1f} times the balanced one" in text
    # the expert phase of the busiest rank grows with busiest/mean
    busy = max(runs[4.0], key=lambda r: r[0])
    assert busy[0] == 4 * balanced_rows and 3.8 < busy[2] / balanced_expert < 4.2
    assert "the phase runs at busiest/mean times the balanced time" in text
    # "the all-to-alls, and what waits for them, are under a tenth of a balanced layer"
    assert (step[1.0] - balanced_expert) / step[1.0] < 0.1 and "under a tenth" in text
    # the model (balanced + extra rows x per-row cost) beside the emulated run
    model = step[1.0] + (busy[0] - balanced_rows) * balanced_expert / balanced_rows
    assert abs(step[4.0] / model - 1) < 0.05
    assert "share their formulas" in text and "(measured)" not in text
    # section 5: a few per cent inside a node, several times more across two nodes; the model's
    # logical bandwidth within 10 % of DeepEP's dispatch at EP 8 x 2 (90 GB/s) and 8 x 4 (61)
    cluster = PRESETS["h100-cluster"]
    send = 8192 * cfg["top_k"] * cfg["d_model"] * 2
    t = {n: ep_lib.all_to_all_seconds(send, n, cluster) for n in (8, 16, 32)}
    assert 4 * t[8] / balanced_expert < 0.1 and t[16] / t[8] > 3
    for n, published in ((16, 90), (32, 61)):
        logical = send * (n - 1) / n / t[n] / 1e9
        assert abs(logical / published - 1) < 0.10, (n, logical)
    assert "within 10 % of DeepEP's measured dispatch at EP 8 × 2 and 8 × 4" in text
    assert "they cost several times more" in text


def test_all_to_all_seconds_inside_a_node_is_the_links_own_model():
    from distlab.emulate import PRESETS
    node = PRESETS["h100-node"]
    assert ep_lib.all_to_all_seconds(1e8, 8, node) == node.intra.seconds("all_to_all", 1e8, 8)
    # across nodes the NIC carries the cross-node half at EP 16: slower than any ring's rate
    two = PRESETS["h100-2x8"]
    assert ep_lib.all_to_all_seconds(1e8, 16, two) > 1e8 * 8 / 16 / two.inter.bandwidth


# ---- chapter 09 section 6 (modern MoE): the prose's numbers, and the verdicts its cells print ----

def test_modern_moe_prose_numbers():
    text = _chapter_text()
    # "bfloat16 keeps 8 bits of mantissa, so a logit between 32 and 64 is rounded to a multiple
    # of 0.25"
    assert torch.finfo(torch.bfloat16).eps == 2 ** -7            # 7 stored + 1 implicit bit
    for value in (32.1, 47.3, 63.9):
        rounded = float(torch.tensor(value).bfloat16())
        assert abs(rounded / 0.25 - round(rounded / 0.25)) == 0 and abs(rounded - value) <= 0.125
    assert "a logit between 32 and 64 is rounded to a multiple of 0.25" in text
    # "64 tokens, 4 experts, factor 1 (C = 16)"
    assert moe_lib.expert_capacity(64, 4, 1, 1.0) == 16 and "factor 1 (C = 16)" in text
    # fine-grained keeps the width x active experts of the coarse layer
    fine = moe_lib.fine_grained(16, 64, 8, 2, m=4, n_shared=1)
    assert (fine["top_k"] + fine["n_shared"]) * fine["hidden"] == 2 * 64


def test_modern_moe_cells_print_true_verdicts():
    """Each claim of chapter 09's balancing comparison and of chapter 09b is printed by its cell
    as a verdict (recomputed by nbval on every run); none of the stored verdicts may read False."""
    outputs = " ".join(o.get("text", "") for c in _cells()
                       if c.cell_type == "code" for o in c.get("outputs", []))
    for claim in ("both methods end below a third of the unbalanced router's MaxVio: True",
                  "than one capacity for the group: True",
                  "task loss within 0.01, smaller bf16 error: True",
                  "while the whole batch stays at least as balanced: True"):
        assert claim in outputs, claim
    assert outputs.count("every rank equals one process, within 1e-12: True") == 3
    assert "False" not in outputs and "NOT within" not in outputs
