#!/usr/bin/env bash
# Multi-node titanrush training on SLURM: one torchrun launcher per node (srun), joined by torchrun's
# c10d rendezvous on the first node of the allocation. Each launcher starts NGPU training processes.
#   sbatch --nodes=8 scripts/slurm_train.sh --config train_configs/llama70b_2d.toml [--section.key value ...]
# Environment (all optional):
#   NGPU           training processes per node (default: the GPUs SLURM gave each node, else all visible)
#   RDZV_PORT      rendezvous port on the first node (default 29500)
#   RDZV_ENDPOINT  host:port of the rendezvous (default: first node of the allocation : RDZV_PORT)
#   PYTHON         interpreter (default python3); activate your environment before sbatch, srun inherits it
# Every node runs ./run_train.sh with NNODES, NODE_RANK (= SLURM_NODEID) and RDZV_ENDPOINT set; the
# rendezvous id is the SLURM job id, so two jobs never join each other. If a node fails, srun's
# --kill-on-bad-exit ends the others instead of leaving them waiting in a collective. With
# --job.max_restarts N every node's launcher starts a failed job again in place (same nodes, resuming
# from the newest checkpoint) before it gives up; a preempted job (SIGTERM) is SLURM's to requeue
# (sbatch --requeue). docs/operations.md, "Restarts".
#SBATCH --job-name=titanrush
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=8
#SBATCH --exclusive
#SBATCH --output=slurm-%x-%j.out
set -euo pipefail

# sbatch runs a copy of this script from the spool folder: find the checkout from the submit folder.
REPO=${TITANRUSH_ROOT:-${SLURM_SUBMIT_DIR:-$(cd "$(dirname "$0")/.." && pwd)}}
if [ ! -x "$REPO/run_train.sh" ]; then
  echo "slurm_train.sh: no run_train.sh in $REPO; submit from the checkout or set TITANRUSH_ROOT" >&2
  exit 2
fi
: "${SLURM_JOB_ID:?run this through sbatch (or salloc), not directly}"

NNODES=${SLURM_JOB_NUM_NODES:-${SLURM_NNODES:-1}}
# (sed reads all the names: `head -n 1` would end the pipe early and pipefail would stop the script)
HEAD_NODE=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | sed -n 1p)
RDZV_ENDPOINT=${RDZV_ENDPOINT:-$HEAD_NODE:${RDZV_PORT:-29500}}
[ -z "${NGPU:-}" ] && [ -n "${SLURM_GPUS_ON_NODE:-}" ] && NGPU=$SLURM_GPUS_ON_NODE
export NNODES RDZV_ENDPOINT RDZV_ID="titanrush-$SLURM_JOB_ID"
[ -n "${NGPU:-}" ] && export NGPU
# Some clusters need these for NCCL to find the right network; set them in your environment if so:
#   NCCL_SOCKET_IFNAME, NCCL_IB_HCA, FI_PROVIDER, ...
echo "titanrush on $NNODES node(s) x ${NGPU:-all visible} GPU(s); rendezvous $RDZV_ENDPOINT ($RDZV_ID)"

# One task per node; each reads its own SLURM_NODEID as the node rank (single quotes: expanded there).
srun --ntasks-per-node=1 --nodes="$NNODES" --kill-on-bad-exit=1 \
  bash -c 'NODE_RANK=$SLURM_NODEID exec "$0/run_train.sh" "$@"' "$REPO" "$@"
