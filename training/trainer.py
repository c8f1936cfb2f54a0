"""One `Trainer`: a run built from the config (through training.builders), the training step,
checkpoints and the loop, written once for `train.py`, the scripts and one or many processes.

    trainer = Trainer(cfg)      # bad input raises (ValueError, FileNotFoundError) before any step
    status = trainer.fit()      # the exit status train.py returns

`TrainStep` is the step alone (gradient accumulation, bf16 autocast, torch.compile, DDP/FSDP2,
clipping, optimizer): scripts that run a training step on a model of their own (max context,
step profile) call the same code as training does.
"""
from __future__ import annotations

import contextlib
import logging
import os
import sys
from pathlib import Path
from typing import Callable

import torch
from omegaconf import DictConfig, OmegaConf, open_dict
from tqdm import tqdm
from tqdm.contrib.logging import logging_redirect_tqdm

from data.tokenizer import save_tokenizer
from model.context_parallel import use_context_parallel
from training.builders import build_data, model_from_config, resolve_config
from training.checkpoint import (CheckpointError, CheckpointWriteError, checkpoint_dir, checkpoint_path,
                                 last_checkpoint_note, prune_checkpoints, restore_training_state, save_checkpoint,
                                 save_sharded_checkpoint)
from training.dcp import consolidate, is_sharded_checkpoint, load_sharded, optimizer_by_index
from training.context_parallel import check_context_parallel, context_parallel_loss, context_parallel_size
from training.device import autocast, cpu_threads, resolve_precision
from training.distributed import (AgreedStop, DistEnv, all_reduce, barrier, check_launcher, env_world, init_distributed,
                                  is_sharded, local_grad_accum, set_gradient_sync, wrap_model)
from training.evaluate import evaluate_loss
from training.export import WEIGHTS_NAME, save_weights
from training.faults import fault_line
from training.hf import load_hf_weights
from training.loggers import Loggers
from training.metrics import Throughput, mfu, peak_flops
from training.optim import build_optimizer, lr_at
from training.resume import plan_start, record, recover, superseded_dir
from training.rng import rng_state, seed_everything
from training.runfiles import write_text
from training.runlock import RunDirLock
from training.signals import StopRequest, stop_reason
from training.summary import RunReport

log = logging.getLogger("train")


# ----------------------------------------------------------------------------- the step

def clip_gradients(params: list, max_norm: float) -> torch.Tensor:
    """Total gradient norm (over all ranks' shards under FSDP), gradients scaled down to `max_norm`."""
    grads = [p.grad for p in params if p.grad is not None]
    norm = torch.nn.utils.get_total_norm(grads)
    if hasattr(norm, "full_tensor"):  # a DTensor: the norm of this rank's shard, made global
        norm = norm.full_tensor()
    torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm)
    return norm


