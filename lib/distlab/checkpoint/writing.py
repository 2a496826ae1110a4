"""Writing a checkpoint: in the foreground, or staged and written by a background thread."""
import json
import os
from numbers import Integral

import torch.distributed as dist

from .folder import _commit, _dcp, _fresh_name
from .pieces import _state


def save(folder, step, stage, mesh, optimizer=None, meta=None, sharded=True, background=False):
    """Collective: write this run's state at `step` to a new <folder>/step-<step>[.k], then point
    latest at it and remove the older step folders; returns its path.

    `background=True`: return a Pending as soon as DCP has staged (copied) the state; the
    training may change its tensors at once. Its wait() finishes the save and switches latest.
    One save at a time: a save started while a background one is being written finishes that
    one first (as torchtitan's CheckpointManager does), so latest switches in the order the
    saves began and no two saves run collectives at once.
    """
    _check(folder, step)
    while _in_flight:
        _in_flight[0].wait()
    state = _state(stage, mesh, optimizer, sharded, whole=background)
    state["meta"] = json.dumps(dict(meta or {}, step=step))
    name = _fresh_name(folder, step)
    if background:
        future = _dcp().async_save(state, checkpoint_id=os.path.join(folder, name),
                                   process_group=_save_group(mesh))
        _in_flight.append(Pending(folder, name, future, step))
        return _in_flight[-1]
    _dcp().save(state, checkpoint_id=os.path.join(folder, name))
    return _commit(folder, name)


# This process's background save still being written (at most one): every rank of a job calls
# save() in the same order, so every rank finds the same one here.
_in_flight = []


def _check(folder, step):
    """The same sentence on every rank for arguments no save could use, before any collective."""
    if not isinstance(folder, (str, os.PathLike)):
        raise TypeError(f"save's folder must be a path (a str); got {type(folder).__name__}.")
    if isinstance(step, bool) or not isinstance(step, Integral) or step < 0:
        raise ValueError(f"save's step must be a whole number >= 0 (the optimizer steps done); "
                         f"got {step!r}.")
    if os.path.isfile(folder):
        raise ValueError(f"{folder} is a file; pass save the folder its checkpoints go into "
                         f"(it makes one step folder per save there).")


def _save_group(mesh):
    """A gloo group of its own for async_save's collectives: they run in a background thread,
    and must not interleave with the training's collectives on the same group (made once)."""
    if getattr(mesh, "_save_group", None) is None:
        mesh._save_group = dist.new_group(backend="gloo")
    return mesh._save_group


class Pending:
    """A background save: staged, being written. wait() (collective) waits for every rank's
    files, then switches latest, and returns its path; call it before the run ends. The next
    save() calls it if you have not; calling it again returns the same path at once."""

    def __init__(self, folder, name, future, step):
        self.folder, self.name, self.future, self.step = folder, name, future, step
        self.path = None

    def wait(self):
        if self.path is None:
            if self in _in_flight:              # a failed write must not block every later save
                _in_flight.remove(self)
            self.future.result()                # this rank's files are written (or it raises)
            self.path = _commit(self.folder, self.name)
        return self.path
