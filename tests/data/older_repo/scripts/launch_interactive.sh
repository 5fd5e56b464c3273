#!/bin/bash
# Asks before it starts, logs through exec, and runs torchrun by its full path, through eval and exec.
set -e
LOG_DIR=/var/log/older-runs
exec > >(tee -a "${LOG_DIR}/launch.log") 2>&1
read -p "Press Enter to start training on ${NNODES:-1} nodes..." answer
builtin cd "$(dirname "$0")/.."
enable -n echo
TORCHRUN=/opt/conda/envs/mmdit/bin/torchrun
ARGS="--nnodes=${NNODES:-1} --nproc_per_node=${NPROC_PER_NODE:-8}"
eval "OVERRIDES=\"training.num_epochs=\$((1 + 1)) logging.run_name=small_joint_eval\""
exec $TORCHRUN $ARGS train_mmdit_stable.py --config-name small_joint $OVERRIDES >"${LOG_DIR}/train.log" 2>&1
echo "never reached"
