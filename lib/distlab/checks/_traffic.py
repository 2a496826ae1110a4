"""One traffic rule for every checker that judges communication: WHAT travelled, HOW MANY
BYTES, on WHICH GROUP — the same for a collective and for a point-to-point message.

A record is one call a rank made, as a dict:
- `kind`: "collective", "send" or "recv"; `op`: all_reduce, all_gather, reduce_scatter,
  all_to_all, broadcast, reduce, gather, scatter, barrier, send, recv;
- `group`: the global ranks of its process group (the world where the trace could not tell:
  a collective issued from C++); `peer`: the global rank at the other end of a message;
- `bytes`: the size distlab's trace gives it (the whole tensor of a gather or a scatter, what this
  rank sends in an all-to-all, a message's size);
- `wire`: what this rank PUT ON THE WIRE, by one rule (`wire_bytes`): a message its size (a
  receive nothing: it is the peer's send), a collective what this rank sends in it done as a ring
  (`ring_share`). So a hand-written ring of send/recv, one packed message per hop, or one
  all-gather of weight and bias together count the same bytes as the collective they replace;
- `values` (recorded inside the rank only, by `Carried`): a float64 flat copy of what this rank
  put into the call, so a checker can ask whether the data travelled (an all-to-all of zeros
  beside inputs rebuilt locally carried nothing: `carried_nothing`), and which data (`carries`).

Two sources, one form: `records(trace, rank, where)` reads a run's trace in the parent
(`distlab.run(..., trace=True)`: labels, launch and end times, every route the learner's call
took); `Carried()` records inside the rank, while the learner's function runs, what each call
carried — a TorchDispatchMode over the c10d ops, so `dist.*` under any name, a ProcessGroup's
own methods, batch_isend_irecv, torch's functional collectives and C++ callers are all seen.
Then the rule's questions: `off_group` (a call that left the group it was given), `wire` (the
bytes sent), `messages`, `as_messages` (a collective over two ranks IS a message each way),
`describe`; over all ranks' `Carried` records, `delivered` and `holds` / `missing` (what arrived).
"""
import numpy as np
import torch
import torch.distributed as dist

P2P = ("send", "recv")


# ---- how many bytes ------------------------------------------------------------------------------

def ring_share(op, nbytes, n):
    """The bytes one rank sends in a collective of `nbytes` (the trace's size: the whole tensor,
    the full output of a gather) over n ranks, done as a ring: the rule by which the checkers
    price a built-in collective against the same bytes written as messages."""
    if n <= 1 or op == "barrier":
        return 0
    if op == "all_reduce":
        return 2 * (n - 1) * nbytes / n
    if op in ("reduce_scatter", "all_gather", "all_to_all", "gather", "scatter"):
        return (n - 1) * nbytes / n
    return nbytes                   # broadcast, reduce: the whole tensor passes every rank


def ring_messages(op, n):
    """The messages one rank sends in a collective over n ranks done as a ring (a chain)."""
    if n <= 1 or op == "barrier":
        return 0
    return 2 * (n - 1) if op == "all_reduce" else n - 1 if op in (
        "reduce_scatter", "all_gather", "all_to_all") else 1    # a rooted one: a hop of a chain


def wire_bytes(op, nbytes, n):
    """What one call puts on this rank's wire: a message its size, a receive nothing (it is the
    peer's send), a collective its ring share."""
    if op == "send":
        return nbytes
    if op == "recv":
        return 0
    return ring_share(op, nbytes, n)


def _record(kind, op, group, peer, nbytes, **more):
    return dict(kind=kind, op=op, group=tuple(group), peer=peer, bytes=nbytes,
                wire=wire_bytes(op, nbytes, len(group)), **more)


# ---- from a run's trace (in the parent) ----------------------------------------------------------

def _selects(where, e):
    if where is None:
        return True
    if isinstance(where, str):
        return bool(e["label"]) and e["label"][0] == where
    return where(e)


