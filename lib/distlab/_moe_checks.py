"""The checks of distlab.moe and distlab.expert_parallel's arguments, kept out of the modules
so that the functions the chapter displays change by one line: each refuses in one sentence
what torch would otherwise fail on deep inside, or silently compute wrong."""
from . import _argcheck as check


def _check_route(logits, top_k, capacity_factor, selection_bias):
    check.floating(logits, "the router logits")
    if logits.dim() != 2:
        raise ValueError(f"route takes the router logits as (tokens, experts); got shape "
                         f"{tuple(logits.shape)}: flatten the tokens with .reshape(-1, E).")
    check.whole(top_k, "top_k", example="1 or 2")
    if capacity_factor is not None:
        check.positive(capacity_factor, "capacity_factor (None: no limit)", example=1.25)
    if selection_bias is not None and tuple(selection_bias.shape) != (logits.shape[-1],):
        raise ValueError(f"selection_bias needs one value per expert ({logits.shape[-1]}); got "
                         f"shape {tuple(selection_bias.shape)}.")


def _check_experts(experts, n_experts):
    # one_hot would fail deep inside torch; a bad index is the learner's routing, say so
    if experts.numel() and not 0 <= int(experts.min()) <= int(experts.max()) < n_experts:
        raise ValueError(f"every chosen expert must be from 0 to {n_experts - 1} ({n_experts} "
                         f"experts); got {int(experts.min())} .. {int(experts.max())}.")


def _check_wanted(counts, n_experts, name="wanted"):
    if counts is None:
        return
    check.tensor(counts, name)
    if tuple(counts.shape) != (n_experts,):
        raise ValueError(f"{name} must hold one count per expert ({n_experts} experts); got "
                         f"shape {tuple(counts.shape)}.")
    if name == "wanted" and counts.sum() <= 0:
        raise ValueError("wanted counts no assignment (its sum is 0), so f would be 0/0: pass "
                         "the counts of the batch these tokens belong to (routing.wanted()).")


def _check_bias_update(bias, load, rate):
    # a load of another shape would broadcast into the bias without a word, a negative rate
    # would push the experts away from balance
    _check_wanted(load, len(bias), "load")
    check.positive(rate, "rate", example=0.001)


def _check_layer(d_model, hidden, n_experts, top_k, capacity_factor, n_shared):
    for name, value in (("d_model", d_model), ("hidden", hidden), ("n_experts", n_experts)):
        check.whole(value, name, at_least=1)
    check.whole(n_shared, "n_shared", at_least=0)
    if not 1 <= check.whole(top_k, "top_k") <= n_experts:
        raise ValueError(f"top_k must be between 1 and the number of experts ({n_experts}); "
                         f"got {top_k}.")
    if capacity_factor is not None:
        check.positive(capacity_factor, "capacity_factor (None: no limit)", example=1.25)


def _check_tokens(x, d_model):
    check.floating(x, "the MoE layer's input")
    if x.dim() == 0 or x.shape[-1] != d_model:
        raise ValueError(f"the MoE layer takes tokens of d_model = {d_model} features on the last "
                         f"axis; got shape {tuple(x.shape)}.")
    return x


# ---- expert parallelism

def _check_moe(moe):
    # by what it holds, not its class: this leaf module imports nothing of the package's
    if not all(hasattr(moe, a) for a in ("router", "experts", "router_kind", "selection_bias")):
        raise TypeError(f"ExpertParallelMoE shards a distlab.moe.MoE layer (make_moe(...)); got "
                        f"a {type(moe).__name__}.")


def _check_plan(experts, keep, n_experts, ep_size):
    ep_size = check.whole(ep_size, "ep_size", at_least=1)
    if check.whole(n_experts, "n_experts", at_least=1) % ep_size:
        raise ValueError(f"{n_experts} experts cannot be spread evenly over {ep_size} EP ranks: "
                         f"the number of experts must be a multiple of the EP size.")
    if tuple(keep.shape) != tuple(experts.shape):
        raise ValueError(f"keep must have the same shape as experts (tokens, k), one flag per "
                         f"assignment; got {tuple(keep.shape)} and {tuple(experts.shape)}.")
    _check_experts(experts, n_experts)


def _check_combine(expert_out, token, gate, n_tokens):
    n_tokens = check.whole(n_tokens, "n_tokens", at_least=0)
    if not len(token) == len(gate) == len(expert_out):
        raise ValueError(f"combine needs one token index and one gate per row of expert_out "
                         f"({len(expert_out)} rows); got {len(token)} and {len(gate)}.")
    if len(token) and not 0 <= int(token.min()) <= int(token.max()) < n_tokens:
        raise ValueError(f"every token index must be from 0 to {n_tokens - 1} ({n_tokens} "
                         f"tokens); got {int(token.min())} .. {int(token.max())}.")


def _check_splits(rows, out_splits, in_splits, ranks):
    """The splits as lists of ints. gloo fails on a wrong split far from the call (or aborts the
    process), NCCL hangs: say it here."""
    checked = []
    for name, splits in (("out_splits", out_splits), ("in_splits", in_splits)):
        if len(splits) != ranks:
            raise ValueError(f"{name} needs one row count per rank of the group ({ranks}); got "
                             f"{len(splits)}.")
        try:
            checked.append([check.whole(n, name, at_least=0) for n in splits])
        except (TypeError, ValueError):
            raise ValueError(f"{name} must be whole numbers of rows, not negative; got "
                             f"{splits}.") from None
    if sum(checked[1]) != len(rows):
        raise ValueError(f"in_splits sends {sum(checked[1])} rows in all, but rows holds "
                         f"{len(rows)} rows: they must add up to it.")
    return checked


def _check_mesh_sizes(dp, ep):
    for name, n in (("dp", dp), ("ep", ep)):
        check.whole(n, f"a mesh's sizes must be whole numbers: {name}", at_least=1)


def _check_ep_model(model):
    moe = getattr(model, "moe", None)
    if not hasattr(moe, "expert_parameters"):
        raise TypeError(f"reduce_gradients needs a model whose model.moe is an ExpertParallelMoE "
                        f"(expert_parallel_model(model, mesh)); got a {type(model).__name__} "
                        f"whose .moe is {type(moe).__name__}.")


def _check_volume(tokens, top_k, d_model, ep_size, bytes_per_element):
    check.whole(tokens, "tokens", at_least=0)
    check.whole(top_k, "top_k", at_least=1)
    check.whole(d_model, "d_model", at_least=1)
    check.whole(ep_size, "ep_size", at_least=1)
    check.positive(bytes_per_element, "bytes_per_element", example=2)
