"""Checkers for workbook 06: a ZeRO-1 optimizer step, a ZeRO-3 layer's forward and backward, and
a prediction of ZeRO-2/3's bytes per GPU at rest and at the peak.

The first two judge the result (against one process, float64 with tight tolerances) AND what the
ranks sent: ZeRO's point is to shard memory at DDP's communication cost, so an answer that gets
the numbers right by moving more bytes is refused, with the bytes it moved (from the run's
trace); the ZeRO-3 layer's collectives are also read value by value inside the rank, so a decoy
collective beside the real exchange is named. The third compares the learner's count with the
course's memory model term by term, then with the course's own ZeRO measured on real ranks.
"""
import math
import re
import time

import torch
import torch.nn.functional as F

from .. import models, trace as _trace
from ..cost import TERMS
from ..emulate import _MODEL
from ..launch import RankFailed
from ..sharding import ZeRO, chunk_bounds, gather_flat
from . import CheckFailed, call_learner, compare, forbid, passed, run, run_learner, sizes_phrase

# Parameter counts 60, 10, 50, 5, 15, 3: none divides by both 2 and 3, so slices are padded.
SIZES, STEPS, BATCH, LR = (6, 10, 5, 3), 3, 12, 0.05
TIMEOUT = 60  # a learner's deadlock is reported (with where each rank waits) within this
# (generous: on a loaded 2-core machine a 3-rank launch alone has taken over 20 s)


def _course_code():
    return (ZeRO, ZeRO.step, ZeRO._reduce_scatter_grad, ZeRO._all_gather_param, ZeRO._gather,
            ZeRO._start_prefetch, ZeRO._make_grad_hook, gather_flat)


def _run(rank_fn, ws, fn, name):
    """run_learner, traced; gloo's own words about mismatched calls become one sentence."""
    try:
        return run_learner(rank_fn, ws, fn, name=name, timeout=TIMEOUT, trace=True)
    except RankFailed as e:
        calls = re.findall(r"distributed_c10d\.py\", line \d+, in (\w+)", e.remote_traceback)
        # gloo's own words ("Connection reset by peer ... GLHF", or an abort when the sizes it
        # receives differ) say nothing a learner can use.
        aborted = e.exc_type is None and "SIGABRT" in str(e)
        if aborted or (calls and ("gloo" in str(e) or getattr(e, "peer_lost", False))):
            op = f"{calls[-1]} calls" if calls else "collectives"
            raise CheckFailed(
                f"with world_size={ws}, the ranks' {op} did not match (gloo failed on rank "
                f"{e.rank}): every rank must pass tensors of the same size, so pad each slice "
                f"to ceil(numel / world_size) elements (F.pad) before gathering or scattering "
                f"and trim the padding after — the last ranks' slices are shorter when numel "
                f"does not divide.") from None
        raise


def _traffic(trace, rank):
    """(bytes rank sent in a ring/tree, {op: bytes}) over its calls, as the α-β model counts them:
    an all-reduce sends 2(N-1)/N of the tensor, a reduce-scatter or an all-gather (N-1)/N."""
    per_op = {}
    for e in trace.comm(rank):
        n = len(e["group"]) if e["group"] else trace.world_size
        volume = TERMS[_MODEL.get(e["op"], "send")](e["bytes"], n)[1] if n > 1 else 0
        per_op[e["op"]] = per_op.get(e["op"], 0) + volume
    return sum(per_op.values()), per_op


def _kb(b):
    return f"{b:,.0f} B"


def _check_traffic(trace, ws, allowed, what, rule):
    for rank in range(ws):
        total, per_op = _traffic(trace, rank)
        if total > allowed * (1 + 1e-9):
            calls = ", ".join(f"{op} {_kb(v)}" for op, v in sorted(per_op.items()))
            raise CheckFailed(
                f"with world_size={ws}, rank {rank} sent {_kb(total)} ({calls}; from the run's "
                f"trace), {total / allowed:.2f}× the {_kb(allowed)} {what}; {rule}")


