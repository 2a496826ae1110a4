"""Traces leave the course and come back: a run's trace in the Chrome trace event format (for
Perfetto and chrome://tracing), and torch.profiler traces of a real job read into a Trace.

The export is checked against the format's rules by `check_chrome` below, written from the
format's documentation (the Trace Event Format, Google), not from the writer. A consumer library
loads it too where one can run here: the `perfetto` package's trace processor needs its
`trace_processor_shell` binary, which it downloads at first use (no network in tests: give its
path in PERFETTO_TRACE_PROCESSOR to run that test). HTA (HolisticTraceAnalysis, which `make test`
installs; tests/hta_referee.py) checks the import's overlap and idle numbers against its own on a
GPU-shaped trace; tests/test_gpu_trace.py holds a real GPU trace's steps against it.
"""
import json
import os
import shutil
from collections import Counter, defaultdict
from pathlib import Path

import matplotlib
import pytest
import torch
import torch.distributed as dist

import distlab
from distlab import collectives, models
from distlab.chrome_trace import to_chrome
from distlab.profiler_trace import from_chrome
from distlab.profiler_trace import from_profiler
from hta_referee import require_hta

matplotlib.use("Agg")
DATA = Path(__file__).parent / "data" / "profiler_ddp"
GPU_DATA = Path(__file__).parent / "data" / "hta_resnet50_ddp"
# tools/make_profiler_trace.py: the MLP and the bucket size of the shipped DDP trace
SHIPPED_SIZES = (16, 256, 256, 256, 256, 4)

# The format: required keys per phase, and the metadata events' argument.
REQUIRED = {"X": ("name", "ts", "dur", "pid", "tid"), "M": ("name", "pid", "args"),
            "s": ("name", "cat", "id", "ts", "pid", "tid"),
            "f": ("name", "cat", "id", "ts", "pid", "tid")}
METADATA_ARG = dict(process_name="name", process_labels="labels", process_sort_index="sort_index",
                    thread_name="name", thread_sort_index="sort_index")


def check_chrome(doc):
    """Assert that `doc` follows the Chrome trace event format's rules; returns its events."""
    assert isinstance(doc, dict) and isinstance(doc["traceEvents"], list)
    assert doc.get("displayTimeUnit", "ms") in ("ms", "ns")
    json.dumps(doc, allow_nan=False)               # plain JSON: no NaN or infinity
    events = doc["traceEvents"]
    for e in events:
        assert e["ph"] in REQUIRED, e
        for key in REQUIRED[e["ph"]]:
            assert key in e, (key, e)
        assert isinstance(e["pid"], int) and isinstance(e.get("tid", 0), int)
        if "ts" in e:
            assert isinstance(e["ts"], (int, float)) and e["ts"] >= 0, e
        if e["ph"] == "X":
            assert isinstance(e["dur"], (int, float)) and e["dur"] >= 0, e
        if e["ph"] == "M":
            assert e["name"] in METADATA_ARG and METADATA_ARG[e["name"]] in e["args"], e
    # pid/tid metadata: every process and every thread with events is named
    named_pids = {e["pid"] for e in events if e["ph"] == "M" and e["name"] == "process_name"}
    named_tids = {(e["pid"], e["tid"]) for e in events
                  if e["ph"] == "M" and e["name"] == "thread_name"}
    used = {(e["pid"], e["tid"]) for e in events if e["ph"] != "M"}
    assert {p for p, _ in used} <= named_pids
    assert used <= named_tids
    # Perfetto's JSON importer reads tid 0 as the process's main thread (tid = pid): a thread 0,
    # or a thread whose id is its process's, merges with another row or is drawn as "main
    # thread" (seen in Perfetto UI v52). A thread id also belongs to one process only.
    assert all(t != 0 and t != p for p, t in named_tids)
    assert len({t for _, t in named_tids}) == len(named_tids)
    # complete events of one thread nest (a viewer draws them as a stack)
    by_thread = defaultdict(list)
    for e in events:
        if e["ph"] == "X":
            by_thread[(e["pid"], e["tid"])].append((e["ts"], e["ts"] + e["dur"]))
    for slices in by_thread.values():
        open_ = []
        for a, b in sorted(slices, key=lambda s: (s[0], -s[1])):
            while open_ and open_[-1] <= a:
                open_.pop()
            assert not open_ or b <= open_[-1] + 1e-6, "slices of one thread overlap"
            open_.append(b)
    # flows: each id starts once ("s") and ends once ("f"), same cat and name, and each binds to
    # a slice of its thread ("s" at its ts, "f" with bp="e": the slice enclosing its ts)
    starts = {e["id"]: e for e in events if e["ph"] == "s"}
    ends = {e["id"]: e for e in events if e["ph"] == "f"}
    assert len(starts) == sum(e["ph"] == "s" for e in events)
    assert set(starts) == set(ends)
    for fid, s in starts.items():
        f = ends[fid]
        assert (s["cat"], s["name"]) == (f["cat"], f["name"]) and f.get("bp") == "e"
        for point in (s, f):
            assert any(a <= point["ts"] <= b for a, b in by_thread[(point["pid"], point["tid"])])
    return events


