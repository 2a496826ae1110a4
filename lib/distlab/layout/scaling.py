"""Which axis runs out first: one model and one global batch on more and more GPUs, the
planner's best layout at each size, and why data parallelism alone stopped being it.

Data parallelism (with ZeRO-3, FSDP) is the axis to grow first: it splits the batch, and its
traffic hides behind compute while each GPU has enough tokens (zero_memory.comm_bound_tokens:
T* = (N−1)/N · F/B). It runs out in one of three ways, and the first one met decides which axis
comes next:
- the batch: a data-parallel rank needs at least one whole sequence, so dp ≤ sequences;
- the link: below T* tokens per GPU its gathers outlast the compute they should hide behind;
- memory: what ZeRO-3 cannot shard (activations, the layer being gathered) no longer fits.
Past that, tensor parallelism inside a node splits each sequence's work, then pipeline (its
bubble) or context parallelism (long sequences) split it further — each with its own price,
which the table shows as the fraction of the step that is not compute."""
from .ranking import rank_layouts
from .shapes import shape_of


def _why(best, rows, sequences, n_gpus):
    """Why the best layout is not data parallelism alone, in a few words."""
    if best["tp"] == best["pp"] == best.get("cp", 1) == 1:
        return "dp alone" + (" (one sequence per GPU)" if best["dp"] == sequences else "")
    alone = [r for r in rows if r["tp"] == r["pp"] == r.get("cp", 1) == 1]
    if not alone:
        return f"batch: {sequences} sequences for {n_gpus} GPUs"
    if not alone[0]["fits"]:
        return f"memory: dp alone needs {alone[0]['gb']:.0f} GB"
    return f"dp alone slower ({alone[0]['step_s']:.2f} s: {alone[0]['dp_s']:.2f} s exposed dp)"


def axis_table(model, gpu_counts, global_batch, gpus_per_node=8, **kw):
    """For each GPU count: the planner's best layout (`rank_layouts`, everything else as `kw`:
    zero_stage, seq_len, cluster, cps, ...), its step, its MFU, the fraction of the step that
    is not compute (bubble and exposed tp, cp, pp, dp traffic) and why dp alone is not it."""
    shape_of(model)
    out = []
    for n in gpu_counts:
        if n % gpus_per_node:
            raise ValueError(f"{n} GPUs do not fill whole nodes of {gpus_per_node}: use "
                             f"multiples of {gpus_per_node}.")
        rows = rank_layouts(model, nodes=n // gpus_per_node, gpus_per_node=gpus_per_node,
                            global_batch=global_batch, **kw)
        best = rows[0]
        lost = sum(best[k] for k in ("bubble_s", "tp_s", "cp_s", "pp_s", "dp_s"))
        out.append(dict(gpus=n, dp=best["dp"], pp=best["pp"], cp=best.get("cp", 1),
                        tp=best["tp"], fits=best["fits"], gb=best["gb"], step_s=best["step_s"],
                        mfu=best["mfu"], not_compute=lost / best["step_s"],
                        tokens_per_gpu=global_batch * kw.get("seq_len", 4096) / n,
                        why=_why(best, rows, global_batch, n)))
    return out


def axis_text(rows):
    """The table as text, one line per GPU count."""
    head = (f"{'GPUs':>5} {'dp':>5} {'pp':>3} {'cp':>3} {'tp':>3} {'tokens/GPU':>10} "
            f"{'step s':>7} {'MFU':>5} {'not compute':>11}  why not dp alone")
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(f"{r['gpus']:>5} {r['dp']:>5} {r['pp']:>3} {r['cp']:>3} {r['tp']:>3} "
                     f"{r['tokens_per_gpu']:>10,.0f} {r['step_s']:>7.2f} {r['mfu']:>5.0%} "
                     f"{r['not_compute']:>11.0%}  {r['why']}"
                     + ("" if r["fits"] else "  (does not fit)"))
    return "\n".join(lines)


# DeepSeek LLM (Bi et al. 2024, arXiv 2401.02954, its scaling laws for hyperparameters): the batch
# that gave the lowest loss at a compute budget C, fitted on small runs, in tokens with C in
# FLOPs: B_opt = 0.2920 · C^0.3271 (beside η_opt = 0.3118 · C^-0.1250). Read as two summaries of
# the paper quote it (mrshaw01/software-engineer, docs/deepseek/1-DeepSeek-V1.md;
# codestar12.github.io/llm-hparam-flop-calculator); the paper's own text was not at hand. Their C
# counts non-embedding FLOPs per token (attention included) times tokens; 6·N·D approximates it.
B_OPT_COEFF, B_OPT_EXPONENT = 0.2920, 0.3271


def optimal_batch_tokens(compute_flops, coeff=B_OPT_COEFF, exponent=B_OPT_EXPONENT):
    """The loss-optimal global batch, in tokens, for a training budget of `compute_flops`
    (DeepSeek LLM's fit by default): coeff · C^exponent."""
    if isinstance(compute_flops, bool) or not isinstance(compute_flops, (int, float)) \
            or not compute_flops > 0:
        raise ValueError(f"optimal_batch_tokens needs a positive compute budget in FLOPs; got "
                         f"{compute_flops!r}.")
    return coeff * compute_flops ** exponent


def batch_text(gpu_counts, b_opt_tokens, global_batch, seq_len=4096):
    """Per GPU count: the sequences each GPU gets of `global_batch`, and the global batch that
    dp alone with one sequence per GPU would need, against the optimal batch `b_opt_tokens`."""
    head = f"{'GPUs':>5} {'sequences/GPU':>13} {'batch at 1 sequence/GPU':>24} {'x B_opt':>8}"
    lines = [head, "-" * len(head)]
    for n in gpu_counts:
        tokens = n * seq_len
        lines.append(f"{n:>5} {global_batch / n:>13.3g} {tokens / 1e6:>15.1f} M tokens "
                     f"{tokens / b_opt_tokens:>8.2f}")
    return "\n".join(lines)