def records(trace, rank, where=None):
    """The rank's calls in the run's trace, in the order it issued them, as records. `where`: a
    span label (the calls inside `distlab.trace.span(label)`), or a function of the trace's event
    that says which to keep."""
    out = []
    for e in trace.comm(rank):
        if not _selects(where, e):
            continue
        kind = e["op"] if e["op"] in P2P else "collective"
        group = e["group"] or tuple(range(trace.world_size))
        out.append(_record(kind, e["op"], group, e["peer"], e["bytes"], native=e["native"],
                           label=e["label"], launch=e["launch"], end=e["end"], tag=e["tag"],
                           seq=e.get("seq", 0), values=None))
    return out


# ---- the rule's questions ----------------------------------------------------------------------

def off_group(calls, ranks):
    """(the first call that left the group `ranks`, a phrase naming it), or (None, ""): a message
    to or from a rank outside it, a collective over any other set of ranks (the world's
    included)."""
    for c in calls:
        if c["kind"] in P2P:
            if c["peer"] is not None and c["peer"] not in ranks:
                return c, f"a {c['op']} with rank {c['peer']}"
        elif sorted(c["group"]) != sorted(ranks):
            return c, f"a {c['op']} over ranks {list(c['group'])}"
    return None, ""


def wire(calls):
    """The bytes this rank put on the wire in `calls`, by the one rule."""
    return sum(c["wire"] for c in calls)


def messages(calls):
    """The messages this rank sent in `calls`: a send one, a collective its ring's count."""
    return sum(1 if c["kind"] == "send" else 0 if c["kind"] == "recv"
               else ring_messages(c["op"], len(c["group"])) for c in calls)


def data_calls(calls):
    """The calls that carry data (a barrier carries none)."""
    return [c for c in calls if c["op"] != "barrier"]


def describe(calls):
    if not calls:
        return "no communication"
    return ", ".join(f"{c['op']} of {c['bytes']:,} B" for c in calls)


def as_messages(calls, rank):
    """The calls as messages [dict(kind='send'|'recv', src, dst, bytes, tag, launch, end, seq)]:
    a collective over this rank and one other IS a message each way (a rooted one does not say
    its root: it counts both ways, the most it can have moved); a data collective over more
    ranks is kept as dict(kind='collective', op, group, native) for the caller to judge."""
    out = []
    for c in calls:
        if c["op"] == "barrier":
            continue
        when = dict(launch=c.get("launch"), end=c.get("end"), seq=c.get("seq", 0))
        if c["kind"] in P2P:
            src, dst = (rank, c["peer"]) if c["kind"] == "send" else (c["peer"], rank)
            out.append(dict(kind=c["kind"], src=src, dst=dst, bytes=c["bytes"],
                            tag=c.get("tag"), **when))
            continue
        group = list(c["group"])
        if len(group) != 2 or rank not in group:
            out.append(dict(kind="collective", op=c["op"], group=group,
                            native=c.get("native", False)))
            continue
        other = next(r for r in group if r != rank)
        each = c["bytes"] // 2 if c["op"] in ("all_gather", "reduce_scatter", "gather",
                                              "scatter") else c["bytes"]
        for src, dst in ((rank, other), (other, rank)):
            out.append(dict(kind="send" if src == rank else "recv", src=src, dst=dst,
                            bytes=each, tag=("pair", c["op"]), **when))
    return out


# ---- what travelled ----------------------------------------------------------------------------

def carried_nothing(call):
    """True when the call's values were read and hold only zeros (or nothing): it moved bytes but
    no data — a decoy beside an answer computed some other way."""
    v = call.get("values")
    return v is not None and (not v.numel() or not bool(v.abs().max()))


