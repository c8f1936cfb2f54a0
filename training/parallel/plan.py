"""The parallel plan: how one run is laid out over torchrun's processes, and what that changes.

Built once from the config and the launcher's environment, as torchtitan builds its
`ParallelDims` and applies its `parallelize()` to a model:

    plan, device = ParallelPlan.from_config(cfg, device)   # checks, then joins the processes
    wrapped = plan.parallelize(model, device, precision)    # the ring, then DDP or FSDP2
    forward = plan.compile(model, wrapped)                   # where torch.compile goes
    loss = plan.train_loss(forward, model, x, y, doc_ids)    # a micro-batch's loss (or this rank's share)
    model_sd, optim_sd = plan.full_state(model, optimizer)  # the whole state on rank 0

A plan has two parts: the replica part (`Alone`, `Replicate` for DDP, `Shard` for FSDP2:
training/parallel/data_parallel.py), how the data-parallel ranks hold the model, and the
context-parallel part (`ContextSplit`, training/parallel/context.py), how a sequence is split.
The loop (training/loop/) asks the plan and never the mode, and the checkpoint store asks it
whether the state is saved as shards; a new parallelism is a new part here
(docs/architecture.md, "Adding a parallelism").

Layout: N processes, C = `trainer.context_parallel` dividing N; the ranks form a 2-D mesh
(dp = N / C, cp = C; ranks dp_rank * C .. dp_rank * C + C - 1 are one CP group). The sampler is
sharded by data-parallel rank; both replica parts reduce gradients over all N ranks (FSDP2
shards over all N: the flattened mesh).
"""
from __future__ import annotations

import logging

import torch
from omegaconf import DictConfig

from training.parallel.context import ContextSplit, check_context_parallel, context_parallel_size
from training.parallel.data_parallel import REPLICAS, Alone
from training.parallel.distributed import (AgreedStop, DistEnv, all_reduce, barrier, check_launcher, env_world,
                                           init_distributed, local_grad_accum)

log = logging.getLogger("train")


