"""Training, in packages by job: config/ (schema, composition, checks), process/ (device, RNGs,
signals, faults), parallel/ (processes, DDP/FSDP2, context parallelism), run/ (run files, lock,
checkpoints, resume, reports), interop/ (safetensors, Hugging Face), loop/ (the Trainer), and
builders.py (config -> objects) and launch.py (`python -m training.launch`). `train.py` wires them
together.
"""
