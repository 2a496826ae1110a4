"""Every checker of workbooks 07 and 08 through the battery (tests/checker_battery.py): it accepts
the workbook's solution and a differently-written one, and refuses a wrong answer, a cheat and a
decoy, each in one sentence. The group-taking checkers of 07 run on real subgroups (4 ranks as
two groups of 2; 5 ranks as [1, 3] and [0, 2, 4]), so a decoy that talks to the whole world —
right on a world-only check — is among the refused."""
import math

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed import ReduceOp

from checker_battery import battery
from distlab import tp_comm
from distlab.checks import ch07, ch08


# ==== workbook 07, exercise 1: the sequence-parallel pair =========================================

def _gather_rows(x, group):            # the workbook's way: the sequence first, one collective
    n = dist.get_world_size(group)
    rows = x.transpose(0, 1).contiguous()
    out = rows.new_empty((n * rows.shape[0], *rows.shape[1:]))
    dist.all_gather_single(out, rows, group=group)
    return out.transpose(0, 1)


def _scatter_rows(x, group):
    n = dist.get_world_size(group)
    rows = x.transpose(0, 1).contiguous()
    mine = rows.new_empty((rows.shape[0] // n, *rows.shape[1:]))
    dist.reduce_scatter_single(mine, rows, group=group)
    return mine.transpose(0, 1)


class GatherF(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _gather_rows(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _scatter_rows(grad, ctx.group), None


class ScatterF(torch.autograd.Function):
    @staticmethod
    def forward(ctx, partial, group):
        ctx.group = group
        return _scatter_rows(partial, group)

    @staticmethod
    def backward(ctx, grad):
        return _gather_rows(grad, ctx.group), None


def _gather_list(x, group):            # another way: the list forms, along dim 1
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, x.contiguous(), group=group)
    return torch.cat(parts, dim=1)


def _scatter_list(x, group):
    n = dist.get_world_size(group)
    out = torch.empty_like(x.chunk(n, dim=1)[0], memory_format=torch.contiguous_format)
    dist.reduce_scatter(out, [c.contiguous() for c in x.chunk(n, dim=1)], group=group)
    return out


class GatherListF(GatherF):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _gather_list(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _scatter_list(grad, ctx.group), None


class ScatterListF(ScatterF):
    @staticmethod
    def forward(ctx, partial, group):
        ctx.group = group
        return _scatter_list(partial, group)

    @staticmethod
    def backward(ctx, grad):
        return _gather_list(grad, ctx.group), None


def _exchange(send, group, r, n):
    """One ring hop: send to the right neighbour, receive from the left, both posted at once."""
    right, left = dist.get_global_rank(group, (r + 1) % n), dist.get_global_rank(group, (r - 1) % n)
    got = torch.empty_like(send)
    for request in (dist.isend(send, right, group=group), dist.irecv(got, left, group=group)):
        request.wait()
    return got


def _ring_gather(x, group):            # a hand-written ring of messages: the same bytes
    n, r = dist.get_world_size(group), dist.get_rank(group)
    pieces = [None] * n
    pieces[r] = x.contiguous()
    for step in range(n - 1):
        pieces[(r - 1 - step) % n] = _exchange(pieces[(r - step) % n], group, r, n)
    return torch.cat(pieces, dim=1)


def _ring_scatter(x, group):
    n, r = dist.get_world_size(group), dist.get_rank(group)
    chunks = [c.contiguous() for c in x.chunk(n, dim=1)]
    acc = chunks[(r - 1) % n]
    for step in range(n - 1):
        acc = _exchange(acc, group, r, n) + chunks[(r - 2 - step) % n]
    return acc


class GatherRingF(GatherF):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _ring_gather(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _ring_scatter(grad, ctx.group), None


class ScatterRingF(ScatterF):
    @staticmethod
    def forward(ctx, partial, group):
        ctx.group = group
        return _ring_scatter(partial, group)

    @staticmethod
    def backward(ctx, grad):
        return _ring_gather(grad, ctx.group), None


class GatherSplitBackF(GatherF):       # wrong: the all-gather/split pair, the sum is missing
    @staticmethod
    def backward(ctx, grad):
        n, r = dist.get_world_size(ctx.group), dist.get_rank(ctx.group)
        return grad.chunk(n, dim=1)[r].contiguous(), None


class GatherAllReduceBackF(GatherF):   # wrong: right numbers, twice the bytes in backward
    @staticmethod
    def backward(ctx, grad):
        total = grad.contiguous().clone()
        dist.all_reduce(total, group=ctx.group)
        n, r = dist.get_world_size(ctx.group), dist.get_rank(ctx.group)
        return total.chunk(n, dim=1)[r], None


class ScatterSavesAllF(ScatterF):      # wrong: keeps the whole sequence for a backward that needs none
    @staticmethod
    def forward(ctx, partial, group):
        ctx.group = group
        ctx.save_for_backward(partial)
        return _scatter_rows(partial, group)


class GatherCourseF(GatherF):          # cheat: the course's helper
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return tp_comm._all_gather(x, 1, group, "forward")


class GatherTorchF(GatherF):           # cheat: torch's differentiable all_gather does the backward
    @staticmethod
    def forward(ctx, x, group):
        import torch.distributed.nn.functional as dnf
        return torch.cat(dnf.all_gather(x.contiguous(), group=group), dim=1)


class GatherLocalBackF(GatherF):       # cheat: a collective called, the gradient kept locally
    @staticmethod
    def backward(ctx, grad):
        n, r = dist.get_world_size(ctx.group), dist.get_rank(ctx.group)
        _scatter_rows(torch.zeros_like(grad), ctx.group)
        return n * grad.chunk(n, dim=1)[r].contiguous(), None


def _gather_world(x, group):           # decoy: right on a world-only check, the group ignored
    n = dist.get_world_size()
    rows = x.transpose(0, 1).contiguous()
    out = rows.new_empty((n * rows.shape[0], *rows.shape[1:]))
    dist.all_gather_single(out, rows)
    return out.transpose(0, 1)


class GatherWorldF(GatherF):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _gather_world(x, group)


def _pair(gather, scatter=ScatterF):
    """A battery candidate: the two Functions, named by the gather."""
    pair = (lambda check: check(gather, scatter))
    pair.__name__ = gather.__name__ + (f"+{scatter.__name__}" if scatter is not ScatterF else "")
    return pair


def test_sequence_parallel_pair_battery():
    said = battery(ch07.check_sequence_parallel_pair, call=lambda check, pair: pair(check),
                   correct=[_pair(GatherF)],
                   different=[_pair(GatherListF, ScatterListF), _pair(GatherRingF, ScatterRingF)],
                   wrong=[_pair(GatherSplitBackF), _pair(GatherAllReduceBackF),
                          _pair(GatherF, ScatterSavesAllF)],
                   cheat=[_pair(GatherCourseF), _pair(GatherTorchF), _pair(GatherLocalBackF)],
                   decoy=[_pair(GatherWorldF)])
    split, all_reduce, saves = said["wrong"]
    assert "only this rank's own term" in split
    assert "2× the" in all_reduce and "all_reduce" in all_reduce
    assert "saved" in saves and "more than its own tokens" in saves
    course, torch_own, local = said["cheat"]
    assert "course's own _all_gather" in course
    assert "torch's differentiable torch.distributed.nn.functional.all_gather" in torch_own
    assert "gradient" in local
    assert "group" in said["decoy"][0]
    assert "groups [0, 1] and [2, 3]" in said["correct"][0]


def test_sequence_parallel_pair_stubs_and_bad_arguments():
    class Stub(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, group):
            raise NotImplementedError

        @staticmethod
        def backward(ctx, grad):
            raise NotImplementedError

    with pytest.raises(NotImplementedError, match=r"Stub.forward is not written yet"):
        ch07.check_sequence_parallel_pair(GatherF, Stub)
    with pytest.raises(TypeError, match="autograd.Function class itself"):
        ch07.check_sequence_parallel_pair(GatherF.apply, ScatterF)


# ==== workbook 07, exercise 2: vocab-parallel cross-entropy =======================================

class VocabCE(torch.autograd.Function):        # the workbook's solution
    @staticmethod
    def forward(ctx, logits_shard, target, vocab_start, group):
        top = logits_shard.max(dim=1).values
        dist.all_reduce(top, op=dist.ReduceOp.MAX, group=group)
        shifted = logits_shard - top[:, None]
        exps = shifted.exp()
        local = target - vocab_start
        here = (local >= 0) & (local < logits_shard.shape[1])
        column = local.clamp(0, logits_shard.shape[1] - 1)[:, None]
        picked = torch.where(here, shifted.gather(1, column)[:, 0], torch.zeros_like(top))
        sums = torch.stack([exps.sum(dim=1), picked])
        dist.all_reduce(sums, group=group)
        ctx.save_for_backward(exps / sums[0][:, None], local, here)
        return sums[0].log() - sums[1]

    @staticmethod
    def backward(ctx, grad):
        probs, local, here = ctx.saved_tensors
        rows = here.nonzero()[:, 0]
        grad_logits = probs.clone()
        grad_logits[rows, local[rows]] -= 1
        return grad_logits * grad[:, None], None, None, None


def ce_solution(logits_shard, target, vocab_start, group):
    return VocabCE.apply(logits_shard, target, vocab_start, group)


class SumFwd(torch.autograd.Function):       # a g of one's own: sum forward, identity backward
    @staticmethod
    def forward(ctx, x, group):
        out = x.clone()
        dist.all_reduce(out, op=ReduceOp.SUM, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def ce_gathered_stats(logits_shard, target, vocab_start, group):
    """Differently written: every rank's (max, sum of exps, target logit) all-gathered (3 numbers
    per token per rank), combined with rescaling; autograd differentiates the local terms."""
    n, me = dist.get_world_size(group), dist.get_rank(group)
    m = logits_shard.detach().max(dim=1).values
    s = (logits_shard - m[:, None]).exp().sum(dim=1)
    local = target - vocab_start
    here = (local >= 0) & (local < logits_shard.shape[1])
    z_t = torch.where(here, logits_shard.gather(1, local.clamp(0, logits_shard.shape[1] - 1)
                                                [:, None])[:, 0], torch.zeros_like(m))
    stats = torch.stack([m, s.detach(), z_t.detach()])
    every = [torch.empty_like(stats) for _ in range(n)]
    dist.all_gather(every, stats, group=group)
    M = torch.stack([e[0] for e in every]).max(dim=0).values
    total = sum((s if r == me else e[1]) * (e[0] - M).exp() for r, e in enumerate(every))
    target_logit = sum(z_t if r == me else e[2] for r, e in enumerate(every))
    return total.log() + M - target_logit


def ce_with_own_g(logits_shard, target, vocab_start, group):
    """Differently written: the three all-reduces, the sums through a g of one's own."""
    m = logits_shard.detach().max(dim=1).values
    dist.all_reduce(m, op=ReduceOp.MAX, group=group)
    z = logits_shard - m[:, None]
    local = target - vocab_start
    here = ((local >= 0) & (local < z.shape[1])).double()
    picked = (z * F.one_hot(local.clamp(0, z.shape[1] - 1), z.shape[1]) * here[:, None]).sum(1)
    return SumFwd.apply(z.exp().sum(1), group).log() - SumFwd.apply(picked, group)


def ce_no_max(logits_shard, target, vocab_start, group):   # wrong: exp overflows near 1000
    local = target - vocab_start
    here = ((local >= 0) & (local < logits_shard.shape[1])).double()
    picked = (logits_shard * F.one_hot(local.clamp(0, logits_shard.shape[1] - 1),
                                       logits_shard.shape[1]) * here[:, None]).sum(1)
    return (SumFwd.apply(logits_shard.exp().sum(1), group).log()
            - SumFwd.apply(picked, group))


def ce_torch_all_reduce(logits_shard, target, vocab_start, group):
    """Wrong: torch's differentiable all_reduce for the sums: its backward all-reduces the
    gradient (every rank computed the same loss: n× the gradient, and a backward that talks)."""
    import torch.distributed.nn.functional as dnf
    m = logits_shard.detach().max(dim=1).values
    dist.all_reduce(m, op=ReduceOp.MAX, group=group)
    z = logits_shard - m[:, None]
    local = target - vocab_start
    here = ((local >= 0) & (local < z.shape[1])).double()
    picked = (z * F.one_hot(local.clamp(0, z.shape[1] - 1), z.shape[1]) * here[:, None]).sum(1)
    return dnf.all_reduce(z.exp().sum(1), group=group).log() - dnf.all_reduce(picked, group=group)


def ce_gather_logits(logits_shard, target, vocab_start, group):
    """Cheat: every shard gathered (padded to one size), then dense F.cross_entropy."""
    n, me = dist.get_world_size(group), dist.get_rank(group)
    size = torch.tensor([logits_shard.shape[1]])
    sizes = [torch.zeros_like(size) for _ in range(n)]
    dist.all_gather(sizes, size, group=group)
    width = int(max(sizes))
    padded = F.pad(logits_shard.detach(), (0, width - logits_shard.shape[1]))
    parts = [torch.empty_like(padded) for _ in range(n)]
    dist.all_gather(parts, padded, group=group)
    parts[me] = F.pad(logits_shard, (0, width - logits_shard.shape[1]))
    full = torch.cat([p[:, :int(k)] for p, k in zip(parts, sizes)], dim=1)
    return F.cross_entropy(full, target, reduction="none")


def ce_course_module(logits_shard, target, vocab_start, group):
    """Cheat: chapter 07's own vocab-parallel loss (distlab.vocab_parallel) called."""
    from distlab import vocab_parallel
    width = torch.tensor([logits_shard.shape[1]])
    dist.all_reduce(width, group=group)
    return vocab_parallel.vocab_parallel_cross_entropy(logits_shard, target, int(width), group)


def ce_world(logits_shard, target, vocab_start, group):
    """Decoy: the solution with every all-reduce over the whole world (right when the world is
    the group, which is all a world-only check tries)."""
    return VocabCE.apply(logits_shard, target, vocab_start, None)


def test_vocab_parallel_cross_entropy_battery():
    said = battery(ch07.check_vocab_parallel_cross_entropy,
                   correct=[ce_solution], different=[ce_gathered_stats, ce_with_own_g],
                   wrong=[ce_no_max, ce_torch_all_reduce],
                   cheat=[ce_gather_logits, ce_course_module], decoy=[ce_world])
    no_max, torch_ar = said["wrong"]
    assert "overflows" in no_max and "op=MAX" in no_max
    assert "the gradient is 2× the right one" in torch_ar
    gathered, course = said["cheat"]
    assert "vocabulary shard's worth" in gathered and "no rank ever holds" in gathered
    assert "course's own" in course
    assert "group" in said["decoy"][0]


def test_vocab_parallel_cross_entropy_stubs_and_bad_arguments():
    def vocab_parallel_cross_entropy(logits_shard, target, vocab_start, group):
        raise NotImplementedError

    with pytest.raises(NotImplementedError, match="vocab_parallel_cross_entropy is not written"):
        ch07.check_vocab_parallel_cross_entropy(vocab_parallel_cross_entropy)
    with pytest.raises(TypeError, match="should take 4 arguments"):
        ch07.check_vocab_parallel_cross_entropy(lambda z, t: z)


# ==== workbook 07, exercise 3: one layer's TP communication, predicted ============================

def layer_comm_seconds(hidden, tokens, tp, dtype, sequence_parallel, link):   # the workbook's
    S = tokens * hidden * torch.empty((), dtype=dtype).element_size()
    if sequence_parallel:
        sent = {"all_gather": (tp - 1) / tp * S, "reduce_scatter": (tp - 1) / tp * S}
    else:
        sent = {"all_reduce": 2 * (tp - 1) / tp * S}
    return sum(4 * (link.latency[op] + b / link.busbw[op]) for op, b in sent.items())


def estimate_per_collective(hidden, tokens, tp, dtype, sequence_parallel, link):
    """Differently written: one collective at a time, dtype.itemsize, the ring as N-1 steps."""
    S = hidden * tokens * dtype.itemsize
    layer = ["all_gather", "reduce_scatter"] * 4 if sequence_parallel else ["all_reduce"] * 4
    total = 0.0
    for op in layer:
        steps = (tp - 1) * (2 if op == "all_reduce" else 1)
        total += link.latency[op] + steps * (S / tp) / link.busbw[op]
    return total


def _variant(name, **wrong):
    """The right formula with one term wrong."""
    def estimate(hidden, tokens, tp, dtype, sequence_parallel, link):
        size = wrong.get("bytes", torch.empty((), dtype=dtype).element_size())
        S = tokens * hidden * size
        ops = ["all_gather", "reduce_scatter"] if sequence_parallel else ["all_reduce"]
        t = 0.0
        for op in ops:
            factor = (1 if wrong.get("no_ring") else
                      (tp - 1) / tp * (1 if sequence_parallel else 2))
            bw = link.busbw["all_reduce" if wrong.get("ar_busbw") else op]
            lat = 0.0 if wrong.get("no_latency") else link.latency[op]
            t += wrong.get("count", 4) * (lat + factor * S / bw)
        return t
    estimate.__name__ = name
    return estimate


def estimate_course_link(hidden, tokens, tp, dtype, sequence_parallel, link):
    """Cheat: the course's own link model instead of a formula."""
    from distlab import hardware
    model = hardware.PRESETS[link.name.split(":")[0]].link_between(range(tp))
    S = tokens * hidden * dtype.itemsize
    ops = ["all_gather", "reduce_scatter"] if sequence_parallel else ["all_reduce"]
    return sum(4 * model.seconds(op, S, tp) for op in ops)


def test_tp_comm_estimate_battery():
    said = battery(ch07.check_tp_comm_estimate,
                   correct=[layer_comm_seconds], different=[estimate_per_collective],
                   wrong=[_variant("no_latency", no_latency=True), _variant("two", count=2),
                          _variant("no_ring", no_ring=True),
                          _variant("sp_at_all_reduce_busbw", ar_busbw=True)],
                   cheat=[estimate_course_link],
                   # right on every bf16 case, the first ones the check tries: 2 bytes always
                   decoy=[_variant("always_bf16", bytes=2)])
    no_latency, two, no_ring, ar_busbw = said["wrong"]
    assert "misses the latency" in no_latency and "15 µs here" in no_latency
    assert "counts 2 collectives' latencies where a layer makes 4" in two
    assert "misses the ring's factor" in no_ring and "1.75·S at N = 8" in no_ring
    assert "divides by another collective's bus bandwidth" in ar_busbw
    assert "course's own Link.seconds" in said["cheat"][0]
    assert "does not change with the dtype" in said["decoy"][0]
    assert "h100 2 nodes × 2, TP + SP" in said["correct"][0] and "(8 collectives)" in said["correct"][0]
    # the emulated layer beside the closed form: the same number, because the same formulas
    runs = ch07._emulated_layers()
    assert len(runs) == 4 and all(math.isclose(
        seconds, ch07._reference_layer_seconds(4096, 4096, 4, torch.bfloat16, sp, cluster),
        rel_tol=1e-6) for (_, sp), (seconds, _, cluster) in runs.items())
    # what workbook 07 says of the printout: SP's communication is longer inside the H100 node
    # (NVLink SHARP for all_reduce only, twice the latencies) and nearly ties across two nodes
    t = {key: seconds for key, (seconds, _, _) in runs.items()}
    assert t["h100-node", True] > 1.1 * t["h100-node", False]
    assert abs(t["h100 2 nodes × 2", True] / t["h100 2 nodes × 2", False] - 1) < 0.03


# ==== workbook 08 =================================================================================

def interleaved_stage(p, m, v, rank):              # the workbook's solution
    n = m * v
    warmup = min(2 * (p - 1 - rank) + (v - 1) * p, n)
    walk = [(group + i, c) for group in range(0, m, p) for c in range(v) for i in range(p)]
    forwards = iter([("F", mb, c) for mb, c in walk])
    backwards = iter([("B", mb, v - 1 - c) for mb, c in walk])
    actions = [next(forwards) for _ in range(warmup)]
    for _ in range(n - warmup):
        actions.append(next(forwards))
        actions.append(next(backwards))
    actions.extend(backwards)
    return actions


def interleaved_by_counters(p, m, v, rank):
    """Differently written: Megatron's own bookkeeping — the k-th forward's chunk and micro-batch
    from k, the k-th backward's the same with the chunk mirrored."""
    total = m * v
    warmup = min(2 * (p - 1 - rank) + (v - 1) * p, total)

    def at(k, backward):
        chunk = (k // p) % v
        mb = (k // (p * v)) * p + k % p
        return ("B" if backward else "F", mb, v - 1 - chunk if backward else chunk)

    out = [at(k, False) for k in range(warmup)]
    for k in range(total - warmup):
        out += [at(warmup + k, False), at(k, True)]
    return out + [at(k, True) for k in range(total - warmup, total)]


def interleaved_chunk_major(p, m, v, rank):
    """Wrong: every micro-batch through chunk 0, then every one through chunk 1 (depth-first in
    the chunks is what bounds the memory); the warm-up as given."""
    n = m * v
    warmup = min(2 * (p - 1 - rank) + (v - 1) * p, n)
    walk = [(mb, c) for c in range(v) for mb in range(m)]
    forwards = iter([("F", mb, c) for mb, c in walk])
    backwards = iter([("B", mb, v - 1 - c) for mb, c in walk])
    actions = [next(forwards) for _ in range(warmup)]
    for _ in range(n - warmup):
        actions += [next(forwards), next(backwards)]
    return actions + list(backwards)


def interleaved_course(p, m, v, rank):
    """Cheat: the chapter's own schedule, converted."""
    from distlab import pipeline_schedules as ps
    return [(a.kind, a.mb, a.chunk) for a in ps.interleaved_1f1b(p, m, v)[rank]]


def interleaved_gpipe(p, m, v, rank):
    """Decoy: every forward, then every backward, in the right order — it never deadlocks and
    trains exactly (right numbers), but holds every chunk at once."""
    walk = [(group + i, c) for group in range(0, m, p) for c in range(v) for i in range(p)]
    return [("F", mb, c) for mb, c in walk] + [("B", mb, v - 1 - c) for mb, c in walk]


def test_interleaved_battery():
    said = battery(ch08.check_interleaved,
                   correct=[interleaved_stage], different=[interleaved_by_counters],
                   wrong=[interleaved_chunk_major], cheat=[interleaved_course],
                   decoy=[interleaved_gpipe])
    assert "course's own" in said["cheat"][0]
    assert "chunks' activations at once" in said["decoy"][0]
    assert "train exactly like one process on 3 real ranks with v=2" in said["different"][0]


def slow_stage_bubble(p, m, k):                    # the workbook's solution
    step = m * k + p - 1
    return 1 - m * ((p - 1) + k) / (p * step)


def slow_stage_idle(p, m, k):
    """Differently written: each fast stage idles step − m, the slow one p − 1."""
    step = m * k + p - 1
    idle = (p - 1) * (step - m) + (step - m * k)
    return idle / (p * step)


def slow_stage_equal(p, m, k):                     # wrong: the chapter's equal-stage formula
    return (p - 1) / (m + p - 1)


def slow_stage_course(p, m, k):
    """Cheat: the checker's own simulation of the run."""
    from distlab import pipeline_schedules as ps
    return ps.bubble_fraction(ch08.slow_stage_run(p, m, k))


def slow_stage_fill_at_slow_pace(p, m, k):
    """Decoy: right whenever k = 1 (the chapter's case) — the fill and drain at the slow pace."""
    step = k * (m + p - 1)
    return 1 - m * ((p - 1) + k) / (p * step)


def test_slow_stage_bubble_battery():
    said = battery(ch08.check_slow_stage_bubble,
                   correct=[slow_stage_bubble], different=[slow_stage_idle],
                   wrong=[slow_stage_equal], cheat=[slow_stage_course],
                   decoy=[slow_stage_fill_at_slow_pace])
    assert "fill and drain" in said["decoy"][0] or "p - 1" in said["decoy"][0] \
        or "ramp" in said["decoy"][0]


def choose_m(p, k, gbs, dp, target, budget):       # the workbook's solution
    samples = gbs // dp
    for m in (m for m in range(1, samples + 1) if samples % m == 0):
        if min(p, m) * (samples // m) <= budget and slow_stage_bubble(p, m, k) <= target:
            return m
    return None


def choose_m_descending(p, k, gbs, dp, target, budget):
    """Differently written: every divisor that fits, then the smallest."""
    samples = gbs // dp
    fits = [m for m in range(samples, 0, -1) if samples % m == 0
            and min(p, m) * samples // m <= budget and slow_stage_bubble(p, m, k) <= target]
    return min(fits) if fits else None


def choose_m_gpipe_memory(p, k, gbs, dp, target, budget):
    """Wrong: GPipe's memory (all m micro-batches held) instead of 1F1B's min(p, m)."""
    samples = gbs // dp
    for m in (m for m in range(1, samples + 1) if samples % m == 0):
        if samples <= budget and slow_stage_bubble(p, m, k) <= target:
            return m
    return None


def choose_m_checker(p, k, gbs, dp, target, budget):
    """Cheat: the checker's own exhaustive search."""
    return ch08._best_m(p, k, gbs, dp, target, budget)


def choose_m_ignores_dp(p, k, gbs, dp, target, budget):
    """Decoy: right whenever dp = 1 — the global batch taken for the pipeline's."""
    return choose_m(p, k, gbs, 1, target, budget)


def test_choose_m_battery():
    battery(ch08.check_choose_m, correct=[choose_m], different=[choose_m_descending],
            wrong=[choose_m_gpipe_memory], cheat=[choose_m_checker],
            decoy=[choose_m_ignores_dp])
