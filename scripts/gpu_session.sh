#!/usr/bin/env bash
# A short GPU lease spent on measurement only: one command, at most 10 minutes on one H100, in order
#
#   1. the older codebase's shape at full size (model=base-2k: 1024 wide, 24 blocks, texts of
#      600-2048 tokens, a 30,522-entry vocabulary, 32-d latents) on synthetic tokens, no corpus:
#      a. eager, micro-batch 8: the optimized config (the masked attention, model.attention=sdpa) vs
#         bf16 compute weights (perf.compute_weights: no weight cast per use, the reference gets them
#         too) and cuDNN's attention on batches of two lengths (perf.cudnn_attention,
#         data.length_buckets: does its per-mask plan cost go with few shapes?; varlen and packed rows
#         were measured 2026-11-27), beside the plain
#         transformer of the same text-stream dimensions (`bench --reference`); samples/s, tokens/s, peak memory, bytes per
#         parameter, the real-token share, MFU on real tokens, and tokens/s and MFU over the reference's
#         (WITH_BASELINE=1 adds the baseline config and the largest micro-batch of each under 90% of
#         the GPU's memory: measured 2026-11-27);
#      b. compiled (the reference compiled too), without and with CUDA graphs and cuDNN's attention
#         (perf.cuda_graphs: each block's forward and backward one replay per shape; batches padded
#         to data.length_buckets, 1536 or 2048 tokens), and CUDA graphs on the micro-batch packed in
#         one row as wide as the shortest of 12,288 and 16,384 that holds it (2 shapes as the buckets
#         have, 77% of the padded rows' positions) through flash's variable-length kernel
#         (model.attention=varlen, static shapes since 2026-12-05; compiled varlen with symbolic
#         shapes was measured 2026-11-27);
#      c. one optimized step at micro-batch 8 under torch.profiler: how busy the GPU is and the top
#         kernels and host operators, the row that names the next lever (scripts/profile_step.py);
#      d. the attention kernel that each kind of batch reaches at that shape (no padding, a padded
#         batch's key mask, a packed batch's block-diagonal mask, FlexAttention's block masks) and
#         its time, forward + backward (scripts/attention_kernels.py);
#      e. the text head and its loss at micro-batch 8's masked positions, forward + backward: the
#         logits then the SUBS cross-entropy vs the two fused chunk by chunk (perf.fused_text_loss, on
#         in the optimized and compiled presets), time and peak memory (scripts/text_loss.py);
#      f. eager, micro-batch 8: the optimized config vs the same with each pair of the two streams'
#         products grouped (perf.grouped_linears: fewer launches, but are grouped_mm's kernels as fast
#         as cuBLAS's on 10,000 text rows beside 8 latent ones?) (off unless T_GROUPED is set; the
#         second call's);
#   2. short texts: the small preset on the default data at micro-batch 64, CUDA graphs of the
#      blocks with the parts outside them compiled too (perf.compile_outside_blocks: the host's work
#      left beside the blocks' replays) vs CUDA graphs of the whole model (perf.compile_model: one
#      replay for the forward and one for the backward, the text head's rows filled to a quarter of
#      the batch's positions by perf.text_row_buckets; its compiles take the time that compile
#      without CUDA graphs had as a row of its own), and the first on the micro-batch packed in one
#      row of 1,024 positions (data.packing) where padding to 64 makes 4,096, beside the plain transformer at 64 (the eager row was measured on
#      2026-11-27; 64 is the batch whose loss after equal samples larger batches do not keep on the
#      main job: docs/log/quality.md, "Batch size at equal samples");
#      b. the host's time per step by part outside the model (the batch, the objective's draws and
#         losses, the gradient norm, the update and the optimizer's pieces), the small preset eager at
#         micro-batch 64 (scripts/cpu_step_costs.py parts): the host's work that CUDA graphs of the
#         model leave (off unless T_PARTS is set; the second call's);
#   3. a first writing rung: the small preset trained on the default data for what its limit leaves
#      and evaluated on 128 validation texts (t2l retrieval@1, l2t word F1 and BLEU, with intervals),
#      as scripts/writing_ladder.py measures it (off unless T_RUNG is set: with part 1's 480 s it
#      does not fit one command; `T_SHAPE4=0 T_SHAPE8=0 T_LOSS=0 T_BASE=0 T_GROUPED=45 T_PARTS=40 T_RUNG=120`
#      is the second call, on the warm machine, where the lease has about 4 minutes left);
#   4. the CUDA-only tests (`pytest -m cuda`; off unless T_TESTS is set: they passed on this image
#      on 2026-11-26, and a lease is no time to debug one that fails).
#
#   bash scripts/gpu_session.sh            # on the GPU machine
#   bash scripts/gpu_session.sh --cpu      # every part at tiny shapes on a CPU, seconds each
#
# The data of parts 2 and 3 is a prepared 50,000-text slice of the bundled corpus, made on a CPU
# beforehand and carried to the device (50.5 MiB; docs/benchmarks-gpu.md):
#
#   python -m mmldlm prepare --input default --max-samples 50000 --out runs/gpu-data
#
# DATA=DIR names another prepared dataset. Each part runs under its own timeout and appends its
# section to the report as soon as it ends (done, failed or cut off), so a lease that ends early
# still leaves every finished part: REPORT (default docs/benchmarks-gpu.md; --cpu: OUT_DIR/report.md)
# between the markers `gpu_session report`, raw outputs in OUT_DIR (default runs/gpu_session). A
# bench cut off still leaves, in its log and the report, every row it measured (one line per row).
# COPY_TO=DIR copies the report so far and each part's log there as each part ends: the folder
# that comes back from the device, so that a command stopped at the device's limit still returns
# them. Exit status 1 if a part failed or was cut off. Without CUDA and without --cpu it says so in
# one line and exits 0.
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
# The budget, in seconds of wall time. The device stops a command at 600 s: the parts' limits add up
# to at most 540, leaving the report, the copies and a part's 10 s grace past its limit. A limit of 0
# skips its part. Times on one H100 (2026-11-26): the CUDA tests 54 s; `mmldlm train` of the older
# shape (optimized, eager) 64 s for 30 steps with its start-up, probe and checkpoint; a bench of
# three 1B rows and their fit searches at 2048 tokens did not finish in 170 s (its rows then shared
# the GPU's memory: the baseline ran out of it), hence rows one at a time and two benches.
if [ "$MODE" = gpu ]; then
    DEFAULTS=(140 250 0 0 25 125 0 0 0 0)  # 1a, 1b, 1c, 1d, 1e, 2, 3, 4, 2b, 1f (1c measured on 2026-11-27)