def _slices(events, cat):
    return [e for e in events if e["ph"] == "X" and e.get("cat") == cat]


def _workload(rank, world_size):
    with distlab.trace.span("forward"):
        t = torch.arange(11.0) + rank
        t = t * 2
    collectives.ring_all_reduce(t)                      # 2(N-1) sends and recvs per rank
    dist.all_reduce(t)
    if distlab.trace.emulated() is None:                # two transfers in flight together
        first = dist.all_reduce(t, async_op=True)
        second = dist.all_reduce(t.clone(), async_op=True)
        first.wait()
        second.wait()
    return t


@pytest.fixture(scope="module")
def measured():
    return distlab.run(_workload, 3, trace=True).trace


@pytest.fixture(scope="module")
def emulated():
    return distlab.run(_workload, 3, trace=True, emulate="h100-nvlink").trace


@pytest.mark.parametrize("which", ["measured", "emulated"])
def test_a_run_exports_to_the_chrome_trace_format(which, request, tmp_path):
    trace = request.getfixturevalue(which)
    path = trace.to_chrome(tmp_path / "run.json")
    events = check_chrome(json.loads(Path(path).read_text()))
    # one process per rank, named; compute, communication and waiting threads
    names = {e["pid"]: e["args"]["name"] for e in events if e["name"] == "process_name"}
    assert sorted(names) == [0, 1, 2] and all(n.startswith(f"rank {r}") for r, n in names.items())
    threads = {e["args"]["name"] for e in events if e["name"] == "thread_name"}
    assert {"compute", "communication", "blocked waiting"} <= threads
    # every collective and message is one complete slice with its facts as args
    comm = _slices(events, "comm")
    assert len(comm) == len(trace.comm())
    for e in comm:
        assert {"op", "group", "bytes", "dtype", "waited_us", "launch_us"} <= set(e["args"])
        assert e["name"] == e["args"]["op"]
    by_rank_op = Counter((e["pid"], e["name"]) for e in comm)
    assert by_rank_op == Counter((e["rank"], e["op"]) for e in trace.comm())
    assert all(e["args"]["bytes"] == 11 * 4 for e in comm if e["name"] == "all_reduce")
    # spans are named slices
    assert "forward" in {e["name"] for e in _slices(events, "compute")}
    # a flow from every send to its recv: 2(N-1) messages per rank
    flows = [e for e in events if e["ph"] == "s"]
    assert len(flows) == len(trace.comm(op="send")) == 3 * 4
    ends = {e["id"]: e for e in events if e["ph"] == "f"}
    for s in flows:
        assert ends[s["id"]]["pid"] == (s["pid"] + 1) % 3          # a ring: to the right
    # µs: the latest slice ends when the slowest rank's last transfer did
    last = max(e["ts"] + e["dur"] for e in comm)
    assert last == pytest.approx(max(c["end"] for c in trace.comm()) * 1e6, abs=0.01)


