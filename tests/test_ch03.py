"""Workbook 03's checkers judge the algorithm from what travelled (the run's trace), on two
process groups side by side whose ranks are not 0..k: right answers written another way pass;
one-way rings, rings run one after the other, roots and chains, the course's own code and
built-in collectives (however they are reached) are refused in one sentence (the battery of
tests/checker_battery.py). Then the chapter's numbers, re-computed, and its timeline's labels."""
import pytest
import torch
import torch.distributed as dist
from torch.distributed import all_reduce as imported_all_reduce   # imported before the check

import distlab
from checker_battery import battery
from distlab import collectives
from distlab.checks import CheckFailed, ch03


# ---- exercise 1: the bidirectional ring all-reduce ----------------------------------------------

def bidirectional_all_reduce(tensor, group):          # as the workbook's solution
    me, n = dist.get_rank(group), dist.get_world_size(group)
    right = dist.get_global_rank(group, (me + 1) % n)
    left = dist.get_global_rank(group, (me - 1) % n)
    halves = torch.tensor_split(tensor, 2)
    rings = [(list(torch.tensor_split(halves[0], n)), right, left, 1),
             (list(torch.tensor_split(halves[1], n)), left, right, -1)]

    def step(pairs):
        ops = []
        for outgoing, incoming, to, frm in pairs:
            if outgoing.numel():
                ops.append(dist.P2POp(dist.isend, outgoing, to))
            if incoming.numel():
                ops.append(dist.P2POp(dist.irecv, incoming, frm))
        for req in dist.batch_isend_irecv(ops) if ops else []:
            req.wait()

    for s in range(n - 1):
        pairs, adds = [], []
        for chunks, to, frm, turn in rings:
            out_c, in_c = (me - turn * (s + 1)) % n, (me - turn * (s + 2)) % n
            buf = torch.empty_like(chunks[in_c])
            pairs.append((chunks[out_c], buf, to, frm))
            adds.append((chunks[in_c], buf))
        step(pairs)
        for mine, arrived in adds:
            mine += arrived
    for s in range(n - 1):
        pairs = []
        for chunks, to, frm, turn in rings:
            out_c, in_c = (me - turn * s) % n, (me - turn * (s + 1)) % n
            pairs.append((chunks[out_c], chunks[in_c], to, frm))
        step(pairs)
    return tensor


def _ring_halves(tensor, group, together=True, add=(True, True), one_way=False):
    """Another way to write it: a fresh output, each half cut by hand with narrow(), group_peer
    instead of global ranks, isend/irecv handles instead of a batch; the variants below break it
    on purpose (one ring after the other, a half copied instead of added, everything one way)."""
    me, n = dist.get_rank(group), dist.get_world_size(group)
    out = tensor.clone()
    cut = out.numel() // 2 if not one_way else out.numel()
    parts = [out.narrow(0, 0, cut), out.narrow(0, cut, out.numel() - cut)]

    def pieces(t):
        base, extra = divmod(t.numel(), n)
        sizes = [base + (i < extra) for i in range(n)]
        return list(t.split(sizes))

    rings = [(pieces(parts[0]), 1), (pieces(parts[1]), -1)]
    schedule = [(phase, s) for phase in ("reduce", "gather") for s in range(n - 1)]
    order = ([[(i, p, s) for i in range(2)] for p, s in schedule] if together else
             [[(i, p, s)] for i in range(2) for p, s in schedule])
    for batch in order:
        handles, after = [], []
        for i, phase, s in batch:
            chunks, turn = rings[i]
            shift = 1 if phase == "reduce" else 0
            send_c, recv_c = (me - turn * (s + shift)) % n, (me - turn * (s + shift + 1)) % n
            into = torch.empty_like(chunks[recv_c])
            if chunks[send_c].numel():
                handles.append(dist.isend(chunks[send_c].contiguous(), group=group,
                                          group_dst=(me + turn) % n))
            if into.numel():
                handles.append(dist.irecv(into, group=group, group_src=(me - turn) % n))
            after.append((chunks[recv_c], into, phase == "reduce" and add[i]))
        for h in handles:
            h.wait()
        for mine, arrived, adding in after:
            mine.add_(arrived) if adding else mine.copy_(arrived)
    return out


def ring_with_handles(tensor, group):
    return _ring_halves(tensor, group)


def second_half_copied(tensor, group):
    return _ring_halves(tensor, group, add=(True, False))


