"""Chapter 01: the torchrun script under real torchrun, the rendezvous helpers, the checkers."""
import json

import matplotlib
import pytest
import torch
import torch.distributed as dist

import distlab
from distlab import rendezvous
from checker_battery import battery
from distlab.checks import ch01

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


# ---- the workbook's checkers, through the battery (tests/checker_battery.py) --------------------

def rank_slice(rank, world_size, n):
    base, extra = divmod(n, world_size)
    start = rank * base + min(rank, extra)
    return start, start + base + (rank < extra)


def rank_slice_by_counting(rank, world_size, n):
    # Differently written: deal the items out one by one and count where this rank's begin.
    sizes = [0] * world_size
    for i in range(n):
        sizes[i % world_size] += 1
    start = sum(sizes[:rank])
    return start, start + sizes[rank]


def rank_slice_extra_to_last(rank, world_size, n):
    base, extra = divmod(n, world_size)
    start = rank * base + max(0, rank - (world_size - extra))
    return start, start + base + (rank >= world_size - extra)


def rank_slice_tensor_split(rank, world_size, n):
    sizes = [len(c) for c in torch.arange(n).tensor_split(world_size)]
    return sum(sizes[:rank]), sum(sizes[:rank + 1])


def rank_slice_proportional(rank, world_size, n):
    # Balanced (sizes differ by at most one) and right whenever world_size divides n; but the
    # extra items land on the wrong ranks.
    return rank * n // world_size, (rank + 1) * n // world_size


def stub(*args):
    raise NotImplementedError("exercise: replace this line with your code")


def test_rank_slice_battery():
    said = battery(ch01.check_rank_slice, correct=[rank_slice], different=[rank_slice_by_counting],
                   wrong=[rank_slice_extra_to_last],
                   cheat=[rank_slice_tensor_split, ch01.reference_slice],
                   decoy=[rank_slice_proportional])
    assert "library's splitter" in said["cheat"][0]
    assert "course's own reference_slice" in said["cheat"][1]
    with pytest.raises(NotImplementedError, match="is not written yet"):
        ch01.check_rank_slice(stub)


def share_config(rank, world_size, store, config):
    if rank == 0:
        store.set("config", json.dumps(config))
    return json.loads(store.get("config"))


def share_config_with_wait(rank, world_size, store, config):
    # Differently written: bytes, and an explicit wait before the get.
    if rank == 0:
        store.set("cfg", json.dumps(config).encode())
    store.wait(["cfg"])
    return json.loads(store.get("cfg").decode())


def share_config_without_waiting(rank, world_size, store, config):
    if rank == 0:
        store.set("config", json.dumps(config))
        return config
    # check() does not wait: rank 0 has not published yet, so this rank gives up
    return json.loads(store.get("config")) if store.check(["config"]) else None


def share_config_drawn_again(rank, world_size, store, config):
    return ch01.draw_config(world_size, 0)


def share_config_read_once(rank, world_size, store, config):
    # Treats the key as a message consumed by its reader: right with one reader (two ranks),
    # a hang as soon as a second rank comes to read.
    if rank == 0:
        store.set("config", json.dumps(config))
        return config
    got = json.loads(store.get("config"))
    store.delete_key("config")
    return got


def test_share_config_battery():
    said = battery(ch01.check_share_config, correct=[share_config],
                   different=[share_config_with_wait], wrong=[share_config_without_waiting],
                   cheat=[share_config_drawn_again], decoy=[share_config_read_once],
                   call=lambda check, fn: check(fn, world_sizes=(3,)))
    assert "course's own draw_config" in said["cheat"][0]
    assert "world_size=3" in said["decoy"][0]


def broadcast_config(rank, world_size, config):
    data = json.dumps(config).encode() if rank == 0 else b""
    length = torch.tensor([len(data)])
    dist.broadcast(length, src=0)
    payload = (torch.frombuffer(bytearray(data), dtype=torch.uint8) if rank == 0
               else torch.empty(int(length), dtype=torch.uint8))
    dist.broadcast(payload, src=0)
    return json.loads(bytes(payload.tolist()))


def broadcast_config_by_messages(rank, world_size, config):
    # Differently written: rank 0 sends the length and the bytes to each rank in turn.
    import pickle
    if rank == 0:
        data = torch.tensor(list(pickle.dumps(config)), dtype=torch.uint8)
        for r in range(1, world_size):
            dist.send(torch.tensor([data.numel()]), dst=r)
            dist.send(data, dst=r)
        return config
    n = torch.zeros(1, dtype=torch.int64)
    dist.recv(n, src=0)
    data = torch.empty(int(n), dtype=torch.uint8)
    dist.recv(data, src=0)
    return pickle.loads(bytes(data.tolist()))


def broadcast_config_object_list(rank, world_size, config):
    box = [config]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def broadcast_config_own(rank, world_size, config):
    return config


