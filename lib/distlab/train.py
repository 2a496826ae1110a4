"""Train the tiny GPT with 3D parallelism, as a script: the same code on a laptop and a cluster.

On this machine, one process per rank started for you (gloo on the CPU):

    python -m distlab.train --dp 2 --pp 2 --tp 2 --steps 6 --ckpt /tmp/run1

With torchrun on one machine (nccl when every local rank has a GPU, else gloo):

    torchrun --standalone --nproc-per-node=4 -m distlab.train --dp 2 --pp 1 --tp 2 --ckpt /tmp/run1

On a cluster: the same command on every node, with one rendezvous endpoint (a host:port of the
first node that all nodes can reach) and a job id they share. 2 nodes x 8 GPUs; with the mesh
order (dp, pp, tp) each node holds one whole data-parallel replica (both pipeline stages, TP
inside the node), so only the dp all-reduces cross the network:

    torchrun --nnodes=2 --nproc-per-node=8 --rdzv-backend=c10d \\
             --rdzv-endpoint=node0.example:29500 --rdzv-id=gpt3d \\
             -m distlab.train --dp 2 --pp 2 --tp 4 --ckpt /shared/run1

(--ckpt must then be a folder every node sees: every rank writes its part, every rank reads.)

Only rank 0 logs. Every --save-every steps, and at the end, every rank writes its part of the
model, of Adam's state and its random state with torch.distributed.checkpoint (distlab.checkpoint)
to <ckpt>/step-<n>; <ckpt>/latest points at the newest complete one. When it exists at start,
every rank reads the part it needs and training continues from its step: the data of step s is a
fixed function of s, so a resumed run sees exactly the batches it would have seen. Each rank
writes only its shards, as DTensors under the DENSE model's names, and DCP reshards them at load:
a run may resume under a different (dp, pp, tp), each rank reading only the chunks it needs.

The script's options are chosen so that none is a prefix of one of torchrun's (torchrun reads
abbreviations: a script option `--n` would be taken as ambiguous torchrun option).
"""
import argparse
import math
import os
import signal
import sys
import time

import torch
import torch.distributed as dist

from . import checkpoint as ckpt
from . import parallel3d as p3
from .models import batches_of, make_gpt, token_data

CONFIG = dict(vocab=32, d_model=16, n_heads=2, seq_len=8)


def _at_least(low):
    """An argparse type: a whole number >= low (argparse turns the ValueError into its error)."""
    def whole(text):
        try:
            n = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be a whole number; got {text!r}") from None
        if n < low:
            raise argparse.ArgumentTypeError(f"must be at least {low}; got {n}")
        return n
    return whole


def _learning_rate(text):
    """A positive, finite float: float() also reads 'nan' and 'inf', which would train NaNs."""
    try:
        lr = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number; got {text!r}") from None
    if not (math.isfinite(lr) and lr > 0):
        raise argparse.ArgumentTypeError(f"must be a positive, finite number; got {text}")
    return lr


