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
- the data position (`DataPosition`: the epoch and how many batches of it were consumed), so the
  sampler is set to the same epoch and the batches already trained on are skipped — torchdata's
  `StatefulDataLoader` does the same for a whole DataLoader, worker processes included;
- every rank's random state, under its own key (`rng.<rank>`: DCP would keep one copy of a key
  that every rank offers, and every rank would read back rank 0's). CPU and, where there is one,
  the accelerator's generator: dropout masks and sampling must continue, not repeat.
`parts` leaves some out, to show what goes wrong without them.
"""
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
        whole = {"model": model, "optim": optim, "data": self.data.state_dict(),
                 f"rng.{dist.get_rank()}": rng_state()}
        return {k: v for k, v in whole.items() if k.split(".")[0] in self.parts}

    def load_state_dict(self, state):
        if "model" in state:
            set_state_dict(self.model, self.optimizer, model_state_dict=state["model"],
                           optim_state_dict=state.get("optim", {}))
        if "data" in state:
            self.data.load_state_dict(state["data"])
        if f"rng.{dist.get_rank()}" in state:
            set_rng_state(state[f"rng.{dist.get_rank()}"])


def train_fsdp(rank, world_size, folder, steps, stop_after=None, resume=None, samples=24):
    """A small FSDP2 job (an MLP with dropout, Adam, a shuffled DistributedSampler), run on
    every rank. Plain: `steps` steps. `stop_after=k`: k steps, then `dcp.save` of a TrainState
    to `folder`. `resume=parts`: a FRESH model (another init), optimizer, data position and
    random state, then `dcp.load` of those parts from `folder`, then `steps` more steps.
    Returns (the global batch's mean loss at each step, rank 0's full parameters at the end)."""
    import torch.distributed.checkpoint as dcp
    import torch.nn as nn
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.utils.data import DataLoader, TensorDataset
    from torch.utils.data.distributed import DistributedSampler

    data = torch.Generator().manual_seed(0)
    dataset = TensorDataset(torch.randn(samples, 8, generator=data),
                            torch.randn(samples, 4, generator=data))
    # its own generator: each iter(loader) draws a seed for its workers, from torch's global
    # generator otherwise, so a resume (one iter more) would shift every dropout mask after it
    loader = DataLoader(dataset, batch_size=2, sampler=DistributedSampler(dataset, seed=0),
                        generator=torch.Generator().manual_seed(0))
    torch.manual_seed(0 if resume is None else 1)       # a resumed run starts from another init
    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Dropout(0.25), nn.Linear(32, 4))
    fully_shard(model, mesh=init_device_mesh("cpu", (world_size,)))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    position = DataPosition(loader)
    torch.manual_seed(100 + rank if resume is None else 999)  # dropout: every rank its own masks
    if resume is not None:
        dcp.load({"train": TrainState(model, optimizer, position, resume)}, checkpoint_id=folder)
    losses = []
    for _, (x, y) in zip(range(stop_after or steps), position.batches()):
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
    return losses, (full if rank == 0 else None)
