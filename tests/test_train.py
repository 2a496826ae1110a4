"""`distlab.train` on the CPU: it trains, it checkpoints, and it resumes exactly.

Its ranks come from this process's warm launcher, which runs train.main exactly as torchrun's
workers do; torchrun's own path (its environment, its restart after kill -9, two agents meeting
at a rendezvous, only rank 0 logging) is tests/test_checkpoint.py's, and chapter 10b's. A
torchrun of four workers here cost ≈ 30 CPU-seconds for what those runs already prove.
"""
import contextlib
import io

import pytest
import torch

from distlab import train

def here(capsys, *options):
    """The same run as `python -m distlab.train` without torchrun starts it: its ranks come from
    this process's warm launcher (a second, where torchrun takes several) and run train.main
    exactly as torchrun's do."""
    capsys.readouterr()
    train._launch_here(train.parse(["--dtype", "float64", "--steps", "5", *options]))
    return capsys.readouterr().out


def checkpoint(folder):
    """The newest checkpoint in `folder` (a DCP checkpoint, read in this one process)."""
    from distlab.checkpoint import read
    state = read(str(folder))
    return dict(step=state["meta"]["step"], losses=state["meta"]["losses"], model=state["model"])


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """dp=2 x tp=2, five steps, never stopped: what the stopped runs must end equal to."""
    folder = tmp_path_factory.mktemp("whole")
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        train._launch_here(train.parse(["--dtype", "float64", "--steps", "5", "--dp", "2",
                                        "--pp", "1", "--tp", "2", "--ckpt", str(folder)]))
    return folder, out.getvalue()


@pytest.fixture(scope="module")
def stopped(tmp_path_factory):
    """dp=2 x tp=2 stopped after its second step (it saved step 2): trained once, resumed from
    copies."""
    folder = tmp_path_factory.mktemp("stopped")
    train._launch_here(train.parse(["--dtype", "float64", "--steps", "5", "--dp", "2", "--pp", "1",
                                    "--tp", "2", "--ckpt", str(folder), "--stop-after", "1"]))
    return folder


def copy_of(stopped, folder):
    import shutil
    shutil.copytree(stopped, folder, dirs_exist_ok=True)


def test_it_trains_and_only_rank_0_logs(uninterrupted):
    folder, out = uninterrupted
    # the launcher prefixes each rank's lines with its rank: every line is rank 0's
    assert all(line.startswith("[rank 0] ") for line in out.splitlines()), out
    lines = [line.removeprefix("[rank 0] ") for line in out.splitlines()]
    assert "4 ranks (gloo) as dp=2 x pp=1 x tp=2; steps 0..4" in lines
    assert sum(line.startswith("step ") for line in lines) == 5   # once, not once per rank
    state = checkpoint(folder)
    assert state["step"] == 5 and len(state["losses"]) == 5


def test_a_resumed_run_continues_with_identical_losses(uninterrupted, stopped, tmp_path, capsys):
    # torchrun's restart after kill -9 runs in ch10b under nbval; test_checkpoint reads its output.
    whole = checkpoint(uninterrupted[0])
    copy_of(stopped, tmp_path)
    stopped = checkpoint(tmp_path)
    assert stopped["step"] == 2 and stopped["losses"] == whole["losses"][:2]
    out = here(capsys, "--dp", "2", "--pp", "1", "--tp", "2", "--ckpt", str(tmp_path))
    assert f"resumed from {tmp_path / 'step-000002'} at step 2" in out
    assert "steps 2..4" in out
    resumed = checkpoint(tmp_path)
    assert resumed["losses"] == whole["losses"]          # bit for bit: same data, same order
    for name, value in whole["model"].items():
        assert torch.equal(resumed["model"][name], value), name


def test_a_checkpoint_resumes_under_another_layout(uninterrupted, stopped, tmp_path, capsys):
    """DCP reshards the saved DTensor shards, so dp=2 x tp=2 can continue as pp=2 x tp=2."""
    whole = checkpoint(uninterrupted[0])
    copy_of(stopped, tmp_path)
    here(capsys, "--dp", "1", "--pp", "2", "--tp", "2", "--ckpt", str(tmp_path))
    resumed = checkpoint(tmp_path)
    # Another layout sums in another order: equal to rounding, not bit for bit.
    assert resumed["losses"] == pytest.approx(whole["losses"], abs=1e-12)
    for name, value in whole["model"].items():
        assert torch.allclose(resumed["model"][name], value, atol=1e-12, rtol=0), name


def test_no_option_is_a_prefix_of_a_torchrun_option():
    """torchrun accepts abbreviations of its own options, so a prefix of one would be stolen."""
    from torch.distributed.run import get_args_parser
    theirs = [o for a in get_args_parser()._actions for o in a.option_strings]
    ours = [o for a in train.parser()._actions for o in a.option_strings if o not in ("-h", "--help")]
    assert "--dp" in ours and "--stop-after" in ours
    for mine in ours:
        clashes = [o for o in theirs if o.startswith(mine)]
        assert not clashes, f"{mine} is a prefix of torchrun's {clashes}"