def parser():
    ap = argparse.ArgumentParser(prog="python -m distlab.train", description=__doc__.split("\n")[0],
                                 allow_abbrev=False)
    ap.add_argument("--dp", type=_at_least(1), default=2, help="data-parallel replicas")
    ap.add_argument("--pp", type=_at_least(1), default=1, help="pipeline stages")
    ap.add_argument("--tp", type=_at_least(1), default=2, help="tensor-parallel ranks per stage")
    ap.add_argument("--layers", type=_at_least(1), default=4, help="transformer blocks")
    ap.add_argument("--steps", type=_at_least(0), default=6, help="total optimizer steps of the run")
    ap.add_argument("--batch", type=_at_least(1), default=8, help="global batch, in sequences")
    ap.add_argument("--micro", type=_at_least(1), default=2,
                    help="micro-batches per data-parallel rank")
    ap.add_argument("--optim", choices=("sgd", "adam"), default="sgd",
                    help="plain SGD, or Adam (whose moments the checkpoint also holds)")
    ap.add_argument("--lr", type=_learning_rate, default=0.1, help="learning rate")
    ap.add_argument("--seed", type=int, default=0,
                    help="seed of the model's initial weights and of the data")
    ap.add_argument("--dtype", choices=("float32", "float64"), default="float32",
                    help="precision of weights, activations and gradients (a run resumes in "
                         "the precision it was saved in)")
    ap.add_argument("--ckpt", default=None, help="folder of the checkpoint (resume from it)")
    ap.add_argument("--save-every", type=_at_least(0), default=0, help="also save every k steps")
    ap.add_argument("--dense-ckpt", action="store_true",
                    help="save whole tensors (each rank all-gathers its tp shards first) instead "
                         "of each rank's DTensor shards")
    ap.add_argument("--async-save", action="store_true",
                    help="write each checkpoint in a background thread (dcp.async_save): training "
                         "goes on once the state is staged; the next save waits for it")
    ap.add_argument("--stop-after", type=_at_least(0), default=None,
                    help="stop after this step, as if the job were preempted (to try resuming)")
    ap.add_argument("--kill-at", type=_at_least(0), default=None,
                    help="on the first attempt only (TORCHELASTIC_RESTART_COUNT=0), the last "
                         "rank kills itself with SIGKILL before this step: a crash to restart from")
    return ap


def parse(argv=None):
    """The options, checked together as well: what would otherwise fail inside every rank."""
    ap = parser()
    args = ap.parse_args(argv)
    if args.batch % (args.dp * args.micro):
        ap.error(f"--batch {args.batch} does not split into --dp {args.dp} x --micro "
                 f"{args.micro} equal micro-batches")
    if args.pp > args.layers:
        ap.error(f"--pp {args.pp} needs at least {args.pp} blocks (one per stage); got "
                 f"--layers {args.layers}")
    if CONFIG["n_heads"] % args.tp:
        ap.error(f"--tp {args.tp} does not divide the model's {CONFIG['n_heads']} attention heads")
    # How to save without where: every rank would train and write nothing, silently.
    how = [f"--save-every {args.save_every}"] * bool(args.save_every) \
        + ["--async-save"] * args.async_save + ["--dense-ckpt"] * args.dense_ckpt
    if how and not args.ckpt:
        named = " and ".join([", ".join(how[:-1]), how[-1]] if len(how) > 1 else how)
        one = len(how) == 1
        ap.error(f"{named} need{'s' * one} a checkpoint folder: add --ckpt DIR, or drop "
                 f"{'it' if one else 'them'}")
    return args


def log(*words):
    if dist.get_rank() == 0:
        print(*words, flush=True)


def refuse(message):
    """Stop every rank for a reason they all found; rank 0 alone says it, in one sentence.

    Collective. The other ranks leave first, quietly and with exit code 0, so that the message is
    printed once (not once per rank, interleaved) and torchrun lists one failure, rank 0's.
    """
    dist.barrier()
    if dist.get_rank() != 0:
        raise SystemExit(0)
    time.sleep(0.3)      # the others' exits, seen by torchrun before this one
    raise SystemExit(message)


class Adam:
    """torch.optim.Adam's update (its single-tensor path, bit for bit) on this rank's shards.

    Written out because building torch.optim.Adam imports torch._dynamo: seconds in every fresh
    torchrun worker. `state[name]` holds the moments of this rank's shard of parameter `name`.
    """

    def __init__(self, stage, lr, betas=(0.9, 0.999), eps=1e-8):
        self.params, self.lr, self.betas, self.eps, self.steps = dict(stage.named_parameters()), \
            lr, betas, eps, 0
        self.state = {n: dict(exp_avg=torch.zeros_like(p), exp_avg_sq=torch.zeros_like(p))
                      for n, p in self.params.items()}

    @torch.no_grad()
    def step(self):
        self.steps += 1
        (b1, b2), t = self.betas, self.steps
        for name, p in self.params.items():
            m, v = self.state[name]["exp_avg"], self.state[name]["exp_avg_sq"]
            m.lerp_(p.grad, 1 - b1)
            v.mul_(b2).addcmul_(p.grad, p.grad, value=1 - b2)
            denom = (v.sqrt() / (1 - b2 ** t) ** 0.5).add_(self.eps)
            p.addcdiv_(m, denom, value=-self.lr / (1 - b1 ** t))


