#!/usr/bin/env bash
# Launch titanrush training: ./run_train.sh [--config FILE] [--section.key value ...]
#   NGPU      processes per node (default: visible GPUs, or 1 without a GPU)
#   NNODES    nodes (default 1); with NNODES > 1 also NODE_RANK and RDZV_ENDPOINT (host:port) or
#             MASTER_ADDR / MASTER_PORT, for torchrun's c10d rendezvous
#   OMP_NUM_THREADS  CPU threads per process when several run (default: the node's cores / NGPU)
set -euo pipefail
# Paths on the command line stay relative to where you run this from; titanrush itself must be
# importable (pip install -e . in the checkout), or run this from the checkout's root.
here=$(cd "$(dirname "$0")" && pwd)
export PYTHONPATH="$here${PYTHONPATH:+:$PYTHONPATH}"
PYTHON=${PYTHON:-python3}

for arg in "$@"; do
  if [ "$arg" = "--help" ] || [ "$arg" = "-h" ]; then exec "$PYTHON" -m titanrush.train "$@"; fi  # (--help [TOPIC])
done

# How this script was called, for the run's summary to print its next commands (resume, ...) as the same
# command: the script's path, with the NGPU this call set.
printf -v launcher '%q' "$0"
case $0 in */*) ;; *) launcher=./$launcher ;; esac
if [ -n "${NGPU:-}" ]; then launcher="NGPU=$(printf '%q' "$NGPU") $launcher"; fi
export TITANRUSH_LAUNCHER=$launcher

if [ -z "${NGPU:-}" ]; then
  # torch counts the GPUs it can use; a host without a GPU's device file (NVIDIA, AMD, WSL) has none,
  # and is told so without the seconds of importing torch.
  if compgen -G "/dev/nvidia[0-9]*" >/dev/null || [ -e /dev/kfd ] || [ -e /dev/dxg ]; then  # (launch_env.GPU_DEVICE_FILES)
    NGPU=$("$PYTHON" -c "import torch; print(torch.cuda.device_count() or 1)" 2>/dev/null || echo 1)
  else
    NGPU=1
  fi
fi
NNODES=${NNODES:-1}
for var in NGPU NNODES; do
  if ! [[ "${!var}" =~ ^[1-9][0-9]{0,5}$ ]]; then
    echo "run_train.sh: error: $var=${!var} must be a whole number >= 1" >&2
    exit 2
  fi
done

if [ "$NNODES" != "1" ]; then  # (before any check or launch, like the counts above)
  if [ -z "${NODE_RANK:-}" ] || { [ -z "${RDZV_ENDPOINT:-}" ] && [ -z "${MASTER_ADDR:-}" ]; }; then
    echo "run_train.sh: error: NNODES=$NNODES needs NODE_RANK (this node's index, 0 to $((NNODES - 1))) and" \
      "RDZV_ENDPOINT (host:port of node 0) or MASTER_ADDR [MASTER_PORT]" >&2
    exit 2
  fi
  if ! [[ "$NODE_RANK" =~ ^[0-9]+$ ]] || [ "$NODE_RANK" -ge "$NNODES" ]; then
    echo "run_train.sh: error: NODE_RANK=$NODE_RANK must be a whole number from 0 to $((NNODES - 1))" >&2
    exit 2
  fi
fi

if [ "$NGPU" = "1" ] && [ "$NNODES" = "1" ]; then
  # One process: no launcher needed, and config errors exit with status 2 directly.
  exec "$PYTHON" -m titanrush.train "$@"
fi

# Several processes: --check is one process for the job's world size, nothing to launch. A run's config
# is checked once by the launcher before it starts the workers (a typo exits 2 before any launch).
for arg in "$@"; do
  if [ "$arg" = "--check" ]; then
    WORLD_SIZE=$((NGPU * NNODES)) LOCAL_WORLD_SIZE=$NGPU exec "$PYTHON" -m titanrush.train "$@"
  fi
done

# CPU threads per process: this node's cores shared by its NGPU processes (torchrun would set 1, with a
# banner saying so). A value in the environment wins.
if [ -z "${OMP_NUM_THREADS:-}" ]; then
  cores=$(nproc 2>/dev/null || getconf _NPROCESSORS_ONLN 2>/dev/null || echo 1)
  OMP_NUM_THREADS=$((cores / NGPU))
  [ "$OMP_NUM_THREADS" -ge 1 ] || OMP_NUM_THREADS=1
  export OMP_NUM_THREADS
fi

# titanrush.run.launch is torchrun ending with the workers' exit status (2, 3, 128 + N) and one line.
if [ "$NNODES" = "1" ]; then
  exec "$PYTHON" -m titanrush.run.launch --standalone --nproc_per_node="$NGPU" -m titanrush.train "$@"
fi
ENDPOINT=${RDZV_ENDPOINT:-$MASTER_ADDR:${MASTER_PORT:-29500}}
exec "$PYTHON" -m titanrush.run.launch --nnodes="$NNODES" --node_rank="$NODE_RANK" \
  --nproc_per_node="$NGPU" --rdzv_backend=c10d --rdzv_endpoint="$ENDPOINT" --rdzv_id="${RDZV_ID:-titanrush}" \
  -m titanrush.train "$@"
