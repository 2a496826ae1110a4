"""Chapter 01: the torchrun script under real torchrun, the rendezvous helpers, the checkers."""
import json

import matplotlib
import pytest
import torch
import torch.distributed as dist

import distlab
from distlab import rendezvous
from distlab.checks import CheckFailed, ch01

matplotlib.use("Agg")


# ---- the script under torchrun --------------------------------------------------------------------

def test_hello_torchrun_under_torchrun(tmp_path):
    # One launch proves it all: 3 ranks (odd, so the slices of 101 cannot all be equal), the
    # environment torchrun sets, the sums, rank 0's weights on every rank, the logs in rank order.
    # (Chapter 01 itself runs the two-agent, two-"machine" form.)
    nproc, count = 3, 101
    code, outputs, errors = rendezvous.run_torchrun(
        "distlab.scripts.hello_torchrun", nproc, "--count", count, "--out", tmp_path)
    assert code == 0, errors
    assert sorted(outputs) == list(range(nproc))
    records = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(nproc)]
    expected_chunks = [len(c) for c in torch.arange(count).tensor_split(nproc)]
    assert [r["count"] for r in records] == expected_chunks == [34, 34, 33]
    assert sum(r["partial"] for r in records) == count * (count - 1) // 2
    checkpoint = torch.load(tmp_path / "checkpoint.pt")["weights"]
    for rank, record in enumerate(records):
        assert record["total"] == count * (count - 1) // 2
        env = record["env"]
        assert (env["RANK"], env["LOCAL_RANK"], env["WORLD_SIZE"]) == (str(rank), str(rank),
                                                                       str(nproc))
        assert env["GROUP_RANK"] == "0" and env["TORCHELASTIC_USE_AGENT_STORE"] == "True"
        # rank 0's weights reached every rank exactly
        assert torch.equal(torch.tensor(record["weights"]), checkpoint)
        assert outputs[rank].startswith(f"rank {rank} of {nproc} (local rank {rank})")
    assert f"sum of 0..{count - 1} = {count * (count - 1) // 2} (expected" in outputs[0]
    assert all("rank 0 reports" not in outputs[r] for r in range(1, nproc))


def test_hello_torchrun_explains_itself_without_torchrun(monkeypatch):
    # In this process (a fresh interpreter would spend seconds importing torch to say it).
    from distlab.scripts import hello_torchrun
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(key, raising=False)
    with pytest.raises(SystemExit) as exit_:
        hello_torchrun.main([])
    assert "start it with `torchrun" in str(exit_.value.code)


def test_rank_logs_reads_torchrun_layout(tmp_path):
    for rank, text in [(1, "one\n"), (0, "zero\n"), (10, "ten\n")]:
        folder = tmp_path / "run-id_x" / "attempt_0" / str(rank)
        folder.mkdir(parents=True)
        (folder / "stdout.log").write_text(text)
    assert rendezvous.rank_logs(tmp_path) == {0: ("zero\n", ""), 1: ("one\n", ""),
                                              10: ("ten\n", "")}


# ---- rendezvous helpers --------------------------------------------------------------------------

def toy(rank, world_size):
    return rendezvous.toy_rendezvous(rank, world_size, rendezvous.open_store(rank, world_size))


@pytest.mark.parametrize("world_size", [1, 3, 4])
def test_toy_rendezvous_gives_every_rank_the_same_table(world_size, capsys):
    tables = distlab.run(toy, world_size, init=False)
    assert all(t == tables[0] for t in tables)
    assert sorted(tables[0]) == list(range(world_size))
    assert len(set(tables[0].values())) == world_size
    out = capsys.readouterr().out
    for rank in range(world_size):
        left = (rank - 1) % world_size
        assert f"[rank {rank}] direct socket from the left neighbour: 'hello from rank {left}'" \
            in out


def keys_after_init(rank, world_size):
    dist.init_process_group("gloo", init_method="env://")
    dist.barrier()
    keys = rendezvous.store_keys()
    dist.barrier()      # rank 0 serves the store: nobody may still be reading it when it leaves
    dist.destroy_process_group()
    return keys


@pytest.mark.parametrize("world_size", [2, 3])
def test_store_keys_show_one_gloo_address_per_rank(world_size):
    keys = distlab.run(keys_after_init, world_size, init=False)[0]
    assert sorted(keys) == [f"default_pg/0//cpu//0/{r}" for r in range(world_size)]
    assert all(v.startswith("127.0.0.1:") for v in keys.values())
    assert len(set(keys.values())) == world_size