else
    DEFAULTS=(80 80 60 40 40 70 70 40 40 20)  # every part, at tiny shapes
fi
T_SHAPE4=${T_SHAPE4:-${DEFAULTS[0]}} # 1a. three rows of 1B parameters and the reference, 3 + 10 steps each
T_SHAPE8=${T_SHAPE8:-${DEFAULTS[1]}} # 1b. three compiled rows and the compiled reference, 12 + 10 steps
T_PROFILE=${T_PROFILE:-${DEFAULTS[2]}} # 1c. one row built, 3 steps, 2 steps profiled
T_ATTENTION=${T_ATTENTION:-${DEFAULTS[3]}} # 1d. five SDPA backends x three masks, two FlexAttention compiles
T_LOSS=${T_LOSS:-${DEFAULTS[4]}}     # 1e. the text head and its loss, two ways, 13 calls each
T_BASE=${T_BASE:-${DEFAULTS[5]}}     # 2. three rows and the reference, compile, 12 + 10 steps
T_RUNG=${T_RUNG:-${DEFAULTS[6]}}     # 3. a 16-step timing run and its eval, the training, the eval of 128 texts
T_TESTS=${T_TESTS:-${DEFAULTS[7]}}   # 4. pytest -m cuda
T_PARTS=${T_PARTS:-${DEFAULTS[8]}}   # 2b. one eager row built, 20 + 100 steps timed by part
T_GROUPED=${T_GROUPED:-${DEFAULTS[9]}} # 1f. two rows of 1B parameters, 3 + 10 steps each
TOTAL=$(( T_SHAPE4 + T_SHAPE8 + T_PROFILE + T_ATTENTION + T_LOSS + T_BASE + T_RUNG + T_TESTS + T_PARTS + T_GROUPED ))
if [ "$TOTAL" -gt 540 ]; then
    echo "gpu_session: the parts' limits add up to $TOTAL s; expected at most 540 (the device's 600 s less the report and copies)"
    exit 2
