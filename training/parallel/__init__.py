"""Several processes: the process group, DDP/FSDP2 wrapping and collectives (distributed.py), and
context parallelism's checks and loss (context.py).
"""
