"""Sharded checkpoints with torch.distributed.checkpoint (DCP), resumable under another layout.

    save(folder, step, stage, mesh, optimizer, meta)     # collective: every rank writes its part
    step, meta = load(folder, stage, mesh, optimizer, dense_model)   # collective: each rank reads its part
    everything = read(folder)                             # one process, no process group (tests, notebooks)

What is written, under DENSE names (the names of the one-process model), so that the files do
not depend on the (dp, pp, tp) layout that wrote them:
- "model.<name>": every parameter, whole. Each rank first all-gathers its tensor-parallel shards
  (inside its stage), so the ranks of one stage all hold the same full tensors and the dp replicas
  hold them too; DCP's planner DEDUPLICATES keys that several ranks offer, so each tensor is
  written once, by one rank, and the stages write their own layers in parallel (one file per rank);
- "optim.<name>.exp_avg" / ".exp_avg_sq" and "optim.step": Adam's state, gathered the same way;
- "rng.<rank>": every rank's CPU random generator state;
- "meta": step, losses so far, the data position, the model's configuration.

On load each rank asks only for the keys of ITS layers (DCP reads just those bytes), then keeps
its tensor-parallel shard of each: that is the resharding. The alternative, each tp rank writing
only its own shard (DTensor), writes 1/tp as much per rank but ties the files to how chapter 07
stacks q, k and v; full tensors per stage keep the format the dense model's, for 1/pp of the
model in memory per rank at save time.

Each save goes to a folder NO save has used before: <folder>/step-<n>, or step-<n>.1, .2, ...
when that name is taken (a re-run saving the step `latest` already points at must not rewrite
the files of the only good checkpoint in place). Only when every rank has finished writing does
rank 0 point <folder>/latest at it (write a small file, then atomic rename), and only then are
the older and the unfinished step folders removed. A run killed in the middle of a save resumes
from the previous checkpoint, never from half of one.
"""
import json
import os
import re
import shutil

import torch
import torch.distributed as dist


def _dcp():
    """torch.distributed.checkpoint, imported when a checkpoint is first touched: ≈ 1.5 CPU-s,
    paid by every torchrun worker and rank that imports distlab.train even to be refused."""
    import torch.distributed.checkpoint as dcp
    return dcp


def _reader(path):
    return _dcp().FileSystemReader(path)


def _failed():
    from torch.distributed.checkpoint.api import CheckpointException
    return CheckpointException

from .parallel3d import _unshard


class BrokenCheckpoint(ValueError):
    """A checkpoint that cannot be read; the message is one sentence naming what is missing."""


_ELSE = "resume from another checkpoint, or start with another --ckpt folder."


def latest(folder):
    """The path of the newest complete checkpoint in `folder`, or None if no save finished there.

    Raises BrokenCheckpoint when <folder>/latest exists but names nothing, or a missing folder.
    """
    pointer = os.path.join(folder, "latest")
    if not os.path.exists(pointer):
        return None
    with open(pointer) as f:
        name = f.read().strip()
    if not name:
        raise BrokenCheckpoint(f"{pointer} is empty, so it names no checkpoint; write the name "
                               f"of a complete step folder into it, or {_ELSE}")
    if not os.path.isdir(os.path.join(folder, name)):
        raise BrokenCheckpoint(f"{pointer} names {name}, but {folder} has no such folder; {_ELSE}")
    return os.path.join(folder, name)


def damage(path):
    """A sentence saying what is missing or cut short in the checkpoint at `path`, or None.

    Reads only the metadata and the sizes of the files it lists, so every rank can check before
    any collective read: DCP and pickle would otherwise fail with pages of traceback, or on some
    ranks only.
    """
    from torch.distributed.checkpoint.metadata import Metadata
    if not os.path.isdir(path):
        return f"there is no checkpoint folder {path}; {_ELSE}"
    if not os.path.exists(os.path.join(path, ".metadata")):
        return (f"{path} has no .metadata file, so the save that wrote it never finished; "
                f"{_ELSE}")
    try:
        metadata = _reader(path).read_metadata()
    except Exception as e:                # garbage unpickles into any error; say which
        return f"{path}/.metadata is not DCP metadata ({type(e).__name__} reading it); {_ELSE}"
    if not isinstance(metadata, Metadata) or "meta" not in metadata.state_dict_metadata:
        return f"{path}/.metadata is not the metadata of a distlab checkpoint; {_ELSE}"
    needed = {}                           # file -> bytes its entries reach
    for info in (metadata.storage_data or {}).values():
        needed[info.relative_path] = max(needed.get(info.relative_path, 0),
                                         info.offset + info.length)
    for name, size in sorted(needed.items()):
        file = os.path.join(path, name)
        if not os.path.exists(file):
            return f"{path} lacks {name}, one of the rank files its .metadata lists; {_ELSE}"
        if os.path.getsize(file) < size:
            return (f"{file} is cut short ({os.path.getsize(file)} of the {size} bytes its "
                    f".metadata lists); {_ELSE}")
    return None