fi
RUN_OUT=${OUT_DIR:-runs/gpu_session}
# The rehearsal's figures mean nothing: its report stays beside its outputs unless REPORT says otherwise.
[ "$MODE" = gpu ] && REPORT=${REPORT:-docs/benchmarks-gpu.md} || REPORT=${REPORT:-$RUN_OUT/report.md}
DATA=${DATA:-runs/gpu-data}
# Parts 2, 2b and 3 read it; part 1 makes its own synthetic tokens.
if [ $(( T_BASE + T_PARTS + T_RUNG )) -gt 0 ] && [ ! -f "$DATA/meta.json" ]; then
    echo "gpu_session: $DATA: no prepared dataset; make it on a CPU first:" \
        "python -m mmldlm prepare --input default --max-samples 50000 --out $DATA"
    exit 2
fi

if [ "$MODE" = gpu ]; then
    CAP=$("$PY" -c 'import torch; print(round(0.9 * torch.cuda.get_device_properties(0).total_memory / 2**30, 1))')
    SHAPE="model=base-2k"
    SYNTHETIC="--synthetic-vocab 30522 --synthetic-lengths 600:2048 --synthetic-latent-dim 32"
    STEPS="--steps 10 --warmup 3 --round-steps 5"
    # Recompiles for new modes and lengths settle in the warm-up, and a CUDA graph is recorded at the
    # second run of its shape: 12 steps of three equally likely modes leave one unseen in 2% of rows.
    COMPILED_STEPS="--steps 10 --warmup 12 --round-steps 5"
    FIT="--memory-cap-gib $CAP --max-micro-batch 64"
    # 64 texts a step ran at 10 steps a second (2026-11-27): the host, not the GPU, set the pace. On
    # the main job every batch above 64 left a worse loss after equal samples (128: +0.27 nats per
    # token; 512: +0.65 and t2l retrieval 5% against 71%), so the goal's samples/s are those at 64.
    BASE="model=small train.micro_batch_size=64 train.global_batch_size=64"
    PARTS="$BASE --steps 120"
    # writing_ladder.py fits its timing run, training and evaluations into --minutes (with a 10%
    # margin of its own); 15 s of the part's limit are left for its start-up and its table.
    RUNG="--minutes $("$PY" -c "print(round(($T_RUNG - 15) / 60, 2))") --rungs small:1 --timing-steps 16"
    RUNG_KEYS=""
    EVAL="--num-samples 128 --best-of 1 --no-encoder"  # the figures read need no sentence encoder on the device
    ATTENTION=""  # its defaults are the older shape
    LOSS=""  # its defaults are the older shape at micro-batch 8
    # Two lengths (1536, 2048): of 8 texts of 600-2048 tokens the longest passes 1536 in 97% of batches.
    GRAPHS="perf.cuda_graphs=true data.length_buckets=[1536]"
    CUDNN="perf.cudnn_attention=true data.length_buckets=[1536]"
    # First-fit puts 8 texts of 600-2048 tokens in 6 or fewer rows of 2048 half the time. [6,7] would
    # compute less (6.6 rows on average) but compile a third more graphs than the lease has time for.
    # The micro-batch in one packed row of 12,288 positions (93% of micro-batches; else 16,384: two
    # shapes), 84% of them real tokens, through flash's variable-length kernel (real positions alone).
    PACKED="perf.cuda_graphs=true model.attention=varlen data.packing=true data.pack_length=16384 data.pack_rows=[1] data.length_buckets=[12288]"
    SHORT_GRAPHS="perf.cuda_graphs=true"  # glosses padded to 64: one or two lengths
    OUTSIDE="perf.compile_outside_blocks=true"
    # The whole forward one graph per mode, length and count of text rows. Glosses padded to 64 are
    # 16% real tokens, so the masked ones (about 330 of 4,096 positions) fill a quarter of the batch's
    # positions in one count: one graph a mode, where sixteenths made two or three (on a CPU some
    # first met after 12 warm-up steps); the head computes 1,024 rows, 3% of the blocks' products.
    WHOLE="perf.compile_model=true perf.text_row_buckets=4"
    # The 64 glosses (about 650 tokens and 64 latent slots) laid end to end in one row of 1,024
    # positions (else 2,048), where padding each to 64 makes 4,096: a quarter of the products. With
    # the blocks compiled alone: on a CPU each whole-model graph took about a minute to compile.
    PACKED_SHORT="data.packing=true data.pack_length=2048 data.pack_rows=[1] data.length_buckets=[1024]"
    export PYTORCH_CUDA_ALLOC_CONF=${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}
