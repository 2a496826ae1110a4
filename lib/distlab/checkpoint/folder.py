"""Where checkpoints live: the step folders, the `latest` pointer that makes one count, and what a
damaged one lacks (a sentence, before DCP or pickle can fail with pages of traceback)."""
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


def _commit(folder, name):
    """Collective: once every rank's files are whole, point latest at `name`, remove the rest."""
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
