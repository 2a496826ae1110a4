"""Workbook 00's checkers through the battery (tests/checker_battery.py): the solution and a
differently-written one pass; a wrong answer, a cheat (the course's own formulas, the checker's
own data) and a decoy (right on the obvious case only) are each refused in one sentence."""
import math

import torch
import torch.distributed as dist

from checker_battery import battery
from distlab import memory, nan_debug
from distlab.checks import ch00


# ---- exercise 1: the fewest GPUs ------------------------------------------------------------

def fewest_gpus(n_params, sharded, gpu_gb=80):
    per = {"weights": 2, "grads": 2, "optimizer": 12}
    capacity = gpu_gb * 1e9
    copied = sum(b for p, b in per.items() if p not in sharded) * n_params
    split = sum(b for p, b in per.items() if p in sharded) * n_params
    if split == 0:
        return 1 if copied <= capacity else None
    if copied >= capacity:
        return None
    return max(1, math.ceil(split / (capacity - copied)))


def fewest_gpus_by_search(n_params, sharded, gpu_gb=80):
    # Differently written: try d = 1, 2, ... and stop when adding GPUs no longer helps.
    per_param = dict(weights=2, grads=2, optimizer=12)
    def per_gpu(d):
        return sum(b * n_params / (d if p in sharded else 1) for p, b in per_param.items())
    floor = sum(b * n_params for p, b in per_param.items() if p not in sharded)
    if floor > gpu_gb * 1e9 or (floor == gpu_gb * 1e9 and sharded):
        return None
    d = 1
    while per_gpu(d) > gpu_gb * 1e9:
        d += 1
    return d


def fewest_gpus_forgets_the_copies(n_params, sharded, gpu_gb=80):
    split = sum({"weights": 2, "grads": 2, "optimizer": 12}[p] for p in sharded) * n_params
    return max(1, math.ceil(split / (gpu_gb * 1e9)))


def fewest_gpus_course_code(n_params, sharded, gpu_gb=80):
    stage = {0: 0, 1: 1, 2: 2, 3: 3}[len(sharded)]
    for d in range(1, 10_000):
        if sum(memory.model_state_bytes(n_params, zero_stage=stage, world_size=d).values()) \
                <= gpu_gb * 1e9:
            return d
    return None


def fewest_gpus_everything_sharded(n_params, sharded, gpu_gb=80):
    # Right when every part is sharded (16 bytes split d ways), whatever `sharded` says.
    return math.ceil(16 * n_params / (gpu_gb * 1e9))


def test_fewest_gpus_battery():
    said = battery(ch00.check_fewest_gpus, correct=[fewest_gpus],
                   different=[fewest_gpus_by_search], wrong=[fewest_gpus_forgets_the_copies],
                   cheat=[fewest_gpus_course_code], decoy=[fewest_gpus_everything_sharded])
    assert "course's own model_state_bytes" in said["cheat"][0]
    assert "return None" in said["decoy"][0] or "expected" in said["decoy"][0]


def test_fewest_gpus_cases_avoid_exact_boundaries_and_cover_none():
    answers = [ch00._fewest(*case) for case in ch00.GPU_CASES]
    assert None in answers and 1 in answers and max(a for a in answers if a) > 10
    assert len(ch00.GPU_CASES) > 40
    # 7B: nothing sharded does not fit 80 GB; the optimizer states alone sharded need 2 GPUs
    assert ch00._fewest(7e9, frozenset(), 80) is None
    assert ch00._fewest(7e9, frozenset({"optimizer"}), 80) == 2


# ---- exercise 2: attention's share ------------------------------------------------------------

def attention_share(n_params, layers, hidden, seq_len):
    attention = 3 * (4 * seq_len * hidden) * layers
    return attention / (6 * n_params + attention)


def attention_share_forward_only(n_params, layers, hidden, seq_len):
    # Differently written: forward FLOPs only; the backward's factor 3 cancels in the ratio.
    per_token = 2 * n_params + layers * (2 * hidden * seq_len + 2 * seq_len * hidden)
    return 1 - 2 * n_params / per_token


def attention_share_scores_only(n_params, layers, hidden, seq_len):
    attention = 6 * layers * hidden * seq_len            # forgot the weighted sum
    return attention / (6 * n_params + attention)