# ---- exercise 1: a ZeRO-1 step --------------------------------------------------------------

def _zero1_rank(rank, world_size, fn):
    torch.set_default_dtype(torch.float64)
    model = models.make_mlp(SIZES, seed=3)
    params = list(model.parameters())
    shards = []
    for p in params:
        lo, hi = chunk_bounds(p.numel(), world_size, rank)
        shards.append(torch.nn.Parameter(p.data.view(-1)[lo:hi]))
    optimizer = torch.optim.Adam(shards, lr=LR)
    x, y = models.regression_data(64, SIZES[0], SIZES[-1], seed=4)
    for gx, gy in models.batches_of(x, y, BATCH, STEPS):
        model.zero_grad()
        optimizer.zero_grad()
        F.mse_loss(model(gx.chunk(world_size)[rank]), gy.chunk(world_size)[rank]).backward()
        with forbid(*_course_code(), exercise="write the ZeRO-1 step yourself"), \
                _trace.span("zero1_step"):
            fn(params, shards, optimizer)
    states = sum(v.numel() for st in optimizer.state.values() for v in st.values() if v.dim())
    return [p.detach().clone() for p in params], states


def _zero1_reference():
    torch.set_default_dtype(torch.float64)
    try:
        model = models.make_mlp(SIZES, seed=3)
        x, y = models.regression_data(64, SIZES[0], SIZES[-1], seed=4)
        models.train_reference(model, models.batches_of(x, y, BATCH, STEPS), optimizer="adam",
                               lr=LR)
        return [p.detach().clone() for p in model.parameters()]
    finally:
        torch.set_default_dtype(torch.float32)


def _padded(numels, ws):
    """Elements a collective over per-parameter slices moves: each padded to ceil(n/ws)·ws."""
    return sum(math.ceil(n / ws) * ws for n in numels)


def check_zero1_step(fn, world_sizes=(2, 3)):
    """fn(params, shards, optimizer) must leave every rank with the parameters of Adam on one
    process, keep Adam's state for its slices only, and send no more than DDP sends."""
    want = _zero1_reference()
    numels = [p.numel() for p in want]
    n = sum(numels)
    names = [f"{i}.{k}" for i in range(0, 2 * (len(SIZES) - 1), 2) for k in ("weight", "bias")]
    for ws in world_sizes:
        got = _run(_zero1_rank, ws, fn, "zero1_step")
        for rank, (params, states) in enumerate(got):
            for name, g, w in zip(names, params, want):
                compare(g, w, f"zero1_step with world_size={ws}, rank {rank}, after {STEPS} "
                        f"steps, parameter net.{name}", atol=1e-10, rtol=1e-9)
        total_states = sum(states for _, states in got)
        if total_states != 2 * n:
            raise CheckFailed(f"with world_size={ws} the ranks keep {total_states} optimizer "
                              f"state values in all; sharded Adam keeps 2 per parameter "
                              f"({2 * n}), split between the ranks.")
        # DDP all-reduces the gradients: 2(N-1)/N of them per step. ZeRO-1 moves the same, as a
        # reduce-scatter of the gradients + an all-gather of the updated slices (padded slices
        # cost a few bytes more; one flat buffer for all parameters, less).
        ring = 2 * (ws - 1) / ws * 8 * STEPS
        _check_traffic(got.trace, ws, ring * _padded(numels, ws),
                       f"that a reduce-scatter of the gradients plus an all-gather of the updated "
                       f"slices send in {STEPS} steps (DDP's all-reduce: {_kb(ring * n)})",
                       "ZeRO-1 costs what DDP costs because an all-reduce IS a reduce-scatter "
                       "followed by an all-gather: reduce-scatter the gradients (each rank needs "
                       "only the average of its own slice) instead of all-reducing them, then "
                       "all-gather the updated slices.")
    passed(f"zero1_step trains exactly like Adam on one process, on {sizes_phrase(world_sizes)} "
           f"ranks over {STEPS} steps, each rank keeping only its slice of Adam's state and "
           f"sending what DDP sends (a reduce-scatter + an all-gather).")

