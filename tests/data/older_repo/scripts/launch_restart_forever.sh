#!/bin/bash
# Restarts training whenever it ends, for good.
while true; do
    torchrun --standalone --nproc_per_node=gpu train_mmdit_stable.py --config-name small_joint training.num_epochs=4
    sleep 30
done
