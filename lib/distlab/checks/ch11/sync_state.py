"""Workbook 11, exercise 3: replicas that never were equal — parameters and buffers."""
import torch

from ... import trace as _trace
from .. import CheckFailed, _traffic, passed, sizes_phrase
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
    with _trace.span("fix"), _refused("broadcast rank 0's state yourself", _bn_model), \
            _traffic.Carried() as carried:
        fn(model)
    return {"before": before, "after": {k: v.clone() for k, v in model.state_dict().items()},
            "sent": carried.records}


def check_sync_state(fn):
    """fn(model) -> None: afterwards every rank holds rank 0's parameters AND buffers, sent in
    one broadcast per dtype. Judged by the checkers' one traffic rule: broadcasts, or messages
    from rank 0 (one per dtype to each rank), and rank 0's state among what they delivered."""
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
            calls = _traffic.data_calls(_traffic.records(got.trace, rank, "fix"))
            others = sorted({c["op"] for c in calls if c["op"] not in ("broadcast", "send",
                                                                         "recv")})
            if others:
                raise CheckFailed(f"{name} with world_size={ws}: rank {rank} called "
                                  f"{', '.join(others)}; rank 0's state needs only broadcasts "
                                  f"(or messages from rank 0).")
            # what reached it, by the one rule: a broadcast, or a message (rank 0: to each peer)
            per_peer = {}
            for c in calls:
                if c["kind"] != "collective":
                    per_peer[c["peer"]] = per_peer.get(c["peer"], 0) + 1
            count = sum(c["kind"] == "collective" for c in calls) + max(per_peer.values(),
                                                                        default=0)
            if count > len(dtypes):
                made = (f"made {count} broadcasts" if not per_peer else
                        f"took part in {count} broadcasts or messages with one rank")
                raise CheckFailed(
                    f"{name} with world_size={ws}: rank {rank} {made}, one per tensor; the state "
                    f"holds {len(want)} tensors of {len(dtypes)} dtypes ({', '.join(dtypes)}): "
                    f"flatten the tensors of each dtype into one buffer and broadcast that "
                    f"({len(dtypes)} messages, each paying the latency once).")
        missing = _traffic.missing(_traffic.delivered({r: got[r]["sent"] for r in range(ws)}),
                                   list(want.values()), list(want))
        if missing:
            raise CheckFailed(
                f"{name} with world_size={ws}: every rank holds rank 0's state, but what the "
                f"ranks' calls delivered does not hold rank 0's {missing}: all of it must travel "
                f"from rank 0 (rebuilding it locally copies rank 0's recipe, not its state).")
    dtypes = sorted({str(v.dtype) for v in _bn_model(0).state_dict().values()})
    passed(f"{name} gives every rank rank 0's parameters and buffers in {len(dtypes)} broadcasts "
           f"(one per dtype), on {sizes_phrase(WORLD_SIZES)} ranks.")