# ---- exercise 2: a ZeRO-3 layer, forward AND backward ------------------------------------------
#
# The learner writes an autograd.Function that holds only this rank's flat slices of a Linear
# layer's weight and bias: forward all-gathers the full weight, computes, and lets it go;
# backward gathers the weight AGAIN (it was not kept), computes the three gradients, and
# reduce-scatters the weight's and the bias's gradients so that each rank keeps the average of
# its own slice. Judged on the values (float64, against one process that sees every rank's
# batch), on what each collective CARRIED (recorded inside the rank: a decoy collective of zeros
# beside the real exchange is named), on the trace (every collective the profiler saw must be one
# the recorder read) and on memory (what the forward leaves alive for backward, tracked storage by
# storage: the full weight must not be among it).

# (in, out) of two stacked layers, tanh between: weights 63 and 35, biases 7 and 5 values — none
# divides by 2, and only 63 by 3, so slices are padded; 3 rows per rank, fewer values than any
# weight, so what a forward keeps is told apart from a weight.
LAYERS, ROWS = ((9, 7), (7, 5)), 3


class _Collectives:
    """A dispatch mode that records, for every c10d collective this rank calls, its op and a
    flat copy of what this rank PUTS IN (its all-gather piece, its reduce-scatter input, its
    all-reduce tensor); `phase` is stamped on each record."""

    _INPUT = {"allgather_": ("all_gather", lambda a: a[1][0]),
              "_allgather_base_": ("all_gather", lambda a: a[1]),
              "allgather_into_tensor_coalesced_": ("all_gather", lambda a: torch.cat(
                  [t.reshape(-1) for t in a[1]])),
              "reduce_scatter_": ("reduce_scatter", lambda a: torch.cat(
                  [t.reshape(-1) for t in a[1][0]])),
              "_reduce_scatter_base_": ("reduce_scatter", lambda a: a[1]),
              "allreduce_": ("all_reduce", lambda a: torch.cat([t.reshape(-1) for t in a[0]]))}

    def __init__(self):
        from torch.utils._python_dispatch import TorchDispatchMode
        recorder = self
        self.calls, self.phase = [], None

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                name = str(func)
                if name.startswith("c10d."):
                    op = name.split(".")[1]
                    label, get = recorder._INPUT.get(op, (op.strip("_"), None))
                    values = get(args).detach().reshape(-1).clone() if get else None
                    recorder.calls.append((recorder.phase, label, values))
                return func(*args, **(kwargs or {}))
        self._mode = Mode()

    def __enter__(self):
        self._mode.__enter__()
        return self

    def __exit__(self, *exc):
        return self._mode.__exit__(*exc)


class _Kept:
    """Bytes of the storages created inside the block that are still alive after it (weakly
    tracked, op by op), less those of `out`: what a forward leaves behind for backward."""

    def __enter__(self):
        from torch.multiprocessing.reductions import StorageWeakRef
        from torch.utils._python_dispatch import TorchDispatchMode
        from torch.utils._pytree import tree_leaves
        refs, self._refs = {}, None

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                for t in tree_leaves(out):
                    if isinstance(t, torch.Tensor) and t.device.type != "meta":
                        st = t.untyped_storage()
                        ref = refs.get(st._cdata)
                        if ref is None or ref.expired():    # a freed storage's key, reused
                            refs[st._cdata] = StorageWeakRef(st)
                return out
        self._refs, self._mode = refs, Mode()
        self._mode.__enter__()
        return self

    def __exit__(self, *exc):
        return self._mode.__exit__(*exc)

    def bytes_besides(self, out, below=None, wait=0.5):
        """`below`: while the count is not below it, read again for up to `wait` seconds.
        gloo's worker thread lets go of a finished collective's tensors (the padded slice it
        sent, the parts it filled) a moment after wait() returns, so a first reading taken
        straight after the call can count them; what the learner's code keeps never goes."""
        mine = out.untyped_storage()._cdata if isinstance(out, torch.Tensor) else None
        deadline = time.monotonic() + wait
        while True:
            alive = (torch.UntypedStorage._new_with_weak_ptr(ref.cdata)
                     for key, ref in list(self._refs.items()) if key != mine)
            total = sum(st.nbytes() for st in alive if st is not None)   # None: just freed
            if below is None or total < below or time.monotonic() >= deadline:
                return total
            time.sleep(0.01)


