#!/bin/bash
# torchrun as the condition of an if, inside a retry loop; a second form, until, below it.
NPROC=${NPROC_PER_NODE:-8}
ATTEMPT=0
while [ $ATTEMPT -lt 3 ]; do
    ATTEMPT=$((ATTEMPT + 1))
    if torchrun --nnodes=${NNODES:-1} --nproc_per_node=$NPROC train_mmdit_stable.py --config-name=small_joint \
        training.train_batch_size=$((64 / NPROC)) logging.run_name=retry_${ATTEMPT}; then
        echo "finished on attempt ${ATTEMPT}"
        break
    fi
    echo "attempt ${ATTEMPT} failed; retrying in 60 s"
    sleep 60
done
