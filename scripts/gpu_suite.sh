#!/usr/bin/env bash
# The project's GPU suite on a 4-GPU H200 machine, in two phases that each fit one device call.
#   phase A: GPU tests (GPUs 2-3) and the 1B single-GPU benchmarks (GPUs 0 and 1) in parallel, then the
#            8B on 4 GPUs: FSDP4 compiled, FSDP2 x TP2, CP2 x FSDP2
#   phase B: the 8B on 4 GPUs: FSDP4 eager, PP2 x FSDP2, FSDP4 + float8
# Usage (on the device machine, from the repo root): bash scripts/gpu_suite.sh A|B   (results under $OUT)
set -u
PHASE=${1:?phase A or B}
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export TITANRUSH_COMMIT=${TITANRUSH_COMMIT:-unknown}
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT" /tmp/suite
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD
fi
export PYTHONPATH=${PYTHONPATH:-$PWD}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader > /tmp/suite/env.txt
python3 -c "import torch; print('torch', torch.__version__)" >> /tmp/suite/env.txt

B1="--config train_configs/llama1b_single.toml"
B8="--config train_configs/llama8b_fsdp.toml --training.steps 10"
bench() {  # bench SECONDS OUTDIR NGPU STEPS WARMUP --run ... : one bench_runs.py call, its log beside it
  local limit=$1 out=$2 ngpu=$3 steps=$4 warmup=$5; shift 5
  timeout "$limit" python3 scripts/bench_runs.py --out "/tmp/suite/$out" --ngpu "$ngpu" --steps "$steps" --warmup "$warmup" "$@" \
    > "/tmp/suite/$out.log" 2>&1
  cp "/tmp/suite/$out/results.md" "$OUT/$out.md" 2>/dev/null
}
if [ "$PHASE" = A ]; then
  # Stage 1, in parallel: the 1B single-GPU figures on GPUs 0 and 1, the GPU tests on GPUs 2-3.
  (CUDA_VISIBLE_DEVICES=2,3 timeout 300 python3 -m pytest tests/gpu -q -p no:cacheprovider \
     > /tmp/suite/gpu_tests.txt 2>&1; cp /tmp/suite/gpu_tests.txt "$OUT/") &
  (CUDA_VISIBLE_DEVICES=0 bench 280 b1_gpu0 1 14 5 \
    --run "compile: $B1" \
    --run "compile_float8_tensorwise: $B1 --float8.enable" \
    --run "compile_chunked_loss: $B1 --training.loss chunked" \
    --run "compile_adamw8bit: $B1 --optimizer.name adamw8bit") &
  CUDA_VISIBLE_DEVICES=1 bench 280 b1_gpu1 1 14 5 \
    --run "eager: $B1 --no-compile.enable" \
    --run "compile_float8_rowwise: $B1 --float8.enable --float8.recipe rowwise" \
    --run "compile_cudnn: $B1 --model.attn_backend cudnn" \
    --run "compile_flex: $B1 --model.attn_backend flex"
  wait
  # Stage 2: the 8B on all four GPUs.
  bench 290 b8_a 4 10 4 \
    --run "fsdp4_compile: $B8" \
    --run "fsdp2_tp2_compile: $B8 --parallelism.tp 2" \
    --run "cp2_fsdp2_compile: $B8 --parallelism.cp 2"
else
  bench 290 b8_b 4 10 4 \
    --run "fsdp4_eager: $B8 --no-compile.enable" \
    --run "pp2_fsdp2_compile: $B8 --parallelism.pp 2 --training.local_batch_size 4" \
    --run "fsdp4_compile_float8: $B8 --float8.enable"
fi
cp /tmp/suite/env.txt "$OUT/"
tar czf "$OUT/logs_$PHASE.tgz" --exclude='*.distcp' --exclude='tb' -C /tmp suite 2>/dev/null
cat "$OUT"/*.md "$OUT"/*.txt 2>/dev/null | tail -60
