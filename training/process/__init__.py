"""This process: its device, precision and determinism, CPU threads, random number generators,
stop signals, exit statuses and the one-line messages for the machine's failures.

device.py (where the run happens and in which dtype), rng.py (seeding, and every RNG's state
for checkpoints), signals.py (Ctrl-C and SIGTERM as requests to stop at a step boundary),
exits.py (the exit-status table: the one place that says what each status means), faults.py
(out of memory, a full disk, a lost process group: one line, status 2). Imports nothing of
ours: train.py loads signals.py and exits.py before torch.
"""
