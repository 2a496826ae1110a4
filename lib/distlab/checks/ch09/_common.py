"""What workbook 09's checks share: the refusals, the layer against one process, the subgroups."""
import contextlib

import torch
import torch.distributed as dist

from ... import expert_parallel as ep_lib
from ... import moe as moe_lib
from .. import CheckFailed, UsedCourseCode, _traffic, call_learner, compare, forbid
from ._references import (_dispatch_case, _dispatch_reference, _group_case, _group_reference,
                          _one_process_layer, _priority_order, _queue_positions, _reference_route,
                          _skewed_layer, _tokens)


TIMEOUT = 30  # a learner's deadlock is reported (with where each rank waits) within this


def _course_code():
    return (moe_lib.route, moe_lib.capacity_keep, moe_lib.expert_capacity,
            moe_lib.load_balancing_loss, ep_lib.reduce_gradients, ep_lib.ep_dp_mesh,
            ep_lib.dispatch_plan, ep_lib.all_to_all,
            ep_lib.ExpertParallelMoE._route_with_group_capacity,
            _reference_route, _group_reference, _queue_positions, _priority_order,
            _one_process_layer, _dispatch_reference,
            # the checker's own data: the other ranks' inputs rebuilt without a message would
            # pass without communicating (they are also drawn afresh per check)
            _tokens, _group_case, _dispatch_case, _skewed_layer)


@contextlib.contextmanager
def _refusing(what):
    with forbid(*_course_code(), exercise=f"write {what} yourself"):
        yield


def _called(fn, *args, name, what="the prioritized routing"):
    """Call the learner's local function here, in one process."""
    try:
        with _refusing(what):
            return call_learner(fn, *args, name=name)
    except UsedCourseCode as e:
        raise CheckFailed(str(e)) from None


@contextlib.contextmanager
def _layer_routes_with(route_fn):
    """Inside a rank: ExpertParallelMoE routes with `route_fn` (its module's `route` name)."""
    saved = ep_lib.route
    ep_lib.route = route_fn
    try:
        yield
    finally:
        ep_lib.route = saved


def _layer_versus_reference(moe, layer_route, tokens, reference_out):
    """Run the EP layer (routing through `layer_route`) on this rank's tokens; return
    (y, x.grad) and (reference y, reference x.grad)."""
    layer = ep_lib.ExpertParallelMoE(moe, None)
    x = tokens.clone().requires_grad_()
    with _layer_routes_with(layer_route):
        y, _ = layer(x)
    weights = torch.linspace(-1, 1, y.numel(), dtype=y.dtype).view_as(y)
    (y * weights).sum().backward()
    yr, gr = reference_out(weights)
    return (y.detach(), x.grad), (yr, gr)


def _compare_ranks(got, what, world_size):
    for rank, ((y, gx), (yr, gr)) in enumerate(got):
        where = f"{what}, EP={world_size}, rank {rank}"
        compare(y, yr, f"{where}: the layer's output", atol=1e-10, rtol=1e-9)
        compare(gx, gr, f"{where}: the gradient of the layer's input", atol=1e-10, rtol=1e-9)


LAYER_CASES = ((1, 1.0), (2, 0.75))      # (top_k, capacity_factor) of the layer runs


# A function given `group` must talk to that group only. Each layout below splits the world into
# EP groups that run at the same time on different tokens: four ranks as two groups of two, and
# five ranks as {0, 2} and {1, 3, 4} (a group whose ranks are not 0..k). A function that talks to
# the whole world mixes the groups' data, and the trace names the collective that did.

LAYOUTS = ((3, ((0, 1, 2),)), (4, ((0, 1), (2, 3))), (5, ((0, 2), (1, 3, 4))))


def _layout_phrase(layouts):
    return "; ".join(f"{ws} ranks as " + " and ".join(str(list(g)) for g in groups)
                     for ws, groups in layouts)


def _my_group(rank, groups):
    """Every rank creates every group, in the same order; (this rank's group, its ranks)."""
    made = [dist.new_group(list(ranks)) for ranks in groups]
    i = next(i for i, ranks in enumerate(groups) if rank in ranks)
    return made[i], groups[i]


def _fresh_seed():
    # Drawn per check: the other ranks' inputs cannot be rebuilt without a message.
    import secrets
    return secrets.randbelow(2 ** 31)


def _talked_outside(trace, groups, name):
    """A one-sentence refusal when a rank's collective or message reached past its group, by the
    checkers' one traffic rule (`_traffic.off_group`)."""
    for ranks in groups:
        for rank in ranks:
            bad, _ = _traffic.off_group(_traffic.records(trace, rank), ranks)
            if bad is not None:
                reached = [bad["peer"]] if bad["kind"] in _traffic.P2P else list(bad["group"])
                return (f"{name}: rank {rank}'s {bad['op']} reached ranks {reached}, but "
                        f"its group is {list(ranks)} (the others form another EP group "
                        f"with other tokens): pass the `group` you were given to every "
                        f"collective, and use ranks inside it.")
    return None
