"""Workbook 08's checkers pass right answers however they are written, refuse wrong structures,
wrong formulas and the course's own code (also loaded again under another name), and say which
rank, step, micro-batch - or which term of a formula - is wrong, and the rule."""
import importlib.util

import pytest

from distlab import pipeline_schedules as ps
from distlab.checks import CheckFailed, ch08
from distlab.checks import ch08_sim as sim


# ---- the checker's simulator agrees with the chapter's ------------------------------------------

@pytest.mark.parametrize("name, p, m, v", [("GPipe", 3, 5, 1), ("1F1B", 4, 6, 1), ("1F1B", 5, 2, 1),
                                           ("interleaved 1F1B", 4, 8, 2),
                                           ("interleaved 1F1B", 3, 6, 3)])
def test_own_simulator_matches_the_chapters(name, p, m, v):
    lists = ps.interleaved_1f1b(p, m, v) if v > 1 else ps.make_schedule(name, p, m)
    ours = sim.simulate(sim.normalize(lists), m,
                        lambda r, a: (1.0 if a.kind == "F" else 2.0) / v, v)
    theirs = ps.simulate(lists, m)
    assert sim.bubble(ours, p) == pytest.approx(ps.bubble_fraction(theirs), abs=1e-12)
    starts = {(e["stage"], e["kind"], e["mb"], e["chunk"]): e["start"] for e in theirs}
    assert all(starts[e["rank"], e["kind"], e["mb"], e["chunk"]] == pytest.approx(e["start"])
               for e in ours)


@pytest.mark.parametrize("p, m", [(2, 1), (3, 5), (4, 8), (5, 3)])
def test_checkers_1f1b_is_the_chapters(p, m):
    assert ch08._one_f_one_b_slow_last(p, m) == sim.normalize(ps.one_f_one_b(p, m))


def test_own_simulator_names_the_deadlock_cycle():
    lists = [[("F", 0), ("B", 0), ("F", 1), ("B", 1)], [("F", 1), ("F", 0), ("B", 0), ("B", 1)]]
    with pytest.raises(sim.ScheduleError, match="rank 1, step 0 \\(F1\\) receives rank 0's "
                                                "activation message number 0, but rank 0 sends "
                                                "that one for micro-batch 0"):
        sim.simulate(sim.normalize(lists), 2, lambda r, a: 1.0)
    lists = [[("F", 0), ("B", 0)], [("B", 0), ("F", 0)]]
    with pytest.raises(sim.ScheduleError, match="rank 1, step 0: B0 comes before its forward"):
        sim.simulate(sim.normalize(lists), 1, lambda r, a: 1.0)


# ---- exercise 1: interleaved 1F1B ---------------------------------------------------------------

def interleaved_stage(p, m, v, rank):
    """The workbook's answer: the forward order of (micro-batch, chunk) pairs, the backward order
    the same with the chunks reversed, a warm-up, then one forward and one backward."""
    forward = [(g + i, c) for g in range(0, m, p) for c in range(v) for i in range(p)]
    backward = [(mb, v - 1 - c) for mb, c in forward]
    warmup = min(2 * (p - 1 - rank) + (v - 1) * p, m * v)
    fwd = iter([("F", mb, c) for mb, c in forward])
    bwd = iter([("B", mb, c) for mb, c in backward])
    actions = [next(fwd) for _ in range(warmup)]
    for _ in range(m * v - warmup):
        actions += [next(fwd), next(bwd)]
    return actions + list(bwd)


def looped_bfs(p, m, v, rank):
    """Wrong structure: every forward first (no deadlock, the bubble is fine, memory is not)."""
    forward = [(g + i, c) for g in range(0, m, p) for c in range(v) for i in range(p)]
    return [("F", mb, c) for mb, c in forward] + [("B", mb, v - 1 - c) for mb, c in forward]


def chunks_not_reversed(p, m, v, rank):
    """Wrong structure: backwards visit the chunks in forward order (a waiting cycle)."""
    return [(k, mb, c if k == "F" else v - 1 - c) for k, mb, c in interleaved_stage(p, m, v, rank)]


