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

(--ckpt must then be a folder every node sees: rank 0 writes it, every rank reads it.)

Only rank 0 logs. Every --save-every steps, and at the end, the dense model is gathered to rank 0,
which writes it to <ckpt>/checkpoint.pt (a temporary file, then an atomic rename, so a crash
never leaves half a checkpoint); a barrier keeps every rank until the file is whole. When the
checkpoint exists at start, every rank reads it and training continues from its step: the data
of step s is a fixed function of s, so a resumed run sees exactly the batches it would have seen.
The checkpoint holds the DENSE model, so a run may resume under a different (dp, pp, tp).

The script's options are chosen so that none is a prefix of one of torchrun's (torchrun reads
abbreviations: a script option `--n` would be taken as ambiguous torchrun option).
"""
import argparse
import os
import sys

import torch
import torch.distributed as dist

from . import parallel3d as p3
from .models import batches_of, make_gpt, token_data

CONFIG = dict(vocab=32, d_model=16, n_heads=2, seq_len=8)


def parser():
    ap = argparse.ArgumentParser(prog="python -m distlab.train", description=__doc__.split("\n")[0],
                                 allow_abbrev=False)
    ap.add_argument("--dp", type=int, default=2, help="data-parallel replicas")
    ap.add_argument("--pp", type=int, default=1, help="pipeline stages")
    ap.add_argument("--tp", type=int, default=2, help="tensor-parallel ranks per stage")
    ap.add_argument("--layers", type=int, default=4, help="transformer blocks")
    ap.add_argument("--steps", type=int, default=6, help="total optimizer steps of the run")
    ap.add_argument("--batch", type=int, default=8, help="global batch, in sequences")
    ap.add_argument("--micro", type=int, default=2, help="micro-batches per data-parallel rank")
    ap.add_argument("--lr", type=float, default=0.1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dtype", choices=("float32", "float64"), default="float32")
    ap.add_argument("--ckpt", default=None, help="folder of the checkpoint (resume from it)")
    ap.add_argument("--save-every", type=int, default=0, help="also save every k steps")
    ap.add_argument("--stop-after", type=int, default=None,
                    help="stop after this step, as if the job were preempted (to try resuming)")
    return ap


def parse(argv=None):
    return parser().parse_args(argv)


def checkpoint_path(args):
    return os.path.join(args.ckpt, "checkpoint.pt") if args.ckpt else None


def log(*words):
    if dist.get_rank() == 0:
        print(*words, flush=True)


def save(stage, mesh, args, step, losses):
    """Collective: gather the dense model to rank 0; rank 0 writes; everyone waits for it."""
    dense = p3.dense_state_dict(stage, mesh)
    if dist.get_rank() == 0:
        os.makedirs(args.ckpt, exist_ok=True)
        path = checkpoint_path(args)
        torch.save(dict(step=step, model=dense, losses=losses, config=CONFIG, layers=args.layers,
                        seed=args.seed), path + ".tmp")
        os.replace(path + ".tmp", path)
        log(f"saved step {step} to {path}")
    dist.barrier()


def load(args):
    """(first step, dense model, losses so far): from the checkpoint if there is one."""
    # The training dtype before loading: load_state_dict casts to the model's dtype, and a
    # float64 checkpoint read into float32 would not continue the same run.
    model = make_gpt(seed=args.seed, n_layers=args.layers, **CONFIG).to(getattr(torch, args.dtype))
    path = checkpoint_path(args)
    if not path or not os.path.exists(path):
        return 0, model, []
    state = torch.load(path, map_location="cpu")
    if state["layers"] != args.layers or state["config"] != CONFIG:
        raise SystemExit(f"{path} holds a different model ({state['layers']} blocks); start "
                         f"with another --ckpt folder or the same --layers.")
    model.load_state_dict(state["model"])
    log(f"resumed from {path} at step {state['step']}")
    return state["step"], model, state["losses"]


def pick_backend():
    local = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("WORLD_SIZE", "1")))
    if torch.cuda.is_available() and torch.cuda.device_count() >= local and dist.is_nccl_available():
        return "nccl"
    return "gloo"


def main(args):
    """Runs on every rank, under torchrun (or distlab.run with init=False)."""
    backend = pick_backend()
    on = torch.device("cpu")
    if backend == "nccl":
        on = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(on)
    dist.init_process_group(backend)
    try:
        world = dist.get_world_size()
        if args.dp * args.pp * args.tp != world:
            raise SystemExit(f"--dp {args.dp} x --pp {args.pp} x --tp {args.tp} = "
                             f"{args.dp * args.pp * args.tp} ranks, but {world} were started.")
        mesh = p3.Mesh3D(args.dp, args.pp, args.tp)
        start, model, losses = load(args)
        stage = p3.Stage3D.from_dense(model, mesh, on)
        log(f"{world} ranks ({backend}) as dp={args.dp} x pp={args.pp} x tp={args.tp}; "
            f"steps {start}..{args.steps - 1}")
        x, y = token_data(n=8 * args.batch, seq_len=CONFIG["seq_len"], vocab=CONFIG["vocab"],
                          seed=args.seed + 1)
        batches = batches_of(x, y, args.batch, args.steps)
        step = start
        for step in range(start, args.steps):
            xb, yb = batches[step]
            loss = p3.train_step(stage, mesh, xb, yb, args.micro, args.lr)
            losses.append(loss)
            log(f"step {step} loss {loss:.6f}")
            done = step + 1
            if args.stop_after is not None and step >= args.stop_after:
                break
            if args.ckpt and args.save_every and done % args.save_every == 0 and done < args.steps:
                save(stage, mesh, args, done, losses)
        if args.ckpt:
            save(stage, mesh, args, len(losses), losses)
        return losses
    finally:
        dist.destroy_process_group()


def _on_rank(rank, world_size, args):
    return main(args)


if __name__ == "__main__":
    args = parse()
    if "RANK" in os.environ:        # started by torchrun: this process is one rank
        main(args)
    else:                            # plain python: start the ranks here, one process each
        import distlab
        distlab.run(_on_rank, args.dp * args.pp * args.tp, args, init=False, timeout=None)
        sys.exit(0)
