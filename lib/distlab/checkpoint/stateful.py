"""torch's own way to checkpoint a sharded job: `get_state_dict` / `set_state_dict` and `Stateful`.

`distlab.train` wraps its shards as DTensors by hand (pieces.py), because chapter 07's layers are
plain tensors. A model sharded by torch's own APIs (FSDP2's `fully_shard`, DTensor TP) already
holds DTensors, and `torch.distributed.checkpoint.state_dict` gives its state in the form DCP
wants: `get_state_dict(model, optimizer)` returns the model's and the optimizer's state keyed by
parameter NAME (an optimizer's own `state_dict()` keys by position), every tensor a DTensor shard.
`set_state_dict` puts such dicts back, resharded to whatever the model now is.

`TrainState` is the one object a training loop hands to `dcp.save` / `dcp.load`. It is a
`Stateful`: DCP calls its `state_dict()` at save; at load it calls `state_dict()` first (to know
what to read, and into which shards) and `load_state_dict()` once the values are read. It holds
everything a resumed run needs to take the SAME next step, not only the same weights:
- the model and the optimizer (Adam's moments and step count);
- the data position, so the sampler is set to the same epoch and the batches already trained on
  are not trained on again. `DataPosition` is that state written out (the epoch, and how many
  batches of it were consumed); `LoaderPosition` keeps it with torchdata's `StatefulDataLoader`,
  whose `state_dict()` holds where its epoch is, worker processes included;
- every rank's random state. CPU and, where there is one, the accelerator's generator: dropout
  masks and sampling must continue, not repeat.
The data position and the random state are saved under a key of each rank's own (`data.<rank>`,
`rng.<rank>`): DCP would keep one copy of a key that every rank offers, and every rank would read
back rank 0's. So they resume only at the world size that saved them (`load` says so in a
sentence); the model and the optimizer reshard to any. `parts` leaves some out, to show what goes
wrong without them.
"""
import pickle
import warnings

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.checkpoint.stateful import Stateful

PARTS = ("model", "optim", "data", "rng")


class DataPosition:
    """Where a DistributedSampler's loop is: its epoch and the batches of it already consumed."""

    def __init__(self, loader):
        self.loader, self.epoch, self.consumed = loader, 0, 0

    def batches(self):
        """The batches left, epoch after epoch; the position moves as each one is taken."""
        while True:
            self.loader.sampler.set_epoch(self.epoch)
            for i, batch in enumerate(self.loader):
                if i < self.consumed:
                    continue                    # trained on before the checkpoint
                self.consumed += 1
                yield batch
            self.epoch, self.consumed = self.epoch + 1, 0

    def state_dict(self):
        return {"epoch": self.epoch, "consumed": self.consumed}

    def load_state_dict(self, state):
        self.epoch, self.consumed = state["epoch"], state["consumed"]


class LoaderPosition:
    """The same with torchdata's `StatefulDataLoader`: its `state_dict()` says how far into the
    epoch it is (the batches its sampler has handed out, every worker's state); a loader given
    that state by `load_state_dict` goes on from the next batch. The epoch stays the loop's
    (a DistributedSampler's `set_epoch`), so it is kept here beside the loader's state."""

    def __init__(self, loader):
        self.loader, self.epoch, self.started = loader, 0, False

    def batches(self):
        while True:
            self.loader.sampler.set_epoch(self.epoch)
            self.started = True
            yield from self.loader              # a loaded state: from where the saved run was
            self.epoch += 1

    def state_dict(self):
        # One opaque value, as torchtitan saves its loader's. DCP loads only the keys of the state
        # it is handed at load, and a loader not yet iterated hands {} (its start, as
        # load_state_dict({}) takes it; its state_dict() would start its workers): a nested dict
        # saved mid-epoch would find no keys to land in.
        loader = self.loader
        return pickle.dumps({"epoch": self.epoch, "batch_size": loader.batch_size,
                             "num_workers": loader.num_workers,
                             "loader": loader.state_dict() if self.started else {}})

    def load_state_dict(self, state):
        state = pickle.loads(state)
        for name in ("batch_size", "num_workers"):
            if state[name] != getattr(self.loader, name):
                raise ValueError(
                    f"this loader's state was saved with {name}={state[name]}, and this loader has "
                    f"{name}={getattr(self.loader, name)}: build it with {name}={state[name]} to "
                    f"resume its epoch, or resume without the data part to start the epoch over.")
        self.epoch = state["epoch"]
        self.loader.load_state_dict(state["loader"])


def stateful_loader(dataset, **options):
    """torchdata's StatefulDataLoader(dataset, **options), without the deprecation warning its
    constructor raises on this torch (it calls torch.set_vital, which torch 2.13 deprecates)."""
    from torchdata.stateful_dataloader import StatefulDataLoader
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="'set_vital' is deprecated", category=UserWarning)
        return StatefulDataLoader(dataset, **options)


def rng_state():
    """This process's random generators: CPU, and the accelerator's where there is one."""
    state = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state):
    torch.set_rng_state(state["cpu"])
    if "cuda" in state:
        torch.cuda.set_rng_state_all(state["cuda"])


