"""Sharded checkpoints with torch.distributed.checkpoint (DCP), resumable under another layout.

    save(folder, step, stage, mesh, optimizer, meta)     # collective: every rank writes its part
    step, meta = load(folder, stage, mesh, optimizer, dense_model)   # collective: each rank reads its part
    everything = read(folder)                             # one process, no process group (tests, notebooks)

Two formats, both under the DENSE names of the one-process model, so that the files do not
depend on the (dp, pp, tp) layout that wrote them:

- sharded (the default, what torchtitan does): each rank offers only ITS shards, as DTensors on
  the stage's (dp, tp) DeviceMesh — Shard(0) for a column-parallel weight, Shard(1) for a
  row-parallel one, Replicate() for the small replicated tensors and along dp. A DTensor knows
  its global shape and where its shard sits in it, so DCP writes each shard once (the dp replicas
  offer the same chunk; the planner DEDUPLICATES it) and, on load into DTensors of ANOTHER layout,
  each rank reads only the saved chunks that overlap its new shard: that is resharding. Stacked
  matrices (chapter 07's qkv: each rank holds its slice of q, of k and of v) are saved as their
  pieces, "<name>.q", ".k", ".v", each an ordinary row shard;
- dense (`sharded=False`, the simple alternative): each rank all-gathers its tp shards first, so
  every rank holds its WHOLE stage — at 70B on tp8 x pp8 that is ≈ 100 GB of fp32 per rank at
  every save (`save_costs` computes it) — and on load each rank reads whole tensors and keeps its
  slice: tp times the bytes it needs.

Keys: "model.<name>" (every parameter), "optim.<name>.exp_avg" / ".exp_avg_sq" and "optim.step"
(Adam's state), "rng.<rank>" (every rank's CPU random generator), "meta" (step, losses, data
position, the model's configuration), and in the sharded format "layout" (the dp, pp, tp that
wrote it).

Each save goes to a folder NO save has used before: <folder>/step-<n>, or step-<n>.1, .2, ...
when that name is taken (a re-run saving the step `latest` already points at must not rewrite
the files of the only good checkpoint in place). Only when every rank has finished writing does
rank 0 point <folder>/latest at it (write a small file, then atomic rename), and only then are
the older and the unfinished step folders removed. A run killed in the middle of a save resumes
from the previous checkpoint, never from half of one. `save(..., background=True)` returns as
soon as the state is staged (copied) and writes it with dcp.async_save in a thread; its
`wait()` — called before the next save and at the end of the run — is where `latest` switches.
"""
import json
import os
import re
import shutil

import torch
import torch.distributed as dist


def _dcp():
    """torch.distributed.checkpoint, imported when a checkpoint is first touched: ≈ 1.5 CPU-s,
    paid by every torchrun worker and rank that imports distlab.train even to be refused."""
    import torch.distributed.checkpoint as dcp
    return dcp


def _reader(path):
    return _dcp().FileSystemReader(path)


def _failed():
    from torch.distributed.checkpoint.api import CheckpointException
    return CheckpointException

from .parallel3d import _unshard
from .tensor_parallel import ColumnParallelLinear, RowParallelLinear


class BrokenCheckpoint(ValueError):
    """A checkpoint that cannot be read; the message is one sentence naming what is missing."""


_ELSE = "resume from another checkpoint, or start with another --ckpt folder."


def latest(folder):
    """The path of the newest complete checkpoint in `folder`, or None if no save finished there.

    Raises BrokenCheckpoint when <folder>/latest exists but names nothing, or a missing folder.
    """
    pointer = os.path.join(folder, "latest")
    if not os.path.exists(pointer):
        return None
    with open(pointer) as f:
        name = f.read().strip()
    if not name:
        raise BrokenCheckpoint(f"{pointer} is empty, so it names no checkpoint; write the name "
                               f"of a complete step folder into it, or {_ELSE}")
    if not os.path.isdir(os.path.join(folder, name)):
        raise BrokenCheckpoint(f"{pointer} names {name}, but {folder} has no such folder; {_ELSE}")
    return os.path.join(folder, name)