def carries(values, whole, scales=(1.0,)):
    """`values`, less its trailing zeros (padding), is a contiguous piece of `whole` times one of
    `scales` (a pre-divided gradient, a mean)."""
    if values is None:
        return False
    nz = torch.nonzero(values).reshape(-1)
    if not nz.numel():
        return False
    v = values[:int(nz[-1]) + 1].double()
    whole = whole.detach().reshape(-1).double()
    for off in range(whole.numel() - v.numel() + 1):
        for s in scales:
            if torch.allclose(whole[off:off + v.numel()] * s, v, rtol=1e-9, atol=1e-12):
                return True
    return False


_REDUCE = dict(sum=sum, avg=lambda v: sum(v) / len(v), product=lambda v: torch.stack(v).prod(0),
               min=lambda v: torch.stack(v).amin(0), max=lambda v: torch.stack(v).amax(0))


def delivered(per_rank):
    """What the calls of ranks ({rank: its `Carried` records}) handed them: each message, the sum
    of the ranks' k-th messages; each collective lined up over its group (its k-th call there):
    a reduction's result, an all-gather's pieces and sum, a broadcast's root tensor, all else."""
    out, lined, sent = [], {}, {}
    for rank, calls in sorted(per_rank.items()):
        seen = {}
        for c in (c for c in calls if c.get("values") is not None and c["op"] != "barrier"):
            key = "send" if c["kind"] == "send" else c["group"]
            k = seen[key] = seen.get(key, -1) + 1
            if c["kind"] == "send":
                out.append(c["values"])
                sent.setdefault(k, []).append(c["values"])
            else:
                lined.setdefault((c["group"], k), {})[rank] = c
    out += [sum(p) for p in sent.values() if len(p) > 1 and len({v.numel() for v in p}) == 1]
    for (group, _), by_rank in lined.items():
        calls = [by_rank[r] for r in group if r in by_rank]
        op, inputs = calls[0]["op"], [c["values"] for c in calls]
        same = len({v.numel() for v in inputs}) == 1 and len(calls) == len(group)  # all there
        how = _REDUCE.get(calls[0].get("reduce_op") or "")
        if op in ("all_reduce", "reduce", "reduce_scatter"):
            out += [how(inputs)] if how is not None and same else []
        elif op in ("broadcast", "scatter") and calls[0].get("root") in by_rank:
            out.append(by_rank[calls[0]["root"]]["values"])
        else:                       # all_gather, gather, all_to_all, a root not known
            out.extend(inputs)
            if op in ("all_gather", "gather") and same and len(inputs) > 1:
                out.append(sum(inputs))
    return [v for v in out if v.numel()]


def _keys(v):                # numpy (one thread: the ranks share the cores), log|v| with the
    return np.log(np.abs(v)) + 1000.0 * (v < 0)     # negative values in a band apart


def _pair_keys(v, floor=0.0):
    both = (np.abs(v[1:]) > floor) & (np.abs(v[:-1]) > floor)
    return _keys(v[1:][both] / v[:-1][both])


def _index(pieces):     # keys of the pieces' neighbouring ratios, keys of their values, values
    live = [p.detach().reshape(-1).double().numpy() for p in pieces if p.numel()]
    flat = np.unique(np.concatenate([np.zeros(0), *live]))
    flat, ends = flat[flat != 0], [[-1e9, 1e9]]
    return (np.sort(np.concatenate(ends + [_pair_keys(p) for p in live])),
            np.sort(np.concatenate(ends + [_keys(flat)])), flat)


def _found(have, want, tol):
    at = np.clip(np.searchsorted(have, want), 1, len(have) - 1)
    return np.minimum(np.abs(have[at] - want), np.abs(have[at - 1] - want)) <= tol


