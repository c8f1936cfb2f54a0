"""The training loop: the `Trainer` (a run built from the config, its loop and its failures),
the step alone (step.py, `TrainStep`: micro-batches, autocast, clipping, optimizer), optimizer and LR
schedule (optim.py), held-out loss (evaluate.py), tokens/s and MFU (throughput.py), and where
metrics go (loggers.py). The top of training: it may import every package below it and
training.builders; nothing imports it but train.py, the tools and the tests. It asks the
parallel plan (training.parallel.plan) and the checkpoint store (training.run.store), and names
no parallel mode and no checkpoint format (tests/test_import_layers.py checks).
"""
