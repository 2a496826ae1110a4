"""The battery every exercise checker goes through in its chapter's tests (issue 44).

A checker is proven by the verdicts it gives, not by the solution it was written with:

- `correct`: the workbook's solution (or a close variant);
- `different`: a correct solution written another way (another algorithm, another collective of
  the same bytes, a loop where the solution vectorises) — it must PASS;
- `wrong`: a plausible mistake (an off-by-one, the wrong reduction, a missing division);
- `cheat`: what skips the work (the course's own answer, torch's built-in where the exercise is to
  write it, a copy instead of a message, the world group where a subgroup was given);
- `decoy`: numbers right on the obvious case, algorithm wrong (a constant that matches the
  default shape, rank 0's value everywhere, a result that ignores the group) — the three must be
  REFUSED, each with the checker's one sentence: a `CheckFailed` (a `UsedCourseCode` is one) whose
  message is a single line — never another exception, never a traceback from deep inside torch.

    from checker_battery import battery
    battery(ch03.check_ring_all_gather,
            correct=[solution], different=[with_send_recv],
            wrong=[off_by_one], cheat=[torch_all_gather], decoy=[rank_zero_only])

`call(check, fn)` says how to call a checker that takes more than the learner's function.
Each refusal's sentence is returned, so a test can also assert what it names.
"""
import contextlib
import io

from distlab.checks import CheckFailed

ACCEPTED = ("correct", "different")
REFUSED = ("wrong", "cheat", "decoy")


def verdict(check, fn, call=None):
    """('passed', printed) or ('refused', sentence); anything else raised is a checker defect and
    propagates with a note of which candidate raised it."""
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out):
            (call or (lambda c, f: c(f)))(check, fn)
    except CheckFailed as e:
        return "refused", str(e)
    return "passed", out.getvalue()


def _one_sentence(kind, name, said):
    assert said.strip(), f"the {kind} candidate {name} was refused with an empty message"
    assert "\n" not in said.strip(), (
        f"the {kind} candidate {name} was refused with more than one line:\n{said}")
    assert "Traceback" not in said, f"the {kind} candidate {name}'s refusal holds a traceback"


def battery(check, *, correct=(), different=(), wrong=(), cheat=(), decoy=(), call=None,
            require=REFUSED + ACCEPTED):
    """Assert the checker accepts every correct and differently-written solution and refuses
    every wrong, cheating and decoy one, in one sentence each. Every kind in `require` must have
    at least one candidate (a battery without a decoy proves less than it says). Returns
    {kind: [sentence or printed text, ...]}."""
    given = dict(correct=correct, different=different, wrong=wrong, cheat=cheat, decoy=decoy)
    missing = [k for k in require if not given[k]]
    assert not missing, f"the battery for {getattr(check, '__name__', check)} has no {missing}"
    said = {}
    for kind, candidates in given.items():
        if callable(candidates):
            candidates = [candidates]
        said[kind] = []
        for fn in candidates:
            name = getattr(fn, "__name__", repr(fn))
            result, text = verdict(check, fn, call)
            if kind in ACCEPTED:
                assert result == "passed", (
                    f"{getattr(check, '__name__', check)} refused the {kind} solution {name}: "
                    f"{text}")
                assert "✅" in text, f"{name} passed without the checker saying so"
            else:
                assert result == "refused", (
                    f"{getattr(check, '__name__', check)} accepted the {kind} solution {name}")
                _one_sentence(kind, name, text)
            said[kind].append(text)
    return said


def ring_all_reduce(flat, ranks=None):
    """A hand-written ring all-reduce (sum) of a flat tensor over `ranks` (global ranks; the
    world by default), for answers written differently: a reduce-scatter then an all-gather, one
    isend/irecv pair per hop, chunks of unequal size where the length does not divide. Runs
    inside a rank."""
    import torch
    import torch.distributed as dist
    ranks = list(ranks or range(dist.get_world_size()))
    n, me = len(ranks), ranks.index(dist.get_rank())
    chunks = list(flat.tensor_split(n))

    def hop(out, into):
        got = torch.empty_like(chunks[into])
        for work in (dist.isend(chunks[out].contiguous(), ranks[(me + 1) % n]),
                     dist.irecv(got, ranks[(me - 1) % n])):
            work.wait()
        return got
    for step in range(n - 1):
        out, into = (me - step) % n, (me - step - 1) % n
        chunks[into] = chunks[into] + hop(out, into)
    for step in range(n - 1):
        out, into = (me + 1 - step) % n, (me - step) % n
        chunks[into] = hop(out, into)
    return torch.cat(chunks)