def damage(path):
    """A sentence saying what is missing or cut short in the checkpoint at `path`, or None.

    Reads only the metadata and the sizes of the files it lists, so every rank can check before
    any collective read: DCP and pickle would otherwise fail with pages of traceback, or on some
    ranks only.
    """
    from torch.distributed.checkpoint.metadata import Metadata
    if not os.path.isdir(path):
        return f"there is no checkpoint folder {path}; {_ELSE}"
    if not os.path.exists(os.path.join(path, ".metadata")):
        return (f"{path} has no .metadata file, so the save that wrote it never finished; "
                f"{_ELSE}")
    try:
        metadata = _reader(path).read_metadata()
    except Exception as e:                # garbage unpickles into any error; say which
        return f"{path}/.metadata is not DCP metadata ({type(e).__name__} reading it); {_ELSE}"
    if not isinstance(metadata, Metadata) or "meta" not in metadata.state_dict_metadata:
        return f"{path}/.metadata is not the metadata of a distlab checkpoint; {_ELSE}"
    needed = {}                           # file -> bytes its entries reach
    for info in (metadata.storage_data or {}).values():
        needed[info.relative_path] = max(needed.get(info.relative_path, 0),
                                         info.offset + info.length)
    for name, size in sorted(needed.items()):
        file = os.path.join(path, name)
        if not os.path.exists(file):
            return f"{path} lacks {name}, one of the rank files its .metadata lists; {_ELSE}"
        if os.path.getsize(file) < size:
            return (f"{file} is cut short ({os.path.getsize(file)} of the {size} bytes its "
                    f".metadata lists); {_ELSE}")
    return None


def _unreadable(path, error):
    """BrokenCheckpoint for a file DCP could not read although its size was right."""
    failures = getattr(error, "failures", None)
    cause = next(iter(failures.values()))[0] if failures else error
    return BrokenCheckpoint(f"{path} holds a rank file that cannot be read ({type(cause).__name__}: "
                            f"{str(cause).splitlines()[0] if str(cause) else 'no detail'}); {_ELSE}")


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
    return state


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


def _commit(folder, name):
    """Collective: once every rank's files are whole, point latest at `name`, remove the rest."""
    dist.barrier()                              # every rank's file is whole ...
    if dist.get_rank() == 0:                    # ... before the checkpoint counts
        _point_latest_at(folder, name)
        for old in os.listdir(folder):          # the newest complete checkpoint is enough
            if _STEP_FOLDER.fullmatch(old) and old != name:
                shutil.rmtree(os.path.join(folder, old), ignore_errors=True)
    dist.barrier()
    return os.path.join(folder, name)


# The folders save() writes; nothing else in the folder is ever removed.
_STEP_FOLDER = re.compile(r"step-\d{6,}(\.\d+)?")


def _fresh_name(folder, step):
    """Collective: a step folder name no save used before, the same on every rank.

    Rank 0 chooses (the ranks of a multi-node job may see the shared folder a little apart) and
    sends the number: 0 for step-<n>, k for step-<n>.k.
    """
    def name(k):
        return f"step-{step:06d}" + (f".{k}" if k else "")
    k = 0
    if dist.get_rank() == 0:
        os.makedirs(folder, exist_ok=True)
        while os.path.exists(os.path.join(folder, name(k))):
            k += 1
    chosen = torch.tensor([k])
    dist.broadcast(chosen, 0)                   # a CPU tensor: gloo, also beside nccl
    return name(int(chosen))


def _point_latest_at(folder, name):
    """Make <folder>/latest name `name`, atomically: a crash leaves the old pointer or the new."""
    tmp = os.path.join(folder, "latest.tmp")
    with open(tmp, "w") as f:
        f.write(name)
        f.flush()
        os.fsync(f.fileno())                    # the new name is on disk before it counts
    os.replace(tmp, os.path.join(folder, "latest"))
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)                            # ... and so is the rename
    finally:
        os.close(fd)