def _unreadable(path, error):
    """BrokenCheckpoint for a file DCP could not read although its size was right."""
    failures = getattr(error, "failures", None)
    cause = next(iter(failures.values()))[0] if failures else error
    return BrokenCheckpoint(f"{path} holds a rank file that cannot be read ({type(cause).__name__}: "
                            f"{str(cause).splitlines()[0] if str(cause) else 'no detail'}); {_ELSE}")


def _dense(stage, mesh, local):
    """{dense name: full tensor} from {this stage's name: this rank's shard} (collective over tp)."""
    out = {}
    for name, t in local.items():
        owner = stage.get_submodule(name.rpartition(".")[0])
        out[stage.dense_name(name)] = _unshard(owner, name.rpartition(".")[2], t.detach(),
                                               mesh.get_group("tp")).cpu()
    return out


def save(folder, step, stage, mesh, optimizer=None, meta=None):
    """Collective: write this run's state at `step` to a new <folder>/step-<step>[.k], then point
    latest at it and remove the older step folders; returns its path."""
    state = {f"model.{k}": v for k, v in _dense(stage, mesh, dict(stage.named_parameters())).items()}
    if optimizer is not None:
        for which in ("exp_avg", "exp_avg_sq"):
            local = {n: s[which] for n, s in optimizer.state.items()}
            state.update({f"optim.{k}.{which}": v for k, v in _dense(stage, mesh, local).items()})
        state["optim.step"] = torch.tensor(optimizer.steps)
    state[f"rng.{dist.get_rank()}"] = torch.get_rng_state()
    state["meta"] = json.dumps(dict(meta or {}, step=step))
    name = _fresh_name(folder, step)
    _dcp().save(state, checkpoint_id=os.path.join(folder, name))
    dist.barrier()                              # every rank's file is whole ...
    if dist.get_rank() == 0:                    # ... before the checkpoint counts
        _point_latest_at(folder, name)
        for old in os.listdir(folder):          # the newest complete checkpoint is enough
            if _STEP_FOLDER.fullmatch(old) and old != name:
                shutil.rmtree(os.path.join(folder, old), ignore_errors=True)
    dist.barrier()
    return os.path.join(folder, name)


# The folders save() writes; nothing else in the folder is ever removed.
_STEP_FOLDER = re.compile(r"step-\d{6,}(\.\d+)?")


def _fresh_name(folder, step):
    """Collective: a step folder name no save used before, the same on every rank.

    Rank 0 chooses (the ranks of a multi-node job may see the shared folder a little apart) and
    sends the number: 0 for step-<n>, k for step-<n>.k.
    """
    def name(k):
        return f"step-{step:06d}" + (f".{k}" if k else "")
    k = 0
    if dist.get_rank() == 0:
        os.makedirs(folder, exist_ok=True)
        while os.path.exists(os.path.join(folder, name(k))):
            k += 1
    chosen = torch.tensor([k])
    dist.broadcast(chosen, 0)                   # a CPU tensor: gloo, also beside nccl
    return name(int(chosen))


def _point_latest_at(folder, name):
    """Make <folder>/latest name `name`, atomically: a crash leaves the old pointer or the new."""
    tmp = os.path.join(folder, "latest.tmp")
    with open(tmp, "w") as f:
        f.write(name)
        f.flush()
        os.fsync(f.fileno())                    # the new name is on disk before it counts
    os.replace(tmp, os.path.join(folder, "latest"))
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)                            # ... and so is the rename
    finally:
        os.close(fd)


