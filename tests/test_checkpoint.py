"""DCP checkpoints of distlab.train: Adam's state and the data position survive a stop, a kill -9
and a change of layout, bit for bit; a checkpoint of another model or dtype is refused."""
import json
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch

from distlab import checkpoint, train

ROOT = pathlib.Path(__file__).resolve().parent.parent
COMMON = ["--dtype", "float64", "--optim", "adam", "--lr", "0.01", "--steps", "4", "--layers", "2"]


def run_here(*options):
    """python -m distlab.train, ranks started by distlab.run (fast: torch preloaded)."""
    args = train.parse(COMMON + [str(o) for o in options])
    train._launch_here(args)
    return checkpoint.read(args.ckpt)


@pytest.fixture(scope="module")
def whole_folder(tmp_path_factory):
    """The checkpoint folder of the uninterrupted run (tp=2: two rank files); only read."""
    folder = tmp_path_factory.mktemp("whole")
    run_here("--dp", 1, "--pp", 1, "--tp", 2, "--ckpt", folder)
    return str(folder)


@pytest.fixture(scope="module")
def uninterrupted(whole_folder):
    return checkpoint.read(whole_folder)


@pytest.fixture(scope="module")
def stopped_folder(tmp_path_factory):
    """A tp=2 run stopped after its second step (it saved step 2); tests resume COPIES of it,
    so the run that several of them start from is trained once."""
    folder = tmp_path_factory.mktemp("stopped")
    run_here("--dp", 1, "--pp", 1, "--tp", 2, "--ckpt", folder, "--stop-after", 1)
    return str(folder)


def stopped_in(stopped_folder, folder):
    """A copy of the stopped run's checkpoint folder in `folder`, read back."""
    shutil.copytree(stopped_folder, folder, dirs_exist_ok=True)
    return checkpoint.read(str(folder))


def test_the_written_adam_is_torchs_adam_bit_for_bit():
    torch.manual_seed(0)
    mine, theirs = torch.nn.Linear(5, 3).double(), torch.nn.Linear(5, 3).double()
    theirs.load_state_dict(mine.state_dict())
    ours, ref = train.Adam(mine, lr=0.01), torch.optim.Adam(theirs.parameters(), lr=0.01, foreach=False)
    for step in range(3):
        x = torch.randn(4, 5, dtype=torch.float64)
        for model in (mine, theirs):
            model.zero_grad()
            model(x).pow(2).sum().backward()
        ours.step(), ref.step()
    for a, b in zip(mine.parameters(), theirs.parameters()):
        assert torch.equal(a, b)
    assert torch.equal(ours.state["weight"]["exp_avg_sq"], ref.state[theirs.weight]["exp_avg_sq"])


def test_saved_under_tp2_resumed_under_pp2_equals_the_uninterrupted_run_bit_for_bit(
        uninterrupted, stopped_folder, tmp_path):
    stopped = stopped_in(stopped_folder, tmp_path)
    assert stopped["meta"]["step"] == 2 and stopped["meta"]["next_sample"] == 2 * 8
    assert stopped["optim"]["step"] == 2 and len(stopped["rng"]) == 2
    # Another layout (4 ranks: blocks cut into 2 stages, each tensor-parallel over 2) reads the
    # same files: each rank loads only its own stage's layers and keeps its shard of them.
    resumed = run_here("--dp", 1, "--pp", 2, "--tp", 2, "--ckpt", tmp_path)
    assert resumed["meta"]["losses"] == uninterrupted["meta"]["losses"]
    assert len(resumed["rng"]) == 4
    for part in ("model", "optim"):
        assert resumed[part].keys() == uninterrupted[part].keys()
        for name, value in uninterrupted[part].items():
            assert torch.equal(resumed[part][name], value), f"{part}.{name}"


def test_saved_under_tp2_resumed_under_dp2_matches_to_rounding(uninterrupted, stopped_folder,
                                                              tmp_path):
    """tp=1 sums each row-parallel product in one piece, not two: equal to rounding only."""
    stopped_in(stopped_folder, tmp_path)
    resumed = run_here("--dp", 2, "--pp", 1, "--tp", 1, "--ckpt", tmp_path)
    # Adam divides by sqrt(v): the last bits of float64 grow to ~5e-13 in the parameters.
    assert resumed["meta"]["losses"] == pytest.approx(uninterrupted["meta"]["losses"], abs=1e-11)
    for name, value in uninterrupted["model"].items():
        assert torch.allclose(resumed["model"][name], value, atol=1e-11, rtol=0), name


