"""The backtest (bench/fidelity.py) holds the calibrated model to published measurements. The
model is deterministic: these are checks of arithmetic against a table, not of wall time."""
import importlib.util
import os

import pytest

HERE = os.path.dirname(__file__)
_spec = importlib.util.spec_from_file_location(
    "fidelity", os.path.join(HERE, "..", "bench", "fidelity.py"))
fidelity = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(fidelity)

RESULTS = fidelity.backtest()


def test_every_published_row_names_its_source_and_its_use():
    for row, *_ in RESULTS:
        assert row["source"].strip() and row["unit"].strip(), row["case"]
        assert row["use"] in ("calibration", "validation", "fit-check"), row["case"]
        assert row["kind"] in fidelity.PREDICT


def test_the_backtest_has_the_rows_issue_43_asks_for():
    rows = [r for r, *_ in RESULTS]
    hopper = [r for r in rows if any(x in r["case"] + r["config"].get("preset", "")
                                     + r["config"].get("device", "")
                                     for x in ("H100", "H200", "h100", "h200"))]
    mid = [r for r in rows if r["kind"] == "busbw"
           and 2**20 <= int(r["config"].get("bytes", "0")) <= 64 * 2**20]
    assert len(rows) >= 80 and len(hopper) >= 25 and len(mid) >= 8
    assert sum(r["kind"] == "memory" for r in rows) >= 8
    assert sum(r["kind"] == "attention" for r in rows) >= 5


def test_calibration_rows_reproduce_what_they_set():
    k, m = fidelity.summary(RESULTS)["calibration"]
    assert k == m


def test_no_calibration_row_shares_a_source_with_a_validation_row():
    # held-out discipline: a validation row comes from another source than any row that set a
    # constant (the source's first clause names the document)
    def doc(row):
        return row["source"].split(",")[0].split(" (")[0].strip()
    calibration = {doc(r) for r, *_ in RESULTS if r["use"] == "calibration"}
    shared = [r["case"] for r, *_ in RESULTS if r["use"] == "validation" and doc(r) in calibration]
    assert not shared, shared


def test_validation_rows_do_not_lose_ground():
    # A ratchet, not the goal: what the model scores on rows it never saw, at this commit
    # (issue 43 asks for 90 % of all of them). A change that loses a row fails here; one that
    # wins rows raises these numbers.
    within, total = fidelity.summary(RESULTS)["validation"]
    within_priced, priced = fidelity.priced_summary(RESULTS)["validation"]
    assert total >= 162 and priced >= 124
    assert within >= 90 and within_priced >= 90


# Memory peaks the planner misses, each with what it does not count (bench/fidelity.py's
# cause() prints it): a new miss fails, a row that comes within may leave the list
MEMORY_MISSES = {
    "torchtitan Llama 3.1 70B FSDP32 TP8 Float8 (256 H100) peak memory",
    "torchtitan Llama 3.1 70B FSDP32 TP8 AsyncTP Float8 (256 H100) peak memory",
    "torchtitan Llama 3.1 405B FSDP8 TP8 PP8 1F1B Float8 (512 H100) peak memory",
    "torchtitan Llama 3.1 8B FSDP Float8 (4x8 H200, Trainy/WhiteFiber) peak memory",
    "torchtitan Llama 3.1 8B FSDP Float8 (8x8 H200, Trainy/WhiteFiber) peak memory",
    "torchtitan Llama 3.1 405B 4D FSDP1 CP8 seq 262144 (512 H100) peak memory",
}


@pytest.mark.parametrize("kind", ["busbw", "gemm", "attention", "memory"])
def test_collectives_kernels_and_memory_validate_row_by_row(kind):
    misses = [(r["case"], round(ratio, 2)) for r, predicted, ratio, within in RESULTS
              if r["kind"] == kind and r["use"] == "validation" and predicted is not None
              and not within]
    if kind == "memory":
        assert not {case for case, _ in misses} - MEMORY_MISSES, misses
        return
    allowed = {"busbw": 1, "gemm": 1}.get(kind, 0)      # listed with their causes by main()
    assert len(misses) <= allowed, misses


def test_fp8_and_cp_rows_are_priced():
    # issue 43: FP8 GEMMs and context parallelism are in the step model, so no row is refused
    # for them any more
    reasons = {why for _, predicted, why, _ in RESULTS if predicted is None}
    assert not any("FP8" in why or "context parallel" in why for why in reasons), reasons


def test_a_row_the_model_cannot_price_says_why():
    unpriced = [(r, why) for r, predicted, why, _ in RESULTS if predicted is None]
    assert unpriced
    for row, why in unpriced:
        assert isinstance(why, str) and len(why) > 10, row["case"]


def test_the_summary_line_is_printed(capsys):
    fidelity.main()
    out = capsys.readouterr().out
    assert "fidelity (validation): " in out and " within ±20 %" in out
    assert "not priced: recompute unstated" in out
