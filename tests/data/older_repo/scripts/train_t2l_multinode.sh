#!/bin/bash
# Multi-node t2l training; node rank 0 asks before it starts.
set -e

NNODES=${NNODES:-2}
NODE_RANK=${NODE_RANK:-0}
MASTER_ADDR=${MASTER_ADDR:-10.0.0.1}
MASTER_PORT=${MASTER_PORT:-29500}
GPUS_PER_NODE=${GPUS_PER_NODE:-8}

export NCCL_DEBUG=INFO
export NCCL_DEBUG_FILE=/shared/logs/nccl_debug.log
export NCCL_SOCKET_IFNAME=eth0

echo "=========================================="
echo "Node ${NODE_RANK} of ${NNODES}: ${GPUS_PER_NODE} GPUs, master ${MASTER_ADDR}:${MASTER_PORT}"
echo "=========================================="

if [ "$NODE_RANK" -eq 0 ]; then
    read -p "Press Enter to start, or Ctrl+C to cancel..." </dev/tty
fi

torchrun \
    --nnodes=${NNODES} \
    --node_rank=${NODE_RANK} \
    --nproc_per_node=${GPUS_PER_NODE} \
    --master_addr=${MASTER_ADDR} \
    --master_port=${MASTER_PORT} \
    train_mmdit_stable.py --config-name mmdit_2048 \
    loss.loss_type=l2t \
    logging.eval_freq=5000