def _layer_data(rank):
    """(dense layers, this rank's input): the same on every rank but the input."""
    torch.manual_seed(0)
    dense = [torch.nn.Linear(i, o) for i, o in LAYERS]
    x = torch.linspace(-1, 1, ROWS * LAYERS[0][0]).reshape(ROWS, -1) * (rank + 1) + rank / 3
    return dense, x


def _zero3_layer_rank(rank, world_size, Fn):
    torch.set_default_dtype(torch.float64)
    dense, x = _layer_data(rank)
    # what this rank's own batch gives, on one process: the values its collectives must carry
    xd = x.clone().requires_grad_()
    h = xd
    for layer in dense:
        h = torch.tanh(layer(h))
    h.pow(2).mean().backward()
    local = [(layer.weight.grad.reshape(-1).clone(), layer.bias.grad.reshape(-1).clone())
             for layer in dense]
    shards = []
    for layer in dense:
        pair = []
        for p in (layer.weight, layer.bias):
            lo, hi = chunk_bounds(p.numel(), world_size, rank)
            pair.append(p.detach().reshape(-1)[lo:hi].clone().requires_grad_())
        shards.append(pair)
    xs = x.clone().requires_grad_()
    kept, outs = [], []
    with forbid(*_course_code(), exercise="write the ZeRO-3 layer yourself"), \
            _Collectives() as rec:
        h = xs
        for k, (layer, (w, b)) in enumerate(zip(dense, shards)):
            rec.phase = ("forward", k)
            with _Kept() as track:
                out = Fn.apply(h, w, b, tuple(layer.weight.shape))
            if not isinstance(out, torch.Tensor):
                raise CheckFailed(f"ZeRO3Linear.apply returned {type(out).__name__}; forward "
                                  f"returns the layer's output, a tensor.")
            kept.append(track.bytes_besides(out, below=layer.weight.numel() * 8))
            outs.append(out.detach().clone())
            h = torch.tanh(out)
        rec.phase = ("backward",)
        h.pow(2).mean().backward()
    grads = [[None if t.grad is None else t.grad.detach().clone() for t in pair]
             for pair in shards]
    own = [[t.detach().reshape(-1).clone() for t in pair] for pair in shards]
    return dict(outs=outs, x_grad=None if xs.grad is None else xs.grad.clone(), grads=grads,
                kept=kept, calls=rec.calls, local=local, own=own)


def _zero3_layer_reference(world_size):
    """Per rank: the dense outputs, its input's gradient, and its slices of the AVERAGED weight
    and bias gradients (every rank's loss is the mean over its rows; the global gradient is
    the mean over the ranks)."""
    torch.set_default_dtype(torch.float64)
    try:
        per_rank, total = [], None
        for rank in range(world_size):
            dense, x = _layer_data(rank)
            x.requires_grad_()
            h, outs = x, []
            for layer in dense:
                out = layer(h)
                outs.append(out.detach())
                h = torch.tanh(out)
            h.pow(2).mean().backward()
            g = [(l.weight.grad.reshape(-1), l.bias.grad.reshape(-1)) for l in dense]
            total = g if total is None else [(a + c, b + d) for (a, b), (c, d) in zip(total, g)]
            per_rank.append((outs, x.grad.detach()))
        mean = [(a / world_size, b / world_size) for a, b in total]
        out = []
        for rank, (outs, xg) in enumerate(per_rank):
            sl = [[v[slice(*chunk_bounds(v.numel(), world_size, rank))] for v in pair]
                  for pair in mean]
            out.append((outs, xg, sl))
        return out
    finally:
        torch.set_default_dtype(torch.float32)