def one_ring_then_the_other(tensor, group):
    return _ring_halves(tensor, group, together=False)


def one_way_ring(tensor, group):
    return _ring_halves(tensor, group, one_way=True)


def torch_all_reduce(tensor, group):
    imported_all_reduce(tensor, group=group)
    return tensor


def course_ring(tensor, group):
    return collectives.ring_all_reduce(tensor, group=group)


def test_bidirectional_all_reduce_battery():
    said = battery(ch03.check_bidirectional_all_reduce,
                   correct=[bidirectional_all_reduce], different=[ring_with_handles],
                   wrong=[second_half_copied], cheat=[torch_all_reduce, course_ring],
                   decoy=[one_ring_then_the_other, one_way_ring])
    wrong, (built_in, course), (sequential, one_way) = said["wrong"], said["cheat"], said["decoy"]
    assert "second_half_copied, group [1, 2, 4, 6, 7], length 1: on rank 1" in wrong[0]
    assert "called the built-in collective all_reduce over ranks [1, 2, 4, 6, 7]" in built_in
    assert "course's own ring_all_reduce" in course
    assert ("took 16 rounds" in sequential and "2(N-1) = 8 rounds: post a step's messages in "
            "both directions" in sequential)
    assert "each direction carries only half the tensor" in one_way


def receive_first(tensor, group):
    me, n = dist.get_rank(group), dist.get_world_size(group)
    incoming = torch.empty_like(tensor)
    dist.recv(incoming, dist.get_global_rank(group, (me - 1) % n))   # every rank waits
    dist.send(tensor, dist.get_global_rank(group, (me + 1) % n))
    return tensor + incoming


def test_a_deadlocked_ring_says_where_each_rank_waits(monkeypatch):
    monkeypatch.setattr(ch03, "TIMEOUT", 4)
    with pytest.raises(CheckFailed) as caught:
        ch03.check_bidirectional_all_reduce(receive_first)
    message = str(caught.value)
    assert "receive_first with world_size=8 deadlocked" in message
    assert "waits in recv at `dist.recv(incoming, dist.get_global_rank(group, (me - 1) % n))`" \
        in message
    assert "post every message of the step" in message and "timeout" not in message


# ---- exercise 2: the binomial-tree reduce -------------------------------------------------------

def tree_reduce(tensor, dst, group):                   # as the workbook's solution
    me, n = dist.get_rank(group), dist.get_world_size(group)
    v = (me - dst) % n
    partial = tensor.clone()
    incoming = torch.empty_like(partial)
    mask = 1
    while mask < n:
        if v % (2 * mask) == mask:
            dist.send(partial, dist.get_global_rank(group, (v - mask + dst) % n))
            break
        if v + mask < n:
            dist.recv(incoming, dist.get_global_rank(group, (v + mask + dst) % n))
            partial += incoming
        mask *= 2
    tensor.copy_(partial)
    return tensor


def _farthest_first(tensor, dst, group, add=True):
    """Another binomial tree (MPI's order: the farthest half first), with group_dst/group_src
    and isend/irecv; `add=False` overwrites instead of adding (wrong)."""
    me, n = dist.get_rank(group), dist.get_world_size(group)
    v = (me - dst) % n
    top = 1 << (n - 1).bit_length()
    acc = tensor.clone()
    span = top // 2
    while span >= 1:
        if span <= v < 2 * span:
            dist.isend(acc, group=group, group_dst=(v - span + dst) % n).wait()
            return tensor
        if v < span and v + span < n:
            got = torch.empty_like(acc)
            dist.irecv(got, group=group, group_src=(v + span + dst) % n).wait()
            acc = acc + got if add else got
        span //= 2
    return acc


def tree_farthest_first(tensor, dst, group):
    return _farthest_first(tensor, dst, group)


def tree_overwrites(tensor, dst, group):
    return _farthest_first(tensor, dst, group, add=False)


def root_collects(tensor, dst, group):
    """Right sum, wrong algorithm: dst receives from every member in turn (N-1 rounds)."""
    me, n = dist.get_rank(group), dist.get_world_size(group)
    if me != dst:
        dist.send(tensor, dist.get_global_rank(group, dst))
        return tensor
    total, got = tensor.clone(), torch.empty_like(tensor)
    for other in range(n):
        if other != dst:
            dist.recv(got, dist.get_global_rank(group, other))
            total += got
    return total


