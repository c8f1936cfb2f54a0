"""Training: from a composed config to a trained run, in packages by job.

Each package may import those listed before it (tests/test_import_layers.py enforces it):

- process/  this process: device, precision, RNGs, signals, exit statuses, faults (imports nothing)
- config/   the schema, composition and checks of the config (imports kernels, model)
- parallel/ the parallel plan over torchrun's processes: DDP/FSDP2, context parallelism, state
- run/      the run folder: atomic files, lock, checkpoint store, resume planner, lineage, report
- interop/  weights-only safetensors and Hugging Face folders
- builders.py  config -> data, model and resolved settings; a trained run back as a model
- loop/     the Trainer, its step, optimizer, evaluation, throughput and loggers
- launch.py `python -m training.launch`: torchrun with train.py's exit statuses (imports none)

`train.py` wires them together; docs/architecture.md walks a step and a checkpoint through them.
"""