def mismatch(path, dense_model, optimizer=None):
    """A sentence saying why the checkpoint at `path` cannot continue this run, or None."""
    saved = _reader(path).read_metadata().state_dict_metadata
    mine = dense_model.state_dict()
    names = {k[len("model."):] for k in saved if k.startswith("model.")}
    if names != set(mine):
        blocks = [len({k.split(".")[1] for k in ks if k.startswith("blocks.")}) for ks in (names, mine)]
        extra, missing = sorted(names - set(mine)), sorted(set(mine) - names)
        what = (f"has {blocks[0]} blocks, this run's has {blocks[1]}" if blocks[0] != blocks[1] else
                f"has {extra[0]}, which this model lacks" if extra else f"lacks {missing[0]}")
        return (f"{path} holds a different model (it {what}); start with another --ckpt folder "
                f"or the model options it was saved with.")
    for k, v in mine.items():
        md = saved[f"model.{k}"]
        if tuple(md.size) != tuple(v.shape):
            return (f"{path} holds a different model ({k} is {tuple(md.size)}, this run's is "
                    f"{tuple(v.shape)}); start with another --ckpt folder or the model options it "
                    f"was saved with.")
        if md.properties.dtype != v.dtype:
            was, now = (str(d).removeprefix("torch.") for d in (md.properties.dtype, v.dtype))
            return (f"{path} was saved in {was}, so it cannot continue the same run in {now}; "
                    f"resume with --dtype {was}, or start with another --ckpt folder.")
    if optimizer is not None and "optim.step" not in saved:
        return (f"{path} holds no Adam state, so Adam cannot continue that run; resume with the "
                f"optimizer it was saved with, or start with another --ckpt folder.")
    return None


def read_meta(path):
    """Collective: the meta of the checkpoint at `path` alone (step, losses, the run's settings)."""
    want = {"meta": ""}
    try:
        _dcp().load(want, checkpoint_id=path)
    except _failed() as e:
        raise _unreadable(path, e) from None
    return json.loads(want["meta"])


def load(path, stage, mesh, optimizer=None):
    """Collective: fill this rank's shards (and Adam's) from the checkpoint at `path`; its meta."""
    params = dict(stage.named_parameters())
    want = {}
    for name, p in params.items():
        full = stage.dense_name(name)
        shape = _full_shape(stage, name, p)
        want[f"model.{full}"] = torch.empty(shape, dtype=p.dtype)
        if optimizer is not None:
            for which in ("exp_avg", "exp_avg_sq"):
                want[f"optim.{full}.{which}"] = torch.empty(shape, dtype=p.dtype)
    if optimizer is not None:
        want["optim.step"] = torch.tensor(0)
    rng = f"rng.{dist.get_rank()}"
    has_rng = rng in _reader(path).read_metadata().state_dict_metadata
    if has_rng:
        want[rng] = torch.get_rng_state()
    want["meta"] = ""
    try:
        _dcp().load(want, checkpoint_id=path)      # reads only the keys asked for
    except _failed() as e:           # on every rank: DCP gathers the failures
        raise _unreadable(path, e) from None
    with torch.no_grad():
        for name, p in params.items():
            full = stage.dense_name(name)
            p.copy_(stage.shard_of(name, want[f"model.{full}"]).to(p.device))
            if optimizer is not None:
                for which in ("exp_avg", "exp_avg_sq"):
                    optimizer.state[name][which].copy_(
                        stage.shard_of(name, want[f"optim.{full}.{which}"]))
    if optimizer is not None:
        optimizer.steps = int(want["optim.step"])
    if has_rng:        # another layout has other ranks: their streams start where these stopped
        torch.set_rng_state(want[rng])
    return json.loads(want["meta"])


def _full_shape(stage, name, p):
    """The dense shape of this rank's shard `p` of parameter `name` (shard_of, inverted)."""
    from .tensor_parallel import ColumnParallelLinear, RowParallelLinear
    owner, attr = stage.get_submodule(name.rpartition(".")[0]), name.rpartition(".")[2]
    shape = list(p.shape)
    if isinstance(owner, ColumnParallelLinear):
        shape[0] *= owner.tp
    elif isinstance(owner, RowParallelLinear) and attr == "weight":
        shape[1] *= owner.tp
    return shape


def read(folder_or_path):
    """The whole checkpoint in this process (no process group): {"meta", "model", "optim", "rng"}."""
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict_from_keys
    import warnings
    path = latest(folder_or_path) or folder_or_path
    why = damage(path)
    if why:
        raise BrokenCheckpoint(why)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")          # "assuming ... a single process": yes
        try:
            flat = _load_state_dict_from_keys(checkpoint_id=path)
        except (Exception, _failed()) as e:
            raise _unreadable(path, e) from None
    out = {"meta": json.loads(flat.pop("meta")), "model": {}, "optim": {}, "rng": {}}
    for k, v in flat.items():
        group, _, rest = k.partition(".")
        out[group][rest] = v
    return out