@pytest.mark.parametrize("change, sentence", [
    (["--dtype", "float32"], "was saved in float64, so it cannot continue the same run in float32; "
                             "resume with --dtype float64, or start with another --ckpt folder."),
    (["--layers", "3"], "holds a different model (it has 2 blocks, this run's has 3); start with "
                        "another --ckpt folder or the model options it was saved with."),
])
def test_a_resume_of_another_dtype_or_model_is_refused_in_one_sentence(uninterrupted, change,
                                                                       sentence, tmp_path):
    run_here("--dp", 1, "--pp", 1, "--tp", 2, "--ckpt", tmp_path, "--stop-after", 0)
    args = train.parse(COMMON + ["--dp", "1", "--pp", "1", "--tp", "2", "--ckpt", str(tmp_path)]
                       + change)
    with pytest.raises(SystemExit) as e:
        train._launch_here(args)
    assert e.value.code == f"{checkpoint.latest(str(tmp_path))} {sentence}"


def test_still_running_finds_a_process_by_the_folder_in_its_command_line(tmp_path):
    marker = str(tmp_path / "run")
    # one process that never forks (a shell's child would carry the marker until its exec)
    left = subprocess.Popen([sys.executable, "-S", "-c", "import time; time.sleep(30)", marker],
                            start_new_session=True)
    try:
        found, deadline = [], time.monotonic() + 20
        while found != [left.pid] and time.monotonic() < deadline:   # its exec may still run
            found = train.still_running(marker)
            time.sleep(0.05)
        assert found == [left.pid]
    finally:
        left.kill()
        left.wait()
    assert train.still_running(marker) == []


def _chapter_10b_output(marker):
    cells = json.loads((ROOT / "notebooks" / "10b_running_at_scale.ipynb").read_text())["cells"]
    found = [c for c in cells if c["cell_type"] == "code" and marker in "".join(c["source"])]
    assert len(found) == 1, f"{len(found)} cells of chapter 10b hold {marker!r}"
    return "".join("".join(o.get("text", "")) for o in found[0]["outputs"])


def test_a_worker_killed_with_sigkill_is_restarted_by_torchrun_and_resumes_exactly():
    """torchrun --max-restarts=2: rank 1 kills itself (kill -9) before step 3 on the first
    attempt; torchrun stops rank 0, starts both again, and they resume from the step-2 save.
    Chapter 10b runs exactly this job (this file's COMMON options, tp=2) under nbval, which
    proves its stored output reproducible in `make test`: what it printed is asserted here
    instead of a second torchrun."""
    elastic = _chapter_10b_output('"--max-restarts=2"')
    assert "rank 1: kill -9 myself before step 3" in elastic
    assert "resumed from <ckpt>/step-000002 at step 2" in elastic
    assert "torchrun's exit code: 0" in elastic
    assert "still alive after torchrun returned: 0" in elastic       # no orphan outlived it
    compared = _chapter_10b_output("after_kill = ")
    assert "losses, killed + restarted equal them bit for bit: True" in compared
    assert "every parameter and Adam moment equal bit for bit: True" in compared
    # the chapter's job is this file's: the same options, so the same run as `uninterrupted`
    cells = json.loads((ROOT / "notebooks" / "10b_running_at_scale.ipynb").read_text())["cells"]
    source = next("".join(c["source"]) for c in cells if '"--max-restarts=2"' in "".join(c["source"]))
    for option, value in zip(COMMON[::2], COMMON[1::2]):
        assert f'"{option}", "{value}"' in source, option
    assert '"--tp", "2"' in source and '"--save-every", "2", "--kill-at", "3"' in source


