"""Checkers for workbook 06: a ZeRO-1 optimizer step and ZeRO-3's gather/free around a layer."""
import torch
import torch.distributed as dist
import torch.nn.functional as F

from .. import models
from ..sharding import chunk_bounds, gather_flat
from . import CheckFailed, compare, passed, run_learner, sizes_phrase

SIZES, STEPS, BATCH, LR = (6, 10, 5, 3), 3, 12, 0.05


def _zero1_rank(rank, world_size, fn):
    torch.set_default_dtype(torch.float64)
    model = models.make_mlp(SIZES, seed=3)
    params = list(model.parameters())
    shards = []
    for p in params:
        lo, hi = chunk_bounds(p.numel(), world_size, rank)
        shards.append(torch.nn.Parameter(p.data.view(-1)[lo:hi]))
    optimizer = torch.optim.Adam(shards, lr=LR)
    x, y = models.regression_data(64, SIZES[0], SIZES[-1], seed=4)
    for gx, gy in models.batches_of(x, y, BATCH, STEPS):
        model.zero_grad()
        optimizer.zero_grad()
        F.mse_loss(model(gx.chunk(world_size)[rank]), gy.chunk(world_size)[rank]).backward()
        fn(params, shards, optimizer)
    states = sum(v.numel() for st in optimizer.state.values() for v in st.values() if v.dim())
    return [p.detach().clone() for p in params], states


def _zero1_reference():
    torch.set_default_dtype(torch.float64)
    try:
        model = models.make_mlp(SIZES, seed=3)
        x, y = models.regression_data(64, SIZES[0], SIZES[-1], seed=4)
        models.train_reference(model, models.batches_of(x, y, BATCH, STEPS), optimizer="adam",
                               lr=LR)
        return [p.detach().clone() for p in model.parameters()]
    finally:
        torch.set_default_dtype(torch.float32)


def check_zero1_step(fn, world_sizes=(2, 3)):
    """fn(params, shards, optimizer) must leave every rank with the parameters of Adam on one process."""
    want = _zero1_reference()
    n = sum(p.numel() for p in want)
    names = [f"{i}.{k}" for i in range(0, 2 * (len(SIZES) - 1), 2) for k in ("weight", "bias")]
    for ws in world_sizes:
        got = run_learner(_zero1_rank, ws, fn, name="zero1_step")
        for rank, (params, states) in enumerate(got):
            for name, g, w in zip(names, params, want):
                compare(g, w, f"zero1_step with world_size={ws}, rank {rank}, after {STEPS} "
                        f"steps, parameter net.{name}", atol=1e-10, rtol=1e-9)
        total_states = sum(states for _, states in got)
        if total_states != 2 * n:
            raise CheckFailed(f"with world_size={ws} the ranks keep {total_states} optimizer "
                              f"state values in all; sharded Adam keeps 2 per parameter "
                              f"({2 * n}), split between the ranks.")
    passed(f"zero1_step trains exactly like Adam on one process, on {sizes_phrase(world_sizes)} "
           f"ranks, with each rank keeping only its slice of Adam's state.")


def _zero3_rank(rank, world_size, fn):
    torch.manual_seed(0)
    dense = torch.nn.Linear(7, 5)
    x = torch.randn(4, 7) + rank
    layer = torch.nn.Linear(7, 5)
    shards = {}
    for name, p in dense.named_parameters():
        lo, hi = chunk_bounds(p.numel(), world_size, rank)
        shards[name] = p.detach().reshape(-1)[lo:hi].clone()
    for p in layer.parameters():
        p.data.zero_()
        p.untyped_storage().resize_(0)
    with torch.no_grad():
        out = fn(layer, shards, x)
        want = dense(x)
    freed = all(p.untyped_storage().nbytes() == 0 for p in layer.parameters())
    return out, want, freed


def check_zero3_forward(fn, world_sizes=(2, 3, 4)):
    """fn(layer, shards, x): gather the layer's weights, run it, free them again."""
    for ws in world_sizes:
        got = run_learner(_zero3_rank, ws, fn, name="zero3_forward")
        for rank, (out, want, freed) in enumerate(got):
            compare(out, want, f"zero3_forward with world_size={ws}, rank {rank}, output",
                    atol=1e-6, rtol=1e-5)
            if not freed:
                raise CheckFailed(f"with world_size={ws}, rank {rank} still holds the full "
                                  f"weights after the forward: free them (resize their storage "
                                  f"to 0) once the output is computed.")
    passed(f"zero3_forward gathers the full layer, gives the dense output and frees the weights "
           f"again, on {sizes_phrase(world_sizes)} ranks.")


def zero3_forward_reference(layer, shards, x):
    """The answer, used by the tests (not shown in the workbook)."""
    for name, p in layer.named_parameters():
        full = gather_flat(shards[name], p.numel())
        p.untyped_storage().resize_(p.numel() * p.element_size())
        p.data.view(-1).copy_(full)
    out = layer(x)
    for p in layer.parameters():
        p.untyped_storage().resize_(0)
    return out