def save(stage, mesh, args, step, losses, optimizer, pending=None):
    """Collective: every rank writes its part of the run at `step` (see distlab.checkpoint).

    With --async-save the save before (`pending`) is waited for first, so that latest switches
    in order and at most one save is in flight; returns the new one still being written."""
    if pending is not None:
        log(f"saved step {finish(pending)}")
    path = ckpt.save(args.ckpt, step, stage, mesh, optimizer,
                     dict(losses=losses, next_sample=step * args.batch, config=CONFIG,
                          layers=args.layers, seed=args.seed, optim=args.optim, batch=args.batch),
                     sharded=not args.dense_ckpt, background=args.async_save)
    if args.async_save:
        log(f"staged step {step}; writing in the background")
        return path
    log(f"saved step {step} to {path}")
    return None


def finish(pending):
    """Collective: wait for a background save and switch latest to it; its step."""
    path = pending.wait()
    return f"{pending.step} to {path}"


def load(args, model, stage, mesh, optimizer):
    """(first step, losses so far): from the newest checkpoint, if there is one (collective)."""
    try:
        path = ckpt.latest(args.ckpt) if args.ckpt else None
    except ckpt.BrokenCheckpoint as e:      # an empty latest, or one naming a missing folder
        refuse(str(e))
    if path is None:
        return 0, []
    # Every rank reads the same small metadata file, so they all refuse together or not at all.
    why = ckpt.damage(path)
    if why:
        refuse(why)
    try:
        why = another_run(path, ckpt.read_meta(path), args) or ckpt.mismatch(path, model, optimizer)
        if why:
            refuse(why)
        meta = ckpt.load(path, stage, mesh, optimizer)
    except ckpt.BrokenCheckpoint as e:      # a rank file of the right size, but garbage
        refuse(str(e))
    log(f"resumed from {path} at step {meta['step']}; rank 0 read {meta['read_bytes']} bytes of "
        f"tensors")
    return meta["step"], meta["losses"]


def another_run(path, meta, args):
    """A sentence if the run saved at `path` had another --optim, --seed or --batch, else None.

    Each changes what the steps after the resume compute (Adam's moments, the data and the
    initial weights the losses so far came from, the batch of each step), so the resumed run
    would be neither the saved run nor a fresh one.
    """
    saved = dict(meta)
    if "batch" not in saved and saved.get("step") and "next_sample" in saved:
        saved["batch"] = saved["next_sample"] // saved["step"]      # saved before meta had it
    for option in ("optim", "seed", "batch"):
        was, now = saved.get(option), getattr(args, option)
        if was is not None and was != now:
            return (f"{path} was saved with --{option} {was}, so it cannot continue the same run "
                    f"with --{option} {now}; resume with --{option} {was}, or start with another "
                    f"--ckpt folder.")
    return None


def pick_backend():
    local = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("WORLD_SIZE", "1")))
    if torch.cuda.is_available() and torch.cuda.device_count() >= local and dist.is_nccl_available():
        return "cpu:gloo,cuda:nccl"     # CUDA tensors over NCCL, CPU tensors (objects) over gloo
    return "gloo"


def init_process_group(backend):
    """init_process_group, safe to repeat after torchrun restarts the workers (--max-restarts).

    torchrun (2.13) keeps ONE store for all attempts, and the workers' keys of a killed attempt
    stay in it: a restarted gloo group may read a dead worker's address ("Connection refused").
    A key prefix per attempt keeps the attempts apart.
    """
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT")
    if attempt and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                              is_master=False)
        dist.init_process_group(backend, store=dist.PrefixStore(f"distlab/attempt{attempt}", store),
                                rank=int(os.environ["RANK"]),
                                world_size=int(os.environ["WORLD_SIZE"]))
    else:
        dist.init_process_group(backend)