def test_an_emulated_run_says_so_and_keeps_its_virtual_times(emulated, tmp_path):
    doc = json.loads(Path(to_chrome(emulated, tmp_path / "emulated.json")).read_text())
    events = check_chrome(doc)
    info = doc["otherData"]["distlab"]
    assert info["emulated"] is True and info["clock"] == "modeled"
    assert info["cluster"] == emulated.emulated.name and "modeled" in info["description"]
    assert all("emulated" in e["args"]["name"] for e in events if e["name"] == "process_name")
    assert all(e["args"]["clock"] == "modeled" for e in events if e["ph"] == "X")
    for e, c in zip(sorted(_slices(events, "comm"), key=lambda e: (e["pid"], e["args"]["seq"])),
                    emulated.comm()):
        assert e["ts"] == pytest.approx(c["start"] * 1e6, abs=1e-3)        # virtual µs
        assert e["dur"] == pytest.approx((c["end"] - c["start"]) * 1e6, abs=2e-3)
    # on one modeled clock a message arrives after it left: every arrow points forward
    ends = {e["id"]: e for e in events if e["ph"] == "f"}
    assert all(ends[s["id"]]["ts"] >= s["ts"] for s in events if s["ph"] == "s")


@pytest.mark.parametrize("which", ["measured", "emulated"])
def test_export_round_trips(which, request, tmp_path):
    trace = request.getfixturevalue(which)
    back = from_chrome(trace.save(tmp_path / "run.json"))
    assert back.world_size == trace.world_size
    assert (back.emulated is None) == (trace.emulated is None)
    # Numbers, not summary(): the export keeps whole ns, and a total a few ns from a rounding
    # edge of summary's µs can print one digit apart (seen once in CI on the measured run).
    for r in range(trace.world_size):
        assert back.totals(r) == pytest.approx(trace.totals(r), abs=1e-8)
    for r in range(trace.world_size):
        for a, b in zip(trace.comm(r), back.comm(r), strict=True):
            for key in ("op", "group", "peer", "tag", "bytes", "dtype", "async_op", "native"):
                assert a[key] == b[key], key
            for key in ("launch", "start", "end", "waited"):
                assert (a[key] is None) == (b[key] is None)
                if a[key] is not None:
                    assert b[key] == pytest.approx(a[key], abs=1e-9)
        spans = sorted((s["name"], s["start"], s["end"]) for s in trace.compute(r))
        spans_back = sorted((s["name"], s["start"], s["end"]) for s in back.compute(r))
        assert [s[0] for s in spans] == [s[0] for s in spans_back]
        assert all(abs(x[1] - y[1]) < 1e-9 for x, y in zip(spans, spans_back))
        assert back.overlap(r) == pytest.approx(trace.overlap(r), abs=1e-8)


def test_async_transfers_in_flight_together_get_their_own_lane(measured, tmp_path):
    events = check_chrome(json.loads(Path(to_chrome(measured, tmp_path / "m.json")).read_text()))
    comm = _slices(events, "comm")
    for rank in range(3):
        mine = sorted(((e["ts"], e["ts"] + e["dur"], e["tid"]) for e in comm if e["pid"] == rank))
        overlapping = [(x, y) for x, y in zip(mine, mine[1:]) if y[0] < x[1] and y[1] > x[1]]
        assert all(x[2] != y[2] for x, y in overlapping)       # never on the same thread


def test_bad_input_gets_a_sentence(tmp_path):
    with pytest.raises(TypeError, match="needs a distlab Trace"):
        to_chrome([1, 2], tmp_path / "x.json")
    (tmp_path / "other.json").write_text('{"traceEvents": []}')
    with pytest.raises(ValueError, match="not written by distlab"):
        from_chrome(tmp_path / "other.json")


