#!/bin/bash
# Trains the stable l2t recipe on one node or several (written for mmldlm's migrate tests in the shape
# of the older codebase's launchers: nested defaults, a batch chosen from nvidia-smi's memory with
# integer arithmetic, the LR scaled with bc, NCCL settings, one torchrun per branch).
set -e

NNODES="${NNODES:-1}"
NODE_RANK="${NODE_RANK:-0}"
NPROC_PER_NODE="${NPROC_PER_NODE:-8}"
MASTER_ADDR="${MASTER_ADDR:-10.1.2.3}"
MASTER_PORT="${MASTER_PORT:-29600}"
WORLD_SIZE=$((NNODES * NPROC_PER_NODE))
BASE_WORLD_SIZE="${BASE_WORLD_SIZE:-${NPROC_PER_NODE}}"

export TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC=12000000
export TORCH_NCCL_ENABLE_MONITORING=0
export NCCL_TIMEOUT=7200
export NCCL_BLOCKING_WAIT=1
export NCCL_ASYNC_ERROR_HANDLING=1
export NCCL_IB_TIMEOUT=90
export NCCL_DEBUG=INFO
export NCCL_SOCKET_IFNAME=ib0
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True

# Per-GPU batch from the GPU's memory in GB.
GPU_MEM_MIB=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -n 1)
GPU_MEM_GB=$((GPU_MEM_MIB / 1024))
if [ "$GPU_MEM_GB" -ge 80 ]; then
    BS="${BS:-${DEFAULT_BS:-4}}"
    GRAD_ACCUM=1
elif [ "$GPU_MEM_GB" -ge 40 ]; then
    BS="${BS:-3}"
    GRAD_ACCUM=2
else
    BS=1
    GRAD_ACCUM=4
fi

# Square-root LR scaling above an effective batch of 32.
EFFECTIVE_BATCH=$((BS * GRAD_ACCUM * WORLD_SIZE))
BASE_LR="5e-5"
if [ "$EFFECTIVE_BATCH" -gt 32 ]; then
    SCALE=$(echo "scale=4; sqrt($EFFECTIVE_BATCH / 32)" | bc -l)
    LEARNING_RATE=$(echo "scale=10; ${BASE_LR} * ${SCALE}" | bc)
else
    LEARNING_RATE="${BASE_LR}"
fi

NUM_STEPS=$((1000000 * BASE_WORLD_SIZE / WORLD_SIZE))
SAVE_FREQ=$((50000 * BASE_WORLD_SIZE / WORLD_SIZE))
WARMUP=$((NUM_STEPS / 100))
[ "$WARMUP" -gt 5000 ] && WARMUP=5000

if [ ! -d "/store/old-run/tokens" ]; then
    echo "no tokens at /store/old-run/tokens"
    exit 1
fi
mkdir -p logs
echo "world ${WORLD_SIZE}: batch ${BS} x ${GRAD_ACCUM}, lr ${LEARNING_RATE}" > logs/launch.txt

if [ ${NNODES} -gt 1 ]; then
    torchrun --nnodes=${NNODES} --node_rank=${NODE_RANK} --nproc_per_node=${NPROC_PER_NODE} \
        --master_addr=${MASTER_ADDR} --master_port=${MASTER_PORT} \
        train_mmdit_stable.py --config-name stable_l2t \
        training.train_batch_size=${BS} \
        training.gradient_accumulation_steps=${GRAD_ACCUM} \
        training.num_train_steps=${NUM_STEPS} \
        training.warmup_steps=${WARMUP} \
        optimizer.lr=${LEARNING_RATE} \
        logging.run_name=stable_l2t_${NNODES}n \
        logging.save_freq=${SAVE_FREQ} \
        logging.log_freq=1000 \
        data.num_workers=16 2>&1 | tee logs/train_node${NODE_RANK}.log
else
    torchrun --standalone --nproc_per_node=${NPROC_PER_NODE} \
        train_mmdit_stable.py --config-name stable_l2t \
        training.train_batch_size=${BS} \
        training.gradient_accumulation_steps=${GRAD_ACCUM} \
        training.num_train_steps=${NUM_STEPS} \
        training.warmup_steps=${WARMUP} \
        optimizer.lr=${LEARNING_RATE} \
        logging.run_name=stable_l2t \
        logging.save_freq=${SAVE_FREQ} \
        data.num_workers=16 2>&1 | tee logs/train.log
fi
