"""This process: device, precision and determinism (device.py), RNG state (rng.py), stop signals
(signals.py) and the one-line messages for the machine's failures (faults.py).
"""
