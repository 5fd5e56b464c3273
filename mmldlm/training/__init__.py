"""The training engine: process group setup, model wrapping, optimizer and schedules, checkpoints,
metrics and the loop that ties them together. Each module takes its own config section.

run.py          `mmldlm train` as a library call: process group, data, model, objective, then the loop
trainer.py      the loop (`Trainer`): one code path for 1 process, N processes and N nodes
distributed.py  process group setup from torchrun's environment, failing loudly instead of hanging
parallelize.py  activation checkpointing, then compile, then DDP / FSDP2 / HSDP, in that order
optim.py        AdamW, weight decay on weight matrices only
schedules.py    the learning rate by optimizer step, reduce-on-plateau on top
batch_size.py   `train.micro_batch_size: auto`: the largest micro-batch that fits
ema.py          the exponential moving average of the weights
init_from.py    starting a new run from another run's weights (fine-tuning)
checkpoint.py   the checkpoint manager: save, load, rotate, optionally in the background
storage.py      a failed write's error, free space, the lock that claims a run directory
metrics.py      RUN/metrics.jsonl, TensorBoard and W&B writers, memory and FLOP figures
profiler.py     a torch.profiler window on request
evaluation.py   evaluation during training: mmldlm/evaluation/evaluate.py on rank 0 every eval.every steps
"""