def _same(values, want, scales=(1.0,)):
    """values (a padded collective input) starts with want × one of `scales`."""
    if values is None or values.numel() < want.numel():
        return False
    head = values[:want.numel()]
    return any(torch.allclose(head, want * s, rtol=1e-9, atol=1e-12) for s in scales)


def _judge_calls(calls, got, ws, rank):
    """Name each collective by what it carried; refuse what the algorithm does not send."""
    where = f"with world_size={ws}, rank {rank}"
    names = ("weight", "bias")
    seen = set()
    for phase, op, values in calls:
        label = None
        if op == "all_gather":
            for k, pair in enumerate(got["own"]):
                for name, shard in zip(names, pair):
                    if _same(values, shard):
                        label = ("gather", k, name)
        elif op == "reduce_scatter":
            for k, pair in enumerate(got["local"]):
                for name, grad in zip(names, pair):
                    if _same(values, grad, (1.0, 1.0 / ws)):
                        label = ("reduce", k, name)
        if phase == ("backward",) and label and label[0] == "gather":
            stage = "backward"
        else:
            stage = phase[0] if phase else "outside the layer"
        if label is None and op not in ("all_gather", "reduce_scatter"):
            raise CheckFailed(
                f"{where}: the {stage} called {op}; a ZeRO-3 layer needs only all-gathers of "
                f"the slices (forward, and the weight again in backward) and reduce-scatters "
                f"of the gradients this rank computed — "
                + ("an all-reduce leaves every rank the whole sum, twice a reduce-scatter's "
                   "bytes, where each rank needs only its own slice." if op == "all_reduce"
                   else "nothing else."))
        if label is None:
            what = {"all_gather": "an all-gather", "reduce_scatter": "a reduce-scatter"}.get(
                op, f"a {op}")
            carried = ("nothing the check could read" if values is None else
                       "all zeros" if not values.abs().max() else "values that are neither "
                       "this rank's slice of a weight or bias nor its gradient of one")
            rule = ("the layer needs only two kinds of collectives: all-gathers of the slices "
                    "(forward, and the weight again in backward) and reduce-scatters of the "
                    "full gradients this rank computed (backward)")
            raise CheckFailed(f"{where}: {what} in the {stage} carried {carried}; {rule}.")
        if label[0] == "reduce" and phase != ("backward",):
            raise CheckFailed(f"{where}: layer {label[1]}'s {label[2]} gradient was "
                              f"reduce-scattered outside backward.")
        key = (stage,) + label
        if key in seen:
            raise CheckFailed(f"{where}: layer {label[1]}'s {label[2]} was "
                              f"{'gathered' if label[0] == 'gather' else 'reduce-scattered'} "
                              f"twice in the {stage}: once is all the algorithm needs.")
        seen.add(key)
    for k in range(len(LAYERS)):
        for name in names:
            if ("forward", "gather", k, name) not in seen:
                raise CheckFailed(f"{where}: the forward of layer {k} never all-gathered the "
                                  f"slices of its {name}.")
            if ("backward", "reduce", k, name) not in seen:
                raise CheckFailed(f"{where}: the backward of layer {k} never reduce-scattered "
                                  f"its {name}'s gradient: each rank must end with the average "
                                  f"of its own slice, and only the other ranks have their parts.")
        if ("backward", "gather", k, "weight") not in seen:
            raise CheckFailed(f"{where}: the backward of layer {k} never all-gathered its weight "
                              f"again, yet grad_x = grad_out @ W needs the full weight — "
                              f"ZeRO-3 frees it after forward and gathers it again for backward.")
    return seen