def test_the_slurm_scripts_torchrun_line_joins_two_agents_standing_in_for_two_nodes(
        uninterrupted, tmp_path):
    """lib/distlab/scripts/slurm_train.sh outside Slurm runs one agent; two of them, one rank
    each, meet at the c10d rendezvous endpoint as two nodes would, and train as tp=2."""
    from pathlib import Path
    from distlab.launch import _free_port            # outside the ephemeral range: no race
    script = Path(__file__).parents[1] / "lib" / "distlab" / "scripts" / "slurm_train.sh"
    port = _free_port()
    folder = str(tmp_path / "run")
    env = dict(os.environ, NNODES="2", NPROC="1", RDZV_HOST="127.0.0.1", PORT=str(port),
               RDZV_ID=f"test{port}", PYTHON=sys.executable)
    env.pop("SLURM_JOB_ID", None)
    cmd = ["bash", str(script), *COMMON, "--dp", "1", "--pp", "1", "--tp", "2", "--ckpt", folder]
    agents = [subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               text=True, start_new_session=True) for _ in range(2)]
    try:
        outs = [a.communicate(timeout=120)[0] for a in agents]
    finally:
        for a in agents:
            if a.poll() is None:
                os.killpg(a.pid, signal.SIGKILL)
        for pid in train.still_running(folder):
            os.kill(pid, signal.SIGKILL)
    assert [a.returncode for a in agents] == [0, 0], outs[0][-2000:] + outs[1][-2000:]
    logs = "".join(outs)
    assert "2 ranks (gloo) as dp=1 x pp=1 x tp=2; steps 0..3" in logs   # one world of two agents
    # only rank 0 logs: each step's line once, all from the agent that runs rank 0
    steps = [[line for line in out.splitlines() if line.startswith("step ")] for out in outs]
    assert sorted(len(s) for s in steps) == [0, 4], steps
    assert checkpoint.read(folder)["meta"]["losses"] == uninterrupted["meta"]["losses"]


# ---- a save killed midway never destroys the only good checkpoint ---------------------------------

def _killed_while_writing(rank, world_size, args, victim):
    """train.main on this rank, but rank `victim` dies (os._exit) inside its checkpoint file:
    the file is open for writing and holds a few bytes, as a SIGKILL or a lost node leaves it."""
    import torch.distributed.checkpoint.filesystem as fs
    real = fs._write_item

    def write_then_die(transforms, stream, *rest):
        if rank == victim:
            stream.write(b"half a tensor")
            stream.flush()
            os._exit(9)
        return real(transforms, stream, *rest)
    fs._write_item = write_then_die
    return train._on_rank(rank, world_size, args)


@pytest.mark.parametrize("steps", [2, 4], ids=["the same step again", "the next step"])
def test_a_save_killed_inside_the_write_leaves_the_previous_checkpoint_whole(
        uninterrupted, stopped_folder, tmp_path, steps):
    """A re-run that saves the step `latest` already points at (a requeued job, a resume with
    --steps <= the saved step) must not rewrite the only good checkpoint in place; nor may the
    save of a later step touch it."""
    import distlab
    layout = ["--dp", 1, "--pp", 1, "--tp", 2, "--ckpt", tmp_path]
    good = stopped_in(stopped_folder, tmp_path)              # saved step 2
    assert good["meta"]["step"] == 2
    # resumes at step 2, trains up to `steps` and saves it: rank 1 dies inside that save
    args = train.parse(COMMON + [str(o) for o in layout] + ["--steps", str(steps)])
    with pytest.raises(distlab.RankFailed, match="rank 1"):
        distlab.run(_killed_while_writing, 2, args, 1, init=False, timeout=60, threads=1)
    after = checkpoint.read(str(tmp_path))                   # still the good one, whole
    assert after["meta"] == good["meta"]
    for part in ("model", "optim"):
        for name, value in good[part].items():
            assert torch.equal(after[part][name], value), f"{part}.{name}"
    # ... and the run resumes from it exactly; the next good save removes the half-written one.
    resumed = run_here(*layout)
    assert resumed["meta"]["losses"] == uninterrupted["meta"]["losses"]
    assert sorted(os.listdir(tmp_path)) == ["latest", checkpoint.latest(str(tmp_path)).rpartition("/")[2]]


# ---- a damaged checkpoint is one sentence, not a traceback from DCP or pickle ------------------------