def chain(tensor, dst, group):
    """Right sum in N-1 rounds: each rank adds and passes on to the next one towards dst."""
    me, n = dist.get_rank(group), dist.get_world_size(group)
    v = (me - dst) % n
    acc = tensor.clone()
    if v < n - 1:
        got = torch.empty_like(acc)
        dist.recv(got, dist.get_global_rank(group, (me + 1) % n))
        acc += got
    if v > 0:
        dist.send(acc, dist.get_global_rank(group, (me - 1) % n))
    return acc


def torch_reduce(tensor, dst, group):
    dist.reduce(tensor, dst=dist.get_global_rank(group, dst), group=group)
    return tensor


def course_naive(tensor, dst, group):
    return collectives.naive_all_reduce(tensor, group=group, root=dst)


def test_tree_reduce_battery():
    said = battery(ch03.check_tree_reduce, correct=[tree_reduce],
                   different=[tree_farthest_first], wrong=[tree_overwrites],
                   cheat=[torch_reduce, course_naive], decoy=[root_collects, chain])
    (collects, chained), (built_in, course) = said["decoy"], said["cheat"]
    assert "group [1, 2, 4, 6, 7], dst=0 (rank 1), length 1" in said["wrong"][0]
    assert "the sum took 4 rounds" in collects and "ceil(log2 5) = 3" in collects
    assert "the sum took 4 rounds" in chained
    assert "called the built-in collective reduce over ranks [1, 2, 4, 6, 7]" in built_in
    assert "course's own naive_all_reduce" in course


def test_stubs_give_one_line_not_implemented():
    def stub(*args):
        raise NotImplementedError("exercise: replace this line with your code")

    for check in (ch03.check_bidirectional_all_reduce, ch03.check_tree_reduce):
        with pytest.raises(NotImplementedError, match="is not written yet"):
            check(stub)


# ---- predict, then run: the hierarchical all-reduce's α-β time -----------------------------------

def hierarchical_seconds(S, M, G, intra, inter):        # as the workbook's solution
    return (2 * (G - 1) * intra.alpha + 2 * (G - 1) / G * S / intra.bandwidth
            + 2 * (M - 1) * inter.alpha + 2 * (M - 1) / M * (S / G) / inter.bandwidth)


def hierarchical_by_phases(S, M, G, intra, inter):      # differently written: phase by phase
    def ring(steps, piece, link):
        return steps * (link.alpha + piece / link.bandwidth)
    inside = ring(G - 1, S / G, intra)                  # reduce-scatter; the all-gather: the same
    between = ring(2 * (M - 1), S / G / M, inter)
    return 2 * inside + between


def flat_ring_between_nodes(S, M, G, intra, inter):     # one ring of all M·G GPUs, on the NICs
    n = M * G
    return 2 * (n - 1) * inter.alpha + 2 * (n - 1) / n * S / inter.bandwidth


def whole_tensor_between_nodes(S, M, G, intra, inter):
    return (2 * (G - 1) * intra.alpha + 2 * (G - 1) / G * S / intra.bandwidth
            + 2 * (M - 1) * inter.alpha + 2 * (M - 1) / M * S / inter.bandwidth)


def half_the_steps(S, M, G, intra, inter):
    return ((G - 1) * intra.alpha + 2 * (G - 1) / G * S / intra.bandwidth
            + 2 * (M - 1) * inter.alpha + 2 * (M - 1) / M * (S / G) / inter.bandwidth)


def with_the_course_model(S, M, G, intra, inter):
    from distlab import cost
    return (cost.predict("ring_reduce_scatter", S, G, intra)
            + cost.predict("ring_all_reduce", S / G, M, inter)
            + cost.predict("ring_all_gather", S, G, intra))


def with_the_reference(S, M, G, intra, inter):
    return ch03._hierarchical_reference(S, M, G, intra, inter)


def two_nodes_hard_coded(S, M, G, intra, inter):      # right on 2 nodes only: a decoy
    return (2 * (G - 1) * intra.alpha + 2 * (G - 1) / G * S / intra.bandwidth
            + 2 * inter.alpha + (S / G) / inter.bandwidth)


def with_a_misnamed_field(S, M, G, intra, inter):     # wrong, and it raises
    return 2 * (G - 1) * intra.latency + 2 * (M - 1) * inter.alpha