def rank0_swaps_two_sends(p, m, v, rank):
    """Wrong order: rank 0 sends micro-batch 1 before 0; rank 1 receives 0 first."""
    actions = interleaved_stage(p, m, v, rank)
    if rank == 0:
        actions[0], actions[1] = actions[1], actions[0]
    return actions


def depth_first(p, m, v, rank):
    """Valid and within memory, but each micro-batch goes through all chunks first: idles."""
    forward = [(mb, c) for mb in range(m) for c in range(v)]
    backward = [(mb, v - 1 - c) for mb, c in forward]
    warmup = min(2 * (p - 1 - rank) + (v - 1) * p, m * v)
    fwd = iter([("F", mb, c) for mb, c in forward])
    bwd = iter([("B", mb, c) for mb, c in backward])
    actions = [next(fwd) for _ in range(warmup)]
    for _ in range(m * v - warmup):
        actions += [next(fwd), next(bwd)]
    return actions + list(bwd)


def cheat_course_schedule(p, m, v, rank):
    return ps.interleaved_1f1b(p, m, v)[rank]


def cheat_module_loaded_again(p, m, v, rank):
    """The course's file loaded under another module name: new code objects, same answer."""
    # the file that holds it, under a new name in the package (its relative imports resolve)
    spec = importlib.util.spec_from_file_location("distlab.pipeline_schedules.my_schedules",
                                                  ps.classic.__file__)
    mine = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mine)
    return mine.interleaved_1f1b(p, m, v)[rank]


# (a right answer trained on real ranks: the battery in tests/test_checks_ch07_08.py)


def test_interleaved_workbook_answer_passes_the_simulation(capsys):
    ch08.check_interleaved(interleaved_stage, run=None)   # its real run is nbval's, in solutions/


@pytest.mark.parametrize("fn, message", [
    (looped_bfs, r"with p=2, m=4, v=2, rank 0 holds 8 chunks' activations at once; interleaved "
                 r"1F1B holds at most min\(2\(p-1-r\) \+ \(v-1\)p \+ 1, mv\) = 5 on rank 0"),
    (chunks_not_reversed, r"with p=2, m=4, v=2: the schedule deadlocks: rank 0's step 5 \(B0 of "
                          r"chunk 0\) waits for micro-batch 0's gradient from rank 1, which rank 1 "
                          r"only sends at its step 3, and that step waits too; rank 1's step 3"),
    (rank0_swaps_two_sends, r"with p=2, m=4, v=2: rank 1, step 0 \(F0 of chunk 0\) receives rank "
                            r"0's activation message number 0, but rank 0 sends that one for "
                            r"micro-batch 1 .*matched in the order they are sent"),
    (depth_first, r"with p=2, m=4, v=2, your schedule's bubble is 0.333; interleaved 1F1B reaches "
                  r"\(p-1\)/\(vm\+p-1\) = 0.111. The first action to start late: rank 0's step 2 "
                  r"\(F1 of chunk 0\) starts at 3 chunk-forward times; in interleaved 1F1B it "
                  r"starts at 1"),
])
def test_interleaved_wrong_structures_are_named(fn, message):
    with pytest.raises(CheckFailed, match=message):
        ch08.check_interleaved(fn, run=None)


@pytest.mark.parametrize("fn", [cheat_course_schedule, cheat_module_loaded_again])
def test_interleaved_course_schedule_is_refused(fn):
    with pytest.raises(CheckFailed, match="course's own interleaved_1f1b.*write the interleaved "
                                          "lists yourself"):
        ch08.check_interleaved(fn, run=None)
    assert repr(ps.interleaved_1f1b(2, 2, 2)[0][0]) == "F0"          # restored


def test_interleaved_stub_says_not_written():
    def stub(p, m, v, rank):
        raise NotImplementedError
    with pytest.raises(NotImplementedError, match="interleaved_stage is not written yet"):
        ch08.check_interleaved(stub)


def test_interleaved_not_a_list_is_one_sentence():
    with pytest.raises(CheckFailed, match=r"rank 0, step 0: 'F0' is not an action like"):
        ch08.check_interleaved(lambda p, m, v, rank: ["F0"], run=None)


