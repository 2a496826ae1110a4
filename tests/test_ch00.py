"""Workbook 00's checkers: right answers written two ways pass; wrong answers, a cheat (the
course's own formulas, the checker's reference) and a mean that never communicates are refused."""
import pytest
import torch
import torch.distributed as dist

from distlab import memory
from distlab.checks import CheckFailed, ch00


def model_states_gb(n):
    return {"weights": 2 * n / 1e9, "grads": 2 * n / 1e9, "optimizer": 12 * n / 1e9}


def model_states_gb_per_byte(n):
    # Differently written: bytes per parameter first, then GB.
    per = {"weights": 2, "grads": 2, "optimizer": 4 + 4 + 4}
    return {k: v * n / 10 ** 9 for k, v in per.items()}


def test_model_states_gb(capsys):
    ch00.check_model_states_gb(model_states_gb)
    ch00.check_model_states_gb(model_states_gb_per_byte)
    assert capsys.readouterr().out.count("✅") == 2
    # Wrong: the fp32 master copy forgotten (Adam's two moments only).
    with pytest.raises(CheckFailed, match=r"model_states_gb\(1.3e\+09\).*'optimizer'\]: "
                                          r"expected 15.6, got 10.4"):
        ch00.check_model_states_gb(lambda n: {"weights": 2 * n / 1e9, "grads": 2 * n / 1e9,
                                              "optimizer": 8 * n / 1e9})
    with pytest.raises(CheckFailed, match="course's own model_state_bytes; the exercise is to do "
                                          "the byte arithmetic yourself"):
        ch00.check_model_states_gb(
            lambda n: {k: v / 1e9 for k, v in
                       memory.model_state_bytes(n, "bf16-mixed", "adam").items()})


def test_training_days(capsys):
    ch00.check_training_days(lambda n, d, g, f, m: 6 * n * d / (g * f * m) / 86400)
    assert "✅" in capsys.readouterr().out
    with pytest.raises(CheckFailed, match=r"training_days\(1.75e\+11.*expected"):
        ch00.check_training_days(lambda n, d, g, f, m: 6 * n * d / (g * f) / 86400)  # no MFU
    with pytest.raises(CheckFailed, match="course's own training_days"):
        ch00.check_training_days(memory.training_days)


def global_mean(local):
    total = torch.stack([local.sum(), torch.tensor(float(local.numel()), dtype=local.dtype)])
    dist.all_reduce(total)
    return (total[0] / total[1]).item()


def global_mean_gathered(local):
    # Differently written: an imported all_gather of every rank's (sum, count).
    from torch.distributed import all_gather
    mine = torch.tensor([local.sum().item(), float(len(local))], dtype=torch.float64)
    every = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    all_gather(every, mine)
    both = torch.stack(every).sum(0)
    return (both[0] / both[1]).item()


def global_mean_without_communicating(local):
    # Rebuilds the other ranks' numbers from the checker's recipe: right, and no collective.
    ws = dist.get_world_size()
    data = [torch.randn(r + 2, generator=torch.Generator().manual_seed(1000 + r),
                        dtype=torch.float64) for r in range(ws)]
    return torch.cat(data).mean().item()


def test_global_mean(capsys):
    ch00.check_global_mean(global_mean, world_sizes=(1, 3))
    ch00.check_global_mean(global_mean_gathered, world_sizes=(3,))
    assert capsys.readouterr().out.count("✅") == 2
    with pytest.raises(CheckFailed, match=r"world_size=2, rank 0 returned its own local mean"):
        ch00.check_global_mean(lambda local: local.mean().item(), world_sizes=(2,))
    with pytest.raises(CheckFailed, match=r"world_size=2, rank 0 returned the right number "
                                          r"without a collective over all the ranks"):
        ch00.check_global_mean(global_mean_without_communicating, world_sizes=(2,))
    with pytest.raises(CheckFailed, match="course's own _reference_global_mean"):
        ch00.check_global_mean(
            lambda local: ch00._reference_global_mean(0, dist.get_world_size()), world_sizes=(2,))


# ---- the numbers chapter 00's prose quotes, recomputed (stale text fails) --------------------------

def test_chapter_00_numbers():
    from distlab import hardware as hw
    # activations of a 7B shape, one sequence: "a sixth" of the states at 4k, "eight times" at 32k,
    # and then more than the states
    states = sum(memory.model_state_bytes(7e9).values())
    act = {s: memory.activation_bytes(seq_len=s, batch=1, hidden=4096, layers=32, heads=32)
           for s in (4096, 32768)}
    assert round(states / act[4096]) == 6 and round(act[32768] / act[4096]) == 8
    assert act[32768] > states
    # FLOP per byte on an H100: ~280 (HBM), ~2,300 (NVLink), ~18,000 (NIC), NIC/NVLink ~8
    achieved = hw.H100.peak(torch.bfloat16) * hw.H100.gemm_efficiency(8192, 8192, 8192)
    hbm, nvl, nic = (achieved / bw for bw in (hw.H100.memory_bandwidth, hw.NVLINK4.bandwidth,
                                             hw.IB_NDR.bandwidth))
    assert round(hbm, -1) == 280 and round(nvl, -2) == 2300 and round(nic, -3) == 18000
    assert round(nic / nvl) == 8 and round(3 * hbm, -1) == 850
    # GPT-3's batch: ~1,560 sequences; a tenth of one per rank at 16,384 ranks
    sequences = 3.2e6 / 2048
    assert round(sequences, -1) == 1560 and round(sequences / 16384, 2) == 0.10
