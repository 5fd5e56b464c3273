#!/usr/bin/env bash
# The GPU suite: one command on a machine with a CUDA GPU, about 8 minutes on one H100.
#
#   bash scripts/gpu_suite.sh [DATA_DIR]
#
# 1. the CUDA-only tests (`pytest -m cuda`: bf16 and fp16 autocast over fp32 masters, the flash /
#    memory-efficient attention kernel, compile of checkpointed blocks, DDP and FSDP2 over NCCL);
# 2. `mmldlm bench` on the base preset: baseline vs optimized with the largest micro-batch of each
#    under the GPU's memory, then optimized vs compiled (padding to 64, then to 8); samples/s,
#    tokens/s, peak memory and MFU;
# 3. one markdown report, docs/benchmarks-gpu.md (REPORT=PATH to write elsewhere), with the date,
#    the device and the commands; the raw outputs stay in runs/gpu_suite (OUT_DIR=PATH).
#
# DATA_DIR is a prepared dataset; without it the first 50,000 samples of the bundled corpus are
# prepared into OUT_DIR/data (the sentence encoder runs on the GPU). MICRO (default 256) is the
# micro-batch = global batch of the speed comparison. Without CUDA it says so in one line, exit 0.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if ! "$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
    echo "gpu_suite: no CUDA device is visible to torch on this machine; nothing to run"
    exit 0
fi
OUT=${OUT_DIR:-runs/gpu_suite}
REPORT=${REPORT:-docs/benchmarks-gpu.md}
MICRO=${MICRO:-256}
DATA=${1:-$OUT/data}
mkdir -p "$OUT"
started=$(date +%s)
if [ ! -f "$DATA/meta.json" ]; then
    "$PY" -m mmldlm prepare --input default --max-samples 50000 --out "$DATA" --quiet || exit 1
fi
CAP=$("$PY" -c 'import torch; print(round(0.9 * torch.cuda.get_device_properties(0).total_memory / 2**30, 1))')
status=0

"$PY" -m pytest -m cuda -q -p no:cacheprovider tests 2>&1 | tee "$OUT/tests.log"
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1

B="model=base data.path=$DATA train.global_batch_size=$MICRO train.micro_batch_size=$MICRO"
"$PY" -m mmldlm bench $B --steps 10 --warmup 3 --memory-cap-gib "$CAP" --max-micro-batch 4096 \
    --out "$OUT/bench" || status=1
"$PY" -m mmldlm bench $B --baseline optimized --optimized compiled --steps 10 --warmup 6 --no-fit \
    --out "$OUT/compile" || status=1
# compile at the optimized preset's own padding (8: dynamic lengths after the first recompile),
# the case that decides whether compile can be the optimized preset's default on a GPU
"$PY" -m mmldlm bench $B data.pad_to_multiple=8 --baseline optimized --optimized compiled --steps 10 --warmup 8 \
    --no-fit --out "$OUT/compile-pad8" || status=1

"$PY" scripts/gpu_report.py --out "$REPORT" --tests "$OUT/tests.log" --seconds $(( $(date +%s) - started )) \
    "$OUT/bench" "$OUT/compile" "$OUT/compile-pad8" || status=1
echo "gpu_suite: wrote $REPORT (exit status $status)"
exit $status