def test_decode_address_finds_the_sockaddr():
    record = bytes(16) + b"\x02\x00" + (4242).to_bytes(2, "big") + bytes([127, 0, 0, 1]) + bytes(40)
    assert rendezvous.decode_address(record) == "127.0.0.1:4242"
    assert rendezvous.decode_address(b"\x01" * 20) == "(20 bytes)"


@pytest.mark.parametrize("world_size", [1, 2, 5])
def test_rendezvous_picture_draws(world_size):
    import matplotlib.pyplot as plt
    from distlab.viz.rendezvous import rendezvous_sequence
    ax = rendezvous_sequence(world_size)
    assert f"{world_size} ranks" in ax.get_title()
    plt.close("all")


# ---- the workbook's checkers: right answers pass, wrong ones are named --------------------------

def rank_slice(rank, world_size, n):
    base, extra = divmod(n, world_size)
    start = rank * base + min(rank, extra)
    return start, start + base + (rank < extra)


def rank_slice_extra_to_last(rank, world_size, n):
    base, extra = divmod(n, world_size)
    start = rank * base + max(0, rank - (world_size - extra))
    return start, start + base + (rank >= world_size - extra)


def rank_slice_drops_remainder(rank, world_size, n):
    base = n // world_size
    return rank * base, (rank + 1) * base


def stub(*args):
    raise NotImplementedError("exercise: replace this line with your code")


def test_check_rank_slice(capsys):
    ch01.check_rank_slice(rank_slice)
    assert "✅" in capsys.readouterr().out
    with pytest.raises(CheckFailed, match=r"rank=0, world_size=2, n=1\).*expected 1, got 0"):
        ch01.check_rank_slice(rank_slice_extra_to_last)
    with pytest.raises(CheckFailed, match=r"world_size=2, n=1\).*element \[1\]: expected 1, got 0"):
        ch01.check_rank_slice(rank_slice_drops_remainder)
    with pytest.raises(CheckFailed, match="pair of ints"):
        ch01.check_rank_slice(lambda rank, world_size, n: [0.0, 1.0])
    with pytest.raises(NotImplementedError, match="is not written yet"):
        ch01.check_rank_slice(stub)


def share_config(rank, world_size, store, config):
    if rank == 0:
        store.set("config", json.dumps(config))
    return json.loads(store.get("config"))


def share_config_without_waiting(rank, world_size, store, config):
    if rank == 0:
        store.set("config", json.dumps(config))
        return config
    # check() does not wait: rank 0 has not published yet, so this rank gives up
    return json.loads(store.get("config")) if store.check(["config"]) else None


def test_check_share_config(capsys):
    # The full set of world sizes runs in solutions/01 (nbval); here the ones that tell.
    ch01.check_share_config(share_config, world_sizes=(1, 2))
    assert "✅" in capsys.readouterr().out
    with pytest.raises(CheckFailed, match=r"world_size=2: rank 1 returned None, but rank 0's config was \{"):
        ch01.check_share_config(share_config_without_waiting, world_sizes=(2,))
    with pytest.raises(NotImplementedError, match="is not written yet"):
        ch01.check_share_config(stub)


def broadcast_config(rank, world_size, config):
    box = [config]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def test_check_broadcast_config(capsys):
    ch01.check_broadcast_config(broadcast_config)
    assert "✅" in capsys.readouterr().out
    with pytest.raises(CheckFailed, match=r"world_size=2: rank 1 returned None"):
        ch01.check_broadcast_config(lambda rank, world_size, config: config)


def group_sum(rank, world_size, group_size):
    mine = None
    for first in range(0, world_size, group_size):
        ranks = list(range(first, min(first + group_size, world_size)))
        group = dist.new_group(ranks)      # every rank creates every group, in the same order
        if rank in ranks:
            mine = group
    t = torch.tensor([float(rank + 1) ** 2])
    dist.all_reduce(t, group=mine)
    return t.item()


def group_sum_whole_world(rank, world_size, group_size):
    t = torch.tensor([float(rank + 1) ** 2])
    dist.all_reduce(t)
    return t.item()


def test_check_group_sum(capsys):
    ch01.check_group_sum(group_sum, cases=((7, 3), (3, 3)))
    assert "✅" in capsys.readouterr().out
    with pytest.raises(CheckFailed, match=r"world_size=4, group_size=2, rank 0: "
                                          r"expected 5, got 30"):
        ch01.check_group_sum(group_sum_whole_world, cases=((4, 2),))
    with pytest.raises(NotImplementedError, match="is not written yet"):
        ch01.check_group_sum(stub)