def test_perfetto_trace_processor_loads_the_export(emulated, tmp_path):
    binary = os.environ.get("PERFETTO_TRACE_PROCESSOR")
    tp_module = pytest.importorskip("perfetto.trace_processor")
    if not binary or not Path(binary).is_file():
        pytest.skip("perfetto's trace processor binary is downloaded at first use; set "
                    "PERFETTO_TRACE_PROCESSOR to a trace_processor_shell to run this test")
    path = str(to_chrome(emulated, tmp_path / "emulated.json"))
    config = tp_module.TraceProcessorConfig(bin_path=binary)
    with tp_module.TraceProcessor(trace=path, config=config) as tp:
        slices = next(iter(tp.query("select count(*) as n from slice"))).n
        flows = next(iter(tp.query("select count(*) as n from flow"))).n
    assert slices == sum(1 for _ in emulated.comm()) + len(emulated.compute()) + sum(
        1 for e in emulated.comm() if e["waited"] > 0)
    assert flows == len(emulated.comm(op="send"))


# ---- torch.profiler traces into the course ----------------------------------------------------------

@pytest.fixture(scope="module")
def shipped():
    return from_profiler(DATA)


def test_the_shipped_profiler_trace_is_small_and_real():
    files = sorted(DATA.glob("*.json"))
    assert [f.name for f in files] == ["rank0.pt.trace.json", "rank1.pt.trace.json"]
    assert sum(f.stat().st_size for f in files) < 300_000
    for rank, f in enumerate(files):
        doc = json.loads(f.read_text())
        assert doc["distributedInfo"]["rank"] == rank and doc["distributedInfo"]["backend"] == "gloo"
        assert not any(s in f.read_text() for s in ("/work/", "/tmp/", "/home/"))


def test_bad_profiler_input_gets_a_sentence(tmp_path):
    with pytest.raises(ValueError, match="no such trace file"):
        from_profiler([tmp_path / "missing.json"])
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="holds no profiler traces"):
        from_profiler(tmp_path / "empty")
    (tmp_path / "bad.json").write_text("not json")
    with pytest.raises(ValueError, match="not a JSON trace"):
        from_profiler(tmp_path / "bad.json")
    for r in (0, 1):
        shutil.copy(DATA / "rank0.pt.trace.json", tmp_path / f"copy{r}.json")
    with pytest.raises(ValueError, match="one file per rank"):
        from_profiler([tmp_path / "copy0.json", tmp_path / "copy1.json"])


def test_one_ranks_file_of_a_big_job_reads_alone():
    # HTA's rank 34 of a 300-rank gloo job (tests/data/hta_cpu_rank34); before: "needs one file
    # per rank 0..0"
    t = from_profiler(DATA.parent / "hta_cpu_rank34")
    assert (t.world_size, t.ranks_read) == (300, [34]) and "1 of its 300 ranks" in t.source
    assert t.ops(34) == ["all_reduce"] * 10 and t.comm(0) == [] and t.compute(299) == []
    assert all(e["group"] == tuple(range(300)) and e["start"] < e["end"] for e in t.comm(34))
    assert t.overlap(34)["comm"] > 0


@pytest.mark.parametrize("field", ["rank", "world_size"])
def test_a_damaged_world_size_or_rank_is_a_sentence_not_a_trace_of_a_trillion_ranks(tmp_path, field):
    # Found by test_readers_properties under another seed: a garbled distributedInfo naming
    # 10**12 ranks made from_profiler build a list of 10**12 empty ranks (a hang, then the memory).
    import gzip
    doc = json.loads(gzip.open(next((DATA.parent / "hta_cpu_rank34").glob("*.gz"))).read())
    doc["distributedInfo"][field] = 10 ** 12
    (tmp_path / "rank.json").write_text(json.dumps(doc))
    with pytest.raises(ValueError, match="names a job of 1,000,000,000,00[01] ranks, more than "
                                         "the 131,072 this reader takes: is it damaged?"):
        from_profiler(tmp_path / "rank.json")


