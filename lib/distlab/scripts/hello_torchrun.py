"""One program, N processes: the chapter-01 script, started by torchrun.

    torchrun --standalone --nproc-per-node=4 -m distlab.scripts.hello_torchrun [--count 1000] [--out DIR]

torchrun starts one process per rank and tells each who it is through environment variables
(RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT, ...). Every process runs all of main():
- it joins the default process group (init_method env:// reads those variables);
- it sums its own slice of 0..count-1 and all_reduce adds the partial sums;
- rank 0 creates the initial weights and broadcasts them, so every rank starts identical;
- rank 0 alone prints the summary and writes the checkpoint (N ranks writing one file would race).
With --out DIR every rank also writes DIR/rank<r>.json: its environment and what it computed.
"""
import argparse
import json
import os
import sys

import torch
import torch.distributed as dist

ENV_KEYS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK",
            "GROUP_WORLD_SIZE", "ROLE_RANK", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
            "TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS",
            "TORCHELASTIC_USE_AGENT_STORE", "OMP_NUM_THREADS")


def parse(argv):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--count", type=int, default=1000, help="sum the numbers 0..count-1")
    parser.add_argument("--seed", type=int, default=0, help="seed of rank 0's initial weights")
    parser.add_argument("--out", help="folder for rank<r>.json and rank 0's checkpoint.pt")
    return parser.parse_args(argv)


def main(argv=None):
    args = parse(argv)
    if "RANK" not in os.environ:
        sys.exit("hello_torchrun is one rank of a distributed job and reads RANK, WORLD_SIZE and "
                 "MASTER_ADDR from the environment: start it with `torchrun --standalone "
                 "--nproc-per-node=4 -m distlab.scripts.hello_torchrun`.")
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    # One GPU per process, chosen by LOCAL_RANK (the rank within this machine, not the job).
    if torch.cuda.is_available() and local_rank < torch.cuda.device_count():
        backend, device = "nccl", torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    else:
        backend, device = "gloo", torch.device("cpu")
    dist.init_process_group(backend)
    try:
        mine = torch.arange(args.count, device=device).tensor_split(world_size)[rank]
        partial = mine.sum()
        total = partial.clone()
        dist.all_reduce(total)

        weights = torch.zeros(4, device=device)
        if rank == 0:
            weights = torch.randn(4, generator=torch.Generator().manual_seed(args.seed)).to(device)
        dist.broadcast(weights, src=0)

        span = f"{mine[0].item()}..{mine[-1].item()}" if len(mine) else "nothing"
        print(f"rank {rank} of {world_size} (local rank {local_rank}): summed {span} -> "
              f"{partial.item()}; all_reduce -> {total.item()}; "
              f"weights[0] = {weights[0].item():.4f}", flush=True)
        if rank == 0:
            expected = args.count * (args.count - 1) // 2
            print(f"rank 0 reports: sum of 0..{args.count - 1} = {total.item()} (expected "
                  f"{expected}), {world_size} ranks, backend {backend}", flush=True)
        if args.out:
            os.makedirs(args.out, exist_ok=True)
            if rank == 0:
                torch.save({"weights": weights.cpu()}, os.path.join(args.out, "checkpoint.pt"))
            record = {"rank": rank, "backend": backend, "partial": partial.item(),
                      "total": total.item(), "count": len(mine),
                      "weights": weights.cpu().tolist(),
                      "env": {k: os.environ.get(k) for k in ENV_KEYS}}
            with open(os.path.join(args.out, f"rank{rank}.json"), "w") as f:
                json.dump(record, f)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