def main(args):
    """Runs on every rank, under torchrun (or distlab.run with init=False)."""
    backend = pick_backend()
    on = torch.device("cpu")
    if "nccl" in backend:
        on = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(on)
    init_process_group(backend)
    try:
        world = dist.get_world_size()
        if args.dp * args.pp * args.tp != world:
            refuse(f"--dp {args.dp} x --pp {args.pp} x --tp {args.tp} = "
                   f"{args.dp * args.pp * args.tp} ranks, but {world} were started.")
        mesh = p3.Mesh3D(args.dp, args.pp, args.tp)
        # The training dtype before loading: a float64 checkpoint read into float32 would not
        # continue the same run (the guard in load refuses it).
        model = make_gpt(seed=args.seed, n_layers=args.layers, **CONFIG).to(getattr(torch, args.dtype))
        stage = p3.Stage3D.from_dense(model, mesh, on)
        optimizer = Adam(stage, args.lr) if args.optim == "adam" else None
        start, losses = load(args, model, stage, mesh, optimizer)
        log(f"{world} ranks ({backend}) as dp={args.dp} x pp={args.pp} x tp={args.tp}; "
            f"steps {start}..{args.steps - 1}")
        x, y = token_data(n=8 * args.batch, seq_len=CONFIG["seq_len"], vocab=CONFIG["vocab"],
                          seed=args.seed + 1)
        batches = batches_of(x, y, args.batch, args.steps)
        step, pending = start, None
        for step in range(start, args.steps):
            if args.kill_at == step and os.environ.get("TORCHELASTIC_RESTART_COUNT") == "0":
                dist.barrier()          # rank 0 has logged the steps before: a log in order
                if dist.get_rank() == world - 1:
                    print(f"rank {world - 1}: kill -9 myself before step {step}", flush=True)
                    os.kill(os.getpid(), signal.SIGKILL)
            xb, yb = batches[step]
            # With Adam, train_step's own SGD update gets lr 0 (p - 0*g is p, exactly).
            loss = p3.train_step(stage, mesh, xb, yb, args.micro, 0.0 if optimizer else args.lr)
            if optimizer:
                optimizer.step()
            losses.append(loss)
            log(f"step {step} loss {loss:.6f}")
            done = step + 1
            if args.stop_after is not None and step >= args.stop_after:
                break
            if args.ckpt and args.save_every and done % args.save_every == 0 and done < args.steps:
                pending = save(stage, mesh, args, done, losses, optimizer, pending)
        if args.ckpt:
            pending = save(stage, mesh, args, len(losses), losses, optimizer, pending)
            if pending is not None:
                log(f"saved step {finish(pending)}")
        return losses
    finally:
        dist.destroy_process_group()


def _on_rank(rank, world_size, args):
    try:
        return main(args)
    except SystemExit as e:
        if e.code:              # rank 0's reason to stop: the parent says it
            raise
        return None             # another rank of a refused run: nothing to add


def _launch_here(args):
    """Start the ranks of a run on this machine (no torchrun); a refusal stays one sentence."""
    import distlab
    try:
        # One thread per rank, as torchrun sets: the same run gives the same bits either way.
        distlab.run(_on_rank, args.dp * args.pp * args.tp, args, init=False, timeout=None,
                    threads=1)
    except distlab.RankFailed as e:
        if isinstance(e.exception, SystemExit):
            raise SystemExit(e.exception.code) from None
        raise


def still_running(marker):
    """Pids of this machine's processes whose command line mentions `marker` (a run's own
    checkpoint folder): the workers a launcher left behind when it returned, which keep their
    memory and their GPU until someone kills them."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if marker.encode() in f.read():
                    found.append(int(pid))
        except OSError:                 # gone between the listing and the read
            pass
    return found


if __name__ == "__main__":
    args = parse()
    if "RANK" in os.environ:        # started by torchrun: this process is one rank
        main(args)
    else:                            # plain python: start the ranks here, one process each
        _launch_here(args)
        sys.exit(0)
