#!/usr/bin/env bash
# First GPU check: the CPU unit tests under the GPU machine's torch, then the 1B single-GPU runs.
# Usage (device machine): bash scripts/gpu_smoke.sh   (writes under $OUT)
set -u
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
[ -d .whl ] && python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD
export PYTHONPATH=${PYTHONPATH:-$PWD}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/env.txt"
python3 -c "import torch; print(torch.__version__, torch.cuda.get_device_name(0))" | tee -a "$OUT/env.txt"
timeout 300 python3 -m pytest tests/unit -q -x -p no:cacheprovider 2>&1 | tail -5 | tee "$OUT/unit.txt"
python3 scripts/bench_runs.py --out /tmp/bench --steps 30 --warmup 10 "$@" 2>&1 | tail -30
cp /tmp/bench/results.md /tmp/bench/results.jsonl "$OUT/"
tar czf "$OUT/logs.tgz" -C /tmp bench