class TrainStep:
    """One optimizer step of `micro_steps` micro-batches: forward under autocast (compiled when
    `trainer.compile`), backward, gradient reduction across ranks, clipping, optimizer. With
    context parallelism (`env.cp_size` > 1) the model's attention becomes the ring over the CP
    group and each micro-batch of whole windows is cut into this rank's chunks
    (training.context_parallel).

    `model` is the plain module (its state_dict is what checkpoints hold); the step calls
    `wrapped` (DDP, FSDP2-sharded, or the model itself), compiled or not. No host sync: the loss
    and gradient norm come back as device tensors.
    """

    def __init__(self, model, cfg: DictConfig, device: torch.device, env: DistEnv | None = None,
                 micro_steps: int | None = None):
        t, self.env = cfg.trainer, env or DistEnv()
        self.model, self.device, self.precision = model, device, resolve_precision(t.precision, device)
        if self.env.cp_size > 1:
            use_context_parallel(model, self.env.cp_group)
        self.wrapped = wrap_model(model, t.get("parallel", "ddp"), self.env, device, self.precision)
        self.optimizer = build_optimizer(model, cfg.optim, device)  # after sharding: over the shards
        self.params = list(model.parameters())
        self.forward = self._compile(self.wrapped) if t.compile else self.wrapped
        self.micro_steps = micro_steps or local_grad_accum(t.grad_accum, self.env.world_size, self.env.cp_size)
        self.grad_clip = cfg.optim.grad_clip or float("inf")

    def _compile(self, wrapped):
        # FSDP2: compile each block and the head with its loss (the final norm, the vocab-sized
        # matmul and the cross-entropy), as torchtitan compiles its blocks apart: FSDP's hooks run
        # on the modules' calls, outside the graphs (the root's unshard, which gathers the head,
        # comes before its forward). Offloaded activations: the saved-tensor hooks around each
        # block cannot be traced, so the blocks compile alone.
        if is_sharded(wrapped) or self.model.config.offload_activations:
            for block in self.model.blocks:
                block.forward = torch.compile(block.forward)
            if is_sharded(wrapped):
                self.model.head_loss = torch.compile(self.model.head_loss)
            return wrapped
        return torch.compile(wrapped)  # DDP: compiled around the wrapper, so DDP's buckets split the graph

    def micro_loss(self, idx: torch.Tensor, targets: torch.Tensor, document_ids: torch.Tensor | None = None
                   ) -> torch.Tensor:
        """The loss to back-propagate for one micro-batch: the model's mean, or under context
        parallelism C x this rank's share of it (gradients are averaged over all ranks). The
        document ids stay where the sampler made them (the CPU): context parallelism plans its
        ring from them on the host."""
        if self.env.cp_size == 1:
            masks = {} if document_ids is None else {"document_ids": document_ids.to(idx.device, non_blocking=True)}
            return self.forward(idx, targets, **masks)
        return self.env.cp_size * context_parallel_loss(self.forward, idx, targets, self.env.cp_group,
                                                        document_ids, self.model.window)

    def set_lr(self, lr: float) -> None:
        for group in self.optimizer.param_groups:
            group["lr"] = lr

    def __call__(self, next_batch: Callable[[], tuple]) -> tuple[torch.Tensor, torch.Tensor]:
        """(mean loss over this rank's micro-batches, total gradient norm), both device tensors;
        the run's loss is the mean of the first over all ranks."""
        n, device = self.micro_steps, self.device
        loss = torch.zeros((), device=device)
        for i in range(n):
            x, y, *doc_ids = next_batch()  # (x, y) or, with data.document_mask, (x, y, document ids)
            if self.env.enabled:
                set_gradient_sync(self.wrapped, i == n - 1)
            with autocast(device, self.precision):
                micro_loss = self.micro_loss(x.to(device, non_blocking=True), y.to(device, non_blocking=True),
                                             *doc_ids)
            (micro_loss / n).backward()
            loss += micro_loss.detach() / n
        grad_norm = clip_gradients(self.params, self.grad_clip)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return loss, grad_norm

    # ------------------------------------------------------------------------- full state

    def full_state(self) -> tuple[dict | None, dict | None]:
        """(model, optimizer) state dicts of the whole model on rank 0 (None elsewhere), in the
        single-process format whatever the parallelism, so any checkpoint resumes on any number
        of processes. Under FSDP every rank must call this (it gathers the shards)."""
        if not is_sharded(self.model):
            if not self.env.is_main:
                return None, None
            return self.model.state_dict(), self.optimizer.state_dict()
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict
        model_sd, optim_sd = get_state_dict(self.model, self.optimizer,
                                            options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if not self.env.is_main:
            return None, None
        return model_sd, optimizer_by_index(optim_sd)

    def _param_names(self) -> list[str]:
        """The optimizer's parameters in its own order, by name (a tied tensor under its first name)."""
        names = {}
        for name, p in self.model.named_parameters():
            names.setdefault(p, name)
        return [names[p] for group in self.optimizer.param_groups for p in group["params"]]

    def load_optimizer(self, state: dict) -> None:
        """Optimizer moments from a single-process-format state dict (any number of saving ranks)."""
        if not is_sharded(self.model):
            self.optimizer.load_state_dict(state)
            return
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict
        names = self._param_names()
        by_name = {"state": {names[int(k)]: v for k, v in state["state"].items()},
                   "param_groups": [{**g, "params": [names[int(i)] for i in g["params"]]}
                                    for g in state["param_groups"]]}
        set_optimizer_state_dict(self.model, self.optimizer, optim_state_dict=by_name,
                                 options=StateDictOptions(full_state_dict=True))


def check_param_groups(path, saved: dict, optimizer) -> None:
    """Refuse optimizer moments grouped otherwise than this run groups its parameters (which
    tensors are decayed), in one line that says which setting does it."""
    sizes = lambda groups: [len(g["params"]) for g in groups]  # noqa: E731
    if sizes(saved["param_groups"]) != sizes(optimizer.param_groups):
        raise CheckpointError(
            f"checkpoint {path} decays {sizes(saved['param_groups'])[0]} parameter tensors, this run "
            f"{sizes(optimizer.param_groups)[0]}: optim.decay_embeddings differs from the checkpoint's run (runs "
            f"from before that option decayed no embedding table: pass optim.decay_embeddings=false)")


class _DeferredOptimizerState:
    """Stands in for the optimizer while a checkpoint is restored into the unwrapped model: the
    optimizer is built after DDP/FSDP wrapping, and its state is loaded then.

    The moments are copied out of the checkpoint: it is memory-mapped, and the optimizer would
    keep its tensors (a load onto the same device and dtype does not copy), so the file's space
    would stay in use after pruning deletes it, until the process ends."""
    state: dict | None = None

    def load_state_dict(self, state: dict) -> None:
        from torch.utils._pytree import tree_map

        self.state = tree_map(lambda v: v.clone() if isinstance(v, torch.Tensor) else v, state)


# ----------------------------------------------------------------------------- the run

class Trainer:
    """A run: config resolved, processes joined, data, model, optimizer, resume, loggers."""

    def __init__(self, cfg: DictConfig, env: DistEnv | None = None):
        device = resolve_config(cfg)
        t, world = cfg.trainer, env.world_size if env else env_world()[1]
        if env is None:  # WORLD_SIZE left in a shell: say that, not what the world size would imply
            check_launcher(world)
        check_context_parallel(cfg, world)  # before any work
        micro_steps = local_grad_accum(t.grad_accum, world, context_parallel_size(cfg))
        self.env = env or init_distributed(device.type, t.dist_timeout_s, context_parallel_size(cfg))
        if not self.env.enabled and t.parallel == "fsdp":
            log.warning("trainer.parallel=fsdp has no effect in a single process (start several with torchrun)")
        if device.type == "cuda" and self.env.enabled:
            device = torch.device("cuda", self.env.local_rank)
        self.cfg, self.device, self.run_dir = cfg, device, Path(cfg.run.dir)
        # One live run per run.dir, held (by rank 0, the only writer) from before the first checkpoint
        # is looked at until the run ends; released by train.py, or by the OS however the process ends.
        self.lock = RunDirLock(self.run_dir) if self.env.is_main else contextlib.nullcontext()
        try:
            self._build(cfg, device, micro_steps)
        except BaseException:
            self.lock.__exit__(None, None, None)
            raise

    def _build(self, cfg: DictConfig, device: torch.device, micro_steps: int) -> None:
        t = cfg.trainer
        if self.env.is_main:   # what a start or save killed half-way left, put right (the writer, holding the lock)
            recover(self.run_dir)
        barrier(self.env)
        self.start = plan_start(cfg, self.run_dir)  # which checkpoint, which run: refusals before any work
        if device.type == "cpu":
            self._set_cpu_threads(cfg)
        seed_everything(cfg.seed)
        self.data = self._on_local_rank0_first(lambda: build_data(  # a CP group's ranks read the same windows
            cfg, seq_len=t.seq_len, seed=cfg.seed, rank=self.env.dp_rank, world_size=self.env.dp_size,
            progress=self.env.local_rank == 0))  # each node's builder reports its own node's cache
        model = model_from_config(cfg, self.data.vocab_size)
        if cfg.model.get("init_from") and not self.start.state:  # a resumed run's weights come from its checkpoint
            load_hf_weights(model, cfg.model.init_from)
        with open_dict(cfg):
            cfg.run.data_fingerprint = self.data.fingerprint
            cfg.run.num_params = model.num_params()
            cfg.run.world_size = self.env.world_size
        self.step, self.tokens, self.wandb_id, self.resumed_from = 0, 0, None, None
        self.data_change: dict | None = None  # recorded in data_changes.jsonl once the run starts
        self.val_loss: float | None = None  # the last evaluation's, what train.py returns to sweepers
        optimizer_state = _DeferredOptimizerState()
        if self.start.state:  # into the plain model, before DDP/FSDP wrapping
            path, state = self.start.checkpoint, self.start.state
            self.data_change = restore_training_state(
                path, state, model=model, optimizer=optimizer_state, sampler=self.data.train,
                data_fingerprint=self.data.fingerprint, model_cfg=OmegaConf.to_container(cfg.model),
                allow_data_change=bool(cfg.data.get("allow_changed", False)))
            self.step, self.tokens, self.wandb_id, self.resumed_from = (state["step"], state["tokens"],
                                                                        state["wandb_id"], path)
            self.start.state = None  # the tensors are in the model and optimizer now; the metadata stays
        self.model = model.to(device)
        self.train_step = TrainStep(self.model, cfg, device, self.env, micro_steps)
        if self.resumed_from is not None and is_sharded_checkpoint(self.resumed_from):
            load_sharded(self.resumed_from, self.model, self.optimizer)  # DCP reshards onto this run's ranks
        if optimizer_state.state is not None:
            check_param_groups(self.resumed_from, optimizer_state.state, self.optimizer)
            self.train_step.load_optimizer(optimizer_state.state)
        self.document_mask = bool(cfg.data.get("document_mask", False))
        self.val_batches = self.data.val_batches(t.batch_size, t.eval_batches, self.document_mask)

    def _set_cpu_threads(self, cfg: DictConfig) -> None:
        """torch's threads, chosen (training.device.cpu_threads) and recorded in the config, so the
        run's checkpoints carry the count a resume takes again."""
        saved = (self.start.state or {}).get("config", {}).get("trainer", {}).get("cpu_threads")
        threads, self.cpu_threads_reason = cpu_threads(cfg.trainer.cpu_threads,
                                                       int(os.environ.get("LOCAL_WORLD_SIZE", "1")), saved)
        torch.set_num_threads(threads)
        with open_dict(cfg):
            cfg.trainer.cpu_threads = threads

    @property
    def optimizer(self):
        return self.train_step.optimizer

    def _on_local_rank0_first(self, build):
        """Build (e.g. the token cache) on each node's local rank 0 first; the others then load it."""
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

    def next_batch(self) -> tuple:
        return self.data.train.next_batch(self.cfg.trainer.batch_size, self.document_mask)

    def evaluate(self) -> float:
        """Mean validation loss; under several processes each evaluates its share of the batches."""
        return evaluate_loss(self.model, self.val_batches, self.device, self.cfg.trainer.precision, self.env)

    def mean_over_ranks(self, value: torch.Tensor) -> float:
        return (all_reduce(value.detach().clone(), self.env) / self.env.world_size).item()

    def all_finite(self, healthy: torch.Tensor) -> bool:
        return bool(all_reduce(healthy.to(torch.int32), self.env, torch.distributed.ReduceOp.MIN).item())

    def save(self, config: dict, wandb_id: str | None, export: bool = False) -> Path | None:
        """Every rank takes part. Under FSDP each rank writes its shards of a DCP folder; otherwise
        rank 0 writes the whole state as one file (docs/parallel.md, "Checkpoints on several GPUs")."""
        meta = {"step": self.step, "tokens": self.tokens, "rng": rng_state(), "sampler": self.data.train.state_dict(),
                "config": config, "wandb_id": wandb_id, "lineage": self.start.lineage}
        if is_sharded(self.model):
            path = save_sharded_checkpoint(checkpoint_path(self.run_dir, self.step, sharded=True), meta, self.model,
                                           self.optimizer, self.env)
            model_sd = consolidate(path, keys=("model",))["model"] if export and self.env.is_main else None
        else:
            model_sd, optim_sd = self.train_step.full_state()
            path = None
            if self.env.is_main:
                path = save_checkpoint(checkpoint_path(self.run_dir, self.step),
                                       {**meta, "model": model_sd, "optimizer": optim_sd})
        if self.env.is_main:
            prune_checkpoints(checkpoint_dir(self.run_dir), self.cfg.trainer.keep_ckpts, self.start.run_id)
            if export:  # the weights only, read back from the folder on one process under FSDP
                save_weights(model_sd, self.run_dir / WEIGHTS_NAME, config)
        barrier(self.env)  # no rank exits (and makes torchrun stop the others) before the file is whole
        return path

    def export_missing_weights(self) -> Path | None:
        """A finished run whose final export is missing (its write failed, a full disk): write it now
        from the final checkpoint just loaded. Every rank takes part (FSDP gathers)."""
        path = self.run_dir / WEIGHTS_NAME
        if self.step != self.cfg.trainer.max_steps or path.exists():
            return None
        model_sd, _ = self.train_step.full_state()
        if self.env.is_main:
            save_weights(model_sd, path, OmegaConf.to_container(self.cfg))
            log.info("wrote the missing %s from %s", path, self.resumed_from)
        barrier(self.env)
        return path

    def note(self) -> str:
        """Where this run's last good checkpoint is."""
        return last_checkpoint_note(self.run_dir, self.start.run_id)

    def _open_run_files(self, cfg: DictConfig, config: dict) -> Loggers:
        """Rank 0, once the run is accepted: the loggers (wandb first: it is the one that can fail),
        a rewind's later files set aside, the start in lineage.jsonl, config.yaml, the tokenizer."""
        loggers = Loggers(cfg, self.run_dir, config, self.wandb_id)
        record(self.run_dir, self.start, superseded_dir(self.run_dir, self.start), self.data_change)
        loggers.open_metrics(self.step if self.resumed_from else None)
        write_text(self.run_dir / "config.yaml", OmegaConf.to_yaml(cfg))
        save_tokenizer(self.data.tokenizer, self.run_dir)  # evals and generation need no corpus
        return loggers

    def fit(self) -> int:
        """The training loop; returns the process exit status. When to log, evaluate and save is
        the `Cadence`'s; what a failure becomes (a status, a line) is `_failed`'s."""
        t = self.cfg.trainer
        self._config, self._loggers, self._loss = OmegaConf.to_container(self.cfg), None, None
        self._healthy = torch.ones((), dtype=torch.bool, device=self.device)  # checked when the host syncs anyway
        cadence, meter = Cadence(t), Throughput()
        try:
            report = self._start_run()
            with StopRequest() as stop, logging_redirect_tqdm(), self._progress_bar() as bar:
                agreed, stopping = AgreedStop(self.env, stop), False
                while self.step < t.max_steps and not stopping:
                    lr = lr_at(self.step, self.cfg.optim, t.max_steps)
                    self.train_step.set_lr(lr)
                    self._loss, grad_norm = self.train_step(self.next_batch)
                    self._healthy &= torch.isfinite(self._loss) & torch.isfinite(grad_norm)
                    self.step, self.tokens = self.step + 1, self.tokens + cadence.tokens_per_step
                    meter.add(cadence.tokens_per_step)
                    bar.update()
                    stopping = agreed.poll()
                    evaluated, saved = cadence.evaluate(self.step), cadence.save(self.step, stopping)
                    if cadence.log(self.step):
                        self._log_step(grad_norm, lr, meter, evaluated, bar)
                    if saved:
                        self._save_checked(export=cadence.last(self.step))
                    if saved or evaluated:
                        meter.restart()  # tokens/s measures training steps, not evals and saves
                agreed.finish()
        except (FloatingPointError, KeyboardInterrupt, Exception) as e:  # noqa: BLE001 (_failed re-raises the rest)
            return self._failed(e)
        exit_code = stop.exit_code or agreed.exit_code
        last_loss = self.mean_over_ranks(self._loss) if self._loss is not None else None   # the last step's, logged or not
        self._close(exit_code)
        if exit_code and self.env.is_main:
            log.warning("%s: checkpoint saved at step %d", stop_reason(exit_code - 128), self.step)
        if self.env.is_main:
            report.finish(self.step, t.max_steps, self.tokens, exit_code, last_loss)
        return exit_code

    def _start_run(self) -> RunReport | None:
        """Rank 0: the run's files and loggers opened, its first line logged; the report of where it is."""
        cfg, t, env = self.cfg, self.cfg.trainer, self.env
        self._peak, self._flops_per_token = peak_flops(self.device, t.peak_flops), self.model.flops_per_token(t.seq_len)
        if not env.is_main:
            return None
        self._loggers = self._open_run_files(cfg, self._config)
        report = RunReport(cfg, self.run_dir, env.world_size, self.step)   # where the run is, how to resume it
        log.info("%s: %s params, attention=%s%s, device=%s, precision=%s, data=%s%s%s", cfg.model.name,
                 f"{cfg.run.num_params:,}", cfg.attention.name,
                 f" (kernels: {cfg.attention.plan})" if cfg.attention.name == "flash" else "",
                 self.device, t.precision,
                 cfg.run.data_fingerprint,
                 f", {env.world_size} processes ({t.parallel}"
                 f"{f', context_parallel={env.cp_size}' if env.cp_size > 1 else ''})" if env.enabled else "",
                 f", resumed from {self.resumed_from} (step {self.step})" if self.resumed_from else "")
        if self.device.type == "cpu":
            log.info("CPU threads: %d (%s)", t.cpu_threads, self.cpu_threads_reason)
        return report

    def _progress_bar(self) -> tqdm:
        t = self.cfg.trainer
        return tqdm(total=t.max_steps, initial=self.step, unit="step",
                    disable=not (t.progress and self.env.is_main and sys.stderr.isatty()),  # no bar frames in a log file
                    dynamic_ncols=True)

    def _check_finite(self) -> None:
        if not self.all_finite(self._healthy):
            raise FloatingPointError(
                f"loss or gradient became NaN/inf by step {self.step} (last loss {self._loss.item()}); stopped "
                f"without saving: {self.note()}")

    def _log_step(self, grad_norm: torch.Tensor, lr: float, meter: Throughput, evaluate: bool, bar: tqdm) -> None:
        """One metrics row (the validation loss too when `evaluate`), to the loggers and the log;
        tokens/s is read after the finiteness check has synced the device."""
        self._check_finite()
        t = self.cfg.trainer
        row = {"step": self.step, "loss": self.mean_over_ranks(self._loss), "lr": lr,
               "tokens": self.tokens, "tokens_per_s": meter.rate(), "grad_norm": grad_norm.item()}
        if self._peak:
            row["mfu"] = mfu(row["tokens_per_s"], self._flops_per_token, self._peak, self.env.world_size)
        if self.device.type == "cuda":   # the allocator's peak since the process began (this rank's)
            row["peak_memory_bytes"] = torch.cuda.max_memory_allocated(self.device)
        if evaluate:
            row["val_loss"] = self.val_loss = self.evaluate()
        if self.env.is_main:
            self._loggers.log(row)
            bar.set_postfix(loss=f"{row['loss']:.4f}", tok_s=f"{row['tokens_per_s']:.0f}")
            log.info("step %d/%d | loss %.4f | lr %.2e | %.0f tok/s%s%s", self.step, t.max_steps,
                     row["loss"], lr, row["tokens_per_s"],
                     f" | mfu {row['mfu']:.1%}" if self._peak else "",
                     f" | val_loss {row['val_loss']:.4f}" if evaluate else "")

    def _save_checked(self, export: bool = False) -> None:
        self._check_finite()  # never let a poisoned state replace the last good checkpoint
        path = self.save(self._config, self._loggers.wandb_id if self._loggers else None, export)
        if self.env.is_main:
            log.info("saved %s", path)

    def _close(self, exit_code: int) -> None:
        if self._loggers:
            with contextlib.suppress(OSError):
                self._loggers.close(exit_code=exit_code)

    def _failed(self, e: BaseException) -> int:
        """The exit status of a run that stopped on `e`, its one line on stderr: 1 for NaN/inf, 2 for
        the machine's faults (and bad input found before the loggers opened); a second Ctrl-C and
        anything else are re-raised (train.py words the first, the second is a bug's traceback)."""
        if isinstance(e, FloatingPointError):
            self._close(1)
            print(f"error: {e}", file=sys.stderr)
            return 1
        interrupt = _second_ctrl_c(e)
        if interrupt is not None:
            self._close(130)
            raise interrupt
        line = e.strerror if isinstance(e, CheckpointWriteError) else (
            str(e) if isinstance(e, ValueError) and self._loggers is None else fault_line(e))
        if line is None:
            raise e
        self._close(2)
        who = "" if self.env.is_main else f"rank {self.env.rank}: "
        print(f"{who}error: {line.splitlines()[0]}; {self.note()}", file=sys.stderr)
        return 2


def _second_ctrl_c(e: BaseException | None) -> KeyboardInterrupt | None:
    """The KeyboardInterrupt behind `e`: itself, or the one a library's clean-up turned into another
    error while unwinding (a second Ctrl-C during a save: torch.save's zip writer then raises a
    RuntimeError from its __exit__, with the interrupt as its context)."""
    while e is not None and not isinstance(e, KeyboardInterrupt):
        e = e.__context__
    return e


class Cadence:
    """When the loop logs, evaluates and saves: every `trainer.log_every`, `eval_every` and
    `ckpt_every` steps (0: never), and always evaluates and saves (with the weights export) at the
    last step; a stop request saves where the run is."""

    def __init__(self, t: DictConfig):
        self.max_steps, self.log_every, self.eval_every, self.ckpt_every = (t.max_steps, t.log_every, t.eval_every,
                                                                             t.ckpt_every)
        self.tokens_per_step = t.batch_size * t.seq_len * t.grad_accum  # over all ranks: as configured

    def last(self, step: int) -> bool:
        return step == self.max_steps

    def evaluate(self, step: int) -> bool:
        return self.last(step) or bool(self.eval_every and step % self.eval_every == 0)

    def log(self, step: int) -> bool:
        return self.evaluate(step) or step % self.log_every == 0

    def save(self, step: int, stopping: bool) -> bool:
        return self.last(step) or bool(self.ckpt_every and step % self.ckpt_every == 0) or stopping