class ParallelPlan:
    """Where this process sits (`env`: rank, world, the groups) and the parts that lay the run out."""

    def __init__(self, env: DistEnv | None = None, parallel: str = "ddp"):
        self.env = env = env or DistEnv()
        # who this rank is; the data-parallel rank says which share of the windows its group reads
        self.rank, self.world_size, self.is_main = env.rank, env.world_size, env.is_main
        self.dp_rank, self.dp_size = env.dp_rank, env.dp_size
        if parallel not in REPLICAS:
            raise ValueError(f"trainer.parallel={parallel!r}: expected one of {', '.join(REPLICAS)}")
        self.replicas: Alone = REPLICAS[parallel]() if self.env.enabled else Alone()
        self.context = ContextSplit(self.env.cp_size, self.env.cp_group)

    @classmethod
    def from_config(cls, cfg: DictConfig, device: torch.device) -> tuple["ParallelPlan", torch.device]:
        """The plan of `cfg.trainer` over torchrun's processes, and this rank's device. What the
        layout refuses (a world the context-parallel size does not divide, a global batch the
        data-parallel ranks cannot share) is one line before the process group is joined."""
        t, world = cfg.trainer, env_world()[1]
        check_launcher(world)   # WORLD_SIZE left in a shell: say that, not what the world size would imply
        check_context_parallel(cfg, world)
        local_grad_accum(t.grad_accum, world, context_parallel_size(cfg))
        env = init_distributed(device.type, t.dist_timeout_s, context_parallel_size(cfg))
        if not env.enabled and t.parallel != "ddp":
            log.warning("trainer.parallel=%s has no effect in a single process (start several with torchrun)",
                        t.parallel)
        if device.type == "cuda" and env.enabled:
            device = torch.device("cuda", env.local_rank)
        return cls(env, t.parallel), device

    # ------------------------------------------------------------------------- layout

    def micro_steps(self, grad_accum: int) -> int:
        """Micro-batches per rank per optimizer step (the global batch stays the config's)."""
        return local_grad_accum(grad_accum, self.env.world_size, self.env.cp_size)

    def describe(self) -> str:
        """The layout for the run's first line ('' alone)."""
        if not self.env.enabled:
            return ""
        split = f", context_parallel={self.context.size}" if self.context.size > 1 else ""
        return f"{self.env.world_size} processes ({self.replicas.name}{split})"

    # ------------------------------------------------------------------------- the model and the step

    def parallelize(self, model: torch.nn.Module, device: torch.device, precision: str) -> torch.nn.Module:
        """The module the step calls: the context-parallel ring in the attention layers, then the
        replica part's wrapper (DDP, FSDP2 in place: build the optimizer after this)."""
        self.context.apply(model)
        return self.replicas.wrap(model, device, precision, self.env.world_size)

    def compile(self, model: torch.nn.Module, wrapped: torch.nn.Module):
        """`wrapped` compiled where the replica part and the model allow: whole (DDP: around the
        wrapper, so DDP's buckets split the graph), or each block and the head with its loss (the
        final norm, the vocab-sized matmul and the cross-entropy) under FSDP2. Offloaded
        activations: the saved-tensor hooks around each block cannot be traced, so the blocks
        compile alone (the head too only where the replica part asks)."""
        if not (self.replicas.compiles_blocks or model.config.offload_activations):
            return torch.compile(wrapped)
        for block in model.blocks:
            block.forward = torch.compile(block.forward)
        if self.replicas.compiles_blocks:
            model.head_loss = torch.compile(model.head_loss)
        return wrapped

    def set_gradient_sync(self, wrapped: torch.nn.Module, sync: bool) -> None:
        self.replicas.set_gradient_sync(wrapped, sync)

    def train_loss(self, forward, model, idx: torch.Tensor, targets: torch.Tensor,
                   document_ids: torch.Tensor | None = None) -> torch.Tensor:
        """The loss to back-propagate for one micro-batch (on this rank's device; document ids
        where the sampler made them)."""
        return self.context.train_loss(forward, idx, targets, document_ids, model.window)

    def eval_loss(self, model, idx: torch.Tensor, targets: torch.Tensor,
                  document_ids: torch.Tensor | None = None) -> torch.Tensor:
        """A validation batch's mean loss, or this rank's share of it (the shares add up over ranks)."""
        return self.context.share(model, idx, targets, document_ids, model.window)

    def eval_batches(self, batches: list) -> tuple[list, int]:
        """(this data-parallel rank's batches r, r + N, ..., how many forwards to run): a sharded
        model gathers its weights in every forward, so there every rank runs as many (a short
        rank repeats a batch and discards the result)."""
        own = batches[self.dp_rank::self.dp_size]
        return own, -(-len(batches) // self.dp_size) if self.replicas.even_forwards else len(own)

    # ------------------------------------------------------------------------- state

    @property
    def shards_state(self) -> bool:
        """Whether each rank holds only its shards of the state (the checkpoint store then saves a
        DCP folder that every rank writes into; else rank 0 writes one file)."""
        return self.replicas.shards_state

    def full_state(self, model, optimizer) -> tuple[dict | None, dict | None]:
        """(model, optimizer) state dicts of the whole model on rank 0 (None elsewhere), in the
        single-process format whatever the layout; every rank calls it (FSDP2 gathers)."""
        return self.replicas.full_state(model, optimizer, self.env.is_main)

    def load_optimizer(self, model, optimizer, state: dict) -> None:
        """Optimizer moments from a single-process-format state dict, onto this layout."""
        self.replicas.load_optimizer(model, optimizer, state)

    # ------------------------------------------------------------------------- agreeing across ranks

    def barrier(self) -> None:
        barrier(self.env)

    def mean(self, value: torch.Tensor) -> float:
        """The mean of `value` over all ranks (a host sync)."""
        return (all_reduce(value.detach().clone(), self.env) / self.env.world_size).item()

    def all_true(self, flag: torch.Tensor) -> bool:
        return bool(all_reduce(flag.to(torch.int32), self.env, torch.distributed.ReduceOp.MIN).item())

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """Summed in place over all ranks (nothing alone)."""
        return all_reduce(tensor, self.env)

    def agreed_stop(self, stop) -> AgreedStop:
        """A stop request (training.process.signals) agreed by every rank at one step boundary."""
        return AgreedStop(self.env, stop)

    def first_on_each_node(self, build):
        """`build()` on each node's local rank 0 first (e.g. the token cache), then on the others."""
        if not self.env.enabled:
            return build()
        result = error = None
        if self.env.local_rank == 0:
            try:
                result = build()
            except Exception as e:  # the others build next and raise the same error themselves
                error = e
        barrier(self.env)
        if error is not None:
            raise error
        return result if self.env.local_rank == 0 else build()
