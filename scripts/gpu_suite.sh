#!/usr/bin/env bash
# The project's GPU suite on a 4-GPU H200 machine, in two phases that each fit one device call.
#   phase A: GPU tests (GPUs 2-3) and the 1B single-GPU benchmarks (GPUs 0 and 1) in parallel, then the
#            8B on 4 GPUs: FSDP4 compiled, FSDP2 x TP2, CP2 x FSDP2
#   phase B: the 8B on 4 GPUs: FSDP4 eager, PP2 x FSDP2, FSDP4 + float8
#   phase C: in parallel, the 1B side by side with torchtitan (GPUs 0, 1), 8-bit/4-bit AdamW (GPU 2) and
#            profiled 1B runs (GPU 3); then the GPU tests on 4 GPUs and the 8B compiled side by side
#   phase D: the 1B side by side (GPUs 0, 1) and the GPU tests (GPUs 2-3) in parallel; then the 8B mesh
#            sweep over tp/pp/cp
#   phase E: the 4-GPU tests, the 8B with the chunked loss, the 8B checkpoint save/resume timings, then
#            the distributed rush on 4 GPUs (its 8B row takes the sweep's best mesh)
#   phase F: what phases C-E left: the checkpoint-resume GPU test (GPUs 2-3) beside a clean 1B side by
#            side (GPUs 0-1, swapped); then the distributed rush again with room for its 8B rung
#   phase G: the 1B side by side, swapped (GPUs 0-1), beside the checkpoint GPU tests and then both
#            trainers' 1B memory snapshots (GPUs 2-3); then the 8B PP2 x FSDP2 with a rank-0 snapshot.
#            Keeps the first half of the flash-attn wheels (.fa1, carried) in /tmp/fa for phase H.
#   phase H: flash-attn-4 installed from /tmp/fa + .fa2 + .fa3: the attention GPU tests with the package (GPU 0)
#            beside the 1B with each backend (GPUs 1-3); then the distributed rush
#   phase I: the 8B side by side, eager and float8 rows; TP2 x PP2 again; a profiled 8B FSDP4 step
#   phase J: after SDPA's grouped K/V (enable_gqa): the 1B side by side (GPUs 0-1) beside the attention and
#            context-parallel GPU tests (GPUs 2-3); then the 8B side by side, eager and compiled float8
#   phase K: the estimator against the 1B rows it predicts differently since grouped K/V: one GPU each for
#            the tied and the untied rows, GPUs 2-3 for the data-parallel ones
#   phase L: the estimator against the 1B ladder's SDPA and checkpointing rungs (GPU 0) beside the model
#            and attention GPU tests (GPU 1); then the 8B side by side, eager, compiled and float8
#   phase M: both trainers' 8B profiled (eager and compiled, torchtitan's AC policy), then the 8B best
#            settings (no AC) beside torchtitan's compiled and float8 rows
#   phase N: the 8B with the chunked loss's freed memory spent on fewer recomputed matmuls (eager and
#            compiled, within torchtitan's memory), and float8 without AC under ZeRO-2
#   phase O: the 1B rows side by side (GPUs 0-1) beside the 1B eager with the chunked loss (GPUs 2-3); the
#            8B eager with 30 blocks keeping every matmul; both trainers' compiled 8B profiled (synced)
#   phase P: the 8B best row again beside float8 for the output projection too
#   phase Q (2 GPUs): the host link's bandwidth (with HOST_LINK=1), the activation offload GPU tests, then the 8B compiled on
#            FSDP2 side by side (a proxy where 4 GPUs are not lent): torchtitan's AC policy, and the first
#            blocks offloaded paying for the last ones keeping every matmul output
#   phase R (2 GPUs): the offload GPU tests; a memory snapshot of an offload variant, its peak explained
#   phase S: the offload GPU tests, then the 8B compiled row side by side with every 3rd of the first 24
#            blocks offloaded and the last 13 or 14 keeping every matmul output
#   phase T: the chunked-loss and offload GPU tests, then the 8B compiled row side by side with the chunked
#            loss (gradients in forward) alone and with offload and the last 17 or 18 blocks keeping all
#   phase U: the 8B compiled float8 row side by side, the chunked loss with offload and the last 16-18
#            blocks keeping every matmul output
#   phase V: both compiled rows again: offload with the last 18 or 20 blocks keeping all (bf16); float8
#            with the chunked loss and the last 6 keeping all, or every 6th of the first 24 offloaded
#   phase W: the compiled row's offload variants with each rank bound to its GPU's NUMA node (last 18, 20,
#            21 keeping all), and float8 with the chunked loss and the last 5 keeping all
#   phase X (1 GPU): the 1B eager with the plain and the chunked loss, and the estimator's chunked row
#   phase Y: pinning speed (4 processes at once, cudaHostAlloc vs malloc + register), the loss GPU tests
#            and the early release of FSDP's reduce-scatter inputs (2 GPUs); then the compiled float8 row
#            with the chunked loss and the last 6, 8 or 9 blocks keeping all. Keeps .fa1 in /tmp/fa.
#   phase Z: flash-attn-4 from /tmp/fa + .fa2 + .fa3 (carry both; REPEATS=N side-by-side runs); the best row (float8, no AC, ZeRO-2) with cuDNN's and with
#            flash-attn's attention beside torchtitan's float8 row; the package's GPU tests
#   phase AA: the compiled row's offload variant with pinning by register threads and by cudaHostAlloc,
#            and with more blocks keeping all (time to first step, speed, memory)
#   phase AC: the compiled row's offload variant alone: a rank-0 memory snapshot (what sets reserved), then
#            a profiled step beside the chunked loss at torchtitan's policy (where a slow machine's time goes)
#   phase AD: the GPU tests of FSDP's memory changes, then a compiled row (ROW, default 8b_compile) with the
#            sharded gradients in the compute pool and 6, 14 or 18 blocks keeping every matmul, no offload
#   phase AE (with .fa1 carried): the GPU tests of FSDP's memory changes (early release, gradients in the
#            compute pool); keeps .fa1 in /tmp/fa
#   phase AF (with .fa2 + .fa3 carried, same machine): flash-attn-4 installed; the compiled float8 row with
#            the gradients in the compute pool, flash-attn-4's attention and/or 2,048-token loss chunks
#   phase AG (1 GPU, .fa2 + .fa3 carried after a call that copied .fa1 to /tmp/fa): flash-attn-4 as
#            titanrush's operator: the flash GPU tests, then the 1B compiled with selective op AC, cuDNN
#            against flash-attn-4 (twice: the second run loads FA4's cached kernels)
#   phase AH (with .whl + .fa1 carried): keeps .fa1 in /tmp/fa for AF or Z; the compiled float8 row with
#            empty compile caches for every run (time to first step as on a fresh machine): torchtitan,
#            titanrush with its compile workers started at launch (change 23) and with inductor's own pool
#   phase STAGE (with .whl + .fa1 carried): only keeps .fa1 in /tmp/fa (and the wheels in /tmp/site)
#   phase AI (with .fa2 + .fa3 carried after STAGE): the compiled float8 row with flash-attn-4 and the last
#            14 or 16 blocks keeping all; the best row with flash-attn-4 inside and between the graphs
#            (STAGE with COPY_IN=1 also times FSDP's reduce-scatter copy-in, scripts/bench_copy_in.py)
#   phase AJ (with .fa2 + .fa3 carried after STAGE): the best row with the copy-in by chunks (change 25) and
#            with chunk_cat; the float8 row with one AC policy (all but w3) and the last 24 blocks keeping
#            their gathered weights (change 26) beside the last 16 keeping all
#   phase AK (after AJ, same machine): the float8 row's two settings from empty compile caches
#   phase AL (with .fa2 + .fa3 carried after STAGE): the float8 row's one-policy setting from empty caches
#            (flash-attn imported beside the set-up); the best row; the best row with inductor's
#            coordinate-descent tuning (titanrush alone)
#   phase AN (with .fa2 + .fa3 carried after STAGE; ran at fc8e4c2, whose variant `_synced` was removed with
#            the change it measured): the best row with each step's line written once the next step is
#            launched and with the wait for each step's loss; a two-step trace of the best row with its
#            longest stretches without compute
#   phase AP (with .fa2 + .fa3 carried after STAGE): flash-attn-4 on grouped against repeated K/V heads
#            (scripts/bench_flash_gqa.py, one GPU); the best row with NCCL's collectives on fewer SMs
#   phase AO (after AN, same machine): the float8 row's one-policy setting from empty caches, the set-up
#            stages split finer
#   phase AQ (with .fa2 + .fa3 carried after STAGE): the optimizer step unit by unit beside the next forward
#            (change 29) on the best row and on the float8 row's one-policy setting
#   phase AR (after AQ, same machine): its GPU test (2 GPUs); a two-step trace of the best row with it
#   phase AS (with .fa2 + .fa3 carried after STAGE, a fresh machine): time to first step from empty caches,
#            flash-attn-4's included, with its kernels compiled beside the set-up (change 30): the best
#            row (with the overlapped step) and the float8 row's one-policy setting, also with the
#            overlapped step (its gradients freed unit by unit, change 31); then the warm-up's GPU test
#            (first run: the overlapped step's GPU test; then NCCL's communicators started lazily, change 32;
#            then FA4's kernels compiled by a child process, change 33, and the best row inside the graph;
#            then that child started at launch, change 34; its log written to $OUT as the runs go; with
#            .prof carried, rank 0 of each run sampled by py-spy into $S/pyspy_as$AS_TAG, for
#            scripts/startup_profile/summarize.py)
# Usage (on the device machine, from the repo root): bash scripts/gpu_suite.sh A|B   (results under $OUT)
set -u
PHASE=${1:?phase A to AS, or STAGE}
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export TITANRUSH_COMMIT=${TITANRUSH_COMMIT:-unknown}
OUT=${OUT:-/tmp/out}
S=/tmp/suite  # every phase's logs and run folders
mkdir -p "$OUT" $S
if [ -d .whl ]; then  # (a later call on the same machine may carry other files: /tmp/site stays)
  python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD
fi
[ -d .whl ] || [ ! -d /tmp/site ] || export PYTHONPATH=/tmp/site:$PWD
export PYTHONPATH=${PYTHONPATH:-$PWD}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader > $S/env.txt

# The first half of the flash-attn wheels (.fa1, carried by this call) kept for a later call's install_flash.
keep_fa1() { mkdir -p /tmp/fa && cp .fa1/* /tmp/fa/ 2>/dev/null; }
# The GPU tests of FSDP's memory changes (early release, gradients in the compute pool) on GPUs 0-1.
pool_tests() {
  CUDA_VISIBLE_DEVICES=0,1 timeout 200 python3 -m pytest tests/gpu/test_parallel_gpu.py -k "early_release or compute_pool" \
     -q -rs -s -p no:cacheprovider > "$OUT/gpu_tests_pool.txt" 2>&1
}
# flash-attn-4 from /tmp/fa (.fa1, kept by an earlier phase of the same machine) + .fa2 + .fa3 (carried):
# every wheel in one install, since a second `pip --target` skips the folders that exist; the cutlass
# DSL's packages folder on the path by hand (its wheel's .pth, which --target does not run).
install_flash() {
  if [ -d /tmp/fasite/flash_attn ]; then  # installed by an earlier call on this machine
    export PYTHONPATH=/tmp/fasite/nvidia_cutlass_dsl/dsl_packages:/tmp/fasite:$PYTHONPATH; return
  fi
  cp .fa2/* .fa3/* /tmp/fa/ && [ -f /tmp/fa/cu13.part1 ] && cat /tmp/fa/cu13.part1 /tmp/fa/cu13.part2 > /tmp/fa/$(cat /tmp/fa/cu13.name) \
    && (cd /tmp/fa && sha256sum -c cu13.sha256) > $S/flash_install.txt 2>&1
  rm -f /tmp/fa/cu13.part* && rm -rf /tmp/fasite
  python3 -m pip install --no-index --no-deps --target /tmp/fasite /tmp/fa/*.whl >> $S/flash_install.txt 2>&1
  export PYTHONPATH=/tmp/fasite/nvidia_cutlass_dsl/dsl_packages:/tmp/fasite:$PYTHONPATH
  python3 -c "import flash_attn.cute as f; print('flash_attn.cute', f.flash_attn_func)" >> $S/flash_install.txt 2>&1
}
python3 -c "import torch; print('torch', torch.__version__)" >> $S/env.txt

B1="--config train_configs/llama1b_single.toml"
B8="--config train_configs/llama8b_fsdp.toml --training.steps 10"
bench() {  # bench SECONDS OUTDIR NGPU STEPS WARMUP --run ... : one bench_runs.py call, its log beside it
  local limit=$1 out=$2 ngpu=$3 steps=$4 warmup=$5; shift 5
  timeout "$limit" python3 scripts/bench_runs.py --out "$S/$out" --ngpu "$ngpu" --steps "$steps" --warmup "$warmup" "$@" \
    > "$S/$out.log" 2>&1
  cp "$S/$out/results.md" "$OUT/$out.md" 2>/dev/null
}
if [ "$PHASE" = A ]; then
  # Stage 1, in parallel: the 1B single-GPU figures on GPUs 0 and 1, the GPU tests on GPUs 2-3.
  (CUDA_VISIBLE_DEVICES=2,3 timeout 300 python3 -m pytest tests/gpu -q -p no:cacheprovider \
     > $S/gpu_tests.txt 2>&1; cp $S/gpu_tests.txt "$OUT/") &
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
elif [ "$PHASE" = C ]; then
  (CUDA_VISIBLE_DEVICES=0,1 timeout 330 python3 scripts/side_by_side.py --out $S/sbs1b --gpus 0,1 --repeats 1 \
     --rows 1b_eager,1b_compile,1b_compile_float8,1b_compile_b16 --steps 30 --measure-from 15 \
     > $S/sbs1b.log 2>&1; cp $S/sbs1b/results.md "$OUT/sbs1b.md") &
  (CUDA_VISIBLE_DEVICES=2 bench 320 b1_optim 1 14 5 \
    --run "compile_fused_adamw: $B1" \
    --run "compile_adamw8bit: $B1 --optimizer.name adamw8bit" \
    --run "compile_adamw4bit: $B1 --optimizer.name adamw4bit") &
  PROF="--profiling.enable --profiling.freq 10 --profiling.active_steps 2"
  CUDA_VISIBLE_DEVICES=3 bench 320 b1_prof 1 12 5 \
    --run "eager_profiled: $B1 --no-compile.enable --model.tie_embeddings untied $PROF" \
    --run "compile_profiled: $B1 --model.tie_embeddings untied $PROF"
  wait
  for f in $S/b1_prof/runs/*/profile/step-*/rank0.summary.txt; do
    echo "== $f"; cat "$f"; done > "$OUT/profiles.txt" 2>/dev/null
  timeout 200 python3 -m pytest tests/gpu -q -p no:cacheprovider -k "tp or four or 4gpu" > $S/gpu_tests.txt 2>&1
  cp $S/gpu_tests.txt "$OUT/"
  # torchtitan's per-op AC keeps every other matmul: our `alternate` variant is the same policy.
  timeout 280 python3 scripts/side_by_side.py --out $S/sbs8b --rows 8b_compile --variants ac_alternate \
     --steps 16 --measure-from 8 --timeout-per-run 140 > $S/sbs8b.log 2>&1; cp $S/sbs8b/results.md "$OUT/sbs8b.md"
elif [ "$PHASE" = D ]; then
  (CUDA_VISIBLE_DEVICES=0,1 timeout 260 python3 scripts/side_by_side.py --out $S/sbs1b --gpus 0,1 --repeats 1 \
     --rows 1b_eager,1b_compile,1b_compile_float8,1b_compile_b16 --steps 24 --measure-from 12 \
     --timeout-per-run 120 > $S/sbs1b.log 2>&1; cp $S/sbs1b/results.md "$OUT/sbs1b.md") &
  CUDA_VISIBLE_DEVICES=2,3 timeout 250 python3 -m pytest tests/gpu -q -rs -p no:cacheprovider \
    > $S/gpu_tests.txt 2>&1; cp $S/gpu_tests.txt "$OUT/"
  wait
  timeout 330 python3 -m titanrush.cli sweep --config train_configs/llama8b_fsdp.toml --ngpu 4 \
    --grid "tp=1,2 pp=1,2 cp=1,2" --steps 6 --warmup 2 --gpu-mem 139.8 --timeout 75 \
    --output $S/sweep8b > $S/sweep8b.log 2>&1
  cp $S/sweep8b/results.md "$OUT/sweep8b.md"; cp $S/sweep8b/sweep.png "$OUT/sweep8b.png"
  cp $S/sweep8b/results.jsonl "$OUT/sweep8b.jsonl"
elif [ "$PHASE" = B ]; then
  bench 290 b8_b 4 10 4 \
    --run "fsdp4_eager: $B8 --no-compile.enable" \
    --run "pp2_fsdp2_compile: $B8 --parallelism.pp 2 --training.local_batch_size 4" \
    --run "fsdp4_compile_float8: $B8 --float8.enable"
elif [ "$PHASE" = F ]; then
  (CUDA_VISIBLE_DEVICES=2,3 timeout 200 python3 -m pytest tests/gpu/test_checkpoint_gpu.py -q -rs \
     -p no:cacheprovider > $S/gpu_tests_ckpt.txt 2>&1; cp $S/gpu_tests_ckpt.txt "$OUT/") &
  CUDA_VISIBLE_DEVICES=0,1 timeout 300 python3 scripts/side_by_side.py --out $S/sbs1b --gpus 0,1 --repeats 2 \
     --rows 1b_eager,1b_compile --steps 24 --measure-from 12 --timeout-per-run 120 > $S/sbs1b.log 2>&1
  cp $S/sbs1b/results.md "$OUT/sbs1b.md"
  wait
  timeout 280 python3 -m titanrush.cli rush dist --ngpu 4 --steps 10 --warmup 4 --timeout 90 \
    --sweep-results docs/benchmarks/sweep/sweep8b_h200x4.jsonl --output $S/rushdist > $S/rushdist.log 2>&1
  cp $S/rushdist/report.md "$OUT/rushdist.md"; cp $S/rushdist/results.jsonl "$OUT/rushdist.jsonl"
elif [ "$PHASE" = G ]; then
  keep_fa1
  (CUDA_VISIBLE_DEVICES=2,3 timeout 270 python3 -m pytest tests/gpu/test_checkpoint_gpu.py -q -rs \
     -p no:cacheprovider > $S/gpu_tests_ckpt.txt 2>&1; cp $S/gpu_tests_ckpt.txt "$OUT/"
   timeout 120 python3 scripts/side_by_side.py --out $S/snap1b --gpus 2,3 --repeats 1 --rows 1b_compile \
     --steps 8 --measure-from 4 --memory-snapshot 6 --timeout-per-run 100 > $S/snap1b.log 2>&1
   for f in $(find $S/snap1b -name '*.pickle'); do echo "== $f"; timeout 60 python3 scripts/memory_peak.py "$f"; done \
     > $S/mem_peaks.txt 2>&1) &
  CUDA_VISIBLE_DEVICES=0,1 timeout 390 python3 scripts/side_by_side.py --out $S/sbs1b --gpus 0,1 --repeats 2 \
     --rows 1b_eager,1b_compile,1b_compile_float8,1b_compile_b16 --steps 20 --measure-from 10 \
     --timeout-per-run 100 > $S/sbs1b.log 2>&1
  cp $S/sbs1b/results.md "$OUT/sbs1b.md"
  wait
  SNAP="--profiling.enable --profiling.memory_snapshot --profiling.freq 5 --profiling.active_steps 1"
  bench 130 b8_pp2snap 4 6 2 --run "pp2_fsdp2_snapshot: $B8 --parallelism.pp 2 --parallelism.dp_shard 2 $SNAP"
  for f in $(find $S/b8_pp2snap -name '*rank0.pickle'); do echo "== $f"; timeout 90 python3 scripts/memory_peak.py "$f"; done \
    >> $S/mem_peaks.txt 2>&1
  cp $S/mem_peaks.txt "$OUT/"; cp $S/snap1b/results.md "$OUT/snap1b.md" 2>/dev/null
elif [ "$PHASE" = H ]; then
  install_flash
  (CUDA_VISIBLE_DEVICES=0 timeout 300 python3 -m pytest tests/gpu/test_attention_gpu.py -q -rs -s \
     -p no:cacheprovider > $S/gpu_tests_flash.txt 2>&1; cp $S/gpu_tests_flash.txt "$OUT/") &
  (CUDA_VISIBLE_DEVICES=1 bench 300 b1_flash_c 1 14 5 --run "compile_flash: $B1 --model.attn_backend flash" \
     --run "eager_flash: $B1 --no-compile.enable --model.attn_backend flash") &
  (CUDA_VISIBLE_DEVICES=2 bench 300 b1_sdpa_c 1 14 5 --run "compile_sdpa: $B1" \
     --run "eager_sdpa: $B1 --no-compile.enable") &
  CUDA_VISIBLE_DEVICES=3 bench 300 b1_cudnn_c 1 14 5 --run "compile_cudnn: $B1 --model.attn_backend cudnn" \
     --run "eager_cudnn: $B1 --no-compile.enable --model.attn_backend cudnn"
  wait
  cat $S/flash_install.txt $OUT/b1_flash_c.md $OUT/b1_sdpa_c.md $OUT/b1_cudnn_c.md > $S/b1_backends.md 2>/dev/null
  rm -f $OUT/b1_*_c.md; cp $S/b1_backends.md "$OUT/"
  timeout 340 python3 -m titanrush.cli rush dist --ngpu 4 --steps 10 --warmup 4 --timeout 90 \
    --sweep-results docs/benchmarks/sweep/sweep8b_h200x4.jsonl --output $S/rushdist > $S/rushdist.log 2>&1
  cp $S/rushdist/report.md "$OUT/rushdist.md"; cp $S/rushdist/results.jsonl "$OUT/rushdist.jsonl"
  cp $S/rushdist/*.png "$OUT/" 2>/dev/null
elif [ "$PHASE" = I ]; then
  timeout 330 python3 scripts/side_by_side.py --out $S/sbs8b --rows 8b_eager,8b_compile_float8 \
     --steps 14 --measure-from 7 --timeout-per-run 100 > $S/sbs8b.log 2>&1; cp $S/sbs8b/results.md "$OUT/sbs8b.md"
  PROF="--profiling.enable --profiling.freq 8 --profiling.active_steps 2"
  bench 200 b8_i 4 10 4 --run "tp2_pp2_compile: $B8 --parallelism.dp_shard 1 --parallelism.tp 2 --parallelism.pp 2" \
     --run "fsdp4_compile_profiled: $B8 $PROF"
  for f in $S/b8_i/runs/*/profile/step-*/rank0.summary.txt; do echo "== $f"; cat "$f"; done > "$OUT/profiles8b.txt" 2>/dev/null
elif [ "$PHASE" = J ]; then
  (CUDA_VISIBLE_DEVICES=2,3 timeout 150 python3 -m pytest tests/gpu/test_attention_gpu.py \
     tests/gpu/test_context_parallel_gpu.py -q -rs -p no:cacheprovider > $S/gpu_tests_j.txt 2>&1
   cp $S/gpu_tests_j.txt "$OUT/") &
  CUDA_VISIBLE_DEVICES=0,1 timeout 170 python3 scripts/side_by_side.py --out $S/sbs1b --gpus 0,1 --repeats 1 \
     --rows 1b_eager,1b_compile,1b_compile_float8 --steps 20 --measure-from 10 --timeout-per-run 80 \
     > $S/sbs1b.log 2>&1; cp $S/sbs1b/results.md "$OUT/sbs1b.md"
  wait
  timeout 330 python3 scripts/side_by_side.py --out $S/sbs8b --rows 8b_eager,8b_compile_float8 \
     --steps 14 --measure-from 7 --timeout-per-run 100 > $S/sbs8b.log 2>&1; cp $S/sbs8b/results.md "$OUT/sbs8b.md"
elif [ "$PHASE" = K ]; then
  V="timeout 200 python3 scripts/validate_estimator.py --steps 8 --gpu-mem 139.8"
  R="--model.flavor 1B --data.dataset synthetic --training.seq_len 2048 --training.local_batch_size 4"
  R="$R --training.precision bf16 --optimizer.implementation fused --compile.enable true --training.global_batch_size -1"
  (CUDA_VISIBLE_DEVICES=0 $V --out $S/val_tied --run "tied fused: $B1" \
     --run "tied adamw8bit: $B1 --optimizer.name adamw8bit" --run "tied adamw4bit: $B1 --optimizer.name adamw4bit" \
     > $S/val_tied.log 2>&1) &
  (CUDA_VISIBLE_DEVICES=1 $V --out $S/val_untied --run "untied eager: $B1 --model.tie_embeddings untied --no-compile.enable" \
     --run "untied compiled: $B1 --model.tie_embeddings untied" \
     --run "untied float8: $B1 --model.tie_embeddings untied --float8.enable" \
     --run "untied batch 16: $B1 --model.tie_embeddings untied --training.local_batch_size 16" > $S/val_untied.log 2>&1) &
  CUDA_VISIBLE_DEVICES=2,3 $V --out $S/val_dp --run "one GPU @1: $R" \
     --run "DDP @2: $R --parallelism.dp_replicate 2 --parallelism.dp_shard 1" \
     --run "ZeRO-2 @2: $R --parallelism.dp_shard 2 --parallelism.fsdp_reshard_after_forward never" \
     --run "ZeRO-3 @2: $R --parallelism.dp_shard 2 --parallelism.fsdp_reshard_after_forward always" > $S/val_dp.log 2>&1
  wait
  cat $S/val_tied/validation.md $S/val_untied/validation.md $S/val_dp/validation.md > "$OUT/validation.md" 2>/dev/null
elif [ "$PHASE" = L ]; then
  L="--model.flavor 1B --data.dataset synthetic --training.seq_len 2048 --training.precision bf16"
  L="$L --model.attn_backend sdpa --optimizer.implementation fused --float8.enable false --training.global_batch_size -1"
  (CUDA_VISIBLE_DEVICES=1 timeout 150 python3 -m pytest tests/gpu/test_attention_gpu.py tests/gpu/test_float8_gpu.py \
     -q -rs -p no:cacheprovider > $S/gpu_tests_l.txt 2>&1; cp $S/gpu_tests_l.txt "$OUT/") &
  CUDA_VISIBLE_DEVICES=0 timeout 240 python3 scripts/validate_estimator.py --steps 8 --gpu-mem 139.8 --out $S/val_ladder \
     --run "ladder sdpa: $L --training.local_batch_size 1 --compile.enable false --activation_checkpoint.mode none" \
     --run "ladder ac-selective: $L --training.local_batch_size 16 --compile.enable true --activation_checkpoint.mode selective" \
     --run "ladder ac-full: $L --training.local_batch_size 16 --compile.enable true --activation_checkpoint.mode full" \
     > $S/val_ladder.log 2>&1; cp $S/val_ladder/validation.md "$OUT/validation_ladder.md"
  wait
  timeout 330 python3 scripts/side_by_side.py --out $S/sbs8b --rows 8b_eager,8b_compile,8b_compile_float8 \
     --variants ac_alternate --steps 14 --measure-from 7 --timeout-per-run 100 > $S/sbs8b.log 2>&1
  cp $S/sbs8b/results.md "$OUT/sbs8b.md"
elif [ "$PHASE" = M ]; then
  # Both trainers' 8B at torchtitan's AC policy, eager and compiled, with a trace of step 9 of 10 each.
  timeout 290 python3 scripts/side_by_side.py --out $S/sbs8b_prof --rows 8b_eager,8b_compile --variants ac_alternate \
     --steps 10 --measure-from 5 --profile 9 --timeout-per-run 110 > $S/sbs8b_prof.log 2>&1
  cp $S/sbs8b_prof/profiles.txt "$OUT/profiles8b.txt"; cp $S/sbs8b_prof/results.md "$OUT/sbs8b_prof.md"
  # Best settings for the same global batch: no activation checkpointing (the estimator: 116 GiB bf16,
  # 91 GiB float8), beside torchtitan's compiled and float8 rows.
  timeout 280 python3 scripts/side_by_side.py --out $S/sbs8b_best --rows 8b_compile,8b_compile_float8 \
     --variants ac_none --steps 12 --measure-from 6 --timeout-per-run 100 > $S/sbs8b_best.log 2>&1
  cp $S/sbs8b_best/results.md "$OUT/sbs8b_best.md"
elif [ "$PHASE" = N ]; then
  # 8B eager: the chunked loss's freed memory (torchtitan keeps fp32 logits) spent on keeping matmul outputs.
  timeout 230 python3 scripts/side_by_side.py --out $S/sbs8b_lean --rows 8b_eager --variants chunked_all,chunked_last24 \
     --steps 12 --measure-from 6 --timeout-per-run 75 > $S/sbs8b_lean.log 2>&1; cp $S/sbs8b_lean/results.md "$OUT/sbs8b_lean.md"
  # 8B compiled: a 1k-token chunked loss buys 4 blocks that keep every matmul output.
  timeout 150 python3 scripts/side_by_side.py --out $S/sbs8b_c --rows 8b_compile --variants chunked1k_last4 \
     --steps 12 --measure-from 6 --timeout-per-run 75 > $S/sbs8b_c.log 2>&1; cp $S/sbs8b_c/results.md "$OUT/sbs8b_c.md"
  # 8B best: float8 without activation checkpointing, weights kept gathered after forward (ZeRO-2).
  timeout 150 python3 scripts/side_by_side.py --out $S/sbs8b_z2 --rows 8b_compile_float8 --variants ac_none_zero2 \
     --steps 12 --measure-from 6 --timeout-per-run 75 > $S/sbs8b_z2.log 2>&1; cp $S/sbs8b_z2/results.md "$OUT/sbs8b_z2.md"
elif [ "$PHASE" = O ]; then
  SB="timeout 260 python3 scripts/side_by_side.py --repeats 1 --steps 20 --measure-from 10 --timeout-per-run 80"
  (CUDA_VISIBLE_DEVICES=0,1 $SB --out $S/sbs1b --gpus 0,1 --rows 1b_eager,1b_compile,1b_compile_float8,1b_compile_b16 \
     > $S/sbs1b.log 2>&1; cp $S/sbs1b/results.md "$OUT/sbs1b.md") &
  CUDA_VISIBLE_DEVICES=2,3 $SB --out $S/sbs1b_lean --gpus 2,3 --rows 1b_eager --variants chunked > $S/sbs1b_lean.log 2>&1
  cp $S/sbs1b_lean/results.md "$OUT/sbs1b_lean.md"
  wait
  timeout 130 python3 scripts/side_by_side.py --out $S/sbs8b_l30 --rows 8b_eager --variants chunked_last30 \
     --steps 12 --measure-from 6 --timeout-per-run 65 > $S/sbs8b_l30.log 2>&1; cp $S/sbs8b_l30/results.md "$OUT/sbs8b_l30.md"
  timeout 170 python3 scripts/side_by_side.py --out $S/sbs8b_prof --rows 8b_compile --variants ac_alternate \
     --steps 10 --measure-from 5 --profile 9 --timeout-per-run 85 > $S/sbs8b_prof.log 2>&1
  cp $S/sbs8b_prof/profiles.txt "$OUT/profiles8b.txt"
elif [ "$PHASE" = P ]; then
  timeout 280 python3 scripts/side_by_side.py --out $S/sbs8b_best2 --rows 8b_compile_float8 \
     --variants ac_none_zero2,f8out_none_zero2 --steps 12 --measure-from 6 --timeout-per-run 85 > $S/sbs8b_best2.log 2>&1
  cp $S/sbs8b_best2/results.md "$OUT/sbs8b_best2.md"
elif [ "$PHASE" = Q ]; then
  if [ -n "${HOST_LINK:-}" ]; then
    CUDA_VISIBLE_DEVICES=0 timeout 40 python3 scripts/host_link.py > $S/host_link.txt 2>&1; cp $S/host_link.txt "$OUT/"
  fi
  CUDA_VISIBLE_DEVICES=0 timeout 100 python3 -m pytest tests/gpu/test_activation_offload_gpu.py -q -rs -s \
     -p no:cacheprovider > $S/gpu_tests_offload.txt 2>&1; cp $S/gpu_tests_offload.txt "$OUT/"
  timeout 440 python3 scripts/side_by_side.py --out $S/sbs8b_off --rows 8b_compile --ngpu 2 \
     --variants ${VARIANTS:-ac_alternate,off24e3_last14,off24e2_last20,off30e2_last32} --steps 12 --measure-from 6 --timeout-per-run 100 \
     > $S/sbs8b_off.log 2>&1
  cp $S/sbs8b_off/results.md "$OUT/sbs8b_off.md"
elif [ "$PHASE" = R ]; then  # 2 GPUs: where the offload variant's peak comes from
  CUDA_VISIBLE_DEVICES=0 timeout 100 python3 -m pytest tests/gpu/test_activation_offload_gpu.py -q -rs -s \
     -p no:cacheprovider > $S/gpu_tests_offload.txt 2>&1; cp $S/gpu_tests_offload.txt "$OUT/"
  timeout 200 python3 scripts/side_by_side.py --out $S/sbs8b_offsnap --rows 8b_compile --ngpu 2 --trainers titanrush \
     --variants off24e3_last11 --steps 5 --measure-from 3 --memory-snapshot 4 --timeout-per-run 180 > $S/sbs8b_offsnap.log 2>&1
  snap=$(find $S/sbs8b_offsnap -name "step-4-rank0.pickle" | head -1)
  python3 scripts/memory_peak.py "$snap" --top 30 > "$OUT/offsnap_peak.txt" 2>&1
  rm -f $S/sbs8b_offsnap/tr_dump/*/memory_snapshot/*.pickle
elif [ "$PHASE" = S ]; then  # 4 GPUs: the issue's 8B compiled row with activation offload
  CUDA_VISIBLE_DEVICES=0 timeout 60 python3 -m pytest tests/gpu/test_activation_offload_gpu.py -q -rs -s \
     -p no:cacheprovider > $S/gpu_tests_offload.txt 2>&1; cp $S/gpu_tests_offload.txt "$OUT/"
  timeout 250 python3 scripts/side_by_side.py --out $S/sbs8b_off4 --rows 8b_compile \
     --variants off24e3_last13,off24e3_last14 --steps 12 --measure-from 6 --timeout-per-run 80 > $S/sbs8b_off4.log 2>&1
  cp $S/sbs8b_off4/results.md "$OUT/sbs8b_off4.md"
elif [ "$PHASE" = T ]; then  # 4 GPUs: the chunked loss's freed memory on the compiled row
  CUDA_VISIBLE_DEVICES=0 timeout 100 python3 -m pytest tests/gpu/test_loss_gpu.py \
     tests/gpu/test_activation_offload_gpu.py -q -rs -s -p no:cacheprovider > $S/gpu_tests_loss.txt 2>&1
  cp $S/gpu_tests_loss.txt "$OUT/"
  timeout 400 python3 scripts/side_by_side.py --out $S/sbs8b_closs --rows 8b_compile \
     --variants ${VARIANTS:-chunked_alternate,c_off24e3_last17,c_off24e3_last18} --steps 12 --measure-from 6 \
     --timeout-per-run 85 > $S/sbs8b_closs.log 2>&1
  cp $S/sbs8b_closs/results.md "$OUT/sbs8b_closs.md"
elif [ "$PHASE" = U ]; then  # 4 GPUs: the same on the compiled float8 row
  timeout 420 python3 scripts/side_by_side.py --out $S/sbs8b_f8loss --rows 8b_compile_float8 \
     --variants ${VARIANTS:-c_off24e3_last16,c_off24e3_last17,c_off24e3_last18} --steps 12 --measure-from 6 \
     --timeout-per-run 90 > $S/sbs8b_f8loss.log 2>&1
  cp $S/sbs8b_f8loss/results.md "$OUT/sbs8b_f8loss.md"
elif [ "$PHASE" = V ]; then  # 4 GPUs: both compiled rows again, more blocks keeping every matmul output
  timeout 270 python3 scripts/side_by_side.py --out $S/sbs8b_v --rows 8b_compile \
     --variants c_off24e3_last18,c_off24e3_last20 --steps 12 --measure-from 6 --timeout-per-run 85 > $S/sbs8b_v.log 2>&1
  cp $S/sbs8b_v/results.md "$OUT/sbs8b_v.md"
  timeout 270 python3 scripts/side_by_side.py --out $S/sbs8b_f8v --rows 8b_compile_float8 \
     --variants c_last6,c_off24e6_last10 --steps 12 --measure-from 6 --timeout-per-run 85 > $S/sbs8b_f8v.log 2>&1
  cp $S/sbs8b_f8v/results.md "$OUT/sbs8b_f8v.md"
elif [ "$PHASE" = W ]; then  # 4 GPUs: offload with each rank bound to its GPU's NUMA node; float8 last 5
  (nvidia-smi topo -m; lscpu | grep -i numa) > "$OUT/topology.txt" 2>&1
  timeout 330 python3 scripts/side_by_side.py --out $S/sbs8b_w --rows 8b_compile \
     --variants c_off24e3_last20,c_off24e3_last18,c_off24e3_last21 --steps 12 --measure-from 6 \
     --timeout-per-run 85 > $S/sbs8b_w.log 2>&1
  cp $S/sbs8b_w/results.md "$OUT/sbs8b_w.md"
  timeout 180 python3 scripts/side_by_side.py --out $S/sbs8b_f8w --rows 8b_compile_float8 \
     --variants c_last5 --steps 12 --measure-from 6 --timeout-per-run 85 > $S/sbs8b_f8w.log 2>&1
  cp $S/sbs8b_f8w/results.md "$OUT/sbs8b_f8w.md"
elif [ "$PHASE" = Y ]; then  # 4 GPUs: pinning, the release GPU test, float8 with more blocks keeping all
  keep_fa1
  for m in default register8; do
    for g in 0 1 2 3; do CUDA_VISIBLE_DEVICES=$g timeout 90 python3 scripts/pin_bench.py --gib 12.5 --mode $m & done
    wait
  done > $S/pin_bench.txt 2>&1
  cp $S/pin_bench.txt "$OUT/"
  (CUDA_VISIBLE_DEVICES=0 timeout 150 python3 -m pytest tests/gpu/test_loss_gpu.py -q -rs -s -p no:cacheprovider \
     > $S/gpu_tests_loss.txt 2>&1) &
  CUDA_VISIBLE_DEVICES=2,3 timeout 200 python3 -m pytest tests/gpu/test_parallel_gpu.py -k early_release -q -rs -s \
     -p no:cacheprovider > $S/gpu_tests_release.txt 2>&1
  wait
  cat $S/gpu_tests_loss.txt $S/gpu_tests_release.txt > "$OUT/gpu_tests_y.txt"
  timeout 330 python3 scripts/side_by_side.py --out $S/sbs8b_f8y --rows 8b_compile_float8 \
     --variants ${VARIANTS:-c_last6,c_last8,c_last9} --steps 12 --measure-from 6 --timeout-per-run 85 \
     > $S/sbs8b_f8y.log 2>&1
  cp $S/sbs8b_f8y/results.md "$OUT/sbs8b_f8y.md"
elif [ "$PHASE" = Z ]; then  # 4 GPUs: flash-attn-4 on the best row
  install_flash
  cp $S/flash_install.txt "$OUT/"
  for r in $(seq 1 ${REPEATS:-1}); do  # each repeat with its own torchtitan run
    timeout 300 python3 scripts/side_by_side.py --out $S/sbs8b_best$r --rows 8b_compile_float8 \
       --variants ${VARIANTS:-ac_none_zero2,ac_none_zero2_flash} --steps 12 --measure-from 6 --timeout-per-run 120 \
       > $S/sbs8b_best$r.log 2>&1
    cp $S/sbs8b_best$r/results.md "$OUT/sbs8b_best$r.md"
  done
  CUDA_VISIBLE_DEVICES=0 timeout 120 python3 -m pytest tests/gpu/test_attention_gpu.py -k flash -q -rs \
     -p no:cacheprovider > "$OUT/gpu_tests_flash.txt" 2>&1
elif [ "$PHASE" = AA ]; then  # 4 GPUs: the compiled row's offload variant: pinning, more blocks keeping all
  if [ -n "${RELEASE_TEST:-}" ]; then
    CUDA_VISIBLE_DEVICES=0,1 timeout 150 python3 -m pytest tests/gpu/test_parallel_gpu.py -k early_release -q -rs -s \
       -p no:cacheprovider > "$OUT/gpu_tests_release.txt" 2>&1
  fi
  timeout 380 python3 scripts/side_by_side.py --out $S/sbs8b_aa --rows 8b_compile \
     --variants ${VARIANTS:-c_off24e3_last21,c_off24e3_last21_pin0,c_off24e3_last24} --steps 12 --measure-from 6 \
     --timeout-per-run 85 > $S/sbs8b_aa.log 2>&1
  cp $S/sbs8b_aa/results.md "$OUT/sbs8b_aa.md"
elif [ "$PHASE" = AD ]; then  # 4 GPUs: the sharded gradients in the compute pool (change 21)
  pool_tests
  timeout 330 python3 scripts/side_by_side.py --out $S/sbs8b_pool --rows ${ROW:-8b_compile} \
     --variants ${VARIANTS:-c_last6_pool,c_last14_pool,c_last18_pool} --steps 12 --measure-from 6 --timeout-per-run 85 \
     > $S/sbs8b_pool.log 2>&1
  cp $S/sbs8b_pool/results.md "$OUT/sbs8b_pool.md"
elif [ "$PHASE" = AE ]; then  # 2 GPUs: the GPU tests of FSDP's memory changes; keeps .fa1 in /tmp/fa for AF
  keep_fa1
  pool_tests
elif [ "$PHASE" = AF ]; then  # 4 GPUs: the compiled float8 row with the compute pool, flash-attn-4 and 2k chunks
  install_flash
  timeout 400 python3 scripts/side_by_side.py --out $S/sbs8b_af --rows 8b_compile_float8 \
     --variants ${VARIANTS:-c_last14_pool_flash,c2k_last16_pool_flash,c2k_last18_pool} --steps 12 --measure-from 6 \
     --timeout-per-run 95 > $S/sbs8b_af.log 2>&1
  cp $S/sbs8b_af/results.md "$OUT/sbs8b_af.md"
elif [ "$PHASE" = AH ]; then  # 4 GPUs: time to first step from empty compile caches; keeps .fa1 for AF/Z
  keep_fa1
  timeout 420 python3 scripts/side_by_side.py --out $S/sbs8b_cold --rows 8b_compile_float8 --fresh-compile-caches \
     --variants ${VARIANTS:-c_last16_pool,c_last16_pool_inductor_workers} --steps 10 --measure-from 5 \
     --timeout-per-run 130 > $S/sbs8b_cold.log 2>&1
  cp $S/sbs8b_cold/results.md "$OUT/sbs8b_cold.md"
elif [ "$PHASE" = STAGE ]; then  # .fa1 kept for a later call's install_flash
  keep_fa1 && ls /tmp/fa > "$OUT/staged.txt"
  if [ -n "${PYC_DIAG:-}" ]; then  # why every process compiles torch's sources (bytecode caching)
    (env | grep -i "^PYTHON"; python3 -c "import sys, importlib.util as u; s = u.find_spec('torch').origin
print('dont_write', sys.dont_write_bytecode, 'prefix', sys.pycache_prefix, 'torch', s)
import os; p = u.cache_from_source(s); print('pyc', p, os.path.exists(p), 'dir writable', os.access(os.path.dirname(s), os.W_OK))"
     ls -la "$(dirname "$(python3 -c "import importlib.util as u; print(u.find_spec('torch').origin)")")/__pycache__" 2>&1 | head -5
     TIMEFORMAT="import torch %R s"; for i in 1 2; do time python3 -c "import torch"; done
     TIMEFORMAT="import torch, prefix /tmp/pyc %R s"; for i in 1 2; do time PYTHONPYCACHEPREFIX=/tmp/pyc python3 -c "import torch"; done
    ) > "$OUT/pyc_diag.txt" 2>&1
  fi
  if [ -n "${COPY_IN:-}" ]; then  # FSDP's reduce-scatter copy-in at the 8B's shapes (change 25)
    CUDA_VISIBLE_DEVICES=0 timeout 60 python3 scripts/bench_copy_in.py > "$OUT/copy_in.md" 2>&1
  fi
elif [ "$PHASE" = AJ ]; then  # 4 GPUs, .fa2 + .fa3 after STAGE: changes 25-26 beside torchtitan's float8 row
  install_flash
  timeout 560 python3 scripts/side_by_side.py --out $S/sbs8b_aj --rows 8b_compile_float8 \
     --variants ${VARIANTS:-ac_none_zero2_flash_between,ac_none_zero2_flash_between_chunkcat,w3_keep24_pool_flash,c_last16_pool_flash} \
     --steps 12 --measure-from 6 --timeout-per-run 110 > $S/sbs8b_aj.log 2>&1
  cp $S/sbs8b_aj/results.md "$OUT/sbs8b_aj.md"
elif [ "$PHASE" = AK ]; then  # 4 GPUs, after AJ on the same machine: time to first step from empty caches
  install_flash
  timeout 560 python3 scripts/side_by_side.py --out $S/sbs8b_ak --rows 8b_compile_float8 --fresh-compile-caches \
     --variants ${VARIANTS:-w3_keep24_pool_flash,c_last16_pool_flash} --steps 10 --measure-from 5 \
     --timeout-per-run 130 > $S/sbs8b_ak.log 2>&1
  cp $S/sbs8b_ak/results.md "$OUT/sbs8b_ak.md"
elif [ "$PHASE" = AL ]; then  # 4 GPUs, .fa2 + .fa3 after STAGE: first step from empty caches with flash-attn
  install_flash                # imported beside the set-up; the best row again; inductor's coordinate descent
  timeout 200 python3 scripts/side_by_side.py --out $S/sbs8b_al --rows 8b_compile_float8 --fresh-compile-caches \
     --variants ${VARIANTS:-w3_keep24_pool_flash} --steps 10 --measure-from 5 --timeout-per-run 130 > $S/sbs8b_al.log 2>&1
  cp $S/sbs8b_al/results.md "$OUT/sbs8b_al.md"
  grep -h "set-up" $S/sbs8b_al/*.log > "$OUT/setup_lines.txt" 2>/dev/null
  timeout 200 python3 scripts/side_by_side.py --out $S/sbs8b_al2 --rows 8b_compile_float8 \
     --variants ac_none_zero2_flash_between --steps 12 --measure-from 6 --timeout-per-run 110 > $S/sbs8b_al2.log 2>&1
  cp $S/sbs8b_al2/results.md "$OUT/sbs8b_al2.md"
  TORCHINDUCTOR_COORDINATE_DESCENT_TUNING=1 timeout 150 python3 scripts/side_by_side.py --out $S/sbs8b_al3 \
     --rows 8b_compile_float8 --trainers titanrush --variants ac_none_zero2_flash_between --steps 12 --measure-from 6 \
     --timeout-per-run 140 > $S/sbs8b_al3.log 2>&1
  cp $S/sbs8b_al3/results.md "$OUT/sbs8b_al3.md"
elif [ "$PHASE" = AN ]; then  # 4 GPUs, .fa2 + .fa3 after STAGE: change 28 on the best row; its gaps
  install_flash
  timeout 330 python3 scripts/side_by_side.py --out $S/sbs8b_an --rows 8b_compile_float8 \
     --variants ${VARIANTS:-ac_none_zero2_flash_between,ac_none_zero2_flash_between_synced} --steps 14 --measure-from 6 \
     --timeout-per-run 110 > $S/sbs8b_an.log 2>&1
  cp $S/sbs8b_an/results.md "$OUT/sbs8b_an.md"
  timeout 150 python3 scripts/side_by_side.py --out $S/sbs8b_an2 --rows 8b_compile_float8 --trainers titanrush \
     --variants ac_none_zero2_flash_between --steps 12 --measure-from 6 --profile 10 --profile-steps 2 --gaps 30 \
     --timeout-per-run 130 > $S/sbs8b_an2.log 2>&1
  cp $S/sbs8b_an2/profiles.txt "$OUT/profiles_an.txt"
elif [ "$PHASE" = AQ ]; then  # 4 GPUs, .fa2 + .fa3 after STAGE: change 29
  install_flash
  V=ac_none_zero2_flash_between
  timeout 560 python3 scripts/side_by_side.py --out $S/sbs8b_aq --rows 8b_compile_float8 \
     --variants ${VARIANTS:-$V,${V}_overlap,w3_keep24_pool_flash,w3_keep24_pool_flash_overlap} --steps 14 \
     --measure-from 6 --timeout-per-run 110 > $S/sbs8b_aq.log 2>&1
  cp $S/sbs8b_aq/results.md "$OUT/sbs8b_aq.md"
elif [ "$PHASE" = AR ]; then  # 4 GPUs, after AQ: change 29's GPU test; the best row's trace with it
  install_flash
  CUDA_VISIBLE_DEVICES=0,1 timeout 300 python3 -m pytest tests/gpu/test_parallel_gpu.py -k "beside_the_forward" \
     -q -rs -s -p no:cacheprovider > "$OUT/gpu_tests_overlap.txt" 2>&1
  timeout 150 python3 scripts/side_by_side.py --out $S/sbs8b_ar --rows 8b_compile_float8 --trainers titanrush \
     --variants ac_none_zero2_flash_between_overlap --steps 12 --measure-from 6 --profile 10 --profile-steps 2 \
     --gaps 30 --timeout-per-run 130 > $S/sbs8b_ar.log 2>&1
  cp $S/sbs8b_ar/profiles.txt "$OUT/profiles_ar.txt"
elif [ "$PHASE" = AS ]; then  # 4 GPUs, .fa2 + .fa3 after STAGE on a fresh machine: change 30
  install_flash
  if ls .prof/py_spy-*.whl > /dev/null 2>&1; then  # rank 0 of every run sampled by py-spy (startup_profile)
    python3 -m pip install -q --no-index --no-deps --target /tmp/pyspy .prof/py_spy-*.whl
    export PY_SPY=/tmp/pyspy/bin/py-spy STARTUP_PROFILE_DIR=$S/pyspy_as${AS_TAG:-1}
    export PYTHONPATH=$PWD/scripts/startup_profile:$PYTHONPATH
    python3 -c "import sitecustomize as s; print('sitecustomize', s.__file__)" > "$OUT/pyspy_check.txt" 2>&1
  fi
  V=ac_none_zero2_flash_between_overlap,ac_none_zero2_flash_overlap,w3_keep24_pool_flash_overlap
  timeout 460 python3 scripts/side_by_side.py --out $S/sbs8b_as --rows 8b_compile_float8 --fresh-compile-caches \
     --variants ${VARIANTS:-$V} --steps 10 --measure-from 5 --timeout-per-run 130 > "$OUT/sbs8b_as.log" 2>&1
  cp $S/sbs8b_as/results.md "$OUT/sbs8b_as.md"
  grep -h "set-up\|flash-attn" $S/sbs8b_as/*.log > "$OUT/setup_lines.txt" 2>/dev/null
  grep -h "step      1 " $S/sbs8b_as/*.log >> "$OUT/setup_lines.txt" 2>/dev/null
  [ -n "${NO_TESTS:-}" ] || CUDA_VISIBLE_DEVICES=0 timeout 120 python3 -m pytest tests/gpu/test_attention_gpu.py \
     -k "warm_up" -q -rs -s -p no:cacheprovider > "$OUT/gpu_tests_warm_up.txt" 2>&1
elif [ "$PHASE" = AP ]; then  # 4 GPUs, .fa2 + .fa3 after STAGE
  install_flash
  CUDA_VISIBLE_DEVICES=0 timeout 150 python3 scripts/bench_flash_gqa.py > "$OUT/flash_gqa.md" 2>&1
  V=ac_none_zero2_flash_between
  timeout 440 python3 scripts/side_by_side.py --out $S/sbs8b_ap --rows 8b_compile_float8 \
     --variants ${VARIANTS:-$V,${V}_ctas8,${V}_ctas16,${V}_ctas4} --steps 14 --measure-from 6 \
     --timeout-per-run 110 > $S/sbs8b_ap.log 2>&1
  cp $S/sbs8b_ap/results.md "$OUT/sbs8b_ap.md"
elif [ "$PHASE" = AO ]; then  # 4 GPUs, after AN: first step from empty caches, the set-up's stages
  install_flash
  timeout 220 python3 scripts/side_by_side.py --out $S/sbs8b_ao --rows 8b_compile_float8 --fresh-compile-caches \
     --variants ${VARIANTS:-w3_keep24_pool_flash} --steps 10 --measure-from 5 --timeout-per-run 130 > $S/sbs8b_ao.log 2>&1
  cp $S/sbs8b_ao/results.md "$OUT/sbs8b_ao.md"
  grep -h "set-up\|flash-attn imported" $S/sbs8b_ao/*.log > "$OUT/setup_lines.txt" 2>/dev/null
elif [ "$PHASE" = AI ]; then  # 4 GPUs: flash-attn-4 on the float8 row and inside/between graphs on the best row
  install_flash
  cp $S/flash_install.txt "$OUT/" 2>/dev/null
  timeout 280 python3 scripts/side_by_side.py --out $S/sbs8b_f8fl --rows 8b_compile_float8 \
     --variants ${VARIANTS:-c_last14_pool_flash,c_last16_pool_flash} --steps 12 --measure-from 6 \
     --timeout-per-run 95 > $S/sbs8b_f8fl.log 2>&1
  cp $S/sbs8b_f8fl/results.md "$OUT/sbs8b_f8fl.md"
  timeout 280 python3 scripts/side_by_side.py --out $S/sbs8b_bestfl --rows 8b_compile_float8 \
     --variants ${BEST_VARIANTS:-ac_none_zero2_flash,ac_none_zero2_flash_between} --steps 12 --measure-from 6 \
     --timeout-per-run 95 > $S/sbs8b_bestfl.log 2>&1
  cp $S/sbs8b_bestfl/results.md "$OUT/sbs8b_bestfl.md"
elif [ "$PHASE" = AG ]; then  # 1 GPU, after a call that kept .fa1 in /tmp/fa: FA4 as titanrush's operator
  install_flash
  CUDA_VISIBLE_DEVICES=0 timeout 200 python3 -m pytest tests/gpu/test_attention_gpu.py -k flash -q -rs -s \
     -p no:cacheprovider > "$OUT/gpu_tests_flash.txt" 2>&1
  CUDA_VISIBLE_DEVICES=0 bench 260 b1_flash_op 1 12 4 \
    --run "cudnn_ac_op: $B1 --model.attn_backend cudnn --activation_checkpoint.mode selective" \
    --run "flash_ac_op: $B1 --model.attn_backend flash --activation_checkpoint.mode selective" \
    --run "flash_ac_op_again: $B1 --model.attn_backend flash --activation_checkpoint.mode selective"
elif [ "$PHASE" = AC ]; then  # 4 GPUs: the offload row's memory snapshot and a profiled step (titanrush alone)
  timeout 200 python3 scripts/side_by_side.py --out $S/snap_off --rows 8b_compile --trainers titanrush \
     --variants c_off24e3_last21 --steps 8 --measure-from 4 --memory-snapshot 6 --timeout-per-run 100 \
     > $S/snap_off.log 2>&1
  for f in $(find $S/snap_off -name '*rank0*.pickle'); do echo "== $f"; timeout 150 python3 scripts/memory_peak.py "$f"; done \
     > "$OUT/mem_peak_off.txt" 2>&1
  timeout 240 python3 scripts/side_by_side.py --out $S/prof_off --rows 8b_compile --trainers titanrush \
     --variants c_off24e3_last21,chunked_alternate --steps 10 --measure-from 5 --profile 9 --timeout-per-run 100 \
     > $S/prof_off.log 2>&1
  cp $S/prof_off/profiles.txt "$OUT/" 2>/dev/null
elif [ "$PHASE" = X ]; then  # 1 GPU: the chunked loss (change 15) on the 1B, eager: memory and speed
  bench 230 b1_closs 1 12 4 \
    --run "eager_plain: $B1 --training.local_batch_size 8 --compile.enable false" \
    --run "eager_chunked: $B1 --training.local_batch_size 8 --compile.enable false --training.loss chunked" \
    --run "full_chunked_b8: $B1 --training.local_batch_size 8 --compile.enable false --activation_checkpoint.mode full --training.loss chunked"
else  # E
  timeout 80 python3 -m pytest tests/gpu -q -rs -p no:cacheprovider -k 4gpu > $S/gpu_tests_4.txt 2>&1
  cp $S/gpu_tests_4.txt "$OUT/"
  bench 70 b8_loss 4 6 2 --run "fsdp4_compile_chunked_loss: $B8 --training.loss chunked"
  SWEEP=${SWEEP_RESULTS:-docs/benchmarks/sweep/sweep8b_h200x4.jsonl}
  shm=$(df --output=avail -BG /dev/shm 2>/dev/null | tail -1 | tr -dc 0-9)
  if [ "${shm:-0}" -gt 200 ]; then CK=/dev/shm/ckbench; else CK=/tmp/ckbench; fi
  df -h "$(dirname $CK)" > $S/ck_disk.txt
  timeout 210 python3 scripts/bench_checkpoint.py --config train_configs/llama8b_fsdp.toml --ngpu 4 \
    --folder $CK --out $S/ckbench_8b --time-limit 200 > $S/ckbench_8b.log 2>&1
  cp $S/ckbench_8b/results.md "$OUT/ckbench_8b.md"; rm -rf $CK
  timeout 230 python3 -m titanrush.cli rush dist --ngpu 4 --steps 12 --warmup 4 --timeout 60 \
    --sweep-results "$SWEEP" --output $S/rushdist > $S/rushdist.log 2>&1
  cp $S/rushdist/report.md "$OUT/rushdist.md"; cp $S/rushdist/results.jsonl "$OUT/rushdist.jsonl"
  cp $S/rushdist/*.png "$OUT/" 2>/dev/null
fi
cp $S/env.txt "$OUT/"
tar czf "$OUT/logs_$PHASE.tgz" --exclude='*.distcp' --exclude='compile_caches' --exclude='tb' --exclude='*.trace.json.gz' --exclude='*_trace.json' \
  --exclude='corpus' --exclude='tokenizer' --exclude='*.pickle' -C /tmp suite 2>/dev/null
cat "$OUT"/*.md "$OUT"/*.txt 2>/dev/null | tail -60