def check_zero3_layer(Fn, world_sizes=(2, 3)):
    """Fn: an autograd.Function, Fn.apply(x, weight_shard, bias_shard, shape) -> the Linear
    layer's output, holding only flat slices (chunk_bounds) of its weight and bias."""
    name = getattr(Fn, "__name__", "ZeRO3Linear")
    if not (isinstance(Fn, type) and issubclass(Fn, torch.autograd.Function)):
        raise TypeError(f"the check needs your autograd.Function class, e.g. "
                        f"check_zero3_layer(ZeRO3Linear); got {Fn!r}.")
    for ws in world_sizes:
        want = _zero3_layer_reference(ws)
        got = _run(_zero3_layer_rank, ws, Fn, name)
        for rank, (g, (outs, xg, sl)) in enumerate(zip(got, want)):
            where = f"{name} with world_size={ws}, rank {rank}"
            for k, (o, w) in enumerate(zip(g["outs"], outs)):
                compare(o, w, f"{where}, layer {k}'s forward output", atol=1e-10, rtol=1e-9)
            for k, (layer, kept) in enumerate(zip(LAYERS, g["kept"])):
                full = layer[0] * layer[1] * 8
                if kept >= full:
                    raise CheckFailed(
                        f"{where}: after layer {k}'s forward the rank still holds {kept:,} B it "
                        f"made during it — as much as the full {layer[1]}×{layer[0]} weight "
                        f"({full:,} B in float64). ZeRO-3 lets the gathered weight go after "
                        f"forward (save only what you were given, e.g. x and the slices) and "
                        f"gathers it again in backward.")
            if g["x_grad"] is None:
                raise CheckFailed(f"{where}: the input got no gradient: backward must return "
                                  f"grad_x first (then the two slices' gradients, then None).")
            compare(g["x_grad"], xg, f"{where}, the input's gradient (grad_x)", atol=1e-10,
                    rtol=1e-9)
            _judge_calls(g["calls"], g, ws, rank)
            for k, (pair, wpair) in enumerate(zip(g["grads"], sl)):
                for pname, gv, wv in zip(("weight", "bias"), pair, wpair):
                    if gv is None:
                        raise CheckFailed(f"{where}: layer {k}'s {pname} slice got no gradient.")
                    compare(gv, wv, f"{where}, layer {k}'s {pname} slice's gradient (the "
                            f"average over the ranks of this slice)", atol=1e-10, rtol=1e-9)
        for rank in range(ws):
            recorded = len(got[rank]["calls"])
            traced = len(got.trace.comm(rank))
            if traced != recorded:
                raise CheckFailed(f"with world_size={ws}, rank {rank} made {traced} "
                                  f"communication calls (from the run's trace) but only "
                                  f"{recorded} through torch.distributed's collectives; "
                                  f"use dist.all_gather / dist.reduce_scatter (or their "
                                  f"_single forms), one per tensor.")
    passed(f"{name} gathers each layer's weight for forward and again for backward, "
           f"reduce-scatters the gradients it computed (each rank keeps the average of its "
           f"slices) and keeps no full weight between forward and backward; outputs and "
           f"gradients equal one process in float64, on {sizes_phrase(world_sizes)} ranks.")


# ---- exercise 3: predict, then run — bytes per GPU of ZeRO-2 and ZeRO-3 ------------------------
#
# The learner writes, for units (modules gathered at once) of given parameter counts, the bytes
# one rank holds at rest (after the step) and at the worst moment of forward + backward, from
# the bytes per parameter of weights, gradients and optimizer state. Compared with the course's
# model (memory.model_state_bytes for the steady state, zero_memory.zero3_peak walked moment by
# moment for the peak; activations left out) one term at a time, then with the course's own
# ZeRO run on real ranks: its state measured after the step, its peak tracked storage by storage.

# (units' parameter counts, world size, stage, {weights, grads, optimizer} bytes/param)
PREDICT_CASES = [
    ([1000, 1000, 1000], 4, 3, None), ([4000, 1000, 2000, 500], 2, 3, None),
    ([600, 6000, 60], 3, 3, None), ([1000, 1000, 1000], 4, 2, None),
    ([500, 8000, 2000], 2, 2, None), ([6000, 600, 60], 3, 2, None)]
