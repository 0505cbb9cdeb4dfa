#!/usr/bin/env bash
# The GPU check in one GPU-machine call: the GPU tests, then titanrush beside torchtitan 0.2.2. From the
# repo root there: bash scripts/bench/gpu_check.sh [all|tests|bench|parity] [ROWS] [SETTINGS] (logs, results:
# $OUT, default /tmp/gpu_check). all: tests/gpu, then ROWS (default 1b); tests; bench: ROWS (default auto: the
# machine's row, see side_by_side.py); parity: ROWS (default auto: 1b, 1b_fsdp2 on 2 GPUs) in the parity mode
# (the same weights, batches and settings; STEPS 200; ABLATE=1 adds titanrush on torchtitan's schedule).
# ROWS, SETTINGS (same,defaults,best,auto) as side_by_side.py's. Environment: BASE=DIR (another checkout), STEPS,
# MEASURE_FROM, BUDGET (s, 540), ABLATE, TT_AC (torchtitan's AC settings, side_by_side.py's --tt-ac),
# TITANRUSH_COMMIT, TITANRUSH_BASE_COMMIT.
set -u
MODE=${1:-all}
[ "$MODE" = all ] && ROWS=${2:-1b} || ROWS=${2:-auto}
SETTINGS=${3:-same,defaults,best}
BUDGET=${BUDGET:-540}
OUT=${OUT:-/tmp/gpu_check}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
if ls .whl/*.whl > /dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl > "$OUT/pip.log" 2>&1 \
    && export PYTHONPATH=/tmp/site:$PWD
fi
export PYTHONPATH=${PYTHONPATH:-$PWD}
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python3 -c "import torch; print('torch', torch.__version__)"; } > "$OUT/env.txt" 2>&1

tests="not run"
if [ "$MODE" = all ] || [ "$MODE" = tests ]; then
  limit=$([ "$MODE" = tests ] && echo "$BUDGET" || echo 330)
  timeout "$limit" python3 -m pytest tests/gpu -q -rs -p no:cacheprovider > "$OUT/gpu_tests.log" 2>&1
  rc=$?
  tests="$(tail -1 "$OUT/gpu_tests.log") (exit $rc; log: $OUT/gpu_tests.log)"
fi
if [ "$MODE" = all ] || [ "$MODE" = bench ]; then
  left=$((BUDGET - SECONDS))
  [ "$left" -gt 1 ] || left=1
  timeout $((left + 30)) python3 scripts/bench/side_by_side.py --out "$OUT/bench" --rows "$ROWS" \
    --settings "$SETTINGS" --steps "${STEPS:-30}" --measure-from "${MEASURE_FROM:-10}" --time-limit "$left" \
    ${BASE:+--base "$BASE"} ${TT_AC:+--tt-ac "$TT_AC"} > "$OUT/bench.log" 2>&1
  echo "side_by_side.py exit $? (log: $OUT/bench.log)" >> "$OUT/env.txt"
fi
if [ "$MODE" = parity ]; then
  left=$((BUDGET - SECONDS))
  [ "$left" -gt 1 ] || left=1
  timeout $((left + 30)) python3 scripts/bench/side_by_side.py --parity --out "$OUT/parity" --rows "$ROWS" \
    --steps "${STEPS:-200}" --time-limit "$left" --timeout-per-run 420 ${ABLATE:+--ablate-schedule} \
    > "$OUT/parity.log" 2>&1
  echo "side_by_side.py --parity exit $? (log: $OUT/parity.log)" >> "$OUT/env.txt"
fi

echo "== $(tr '\n' ' ' < "$OUT/env.txt")"
echo "== GPU tests: $tests"
if [ -f "$OUT/bench/results.md" ]; then sed '/^Commands:/,$d' "$OUT/bench/results.md"; fi
if [ -f "$OUT/parity/parity.md" ]; then cat "$OUT/parity/parity.md"; else tail -n 20 "$OUT/parity.log" 2>/dev/null; fi