def mismatch(path, dense_model, optimizer=None):
    """A sentence saying why the checkpoint at `path` cannot continue this run, or None."""
    saved = _dense_metadata(_reader(path).read_metadata().state_dict_metadata)
    mine = dense_model.state_dict()
    names = {k[len("model."):] for k in saved if k.startswith("model.")}
    if names != set(mine):
        blocks = [len({k.split(".")[1] for k in ks if k.startswith("blocks.")}) for ks in (names, mine)]
        extra, missing = sorted(names - set(mine)), sorted(set(mine) - names)
        what = (f"has {blocks[0]} blocks, this run's has {blocks[1]}" if blocks[0] != blocks[1] else
                f"has {extra[0]}, which this model lacks" if extra else f"lacks {missing[0]}")
        return (f"{path} holds a different model (it {what}); start with another --ckpt folder "
                f"or the model options it was saved with.")
    for k, v in mine.items():
        size, dtype = saved[f"model.{k}"]
        if size != tuple(v.shape):
            return (f"{path} holds a different model ({k} is {size}, this run's is "
                    f"{tuple(v.shape)}); start with another --ckpt folder or the model options it "
                    f"was saved with.")
        if dtype != v.dtype:
            was, now = (str(d).removeprefix("torch.") for d in (dtype, v.dtype))
            return (f"{path} was saved in {was}, so it cannot continue the same run in {now}; "
                    f"resume with --dtype {was}, or start with another --ckpt folder.")
    if optimizer is not None and "optim.step" not in saved:
        return (f"{path} holds no Adam state, so Adam cannot continue that run; resume with the "
                f"optimizer it was saved with, or start with another --ckpt folder.")
    return None


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


def read_meta(path):
    """Collective: the meta of the checkpoint at `path` alone (step, losses, the run's settings)."""
    want = {"meta": ""}
    try:
        _dcp().load(want, checkpoint_id=path)
    except _failed() as e:
        raise _unreadable(path, e) from None
    return json.loads(want["meta"])


def load(path, stage, mesh, optimizer=None):
    """Collective: fill this rank's shards (and Adam's) from the checkpoint at `path`; its meta,
    with "read_bytes": the tensor bytes this rank asked DCP for."""
    saved = _reader(path).read_metadata().state_dict_metadata
    if "layout" not in saved:                   # written by save(..., sharded=False)
        return _load_dense(path, stage, mesh, optimizer, saved)
    want = _state(stage, mesh, optimizer, sharded=True)    # DTensors over THIS run's layout:
    del want["layout"]                          # ... views of the tensors they fill in place
    rng = f"rng.{dist.get_rank()}"
    if rng not in saved:                        # a run with more ranks than the saved one
        del want[rng]
    if optimizer is not None:
        want["optim.step"] = torch.tensor(0)
    want["meta"] = ""
    planner = _counting_planner()
    try:
        _dcp().load(want, checkpoint_id=path, planner=planner)
    except _failed() as e:           # on every rank: DCP gathers the failures
        raise _unreadable(path, e) from None
    with torch.no_grad():                       # DCP loads DTensors in place; make sure
        mine = _state(stage, mesh, optimizer, sharded=True)
        for key, value in want.items():
            if key.startswith(("model.", "optim.")) and key != "optim.step":
                target = mine[key].to_local()
                if value.to_local().data_ptr() != target.data_ptr():
                    target.copy_(value.to_local())
    if optimizer is not None:
        optimizer.steps = int(want["optim.step"])
    if rng in want:    # another layout has other ranks: their streams start where these stopped
        torch.set_rng_state(want[rng])
    meta = json.loads(want["meta"])
    meta["read_bytes"] = planner.read_bytes
    return meta


def _counting_planner():
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

    class CountingPlanner(DefaultLoadPlanner):
        """DCP's own load planner, counting the tensor bytes this rank's plan reads."""
        def create_local_plan(self):
            plan = super().create_local_plan()
            self.read_bytes = 0
            for item in plan.items:
                target = self.state_dict.get(item.dest_index.fqn)
                if isinstance(target, torch.Tensor):
                    self.read_bytes += torch.Size(item.lengths).numel() * target.element_size()
            return plan
    return CountingPlanner()



