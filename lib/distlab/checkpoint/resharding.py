"""Which tensor-parallel degrees a saved checkpoint can be loaded at (the model's rules, not DCP's)."""
from numbers import Integral

from .folder import _reader, _resolve
from .pieces import _PIECE, _dense_metadata


def reshard_problem(path, tp, n_heads, n_kv_heads=None):
    """A sentence if the checkpoint at `path` cannot be loaded at tensor-parallel degree `tp`
    for a model of `n_heads` heads (`n_kv_heads` K/V heads under grouped-query attention),
    else None (one process, reads the metadata only).

    DCP itself reshards any split (chunks need not align), so only the model's rules limit tp:
    whole query heads per rank, K/V heads split or shared evenly (kv_head_split), and every
    split dimension a multiple of tp (even shards)."""
    from ..tensor_parallel import kv_head_split
    if isinstance(tp, bool) or not isinstance(tp, Integral) or tp < 1:
        raise ValueError(f"reshard_problem's tp must be a whole number >= 1 (tensor-parallel "
                         f"ranks); got {tp!r}.")
    if n_heads % tp and n_kv_heads is None:
        ok = [t for t in range(1, n_heads + 1) if n_heads % t == 0]
        return (f"{path} holds a model with {n_heads} attention heads, which {tp} tensor-parallel "
                f"ranks cannot share (each computes whole heads); load it with tp in {ok}.")
    path = _resolve(path, whole=False)
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
