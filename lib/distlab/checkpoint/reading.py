"""Reading a checkpoint: whether it can continue this run, then each rank's part of it under this
run's layout (DCP reshards), or the whole of it in one process."""
import json
import os

import torch
import torch.distributed as dist

from .folder import _dcp, _failed, _reader, _resolve, _unreadable
from .pieces import _dense_metadata, _merge_pieces, _full_shape, _state


def mismatch(path, dense_model, optimizer=None):
    """A sentence saying why the checkpoint at `path` cannot continue this run, or None."""
    path = _resolve(path, whole=False)
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


def read_meta(path):
    """Collective: the meta of the checkpoint at `path` alone (step, losses, the run's settings)."""
    path = _resolve(path)
    want = {"meta": ""}
    try:
        _dcp().load(want, checkpoint_id=path)
    except _failed() as e:
        raise _unreadable(path, e) from None
    return json.loads(want["meta"])


def load(path, stage, mesh, optimizer=None):
    """Collective: fill this rank's shards (and Adam's) from the checkpoint at `path`; its meta,
    with "read_bytes": the tensor bytes this rank asked DCP for."""
    path = _resolve(path)                       # every rank sees the same files: all or none raise
    saved = _reader(path).read_metadata().state_dict_metadata
    if "layout" not in saved:                   # written by save(..., sharded=False)
        return _load_dense(path, stage, mesh, optimizer, saved)
    want = _state(stage, mesh, optimizer, sharded=True)    # DTensors over THIS run's layout:
    del want["layout"]                          # ... views of the tensors they fill in place
    rng = f"rng.{dist.get_rank()}"
    for key in (rng, rng + ".cuda"):           # more ranks than the saved run, or no GPU then
        if key in want and key not in saved:
            del want[key]
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
    if rng + ".cuda" in want:
        torch.cuda.set_rng_state(want[rng + ".cuda"])
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
    if rng + ".cuda" in saved and torch.cuda.is_available():
        want[rng + ".cuda"] = torch.cuda.get_rng_state()
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
    if rng + ".cuda" in want:
        torch.cuda.set_rng_state(want[rng + ".cuda"])
    meta = json.loads(want["meta"])
    meta["read_bytes"] = planner.read_bytes
    return meta


def read(folder_or_path):
    """The whole checkpoint in this process (no process group): {"meta", "model", "optim", "rng"}."""
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict_from_keys
    import warnings
    path = _resolve(folder_or_path)
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


def consolidate(path, file):
    """One torch.save file of the dense model's state_dict, for inference (one process).

    dcp_to_torch_save (DCP's own converter) reads every chunk of every rank and writes the
    whole checkpoint as one torch.save file; kept are the model's tensors, with q, k, v
    stacked back, so that make_gpt(...).load_state_dict(torch.load(file)) takes it as is."""
    import tempfile
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    where = os.path.dirname(os.fspath(file))
    if not os.path.isdir(where or "."):         # found out only after reading every chunk
        raise ValueError(f"cannot write {file}: there is no folder {where}; create it, or choose "
                         f"another file.")
    path = _resolve(path)
    with tempfile.TemporaryDirectory() as tmp:
        whole = os.path.join(tmp, "whole.pt")
        dcp_to_torch_save(path, whole)
        flat = torch.load(whole, weights_only=False)
    model = {k[len("model."):]: v for k, v in _merge_pieces(flat).items() if k.startswith("model.")}
    torch.save(model, file)
    return model