def _load_dense(path, stage, mesh, optimizer, saved):
    """load() of a dense checkpoint: every rank reads whole tensors, then keeps its slice."""
    params = dict(stage.named_parameters())
    want = {}
    for name, p in params.items():
        full = stage.dense_name(name)
        shape = _full_shape(stage, name, p)
        want[f"model.{full}"] = torch.empty(shape, dtype=p.dtype)
        if optimizer is not None:
            for which in ("exp_avg", "exp_avg_sq"):
                want[f"optim.{full}.{which}"] = torch.empty(shape, dtype=p.dtype)
    if optimizer is not None:
        want["optim.step"] = torch.tensor(0)
    rng = f"rng.{dist.get_rank()}"
    has_rng = rng in saved
    if has_rng:
        want[rng] = torch.get_rng_state()
    want["meta"] = ""
    planner = _counting_planner()
    try:
        _dcp().load(want, checkpoint_id=path, planner=planner)      # only the keys asked for
    except _failed() as e:           # on every rank: DCP gathers the failures
        raise _unreadable(path, e) from None
    with torch.no_grad():
        for name, p in params.items():
            full = stage.dense_name(name)
            p.copy_(stage.shard_of(name, want[f"model.{full}"]).to(p.device))
            if optimizer is not None:
                for which in ("exp_avg", "exp_avg_sq"):
                    optimizer.state[name][which].copy_(
                        stage.shard_of(name, want[f"optim.{full}.{which}"]))
    if optimizer is not None:
        optimizer.steps = int(want["optim.step"])
    if has_rng:        # another layout has other ranks: their streams start where these stopped
        torch.set_rng_state(want[rng])
    meta = json.loads(want["meta"])
    meta["read_bytes"] = planner.read_bytes
    return meta


def _full_shape(stage, name, p):
    """The dense shape of this rank's shard `p` of parameter `name` (shard_of, inverted)."""
    owner, attr = stage.get_submodule(name.rpartition(".")[0]), name.rpartition(".")[2]
    shape = list(p.shape)
    if isinstance(owner, ColumnParallelLinear):
        shape[0] *= owner.tp
    elif isinstance(owner, RowParallelLinear) and attr == "weight":
        shape[1] *= owner.tp
    return shape


def read(folder_or_path):
    """The whole checkpoint in this process (no process group): {"meta", "model", "optim", "rng"}."""
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict_from_keys
    import warnings
    path = latest(folder_or_path) or folder_or_path
    why = damage(path)
    if why:
        raise BrokenCheckpoint(why)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")          # "assuming ... a single process": yes
        try:
            flat = _load_state_dict_from_keys(checkpoint_id=path)
        except (Exception, _failed()) as e:
            raise _unreadable(path, e) from None
    out = {"meta": json.loads(flat.pop("meta")), "model": {}, "optim": {}, "rng": {}}
    layout = flat.pop("layout", None)
    out["layout"] = tuple(layout.tolist()) if layout is not None else None   # None: dense format
    for k, v in _merge_pieces(flat).items():
        group, _, rest = k.partition(".")
        out[group][rest] = v
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


def consolidate(path, file):
    """One torch.save file of the dense model's state_dict, for inference (one process).

    dcp_to_torch_save (DCP's own converter) reads every chunk of every rank and writes the
    whole checkpoint as one torch.save file; kept are the model's tensors, with q, k, v
    stacked back, so that make_gpt(...).load_state_dict(torch.load(file)) takes it as is."""
    import tempfile
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    path = latest(path) or path
    why = damage(path)
    if why:
        raise BrokenCheckpoint(why)
    with tempfile.TemporaryDirectory() as tmp:
        whole = os.path.join(tmp, "whole.pt")
        dcp_to_torch_save(path, whole)
        flat = torch.load(whole, weights_only=False)
    model = {k[len("model."):]: v for k, v in _merge_pieces(flat).items() if k.startswith("model.")}
    torch.save(model, file)
    return model


# ---- what each format costs, and how often to save ------------------------------------------------

