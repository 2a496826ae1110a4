"""Workbook 11, exercise 3: replicas that never were equal — parameters and buffers."""
import torch

from ... import trace as _trace
from .. import CheckFailed, passed, sizes_phrase
from ._common import WORLD_SIZES, _refused, _traced


def _bn_model(rank):
    """A model with buffers (BatchNorm's running statistics, an int64 counter), initialised and
    run differently on every rank: the bug of seeding each rank with its own rank."""
    with torch.random.fork_rng():               # the caller's random stream stays its own
        torch.manual_seed(rank)
        model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.BatchNorm1d(8),
                                    torch.nn.ReLU(), torch.nn.Linear(8, 3))
    g = torch.Generator().manual_seed(100 + rank)
    with torch.no_grad():
        for _ in range(rank + 1):               # running stats and their count differ too
            model(torch.randn(5, 6, generator=g))
    return model


def _sync_on_ranks(rank, world_size, fn):
    model = _bn_model(rank)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with _trace.span("fix"), _refused("broadcast rank 0's state yourself", _bn_model):
        fn(model)
    return {"before": before, "after": {k: v.clone() for k, v in model.state_dict().items()}}


def check_sync_state(fn):
    """fn(model) -> None: afterwards every rank holds rank 0's parameters AND buffers, sent in
    one broadcast per dtype."""
    name = getattr(fn, "__name__", "sync_state")
    for ws in WORLD_SIZES:
        got = _traced(_sync_on_ranks, ws, name, fn, rule="every rank must call the same "
                      "broadcasts, in the same order, with tensors of the same size.")
        want = got[0]["before"]         # rank 0's state before the fix: what everyone must hold
        dtypes = sorted({str(v.dtype).replace("torch.", "") for v in want.values()})
        for rank in range(ws):
            for key, value in want.items():
                mine = got[rank]["after"].get(key)
                if mine is None or mine.dtype != value.dtype or not torch.equal(mine, value):
                    kind = "parameter" if key.endswith(("weight", "bias")) else "buffer"
                    extra = ("" if kind == "parameter" else " Buffers are state too: DDP "
                             "broadcasts them with the parameters.")
                    raise CheckFailed(f"{name} with world_size={ws}: rank {rank}'s {kind} {key} "
                                      f"is not rank 0's.{extra}")
        for rank in range(ws):
            calls = [e for e in got.trace.comm(rank) if e["label"] == ["fix"]]
            others = sorted({e["op"] for e in calls if e["op"] != "broadcast"})
            if others:
                raise CheckFailed(f"{name} with world_size={ws}: rank {rank} called "
                                  f"{', '.join(others)}; rank 0's state needs only broadcasts.")
            sent = sum(e["bytes"] for e in calls)
            state = sum(v.numel() * v.element_size() for v in want.values())
            if sent < state:
                raise CheckFailed(
                    f"{name} with world_size={ws}: rank {rank} took part in broadcasts of "
                    f"{sent} bytes; rank 0's state is {state} bytes, and all of it must travel "
                    f"from rank 0 (rebuilding it locally copies rank 0's recipe, not its state).")
            if len(calls) > len(dtypes):
                raise CheckFailed(
                    f"{name} with world_size={ws}: rank {rank} made {len(calls)} broadcasts, one "
                    f"per tensor; the state holds {len(want)} tensors of {len(dtypes)} dtypes "
                    f"({', '.join(dtypes)}): flatten the tensors of each dtype into one buffer "
                    f"and broadcast that ({len(dtypes)} messages, each paying the latency once).")
    dtypes = sorted({str(v.dtype) for v in _bn_model(0).state_dict().values()})
    passed(f"{name} gives every rank rank 0's parameters and buffers in {len(dtypes)} broadcasts "
           f"(one per dtype), on {sizes_phrase(WORLD_SIZES)} ranks.")
