"""Workbook 06, exercise 2: a ZeRO-3 layer's forward and backward as an autograd.Function."""
import time

import torch

from ...sharding import chunk_bounds
from .. import CheckFailed, compare, forbid, passed, sizes_phrase
from ._common import _Collectives, _course_code, _run

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
        extra = None
        if op == "all_gather":
            for k, pair in enumerate(got["own"]):
                for name, shard in zip(names, pair):
                    if _same(values, shard):
                        label = ("gather", k, name)
                # one all-gather of the weight's and the bias's slices together (FSDP's flat
                # parameter): the bias slice follows the weight slice, padded or not
                w_shard, b_shard = pair
                c = -(-LAYERS[k][0] * LAYERS[k][1] // ws)
                if label == ("gather", k, "weight") and values is not None:
                    for offset in {w_shard.numel(), c}:
                        if b_shard.numel() and _same(values[offset:], b_shard):
                            extra = ("gather", k, "bias")
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
        for lab in (label, extra):
            if lab is None:
                continue
            key = (stage,) + lab
            if key in seen:
                raise CheckFailed(f"{where}: layer {lab[1]}'s {lab[2]} was "
                                  f"{'gathered' if lab[0] == 'gather' else 'reduce-scattered'} "
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
