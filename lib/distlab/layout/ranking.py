"""Every candidate layout priced and ranked; the ranking as text; the best one that fits."""
from .pricing import price
from .search import candidates, positive_whole
from .search import families as search_families
from .shapes import shape_of


def rank_layouts(model, nodes=4, gpus_per_node=8, global_batch=512, micro_batch=1, cps=(1,),
                 families=None, **kw):
    """Every candidate layout priced; those that fit in memory first, fastest first. `cps`: the
    context-parallel degrees to consider (1 alone: no context parallelism). `families`: some of
    search.FAMILIES ("zero1", "fsdp", "hsdp") — each layout priced once per way of those
    families to hold its states, each row labelled (`family`, `dp_shard`); None (the default):
    one way, `zero_stage` (ZeRO-1 unless given)."""
    shape, _ = shape_of(model)
    n_gpus = positive_whole("nodes", nodes) * positive_whole("gpus_per_node", gpus_per_node)
    seq_len = kw.get("seq_len", 4096)
    v = kw.get("interleave", 1)
    if families is not None and ("zero_stage" in kw or "dp_shard" in kw):
        raise ValueError("give either families or zero_stage/dp_shard: each family sets its own "
                         "(ZeRO-1: zero_stage=1; FSDP and HSDP: 3).")
    rows = []
    for dp, pp, cp, tp in candidates(n_gpus, gpus_per_node, shape.layers, shape.heads,
                                     global_batch, micro_batch, cps, seq_len):
        if shape.layers % (pp * v):
            continue
        ways = [(None, {})] if families is None else \
            search_families(families, dp, pp, cp, tp, gpus_per_node)
        for label, options in ways:
            row = price(model, dp, pp, tp, gpus_per_node, global_batch, micro_batch=micro_batch,
                        cp=cp, **kw, **options)
            if label is not None:
                row.update(family=label, dp_shard=options.get("dp_shard", dp))
            rows.append(row)
    if not rows:
        raise ValueError(f"no (dp, pp, tp) splits {model} over {n_gpus} GPUs with a global "
                         f"batch of {global_batch}.")
    return sorted(rows, key=lambda r: (not r["fits"], r["step_s"]))


def table(rows, top=10):
    """The ranking as text: one line per layout, the time split into its parts (cp columns only
    when some layout uses context parallelism)."""
    with_cp = any(r.get("cp", 1) > 1 for r in rows)
    cp_head, cp_comm = (f" {'cp':>3}", f" {'cp comm':>8}") if with_cp else ("", "")
    with_family = any("family" in r for r in rows)
    family_head = f" {'family':<10}" if with_family else ""
    head = (f"{'dp':>3} {'pp':>3}{cp_head} {'tp':>3}{family_head} {'GB peak':>7} {'fits':>5} "
            f"{'step s':>7} "
            f"{'compute':>8} {'bubble':>7} {'tp comm':>8}{cp_comm} {'pp comm':>8} {'dp comm':>8}"
            f" {'MFU':>5}")
    lines = [head, "-" * len(head)]
    for r in rows[:top]:
        cp_cell = f" {r['cp']:>3}" if with_cp else ""
        cp_time = f" {r['cp_s']:>8.2f}" if with_cp else ""
        family_cell = f" {r.get('family', ''):<10}" if with_family else ""
        lines.append(f"{r['dp']:>3} {r['pp']:>3}{cp_cell} {r['tp']:>3}{family_cell} "
                     f"{r['gb']:>7.1f} {'yes' if r['fits'] else 'no':>5} {r['step_s']:>7.2f} "
                     f"{r['compute_s']:>8.2f} {r['bubble_s']:>7.2f} {r['tp_s']:>8.2f}"
                     f"{cp_time} {r['pp_s']:>8.2f} {r['dp_s']:>8.2f} {r['mfu']:>5.0%}")
    if len(rows) > top:
        lines.append(f"... and {len(rows) - top} more")
    return "\n".join(lines)


def best(model, **kw):
    """The fastest layout that fits, or a one-sentence ValueError when none does."""
    rows = rank_layouts(model, **kw)
    if not rows[0]["fits"]:
        smallest = min(rows, key=lambda r: r["gb"])
        cp = f" cp={smallest['cp']}" if smallest.get("cp", 1) > 1 else ""
        raise ValueError(f"no layout of {model} fits: the leanest, dp={smallest['dp']} "
                         f"pp={smallest['pp']}{cp} tp={smallest['tp']}, needs "
                         f"{smallest['gb']:.0f} GB per GPU at its peak; add GPUs or shard more "
                         f"(zero_stage).")
    return rows[0]