FP32_ADAM = {"weights": 4, "grads": 4, "optimizer": 8}      # as the course's float32 runs keep
MIXED_ADAM = {"weights": 2, "grads": 2, "optimizer": 12}    # memory's bf16-mixed with Adam
# the measured runs: an MLP of d×d layers with biases, 4 rows per rank (its activations are a
# fraction of a percent of the weights' bytes), 2 ranks; every unit divides by 2
RUN_DIMS, RUN_ROWS = ((512, 512, 256, 512), 4)
_TERMS = {"weights": "the weights", "grads": "the gradients", "optimizer": "the optimizer state"}
_WHY = {
    ("weights", 2): "ZeRO-2 keeps every weight whole on every rank, all the time",
    ("weights", 3): "a rank keeps its 1/N of the weights, and at its worst moment also one "
                    "unit's full weights, gathered for that unit's backward",
    ("grads", 2): "at the worst moment of backward a rank holds the gradient shards of the units "
                  "already reduced, this unit's own shard, and this unit's FULL gradient, "
                  "which exists until its reduce-scatter",
    ("grads", 3): "at the worst moment of backward a rank holds the gradient shards of the units "
                  "already reduced, this unit's own shard, and this unit's FULL gradient, "
                  "which exists until its reduce-scatter",
    ("optimizer", 2): "the optimizer state is sharded: 1/N of it, all the time",
    ("optimizer", 3): "the optimizer state is sharded: 1/N of it, all the time",
}


def _reference_zero_bytes(units, world_size, stage, per):
    """{"steady", "peak"} of the course's model: memory.model_state_bytes after the step,
    zero_memory.zero3_peak over the units (no activations) during forward + backward."""
    from .. import memory, zero_memory
    n = sum(units)
    # memory's precisions are names; the learner's bytes are numbers: scale its fp32 row
    steady = memory.model_state_bytes(n, "fp32", "adam", stage, world_size)
    steady = sum(steady[k] / FP32_ADAM[k] * per[k] for k in steady)
    w, g, o = per["weights"], per["grads"], per["optimizer"]
    gathered = stage == 3
    states = (w * n if not gathered else w * n / world_size) + o * n / world_size
    peak = zero_memory.zero3_peak(
        [dict(weights=w * u if gathered else 0.0, grad=g * u, grad_shard=g * u / world_size,
              acts=0.0) for u in units], states)
    return {"steady": steady, "peak": peak["peak"], "moment": peak["moment"]}


def _predict(fn, name, units, world_size, stage, per):
    from .. import memory, zero_memory
    with forbid(memory.model_state_bytes, memory.bytes_per_parameter, zero_memory.zero3_peak,
                zero_memory.llama_zero3_peak, _reference_zero_bytes,
                exercise="write the count yourself"):
        got = call_learner(fn, list(units), world_size, stage, dict(per), name=name)
    if not isinstance(got, dict) or not {"steady", "peak"} <= set(got):
        raise CheckFailed(f"{name} should return a dict with the keys 'steady' and 'peak' "
                          f"(bytes); got {got!r}.")
    out = {}
    for key in ("steady", "peak"):
        try:
            out[key] = float(got[key])
        except (TypeError, ValueError):
            raise CheckFailed(f"{name}(...)[{key!r}] should be a number of bytes; got "
                              f"{got[key]!r}.") from None
    return out


def _zero_bytes_run(rank, world_size):
    """The course's ZeRO-2 and ZeRO-3 on the RUN_DIMS MLP (float32, Adam): per stage, (the
    state measured after the second step, the tracked peak of that step's forward + backward)."""
    from .. import zero_memory
    from ..sharding import ZeRO
    out = {}
    for stage in (2, 3):
        model = models.make_mlp(RUN_DIMS, seed=0)
        x, y = models.regression_data(n=RUN_ROWS * world_size, in_dim=RUN_DIMS[0],
                                      out_dim=RUN_DIMS[-1], seed=0)
        zero = ZeRO(model, stage, optimizer="adam", lr=1e-3)
        xs, ys = x.chunk(world_size)[rank].clone(), y.chunk(world_size)[rank].clone()
        for _ in range(2):                           # the second step: Adam's state exists
            zero.zero_grad()
            held = [*model.parameters(), *zero.shards,
                    *(v for st in zero.optimizer.state.values() for v in st.values())]
            with zero_memory.PeakTracker(held) as tracked:
                F.mse_loss(model(xs), ys).backward()
            zero.step()
        out[stage] = (sum(zero.state_bytes().values()), tracked.peak)
    return out