def test_a_layout_that_does_not_match_the_ranks_is_refused(capsys):
    """Two ranks started for a layout of four: rank 0 alone says why, in one sentence, and the
    others leave quietly (train.refuse). Started by this process's warm launcher, as torchrun's
    ranks run train.main."""
    import distlab
    args = train.parse(["--dtype", "float64", "--steps", "5", "--dp", "4", "--pp", "1",
                        "--tp", "1"])
    with pytest.raises(distlab.RankFailed) as failed:
        distlab.run(train._on_rank, 2, args, init=False, timeout=120, threads=1)
    assert failed.value.rank == 0 and isinstance(failed.value.exception, SystemExit)
    said = "--dp 4 x --pp 1 x --tp 1 = 4 ranks, but 2 were started."
    assert failed.value.exception.code == said
    out = capsys.readouterr()
    assert (out.out + out.err).count(said) <= 1            # said once, not once per rank


def test_every_option_says_what_it_is_for():
    for action in train.parser()._actions:
        assert action.help, f"{action.option_strings} has no help text"


def test_a_checkpoint_resumes_only_in_its_own_dtype(tmp_path):
    from distlab.models import make_gpt
    model = make_gpt(seed=0, n_layers=4, **train.CONFIG)          # float32
    import json
    import warnings
    import torch.distributed.checkpoint as dcp
    with warnings.catch_warnings():      # written here, by one process
        warnings.simplefilter("ignore")
        dcp.save({**{f"model.{k}": v for k, v in model.state_dict().items()},
                  "meta": json.dumps(dict(step=2, losses=[1.0, 0.9]))},
                 checkpoint_id=str(tmp_path / "step-000002"))
    (tmp_path / "latest").write_text("step-000002")
    args = train.parse(["--dp", "2", "--pp", "1", "--tp", "1", "--steps", "3", "--ckpt",
                        str(tmp_path), "--dtype", "float64"])
    with pytest.raises(SystemExit) as e:
        train._launch_here(args)         # python -m distlab.train: ranks started here
    assert e.value.code == (
        f"{tmp_path / 'step-000002'} was saved in float32, so it cannot continue the same run "
        f"in float64; resume with --dtype float32, or start with another --ckpt folder.")


@pytest.mark.parametrize("saved, resumed, option", [
    (["--optim", "sgd"], ["--optim", "adam"], "optim"), (["--optim", "adam"], ["--optim", "sgd"], "optim"),
    ([], ["--seed", "1"], "seed"), ([], ["--batch", "4"], "batch")])
def test_a_resume_with_another_optimizer_seed_or_batch_is_refused_in_one_sentence(
        tmp_path, capsys, saved, resumed, option):
    one_rank = ["--dp", "1", "--pp", "1", "--tp", "1", "--layers", "1", "--ckpt", str(tmp_path)]
    here(capsys, *one_rank, *saved, "--stop-after", "0")            # saves step 1
    args = train.parse(["--dtype", "float64", "--steps", "5", *one_rank, *saved, *resumed])
    was = vars(train.parse(["--dtype", "float64", *saved]))[option]
    with pytest.raises(SystemExit) as e:
        train._launch_here(args)
    assert e.value.code == (
        f"{tmp_path / 'step-000001'} was saved with --{option} {was}, so it cannot continue the "
        f"same run with --{option} {resumed[-1]}; resume with --{option} {was}, or start with "
        f"another --ckpt folder.")


@pytest.mark.parametrize("options, error", [
    (["--micro", "0"], "argument --micro: must be at least 1; got 0"),
    (["--lr", "nan"], "argument --lr: must be a positive, finite number; got nan"),
    (["--lr", "inf"], "argument --lr: must be a positive, finite number; got inf"),
    (["--lr", "-0.1"], "argument --lr: must be a positive, finite number; got -0.1"),
    (["--steps", "-2"], "argument --steps: must be at least 0; got -2"),
    (["--dp", "0"], "argument --dp: must be at least 1; got 0"),
    (["--batch", "2.5"], "argument --batch: must be a whole number; got '2.5'"),
    (["--save-every", "-1"], "argument --save-every: must be at least 0; got -1"),
    (["--dp", "3"], "--batch 8 does not split into --dp 3 x --micro 2 equal micro-batches"),
    (["--pp", "5"], "--pp 5 needs at least 5 blocks (one per stage); got --layers 4"),
    (["--tp", "3"], "--tp 3 does not divide the model's 2 attention heads"),
    # how to save, but not where: the run used to write nothing, silently
    (["--save-every", "2"], "--save-every 2 needs a checkpoint folder: add --ckpt DIR, or drop "
                            "it"),
    (["--async-save", "--dense-ckpt"], "--async-save and --dense-ckpt need a checkpoint folder: "
                                       "add --ckpt DIR, or drop them"),
])
def test_nonsense_options_are_refused_in_one_argparse_sentence(options, error, capsys):
    with pytest.raises(SystemExit) as e:
        train.parse(options)
    assert e.value.code == 2                                  # argparse's usage error
    assert capsys.readouterr().err.splitlines()[-1] == f"python -m distlab.train: error: {error}"
