"""A replica group that survives a lost member, from scratch: quorums, a fresh process group per
quorum, and healing a newcomer from a peer.

Every chapter so far used one process group for the whole job: when a rank dies, its peers'
next collective fails ("Connection closed by peer") and the job is restarted from a checkpoint by
torchrun (chapter 10b). Data-parallel replicas do not need that: each one holds the whole model,
so the survivors can go on without the lost one, and a newcomer can copy the state of any
survivor. What it takes:

- a LIGHTHOUSE outside the replicas, which decides who is in the group: here the parent process
  (`run_group`), which also hosts the TCPStore the members meet in, and which starts, watches and
  kills the member processes. It publishes, for each step and each try of that step, a QUORUM:
  an id, the members, and who hands its state to newcomers (`step/<s>/try/<t>` in the store);
- a fresh process group per quorum: `ProcessGroupGloo` built on the store under the quorum's
  prefix, with the member's index in the quorum as its rank, so no global `init_process_group`
  and no restart is needed when membership changes;
- commit or retry: a step's gradients are averaged in a COPY; if the all-reduce fails (a peer
  died inside it), nothing is applied, the member reports the failure and waits for the next try
  of the same step, with the quorum the lighthouse publishes after reaping the dead member;
- healing: when a quorum holds a newcomer, the quorum's donor broadcasts its parameters and its
  optimizer's momentum over the new process group before the step.

The demo is scripted so that the outcome is exact: member `kill[0]` stalls at step `kill[1]`
after its backward (as a hung GPU would), the lighthouse kills it (SIGKILL) while its peers wait
in the all-reduce, and a newcomer joins at step `join`. torchft (the same roles: Lighthouse,
Manager, a reconfigurable ProcessGroupGloo, should_commit, checkpoint transport) decides from
heartbeats and timeouts instead.
"""
import io
import os
import time
from datetime import timedelta

import torch
import torch.distributed as dist

SEED_DATA = 1234


def make_model():
    """The members' model: a small float64 MLP (float64 so trajectories compare to 1e-12)."""
    from .models import make_mlp
    return make_mlp((8, 16, 4), seed=0).double()


def batch(member, step, n=16):
    """The batch member `member` trains on at step `step` (the same wherever it is computed)."""
    g = torch.Generator().manual_seed(SEED_DATA + 1000 * member + step)
    x = torch.randn(n, 8, generator=g, dtype=torch.float64)
    return x, torch.sin(x[:, :4]) + 0.1 * x[:, 4:]


def _grads(model, member, step):
    model.zero_grad()
    x, y = batch(member, step)
    torch.nn.functional.mse_loss(model(x), y).backward()
    return torch.cat([p.grad.reshape(-1) for p in model.parameters()])


def _apply(model, opt, mean):
    for p, g in zip(model.parameters(), mean.split([p.numel() for p in model.parameters()])):
        p.grad = g.view_as(p).clone()
    opt.step()


def _flat(model):
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def _encode(obj):
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def _decode(data):
    return torch.load(io.BytesIO(data), weights_only=False)


def _optimizer(model):
    return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


# ---- a member --------------------------------------------------------------------------------

def _member(me, port, steps, stall_at, first_step, timeout):
    """A member's process: `_train`, and if it raises, its last lines for the lighthouse."""
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=timeout))
    try:
        _train(store, me, steps, stall_at, first_step)
    except BaseException:
        import traceback
        store.set(f"crashed/{me}", traceback.format_exc()[-1500:])
    os._exit(0)      # an abandoned all-reduce may still hold a gloo thread: do not wait for it


def _train(store, me, steps, stall_at, first_step):
    """One replica: train `steps` steps, following the lighthouse's quorums."""
    model, trajectory = make_model(), {}
    opt = _optimizer(model)
    quorum_id, pg = None, None
    store.set(f"hello/{me}", "1")
    step = first_step
    while step < steps:
        tried = 0
        while True:
            qid, members, donor = _decode(store.get(f"step/{step}/try/{tried}"))
            if qid != quorum_id:                       # membership changed: a new process group
                pg = dist.ProcessGroupGloo(dist.PrefixStore(f"quorum/{qid}", store),
                                           members.index(me), len(members),
                                           timedelta(seconds=20))
                _heal(pg, model, opt, members, donor, me)
                quorum_id = qid
            grad = _grads(model, me, step)
            if step == stall_at:
                store.set(f"stalled/{me}", str(step))
                time.sleep(3600)                       # a hung device: the lighthouse kills us
            total = grad.clone()
            try:
                _wait(pg.allreduce([total]), store, f"abort/{qid}")
            except Exception as e:                     # a peer died inside the all-reduce
                said = ("lost its connection to a peer (gloo: closed or reset by peer)"
                        if "by peer" in str(e) else
                        "stopped waiting: the lighthouse aborted the quorum" if "aborted" in str(e)
                        else f"{type(e).__name__}: {str(e)[:200]}")
                store.set(f"failed/{step}/{tried}/{me}", said)
                tried += 1
                continue                               # nothing applied: retry the step
            _apply(model, opt, total / len(members))
            break
        trajectory[step] = _flat(model)
        step += 1
    store.set(f"result/{me}", _encode(trajectory))


def _wait(work, store, abort_key):
    """Wait for `work`, unless the lighthouse aborts its quorum: a member whose all-reduce waits
    on a peer that waits on the dead one would otherwise sit there until the group's timeout."""
    while not work.is_completed():
        if store.check([abort_key]):
            raise RuntimeError("the lighthouse aborted the quorum")
        time.sleep(0.002)
    work.wait()                                        # raises the all-reduce's own error


