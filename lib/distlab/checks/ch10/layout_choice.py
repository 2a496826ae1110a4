"""Workbook 10, exercise 4: choosing the layout for a model and a cluster."""
from .. import CheckFailed, call_learner, passed
from ..ch01 import refusing


# (model, nodes, GPUs per node, global batch): the chapter's two cases, then clusters where a
# constraint bites — 70B's fastest layouts do not fit; 4-GPU nodes cap tp at 4; GPT-2 XL's 25
# heads leave tp = 1 on 8-GPU nodes; a batch of 24 rules out dp = 16; on 24 GPUs 80 layers rule
# out pp = 3, 6 and 12 (equal stages), so the factor 3 goes to dp; on 48 GPUs GPT-3's 96 layers
# allow pp = 6, which wins (a search over powers of two misses it).
LAYOUT_CASES = [("Llama-2 13B", 4, 8, 512), ("Llama-2 70B", 4, 8, 512),
                ("Llama-2 13B", 4, 4, 96), ("GPT-2 XL 1.5B", 2, 8, 64), ("Llama-2 7B", 2, 8, 24),
                ("Llama-2 70B", 3, 8, 96), ("GPT-3 175B", 6, 8, 96)]


def _why_not(model, nodes, per_node, batch, choice):
    """The sentence that says why `choice` is not a layout of this model on this cluster."""
    from ... import layout
    shape, _ = layout.shape_of(model)
    n = nodes * per_node
    if not (isinstance(choice, tuple) and len(choice) == 3
            and all(isinstance(v, int) and not isinstance(v, bool) and v >= 1 for v in choice)):
        return f"return a tuple of three whole numbers (dp, pp, tp); got {choice!r}"
    dp, pp, tp = choice
    if dp * pp * tp != n:
        return f"dp·pp·tp = {dp * pp * tp}, but the cluster has {n} GPUs"
    if per_node % tp:
        return f"tp={tp} does not divide a node's {per_node} GPUs: its all-reduces would cross nodes"
    if shape.heads % tp:
        return f"tp={tp} does not split {shape.heads} attention heads evenly"
    if shape.layers % pp:
        return f"pp={pp} does not cut {shape.layers} layers into equal stages"
    if batch % dp:
        return f"dp={dp} does not split a global batch of {batch} sequences evenly"
    return None


def check_choose_layout(fn):
    """The learner's choose_layout(model, nodes, gpus_per_node, global_batch) against the
    planner's own ranking, on the clusters of LAYOUT_CASES."""
    from ... import layout
    for model, nodes, per_node, batch in LAYOUT_CASES:
        where = f"{model} on {nodes} nodes × {per_node} GPUs (global batch {batch})"
        with refusing(layout.rank_layouts, layout.best, layout.candidates,
                      exercise="enumerate the layouts and choose one yourself (layout.price "
                      "prices one layout)"):
            got = call_learner(fn, model, nodes, per_node, batch, name="choose_layout")
        if isinstance(got, list):
            got = tuple(got)
        wrong = _why_not(model, nodes, per_node, batch, got)
        if wrong:
            raise CheckFailed(f"for {where} you chose {got!r}: {wrong}.")
        best = layout.best(model, nodes=nodes, gpus_per_node=per_node, global_batch=batch)
        want = (best["dp"], best["pp"], best["tp"])
        if got == want:
            continue
        mine = layout.price(model, *got, gpus_per_node=per_node, global_batch=batch)
        yours = f"dp={got[0]} pp={got[1]} tp={got[2]}"
        if not mine["fits"]:
            raise CheckFailed(f"for {where} you chose {yours}: it needs {mine['gb']:.0f} GB per "
                              f"GPU at its peak, more than a GPU's 80 GB — a layout must fit "
                              f"before its speed counts.")
        raise CheckFailed(f"for {where} you chose {yours}, {mine['step_s']:.2f} s per step; "
                          f"dp={want[0]} pp={want[1]} tp={want[2]} fits too and takes "
                          f"{best['step_s']:.2f} s — did you try every (dp, pp, tp) whose "
                          f"product is the GPU count?")
    passed(f"choose_layout picks the planner's best layout on all {len(LAYOUT_CASES)} clusters: "
           f"memory first, then time, within tp's, pp's and dp's constraints.")
