"""The training loop's helpers: config composition and validation, optimizer and schedule,
checkpoints, metrics and loggers, signal handling, evaluation. `train.py` wires them together."""