def test_hierarchical_estimate_battery():
    said = battery(ch03.check_hierarchical_estimate, correct=[hierarchical_seconds],
                   different=[hierarchical_by_phases],
                   wrong=[whole_tensor_between_nodes, half_the_steps, with_a_misnamed_field],
                   cheat=[with_the_course_model, with_the_reference],
                   decoy=[two_nodes_hard_coded])
    assert said["wrong"][2].startswith("with_a_misnamed_field(4096, 2, 4) (with its two links) "
                                       "raised AttributeError: 'Link' object has no attribute "
                                       "'latency'")
    assert ("S = 67108864 B on 4 nodes × 8 GPUs: your estimate has the inter-node latency term "
            "wrong — it counts 2·α_inter, the algorithm pays 2(M-1) = 6·α_inter"
            in said["decoy"][0])


def test_hierarchical_estimate_names_the_wrong_term():
    with pytest.raises(CheckFailed, match=r"S = 4096 B on 2 nodes × 4 GPUs: your estimate misses "
                                          r"the intra-node latency term — it counts nothing, the "
                                          r"algorithm pays 2\(G-1\) = 6·α_intra"):
        ch03.check_hierarchical_estimate(flat_ring_between_nodes)
    with pytest.raises(CheckFailed, match=r"has the inter-node bandwidth term wrong — it counts "
                                          r"1·S/B_inter, the algorithm pays 2\(M-1\)/\(M·G\) = "
                                          r"0\.25·S/B_inter \(only this GPU's shard, S/G"):
        ch03.check_hierarchical_estimate(whole_tensor_between_nodes)
    with pytest.raises(CheckFailed, match=r"intra-node latency term wrong — it counts 3·α_intra, "
                                          r"the algorithm pays 2\(G-1\) = 6·α_intra"):
        ch03.check_hierarchical_estimate(half_the_steps)
    with pytest.raises(CheckFailed, match=r"course's own predict; the exercise is to write the "
                                          r"formula yourself"):
        ch03.check_hierarchical_estimate(with_the_course_model)
    with pytest.raises(CheckFailed, match=r"course's own _hierarchical_reference"):
        ch03.check_hierarchical_estimate(with_the_reference)


def test_hierarchical_estimate_stub_is_not_written():
    def hierarchical_seconds(S, M, G, intra, inter):
        raise NotImplementedError("exercise: replace this line with your code")
    with pytest.raises(NotImplementedError, match="is not written yet"):
        ch03.check_hierarchical_estimate(hierarchical_seconds)


def test_no_exercise_statement_dictates_its_algorithm():
    """The statement gives the task, not the algorithm: the indices live in the hints (which
    test_exercises counts)."""
    import pathlib
    import nbformat
    path = (pathlib.Path(__file__).resolve().parent.parent / "solutions"
            / "03_collectives_from_scratch.ipynb")
    for cell in nbformat.read(path, as_version=4).cells:
        if cell.source.startswith("## Exercise"):
            assert "(rank - step" not in cell.source and "mask" not in cell.source


# ---- the chapter's headline numbers, re-computed (stale prose fails) -------------------------------

def _chapter_text():
    import pathlib
    import nbformat
    path = (pathlib.Path(__file__).resolve().parent.parent / "notebooks"
            / "03_collectives_from_scratch.ipynb")
    cells = nbformat.read(path, as_version=4).cells
    return " ".join(c.source for c in cells if c.cell_type == "markdown").replace("\n", " ")


def _published(kind):
    import csv
    import pathlib
    path = pathlib.Path(__file__).resolve().parent.parent / "bench" / "published.csv"
    with open(path, newline="") as f:
        return [r for r in csv.DictReader(f) if r["kind"] == kind]


def test_ch03_latency_floor_and_bandwidth_numbers_are_the_models():
    from distlab import cost, hardware
    text = _chapter_text()
    # section 1: the naive root's bytes for 1 GB on 64 GPUs
    assert cost.terms("naive_all_reduce", 1e9, 64)[1] / 1e9 == 126
    assert "that is 126 GB through one port" in text
    nvlink = hardware.PRESETS["h100-node"].intra
    floor = nvlink.seconds("all_reduce", 8, 8)
    ring = cost.predict("ring_all_reduce", 8, 8, nvlink.alpha_beta())
    assert round(floor * 1e6) == 15 and "about 15 µs whatever their size" in text
    assert round(ring * 1e6) == 70 == 14 * round(nvlink.alpha * 1e6)
    assert "14 message latencies (70 µs)" in text and "a 5 µs message" in text
    assert (nvlink.busbw("all_reduce"), nvlink.busbw("all_gather")) == (480e9, 370e9)
    assert "all-reduce, 480 GB/s; 370 for a plain ring" in text
    # 1 GB sits within 1 % of the lower bound 2(N-1)/N·S/B: "close to the lower bound"
    big = nvlink.seconds("all_reduce", 1 << 30, 8)
    assert big / cost.all_reduce_lower_bound(1 << 30, 8, nvlink.busbw()) < 1.01


