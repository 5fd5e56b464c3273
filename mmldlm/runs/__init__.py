"""A run directory as `mmldlm train` leaves it, for whoever reads it: training (resume), sampling,
evaluation, export, check and the monitor. Imports nothing of training, evaluation or export.

    files.py        its config files, whether a directory is a run's, CheckpointError (no torch)
    checkpoints.py  the checkpoints' layout, the newest that verifies, their weights in one process
    trained.py      a run's config + checkpoint -> model, diffusions, tokenizer, validation split, encoder,
                    ready to sample from (`TrainedRun`, `load_run`; its sampler is mmldlm/sampling's)
"""