def broadcast_config_fixed_buffer(rank, world_size, config):
    # A buffer of a guessed size: right for every small config, wrong for a long one.
    buffer = torch.zeros(4096, dtype=torch.uint8)
    if rank == 0:
        data = json.dumps(config).encode()[:4096]
        buffer[:len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    dist.broadcast(buffer, src=0)
    text = bytes(buffer.tolist()).rstrip(b"\0").decode(errors="replace")
    try:
        return json.loads(text)
    except ValueError:
        return text


def test_broadcast_config_battery():
    said = battery(ch01.check_broadcast_config, correct=[broadcast_config],
                   different=[broadcast_config_by_messages], wrong=[broadcast_config_own],
                   cheat=[broadcast_config_object_list], decoy=[broadcast_config_fixed_buffer],
                   call=lambda check, fn: check(fn, world_sizes=(2, 3)))
    assert "dist.broadcast_object_list" in said["cheat"][0]
    assert "world_size=3" in said["decoy"][0]


def block_sum(rank, world_size, group_size, value):
    mine = None
    for first in range(0, world_size, group_size):
        ranks = list(range(first, min(first + group_size, world_size)))
        group = dist.new_group(ranks)
        if rank in ranks:
            mine = group
    t = torch.tensor([float(value)])
    dist.all_reduce(t, group=mine)
    return t.item()


def block_sum_by_enumeration(rank, world_size, group_size, value):
    # Differently written: new_subgroups_by_enumeration and an all_gather inside the block.
    blocks = [list(range(f, min(f + group_size, world_size)))
              for f in range(0, world_size, group_size)]
    mine, _ = dist.new_subgroups_by_enumeration(blocks)
    size = dist.get_world_size(mine)
    every = [torch.zeros(1) for _ in range(size)]
    dist.all_gather(every, torch.tensor([float(value)]), group=mine)
    return sum(t.item() for t in every)


def block_sum_strided(rank, world_size, group_size, value):
    # Blocks of every n-th rank instead of consecutive ranks.
    n_blocks = -(-world_size // group_size)
    groups = [dist.new_group(list(range(b, world_size, n_blocks))) for b in range(n_blocks)]
    t = torch.tensor([float(value)])
    dist.all_reduce(t, group=groups[rank % n_blocks])
    return t.item()


def block_sum_reference(rank, world_size, group_size, value):
    return ch01.reference_slice(rank, world_size, group_size)[0] + value


def block_sum_over_the_world(rank, world_size, group_size, value):
    # The right numbers from one all_reduce over every rank: each rank's value in its block's
    # slot. Every value went to every rank.
    n_blocks = -(-world_size // group_size)
    slots = torch.zeros(n_blocks)
    slots[rank // group_size] = value
    dist.all_reduce(slots)
    return slots[rank // group_size].item()


def test_block_sum_battery():
    said = battery(ch01.check_block_sum, correct=[block_sum], different=[block_sum_by_enumeration],
                   wrong=[block_sum_strided], cheat=[block_sum_reference],
                   decoy=[block_sum_over_the_world],
                   call=lambda check, fn: check(fn, cases=((3, 2), (5, 2))))
    assert "ran over ranks [0, 1, 2]" in said["decoy"][0]
    assert "checker's own reference_slice" in said["cheat"][0]


def train(folder, steps, step):
    import os
    dist.init_process_group("gloo")
    path = os.path.join(folder, "checkpoint.pt")
    state, start = torch.zeros(4), 0
    if os.path.exists(path):
        saved = torch.load(path)
        state, start = saved["state"], saved["next_step"]
    for i in range(start, steps):
        state = step(state, i)
        if dist.get_rank() == 0:
            torch.save({"state": state, "next_step": i + 1}, path + ".tmp")
            os.replace(path + ".tmp", path)
        dist.barrier()
    dist.destroy_process_group()
    return state


def train_every_other_step(folder, steps, step):
    # Differently written: json, a checkpoint every second step, the restart count read.
    import os
    dist.init_process_group(backend="gloo", init_method="env://")
    path = os.path.join(folder, "ckpt.json")
    state, start = torch.zeros(4, dtype=torch.float64), 0
    if int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0:
        with open(path) as f:
            saved = json.load(f)
        state, start = torch.tensor(saved["state"], dtype=torch.float64), saved["step"]
    for i in range(start, steps):
        state = step(state, i)
        if i % 2 == 1 and dist.get_rank() == 0:
            with open(path + ".tmp", "w") as f:
                json.dump({"state": state.tolist(), "step": i + 1}, f)
            os.replace(path + ".tmp", path)
        dist.barrier()
    return state


def train_skips_a_step(folder, steps, step):
    import os
    dist.init_process_group("gloo")
    path = os.path.join(folder, "checkpoint.pt")
    state, start = torch.zeros(4), 0
    if os.path.exists(path):
        saved = torch.load(path)
        state, start = saved["state"], saved["next_step"] + 1
    for i in range(start, steps):
        state = step(state, i)
        if dist.get_rank() == 0:
            torch.save({"state": state, "next_step": i + 1}, path)
        dist.barrier()
    return state


def train_from_the_reference(folder, steps, step):
    return ch01._reference_training([], steps)


def train_from_scratch(folder, steps, step):
    # Ends with the right state after the restart, by running every step again.
    dist.init_process_group("gloo")
    state = torch.zeros(4)
    for i in range(steps):
        state = step(state, i)
    return state


def test_resumable_training_battery():
    said = battery(ch01.check_resumable_training, correct=[train],
                   different=[train_every_other_step], wrong=[train_skips_a_step],
                   cheat=[train_from_the_reference], decoy=[train_from_scratch],
                   call=lambda check, fn: check(fn, cases=((3, 5, 2),)))
    assert "began again at step 0" in said["decoy"][0]
    assert "own _reference_training" in said["cheat"][0]
    assert "step 2 never completed" in said["wrong"][0]