def holds(pieces, expected, tol=None, _index_=None):
    """Whether `expected` travelled in `pieces` (`delivered`), up to a factor, cut anywhere: half
    its neighbouring pairs (above 1e-3 of its largest) with the same ratio in some piece, or (64
    values or fewer, cut into single ones) most values times one factor. Zeros travel anywhere."""
    e = expected.detach().reshape(-1).double().numpy()
    tol = tol or (1e-7 if expected.dtype == torch.float64 else 1e-4)
    if not e.size or not np.abs(e).max():
        return True
    top = e[np.abs(e).argmax()]
    want, big = _pair_keys(e, 1e-3 * abs(top)), e[np.abs(e) > 1e-3 * abs(top)]
    pairs, keys, values = _index_ or _index(pieces)
    if want.size and _found(pairs, want, tol).mean() >= 0.5:
        return True
    if big.size > 64:
        return False
    image = (values / top)[:, None] * big[None, :]   # every value as the image of the top one
    return bool((_found(keys, _keys(image).ravel(), tol).reshape(image.shape).mean(1) > 0.5).any())


def missing(pieces, expected, names):
    """The name of the first of `expected` (tensors, named by `names`) that did not travel in
    `pieces` (`holds`); None when every one did."""
    index = _index(pieces)
    return next((n for n, e in zip(names, expected) if not holds(pieces, e, _index_=index)), None)


# ---- inside a rank: what each call carried -------------------------------------------------------

def _flat(tensors):
    ts = [t for t in tensors if isinstance(t, torch.Tensor) and not t.is_meta]
    if not ts:
        return torch.zeros(0, dtype=torch.float64)
    return torch.cat([t.detach().reshape(-1).double() for t in ts])


def _list(x):
    if isinstance(x, torch.Tensor):
        return [x]
    return [t for item in x for t in _list(item)] if isinstance(x, (list, tuple)) else []


# c10d op -> (op, the argument holding the process group, this rank's input, the trace's bytes)
def _n(ts):
    return sum(t.numel() * t.element_size() for t in _list(ts))


_C10D = {
    "allreduce_": ("all_reduce", 1, lambda a: a[0], lambda a, n: _n(a[0])),
    "allreduce_coalesced_": ("all_reduce", 1, lambda a: a[0], lambda a, n: _n(a[0])),
    "broadcast_": ("broadcast", 1, lambda a: a[0], lambda a, n: _n(a[0])),
    "reduce_": ("reduce", 1, lambda a: a[0], lambda a, n: _n(a[0])),
    "allgather_": ("all_gather", 2, lambda a: a[1], lambda a, n: _n(a[0])),
    "_allgather_base_": ("all_gather", 2, lambda a: a[1], lambda a, n: _n(a[0])),
    "allgather_coalesced_": ("all_gather", 2, lambda a: a[1], lambda a, n: _n(a[0])),
    "allgather_into_tensor_coalesced_": ("all_gather", 2, lambda a: a[1],
                                         lambda a, n: _n(a[0])),
    "reduce_scatter_": ("reduce_scatter", 2, lambda a: a[1], lambda a, n: _n(a[1])),
    "_reduce_scatter_base_": ("reduce_scatter", 2, lambda a: a[1], lambda a, n: _n(a[1])),
    "reduce_scatter_tensor_coalesced_": ("reduce_scatter", 2, lambda a: a[1],
                                         lambda a, n: _n(a[1])),
    "alltoall_": ("all_to_all", 2, lambda a: a[1], lambda a, n: _n(a[1])),
    "alltoall_base_": ("all_to_all", 2, lambda a: a[1], lambda a, n: _n(a[1])),
    "gather_": ("gather", 2, lambda a: a[1], lambda a, n: _n(a[1]) * n),
    "scatter_": ("scatter", 2, lambda a: a[1], lambda a, n: _n(a[0]) * n),
    "barrier": ("barrier", 1, lambda a: [], lambda a, n: 4),
    "send": ("send", 1, lambda a: a[0], lambda a, n: _n(a[0])),
    "recv_": ("recv", 1, lambda a: [], lambda a, n: _n(a[0])),
    "recv_any_source_": ("recv", 1, lambda a: [], lambda a, n: _n(a[0])),
}
# torch's functional (and differentiable) collectives: (op, the argument naming the group)
_FUNCTIONAL = {"all_reduce": ("all_reduce", 2), "all_reduce_coalesced": ("all_reduce", 2),
               "all_gather_into_tensor": ("all_gather", 2),
               "all_gather_into_tensor_coalesced": ("all_gather", 2),
               "reduce_scatter_tensor": ("reduce_scatter", 3),
               "reduce_scatter_tensor_coalesced": ("reduce_scatter", 3),
               "all_to_all_single": ("all_to_all", 3), "broadcast": ("broadcast", 2)}