# ---- structure and cheats (issue 14) --------------------------------------------------------------

def rank_slice_tensor_split(rank, world_size, n):
    # Differently written: torch.tensor_split's own chunks.
    sizes = [len(c) for c in torch.arange(n).tensor_split(world_size)]
    return sum(sizes[:rank]), sum(sizes[:rank + 1])


def test_check_rank_slice_written_otherwise_and_the_cheat(capsys):
    ch01.check_rank_slice(rank_slice_tensor_split)
    assert "✅" in capsys.readouterr().out
    with pytest.raises(CheckFailed, match="course's own reference_slice; the exercise is to "
                                          "compute the slice yourself"):
        ch01.check_rank_slice(ch01.reference_slice)


def share_config_with_wait(rank, world_size, store, config):
    # Differently written: bytes, and an explicit wait before the get.
    if rank == 0:
        store.set("cfg", json.dumps(config).encode())
    store.wait(["cfg"])
    return json.loads(store.get("cfg").decode())


def test_check_share_config_written_otherwise_and_the_cheat(capsys):
    ch01.check_share_config(share_config_with_wait, world_sizes=(3,))
    assert "✅" in capsys.readouterr().out
    with pytest.raises(CheckFailed, match="course's own config_for"):
        ch01.check_share_config(lambda rank, world_size, store, config: ch01.config_for(world_size),
                                world_sizes=(2,))


def broadcast_config_gathered(rank, world_size, config):
    # Differently written: every rank gathers every rank's object and keeps rank 0's.
    from torch.distributed import all_gather_object
    every = [None] * world_size
    all_gather_object(every, config)
    return every[0]


def broadcast_config_by_messages(rank, world_size, config):
    # Right answer, wrong structure: rank 0 sends it to each rank in turn.
    box = [config]
    if rank == 0:
        for r in range(1, world_size):
            dist.send_object_list(box, dst=r)
    else:
        dist.recv_object_list(box, src=0)
    return box[0]


def test_check_broadcast_config_structure(capsys):
    ch01.check_broadcast_config(broadcast_config_gathered, world_sizes=(3,))
    assert "✅" in capsys.readouterr().out
    with pytest.raises(CheckFailed, match=r"world_size=2: rank 1 got the config, but rank 0 sent "
                                          r"it in 2 point-to-point messages; the exercise is one "
                                          r"collective"):
        ch01.check_broadcast_config(broadcast_config_by_messages, world_sizes=(2,))
    with pytest.raises(CheckFailed, match="course's own config_for"):
        ch01.check_broadcast_config(lambda rank, world_size, config: ch01.config_for(world_size),
                                    world_sizes=(2,))


def group_sum_by_enumeration(rank, world_size, group_size):
    # Differently written: new_subgroups_by_enumeration, an imported all_reduce, ReduceOp.SUM.
    from torch.distributed import ReduceOp, all_reduce
    blocks = [list(range(f, min(f + group_size, world_size)))
              for f in range(0, world_size, group_size)]
    mine, _ = dist.new_subgroups_by_enumeration(blocks)
    t = torch.tensor([float(rank + 1) ** 2])
    all_reduce(t, op=ReduceOp.SUM, group=mine)
    return t.item()


def group_sum_gathered(rank, world_size, group_size):
    # Right answer, wrong structure: every rank gathers the whole world and adds its block.
    values = [torch.zeros(1) for _ in range(world_size)]
    dist.all_gather(values, torch.tensor([float(rank + 1) ** 2]))
    first = rank // group_size * group_size
    return sum(v.item() for v in values[first:first + group_size])


def test_check_group_sum_structure(capsys):
    ch01.check_group_sum(group_sum_by_enumeration, cases=((5, 2),))
    assert "✅" in capsys.readouterr().out
    with pytest.raises(CheckFailed, match=r"world_size=4, group_size=2: rank 0's block is ranks "
                                          r"\[0, 1\], but its all_gather ran over ranks "
                                          r"\[0, 1, 2, 3\]; make a group of exactly the block"):
        ch01.check_group_sum(group_sum_gathered, cases=((4, 2),))
    with pytest.raises(CheckFailed, match="course's own reference_group_sum"):
        ch01.check_group_sum(ch01.reference_group_sum, cases=((4, 2),))
