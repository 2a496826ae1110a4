"""How long a 4-rank launch takes: distlab.run (cold and warm) against torch.multiprocessing.spawn,
and what one cell costs on ranks that stay (%%ranks).

Each launch does the same work: start 4 processes, initialise a gloo process group, all_reduce
one tensor, destroy the group, exit. Prints the times and the ratios, all measured in this run.

    python bench/launch.py [--world-size 4] [--repeats 5]
"""
import argparse
import os
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import distlab
from distlab.launch import _free_port as free_port
from distlab.ranks import Pool

CELL = "t = torch.ones(1)\ndist.all_reduce(t)"   # the same work, as a %%ranks cell


def work(rank, world_size):
    t = torch.ones(1)
    dist.all_reduce(t)
    return t.item()


def spawned(rank, world_size, port):
    # What a script written for mp.spawn does by hand.
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    work(rank, world_size)
    dist.destroy_process_group()


def timed(fn):
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    n = args.world_size

    cold = timed(lambda: distlab.run(work, n))
    warm = [timed(lambda: distlab.run(work, n)) for _ in range(args.repeats)]
    start = time.perf_counter()
    pool = Pool(n)   # %%ranks: the ranks stay; a cell costs only the round trip
    pool.run_cell(CELL)
    first = time.perf_counter() - start
    cells = [timed(lambda: pool.run_cell(CELL)) for _ in range(max(20, args.repeats))]
    empty = [timed(lambda: pool.run_cell("pass")) for _ in range(max(20, args.repeats))]
    pool.stop()
    spawn = [timed(lambda: mp.spawn(spawned, args=(n, free_port()), nprocs=n, join=True))
             for _ in range(max(1, args.repeats // 2))]

    warm_s, spawn_s = statistics.median(warm), statistics.median(spawn)
    print(f"{n}-rank launch (start, init gloo, all_reduce, destroy, exit), "
          f"{len(os.sched_getaffinity(0))} cores, torch {torch.__version__}")
    print(f"  distlab.run, cold (starts the forkserver): {cold * 1000:8.0f} ms")
    print(f"  distlab.run, warm (median of {len(warm)}):         {warm_s * 1000:8.0f} ms")
    print(f"  mp.spawn (median of {len(spawn)}):                  {spawn_s * 1000:8.0f} ms")
    print(f"  %%ranks first cell (starts {n} ranks, warm):  {first * 1000:8.0f} ms")
    cell_s = statistics.median(cells)
    print(f"  %%ranks cell, same work (median of {len(cells)}):     {cell_s * 1000:8.1f} ms")
    print(f"  %%ranks empty cell, warm overhead (median of {len(empty)}): "
          f"{statistics.median(empty) * 1000:5.1f} ms (target <= 50 ms)")
    print(f"  ratio mp.spawn / distlab.run warm:        {spawn_s / warm_s:8.1f}x")
    print(f"  ratio cold / warm:                        {cold / warm_s:8.1f}x")


if __name__ == "__main__":
    main()