else
    # Tiny shapes and no compile (torch.compile's own CPU tests are in tests/test_perf.py): every
    # command, option and report path of the GPU run, in seconds.
    TINY="model=tiny model.hidden_size=64 model.num_blocks=2 model.timestep_embed_dim=32 data.num_workers=0"
    SHAPE="$TINY model.max_seq_len=64 perf.compile=false"
    SYNTHETIC="--synthetic-vocab 300 --synthetic-lengths 20:64 --synthetic-latent-dim 8 --synthetic-samples 64"
    STEPS="--steps 1 --warmup 1 --round-steps 1"
    COMPILED_STEPS=$STEPS
    FIT="--memory-cap-gib 2 --max-micro-batch 8"
    BASE="$TINY perf.compile=false train.micro_batch_size=auto train.global_batch_size=16"
    PARTS="$TINY train.micro_batch_size=4 train.global_batch_size=4 --steps 25"
    RUNG="--minutes 0.5 --rungs tiny:1 --timing-steps 4"  # less than its timing run: one training step
    RUNG_KEYS="$TINY train.global_batch_size=8 train.micro_batch_size=8"
    EVAL="--num-samples 8 --best-of 1 --no-encoder"
    ATTENTION="--batch 2 --heads 2 --length 64 --warmup 1 --iters 2"
    LOSS="--rows 300 --hidden 64 --vocab 2000 --warmup 1 --iters 2"
    # Compile is off here, and CUDA graphs are compile's: the rows keep their length buckets alone.
    GRAPHS="data.length_buckets=[64]"
    CUDNN="perf.cudnn_attention=true data.length_buckets=[64]"
    PACKED="model.attention=varlen data.packing=true data.pack_length=512 data.pack_rows=[1] data.length_buckets=[384]"
    SHORT_GRAPHS="data.length_buckets=[64]"
    OUTSIDE=""
    WHOLE="perf.text_row_buckets=4"  # the filled text rows alone: compile_model is compile's
    PACKED_SHORT="data.packing=true data.pack_length=256 data.pack_rows=[1] data.length_buckets=[128]"
fi
SHORT="compiled $SHORT_GRAPHS${OUTSIDE:+ $OUTSIDE}"  # part 2's rows at both batches
mkdir -p "$RUN_OUT"
REPORTER=("$PY" scripts/gpu_session_report.py --report "$REPORT" --section "$RUN_OUT/session.md")
"${REPORTER[@]}" start --mode "$MODE" --data "$DATA" || exit 1
status=0
ROWS="--rows one-at-a-time"  # what bench does on a GPU anyway; said here so that the rehearsal takes that path too

# copy_out [FILE...]: the report so far and FILEs into COPY_TO, where it is set.
copy_out() {
    [ -n "${COPY_TO:-}" ] || return 0
    mkdir -p "$COPY_TO" && cp "$RUN_OUT/session.md" "$@" "$COPY_TO/" 2>/dev/null
    return 0
}

# part TITLE SECONDS LOG [--bench DIR ...|--tests|--ladder DIR|--profile DIR] -- COMMAND...: run COMMAND under its
# timeout with its output in LOG, then append its section to the report; a limit of 0 skips it.
part() {
    local title=$1 seconds=$2 log=$3
    shift 3
    local shows=()
    while [ "$1" != "--" ]; do shows+=("$1"); shift; done
    shift
    if [ "$seconds" -eq 0 ]; then
        echo "gpu_session: $title: skipped (its limit is 0)"
        return
    fi
    local started=$(date +%s) command
    command=$(printf '%q ' "$@")
    echo "gpu_session: $title (at most $seconds s)"
    timeout --kill-after=10 "$seconds" "$@" > "$log" 2>&1
    local code=$?
    [ "$code" -eq 0 ] || status=1
    "${REPORTER[@]}" part --title "$title" --status "$code" --seconds $(( $(date +%s) - started )) \
        --budget "$seconds" --log "$log" --command "${command% }" "${shows[@]}" || status=1
    copy_out "$log" $([ -f "$RUN_OUT/profile/profile.txt" ] && echo "$RUN_OUT/profile/profile.txt")
}

MB8="train.global_batch_size=8 train.micro_batch_size=8"
if [ "${WITH_BASELINE:-0}" = 1 ]; then
    SHAPE_ROWS=(--variant baseline)
    FITTING=$FIT
else
    SHAPE_ROWS=()
    FITTING=--no-fit
