"""The state dict a rank offers to DCP, under the DENSE model's names: its DTensor shards
(sharded format) or its whole stage (dense format), stacked matrices saved as their pieces."""
import re

import torch
import torch.distributed as dist

from ..parallel3d import _unshard
from ..tensor_parallel import ColumnParallelLinear, RowParallelLinear


def _dense(stage, mesh, local):
    """{dense name: full tensor} from {this stage's name: this rank's shard} (collective over tp)."""
    out = {}
    for name, t in local.items():
        owner = stage.get_submodule(name.rpartition(".")[0])
        out[stage.dense_name(name)] = _unshard(owner, name.rpartition(".")[2], t.detach(),
                                               mesh.get_group("tp")).cpu()
    return out


# The pieces a stacked column-parallel matrix is saved as (chapter 07: qkv; SwiGLU's gate_up).
_PIECES = {3: ("q", "k", "v"), 2: ("gate", "up")}
_PIECE = re.compile(r"(?P<base>.*\.(?:weight|bias))\.(?P<piece>q|k|v|gate|up)(?P<tail>(?:\.exp_avg(?:_sq)?)?)")


def _pieces(stage, name, local):
    """[(dense key, this rank's piece, the dimension the tp ranks split, or None)] of `local`,
    this rank's tensor of parameter `name` (or of its Adam moment): views, no copies."""
    owner, attr = stage.get_submodule(name.rpartition(".")[0]), name.rpartition(".")[2]
    full = stage.dense_name(name)
    if isinstance(owner, ColumnParallelLinear):
        if owner.chunks > 1:
            parts = local.split(owner.local_sizes, 0)    # unequal under grouped-query attention
            return [(f"{full}.{piece}", part, 0) for piece, part in zip(_PIECES[owner.chunks], parts)]
        return [(full, local, 0)]
    if isinstance(owner, RowParallelLinear) and attr == "weight":
        return [(full, local, 1)]
    return [(full, local, None)]                # row-parallel bias, LayerNorms, embeddings, head


def _sharded(stage, mesh, local, device_type, whole=False):
    """{dense key: DTensor} over this stage's (dp, tp) DeviceMesh, wrapping this rank's tensors
    (no communication, no copy: from_local with run_check=False trusts the even split).

    `whole`: pieces that are views into a larger tensor (q, k, v of a stacked qkv) are copied
    out first. async_save needs it on torch 2.13: its stager fails on a DTensor whose local
    tensor is such a view ("Attempted to call copy_() on an invalid python storage")."""
    from torch.distributed.tensor import DTensor, Replicate, Shard
    dmesh = mesh.device_mesh(device_type)["dp", "tp"]
    out = {}
    for name, t in local.items():
        for key, part, dim in _pieces(stage, name, t.detach()):
            if whole and part.untyped_storage().nbytes() != part.numel() * part.element_size():
                part = part.clone()
            placements = [Replicate(), Replicate() if dim is None else Shard(dim)]
            out[key] = DTensor.from_local(part, dmesh, placements, run_check=False)
    return out


def _state(stage, mesh, optimizer, sharded, whole=False):
    """The state dict this rank offers to DCP (see the module's docstring)."""
    def convert(local):
        if sharded:
            return _sharded(stage, mesh, local, next(stage.parameters()).device.type, whole)
        return _dense(stage, mesh, local)
    state = {f"model.{k}": v for k, v in convert(dict(stage.named_parameters())).items()}
    if optimizer is not None:
        for which in ("exp_avg", "exp_avg_sq"):
            local = {n: s[which] for n, s in optimizer.state.items()}
            state.update({f"optim.{k}.{which}": v for k, v in convert(local).items()})
        state["optim.step"] = torch.tensor(optimizer.steps)
    if sharded:
        state["layout"] = torch.tensor([mesh.dp, mesh.pp, mesh.tp])
    state[f"rng.{dist.get_rank()}"] = torch.get_rng_state()
    if torch.cuda.is_available():               # dropout on a GPU draws from its own generator
        state[f"rng.{dist.get_rank()}.cuda"] = torch.cuda.get_rng_state()
    return state


def _dense_metadata(saved):
    """{dense key: (global shape, dtype)} of the tensors in a checkpoint's metadata, the pieces
    of a stacked matrix ("<name>.q", ".k", ".v") counted as the one matrix they stack into."""
    out = {}
    for key, md in saved.items():
        if not hasattr(md, "size"):
            continue                            # bytes: the meta
        m = _PIECE.fullmatch(key)
        size = tuple(md.size)
        if m:
            key = m["base"] + m["tail"]
            if key in out:
                size = (out[key][0][0] + size[0],) + size[1:]
        out[key] = (size, md.properties.dtype)
    return out


def _merge_pieces(flat):
    """{key: tensor} with the pieces of each stacked matrix stacked back (q, k, v in order)."""
    out, pieces = {}, {}
    for k, v in flat.items():
        m = _PIECE.fullmatch(k)
        if m:
            pieces.setdefault(m["base"] + m["tail"], []).append((m["piece"], v))
        else:
            out[k] = v
    for k, parts in pieces.items():
        order = next(names for names in _PIECES.values() if parts[0][0] in names)
        out[k] = torch.cat([v for _, v in sorted(parts, key=lambda p: order.index(p[0]))])
    return out


def _full_shape(stage, name, p):
    """The dense shape of this rank's shard `p` of parameter `name` (shard_of, inverted)."""
    owner, attr = stage.get_submodule(name.rpartition(".")[0]), name.rpartition(".")[2]
    shape = list(p.shape)
    if isinstance(owner, ColumnParallelLinear):
        shape[0] *= owner.tp
    elif isinstance(owner, RowParallelLinear) and attr == "weight":
        shape[1] *= owner.tp
    return shape
