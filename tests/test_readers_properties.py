"""The readers of real files, on real files and under Hypothesis: nccl-tests logs as people
pasted them (tests/data/nccl_tests, each with its thread in the README), tables written in each
header form nccl-tests has printed, traces written then read back, and truncated or garbled
input, which must get a sentence (ValueError), never a raw exception from deep inside."""
import json
import math
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from distlab import hardware
from distlab.nccl_tests import busbw_table, nccl_tests_cluster, read_nccl_tests

DATA = Path(__file__).parent / "data"
LOGS = DATA / "nccl_tests"
FAST = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _log(name, **kw):
    return read_nccl_tests((LOGS / name).read_text(), **kw)


# ---- nccl-tests logs from the field ---------------------------------------------------------------

ROOT, REDOP, BARE = (("size", "count", "type", "redop", "root"), ("size", "count", "type", "redop"),
                     ("size", "count", "type"))


def test_real_logs_in_every_header_form_read_right():
    # today's header, two nodes (nccl-tests 2.20.0)
    log = _log("two_nodes_gb10.txt")
    assert (log.world_size, log.nodes, log.gpu) == (2, 2, "NVIDIA GB10")
    assert [r["size"] for r in log.rows] == [8192, 16384, 32768, 65536]
    r = log.rows[3]
    assert (r["count"], r["time"], r["algbw"], r["busbw"]) == (16384, pytest.approx(67.93e-6),
                                                               pytest.approx(0.96e9),
                                                               pytest.approx(0.96e9))
    assert (r["time_in_place"], r["busbw_in_place"]) == (pytest.approx(64.71e-6),
                                                         pytest.approx(1.01e9))
    forms = [getattr(log, "form", None)]
    # an older one: redop but no root, an error column (2019, four V100s)
    log = _log("old_4xv100.txt")
    assert (log.world_size, log.nodes) == (4, 1) and "V100" in log.gpu
    assert [(r["size"], r["time"]) for r in log.rows] == [
        (8, pytest.approx(158.3e-6)), (16, pytest.approx(160.4e-6)), (32, pytest.approx(159.2e-6)),
        (64, pytest.approx(159.3e-6))]
    assert log.rows[3]["time_in_place"] == pytest.approx(278.1e-6)
    forms.append(getattr(log, "form", None))
    # older still, all_gather_perf: no redop column at all (before: algbw read as the time)
    log = _log("no_redop_all_gather_2x2080ti.txt", collective="all_gather", world_size=2)
    assert len(log.rows) == 13
    first, last = log.rows[0], log.rows[-1]
    assert (first["size"], first["count"], first["redop"]) == (32768, 4096, None)
    assert (first["time"], first["algbw"], first["busbw"]) == (
        pytest.approx(13.39e-6), pytest.approx(1.22e9), pytest.approx(1.22e9))
    assert (last["time"], last["time_in_place"], last["busbw_in_place"]) == (
        pytest.approx(3298.6e-6), pytest.approx(3070.3e-6), pytest.approx(21.86e9))
    forms.append(getattr(log, "form", None))
    assert forms == [ROOT, REDOP, BARE]             # the header form each log printed


def test_real_logs_under_mpiruns_rank_tags_read_right():
    # Open MPI --tag-output: "[1,0]<stdout>:" before every line (before: no table found)
    log = _log("tag_output_p5.txt", world_size=16)
    assert [r["size"] for r in log.rows] == [8, 16, 32]
    assert (log.rows[2]["time"], log.rows[2]["time_in_place"]) == (pytest.approx(22.25e-6),
                                                                   pytest.approx(13.34e-6))
    # "[0]" at the start and again inside the row, where two outputs met
    log = _log("mpi_rank_tags_inline.txt", world_size=16)
    assert len(log.rows) == 10 and log.rows[0]["size"] == 1048576
    assert (log.rows[6]["time"], log.rows[6]["busbw"], log.rows[6]["time_in_place"]) == (
        pytest.approx(24410e-6), pytest.approx(5.27e9), pytest.approx(24425e-6))


