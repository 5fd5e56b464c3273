"""The training engine: process group setup, model wrapping, optimizer and schedules, checkpoints,
metrics and the loop that ties them together. Each module takes its own config section."""
