#!/usr/bin/env bash
# Launch `mmldlm train` on this node under torchrun; run it once per node.
#
#   NNODES=2 NPROC_PER_NODE=8 NODE_RANK=0 MASTER_ADDR=10.0.0.1 MASTER_PORT=29500 \
#       scripts/launch.sh --config configs/default.yaml train.steps=10000
#
# Environment (defaults for one node):
#   NNODES (1), NPROC_PER_NODE (number of GPUs, else 1), NODE_RANK (0),
#   MASTER_ADDR (127.0.0.1), MASTER_PORT (29500): the rendezvous endpoint, on node 0;
#   MAX_RESTARTS (3): how often a failed worker group is restarted; every start passes
#       --resume auto, so a restart continues from RUN/checkpoints/latest;
#   LOG_DIR (logs): this node's output goes to LOG_DIR/node-NODE_RANK.log (and the terminal);
#   RUN_ID (mmldlm): rendezvous id, the same on every node of one job;
#   PYTHON (.venv/bin/python if present, else python3).
# Checkpoints are written by global rank 0 and read by every rank on resume: with several nodes,
# train.run_dir must be on a filesystem that all nodes share.
set -euo pipefail

NNODES=${NNODES:-1}
NODE_RANK=${NODE_RANK:-0}
MASTER_ADDR=${MASTER_ADDR:-127.0.0.1}
MASTER_PORT=${MASTER_PORT:-29500}
MAX_RESTARTS=${MAX_RESTARTS:-3}
LOG_DIR=${LOG_DIR:-logs}
RUN_ID=${RUN_ID:-mmldlm}
if [[ -z "${PYTHON:-}" ]]; then
    if [[ -x .venv/bin/python ]]; then PYTHON=.venv/bin/python; else PYTHON=python3; fi
fi
if [[ -z "${NPROC_PER_NODE:-}" ]]; then
    NPROC_PER_NODE=$("$PYTHON" -c "import torch; print(max(1, torch.cuda.device_count()))")
fi

# Safe NCCL defaults (the user's own settings win): a collective that times out tears the process
# down so torchrun sees the failure and restarts, instead of a rank hanging forever; the trainer sets
# the process-group timeout itself (distributed.timeout_minutes, 30 by default).
export TORCH_NCCL_ASYNC_ERROR_HANDLING=${TORCH_NCCL_ASYNC_ERROR_HANDLING:-1}
# A fresh store for every restart round: with the rendezvous store shared across rounds, a restarted
# worker group can read the previous round's process-group keys and wait on peers that are gone
# (seen as gloo "Connection refused" or a hang in init_process_group after a worker was killed).
export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=${TORCH_DISABLE_SHARE_RDZV_TCP_STORE:-1}
export NCCL_DEBUG=${NCCL_DEBUG:-WARN}
# One intra-op thread pool per process that does not oversubscribe the node's cores.
CORES=$(nproc)
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-$(( CORES / NPROC_PER_NODE > 0 ? CORES / NPROC_PER_NODE : 1 ))}

# Node 0 hosts the rendezvous store; the others connect to it.
IS_HOST=false
[[ "$NODE_RANK" == "0" ]] && IS_HOST=true

# The line `mmldlm train` prints to continue the run when it is stopped (every start here resumes).
MMLDLM_LAUNCH_COMMAND=$(printf '%q ' "NNODES=$NNODES" "NPROC_PER_NODE=$NPROC_PER_NODE" "NODE_RANK=$NODE_RANK" \
    "MASTER_ADDR=$MASTER_ADDR" "MASTER_PORT=$MASTER_PORT" "$0" "$@")
export MMLDLM_LAUNCH_COMMAND=${MMLDLM_LAUNCH_COMMAND% }

mkdir -p "$LOG_DIR"
LOG="$LOG_DIR/node-$NODE_RANK.log"
echo "launch: node $NODE_RANK of $NNODES, $NPROC_PER_NODE processes, rendezvous $MASTER_ADDR:$MASTER_PORT, log $LOG" | tee -a "$LOG"

"$PYTHON" -m torch.distributed.run \
    --nnodes "$NNODES" \
    --nproc-per-node "$NPROC_PER_NODE" \
    --rdzv-backend c10d \
    --rdzv-endpoint "$MASTER_ADDR:$MASTER_PORT" \
    --rdzv-id "$RUN_ID" \
    --rdzv-conf "is_host=$IS_HOST" \
    --max-restarts "$MAX_RESTARTS" \
    --tee 3 \
    -m mmldlm.cli train --resume auto "$@" 2>&1 | tee -a "$LOG"
exit "${PIPESTATUS[0]}"