# ---- exercise 2: predict the bubble with a slow last stage ---------------------------------------

def slow_stage_bubble(p, m, k):
    """The workbook's answer: work over p times the step."""
    return 1 - m * (p - 1 + k) / (p * ((p - 1) + m * k))


def slow_stage_bubble_factored(p, m, k):
    """Differently written: idle time over rank-time, with the idle counted per rank."""
    step = (p - 1) + m * k
    idle = (p - 1) * (step - m) + (step - m * k)     # p - 1 ranks work m, the last works m k
    return idle / (p * step)


def chapters_formula(p, m, k):
    """Wrong: the equal-stage formula; right at k = 1 only."""
    return (p - 1) / (m + p - 1)


def ramp_at_the_slow_pace(p, m, k):
    """Wrong fill/drain term: the ramp crosses the other stages at the slow stage's cost."""
    return 1 - m * (p - 1 + k) / (p * (k * (p - 1) + m * k))


def cheat_theory(p, m, k):
    return ps.theory_bubble(p, m)


def cheat_checker_closed_form(p, m, k):
    return ch08._closed_form(p, m, k)


@pytest.mark.parametrize("fn", [slow_stage_bubble, slow_stage_bubble_factored])
def test_slow_stage_right_formulas_pass(fn, capsys):
    ch08.check_slow_stage_bubble(fn)
    assert "✅" in capsys.readouterr().out


def test_slow_stage_equal_stage_formula_names_the_steady_term():
    with pytest.raises(CheckFailed, match=r"with p=2, m=2, k=2, your formula gives 0.3333; the "
                                          r"simulated 1F1B run idles 0.4000 of the time \(closed "
                                          r"form 0.4000\); the steady-state term is off: your "
                                          r"formula implies each extra micro-batch adds 1.5 "
                                          r"stage-times to the step - the mean stage's cost"):
        ch08.check_slow_stage_bubble(chapters_formula)


def test_slow_stage_wrong_ramp_names_the_fill_drain_term():
    with pytest.raises(CheckFailed) as e:
        ch08.check_slow_stage_bubble(ramp_at_the_slow_pace)
    assert "with p=2, m=1, k=2" in str(e.value)
    assert "the fill/drain term is off: your formula implies 2 stage-times" in str(e.value)
    assert "steady-state" not in str(e.value)


def test_slow_stage_out_of_range_is_one_sentence():
    with pytest.raises(CheckFailed, match="a bubble is a share of the ranks' time, between 0 "
                                          "and 1"):
        ch08.check_slow_stage_bubble(lambda p, m, k: (p - 1) * k / m + 1)
    with pytest.raises(CheckFailed, match=r"slow_stage_bubble\(2, 1, 1\) should be a number; got "
                                          r"str"):
        ch08.check_slow_stage_bubble(lambda p, m, k: "0.5")


@pytest.mark.parametrize("fn, what", [(cheat_theory, "theory_bubble"),
                                      (cheat_checker_closed_form, "_closed_form")])
def test_slow_stage_course_code_is_refused(fn, what):
    with pytest.raises(CheckFailed, match=f"course's own {what}.*work the bubble out yourself"):
        ch08.check_slow_stage_bubble(fn)


def test_slow_stage_stub_says_not_written():
    def stub(p, m, k):
        raise NotImplementedError
    with pytest.raises(NotImplementedError, match="slow_stage_bubble is not written yet"):
        ch08.check_slow_stage_bubble(stub)


# ---- exercise 3: choosing m -------------------------------------------------------------------