class TrainState(Stateful):
    """Model, optimizer, data position and this rank's random state, as DCP saves and loads them:
    `dcp.save({"train": TrainState(...)}, checkpoint_id=folder)`, and the same with dcp.load."""

    def __init__(self, model, optimizer, data, parts=PARTS):
        unknown = set(parts) - set(PARTS)
        if unknown:
            raise ValueError(f"TrainState keeps {', '.join(PARTS)}; not {', '.join(sorted(unknown))}")
        self.model, self.optimizer, self.data, self.parts = model, optimizer, data, tuple(parts)

    def state_dict(self):
        model, optim = get_state_dict(self.model, self.optimizer)   # DTensor shards, by name
        rank = dist.get_rank()
        whole = {"model": model, "optim": optim, f"data.{rank}": self.data.state_dict(),
                 f"rng.{rank}": rng_state()}
        return {k: v for k, v in whole.items() if k.split(".")[0] in self.parts}

    def load_state_dict(self, state):
        if "model" in state:
            set_state_dict(self.model, self.optimizer, model_state_dict=state["model"],
                           optim_state_dict=state.get("optim", {}))
        rank = dist.get_rank()
        if f"data.{rank}" in state:
            self.data.load_state_dict(state[f"data.{rank}"])
        if f"rng.{rank}" in state:
            set_rng_state(state[f"rng.{rank}"])


def per_rank_problem(folder, world_size, parts=PARTS, key="train"):
    """Why the per-rank parts of the checkpoint in `folder` cannot resume `world_size` ranks (a
    sentence), or None. Reads the metadata only: no process group needed."""
    import torch.distributed.checkpoint as dcp
    if not {"data", "rng"} & set(parts):
        return None
    names = dcp.FileSystemReader(folder).read_metadata().state_dict_metadata
    saved = {k.split(".")[2] for k in names if k.split(".")[:2] in ([key, "data"], [key, "rng"])}
    if len(saved) == world_size:
        return None
    return (f"{folder} holds the data position and random state of {len(saved)} ranks, each its "
            f"own, and this run has {world_size}: resume with world_size={len(saved)}, or load only "
            f"the parts that reshard, parts=('model', 'optim').")


def load(folder, train_state, key="train"):
    """`dcp.load({key: train_state}, checkpoint_id=folder)`, once the checkpoint is known to hold
    the per-rank parts of as many ranks as this run has: a rank with no key of its own would stop
    DCP with "Missing key in checkpoint state_dict", and fewer ranks would silently skip some."""
    import torch.distributed.checkpoint as dcp
    problem = per_rank_problem(folder, dist.get_world_size(), train_state.parts, key)
    if problem:
        raise ValueError(problem)
    dcp.load({key: train_state}, checkpoint_id=folder)


def train_fsdp(rank, world_size, folder, steps, stop_after=None, resume=None, samples=24,
               data="loader"):
    """A small FSDP2 job (an MLP with dropout, Adam, a shuffled DistributedSampler), run on
    every rank. Plain: `steps` steps. `stop_after=k`: k steps, then `dcp.save` of a TrainState
    to `folder`. `resume=parts`: a FRESH model (another init), optimizer, data position and
    random state, then `dcp.load` of those parts from `folder`, then `steps` more steps.
    `data="loader"`: torchdata's StatefulDataLoader with one worker process, in a LoaderPosition;
    `data="position"`: torch's DataLoader, in a DataPosition.
    Returns (the global batch's mean loss at each step, rank 0's full parameters at the end,
    the samples this rank trained on at each step)."""
    import multiprocessing

    import torch.distributed.checkpoint as dcp
    import torch.nn as nn
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.utils.data import DataLoader, TensorDataset
    from torch.utils.data.distributed import DistributedSampler

    generator = torch.Generator().manual_seed(0)
    dataset = TensorDataset(torch.randn(samples, 8, generator=generator),
                            torch.randn(samples, 4, generator=generator), torch.arange(samples))
    # its own generator: each iter(loader) draws a seed for its workers, from torch's global
    # generator otherwise, so a resume (one iter more) would shift every dropout mask after it
    options = dict(batch_size=2, sampler=DistributedSampler(dataset, seed=0),
                   generator=torch.Generator().manual_seed(0))
    if data == "loader":
        # its worker started by fork, as on a plain Linux job: the default here is the forkserver
        # this rank came from, whose workers would import torch again (seconds each)
        fork = "fork" if "fork" in multiprocessing.get_all_start_methods() else None
        position = LoaderPosition(stateful_loader(dataset, num_workers=1,
                                                  multiprocessing_context=fork, **options))
    else:
        position = DataPosition(DataLoader(dataset, **options))
    torch.manual_seed(0 if resume is None else 1)       # a resumed run starts from another init
    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Dropout(0.25), nn.Linear(32, 4))
    fully_shard(model, mesh=init_device_mesh("cpu", (world_size,)))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    torch.manual_seed(100 + rank if resume is None else 999)  # dropout: every rank its own masks
    if resume is not None:
        load(folder, TrainState(model, optimizer, position, resume))
    losses, seen = [], []
    for _, (x, y, index) in zip(range(stop_after or steps), position.batches()):
        seen.append(index.tolist())
        loss = (model(x) - y).pow(2).mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        mean = loss.detach().clone()
        dist.all_reduce(mean, op=dist.ReduceOp.AVG)
        losses.append(mean.item())
    if stop_after is not None:
        dcp.save({"train": TrainState(model, optimizer, position)}, checkpoint_id=folder)
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    return losses, (full if rank == 0 else None), seen