def test_ch03_published_rows_sit_where_the_prose_says():
    from distlab import cost, hardware
    text = _chapter_text()
    worst = 0.0
    for r in _published("busbw"):
        if r["use"] != "validation":
            continue
        c = dict(item.split("=", 1) for item in r["config"].split())
        # the large-message rows the prose quotes (the chapter's α-β line; 1-256 MiB messages
        # are bench/fidelity.py's, priced with hardware.measured's size ramp)
        if c.get("op") not in ("all_reduce", "all_gather", "reduce_scatter") \
                or int(c.get("bytes", "0")) < 2**30 or "device" in c:
            continue
        ranks = ([int(x) for x in c["ranks"].split(";")] if ";" in c["ranks"]
                 else list(range(int(c["ranks"]))))
        link = hardware.PRESETS[c["preset"]].link_between(ranks)
        t = link.seconds(c["op"], int(c["bytes"]), len(ranks))
        model = cost.bus_bandwidth("ring_" + c["op"], int(c["bytes"]), len(ranks), t) / 1e9
        worst = max(worst, abs(model / float(r["value"]) - 1))
    assert 0.01 < worst < 0.02 and "land within 2 %" in text
    # the α-β line at 16 MiB against NVIDIA's measured DGX H100 point (the size ramp's anchor)
    nvlink = hardware.PRESETS["h100-node"].intra
    t16 = nvlink.seconds("all_reduce", 16 << 20, 8)
    line = cost.bus_bandwidth("ring_all_reduce", 16 << 20, 8, t16) / 1e9
    measured = [float(r["value"]) for r in _published("busbw")
                if "bytes=16777216 " in r["config"] + " " and "dgxc" in r["source"]]
    assert measured == [237.21] and round(line) == 385
    assert "line says 385 GB/s where the node measures 237" in text
    (latency,) = [r for r in _published("latency") if r["use"] == "validation"
                  and "H20 NVLink 4 node" in r["case"]]
    model = hardware.PRESETS["h100-node"].intra.seconds("all_reduce", 8, 8) * 1e6
    assert round(float(latency["value"]), 1) == 12.5 and round(model) == 15
    assert round(100 * (model / float(latency["value"]) - 1), -1) == 20
    assert "measured at 12.5 µs, is modeled 20 % high at 15 µs" in text
    a100 = hardware.PRESETS["a100-node"]
    ratio = (cost.bus_bandwidth("ring_all_reduce", 1 << 30, 8,
                                a100.ideal().intra.seconds("all_reduce", 1 << 30, 8))
             / cost.bus_bandwidth("ring_all_reduce", 1 << 30, 8,
                                  a100.intra.seconds("all_reduce", 1 << 30, 8)))
    assert round(100 * (ratio - 1), -1) == 30 and "promises 30 % more" in text
    assert "(232.5 GB/s)" in text and "(365.8 GB/s, nccl-tests#309)" in text
    assert {"232.5", "365.8"} <= {r["value"] for r in _published("busbw")}


def test_ch03_across_nodes_and_hierarchical_numbers_are_the_models():
    from distlab import hardware
    text = _chapter_text()
    cluster = hardware.PRESETS["h100-cluster"]
    small = [cluster.link_between(range(n)).seconds("all_reduce", 8, n) for n in (8, 512)]
    assert [round(t * 1e6) for t in small] == [15, 75]
    assert "From one node to 64, a small all-reduce goes from 15 µs to 75 µs" in text
    big = [cluster.link_between(range(n)).seconds("all_reduce", 1 << 30, n) for n in (16, 512)]
    assert big[1] / big[0] < 1.1 and "barely moves from 2 to 64 nodes" in text
    G, M, S = 8, 16, 1 << 30
    inside = cluster.link_between(range(G))
    between = cluster.link_between(range(0, M * G, G))
    hierarchical = (inside.seconds("reduce_scatter", S, G) + inside.seconds("all_gather", S, G)
                    + between.seconds("all_reduce", S / G, M))
    one_nic = hardware.Cluster("one NIC per node", cluster.device, cluster.intra, cluster.inter,
                               G, nics_per_node=1).link_between(range(M * G))
    flat = cluster.link_between(range(M * G)).seconds("all_reduce", S, M * G)
    assert round(one_nic.seconds("all_reduce", S, M * G) / hierarchical) == 4
    assert "by about 4×" in text
    assert flat < hierarchical and "NCCL does better still" in text