def test_peers_inside_a_subgroup_are_global_ranks_or_unknown(tmp_path):
    # A real 4-rank profile (tests/data/profiler_subgroups): groups [0, 2] and [1, 3], rank 0
    # sends to 2 and rank 1 to 3 (group-local peer 1), ranks 2 and 3 receive (group-local src 0).
    # gloo's events do not say which group; the file lists the rank's groups. Before, every peer
    # went through the default group: 0 -> 1, 1 -> 1 (itself), 3 <- 0, three wrong ranks.
    t = from_profiler(DATA.parent / "profiler_subgroups")
    truth = {0: ("send", 2), 1: ("send", 3), 2: ("recv", 0), 3: ("recv", 1)}
    peers = []
    for rank, (op, peer) in truth.items():
        (e,) = t.comm(rank, op=op)
        assert (e["tag"], e["bytes"]) == (7, 20) and e["peer"] in (peer, None)   # never wrong
        peers.append(e["peer"])
    # 1: local 1 is itself in the default group, so [1, 3]; 2: local 0 is rank 0 in both groups;
    # 0 and 3: the two groups give two ranks, the file cannot tell which
    assert peers == [None, 3, 0, None]
    assert t.matrix()[1][3] == 20 and sum(map(sum, t.matrix())) == 20
    check_chrome(json.loads(Path(t.to_chrome(tmp_path / "sub.json")).read_text()))
    # where an event names its group (as NCCL's do), the peer goes through that group
    doc = json.loads((DATA.parent / "profiler_subgroups" / "rank0.pt.trace.json").read_text())
    send = next(e for e in doc["traceEvents"] if e.get("name") == "c10d::send")
    send["args"]["Process Group Name"] = "1"                 # pg_config: "1" is [0, 2]
    (tmp_path / "named.json").write_text(json.dumps(doc))
    (e,) = from_profiler([tmp_path / "named.json"]).comm(0, op="send")
    assert (e["peer"], e["group"]) == (2, (0, 2))
    # a file that lists no groups cannot tell either
    del send["args"]["Process Group Name"], doc["distributedInfo"]["pg_config"]
    (tmp_path / "bare.json").write_text(json.dumps(doc))
    assert from_profiler([tmp_path / "bare.json"]).comm(0, op="send")[0]["peer"] is None


def test_a_ddp_profile_becomes_the_courses_trace(shipped):
    params = sum(p.numel() for p in models.make_mlp(SHIPPED_SIZES).parameters())
    assert shipped.world_size == 2 and shipped.source.startswith("torch.profiler")
    for r in range(2):
        reduces = shipped.comm(r, op="all_reduce")
        assert shipped.ops(r) == ["all_reduce"] * len(reduces) and len(reduces) >= 2
        assert sum(e["bytes"] for e in reduces) == 4 * params      # DDP's buckets: every gradient
        assert all(e["group"] == (0, 1) and e["dtype"] == "float32" for e in reduces)
        assert all(e["launch"] <= e["start"] < e["end"] for e in reduces)
        assert {"forward", "backward"} <= {s["name"] for s in shipped.compute(r)}
        o = shipped.overlap(r)
        assert 0 <= o["overlapped"] <= o["comm"] and 0 <= o["ratio"] <= 1 and o["idle"] >= 0
        assert o["exposed"] == pytest.approx(o["comm"] - o["overlapped"])
    # the two ranks' buckets are the same all-reduces, in the same order
    assert [e["bytes"] for e in shipped.comm(0)] == [e["bytes"] for e in shipped.comm(1)]
    assert "rank" in shipped.summary()


def test_the_courses_pictures_and_export_work_on_a_profiler_trace(shipped, tmp_path):
    from distlab.viz.trace import timeline
    ax = timeline(shipped)
    assert "torch.profiler" in ax.get_xlabel()
    check_chrome(json.loads(Path(shipped.to_chrome(tmp_path / "real.json")).read_text()))


