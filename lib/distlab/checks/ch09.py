"""Checkers for workbook 09: the dispatch plan and the combine of an expert-parallel MoE layer.

Each checker first calls the learner's function on small cases in this process, then plugs it
into `ExpertParallelMoE` on real ranks and compares every rank's output and gradients with the
single-process `MoE` on the same tokens.
"""
import torch

from .. import expert_parallel as ep_lib
from ..moe import make_moe, route
from . import CheckFailed, call_learner, compare, passed, run_learner, sizes_phrase

D_MODEL = 8
# (ep_size, n_experts, top_k, capacity_factor): odd sizes, top-2 and dropping included.
CASES = [(1, 4, 1, None), (2, 4, 1, 1.0), (3, 6, 2, None), (4, 8, 2, 0.75), (2, 2, 2, 0.5)]


def _routing(case, seed):
    ep_size, n_experts, top_k, capacity_factor = case
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(10, n_experts, generator=g, dtype=torch.float64)
    logits[:6, 0] += 3.0          # a crowd on expert 0, so capacity really drops some
    return route(logits, top_k, capacity_factor)


def _describe(case):
    ep_size, n_experts, top_k, capacity_factor = case
    return (f"ep_size={ep_size}, {n_experts} experts, top_k={top_k}, "
            f"capacity_factor={capacity_factor}")


def _check_plan_case(fn, case, seed):
    ep_size, n_experts, _, _ = case
    r = _routing(case, seed)
    where = f"dispatch_plan with {_describe(case)}"
    got = call_learner(fn, r.experts.clone(), r.keep.clone(), n_experts, ep_size,
                       name="dispatch_plan")
    if not (isinstance(got, (tuple, list)) and len(got) == 2):
        raise CheckFailed(f"{where} should return (order, send_splits); got {type(got).__name__}.")
    order, splits = got
    ref_order, ref_splits = ep_lib.dispatch_plan(r.experts, r.keep, n_experts, ep_size)
    if torch.is_tensor(splits):
        splits = splits.tolist()
    compare(list(splits), ref_splits, f"{where}: send_splits")
    if not torch.is_tensor(order) or order.dtype not in (torch.int64, torch.int32):
        raise CheckFailed(f"{where}: order should be a tensor of integer indices into the "
                          f"flattened (tokens·k) assignments; got {order!r}.")
    order = order.long().reshape(-1)
    if sorted(order.tolist()) != sorted(ref_order.tolist()):
        missing = sorted(set(ref_order.tolist()) - set(order.tolist()))
        extra = sorted(set(order.tolist()) - set(ref_order.tolist()))
        raise CheckFailed(f"{where}: order must list each kept assignment once; missing "
                          f"{missing[:5]}, unexpected {extra[:5]} (a dropped assignment is sent "
                          f"nowhere).")
    experts = r.experts.reshape(-1)[order]
    bad = (experts[1:] < experts[:-1]).nonzero()
    if len(bad):
        i = int(bad[0])
        raise CheckFailed(f"{where}: order sends assignment {int(order[i])} (expert "
                          f"{int(experts[i])}) before assignment {int(order[i + 1])} (expert "
                          f"{int(experts[i + 1])}); sort the kept assignments by expert, so that "
                          f"each rank's rows are one contiguous run.")


def _tokens(rank):
    g = torch.Generator().manual_seed(300 + rank)
    return torch.randn(12, D_MODEL, generator=g, dtype=torch.float64)


def _layer(world_size, top_k, capacity_factor):
    moe = make_moe(seed=4, dtype=torch.float64, d_model=D_MODEL, hidden=16,
                   n_experts=2 * world_size, top_k=top_k, capacity_factor=capacity_factor)
    with torch.no_grad():
        moe.router.bias[0] = 1.5      # uneven loads: uneven splits, and some dropping
    return moe


def _in_the_layer(rank, world_size, plan, combine):
    """On every rank: (got, expected) outputs and gradients, EP layer vs the one-process layer."""
    results = []
    for top_k, capacity_factor in [(1, None), (2, 1.0)]:
        moe = _layer(world_size, top_k, capacity_factor)
        layer = ep_lib.ExpertParallelMoE(moe, None, plan=plan, combine=combine)
        x = _tokens(rank).requires_grad_()
        y, _ = layer(x)
        weights = torch.linspace(-1, 1, y.numel(), dtype=y.dtype).view_as(y)
        (y * weights).sum().backward()
        xr = _tokens(rank).requires_grad_()
        yr, _ = moe(xr)
        (yr * weights).sum().backward()
        results.append(((top_k, capacity_factor), (y.detach(), x.grad), (yr.detach(), xr.grad)))
    return results


def _check_in_the_layer(name, plan, combine, world_sizes):
    for ws in world_sizes:
        got = run_learner(_in_the_layer, ws, plan, combine, name=name, timeout=120)
        for rank, cases in enumerate(got):
            for (top_k, cf), (y, gx), (yr, gr) in cases:
                where = (f"the expert-parallel layer using your {name}, EP={ws}, top_k={top_k}, "
                         f"capacity_factor={cf}, rank {rank}")
                compare(y, yr, f"{where}: output", atol=1e-10, rtol=1e-9)
                compare(gx, gr, f"{where}: gradient of the input", atol=1e-10, rtol=1e-9)


def check_dispatch_plan(fn, world_sizes=(2, 3)):
    """fn(experts, keep, n_experts, ep_size) -> (order, send_splits)."""
    for i, case in enumerate(CASES):
        _check_plan_case(fn, case, seed=10 + i)
    _check_in_the_layer("dispatch_plan", fn, ep_lib.combine, world_sizes)
    passed(f"dispatch_plan sorts the kept assignments by expert and counts the rows for each "
           f"rank; the layer built on it equals one process at EP {sizes_phrase(world_sizes)}, "
           f"top-1 and top-2, with dropping.")


def check_combine(fn, world_sizes=(2, 4)):
    """fn(expert_out, token, gate, n_tokens) -> (n_tokens, d) outputs."""
    g = torch.Generator().manual_seed(2)
    for n_rows, n_tokens in [(7, 5), (0, 3), (12, 4)]:
        rows = torch.randn(n_rows, D_MODEL, generator=g, dtype=torch.float64)
        token = torch.randint(0, n_tokens, (n_rows,), generator=g)
        gate = torch.rand(n_rows, generator=g, dtype=torch.float64)
        got = call_learner(fn, rows.clone(), token.clone(), gate.clone(), n_tokens,
                           name="combine")
        compare(got, ep_lib.combine(rows, token, gate, n_tokens),
                f"combine of {n_rows} rows into {n_tokens} tokens", atol=1e-12, rtol=1e-12)
    _check_in_the_layer("combine", ep_lib.dispatch_plan, fn, world_sizes)
    passed(f"combine puts every gate-weighted row back on its token; the layer built on it "
           f"equals one process at EP {sizes_phrase(world_sizes)}, top-1 and top-2, with "
           f"dropping.")
