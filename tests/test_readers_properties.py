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


# ---- traces: written, then read back --------------------------------------------------------------

from distlab.chrome_trace import to_chrome                       # noqa: E402
from distlab.profiler_trace import from_chrome, from_profiler     # noqa: E402
from distlab.trace import Trace                                   # noqa: E402

NS = st.integers(0, 10**10).map(lambda n: n / 1e9)              # the export keeps ns
OPS = ["all_reduce", "all_gather", "reduce_scatter", "broadcast", "barrier", "send", "recv"]


@st.composite
def _rank(draw, rank, world):
    events = []
    for seq in range(draw(st.integers(0, 5))):
        op = draw(st.sampled_from(OPS))
        launch = draw(NS)
        seen = draw(st.booleans())
        start = launch + draw(NS) if seen else None
        end = start + draw(NS) if seen else None
        p2p = op in ("send", "recv")
        events.append(dict(
            kind="comm", op=op, method=op, seq=seq,
            group=draw(st.sampled_from([None, tuple(range(world))])),
            peer=draw(st.one_of(st.none(), st.integers(0, world - 1))) if p2p else None,
            tag=draw(st.one_of(st.none(), st.integers(0, 99))) if p2p else None,
            bytes=draw(st.integers(0, 2**40)), dtype=draw(st.sampled_from([None, "float32"])),
            launch=launch, start=start, end=end,
            waited=draw(NS) if seen and draw(st.booleans()) else 0.0,
            async_op=draw(st.booleans()), native=draw(st.booleans()),
            label=draw(st.one_of(st.none(), st.text(min_size=1, max_size=8).map(lambda s: [s])))))
    spans = [dict(kind="compute", name=draw(st.text(min_size=1, max_size=8)), start=a,
                  end=a + draw(NS), flops=draw(st.one_of(st.none(), st.integers(0, 10**15))))
             for a in draw(st.lists(NS, max_size=4))]
    memory = [(a, a + draw(NS)) for a in draw(st.lists(NS, max_size=3))]
    ends = [e["end"] for e in events if e["end"] is not None] + [s["end"] for s in spans]
    ends += [b for _, b in memory]
    return dict(rank=rank, events=events, spans=spans, memory=memory,
                end=max(ends, default=0.0))


@st.composite
def _trace(draw):
    world = draw(st.integers(1, 4))
    return Trace([draw(_rank(r, world)) for r in range(world)])


@FAST
@given(trace=_trace())
def test_a_trace_written_to_chrome_reads_back_the_same(tmp_path_factory, trace):
    path = tmp_path_factory.mktemp("rt") / "t.json"
    back = from_chrome(to_chrome(trace, path))
    assert back.world_size == trace.world_size
    for r in range(trace.world_size):
        assert back.end(r) == pytest.approx(trace.end(r), abs=2e-9)
        for a, b in zip(trace.comm(r), back.comm(r), strict=True):
            for key in ("op", "group", "peer", "tag", "bytes", "dtype", "async_op", "native",
                        "label", "seq"):
                if key in ("peer", "tag") and a["op"] not in ("send", "recv"):
                    continue
                assert a[key] == b[key], key
            for key in ("launch", "start", "end", "waited"):
                assert (a[key] is None) == (b[key] is None), key
                if a[key] is not None:
                    assert b[key] == pytest.approx(a[key], abs=2e-9), key
        spans = sorted((s["name"], s["start"], s["end"], s["flops"]) for s in trace.compute(r))
        back_spans = sorted((s["name"], s["start"], s["end"], s["flops"]) for s in back.compute(r))
        assert [s[0] for s in spans] == [s[0] for s in back_spans]
        assert all(x[1:] == pytest.approx(y[1:], abs=2e-9) for x, y in zip(spans, back_spans))
        copies = sorted(tuple(m) for m in trace._ranks[r]["memory"])
        back_copies = sorted(back._ranks[r]["memory"])
        assert [x for m in back_copies for x in m] == pytest.approx(
            [x for m in copies for x in m], abs=2e-9)
        assert back.overlap(r) == pytest.approx(trace.overlap(r), abs=1e-8)


KERNELS = {"compute": "sm90_xmma_gemm_bf16", "nccl": "ncclDevKernel_AllReduce_Sum_f32_RING_LL",
           "copy": "Memcpy DtoD (Device -> Device)", "set": "Memset (Device)"}


