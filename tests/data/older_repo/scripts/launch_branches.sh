#!/bin/bash
# One torchrun per branch, chosen by the scheduler's WORLD_SIZE (the number of nodes where this
# launcher ran: one launcher per node), with different overrides in each branch.
set -euo pipefail
cd "$(dirname "$0")/.."
GPUS_PER_NODE=${GPUS_PER_NODE:-8}
    if [ ${WORLD_SIZE} -gt 1 ]; then
        echo "multi-node: ${WORLD_SIZE} nodes"
        torchrun --nnodes=${WORLD_SIZE} --node_rank=${RANK} --nproc_per_node=${GPUS_PER_NODE} \
            --rdzv_backend=c10d --rdzv_endpoint=${MASTER_ADDR:-node0}:29400 \
            train_mmdit_stable.py --config-name small_joint \
            logging.run_name=small_joint_multi \
            logging.save_freq=250 \
            logging.log_freq=50 \
            logging.eval_freq=250 \
            data.num_workers=4 \
            training.num_epochs=6
    else
        torchrun --nnodes=1 --nproc_per_node=${GPUS_PER_NODE} \
            train_mmdit_stable.py --config-name small_joint \
            logging.run_name=small_joint_single \
            logging.save_freq=2000 \
            data.num_workers=12
    fi