def _rank_file(folder):
    return os.path.join(folder, "step-000004", "__1_0.distcp")     # rank 1's part (tp=2)


DAMAGE = {   # what is done to a good checkpoint in <ckpt>, and the sentence that must follow
    "latest is empty": (lambda f: open(os.path.join(f, "latest"), "w").close(),
                        "{f}/latest is empty, so it names no checkpoint; write the name of a "
                        "complete step folder into it, or "),
    "no step folder": (lambda f: shutil.rmtree(os.path.join(f, "step-000004")),
                       "{f}/latest names step-000004, but {f} has no such folder; "),
    "no metadata": (lambda f: os.remove(os.path.join(f, "step-000004", ".metadata")),
                    "{f}/step-000004 has no .metadata file, so the save that wrote it never "
                    "finished; "),
    "garbage metadata": (lambda f: open(os.path.join(f, "step-000004", ".metadata"), "wb").write(
                         b"not a pickle"),
                         "{f}/step-000004/.metadata is not DCP metadata (UnpicklingError reading "
                         "it); "),
    "a rank file missing": (lambda f: os.remove(_rank_file(f)),
                            "{f}/step-000004 lacks __1_0.distcp, one of the rank files its "
                            ".metadata lists; "),
    "a rank file cut short": (lambda f: os.truncate(_rank_file(f), 100),
                              "{f}/step-000004/__1_0.distcp is cut short (100 of the "),
    "a rank file of garbage": (lambda f: open(_rank_file(f), "r+b").write(b"\0" * 64),
                               "{f}/step-000004 holds a rank file that cannot be read ("),
}


@pytest.mark.parametrize("damage", DAMAGE)
def test_a_damaged_checkpoint_is_refused_in_one_sentence_naming_what_is_missing(
        whole_folder, tmp_path, damage):
    folder = str(tmp_path / "ckpt")
    shutil.copytree(whole_folder, folder)
    harm, start = DAMAGE[damage]
    harm(folder)
    start = start.format(f=folder)
    args = train.parse(COMMON + ["--dp", "1", "--pp", "1", "--tp", "1", "--ckpt", folder])
    with pytest.raises(SystemExit) as e:
        train._launch_here(args)             # python -m distlab.train: ranks started here
    message = e.value.code
    assert isinstance(message, str) and message.startswith(start), message
    assert message.endswith("resume from another checkpoint, or start with another --ckpt "
                            "folder.") and "\n" not in message, message
    with pytest.raises(checkpoint.BrokenCheckpoint) as e:
        checkpoint.read(folder)              # the same sentence in one process
    assert str(e.value) == message


# ---- bad calls of checkpoint's public functions: one sentence each, before any file is read ---------

def _gpt():
    from distlab.models import make_gpt
    return make_gpt(seed=0, n_layers=1, **train.CONFIG)