def test_collectives_and_messages_of_a_gloo_profile(tmp_path):
    distlab.run(_profiled_calls, 2, str(tmp_path))
    t = from_profiler([tmp_path / "p0.json", tmp_path / "p1.json"])
    assert t.ops(0) == ["all_reduce", "all_gather", "reduce_scatter", "broadcast", "send", "barrier"]
    assert t.ops(1) == ["all_reduce", "all_gather", "reduce_scatter", "broadcast", "recv", "barrier"]
    gather, scatter = t.comm(0, op="all_gather")[0], t.comm(0, op="reduce_scatter")[0]
    assert gather["bytes"] == 2 * 6 * 4 and scatter["bytes"] == 2 * 3 * 4   # the full tensors
    send, recv = t.comm(0, op="send")[0], t.comm(1, op="recv")[0]
    assert (send["peer"], send["tag"], send["bytes"], send["dtype"]) == (1, 3, 40, "float64")
    assert (recv["peer"], recv["tag"]) == (0, 3)
    doc = json.loads(Path(to_chrome(t, tmp_path / "calls.json")).read_text())
    assert sum(e["ph"] == "s" for e in check_chrome(doc)) == 1


def _profiled_calls(rank, world_size, out):
    from torch.profiler import ProfilerActivity, profile
    t = torch.ones(6)
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        dist.all_reduce(t)
        dist.all_gather_into_tensor(torch.empty(6 * world_size), t)
        dist.reduce_scatter_tensor(torch.empty(3), torch.ones(3 * world_size))
        dist.broadcast(t, 0)
        if rank == 0:
            dist.send(torch.ones(5, dtype=torch.float64), 1, tag=3)
        else:
            dist.recv(torch.empty(5, dtype=torch.float64), 0, tag=3)
        dist.barrier()
    prof.export_chrome_trace(f"{out}/p{rank}.json")


def _busy(trace, rank):
    """The union of everything the rank's device did: transfers, compute and copies."""
    from distlab.trace import _union
    r = trace._ranks[rank]
    return _union([(e["start"], e["end"]) for e in r["events"] if e["start"] is not None]
                  + [(s["start"], s["end"]) for s in r["spans"]]
                  + [tuple(m) for m in r.get("memory", ())])


def test_a_gpu_profile_keeps_its_copies_through_the_chrome_export(tmp_path):
    # The shipped GPU trace (chapter 11's): 1074 memcpy/memset intervals, 2.65 ms, busy time
    # that is neither compute nor communication. Before, the export dropped them and the idle
    # time read back grew by what they did not overlap.
    before = from_profiler(GPU_DATA)
    doc = json.loads(Path(before.to_chrome(tmp_path / "gpu.json")).read_text())
    check_chrome(doc)
    assert sum(e.get("cat") == "copy" for e in doc["traceEvents"]) == 1074
    after = from_chrome(tmp_path / "gpu.json")
    assert after.overlap(0)["idle"] == pytest.approx(before.overlap(0)["idle"], abs=1e-8)
    assert _busy(after, 0) == pytest.approx(_busy(before, 0), abs=1e-8)


# ---- the definitions of HTA, on a GPU-shaped trace ------------------------------------------------------

# Two ranks' kernels (name, stream, start µs, end µs): compute, NCCL collectives partly hidden
# behind it (rank 1: two at once, on two streams), a copy (busy, but not compute).
AR = "ncclDevKernel_AllReduce_Sum_f32_RING_LL(ncclDevKernelArgsStorage<4096ul>)"
AG = "ncclDevKernel_AllGather_RING_LL(ncclDevKernelArgsStorage<4096ul>)"
GPU_KERNELS = {
    0: [("sm90_gemm_fwd", 7, 0, 40), ("sm90_gemm_bwd", 7, 50, 100), (AR, 20, 80, 130),
        ("Memcpy DtoD (Device -> Device)", 7, 135, 140), ("elementwise_kernel", 7, 140, 150)],
    1: [("sm90_gemm_fwd", 7, 0, 45), ("sm90_gemm_bwd", 7, 55, 90), (AR, 20, 85, 135),
        (AG, 21, 120, 140), ("elementwise_kernel", 7, 145, 150)],
}
# By hand, from the definitions: communication is the union of NCCL kernels, 50 and 55 µs; the
# compute that hides it: 80-100 (20 µs) and 85-90 (5 µs); idle = the 150 µs from first to last
# kernel minus the union of all kernels: rank 0 40-50 and 130-135, rank 1 45-55 and 140-145.
EXPECTED = {0: dict(comm=50, overlapped=20, ratio=20 / 50, idle=15),
            1: dict(comm=55, overlapped=5, ratio=5 / 55, idle=15)}


