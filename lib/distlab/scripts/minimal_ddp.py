"""A minimal, complete DDP training script, started by torchrun:

    torchrun --standalone --nproc-per-node=2 -m distlab.scripts.minimal_ddp [--epochs 3]

What every real DDP script does, in order:
- join the process group; the timeout is a `datetime.timedelta` (there is no `torch.timedelta`);
- one device per process, chosen by LOCAL_RANK; nccl on GPUs, gloo on CPUs;
- build the same model on every rank and wrap it in DistributedDataParallel (which broadcasts
  rank 0's weights, then averages gradients during backward);
- give each rank its own part of the data with a DistributedSampler, and call `set_epoch` so
  every epoch is shuffled differently;
- report the loss averaged over ranks from rank 0 only, and tear the group down at the end.
"""
import argparse
import os
import sys
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

from distlab.models import make_mlp, regression_data


def parse(argv):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=16, help="samples per rank per step")
    parser.add_argument("--lr", type=float, default=0.05)
    return parser.parse_args(argv)


def main(argv=None):
    args = parse(argv)
    if "LOCAL_RANK" not in os.environ:
        sys.exit("minimal_ddp is one rank of a distributed job: start it with `torchrun "
                 "--standalone --nproc-per-node=2 -m distlab.scripts.minimal_ddp`.")
    local_rank = int(os.environ["LOCAL_RANK"])
    if torch.cuda.is_available() and local_rank < torch.cuda.device_count():
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        backend = "nccl"
    else:
        device, backend = torch.device("cpu"), "gloo"
    # A hung collective fails after this long instead of the default 30 minutes (10 for nccl).
    dist.init_process_group(backend, timeout=timedelta(seconds=60))
    try:
        rank, world_size = dist.get_rank(), dist.get_world_size()
        model = DDP(make_mlp(seed=0).to(device),
                    device_ids=[local_rank] if device.type == "cuda" else None)
        x, y = regression_data(n=256, seed=0)
        sampler = DistributedSampler(TensorDataset(x, y), num_replicas=world_size, rank=rank,
                                     shuffle=True, seed=0)
        loader = DataLoader(TensorDataset(x, y), batch_size=args.batch_size, sampler=sampler)
        opt = torch.optim.SGD(model.parameters(), lr=args.lr)
        if rank == 0:
            print(f"{world_size} ranks, backend {backend}, {args.batch_size} samples per rank "
                  f"per step = global batch {args.batch_size * world_size}, "
                  f"{len(loader)} steps per epoch", flush=True)
        for epoch in range(args.epochs):
            sampler.set_epoch(epoch)   # without it every epoch repeats epoch 0's order
            total = torch.zeros(2, device=device)
            for xb, yb in loader:
                xb, yb = xb.to(device), yb.to(device)
                opt.zero_grad()
                loss = F.mse_loss(model(xb), yb)
                loss.backward()        # DDP all-reduces the gradients during backward
                opt.step()
                total += torch.stack([loss.detach() * len(xb), torch.tensor(len(xb), device=device)])
            dist.all_reduce(total)
            if rank == 0:
                print(f"epoch {epoch}: mean loss over all ranks {(total[0] / total[1]).item():.4f}",
                      flush=True)
    finally:
        dist.destroy_process_group()


def _exit_before_gloo_meets_shutdown():
    """End the process without shutting Python down, once main() has finished cleanly.

    DDP's C++ side keeps the gloo process group and its worker threads alive after
    destroy_process_group (and after the model is freed). A worker that drops the last
    collective's tensor after Python has begun to shut down must take the GIL; Python 3.11 ends
    such a thread with pthread_exit, and the unwind through C++ that may not throw calls
    std::terminate ("terminate called without an active exception", SIGABRT: one run in about
    45 under load). Nothing is left to clean up here: flush what was printed and leave.
    """
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
    _exit_before_gloo_meets_shutdown()
