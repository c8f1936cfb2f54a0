"""Several processes: how a run is laid out over them, and what that changes in a step.

The parallel plan (plan.py) is built once from the config and torchrun's environment (world
size, data-parallel and context-parallel degrees, the device mesh). It wraps the model, places
torch.compile, gives a micro-batch's loss (or this rank's share), syncs gradients, and gathers the
whole state for a checkpoint and scatters it back; the loop and the checkpoint store ask it and
never the mode. Its parts: data_parallel.py (how the data-parallel ranks hold the model: alone,
DDP, FSDP2) and context.py (context parallelism: its checks, the loss share, the ring);
distributed.py holds the process group, the mesh and the collectives. A new parallelism is a new
part (docs/architecture.md, "Adding a parallelism"). Imports the process layer and, for the
ring, model; nothing else of training.
"""