def save_costs(shape, dp, pp, tp, bytes_per_value=4, copies=3):
    """Per rank, for the biggest pipeline stage of `shape` (a hardware.Transformer) under
    (dp, pp, tp): the bytes each format holds at a save and reads at a load, and what the whole
    job writes. `copies`: the tensors saved per parameter (3: fp32 weights and Adam's two
    moments). Embeddings and head count as replicated across tp, as in Stage3D."""
    per_layer = (shape.params() - 2 * shape.vocab * shape.hidden) / shape.layers
    layers = -(-shape.layers // pp)                               # the longest stage
    ends = shape.vocab * shape.hidden * (2 if pp == 1 else 1)     # embedding or head
    stage = (layers * per_layer + ends) * bytes_per_value * copies
    sharded = (layers * per_layer / tp + ends) * bytes_per_value * copies
    return {"dense_held": stage, "dense_read": stage, "sharded_held": sharded,
            "sharded_read": sharded,
            "written": shape.params() * bytes_per_value * copies}  # the same in both: dedup


# Llama 3's 54-day pre-training snapshot on 16,384 H100s: 419 unexpected interruptions, 78 % of
# them hardware (Dubey et al. 2024, "The Llama 3 Herd of Models", section 3.3.4, Table 5).
LLAMA3_INTERRUPTIONS, LLAMA3_DAYS, LLAMA3_GPUS = 419, 54, 16384


def mtbf_seconds(gpus, interruptions=LLAMA3_INTERRUPTIONS, days=LLAMA3_DAYS,
                 observed_gpus=LLAMA3_GPUS):
    """Mean time between interruptions of a job on `gpus` GPUs, if failures strike each GPU
    independently at the rate observed (Llama 3's by default): it shrinks as 1/gpus."""
    return days * 86400 / interruptions * observed_gpus / gpus


def young_daly(save_s, mtbf_s):
    """The checkpoint interval that loses the least time (Young 1974, Daly 2006, first order):
    sqrt(2 · C · MTBF), C the time a save stops training."""
    return (2 * save_s * mtbf_s) ** 0.5


def lost_fraction(interval_s, save_s, mtbf_s):
    """The fraction of time lost at interval τ, to first order: C/τ spent saving, plus on
    average τ/2 of work redone after each failure (one per MTBF)."""
    return save_s / interval_s + interval_s / (2 * mtbf_s)


def reshard_problem(path, tp, n_heads, n_kv_heads=None):
    """A sentence if the checkpoint at `path` cannot be loaded at tensor-parallel degree `tp`
    for a model of `n_heads` heads (`n_kv_heads` K/V heads under grouped-query attention),
    else None (one process, reads the metadata only).

    DCP itself reshards any split (chunks need not align), so only the model's rules limit tp:
    whole query heads per rank, K/V heads split or shared evenly (kv_head_split), and every
    split dimension a multiple of tp (even shards)."""
    from .tensor_parallel import kv_head_split
    if n_heads % tp and n_kv_heads is None:
        ok = [t for t in range(1, n_heads + 1) if n_heads % t == 0]
        return (f"{path} holds a model with {n_heads} attention heads, which {tp} tensor-parallel "
                f"ranks cannot share (each computes whole heads); load it with tp in {ok}.")
    saved = _reader(path).read_metadata().state_dict_metadata
    if n_kv_heads is not None:
        try:
            copies = kv_head_split(n_heads, n_kv_heads, tp)["copies"]
        except ValueError as e:
            return f"{path} holds a model with grouped-query attention: {e}"
        widths = {tuple(md.size)[1] for k, md in saved.items()
                  if k.startswith("model.") and k.endswith("attn.proj.weight")}
        for d in sorted(widths):
            if (d // n_heads) % copies:
                return (f"{path}: a head is {d // n_heads} wide, which the {copies} ranks that "
                        f"share each K/V head at tp={tp} cannot split evenly; load it with a tp "
                        f"of at most n_kv_heads = {n_kv_heads}.")
    pieces = {k: (tuple(md.size), None) for k, md in saved.items()
              if hasattr(md, "size") and _PIECE.fullmatch(k)}
    for key, (size, _) in sorted({**_dense_metadata(saved), **pieces}.items()):
        if key.startswith("model.") and ("fc1" in key or "qkv" in key) and size[0] % tp:
            return (f"{path}: {key[6:]} has {size[0]} rows, which {tp} tensor-parallel ranks "
                    f"cannot share evenly; choose a tp that divides {size[0]}.")
    return None
