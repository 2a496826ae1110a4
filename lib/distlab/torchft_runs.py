"""torchft beside the course's own code: the same runs through torchft's Manager, Lighthouse and
reconfigurable gloo process group, on CPU.

torchft (github.com/pytorch/torchft, PyPI `torchft`, the `ft` extra of this course) makes each
data-parallel replica group a unit that may fail: a Lighthouse (a Rust server) forms quorums from
the groups' heartbeats, each group's Manager joins a quorum before it communicates, reconfigures
its process group when the quorum changes, asks `should_commit()` before an update is applied, and
sends its state to a recovering group. Its LocalSGD and DiLoCo wrap an inner optimizer with hooks
and do their outer step through the Manager.

`diloco_beside` runs on `distlab.run` ranks, each rank one replica group of one process: rank 0
also starts the Lighthouse. It trains the same model on the same batches with torchft's DiLoCo
(or LocalSGD) and with `distlab.diloco.DiLoCo`, and returns the largest difference.

`ft_group` is `distlab.fault_tolerance.run_group` done by torchft: replica groups in processes
(the forkserver of the launcher), the Lighthouse in the caller; one group hangs and is killed,
the others' commit fails and they retry without it, a newcomer heals from a peer over torchft's
HTTP checkpoint transport. `membership` reads who contributed to each committed step, so the
run can be compared with `fault_tolerance.reference`.
"""
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn.functional as F

from . import diloco
from .models import make_mlp, regression_data


def _need_torchft():
    try:
        import torchft  # noqa: F401
    except ImportError:
        raise ImportError("torchft is not installed: `pip install -e '.[ft]'` (make test installs "
                          "it; the course tested its Linux x86_64 wheel, torchft 0.2.0).") from None


def _batches(rank, world_size, steps, n=16):
    x, y = regression_data(n=n * world_size * steps, seed=7)
    x, y = x.double(), y.double()
    return [(x[i:i + n], y[i:i + n]) for i in range(n * rank, len(x), n * world_size)]


def diloco_beside(rank, world_size, H=2, steps=6, local_sgd=False, inner_lr=0.05):
    """On every rank: torchft's DiLoCo (outer Nesterov, lr 0.7, momentum 0.9) or LocalSGD, and
    ours, on the same batches. Returns (largest |torchft - ours| over the parameters, torchft's
    step count, our outer-step count)."""
    import logging
    import warnings
    _need_torchft()
    logging.getLogger("torchft").setLevel(logging.ERROR)     # "Unable to reset NCCL flight
    warnings.filterwarnings("ignore", message="The given buffer is not writable")  # recorder"
    from torchft import Manager, ProcessGroupGloo
    from torchft.local_sgd import DiLoCo as FtDiLoCo, LocalSGD as FtLocalSGD
    lighthouse = None
    if rank == 0:
        from torchft._torchft import LighthouseServer
        lighthouse = LighthouseServer(bind="[::]:0", min_replicas=world_size, join_timeout_ms=100)
    address = [lighthouse.address() if lighthouse else None]
    dist.broadcast_object_list(address, src=0)
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    batches = _batches(rank, world_size, steps)

    ft_model = make_mlp((16, 32, 4), seed=0).double()
    inner = torch.optim.SGD(ft_model.parameters(), lr=inner_lr)
    manager = Manager(pg=ProcessGroupGloo(), min_replica_size=world_size,
                      load_state_dict=ft_model.load_state_dict, state_dict=ft_model.state_dict,
                      replica_id=f"replica{rank}", store_addr="127.0.0.1",
                      store_port=store.port, rank=0, world_size=1,
                      lighthouse_addr=address[0], timeout=timedelta(seconds=20),
                      use_async_quorum=False, init_sync=False)
    if local_sgd:
        wrap = FtLocalSGD(manager, ft_model, inner, sync_every=H)
    else:
        wrap = FtDiLoCo(manager, [ft_model], inner, diloco.nesterov(ft_model.parameters()),
                        sync_every=H, pin_memory=False)
    try:
        with wrap:
            for x, y in batches:
                inner.zero_grad()
                F.mse_loss(ft_model(x), y).backward()
                inner.step()
        ft_steps = manager.current_step()
    finally:
        manager.shutdown(wait=False)
        dist.barrier()
        if lighthouse is not None:
            lighthouse.shutdown()

    ours = make_mlp((16, 32, 4), seed=0).double()
    outer = diloco.plain_average if local_sgd else diloco.nesterov
    _, wrapper = diloco.train(ours, batches, lambda ps: torch.optim.SGD(ps, lr=inner_lr),
                              H=H, outer=outer)
    diff = max((a - b).abs().max().item() for a, b in zip(ft_model.parameters(),
                                                          ours.parameters()))
    return diff, ft_steps, wrapper.syncs


# ---- torchft's fault tolerance: a replica group dies, the others go on, a newcomer heals ------

