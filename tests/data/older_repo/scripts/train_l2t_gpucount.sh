#!/bin/bash
# l2t training on every GPU of each node: the GPUs this process may use, as torch counts them.
set -eo pipefail

NNODES=${NNODES:-1}
NODE_RANK=${NODE_RANK:-0}
GPUS_VISIBLE=$(nvidia-smi -L 2>/dev/null | wc -l)
if [ "$GPUS_VISIBLE" -eq 0 ]; then
    echo "no GPU visible to nvidia-smi" >&2
    exit 1
elif [ -n "${CUDA_VISIBLE_DEVICES:-}" ]; then
    NPROC_PER_NODE=$(echo "$CUDA_VISIBLE_DEVICES" | tr ',' '\n' | wc -l)
elif command -v python >/dev/null 2>&1; then
    NPROC_PER_NODE=$(python - <<'PY'
try:
    import torch
    count = torch.cuda.device_count()
except Exception:
    count = 0
print(count)
PY
)
else
    NPROC_PER_NODE=$GPUS_VISIBLE
fi
echo "training on ${NNODES} x ${NPROC_PER_NODE} GPUs"

if [ "$NNODES" -gt 1 ]; then
    torchrun --nnodes=$NNODES --node_rank=$NODE_RANK --nproc_per_node=$NPROC_PER_NODE \
        --master_addr=${MASTER_ADDR:-10.0.0.1} --master_port=29500 \
        train_mmdit_stable.py --config-name mmdit_2048 \
        loss.loss_type=l2t \
        training.num_epochs=30 \  # longer on two nodes
        logging.run_name=l2t_2n
else
    torchrun --standalone --nproc_per_node=$NPROC_PER_NODE \
        train_mmdit_stable.py --config-name mmdit_2048 \
        loss.loss_type=l2t \
        logging.run_name=l2t_1n
fi