def _gpu_trace(folder):
    folder.mkdir()
    for rank, kernels in GPU_KERNELS.items():
        events = []
        for i, (name, stream, a, b) in enumerate(kernels):
            args = {"stream": stream, "device": 0, "correlation": i + 1, "External id": i + 1}
            if name.startswith("nccl"):
                args.update({"In msg nelems": 1024, "Out msg nelems": 1024, "dtype": "Float",
                             "Group size": 2})
            events.append(dict(ph="X", cat="gpu_memcpy" if name.startswith("Memcpy") else "kernel",
                               name=name, pid=0, tid=stream, ts=1_000_000 + a, dur=b - a,
                               args=args))
        doc = dict(schemaVersion=1, distributedInfo=dict(backend="nccl", rank=rank, world_size=2),
                   deviceProperties=[], traceEvents=events)
        (folder / f"rank{rank}.json").write_text(json.dumps(doc))
    return folder


def test_overlap_and_idle_follow_htas_definitions(tmp_path):
    t = from_profiler(_gpu_trace(tmp_path / "gpu"))
    assert t.source == "torch.profiler trace (GPU kernels)"
    for rank, want in EXPECTED.items():
        o = t.overlap(rank)
        assert o["comm"] * 1e6 == pytest.approx(want["comm"])
        assert o["overlapped"] * 1e6 == pytest.approx(want["overlapped"])
        assert o["ratio"] == pytest.approx(want["ratio"])
        assert o["idle"] * 1e6 == pytest.approx(want["idle"])
        assert t.comm(rank)[0]["op"] == "all_reduce" and t.comm(rank)[0]["bytes"] == 4096


@pytest.mark.filterwarnings("ignore::DeprecationWarning")     # pandas' own, raised inside HTA
def test_hta_agrees_on_overlap_and_idle(tmp_path):
    hta = require_hta()
    folder = _gpu_trace(tmp_path / "gpu")
    ours = from_profiler(folder)
    analysis = hta.TraceAnalysis(trace_dir=str(folder))
    overlap = analysis.get_comm_comp_overlap(visualize=False).set_index("rank")
    temporal = analysis.get_temporal_breakdown(visualize=False).set_index("rank")
    for rank in (0, 1):
        o = ours.overlap(rank)
        assert overlap.loc[rank, "comp_comm_overlap_pctg"] == pytest.approx(100 * o["ratio"],
                                                                            abs=0.01)
        assert temporal.loc[rank, "idle_time(us)"] == pytest.approx(o["idle"] * 1e6, abs=0.01)


# ---- chapter 11b §4: the stored Perfetto picture and what the prose reads off it ---------------------

PICTURE = Path(__file__).resolve().parent.parent / "notebooks" / "images" / "perfetto_ddp_profile.png"


def _ms(seconds):
    """As Perfetto prints a duration (and chapter 11b with it): whole ns, 4 significant digits."""
    return f"{round(seconds * 1e9) / 1e6:.4g} ms"


