"""The training loop: the Trainer and its step (trainer.py), optimizer and schedule (optim.py),
held-out loss (evaluate.py), tokens/s and MFU (throughput.py), metric sinks (loggers.py).
"""