def check_zero_bytes(fn):
    """fn(units, world_size, stage, bytes_per_param) -> {"steady": bytes, "peak": bytes} one
    rank holds under ZeRO-`stage` (2 or 3), activations left out: compared term by term with
    the course's model, then with the course's ZeRO measured on 2 ranks."""
    name = getattr(fn, "__name__", "zero_bytes")
    if not callable(fn):
        raise TypeError(f"the check needs your function, e.g. check_zero_bytes({name}); got "
                        f"{fn!r}.")
    for units, ws, stage, _ in PREDICT_CASES:
        where = f"{name}({units}, world_size={ws}, stage={stage}, ...)"
        for term in ("weights", "grads", "optimizer"):
            per = {k: (1 if k == term else 0) for k in FP32_ADAM}
            want = _reference_zero_bytes(units, ws, stage, per)
            got = _predict(fn, name, units, ws, stage, per)
            for key in ("steady", "peak"):
                if math.isclose(got[key], want[key], rel_tol=1e-9, abs_tol=1e-9):
                    continue
                at = ("at rest (after the step)" if key == "steady" else
                      f"at the worst moment ({want['moment']})")
                raise CheckFailed(
                    f"{where}: your {key} count of {_TERMS[term]} is off — counting only them "
                    f"(1 B per parameter, the others 0 B) you say {got[key]:,.6g} B, the rank "
                    f"holds {want[key]:,.6g} B {at}: {_WHY[term, stage]}.")
        for per in (FP32_ADAM, MIXED_ADAM):
            want = _reference_zero_bytes(units, ws, stage, per)
            got = _predict(fn, name, units, ws, stage, per)
            for key in ("steady", "peak"):
                if not math.isclose(got[key], want[key], rel_tol=1e-9):
                    raise CheckFailed(
                        f"{where} with {per}: your {key} is {got[key]:,.6g} B, the model's "
                        f"{want[key]:,.6g} B, although each term alone is right"
                        + (": the peak is ONE moment — add the three terms at each moment "
                           "(each unit's backward), then take the largest sum, rather than "
                           "adding each term's own largest." if key == "peak" else "."))
    # then run: the course's own ZeRO on real ranks, float32 and Adam
    units = [i * o + o for i, o in zip(RUN_DIMS, RUN_DIMS[1:])]
    measured = run(_zero_bytes_run, 2, timeout=TIMEOUT)
    for stage in (2, 3):
        steady = max(m[stage][0] for m in measured)
        peak = max(m[stage][1] for m in measured)
        guess = _predict(fn, name, units, 2, stage, FP32_ADAM)
        if not math.isclose(guess["steady"], steady, rel_tol=1e-9):
            raise CheckFailed(f"ZeRO-{stage} of the {RUN_DIMS} MLP on 2 ranks: your steady "
                              f"state is {guess['steady']:,.0f} B, the course's ZeRO holds "
                              f"{steady:,} B after its step (measured on its tensors).")
        if not math.isclose(guess["peak"], peak, rel_tol=0.01):
            raise CheckFailed(f"ZeRO-{stage} of the {RUN_DIMS} MLP on 2 ranks: your peak is "
                              f"{guess['peak']:,.0f} B, the course's ZeRO peaked at {peak:,} B "
                              f"during forward + backward (tracked storage by storage).")
    passed(f"{name} counts ZeRO-2 and ZeRO-3 at rest and at their worst moment, term by term, "
           f"as the course's model does on {len(PREDICT_CASES)} cases, and lands within 1 % of "
           f"the peak tracked on the course's own ZeRO-2 and ZeRO-3 (2 ranks; the rest is "
           f"activations, which the count leaves out).")
