"""The checker framework (distlab.checks): what `forbid` refuses (also copies of the course's
code and the checkers' own helpers) and the sentences a hang or a lonely collective becomes."""
import importlib
import importlib.util
import sys

import pytest
import torch
import torch.distributed as dist

import distlab
from distlab import debug
from distlab.checks import CheckFailed, UsedCourseCode, ch11, forbid, run_learner


def _copy_of_debug():
    # The same file under another module name: new function objects, new code objects.
    spec = importlib.util.spec_from_file_location("distlab._debug_copy", debug.__file__)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_forbid_refuses_the_file_loaded_under_another_name():
    copy = _copy_of_debug()
    assert copy.average_gradients is not debug.average_gradients
    with pytest.raises(UsedCourseCode, match="course's own average_gradients"):
        with forbid(debug.average_gradients, exercise="average the gradients yourself"):
            copy.average_gradients(None)
    with forbid(debug.average_gradients):
        assert copy.problem is not None and len(copy.sample_fingerprints(torch.ones(2, 2))) == 2


def test_forbid_raises_a_refusal_the_learner_caught_when_the_block_ends():
    copy = _copy_of_debug()

    def swallows(model):
        try:
            copy.broadcast_parameters(model)
        except Exception:
            pass
        return "went on"
    with pytest.raises(UsedCourseCode, match="course's own broadcast_parameters"):
        with forbid(debug.broadcast_parameters):
            assert swallows(None) == "went on"


def _reloads_and_calls(rank, world_size):
    # In a rank (forked: the test process keeps its own distlab.debug).
    with forbid(debug.average_gradients, exercise="average the gradients yourself"):
        fresh = importlib.reload(debug)
        model = torch.nn.Linear(2, 2)
        model(torch.ones(1, 2)).sum().backward()
        fresh.average_gradients(model)


def test_forbid_refuses_a_reloaded_module_in_a_rank():
    with pytest.raises(CheckFailed, match="course's own average_gradients; the exercise is to "
                                          "average the gradients yourself"):
        run_learner(_reloads_and_calls, 1, name="average_gradients")


def test_forbid_refuses_checker_helpers_when_the_learner_calls_them():
    with pytest.raises(UsedCourseCode, match=r"checker's own _pipe_expected \(distlab/checks/"
                                             r"ch11/pipeline.py\), which builds the answer"):
        with forbid():
            ch11._pipe_expected(0, 2)
    # The checker's own code may use its helpers inside the block: here a line compiled as if it
    # stood in the checker's package (ch11/).
    checker_line = compile("ch11._pipe_expected(0, 2)", ch11.__file__, "eval")
    loss, _ = ch11._pipe_expected(0, 2)
    with forbid():
        assert eval(checker_line)[0] == loss
        stage = ch11._pipe_stage(0)      # not an answer-building name: the framework lets it be
        assert stage(ch11._pipe_input(0)).shape == (2, 4)
    with forbid(helpers=False):
        ch11._pipe_expected(0, 2)


def test_forbid_keeps_an_earlier_profile_function_and_restores_it():
    seen = []

    def profiler(frame, event, arg):
        if event == "call":
            seen.append(frame.f_code.co_name)
    sys.setprofile(profiler)
    try:
        with forbid(debug.average_gradients):
            debug.sample_fingerprints(torch.ones(1, 1))
        assert sys.getprofile() is profiler
    finally:
        sys.setprofile(None)
    assert "sample_fingerprints" in seen


# ---- the sentences -----------------------------------------------------------------------------

def ring_sends_first(rank, world_size):
    t = torch.ones(1 << 20)                     # 4 MB: gloo's send waits for the receiver
    dist.send(t, (rank + 1) % world_size)
    dist.recv(t, (rank - 1) % world_size)
    return t[0].item()


def test_a_ring_deadlock_names_the_learners_send_and_what_to_do():
    distlab.run(lambda rank, world_size: None, 2)   # the forkserver is up: the limit is all hang
    with pytest.raises(distlab.RunTimeout) as e:
        run_learner(ring_sends_first, 2, name="ring_hop", timeout=2, trace=True)
    text = str(e.value)
    assert text.startswith("ring_hop with world_size=2 did not finish within the check's 2 s")
    assert "rank 0: waits in send, called from ring_sends_first" in text
    assert "dist.send(t, (rank + 1) % world_size)" in text
    assert "_tracer" not in text and "timeout=" not in text
    assert "dist.batch_isend_irecv" in text


def only_rank_0_reduces(rank, world_size):
    t = torch.ones(3)
    if rank == 0:
        dist.barrier()          # met by the others' end-of-run barrier: they leave after it
        dist.barrier()
    return t.tolist()


def test_a_collective_only_rank_0_reached_is_one_sentence():
    with pytest.raises(distlab.RankFailed) as e:
        distlab.run(only_rank_0_reduces, 2, timeout=20)
    first = str(e.value).splitlines()[0]
    assert first.startswith("only rank 0 reached the barrier at `dist.barrier()` "
                            "(only_rank_0_reduces, line")
    assert "rank 1 had returned without calling it" in first


def _imports_checks(rank, world_size):
    import sys
    before = "nbformat" in sys.modules
    import distlab.checks.ch11  # noqa: F401
    return before, "nbformat" in sys.modules


def test_a_rank_importing_the_checkers_does_not_import_nbformat():
    # nbformat pulls in jsonschema (≈3 CPU-s a process); every rank of every check imports
    # distlab.checks, and only the parent needs the exercise stub's message.
    before, after = distlab.run(_imports_checks, 1)[0]
    assert after == before


def test_an_in_process_refusal_reaches_the_learner_as_one_check_sentence():
    # forbid + call_learner, as the in-process checkers use them: the learner's code calls the
    # course's function (refused inside), or catches that refusal and fails or goes on.
    copy = _copy_of_debug()

    def calls(model):
        return copy.average_gradients(model)

    def catches_then_fails(model):
        try:
            copy.average_gradients(model)
        except Exception:
            pass
        raise ValueError("the learner's own bug after the refusal")

    def catches_and_goes_on(model):
        try:
            copy.average_gradients(model)
        except Exception:
            pass
        return "went on"

    for learner in (calls, catches_then_fails, catches_and_goes_on):
        with pytest.raises(CheckFailed, match="course's own average_gradients") as info:
            with forbid(debug.average_gradients, exercise="average the gradients yourself"):
                from distlab.checks import call_learner
                call_learner(learner, None)
        error = info.value
        assert "\n" not in str(error), learner.__name__
        # No "During handling of the above exception" chain in what the learner sees.
        assert error.__cause__ is None and error.__suppress_context__, learner.__name__
