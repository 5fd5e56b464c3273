#!/usr/bin/env bash
# A short GPU lease spent on measurement only: one command, at most 10 minutes on one H100, in order
#
#   1. the CUDA-only tests (`pytest -m cuda`);
#   2. the older codebase's shape at full size (model=base-2k: 1024 wide, 24 blocks, texts of
#      600-2048 tokens, a 30,522-entry vocabulary, 32-d latents) on synthetic tokens, no corpus:
#      baseline vs optimized vs compiled at micro-batch 4 (with the largest micro-batch of each under
#      90% of the GPU's memory), then optimized vs compiled at micro-batch 8 (the baseline's largest
#      says whether it fits 8); samples/s, tokens/s, peak memory, MFU;
#   3. the base preset on the default data, compiled, at the micro-batch `auto` picks;
#   4. a first writing rung: the small preset trained on the default data for what the lease has
#      left (about 2 minutes; the budget below) and evaluated on 128 validation texts (t2l
#      retrieval@1, l2t word F1 and BLEU, with intervals), as scripts/writing_ladder.py measures it.
#
#   bash scripts/gpu_session.sh            # on the GPU machine
#   bash scripts/gpu_session.sh --cpu      # the same parts at tiny shapes on a CPU, seconds each
#
# The data of parts 3 and 4 is a prepared 50,000-text slice of the bundled corpus, made on a CPU
# beforehand and carried to the device (50.5 MiB; docs/benchmarks-gpu.md):
#
#   python -m mmldlm prepare --input default --max-samples 50000 --out runs/gpu-data
#
# DATA=DIR names another prepared dataset. Each part runs under its own timeout and appends its
# section to the report as soon as it ends (done, failed or cut off), so a lease that ends early
# still leaves every finished part: REPORT (default docs/benchmarks-gpu.md; --cpu: OUT_DIR/report.md)
# between the markers `gpu_session report`, raw outputs in OUT_DIR (default runs/gpu_session). Exit
# status 1 if a part failed or was cut off. Without CUDA and without --cpu it says so in one line
# and exits 0.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"  # the scripts import mmldlm from this checkout
MODE=gpu
[ "${1:-}" = "--cpu" ] && MODE=cpu
if [ "$MODE" = gpu ] && ! "$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
    echo "gpu_session: no CUDA device is visible to torch on this machine; nothing to run (--cpu runs the tiny rehearsal)"
    exit 0
fi
# The budget, in seconds of wall time (the lease allows 600 per command). Each part is stopped at its
# own limit; their sum and the report's few seconds stay under 600. Times of 2026-11-23 on one H100:
# the CUDA tests 46 s; a bench of two base-preset rows with the fit search 152 s, with compile 126 s.
T_TESTS=${T_TESTS:-60}    # 1. pytest -m cuda
T_SHAPE4=${T_SHAPE4:-170} # 2a. three rows of 1B parameters: build, compile, 2 + 4 steps, three fit searches
T_SHAPE8=${T_SHAPE8:-70}  # 2b. two rows, compile again (from inductor's cache), 2 + 4 steps
T_BASE=${T_BASE:-80}      # 3. two rows, the auto micro-batch probe, compile, 2 + 4 steps
T_RUNG=${T_RUNG:-210}     # 4. a 16-step timing run and its eval, the training, the eval of 128 texts
TOTAL=$(( T_TESTS + T_SHAPE4 + T_SHAPE8 + T_BASE + T_RUNG ))  # 60 + 170 + 70 + 80 + 210 = 590
if [ "$TOTAL" -gt 590 ]; then
    echo "gpu_session: the parts' limits add up to $TOTAL s; expected at most 590 (10 minutes less the report)"
    exit 2
fi
OUT=${OUT_DIR:-runs/gpu_session}
# The rehearsal's figures mean nothing: its report stays beside its outputs unless REPORT says otherwise.
[ "$MODE" = gpu ] && REPORT=${REPORT:-docs/benchmarks-gpu.md} || REPORT=${REPORT:-$OUT/report.md}
DATA=${DATA:-runs/gpu-data}
if [ ! -f "$DATA/meta.json" ]; then
    echo "gpu_session: $DATA: no prepared dataset; make it on a CPU first:" \
        "python -m mmldlm prepare --input default --max-samples 50000 --out $DATA"
    exit 2
fi

