"""How the data-parallel ranks hold the model: one of these is the parallel plan's replica part.

- `Alone`: one process (or a single rank's view): the model itself.
- `Replicate` (`trainer.parallel=ddp`): every rank holds the whole model and optimizer;
  DistributedDataParallel averages gradients while the backward runs.
- `Shard` (`trainer.parallel=fsdp`): FSDP2 `fully_shard` on every block and at the root:
  parameters, gradients and optimizer moments are split across ranks and gathered block by
  block; with bf16 precision the gathered parameters are bf16 and gradients are reduced in
  float32. Prefetching is FSDP2's implicit one, as torchtitan leaves it for dense models; the root
  unit (embedding, final norm, head) stays gathered after the forward, so the backward starts
  without a gather. Its state is saved as shards (the checkpoint store's DCP folders).

Each part answers what the step and the checkpoints need of it: wrap the model, where to
compile, skip the gradient reduction of a micro-batch, the whole state on rank 0 in the
single-process format, and optimizer moments back from that format. `REPLICAS` maps the
schema's `trainer.parallel` choices to them: a new way of holding the model is a class here and
a choice in training/config/schema.py, not an edit of the loop.
"""
from __future__ import annotations

import torch
from torch import nn


class Alone:
    """One process: the model itself, compiled whole."""
    name = "none"
    shards_state = False     # the whole state fits one rank: the checkpoint store writes one file
    compiles_blocks = False  # torch.compile per block (and the head with its loss) instead of whole
    even_forwards = False    # every rank runs as many forwards (a sharded model gathers in each)

    def wrap(self, model: nn.Module, device: torch.device, precision: str, mesh_size: int) -> nn.Module:
        return model

    def set_gradient_sync(self, wrapped: nn.Module, sync: bool) -> None:
        """Skip the gradient reduction on all but the last micro-batch of an optimizer step."""

    def full_state(self, model: nn.Module, optimizer, is_main: bool) -> tuple[dict | None, dict | None]:
        """(model, optimizer) state dicts of the whole model on rank 0 (None elsewhere), in the
        single-process format, so any checkpoint resumes on any number of processes."""
        if not is_main:
            return None, None
        return model.state_dict(), optimizer.state_dict()

    def load_optimizer(self, model: nn.Module, optimizer, state: dict) -> None:
        """Optimizer moments from a single-process-format state dict (any number of saving ranks)."""
        optimizer.load_state_dict(state)


class Replicate(Alone):
    """`trainer.parallel=ddp`: DDP around the model, compiled around the wrapper (DDP's buckets
    split the graph)."""
    name = "ddp"

    def wrap(self, model, device, precision, mesh_size):
        from torch.nn.parallel import DistributedDataParallel as DDP
        return DDP(model, device_ids=[device.index] if device.type == "cuda" else None)

    def set_gradient_sync(self, wrapped, sync):
        wrapped.require_backward_grad_sync = sync


class Shard(Alone):
    """`trainer.parallel=fsdp`: FSDP2 on every block and at the root, over all ranks (the
    flattened mesh, context-parallel ranks included). Its blocks and head compile one by one, as
    torchtitan compiles its blocks apart: FSDP's hooks run on the modules' calls, outside the
    graphs (the root's unshard, which gathers the head, comes before its forward)."""
    name = "fsdp"
    shards_state = True
    compiles_blocks = True
    even_forwards = True

    def wrap(self, model, device, precision, mesh_size):
        """`model` sharded in place (its parameters become DTensors: build the optimizer after)."""
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        mesh = init_device_mesh(device.type, (mesh_size,))
        policy = (MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
                  if precision == "bf16" else MixedPrecisionPolicy())
        for block in model.blocks:
            fully_shard(block, mesh=mesh, mp_policy=policy)
        return fully_shard(model, mesh=mesh, mp_policy=policy)

    def set_gradient_sync(self, wrapped, sync):
        wrapped.set_requires_gradient_sync(sync)

    def full_state(self, model, optimizer, is_main):
        """Every rank must call this: it gathers the shards (onto the CPU of rank 0)."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

        model_sd, optim_sd = get_state_dict(model, optimizer,
                                            options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if not is_main:
            return None, None
        return model_sd, optimizer_by_index(optim_sd)

    def load_optimizer(self, model, optimizer, state):
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

        names = _param_names(model, optimizer)
        by_name = {"state": {names[int(k)]: v for k, v in state["state"].items()},
                   "param_groups": [{**g, "params": [names[int(i)] for i in g["params"]]}
                                    for g in state["param_groups"]]}
        set_optimizer_state_dict(model, optimizer, optim_state_dict=by_name,
                                 options=StateDictOptions(full_state_dict=True))


REPLICAS: dict[str, type[Alone]] = {part.name: part for part in (Replicate, Shard)}   # trainer.parallel's choices


def _param_names(model: nn.Module, optimizer) -> list[str]:
    """The optimizer's parameters in its own order, by name (a tied tensor under its first name)."""
    names = {}
    for name, p in model.named_parameters():
        names.setdefault(p, name)
    return [names[p] for group in optimizer.param_groups for p in group["params"]]


def optimizer_by_index(by_name: dict) -> dict:
    """An optimizer state keyed by parameter name (DCP's) in torch.optim's own (by position)."""
    names = [name for group in by_name["param_groups"] for name in group["params"]]
    index = {name: i for i, name in enumerate(names)}
    return {"state": {index[k]: v for k, v in by_name["state"].items()},
            "param_groups": [{**g, "params": [index[k] for k in g["params"]]} for g in by_name["param_groups"]]}
