"""distlab.nccl_debug on real NCCL_DEBUG=INFO logs from public threads (tests/data/nccl_debug, each
with its thread in SOURCES.md), and under Hypothesis: the order of the lines and the noise between
them do not change the summary, and garbage gets the one sentence (ValueError), nothing else."""
import random
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from distlab.nccl_debug import NOT_A_LOG, Connection, diagnose, read, summary

LOGS = Path(__file__).parent / "data" / "nccl_debug"
FAST = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
TEXTS = {p.name: p.read_text() for p in sorted(LOGS.glob("*.txt"))}


def test_every_shipped_log_has_its_source():
    sources = (LOGS / "SOURCES.md").read_text()
    assert TEXTS and all(f"`{name}`" in sources for name in TEXTS)


def test_one_node_of_eight_rtx_4090_goes_through_shm():
    log = read(TEXTS["p2p_off_8x4090.txt"])
    assert log.versions == () and log.hosts == ("node031",) and log.channels == 2
    assert sorted(log.ranks) == list(range(8))
    assert all(info["device"] == r for r, info in log.ranks.items())
    assert log.transports == {"SHM": 9}
    assert Connection(1, 2, 3, "SHM", "direct/direct", False, None, "node031") in log.connections
    assert log.trees == {0: {0: -1, 6: 5}, 1: {0: -1, 6: 5}}
    assert log.rings == {}                 # only ranks 0 and 6 printed their ring neighbours
    found = diagnose(log)
    assert len(found) == 1 and "through host memory (SHM)" in found[0]
    assert found[0].startswith("Ranks 0→1, 1→2, 2→3 and 5 more on one node")


def test_two_h20_nodes_use_infiniband_with_gdr_and_p2p_inside():
    log = read(TEXTS["ib_two_nodes_h20.txt"])
    assert (log.nranks, log.nnodes, log.channels) == (4, 2, 8)
    assert log.hosts == ("H20-GPU-05", "H20-GPU-06")
    assert {r: (i["host"], i["device"], i["bus_id"]) for r, i in log.ranks.items()} == {
        0: ("H20-GPU-05", 0, "18000"), 1: ("H20-GPU-05", 1, "38000"),
        2: ("H20-GPU-06", 0, "18000"), 3: ("H20-GPU-06", 1, "38000")}
    assert log.transports == {"NET/IB": 9, "P2P": 5}
    assert all(c.gdr for c in log.connections if c.transport == "NET/IB")
    assert {c.via for c in log.connections if c.transport == "P2P"} == {"CUMEM"}
    assert (log.ranks[2]["nics"], log.ranks[3]["nics"]) == ((("NET/IB", 3),), (("NET/IB", 2),))
    assert log.trees[1] == {0: 1, 1: -1} and log.trees[5] == {0: 1, 1: 3}
    assert diagnose(log) == ["Every connection is P2P inside a node or InfiniBand with GPUDirect "
                             "RDMA across nodes: the transports are the fast ones."]


def test_the_second_node_of_a_socket_fallback():
    log = read(TEXTS["socket_fallback_2x8.txt"])
    assert (log.nranks, log.channels, log.hosts) == (16, 8, ("<cluster_name>",))
    assert sorted(log.ranks) == list(range(8, 16))
    assert log.ranks[8]["bus_id"] == "7000" and log.ranks[8]["nics"] == (("NET/Socket", 0),)
    assert log.ranks[15]["nics"] == (("NET/Socket", 3),)
    assert log.transports == {"NET/Socket": 6, "P2P": 17}
    assert {c.via for c in log.connections if c.transport == "P2P"} == {"IPC/read"}
    assert len(log.warnings) == 3 and any("Connection closed by remote peer" in w
                                          for w in log.warnings)
    found = diagnose(log)
    assert found[0].startswith("Ranks 0→8, 8→0, 15→6 talk over NET/Socket (TCP), not InfiniBand")
    assert "NCCL_SOCKET_IFNAME" in found[0] and "NCCL_IB_HCA" in found[0]
    assert "3 warning line(s)" in found[1]
    assert found[2].startswith("The log shows 8 of 16 ranks")


# Lines as NCCL prints them, quoted from public threads: NVIDIA/nccl-tests#185 (version, NET/IB),
# NVIDIA/nccl#1052 (NCCL_IB_HCA), tinygrad/open-gpu-kernel-modules#17 (version inside INFO).
QUOTED = """NCCL version 2.19.3+cuda12.3
dgxh100-4:460770:460842 [0] NCCL INFO NET/IB : Using [0]mlx5_10:1/RoCE [1]mlx5_11:1/RoCE [RO]; OOB enp220s0np0:11.1.128.136<0>
dgxh100-4:460770:460842 [0] NCCL INFO Using network IB
node2:14159:14168 [0] NCCL INFO NCCL_IB_HCA set to mlx5_4
ubuntu11:103631:103631 [0] NCCL INFO NCCL version 2.23.4+cuda12.4
"""


def test_versions_nics_and_settings_echoed():
    log = read(QUOTED + "x:1:2 [0] NCCL INFO NCCL_ALGO set by environment to Ring\n")
    assert log.versions == ("2.19.3+cuda12.3", "2.23.4+cuda12.4")
    assert log.nics == {"dgxh100-4 (IB)": {0: "mlx5_10:1/RoCE", 1: "mlx5_11:1/RoCE"}}
    assert log.networks == {"dgxh100-4": "IB"}
    assert log.env == {"NCCL_ALGO": "Ring", "NCCL_IB_HCA": "mlx5_4"}
    found = diagnose(log)
    assert found[0].startswith("The ranks run different NCCL versions (2.19.3+cuda12.3, 2.23.4")
    assert found[1].startswith("NCCL_ALGO=Ring is forced by the environment")


@pytest.mark.parametrize("bad", ["", "hello\nworld", b"\x00\xff", None, 3, "NCCL is great"])
def test_not_a_log_gets_the_sentence(bad):
    with pytest.raises(ValueError) as e:
        read(bad)
    assert str(e.value) == NOT_A_LOG and "NCCL_DEBUG=INFO" in NOT_A_LOG


NOISE = st.lists(st.text(max_size=60).filter(lambda s: "NCCL" not in s), max_size=12)


@FAST
@given(name=st.sampled_from(sorted(TEXTS)), noise=NOISE, seed=st.integers(0, 2**32))
def test_shuffled_lines_among_noise_read_the_same(name, noise, seed):
    lines = TEXTS[name].splitlines() + [n for s in noise for n in s.splitlines()]
    random.Random(seed).shuffle(lines)
    mixed = read("\n".join(lines))
    assert mixed == read(TEXTS[name])
    assert diagnose(mixed) == diagnose(read(TEXTS[name]))


@FAST
@given(data=st.data())
def test_garbage_and_garbled_logs_get_the_sentence_or_a_summary(data):
    base = data.draw(st.sampled_from(sorted(TEXTS)))
    lines = TEXTS[base].splitlines()
    text = data.draw(st.one_of(
        st.text(max_size=300),
        st.lists(st.sampled_from(lines).flatmap(
            lambda line: st.tuples(st.just(line), st.integers(0, len(line)),
                                   st.integers(0, len(line)), st.text(max_size=8))),
            max_size=20).map(lambda cuts: "\n".join(l[:a] + t + l[b:] for l, a, b, t in cuts))))
    try:
        log = read(text)
    except ValueError as e:
        assert str(e) == NOT_A_LOG
        return
    assert isinstance(diagnose(log), list) and isinstance(summary(log), str)