if [ "$MODE" = gpu ]; then
    CAP=$("$PY" -c 'import torch; print(round(0.9 * torch.cuda.get_device_properties(0).total_memory / 2**30, 1))')
    SHAPE="model=base-2k"
    SYNTHETIC="--synthetic-vocab 30522 --synthetic-lengths 600:2048 --synthetic-latent-dim 32"
    STEPS="--steps 4 --warmup 2 --round-steps 2"
    FIT="--memory-cap-gib $CAP --max-micro-batch 64"
    # auto takes the largest divisor of 2048 that fits: 2048 (2,816 fitted under 71.3 GiB on 2026-11-23)
    BASE="model=base train.micro_batch_size=auto train.global_batch_size=2048"
    # writing_ladder.py fits its timing run, training and evaluations into --minutes (with a 10%
    # margin of its own); 15 s of the part's limit are left for its start-up and its table.
    RUNG="--minutes $("$PY" -c "print(round(($T_RUNG - 15) / 60, 2))") --rungs small:1 --timing-steps 16"
    RUNG_KEYS=""
    EVAL="--num-samples 128 --best-of 1 --no-encoder"  # the figures read need no sentence encoder on the device
    export PYTORCH_CUDA_ALLOC_CONF=${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}
else
    # Tiny shapes and no compile (torch.compile's own CPU tests are in tests/test_perf.py): every
    # command, option and report path of the GPU run, in seconds.
    TINY="model=tiny model.hidden_size=64 model.num_blocks=2 model.timestep_embed_dim=32 data.num_workers=0"
    SHAPE="$TINY model.max_seq_len=64 perf.compile=false"
    SYNTHETIC="--synthetic-vocab 300 --synthetic-lengths 20:64 --synthetic-latent-dim 8 --synthetic-samples 64"
    STEPS="--steps 1 --warmup 1 --round-steps 1"
    FIT="--memory-cap-gib 2 --max-micro-batch 8"
    BASE="$TINY perf.compile=false train.micro_batch_size=auto train.global_batch_size=16"
    RUNG="--minutes 0.5 --rungs tiny:1 --timing-steps 4"  # less than its timing run: one training step
    RUNG_KEYS="$TINY train.global_batch_size=8 train.micro_batch_size=8"
    EVAL="--num-samples 8 --best-of 1 --no-encoder"
fi
mkdir -p "$OUT"
REPORTER=("$PY" scripts/gpu_session_report.py --report "$REPORT" --section "$OUT/session.md")
"${REPORTER[@]}" start --mode "$MODE" --data "$DATA" || exit 1
status=0

# part TITLE SECONDS LOG [--bench DIR ...|--tests|--ladder DIR] -- COMMAND...: run COMMAND under its
# timeout with its output in LOG, then append its section to the report.
part() {
    local title=$1 seconds=$2 log=$3
    shift 3
    local shows=()
    while [ "$1" != "--" ]; do shows+=("$1"); shift; done
    shift
    local started=$(date +%s) command
    command=$(printf '%q ' "$@")
    echo "gpu_session: $title (at most $seconds s)"
    timeout --kill-after=10 "$seconds" "$@" > "$log" 2>&1
    local code=$?
    [ "$code" -eq 0 ] || status=1
    "${REPORTER[@]}" part --title "$title" --status "$code" --seconds $(( $(date +%s) - started )) \
        --budget "$seconds" --log "$log" --command "${command% }" "${shows[@]}" || status=1
}

part "1. CUDA-only tests" "$T_TESTS" "$OUT/tests.log" --tests -- \
    "$PY" -m pytest -m cuda -q -p no:cacheprovider tests
part "2a. The older codebase's shape, micro-batch 4" "$T_SHAPE4" "$OUT/shape-4.log" --bench "$OUT/shape-4" -- \
    "$PY" -m mmldlm bench $SHAPE train.global_batch_size=4 train.micro_batch_size=4 $SYNTHETIC \
    --baseline baseline --optimized optimized --variant compiled $STEPS $FIT --out "$OUT/shape-4"
part "2b. The older codebase's shape, micro-batch 8" "$T_SHAPE8" "$OUT/shape-8.log" --bench "$OUT/shape-8" -- \
    "$PY" -m mmldlm bench $SHAPE train.global_batch_size=8 train.micro_batch_size=8 $SYNTHETIC \
    --baseline optimized --optimized compiled $STEPS --no-fit --out "$OUT/shape-8"
part "3. Base preset, default data, compiled at the auto micro-batch" "$T_BASE" "$OUT/base.log" --bench "$OUT/base" -- \
    "$PY" -m mmldlm bench $BASE data.path="$DATA" --baseline optimized --optimized compiled $STEPS --no-fit \
    --out "$OUT/base"
part "4. A first writing rung" "$T_RUNG" "$OUT/rung.log" --ladder "$OUT/rung" -- \
    "$PY" scripts/writing_ladder.py $RUNG --eval-args "$EVAL" --out "$OUT/rung" $RUNG_KEYS data.path="$DATA"

"${REPORTER[@]}" end || status=1
echo "gpu_session: wrote $REPORT (exit status $status)"
exit $status