def _ft_member(rid, lighthouse, port, steps, stall_at, start_after, join_at):
    """One replica group of one process under torchft's Manager: average gradients with
    `manager.allreduce`, apply them only if `manager.should_commit()`. Records, per committed
    step, its parameters and whether it contributed, in the parent's store."""
    import logging
    import os
    import time
    import warnings
    os.environ["RUST_LOG"] = "error"                     # torchft's Rust side: errors only
    logging.getLogger("torchft").setLevel(logging.CRITICAL)
    warnings.filterwarnings("ignore")
    from http.server import BaseHTTPRequestHandler
    BaseHTTPRequestHandler.log_message = lambda *a, **k: None   # the donor's HTTP access log
    from torchft import Manager, ProcessGroupGloo
    from .fault_tolerance import _encode, _flat, _grads, _optimizer, make_model
    torch.set_num_threads(1)
    results = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=60))
    own = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    model = make_model()
    opt = _optimizer(model)

    def state_dict():
        return {"model": model.state_dict(), "opt": opt.state_dict()}

    def load_state_dict(sd):
        model.load_state_dict(sd["model"])
        opt.load_state_dict(sd["opt"])
    # a survivor that waits on a survivor that waits on the dead group notices only at the
    # timeout: short here (the steps take milliseconds), minutes in a real job
    manager = Manager(pg=ProcessGroupGloo(timeout=timedelta(seconds=5)), min_replica_size=1,
                      load_state_dict=load_state_dict, state_dict=state_dict,
                      replica_id=f"group{rid}", store_addr="127.0.0.1", store_port=own.port,
                      rank=0, world_size=1, lighthouse_addr=lighthouse,
                      timeout=timedelta(seconds=5), use_async_quorum=False, init_sync=False)
    results.set(f"ready/{rid}", "1")
    if start_after is None:
        results.wait(["go"])                             # the first quorum: every group at once
    else:
        results.wait(["newcomer-go"])                    # the others are at step `join_at`
        results.set("asking", "1")
    record = {}
    while manager.current_step() < steps:
        if start_after is None and manager.current_step() == join_at:
            results.wait(["newcomer-ready"])               # the newcomer asks to join here
        manager.start_quorum()
        step = manager.current_step()
        grad = _grads(model, rid, step)
        if step == stall_at:
            results.set(f"stalled/{rid}", str(step))
            time.sleep(3600)                             # hung: the parent kills us
        manager.allreduce(grad).wait()                   # mean over the participants
        contributed = manager.is_participating()
        if manager.should_commit():
            from .fault_tolerance import _apply
            _apply(model, opt, grad)
            record[step] = (_flat(model), contributed, manager.num_participants())
            results.set(f"at/{rid}/{step}", "1")
    results.set(f"result/{rid}", _encode(record))
    manager.shutdown(wait=False)
    os._exit(0)


def ft_group(groups=3, steps=8, kill=(2, 3), join=(3, 5), timeout=60):
    """torchft's Lighthouse here, `groups` replica groups in processes: group `kill[0]` stalls at
    step `kill[1]` and is killed; group `join[0]` starts when the others have committed step
    `join[1]` and heals from a peer. Returns {group: {step: (params, contributed, participants)}}."""
    import os
    import time
    os.environ.setdefault("RUST_LOG", "error")           # before torchft's Rust side starts
    _need_torchft()
    from torchft._torchft import LighthouseServer
    from ._supervise import _get_context, _start_without_main, loopback_listener
    from .fault_tolerance import _decode
    port, fd = loopback_listener()
    store = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False,
                          timeout=timedelta(seconds=timeout), master_listen_fd=fd)
    # the groups ask for their first quorum together (the "go" key); later quorums form without
    # the dead group once its heartbeats stop (1 s)
    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=groups - 1, join_timeout_ms=1000,
                                  heartbeat_timeout_ms=1000)
    ctx, procs = _get_context(), {}
    members = list(range(groups)) + [join[0]]         # the newcomer starts now, asks later
    try:
        for rid in members:
            p = ctx.Process(target=_ft_member, daemon=True, args=(
                rid, lighthouse.address(), port, steps, kill[1] if rid == kill[0] else None,
                join[1] if rid == join[0] else None, join[1]))
            _start_without_main(p)
            procs[rid] = p
        store.wait([f"ready/{r}" for r in members])
        store.set("go", "1")
        store.wait([f"stalled/{kill[0]}"])
        procs[kill[0]].kill()
        procs[kill[0]].join()
        survivors = [r for r in range(groups) if r != kill[0]]
        store.wait([f"at/{r}/{join[1] - 1}" for r in survivors])
        store.set("newcomer-go", "1")
        store.wait(["asking"])
        time.sleep(1.0)                                  # its quorum request reaches the lighthouse
        store.set("newcomer-ready", "1")
        out = {}
        for rid in survivors + [join[0]]:
            store.wait([f"result/{rid}"])
            out[rid] = _decode(store.get(f"result/{rid}"))
        return out
    finally:
        for p in procs.values():
            p.join(timeout=5)
            if p.exitcode is None:
                p.kill()
                p.join()
        lighthouse.shutdown()


def membership(records, lost):
    """Who contributed to each committed step, from the survivors' records: the groups that
    recorded the step as contributed, plus the lost group where the count says one more did."""
    steps = sorted({s for rec in records.values() for s in rec})
    out = {}
    for s in steps:
        there = sorted(r for r, rec in records.items() if s in rec and rec[s][1])
        count = max(rec[s][2] for rec in records.values() if s in rec)
        out[s] = sorted(there + [lost]) if count > len(there) else there
    return out
