"""Writing a checkpoint: in the foreground, or staged and written by a background thread."""
import json
import os

import torch.distributed as dist

from .folder import _commit, _dcp, _fresh_name
from .pieces import _state


def save(folder, step, stage, mesh, optimizer=None, meta=None, sharded=True, background=False):
    """Collective: write this run's state at `step` to a new <folder>/step-<step>[.k], then point
    latest at it and remove the older step folders; returns its path.

    `background=True`: return a Pending as soon as DCP has staged (copied) the state; the
    training may change its tensors at once. Its wait() finishes the save and switches latest.
    """
    state = _state(stage, mesh, optimizer, sharded, whole=background)
    state["meta"] = json.dumps(dict(meta or {}, step=step))
    name = _fresh_name(folder, step)
    if background:
        future = _dcp().async_save(state, checkpoint_id=os.path.join(folder, name),
                                   process_group=_save_group(mesh))
        return Pending(folder, name, future, step)
    _dcp().save(state, checkpoint_id=os.path.join(folder, name))
    return _commit(folder, name)


def _save_group(mesh):
    """A gloo group of its own for async_save's collectives: they run in a background thread,
    and must not interleave with the training's collectives on the same group (made once)."""
    if getattr(mesh, "_save_group", None) is None:
        mesh._save_group = dist.new_group(backend="gloo")
    return mesh._save_group


class Pending:
    """A background save: staged, being written. wait() (collective) waits for every rank's
    files, then switches latest; call it before the next save and before the run ends."""

    def __init__(self, folder, name, future, step):
        self.folder, self.name, self.future, self.step = folder, name, future, step

    def wait(self):
        self.future.result()                    # this rank's files are written (or it raises)
        return _commit(self.folder, self.name)