ELSE = "resume from another checkpoint, or start with another --ckpt folder."
BAD_CALLS = {   # what is called (d: an empty folder with a file "f" in it), and what it says
    "read a folder that does not exist": (
        lambda d: checkpoint.read(f"{d}/none"), ValueError,
        "there is no checkpoint folder {d}/none; " + ELSE),
    "read a step that does not exist": (
        lambda d: checkpoint.read(f"{d}/step-000009"), ValueError,
        "there is no checkpoint folder {d}/step-000009; " + ELSE),
    "read a folder no save finished in": (
        lambda d: checkpoint.read(d), ValueError,
        "{d} holds no finished checkpoint (no latest file names one, and it has no .metadata of "
        "its own); " + ELSE),
    "read_meta of a step that does not exist": (
        lambda d: checkpoint.read_meta(f"{d}/step-000009"), ValueError,
        "there is no checkpoint folder {d}/step-000009; " + ELSE),
    "load a step that does not exist": (
        lambda d: checkpoint.load(f"{d}/step-000009", None, None), ValueError,
        "there is no checkpoint folder {d}/step-000009; " + ELSE),
    "mismatch with a step that does not exist": (
        lambda d: checkpoint.mismatch(f"{d}/step-000009", _gpt()), ValueError,
        "there is no checkpoint folder {d}/step-000009; " + ELSE),
    "reshard_problem of a step that does not exist": (
        lambda d: checkpoint.reshard_problem(f"{d}/step-000009", 2, 2), ValueError,
        "there is no checkpoint folder {d}/step-000009; " + ELSE),
    "reshard_problem at tp 0": (
        lambda d: checkpoint.reshard_problem(d, 0, 2), ValueError,
        "reshard_problem's tp must be a whole number >= 1 (tensor-parallel ranks); got 0."),
    "consolidate into a folder that does not exist": (
        lambda d: checkpoint.consolidate(d, f"{d}/none/gpt.pt"), ValueError,
        "cannot write {d}/none/gpt.pt: there is no folder {d}/none; create it, or choose another "
        "file."),
    "save into a file": (
        lambda d: checkpoint.save(f"{d}/f", 1, None, None), ValueError,
        "{d}/f is a file; pass save the folder its checkpoints go into (it makes one step folder "
        "per save there)."),
    "save a negative step": (
        lambda d: checkpoint.save(d, -1, None, None), ValueError,
        "save's step must be a whole number >= 0 (the optimizer steps done); got -1."),
    "save a fractional step": (
        lambda d: checkpoint.save(d, 2.5, None, None), ValueError,
        "save's step must be a whole number >= 0 (the optimizer steps done); got 2.5."),
    "save into a number": (
        lambda d: checkpoint.save(3, 1, None, None), TypeError,
        "save's folder must be a path (a str); got int."),
    "save_costs at pp 0": (
        lambda d: checkpoint.save_costs(__import__("distlab.layout").layout.SHAPES["Llama-2 7B"],
                                        dp=1, pp=0, tp=1), ValueError,
        "save_costs' pp must be a whole number >= 1; got 0."),
    "mtbf_seconds of no GPU": (
        lambda d: checkpoint.mtbf_seconds(0), ValueError,
        "mtbf_seconds' gpus must be a positive number; got 0."),
    "young_daly of a negative save time": (
        lambda d: checkpoint.young_daly(-60, 3600), ValueError,
        "young_daly's save_s must be a positive number of seconds; got -60."),
    "lost_fraction at interval 0": (
        lambda d: checkpoint.lost_fraction(0, 60, 3600), ValueError,
        "lost_fraction's interval_s must be a positive number of seconds; got 0."),
}


def test_bad_calls_are_refused_in_one_sentence_saying_what_to_do(tmp_path):
    d = str(tmp_path)
    (tmp_path / "f").write_text("not a checkpoint folder")
    wrong = []
    for case, (call, kind, sentence) in BAD_CALLS.items():
        try:
            call(d)
            wrong.append(f"{case}: no error")
        except Exception as e:
            if type(e) is not kind and not (kind is ValueError
                                            and isinstance(e, checkpoint.BrokenCheckpoint)):
                wrong.append(f"{case}: {type(e).__name__}: {e}")
            elif str(e) != sentence.format(d=d):
                wrong.append(f"{case}: {e}")
    assert not wrong, "\n".join(wrong)


PARTS_WITHOUT = {"nothing": ("model", "optim", "data", "rng"), "rng": ("model", "optim", "data"),
                 "data": ("model", "optim", "rng")}
# (data, the step it stops after, the parts each resume goes without): 2 ranks of 24 samples in
# batches of 2 take 6 batches an epoch, so step 5 stops mid-epoch and step 6 at the epoch's end
RESUMES = [("loader", 5, ("nothing", "rng", "data")), ("loader", 6, ("nothing",)),
           ("position", 5, ("nothing", "data"))]


def _stop_and_resume(rank, world_size, folder):
    from distlab.checkpoint import stateful
    whole = stateful.train_fsdp(rank, world_size, folder + "/whole", steps=9)
    resumed = {}
    for data, stop, withouts in RESUMES:
        ckpt = f"{folder}/{data}-{stop}"
        stateful.train_fsdp(rank, world_size, ckpt, steps=9, stop_after=stop, data=data)
        for without in withouts:
            resumed[data, stop, without] = stateful.train_fsdp(
                rank, world_size, ckpt, steps=9 - stop, resume=PARTS_WITHOUT[without], data=data)
    return whole, resumed