# where a c10d op holds its reduction (ReduceOp numbers _REDUCE's keys) and root (a group rank)
_REDUCE_AT = {"allreduce_": 2, "allreduce_coalesced_": 2, "reduce_": 2, "reduce_scatter_": 3,
              "_reduce_scatter_base_": 3, "reduce_scatter_tensor_coalesced_": 3}
_ROOT_AT = {"broadcast_": 2, "reduce_": 3, "gather_": 3, "scatter_": 3}


def _reduction(x):
    try:                    # a premul_sum or an unfamiliar ReduceOp: not one of the five
        return x.lower() if isinstance(x, str) else tuple(_REDUCE)[x.op()]
    except Exception:
        return None


def _group_ranks(pg):
    from torch._C._distributed_c10d import ProcessGroup
    try:
        if isinstance(pg, str):
            pg = torch._C._distributed_c10d._resolve_process_group(pg)
        elif isinstance(pg, torch.ScriptObject):
            pg = ProcessGroup.unbox(pg)
        return tuple(dist.get_process_group_ranks(pg))
    except Exception:
        return tuple(range(dist.get_world_size()))


class Carried:
    """`with Carried() as carried:` inside a rank, around the learner's function: `carried.records`
    lists every collective and message this rank made, in order, with `values` (what this rank
    put in: its all-gather piece, its reduce-scatter or all-reduce input, a message's payload;
    None for a receive) and `phase` (whatever the checker set `carried.phase` to at the call)."""

    def __init__(self, values=True):
        from torch.utils._python_dispatch import TorchDispatchMode
        me = self
        self.records, self.phase, self._values = [], None, values

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                if func.namespace in ("c10d", "_c10d_functional"):
                    me._see(func, args)
                return func(*args, **(kwargs or {}))
        self._mode = Mode()

    def _see(self, func, args):
        name = func.__name__.split(".")[0]
        if func.namespace == "c10d" and name in _C10D:
            op, at, given, size = _C10D[name]
            group = _group_ranks(args[at])
            peer = None
            if op in P2P and name != "recv_any_source_":
                peer = group[args[at + 1]] if args[at + 1] < len(group) else args[at + 1]
            values = _flat(_list(given(args))) if self._values and op != "recv" else None
            self.records.append(_record(
                "collective" if op not in P2P else op, op, group, peer, size(args, len(group)),
                values=values, phase=self.phase, native=False,
                reduce_op=_reduction(args[_REDUCE_AT[name]]) if name in _REDUCE_AT else None,
                root=group[args[_ROOT_AT[name]]] if name in _ROOT_AT else None))
        elif func.namespace == "_c10d_functional" and name in _FUNCTIONAL:
            op, at = _FUNCTIONAL[name]
            group = _group_ranks(args[at])
            nbytes = _n(args[0]) * (len(group) if op == "all_gather" else 1)
            values = _flat(_list(args[0])) if self._values else None
            self.records.append(_record(
                "collective", op, group, None, nbytes, values=values, phase=self.phase,
                native=True, root=None,
                reduce_op=_reduction(args[1]) if op in ("all_reduce", "reduce_scatter") else None))

    def __enter__(self):
        self._mode.__enter__()
        return self

    def __exit__(self, *exc):
        return self._mode.__exit__(*exc)
