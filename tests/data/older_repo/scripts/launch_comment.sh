#!/bin/bash
# A comment after a line continuation: bash ends the torchrun call at it.
torchrun --nnodes=${NNODES:-1} --nproc_per_node=${NPROC_PER_NODE:-8} \
    train_mmdit_stable.py --config-name small_joint \
    training.num_epochs=2 \  # try 2 epochs first
    training.train_batch_size=32 \
    optimizer.lr=1e-4 \
    logging.run_name=small_joint_long