fi
part "1a. The older codebase's shape, eager, micro-batch 8: masked attention vs bf16 compute weights vs cuDNN's on two lengths vs the plain transformer" \
    "$T_SHAPE4" "$RUN_OUT/shape-4.log" --bench "$RUN_OUT/shape-4" -- \
    "$PY" -m mmldlm bench $SHAPE $MB8 $SYNTHETIC --baseline optimized --optimized "optimized perf.compute_weights=true" \
    --variant "optimized $CUDNN" "${SHAPE_ROWS[@]}" --reference $STEPS $FITTING $ROWS --out "$RUN_OUT/shape-4"
part "1b. The older codebase's shape, compiled, micro-batch 8: masked attention vs CUDA graphs with cuDNN's attention on padded rows vs CUDA graphs with the variable-length kernel on one packed row, vs the plain transformer" \
    "$T_SHAPE8" "$RUN_OUT/shape-8.log" --bench "$RUN_OUT/shape-8" -- \
    "$PY" -m mmldlm bench $SHAPE $MB8 $SYNTHETIC --baseline compiled --optimized "compiled $GRAPHS perf.cudnn_attention=true" \
    --variant "compiled $PACKED" --reference $COMPILED_STEPS --no-fit $ROWS --out "$RUN_OUT/shape-8"
part "1c. The older codebase's shape, one optimized step profiled" "$T_PROFILE" "$RUN_OUT/profile.log" \
    --profile "$RUN_OUT/profile" -- \
    "$PY" scripts/profile_step.py optimized $SHAPE $MB8 \
    data.path="$RUN_OUT/shape-4/synthetic-data" --warmup 3 --steps 2 --out "$RUN_OUT/profile"
part "1d. The older codebase's shape, attention kernels per kind of batch" "$T_ATTENTION" "$RUN_OUT/attention.log" \
    --output -- "$PY" scripts/attention_kernels.py $ATTENTION
part "1e. The older codebase's shape, the text head and its loss: logits then the loss vs the two fused" "$T_LOSS" \
    "$RUN_OUT/text-loss.log" --output -- "$PY" scripts/text_loss.py $LOSS
part "1f. The older codebase's shape, eager, micro-batch 8: each pair of the two streams' products grouped" \
    "$T_GROUPED" "$RUN_OUT/grouped.log" --bench "$RUN_OUT/grouped" -- \
    "$PY" -m mmldlm bench $SHAPE $MB8 $SYNTHETIC --baseline optimized --optimized "optimized perf.grouped_linears=true" \
    $STEPS --no-fit $ROWS --out "$RUN_OUT/grouped"
part "2. Short texts: the small preset on the default data at micro-batch 64: CUDA graphs of the blocks with the parts outside them compiled too vs CUDA graphs of the whole model vs the first on the micro-batch packed in one row, vs the plain transformer" \
    "$T_BASE" "$RUN_OUT/base.log" --bench "$RUN_OUT/base" -- \
    "$PY" -m mmldlm bench $BASE data.path="$DATA" --baseline "$SHORT" --optimized "compiled $SHORT_GRAPHS $WHOLE" \
    --variant "$SHORT $PACKED_SHORT" --reference $COMPILED_STEPS --no-fit $ROWS --out "$RUN_OUT/base"
part "2b. Short texts: the host's time per step by part outside the model, the small preset eager at micro-batch 64" \
    "$T_PARTS" "$RUN_OUT/parts.log" --output -- \
    "$PY" scripts/cpu_step_costs.py parts $PARTS data.path="$DATA" --config optimized
# The ladder in a folder of its own: writing_ladder.py refuses one that holds an earlier ladder (a call
# run again on the warm machine, whose runs/ stays between calls; or a rehearsal run twice).
LADDER=$RUN_OUT/rung
n=2
while [ -e "$LADDER" ]; do LADDER=$RUN_OUT/rung-$n; n=$(( n + 1 )); done
part "3. A first writing rung" "$T_RUNG" "$LADDER.log" --ladder "$LADDER" -- \
    "$PY" scripts/writing_ladder.py $RUNG --eval-args "$EVAL" --out "$LADDER" $RUNG_KEYS data.path="$DATA"
part "4. CUDA-only tests" "$T_TESTS" "$RUN_OUT/tests.log" --tests -- \
    "$PY" -m pytest -m cuda -q -p no:cacheprovider tests

"${REPORTER[@]}" end || status=1
copy_out
echo "gpu_session: wrote $REPORT (exit status $status)"
exit $status