@FAST
@given(kernels=st.lists(st.tuples(st.sampled_from(sorted(KERNELS)), st.integers(0, 10**6),
                                  st.integers(0, 10**4), st.integers(1, 2**20)),
                        min_size=1, max_size=12),
       base=st.integers(0, 2**50))
def test_a_gpu_profile_reads_back_its_kernels(tmp_path_factory, kernels, base):
    events = [dict(ph="X", cat={"copy": "gpu_memcpy", "set": "gpu_memset"}.get(kind, "kernel"),
                   name=KERNELS[kind], pid=0, tid=7, ts=ts, dur=dur,
                   args={"In msg nelems": n, "Out msg nelems": n, "dtype": "Float"})
              for kind, ts, dur, n in kernels]
    doc = dict(schemaVersion=1, baseTimeNanoseconds=base * 1000,
               distributedInfo=dict(backend="nccl", rank=0, world_size=2), traceEvents=events)
    path = tmp_path_factory.mktemp("gpu") / "rank0.json"
    path.write_text(json.dumps(doc))
    t = from_profiler(path)
    t0 = min(ts for _, ts, _, _ in kernels)

    def want(kinds):
        return pytest.approx([x for ts, dur in sorted((ts, dur) for kind, ts, dur, _ in kernels
                                                      if kind in kinds)
                              for x in ((ts - t0) / 1e6, (ts + dur - t0) / 1e6)], abs=1e-12)

    def flat(pairs):
        return [x for p in sorted(pairs) for x in p]
    assert flat((e["start"], e["end"]) for e in t.comm(0)) == want({"nccl"})
    assert flat((s["start"], s["end"]) for s in t.compute(0)) == want({"compute"})
    assert flat(t._ranks[0]["memory"]) == want({"copy", "set"})
    assert sorted(e["bytes"] for e in t.comm(0)) == sorted(
        4 * n for kind, _, _, n in kernels if kind == "nccl")


# ---- traces: truncated or garbled ------------------------------------------------------------------

SHIPPED = [DATA / "profiler_subgroups" / "rank1.pt.trace.json",
           DATA / "profiler_ddp" / "rank0.pt.trace.json"]
JSONISH = st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=5),
                       lambda kids: st.lists(kids, max_size=4)
                       | st.dictionaries(st.sampled_from(["ph", "ts", "dur", "pid", "tid", "name",
                                                          "cat", "args", "traceEvents",
                                                          "distributedInfo", "rank", "ranks",
                                                          "pg_config", "world_size",
                                                          "Concrete Inputs", "Input Dims",
                                                          "otherData", "distlab"]),
                                         kids, max_size=5),
                       max_leaves=30)


def _garbled(data):
    """A shipped trace cut short, or with a stretch replaced by other text, or a JSON value
    shaped like a trace whose fields hold anything."""
    text = data.draw(st.sampled_from(SHIPPED)).read_text()
    how = data.draw(st.sampled_from(["cut", "splice", "shape", "events"]))
    if how == "cut":
        return text[:data.draw(st.integers(0, len(text)))]
    if how == "splice":
        a = data.draw(st.integers(0, len(text)))
        b = data.draw(st.integers(a, min(len(text), a + 200)))
        return text[:a] + data.draw(st.text(max_size=10)) + text[b:]
    doc = json.loads(text)
    if how == "shape":
        return json.dumps(data.draw(JSONISH))
    i = data.draw(st.integers(0, len(doc["traceEvents"]) - 1))
    doc["traceEvents"][i] = data.draw(JSONISH)              # one event of any shape
    if data.draw(st.booleans()):
        doc["distributedInfo"] = data.draw(JSONISH)
    return json.dumps(doc)


@FAST
@given(data=st.data())
def test_a_garbled_trace_gets_a_sentence(tmp_path_factory, data):
    path = tmp_path_factory.mktemp("bad") / "rank0.pt.trace.json"
    path.write_text(_garbled(data), encoding="utf-8")
    for read in (from_profiler, from_chrome):
        try:
            t = read(path)
        except ValueError as e:
            assert str(e).endswith(".") and "Traceback" not in str(e)
            continue
        t.summary()
        for r in range(t.world_size):
            t.overlap(r)
