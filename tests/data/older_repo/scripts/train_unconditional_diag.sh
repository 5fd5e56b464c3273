#!/bin/bash
# Unconditional training on one node or several, with a check of the software stack first.
set -e

NNODES=${NNODES:-1}
NODE_RANK=${NODE_RANK:-0}
NPROC_PER_NODE=${NPROC_PER_NODE:-8}
MASTER_ADDR=${MASTER_ADDR:-10.0.0.1}

export TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC=12000000
export TORCH_NCCL_ENABLE_MONITORING=0
export NCCL_DEBUG=WARN

echo "Checking the environment..."
python -c "import torch; print(f'✓ PyTorch version: {torch.__version__}'); print(f'✓ CUDA available: {torch.cuda.is_available()}'); print(f'✓ NCCL version: {torch.cuda.nccl.version() if torch.cuda.is_available() else \"N/A\"}')"
nvidia-smi --query-gpu=index,name,memory.total --format=csv

torchrun --nnodes=${NNODES} --node_rank=${NODE_RANK} --nproc_per_node=${NPROC_PER_NODE} \
    --master_addr=${MASTER_ADDR} --master_port=29500 \
    train_mmdit_stable.py --config-name mmdit_2048 \
    training.num_epochs=4