def test_ch11_perfetto_picture_is_of_todays_export_and_its_numbers_are_quoted(shipped, tmp_path):
    import hashlib
    import nbformat
    from PIL import Image
    from distlab import debug
    # The picture (tools/screenshot_trace.py) stamps the sha256 of the export it shows: a change
    # of the export or of the shipped trace makes it stale. Re-run the tool then.
    export = shipped.to_chrome(tmp_path / "ddp_profile.trace.json")
    assert PICTURE.stat().st_size < 150_000
    stamp = Image.open(PICTURE).text["distlab-export-sha256"]
    assert stamp == hashlib.sha256(export.read_bytes()).hexdigest(), \
        "notebooks/images/perfetto_ddp_profile.png is stale: run tools/screenshot_trace.py"
    nb = nbformat.read(PICTURE.parent.parent / "11b_performance.ipynb", as_version=4)
    text = " ".join(c.source for c in nb.cells if c.cell_type == "markdown").replace("\n", " ")
    assert "](images/perfetto_ddp_profile.png)" in text
    back = from_chrome(export)
    read = {}
    for r in (0, 1):
        transfers = [(e["start"], e["end"]) for e in back.comm(r)]
        first, last = min(a for a, _ in transfers), max(b for _, b in transfers)
        inside = sum(min(s["end"], last) - max(s["start"], first) for s in back.compute(r)
                     if s["end"] > first and s["start"] < last)
        o = back.overlap(r)
        # the ruler is the communication time only where the rows are never empty in between
        assert last - first == pytest.approx(o["comm"], abs=1e-12)
        assert inside == pytest.approx(o["overlapped"], abs=1e-12)
        read[r] = dict(window=last - first, total=sum(b - a for a, b in transfers),
                       inside=inside, **o)
        ruler = debug.ruler_reading(back, r)             # what the chapter's cell prints
        assert (ruler["window"], ruler["slices"], ruler["compute_inside"]) == pytest.approx(
            (read[r]["window"], read[r]["total"], inside), abs=1e-12)
    one, zero = read[1], read[0]
    assert one["total"] > one["window"]                 # two transfers in flight at once
    assert zero["inside"] == 0
    quoted = (f"The ruler over rank 1's selection reads {_ms(one['window'])}",
              f"The *Slices* tab says `all_reduce` {_ms(one['total'])}",
              f"inside the selection add up to {_ms(one['inside'])}",
              f"compute hid, {round(100 * one['ratio'])} % of it, and the other "
              f"{_ms(one['exposed'])} are exposed",
              f"nothing of its {_ms(zero['window'])} is hidden")
    for q in quoted:
        assert q in text, q
    # §4c: rank 0's 8.93 ms are mostly its own late records: the ends of the same calls on the
    # two ranks, the cut at the group's first end, and what is left, as the prose quotes them
    tails = [c["tail"] for c in debug.completion_skew(shipped)]
    assert all(t[1] == 0 for t in tails)                          # rank 1 always ends first
    late = [t[0] for t in tails if t[0] > 1e-3]
    assert len(late) == 2 and tails[0][0] in late and tails[-1][0] in late
    cut0, cut1 = (debug.communication_until_group_done(shipped, r) for r in (0, 1))
    assert cut0["comm"] + cut0["tail"] == pytest.approx(zero["comm"], abs=1e-12)
    assert cut0["overlapped"] == 0 and cut1["tail"] == 0
    assert cut1["comm"] == pytest.approx(one["comm"], abs=1e-12)
    quoted = (f"end {late[0] * 1e3:.1f} and {late[1] * 1e3:.1f} ms after rank 1's ends of the same",
              f"rank 0 communicated for {_ms(cut0['comm'])}, all of it exposed; the other "
              f"{_ms(cut0['tail'])} of its {_ms(zero['window'])} are its own thread being late",
              f"its {_ms(one['window'])} are real waiting")
    for q in quoted:
        assert q in text, q
    # §1's pointer: rank 1 reached backward first; its first all-reduce outlasted rank 0's launch
    first0, first1 = shipped.comm(0)[0], shipped.comm(1)[0]
    assert first1["launch"] < first0["launch"] < first1["end"]
    assert "rank 1 reached backward first, and its first all-reduce stayed in flight until " \
           "rank 0 launched its own" in text
