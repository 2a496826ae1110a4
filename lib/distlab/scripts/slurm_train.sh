#!/bin/bash
# distlab.train on a Slurm cluster: one torchrun agent per node, started by srun; the agents meet
# at a rendezvous endpoint on the job's first node and start the ranks.
#
#   sbatch lib/distlab/scripts/slurm_train.sh --dp 2 --pp 2 --tp 4 --ckpt /shared/gpt3d
#
# Outside Slurm (no SLURM_JOB_ID) the script runs ONE agent with the same command line: start it
# once per "node" with NNODES, NPROC and RDZV_HOST set, as tests/test_checkpoint.py does with two
# agents on one machine.
#SBATCH --job-name=distlab-gpt3d
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=1          # one torchrun agent per node; torchrun starts the ranks
#SBATCH --gpus-per-node=8
#SBATCH --cpus-per-task=32
#SBATCH --time=00:30:00
#SBATCH --output=%x-%j.out
set -euo pipefail

NNODES=${NNODES:-${SLURM_NNODES:-1}}
NPROC=${NPROC:-${SLURM_GPUS_ON_NODE:-8}}      # ranks per node: one per GPU
if [ -n "${SLURM_JOB_ID:-}" ]; then
    # The rendezvous endpoint: the job's first node, which every node can reach.
    RDZV_HOST=${RDZV_HOST:-$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)}
fi
RDZV_HOST=${RDZV_HOST:-127.0.0.1}
PORT=${PORT:-29500}
RDZV_ID=${RDZV_ID:-${SLURM_JOB_ID:-distlab}}   # the same on every node of one job, new per job

# NCCL picks a network interface by itself; on nodes with several (ethernet + InfiniBand,
# docker bridges) name the one the nodes reach each other on, e.g. NCCL_SOCKET_IFNAME=ib0 or
# =eth0 (check with `ip addr`). NCCL_DEBUG=INFO prints the transport it chose (NET/IB or
# NET/Socket) and the ring/tree it built: the first thing to read when a multi-node job hangs
# or is slow. WARN keeps the log quiet once it works.
export NCCL_DEBUG=${NCCL_DEBUG:-WARN}
# export NCCL_SOCKET_IFNAME=ib0
# torchrun keeps one OpenMP thread per rank unless told otherwise; give each rank its share.
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-$(( ${SLURM_CPUS_PER_TASK:-$(nproc)} / NPROC > 0 ? ${SLURM_CPUS_PER_TASK:-$(nproc)} / NPROC : 1 ))}

AGENT=("${PYTHON:-python}" -m torch.distributed.run
       --nnodes="$NNODES" --nproc-per-node="$NPROC"
       --rdzv-backend=c10d --rdzv-endpoint="$RDZV_HOST:$PORT" --rdzv-id="$RDZV_ID"
       --max-restarts="${MAX_RESTARTS:-2}"
       -m distlab.train "$@")

if [ -n "${SLURM_JOB_ID:-}" ]; then
    # One task per node; if one agent fails for good, Slurm stops the others.
    exec srun --ntasks-per-node=1 --kill-on-bad-exit=1 "${AGENT[@]}"
else
    exec "${AGENT[@]}"
fi
