"""Training: config, loop, checkpoints, metrics and the tasks."""