def _heal(pg, model, opt, members, donor, me):
    """If the quorum has a newcomer (`donor` is not None), the donor broadcasts its parameters
    and momentum buffers over the new group; everyone takes part, the newcomer receives."""
    if donor is None:
        return
    state = torch.cat([_flat(model)] + [
        opt.state[p]["momentum_buffer"].reshape(-1) if "momentum_buffer" in opt.state[p]
        else torch.zeros(p.numel(), dtype=p.dtype) for p in model.parameters()])
    options = dist.BroadcastOptions()
    options.rootRank = members.index(donor)
    pg.broadcast([state], options).wait()
    if me != donor:
        n = state.numel() // 2
        with torch.no_grad():
            for p, v, m in zip(model.parameters(), state[:n].split([p.numel() for p in model.parameters()]),
                               state[n:].split([p.numel() for p in model.parameters()])):
                p.copy_(v.view_as(p))
                opt.state[p]["momentum_buffer"] = m.view_as(p).clone()


# ---- the lighthouse --------------------------------------------------------------------------

def run_group(members=3, steps=8, kill=(2, 3), join=6, timeout=60):
    """Run a replica group of `members` processes for `steps` steps; member `kill[0]` is killed
    at step `kill[1]` (None: nobody), a new member joins at step `join` (None: nobody).
    Returns {"trajectories": {member: {step: flat parameters}}, "quorums": [(step, members)],
    "failures": [(step, member, error)], "events": [str]}."""
    _check_plan(members, steps, kill, join)
    from ._supervise import _get_context, _start_without_main, loopback_listener
    port, fd = loopback_listener()
    store = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False,
                          timeout=timedelta(seconds=timeout), master_listen_fd=fd)
    ctx = _get_context()
    victim, kill_step = kill if kill is not None else (None, None)
    procs, events, failures, quorums = {}, [], [], []

    def start(me, first_step):
        p = ctx.Process(target=_member, args=(me, port, steps, kill_step if me == victim else None,
                                              first_step, timeout), daemon=True)
        _start_without_main(p)
        procs[me] = p

    def publish(step, tried, qid, group, donor=None):
        store.set(f"step/{step}/try/{tried}", _encode((qid, group, donor)))
        quorums.append((step, list(group)))

    def wait_key(key):
        deadline = time.time() + timeout
        while not store.check([key]):
            crashed = [m for m in procs if store.check([f"crashed/{m}"])]
            if crashed:
                said = store.get(f"crashed/{crashed[0]}").decode().strip().splitlines()[-1]
                raise RuntimeError(f"member {crashed[0]} failed while the lighthouse waited for "
                                   f"{key!r}: {said}")
            dead = [m for m, p in procs.items() if p.exitcode is not None and m != victim
                    and not store.check([f"result/{m}"])]        # finished members are not dead
            if dead or time.time() > deadline:
                raise RuntimeError(f"the replica group stopped waiting for {key!r}: "
                                   + (f"members {dead} exited (codes "
                                      f"{[procs[m].exitcode for m in dead]})" if dead
                                      else "timed out"))
            time.sleep(0.005)

    try:
        alive = list(range(members))
        for m in alive:
            start(m, 0)
        qid, newcomer = 0, members
        for step in range(steps):
            if join is not None and step == join:
                start(newcomer, join)
                wait_key(f"hello/{newcomer}")
                alive.append(newcomer)
                qid += 1
                publish(step, 0, qid, alive, donor=alive[0])
                events.append(f"step {step}: member {newcomer} joins; member {alive[0]} "
                              f"heals it (parameters and momentum)")
            else:
                publish(step, 0, qid, alive)
            if step == kill_step:
                wait_key(f"stalled/{victim}")
                procs[victim].kill()
                procs[victim].join()
                events.append(f"step {step}: member {victim} stalls; the lighthouse kills it "
                              f"(exit code {procs[victim].exitcode})")
                alive.remove(victim)
                store.set(f"abort/{qid}", "1")             # the others stop waiting on it
                for m in alive:
                    wait_key(f"failed/{step}/0/{m}")
                    failures.append((step, m, store.get(f"failed/{step}/0/{m}").decode()))
                qid += 1
                publish(step, 1, qid, alive)
        trajectories = {}
        for m in alive:
            wait_key(f"result/{m}")
            trajectories[m] = _decode(store.get(f"result/{m}"))
        return {"trajectories": trajectories, "quorums": quorums, "failures": failures,
                "events": events}
    finally:
        for p in procs.values():
            if p.exitcode is None:
                p.join(timeout=5)
            if p.exitcode is None:
                p.kill()
                p.join()


def _check_plan(members, steps, kill, join):
    for name, v, least in (("members", members, 2), ("steps", steps, 1)):
        if isinstance(v, bool) or not isinstance(v, int) or v < least:
            raise ValueError(f"{name} must be a whole number >= {least}; got {v!r}.")
    if kill is not None and not (isinstance(kill, tuple) and len(kill) == 2
                                 and 0 <= kill[0] < members and 0 <= kill[1] < steps):
        raise ValueError(f"kill must be (member, step) with member in 0..{members - 1} and step "
                         f"in 0..{steps - 1}, or None; got {kill!r}.")
    if join is not None and not (isinstance(join, int) and 0 < join < steps
                                 and (kill is None or join > kill[1])):
        raise ValueError(f"join must be a step after the kill and before {steps}, or None; got "
                         f"{join!r}.")


def reference(membership, steps):
    """One process, no faults: at each step the mean gradient of the members `membership(step)`
    lists, the same optimizer. Returns {step: flat parameters}."""
    model = make_model()
    opt = _optimizer(model)
    out = {}
    for step in range(steps):
        grads = [_grads(model, m, step) for m in membership(step)]
        _apply(model, opt, sum(grads) / len(grads))
        out[step] = _flat(model)
    return out
