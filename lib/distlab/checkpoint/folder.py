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
    why = _no_metadata(path)
    if why:
        return why
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


def _resolve(folder_or_path, whole=True):
    """The step folder a caller means (the one <folder>/latest names, or the path itself), or a
    BrokenCheckpoint saying what is missing, before DCP or pickle fail deep inside.

    `whole`: check every rank file's size too (damage); else only that the .metadata is there
    (for callers that read nothing else)."""
    folder_or_path = os.fspath(folder_or_path)
    path = latest(folder_or_path) or folder_or_path
    if (path == folder_or_path and os.path.isdir(path) and not _has_metadata(path)
            and not _STEP_FOLDER.fullmatch(os.path.basename(os.path.normpath(path)))):
        raise BrokenCheckpoint(f"{path} holds no finished checkpoint (no latest file names one, "
                               f"and it has no .metadata of its own); {_ELSE}")
    why = damage(path) if whole else _no_metadata(path)
    if why:
        raise BrokenCheckpoint(why)
    return path


def _has_metadata(path):
    return os.path.exists(os.path.join(path, ".metadata"))


def _no_metadata(path):
    """damage's first two sentences: no folder, or a folder without its .metadata."""
    if not os.path.isdir(path):
        return f"there is no checkpoint folder {path}; {_ELSE}"
    if not _has_metadata(path):
        return (f"{path} has no .metadata file, so the save that wrote it never finished; "
                f"{_ELSE}")
    return None


def _unreadable(path, error):
    """BrokenCheckpoint for a file DCP could not read although its size was right."""
    failures = getattr(error, "failures", None)
    cause = next(iter(failures.values()))[0] if failures else error
    return BrokenCheckpoint(f"{path} holds a rank file that cannot be read ({type(cause).__name__}: "
                            f"{str(cause).splitlines()[0] if str(cause) else 'no detail'}); {_ELSE}")


def _commit(folder, name):
    """Collective: once every rank's files are whole, point latest at `name` and remove the step
    folders older than it; returns its path. Refused on every rank, touching nothing, when
    latest already names a newer one (that checkpoint is the one to keep)."""
    dist.barrier()                              # every rank's file is whole ...
    newer = torch.tensor([-1, 0])               # (step, k) of a newer checkpoint, if latest names one
    if dist.get_rank() == 0:                    # ... before the checkpoint counts
        names = os.listdir(folder)
        current = _named_by_latest(folder)
        if current is not None and _order(current) > _order(name):
            newer[:] = torch.tensor(_order(current))
        else:
            _point_latest_at(folder, name)
            for old in _older(names, name):     # the newest complete checkpoint is enough
                shutil.rmtree(os.path.join(folder, old), ignore_errors=True)
    dist.broadcast(newer, 0)                    # also the barrier: rank 0 has finished
    if newer[0] >= 0:
        current = _name(int(newer[0]), int(newer[1]))
        raise ValueError(f"{folder}/latest already names {current}, newer than {name}, so {name} "
                         f"does not replace it: finish each save (wait()) before starting the "
                         f"next.")
    return os.path.join(folder, name)


# The folders save() writes; nothing else in the folder is ever removed.
_STEP_FOLDER = re.compile(r"step-(\d{6,})(?:\.(\d+))?")


def _name(step, k=0):
    return f"step-{step:06d}" + (f".{k}" if k else "")


def _order(name):
    """(step, k) of step-<n>[.k]: the order in which saves of a folder began (k counts the saves
    of the same step, each after the last)."""
    m = _STEP_FOLDER.fullmatch(name)
    return int(m[1]), int(m[2] or 0)


def _older(names, name):
    """The step folders among `names` that a commit of `name` makes useless: only those older than
    it. A newer one may be a save still being written (in a thread of this run, or by another)."""
    return sorted(n for n in names if _STEP_FOLDER.fullmatch(n) and _order(n) < _order(name))


def _named_by_latest(folder):
    """The step folder <folder>/latest names, or None (no pointer, or not a name save() writes)."""
    try:
        with open(os.path.join(folder, "latest")) as f:
            name = f.read().strip()
    except FileNotFoundError:
        return None
    return name if _STEP_FOLDER.fullmatch(name) else None


def _fresh_name(folder, step):
    """Collective: a step folder name no save used before and later than every other save of
    `step` in `folder`, the same on every rank; or the ValueError every rank raises.

    Rank 0 chooses (the ranks of a multi-node job may see the shared folder a little apart) and
    sends (k, errno, newer step): k for step-<n>.k, or why no save of `step` may go there.
    """
    chosen = torch.tensor([0, 0, -1])
    if dist.get_rank() == 0:
        try:
            os.makedirs(folder, exist_ok=True)
            names = os.listdir(folder)
        except OSError as e:
            chosen[1] = e.errno or -1
        else:
            current = _named_by_latest(folder)
            if current is not None and _order(current)[0] > step:
                chosen[2] = _order(current)[0]
            same = [_order(n)[1] for n in names if _STEP_FOLDER.fullmatch(n)
                    and _order(n)[0] == step]
            chosen[0] = max(same) + 1 if same else 0
    dist.broadcast(chosen, 0)                   # a CPU tensor: gloo, also beside nccl
    k, errno, newer = (int(x) for x in chosen)
    if errno:
        why = os.strerror(errno) if errno > 0 else "an error"
        raise ValueError(f"{folder} cannot hold checkpoints ({why}): save into a folder you can "
                         f"write to.")
    if newer >= 0:
        raise ValueError(f"{folder}/latest already names step {newer}, newer than step {step}: "
                         f"save a step of at least {newer}, or into another folder.")
    return _name(step, k)


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
