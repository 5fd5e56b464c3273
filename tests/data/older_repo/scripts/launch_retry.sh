#!/bin/bash
# torchrun as the condition of an if, in a retry loop: up to three attempts, a minute apart.
NPROC=${NPROC_PER_NODE:-8}
for ATTEMPT in 1 2 3; do
    if torchrun --nnodes=${NNODES:-1} --nproc_per_node=$NPROC train_mmdit_stable.py --config-name=small_joint \
        training.train_batch_size=$((64 / NPROC)) logging.run_name=retry_${ATTEMPT}; then
        echo "finished on attempt ${ATTEMPT}"
        break
    fi
    echo "attempt ${ATTEMPT} failed; retrying in 60 s"
    sleep 60
done