def choose_m(p, k, gbs, dp, target, budget):
    """The workbook's answer: the divisors of the pipeline's samples, smallest first."""
    n = gbs // dp
    for m in range(1, n + 1):
        if n % m == 0 and slow_stage_bubble(p, m, k) <= target and min(p, m) * (n // m) <= budget:
            return m
    return None


def choose_m_filtered(p, k, gbs, dp, target, budget):
    """Differently written: every candidate filtered, the smallest of what is left."""
    samples = gbs // dp
    sizes = [mbs for mbs in range(samples, 0, -1) if samples % mbs == 0]   # biggest first
    ok = [samples // mbs for mbs in sizes
          if slow_stage_bubble_factored(p, samples // mbs, k) <= target
          and min(p, samples // mbs) * mbs <= budget]
    return ok[0] if ok else None


def ignores_memory(p, k, gbs, dp, target, budget):
    return choose_m(p, k, gbs, dp, target, 10 ** 9)


def ignores_divisibility(p, k, gbs, dp, target, budget):
    return next((m for m in range(1, gbs // dp + 1) if slow_stage_bubble(p, m, k) <= target
                 and min(p, m) * gbs / dp / m <= budget), None)


def equal_stages(p, k, gbs, dp, target, budget):
    return choose_m(p, 1.0, gbs, dp, target, budget)


def most_micro_batches(p, k, gbs, dp, target, budget):
    n = gbs // dp
    return n if choose_m(p, k, gbs, dp, target, budget) else None


def cheat_best_m(p, k, gbs, dp, target, budget):
    return ch08._best_m(p, k, gbs, dp, target, budget)


@pytest.mark.parametrize("fn", [choose_m_filtered])
def test_choose_m_right_answers_pass(fn, capsys):
    ch08.check_choose_m(fn)
    assert "✅" in capsys.readouterr().out


@pytest.mark.parametrize("fn, message", [
    (ignores_memory, r"with p=8, k=1.5, gbs=1024, dp=2 \(512 samples per pipeline\), target bubble "
                     r"0.35, budget 32 samples on rank 0: with m=64 rank 0 holds min\(p, m\) = 8 "
                     r"micro-batches of 8 samples = 64, above the budget of 32"),
    (ignores_divisibility, r"with p=4, k=1, .*: m=12 does not cut the 128 samples of a pipeline "
                           r"into equal micro-batches"),
    (equal_stages, r"with p=4, k=2, .*target bubble 0.45.*: m=4 leaves a bubble of 0.545, above "
                   r"the target 0.45 \(the last stage's k counts"),
    (most_micro_batches, r"with p=4, k=1, .*: m=128 works, but m=16 does too with fewer, larger "
                         r"micro-batches"),
])
def test_choose_m_wrong_choices_are_named(fn, message):
    with pytest.raises(CheckFailed, match=message):
        ch08.check_choose_m(fn)


def test_choose_m_none_when_one_exists():
    with pytest.raises(CheckFailed, match=r"you returned None, but m=16 \(micro-batches of 8\) "
                                          r"meets both"):
        ch08.check_choose_m(lambda *args: None)


def test_choose_m_refuses_the_checkers_search():
    with pytest.raises(CheckFailed, match="course's own _best_m.*choose m yourself"):
        ch08.check_choose_m(cheat_best_m)


def test_choose_m_stub_says_not_written():
    def stub(p, k, gbs, dp, target, budget):
        raise NotImplementedError
    with pytest.raises(NotImplementedError, match="choose_m is not written yet"):
        ch08.check_choose_m(stub)


# ---- chapter 08's real-size bubble: every number its prose quotes, recomputed --------------------

def _chapter_markdown():
    """The prose of chapter 08 and of its second sitting, 08b."""
    import pathlib
    import nbformat
    root = pathlib.Path(__file__).resolve().parent.parent / "notebooks"
    return "\n".join(c.source for name in ("08_pipeline_parallel", "08b_pipelines_in_practice")
                     for c in nbformat.read(root / f"{name}.ipynb", as_version=4).cells
                     if c.cell_type == "markdown")


def test_real_size_bubble_numbers_the_prose_quotes():
    """Runs the chapter's three emulated real-size pipelines (Llama-2 7B blocks on meta tensors)
    and checks each claim of cells 'The bubble at real size' and the summary against them."""
    import distlab
    from distlab import pipeline_parallel as pp
    text = " ".join(_chapter_markdown().split())
    P, M, TOKENS, HIDDEN = 4, 8, 4096, pp.LLAMA2_7B["hidden"]
    import torch
    FFN = pp.LLAMA2_7B["ffn"]

    def steps(rank, world_size, names):          # as the chapter: one launch per preset
        timelines = [pp.real_size_step(rank, world_size, name, M, 1, TOKENS) for name in names]
        wgrad = {rows: pp.weight_grad_seconds(rows, HIDDEN, 2 * FFN, torch.bfloat16, "meta")
                 for rows in (TOKENS, 1024, 256)}
        return timelines, wgrad
    runs = {}
    for preset, names in [("h100-node", ("1F1B", "ZB-H1")), ("h100-ib", ("1F1B",))]:
        ranks = distlab.run(steps, P, names, emulate=preset, timeout=180)
        for i, name in enumerate(names):
            runs[name, preset] = [e for timelines, _ in ranks for e in timelines[i]]
        if preset == "h100-node":
            wgrad = ranks[0][1]

    def mean(timeline, kind):
        xs = [e["end"] - e["start"] for e in timeline if e["kind"] == kind and e["stage"] > 0]
        return sum(xs) / len(xs)
    t_f, t_b = mean(runs["1F1B", "h100-node"], "F"), mean(runs["1F1B", "h100-node"], "B")
    t_i, t_w = mean(runs["ZB-H1", "h100-node"], "I"), mean(runs["ZB-H1", "h100-node"], "W")
    # cell 0: one activation per micro-batch
    activation = TOKENS * HIDDEN * 2
    assert f"({activation / 2**20:.0f} MiB for one 4096-token sequence" in text
    # the summary: B ≈ 2.2 F, and W shorter than F (so ZB-H1 above (p-1)/(3m+p-1)), I longer
    assert f"B ≈ {t_b / t_f:.1f} F, not 2 F" in text
    assert t_w < t_f < t_i, "the prose says I is longer than F and W shorter"
    assert ps.zb_h1_bubble(P, M, t_f, t_i, t_w) > ps.zb_h1_bubble(P, M)
    assert f"= {ps.zb_h1_bubble(P, M):.3f}, which assumes F = I = W" in text
    # the simulator agrees with ZB-H1's closed form at the measured times
    sim_zb = ps.bubble_fraction(ps.simulate(ps.zb_h1(P, M), M, t_f, t_i + t_w, t_w))
    assert abs(sim_zb - ps.zb_h1_bubble(P, M, t_f, t_i, t_w)) < 1e-9
    # messages: "a few per cent" inside a node, "a fifth" across nodes
    nvlink, ib = (pp.message_seconds(p, activation) for p in ("h100-node", "h100-ib"))
    assert 0.01 < nvlink / t_f < 0.05 and 0.15 < ib / t_f < 0.25
    assert "inside a node it is a few per cent of a stage's forward, across nodes a fifth" in text
    assert 10e-6 <= nvlink                          # a real message, not 3.4 µs
    # + messages: about a point on NVLink, several across nodes, back near the formula at 8 blocks
    one = ps.one_f_one_b(P, M)
    closed = ps.theory_bubble(P, M)
    with_nvlink = ps.bubble_fraction(ps.simulate(one, M, t_f, t_b, comm=nvlink))
    with_ib = ps.bubble_fraction(ps.simulate(one, M, t_f, t_b, comm=ib))
    with_ib_8 = ps.bubble_fraction(ps.simulate(one, M, 8 * t_f, 8 * t_b, comm=ib))
    assert 0.005 < with_nvlink - closed < 0.015 and with_ib - closed > 0.03
    assert with_ib_8 - closed < 0.015
    assert "On NVLink that is about a point; across nodes, with one block per stage, several" in text
    # emulated beside the simulator with messages: the critical path agrees within a point
    for (name, preset), comm in [(("1F1B", "h100-node"), nvlink), (("1F1B", "h100-ib"), ib)]:
        sim = ps.bubble_fraction(ps.simulate(one, M, t_f, t_b, comm=comm))
        assert abs(ps.bubble_fraction(runs[name, preset]) - sim) < 0.01
    # ZB-H1 keeps well below 1F1B
    assert ps.bubble_fraction(runs["ZB-H1", "h100-node"]) < 0.75 * ps.bubble_fraction(
        runs["1F1B", "h100-node"])
    # beside Qi et al.'s table 9 (the chapter's PUBLISHED: T_F, T_B = I, T_W, T_comm in ms)
    published = [(18.522, 18.086, 9.337, 0.601), (29.718, 29.444, 19.927, 0.527),
                 (11.347, 11.248, 8.132, 0.377), (10.419, 10.207, 7.715, 0.408)]
    ratios = [(i + w) / f for f, i, w, _ in published]
    assert f"(I + W)/F between {min(ratios):.2f} and {max(ratios):.2f} in the paper, " \
           f"{(t_i + t_w) / t_f:.2f} here" in text
    assert f"Megatron-LM on A100s: {min(ratios):.1f} to {max(ratios):.1f})" in text   # summary
    zb = [ps.zb_h1_bubble(4, 8, f, i, w) for f, i, w, _ in published]
    assert f"gives {min(zb):.3f} to {max(zb):.3f}, with this model's " \
           f"{ps.zb_h1_bubble(4, 8, t_f, t_i, t_w):.3f}" in text
    assert all(w <= min(f, i) for f, i, w, _ in published)     # the closed form applies
    assert all(0.01 < c / f < 0.05 for f, _, _, c in published)
    assert "they share their formulas" in text or "share their formulas" in text
    assert "(measured)" not in text

    # why production fuses the accumulation: W after the first micro-batch is longer; the
    # addition is a fifth of the GEMM at 4096 tokens, more than the GEMM at 256; fused = GEMM
    ws = [e for e in runs["ZB-H1", "h100-node"] if e["kind"] == "W" and e["stage"] > 0]
    first = [e["end"] - e["start"] for e in ws if e["mb"] == 0]
    later = [e["end"] - e["start"] for e in ws if e["mb"] > 0]
    assert sum(later) / len(later) > 1.05 * sum(first) / len(first)
    extra = {rows: w["GEMM, +="] / w["GEMM"] - 1 for rows, w in wgrad.items()}
    assert 0.15 < extra[TOKENS] < 0.25 and extra[256] > 1 and extra[1024] < extra[256]
    assert ("At 4096 tokens the addition costs a fifth of the GEMM; at 256 tokens it costs more "
            "than the GEMM itself") in text
    assert all(w["fused"] < w["GEMM, +="] and w["fused"] <= 1.2 * w["GEMM"] for w in wgrad.values())
    assert "costs the GEMM's time" in text and "emulated B/F of a block is above 2" in text
    assert t_b / t_f > 2
    # ZB-V and DualPipe: the report's formulas beside the simulator at the real-size times
    real = dict(t_f=t_f, t_b=t_i + t_w, t_w=t_w)

    def idle(schedule):
        timeline = ps.simulate(schedule, M, **real)
        return max(e["end"] for e in timeline) - M * (t_f + t_i + t_w)
    assert idle(ps.one_f_one_b(P, M)) == pytest.approx((P - 1) * (t_f + t_i + t_w), rel=1e-9)
    assert idle(ps.zb_h1(P, M)) == pytest.approx((P - 1) * (t_f + t_i - t_w), rel=1e-9)
    assert "For 1F1B and ZB-H1 the report's formulas and the simulator agree" in text
    # DualPipeV: the report's formula over the simulator, and the two factors that make it up
    report = ps.dualpipe_bubble(2 * P, t_f / 2, (t_i + t_w) / 2, t_w / 2)
    v = ps.dualpipe_v(P, M)
    apart = idle(v)
    unit = max(e["end"] for e in ps.simulate(v, M, t_fb=t_f + t_i + t_w, **real)) - \
        M * (t_f + t_i + t_w)
    assert f"the report's number is {report / apart:.2f} times the simulator's first one" in text
    assert f"**The pair as one unit: × {unit / apart:.2f}.**" in text
    assert f"**The formula assumes I = F: × {report / unit:.2f}.**" in text
    assert f"Here I = {t_i / t_f:.2f} F, and the formula is {100 * (report / unit - 1):.0f} % " \
           f"above the simulator" in text
    # the back-to-back discussion (08b, section 1) quotes the same block's ratios
    assert f"with chapter 08's 7B-block times (I = {t_i / t_f:.2f} F, W = {t_w / t_f:.2f} F)" in text
    # with I = F the formula is the simulator's, pairs as units
    same = dict(t_f=t_f, t_b=t_f + t_w, t_w=t_w, t_fb=2 * t_f + t_w)
    at_i_f = max(e["end"] for e in ps.simulate(v, M, **same)) - M * (2 * t_f + t_w)
    assert at_i_f == pytest.approx(ps.dualpipe_bubble(2 * P, t_f / 2, (t_f + t_w) / 2, t_w / 2),
                                   rel=1e-9)
    # the bidirectional DualPipe on the same ranks, pairs as units
    dual = max(e["end"] for e in ps.simulate(ps.dualpipe(P, M), M, t_fb=t_f + t_i + t_w,
                                             **real)) - M * (t_f + t_i + t_w)
    assert f"on the same 4 ranks idles {dual * 1e3:.2f} ms against DualPipeV's " \
           f"{unit * 1e3:.2f}" in text


def test_v_schedule_prose_numbers():
    """ZB-V and DualPipeV at p = 4, m = 8, F = I = W: every number the section quotes."""
    text = " ".join(_chapter_markdown().split())
    p, m = 4, 8
    sims = {name: ps.simulate(s, m, t_f=1, t_b=2, t_w=1) for name, s in
            [("ZB-H1", ps.zb_h1(p, m)), ("ZB-V", ps.zb_v(p, m)), ("DualPipeV", ps.dualpipe_v(p, m))]}
    idle = {n: max(e["end"] for e in t) - 3 * m for n, t in sims.items()}
    assert idle["ZB-V"] == pytest.approx(idle["ZB-H1"] / 2) == pytest.approx((p - 1) * 0.5)
    assert idle["DualPipeV"] == pytest.approx(idle["ZB-V"])       # "idles the same here"
    assert f"here {ps.zb_v_bubble(p, m):.3f} against ZB-H1's {ps.zb_h1_bubble(p, m):.3f}" in text
    assert ps.bubble_fraction(sims["ZB-V"]) == pytest.approx(ps.zb_v_bubble(p, m))
    assert max(ps.peak_in_flight(a) for a in ps.zb_v(p, m)) == 2 * p     # p micro-batches
    assert max(ps.peak_in_flight(a) for a in ps.one_f_one_b(p, m)) == p
    assert max(ps.peak_in_flight(a) for a in ps.dualpipe_v(p, m)) == 2 * p + 1   # one chunk more
    assert "p = 4 micro-batches. DualPipeV, with its pairs run one after the other, idles the " \
           "same here and holds one chunk more" in text
    assert "half ZB-H1's idle time at 1F1B's peak memory" in text
    # at F = I = W the report's DualPipe formula, in chunk units, is twice the simulator's
    assert ps.dualpipe_bubble(2 * p, 0.5, 1, 0.5) == pytest.approx(2 * idle["DualPipeV"])
    # the bidirectional DualPipe: less idle, p + 1 micro-batches, two copies of the parameters
    dual = ps.dualpipe(p, m)
    t = ps.simulate(dual, m, t_f=1, t_b=2, t_w=1)
    assert max(e["end"] for e in t) - 3 * m == pytest.approx(1.0)
    assert max(ps.peak_in_flight(a) for a in dual) == p + 1 and dual.placement == "dual"
    assert "DualPipe idles less still, 1 against 1.5, but it holds two copies of the " \
           "parameters and p + 1 = 5 micro-batches" in text


def test_zb_v_authors_zero_and_section_6_prose_numbers():
    """ZB-V's 0 against one step, m < p, looped BFS and ZeRO-3's gathers (chapter 08b, sections 1
    and 3): every number the prose quotes, recomputed (no launch); the back-to-back table's rows
    are 08b's stored outputs, and the 7B block's times 08b prints are the ones chapter 08 prints."""
    import pathlib
    import re

    import nbformat
    root = pathlib.Path(__file__).resolve().parent.parent / "notebooks"

    def stored_outputs(name):
        cells = nbformat.read(root / f"{name}.ipynb", as_version=4).cells
        return "\n".join(o.get("text", "") for c in cells if c.cell_type == "code"
                         for o in c.get("outputs", []))
    text = " ".join(_chapter_markdown().split())
    outputs = stored_outputs("08b_pipelines_in_practice")
    # 08b runs chapter 08's real-size stage again for F, I and W: the same times, to the digit
    times = r"F (\d+\.\d\d) ms +(?:B \d+\.\d\d ms +)?I (\d+\.\d\d) ms +W (\d+\.\d\d) ms"
    in_08 = re.findall(times, stored_outputs("08_pipeline_parallel"))
    in_08b = re.findall(times, outputs)
    assert len(in_08) == 1 and in_08 == in_08b, (in_08, in_08b)
    p = 4
    # one synchronous step against steps back to back (post-validation)
    rows = {(label.strip(), name.strip()): (float(one), float(steady)) for label, name, one, steady
            in re.findall(r"^\s*(.+?), +(1F1B|ZB-H1|ZB-V): +(\d\.\d+) +(\d\.\d+)$", outputs, re.M)}
    assert rows["F = I = W, m = 8", "ZB-V"] == (round(ps.zb_v_bubble(p, 8), 3), 0.0)
    assert 0.01 < rows["F = I = W, m = 6", "ZB-V"][1] < rows["F = I = W, m = 6", "ZB-V"][0]
    assert 0.03 < rows["7B block's F, I, W, m = 8", "ZB-V"][1] < 0.10     # "several per cent"
    for label in ("F = I = W, m = 8", "7B block's F, I, W, m = 8"):
        for name in ("1F1B", "ZB-H1"):
            one, steady = rows[label, name]
            assert one == steady
    assert "the barrier kept (one step: 0.059)" in text and "m < 2p − 1 (at m = 6 < 7" in text
    assert "back-to-back idle is several per cent, not 0" in text
    # fewer micro-batches than stages
    assert ps.theory_bubble(p, 2) == 0.6 and "the stages idle 60 % of the step" in text
    assert [ps.peak_in_flight(a) for a in ps.one_f_one_b(p, 2)] == [2, 2, 2, 1]
    # looped BFS: interleaving's bubble, GPipe's memory
    bfs, inter = ps.looped_bfs(p, 8, 2), ps.interleaved_1f1b(p, 8, 2)
    assert ps.bubble_fraction(ps.simulate(bfs, 8)) == pytest.approx(
        ps.bubble_fraction(ps.simulate(inter, 8)))
    assert max(ps.peak_in_flight(a) for a in bfs) == 2 * 8
    # ZeRO-3 inside a pipeline: Llama-2 7B, pp = 4, dp = 8, bf16
    from distlab import pipeline_parallel as pp
    h, ffn = pp.LLAMA2_7B["hidden"], pp.LLAMA2_7B["ffn"]
    stage = 8 * (4 * h * h + 3 * h * ffn) * 2
    n, _ = ps.parameter_gathers(ps.one_f_one_b(p, 8)[0], "every action")
    assert f"{n} gathers of a {stage / 1e9:.1f} GB stage, {n * stage * 7 / 8 / 1e9:.0f} GB " \
           f"received per step here, against {stage * 7 / 8 / 1e9:.1f} GB once" in text
    assert ps.parameter_gathers(bfs[0], "while in use") == (3, 1)
    assert "so it gathers 3 times per step while holding one chunk" in text


def test_end_stages_prose_numbers():
    """08b, section 3: Llama 3 8B's embedding and head against one of its layers, as the prose
    quotes them (its released config: vocabulary 128,256, hidden 4,096, 8 key/value heads of 128,
    MLP 14,336, 32 layers); the shape adds up to the model's 8.0B."""
    V, H, KV, FFN, L = 128_256, 4096, 8 * 128, 14_336, 32
    layer = 2 * H * H + 2 * H * KV + 3 * H * FFN + 2 * H
    table = V * H
    assert 8.0e9 < L * layer + 2 * table + H < 8.1e9
    text = " ".join(_chapter_markdown().split())
    assert f"its {table / 1e6:.0f}M parameters" in text
    assert (f"a 4096 × 128,256 GEMM on every token, about as much matrix work as "
            f"{table / layer:.1f} of the {layer / 1e6:.0f}M layers") in text
    assert "32 layers cut 8 / 8 / 8 / 8 do not balance" in text