def test_a_one_gpu_log_gives_busbw_as_the_file_does():
    log = _log("one_gpu_rtx5090.txt")
    assert (log.world_size, log.nodes) == (1, 1) and len(log.rows) == 25
    assert all(r["busbw"] == 0 for r in log.rows)
    assert log.rows[-1]["algbw"] == pytest.approx(764.34e9)
    with pytest.raises(ValueError, match="platform"):     # a GeForce: no calibrated model
        busbw_table(log)
    table = busbw_table(log, device=hardware.H100)        # before: ZeroDivisionError
    assert "one GPU" in table.splitlines()[0]
    rows = [line.split() for line in table.splitlines()[3:]]
    assert len(rows) == 25 and all(float(r[1]) == 0 for r in rows)
    with pytest.raises(ValueError, match="one-GPU"):
        nccl_tests_cluster(log)


NUMBER = st.integers(1, 10**7).map(lambda x: x / 100)          # what %.2f prints back exactly


def _format(rows, form, prefix):
    """A table as nccl-tests prints it, in header form `form`, each line after `prefix`."""
    head = "#" + "".join(f"{c:>12}" for c in form) + "     time   algbw   busbw  error" * 2
    lines = [head]
    for size, count, t, a, b, t2, a2, b2 in rows:
        cells = [f"{size:>12}", f"{count:>12}", f"{'float':>8}"]
        cells += [f"{'sum':>6}"] if "redop" in form else []
        cells += [f"{-1:>6}"] if "root" in form else []
        cells += [f"{t:8.2f}", f"{a:7.2f}", f"{b:7.2f}", "  0e+00", f"{t2:8.2f}", f"{a2:7.2f}",
                  f"{b2:7.2f}", "  0e+00"]
        lines.append(" ".join(cells))
    return "\n".join(prefix + line for line in lines)


@FAST
@given(rows=st.lists(st.tuples(st.integers(0, 2**34), st.integers(0, 2**32), NUMBER, NUMBER,
                               NUMBER, NUMBER, NUMBER, NUMBER), min_size=1, max_size=6),
       form=st.sampled_from([ROOT, REDOP, BARE]),
       prefix=st.sampled_from(["", "[0] ", "[1,0]<stdout>:", "[1,12]<stderr>:  "]),
       header=st.booleans())
def test_a_table_in_each_header_form_reads_back_the_same_numbers(rows, form, prefix, header):
    text = _format(rows, form, prefix)
    if not header:
        text = text.split("\n", 1)[1]            # a paste that starts at the rows
    log = read_nccl_tests(text, world_size=8)
    assert len(log.rows) == len(rows)
    for r, (size, count, t, a, b, t2, a2, b2) in zip(log.rows, rows):
        assert (r["size"], r["count"], r["type"]) == (size, count, "float")
        assert r["redop"] == ("sum" if "redop" in form else None)
        for key, want, unit in (("time", t, 1e-6), ("algbw", a, 1e9), ("busbw", b, 1e9),
                                ("time_in_place", t2, 1e-6), ("algbw_in_place", a2, 1e9),
                                ("busbw_in_place", b2, 1e9)):
            assert r[key] == pytest.approx(want * unit, rel=1e-12)
    assert log.form == form


REAL = sorted(p.read_text() for p in LOGS.glob("*.txt"))


@FAST
@given(text=st.one_of(st.text(max_size=400),
                      st.sampled_from(REAL).flatmap(
                          lambda t: st.tuples(st.just(t), st.integers(0, len(t)),
                                              st.integers(0, len(t)), st.text(max_size=20))
                      ).map(lambda x: x[0][:x[1]] + x[3] + x[0][x[2]:])))
def test_a_truncated_or_garbled_log_gets_a_sentence(text):
    try:
        log = read_nccl_tests(text)
    except ValueError as e:
        assert str(e).endswith(".") and "\n" not in str(e)
        return
    assert log.rows and all(r["time"] > 0 and math.isfinite(r["time"]) for r in log.rows)
    try:
        busbw_table(log)
    except ValueError as e:
        assert "platform" in str(e)