def attention_share_course_code(n_params, layers, hidden, seq_len):
    total = nan_debug.flops_per_token(n_params, layers, hidden, seq_len)
    return 1 - 6 * n_params / total


def attention_share_weights_as_12lh2(n_params, layers, hidden, seq_len):
    # Right only when the model has no parameters outside its blocks (N = 12·L·h²).
    return seq_len / (6 * hidden + seq_len)


def test_attention_share_battery():
    said = battery(ch00.check_attention_share, correct=[attention_share],
                   different=[attention_share_forward_only],
                   wrong=[attention_share_scores_only], cheat=[attention_share_course_code],
                   decoy=[attention_share_weights_as_12lh2])
    assert "course's own flops_per_token" in said["cheat"][0]


def test_the_decoy_is_right_on_the_obvious_model():
    # The decoy's premise: a model whose parameters are all in its blocks.
    n = 12 * 32 * 4096 ** 2
    assert math.isclose(attention_share_weights_as_12lh2(n, 32, 4096, 4096),
                        ch00._attention_share(n, 32, 4096, 4096))


# ---- exercise 3: the mean across ranks --------------------------------------------------------

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


def global_mean_own(local):
    return local.mean().item()


def global_mean_from_the_checkers_data(local):
    shards = ch00._draw_shards(dist.get_world_size(), 0)
    return torch.cat(shards).mean().item()


def global_mean_of_means(local):
    # Right when every rank holds as many numbers as the others; the shards here are uneven.
    m = torch.tensor([local.mean().item() if len(local) else 0.0], dtype=torch.float64)
    dist.all_reduce(m)
    return m.item() / dist.get_world_size()


def test_global_mean_battery():
    said = battery(ch00.check_global_mean, correct=[global_mean], different=[global_mean_gathered],
                   wrong=[global_mean_own], cheat=[global_mean_from_the_checkers_data],
                   decoy=[global_mean_of_means],
                   call=lambda check, fn: check(fn, world_sizes=(1, 3)))
    assert "checker's own" in said["cheat"][0] or "course's own" in said["cheat"][0]


def test_shards_are_uneven_and_fresh():
    a, b = ch00._draw_shards(4, 1), ch00._draw_shards(4, 2)
    assert len({len(s) for s in a}) > 1 and sum(map(len, a))
    assert [s.tolist() for s in a] != [s.tolist() for s in b]


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
    # FLOP per byte on an H100: ~260 (HBM), ~2,100 (NVLink), ~17,000 (NIC), NIC/NVLink ~8 (the
    # best measured matmul, MAMF 794.5 TFLOP/s, over the achieved rates)
    achieved = hw.H100.peak(torch.bfloat16) * hw.H100.gemm_efficiency(8192, 8192, 8192)
    hbm, nvl, nic = (achieved / bw for bw in (hw.H100.memory_bandwidth, hw.NVLINK4.bandwidth,
                                             hw.IB_NDR.bandwidth))
    assert round(hbm, -1) == 260 and round(nvl, -2) == 2100 and round(nic, -3) == 17000
    assert round(nic / nvl) == 8 and round(3 * hbm, -1) == 790
    import json
    import pathlib
    chapter = pathlib.Path(__file__).resolve().parent.parent / "notebooks" / \
        "00_why_distributed.ipynb"
    text = " ".join("".join(c["source"]) for c in json.loads(chapter.read_text())["cells"]
                    if c["cell_type"] == "markdown")
    for said in ("about 260 bf16 FLOPs", "from `n ≈ 790`", "About 2,100 FLOPs per byte",
                 "About 17,000 FLOPs per byte"):
        assert said in text, said
    # GPT-3's batch: ~1,560 sequences; a tenth of one per rank at 16,384 ranks
    sequences = 3.2e6 / 2048
    assert round(sequences, -1) == 1560 and round(sequences / 16384, 2) == 0.10
    # the workbook's afterwords: attention ~7 % of a 7B model's FLOPs at 2k, over half at 32k
    assert round(ch00._attention_share(7e9, 32, 4096, 2048), 2) == 0.07
    assert ch00._attention_share(7e9, 32, 4096, 32768) > 0.5