def _emulated_ring(rank, world_size, sizes):
    out = []
    for nbytes in sizes:
        x = torch.ones(nbytes // 4)
        dist.barrier()
        began = distlab.trace.now()
        collectives.ring_all_reduce(x)
        out.append(distlab.trace.now() - began)
    return out


def test_ch03_the_emulated_fit_finds_the_bandwidth_and_an_alpha_with_the_ops_in_it():
    # Section 7: the same few tens of µs left over at every size are the ring's own ops (its
    # receive buffer and N-1 additions) at the launch floor; the fit finds B, and a larger α.
    from distlab import cost, emulate
    sizes = [4 << 10, 1 << 20, 8 << 20]
    cluster = emulate.PRESETS["a100-ethernet"]
    link = cluster.inter.alpha_beta()
    res = distlab.run(_emulated_ring, 4, sizes, emulate="a100-ethernet")
    times = [max(r[i] for r in res) for i in range(len(sizes))]
    left = [t - cost.predict("ring_all_reduce", s, 4, link) for s, t in zip(sizes, times)]
    assert all(x == pytest.approx(4 * cluster.device.floor, rel=0.02) for x in left)
    fitted = cost.fit([("ring_all_reduce", s, 4, t) for s, t in zip(sizes, times)])
    assert fitted.bandwidth == pytest.approx(link.bandwidth, rel=0.03)
    assert fitted.alpha > 1.4 * link.alpha
    text = _chapter_text()
    assert "the same few tens of µs are left over at every size" in text
    assert "the N-1 = 3 additions of the reduce-scatter" in text


# ---- the chapter's timeline: every label readable ------------------------------------------------

def _ring_like_trace(world_size=4, steps=6):
    """A trace shaped like c47's ring: every step a send right and a receive left at the same
    time, between the additions (no ranks launched)."""
    from distlab.trace import Trace
    per_rank = []
    for r in range(world_size):
        events, spans = [], []
        for s in range(steps):
            t0 = 10e-6 + s * 45e-6
            for op, peer in (("send", (r + 1) % world_size), ("recv", (r - 1) % world_size)):
                events.append(dict(kind="comm", op=op, group=tuple(range(world_size)), peer=peer,
                                   tag=0, bytes=1 << 18, dtype="float32", launch=t0, start=t0,
                                   end=t0 + 40e-6, waited=0.0, async_op=True, native=False,
                                   label=None, seq=len(events)))
            spans.append(dict(kind="compute", name="add", start=t0 + 40e-6, end=t0 + 45e-6))
        per_rank.append(dict(rank=r, events=events, spans=spans, end=10e-6 + steps * 45e-6))
    return Trace(per_rank)


@pytest.mark.parametrize("width", [10, 4])
def test_the_timeline_never_draws_a_label_over_another(width):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from distlab.viz import trace as trace_viz
    fig, ax = plt.subplots(figsize=(width, 3))
    trace_viz.timeline(_ring_like_trace(), ax=ax)
    boxes = trace_viz.label_boxes(ax)
    texts = [t.get_text() for t in ax.texts if t.get_gid() == trace_viz.LABEL]
    plt.close(fig)
    assert not any(a.overlaps(b) for i, a in enumerate(boxes) for b in boxes[i + 1:])
    if width == 10:             # room for all: one label per step, the send and receive merged
        assert len(texts) == 24 and texts[:2] == ["→1 ←3", "→1 ←3"]
    assert all("→" in t and "←" in t for t in texts)


def test_ch03_says_what_nccl_runs_for_each_collective():
    text = _chapter_text()
    assert "all-gather and reduce-scatter are rings only" not in text
    for said in ("PAT", "NVIDIA/nccl#1473", "CollNet", "NVLS", "Bidirectional rings",
                 "1.125·S against 1.75·S at N = 8"):
        assert said in text