@pytest.fixture(scope="module")
def stop_and_resume(tmp_path_factory):
    import distlab
    folder = str(tmp_path_factory.mktemp("stateful"))
    return folder, distlab.run(_stop_and_resume, 2, folder, timeout=120)


def test_torchs_state_dict_api_resumes_the_same_run_and_every_part_counts(stop_and_resume):
    """Issue 45 (chapter 10b): FSDP2 shards saved through get_state_dict in one Stateful, with
    the data position and every rank's random state (under its own key), resume the very run a
    stop never interrupted — losses, parameters and every rank's batches bit for bit, mid-epoch
    and at the epoch's end, with torchdata's StatefulDataLoader (one worker process) as with
    DataPosition; without the random state the batches are right and the steps are not; without
    the data position the epoch starts over: the resumed run trains again on batches it took."""
    from distlab.checkpoint import stateful
    _, results = stop_and_resume
    (losses, params, _), _ = results[0]
    for rank, ((_, _, seen), resumed) in enumerate(results):
        for (data, stop, without), (got, got_params, got_seen) in resumed.items():
            case = (rank, data, stop, without)
            if without == "nothing":
                assert got == losses[stop:] and got_seen == seen[stop:], case
                if rank == 0:
                    assert all(torch.equal(got_params[k], v) for k, v in params.items()), case
            elif without == "rng":
                assert got != losses[stop:] and got_seen == seen[stop:], case
            else:
                assert got != losses[stop:] and got_seen == seen[:9 - stop], case
    with pytest.raises(ValueError, match="TrainState keeps model, optim, data, rng; not weights"):
        stateful.TrainState(None, None, None, parts=("weights",))


def test_resuming_per_rank_parts_at_another_world_size_is_refused_in_one_sentence(stop_and_resume):
    """DCP would stop a third rank with "Missing key in checkpoint state_dict: train.data.2.",
    and let one rank go on silently from rank 0's position in a 2-rank shard of the data."""
    from distlab.checkpoint import stateful
    folder = stop_and_resume[0] + "/loader-5"
    assert stateful.per_rank_problem(folder, 2) is None
    assert stateful.per_rank_problem(folder, 3, ("model", "optim")) is None   # these reshard
    for world_size in (1, 3):
        assert stateful.per_rank_problem(folder, world_size) == (
            f"{folder} holds the data position and random state of 2 ranks, each its own, and "
            f"this run has {world_size}: resume with world_size=2, or load only the parts that "
            f"reshard, parts=('model', 'optim').")
    assert stateful.per_rank_problem(folder, 3, ("model", "optim", "rng")) is not None


def test_a_loader_state_resumes_only_a_loader_of_its_batch_size_and_workers():
    """torchdata itself would go on at the saved sample with batches of 3 (another run), and
    fail with an AssertionError that names no option for another number of workers."""
    import warnings
    from torch.utils.data import DistributedSampler, TensorDataset
    from distlab.checkpoint import stateful
    data = TensorDataset(torch.arange(12))

    def position(batch_size=2, num_workers=0):
        sampler = DistributedSampler(data, num_replicas=2, rank=1, seed=0)
        return stateful.LoaderPosition(stateful.stateful_loader(
            data, batch_size=batch_size, num_workers=num_workers, sampler=sampler))

    with warnings.catch_warnings():
        warnings.simplefilter("error")                      # the set_vital warning is filtered
        saved = position()
    batches = saved.batches()
    next(batches), next(batches)
    state = saved.state_dict()
    rest = [next(batches)[0].tolist() for _ in range(3)]    # 3 batches an epoch: into epoch 1
    resumed = position()
    resumed.load_state_dict(state)
    assert [b[0].tolist() for _, b in zip(range(3), resumed.batches())] == rest
    assert resumed.epoch == 1
    for option, value in (("batch_size", 3), ("num_workers", 1)):
        with pytest.raises(ValueError) as refused:
            position(**{option: value}).load_state_dict(state)
        assert str(refused.value) == (
            f"this loader's state was saved with {option}={getattr(saved.loader, option)}, and "
            f"this loader has {option}={value}: build it with {option}="
            f"{getattr(saved.loader, option)} to resume its epoch, or resume without the data "
            f"part to start the epoch over.")
