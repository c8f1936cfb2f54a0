"""One `Trainer`: a run built from the config (through training.builders), its loop, its
checkpoints and its failures, written once for `train.py`, the scripts and one or many processes.

    trainer = Trainer(cfg)      # bad input raises (ValueError, FileNotFoundError) before any step
    status = trainer.fit()      # the exit status train.py returns

How the run is laid out over processes is the parallel plan's (training.parallel.plan), where a
checkpoint goes and in which format the checkpoint store's (training.run.store), where a start
picks a run up the resume planner's (training.run.resume): the loop asks them and branches on
neither the parallel mode nor the checkpoint format. The step alone is `TrainStep`
(training/loop/step.py).
"""
from __future__ import annotations

import contextlib
import logging
import os
import sys
from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf, open_dict
from tqdm import tqdm
from tqdm.contrib.logging import logging_redirect_tqdm

from training.builders import build_data, model_from_config, resolve_config
from training.interop.huggingface import load_hf_weights
from training.interop.weights import save_weights
from training.loop.evaluate import check_probe_lengths, evaluate_loss, passkey_probe
from training.loop.loggers import Loggers
from training.loop.optim import lr_at
from training.loop.step import TrainStep
from training.loop.throughput import Throughput, mfu, peak_flops
from training.parallel.plan import ParallelPlan
from training.process.device import cpu_threads
from training.process.exits import BAD_INPUT, DIVERGED, INTERRUPTED
from training.process.faults import fault_line
from training.process.rng import rng_state, seed_everything
from training.process.signals import StopRequest, stop_reason
from training.run.files import CONFIG, TOKENIZER, WEIGHTS, copy_in, write_text
from training.run.lineage import record, recover, superseded_dir
from training.run.lock import RunDirLock
from training.run.report import RunReport
from training.run.resume import check_tokenizer, plan_start, restore
from training.run.store import CheckpointStore, CheckpointWriteError

log = logging.getLogger("train")


# ----------------------------------------------------------------------------- the run

class Trainer:
    """A run: config resolved, processes joined, data, model, optimizer, resume, loggers."""

    def __init__(self, cfg: DictConfig):
        device = resolve_config(cfg)
        self.plan, device = ParallelPlan.from_config(cfg, device)   # refusals, then the processes joined
        self.cfg, self.device, self.run_dir = cfg, device, Path(cfg.run.dir)
        self.store = CheckpointStore(self.run_dir)
        # One live run per run.dir, held (by rank 0, the only writer) from before the first checkpoint
        # is looked at until the run ends; released by train.py, or by the OS however the process ends.
        self.lock = RunDirLock(self.run_dir) if self.plan.is_main else contextlib.nullcontext()
        try:
            self._build(cfg, device)
        except BaseException:
            self.lock.__exit__(None, None, None)
            raise

    def _build(self, cfg: DictConfig, device: torch.device) -> None:
        t, plan = cfg.trainer, self.plan
        if plan.is_main:   # what a start or save killed half-way left, put right (the writer, holding the lock)
            recover(self.run_dir)
        plan.barrier()
        self.start = plan_start(cfg, self.store)  # which checkpoint, which run: refusals before any work
        if device.type == "cpu":
            self._set_cpu_threads(cfg)
        seed_everything(cfg.seed)
        self.data = plan.first_on_each_node(lambda: build_data(  # a CP group's ranks read the same windows
            cfg, seq_len=t.seq_len, seed=cfg.seed, rank=plan.dp_rank, world_size=plan.dp_size,
            progress=plan.env.local_rank == 0,  # each node's builder reports its own node's cache
            check_tokenizer=lambda fingerprint: check_tokenizer(self.start, fingerprint)))
        check_probe_lengths(list(t.get("passkey_probe") or []), self.data.tokenizer)
        model = model_from_config(cfg, self.data.vocab_size)
        if cfg.model.get("init_from") and not self.start.state:  # a resumed run's weights come from its checkpoint
            load_hf_weights(model, cfg.model.init_from)
        with open_dict(cfg):
            cfg.run.data_fingerprint = self.data.fingerprint
            cfg.run.num_params = model.num_params()
            cfg.run.world_size = plan.world_size
        self.val_loss: float | None = None  # the last evaluation's, what train.py returns to sweepers
        # the checkpoint (if any) into the plain model, the sampler and the RNGs; the data change is
        # recorded in data_changes.jsonl once the run starts
        restored, self.data_change = restore(self.start, model=model, sampler=self.data.train,
                                             data_fingerprint=self.data.fingerprint, cfg=cfg)
        self.step, self.tokens, self.wandb_id, self.resumed_from = (restored.step, restored.tokens,
                                                                    restored.wandb_id, restored.path)
        self.model = model.to(device)
        self.train_step = TrainStep(self.model, cfg, device, plan)
        restored.finish(self.model, self.optimizer, plan)   # the optimizer's moments, onto the plan's layout
        self.document_mask = bool(cfg.data.get("document_mask", False))
        self.val_batches = self.data.val_batches(t.batch_size, t.eval_batches, self.document_mask)

    def _set_cpu_threads(self, cfg: DictConfig) -> None:
        """torch's threads, chosen (training.process.device.cpu_threads) and recorded in the config, so the
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

    def next_batch(self) -> tuple:
        return self.data.train.next_batch(self.cfg.trainer.batch_size, self.document_mask)

    def evaluate(self) -> float:
        """Mean validation loss; under several processes each evaluates its share of the batches."""
        return evaluate_loss(self.model, self.val_batches, self.device, self.cfg.trainer.precision, self.plan)

    def probe_passkey(self) -> dict[str, float]:
        """`trainer.passkey_probe`: passkey accuracy at each of its prompt lengths (depths 0, 0.5 and 1,
        `passkey_trials` keys each, the same keys every time), as `passkey_<length>` metrics; so a
        long-context run's log says when retrieval forms, which its per-token loss cannot. Every
        rank runs the same prompts (FSDP's forwards gather weights on all of them)."""
        t = self.cfg.trainer
        lengths = list(t.get("passkey_probe") or [])
        if not lengths:
            return {}
        accuracy = passkey_probe(self.model, self.data.tokenizer, lengths, [0.0, 0.5, 1.0], int(t.passkey_trials),
                                 self.device, t.precision)
        return {f"passkey_{n}": a for n, a in accuracy.items()}

    def save(self, config: dict, wandb_id: str | None, export: bool = False) -> Path | None:
        """Every rank takes part: the checkpoint store writes what the plan holds, in the format the
        plan asks for (docs/parallel.md, "Checkpoints on several GPUs"); rank 0 then prunes and,
        with `export`, writes the weights alone."""
        meta = {"step": self.step, "tokens": self.tokens, "rng": rng_state(), "sampler": self.data.train.state_dict(),
                "config": config, "wandb_id": wandb_id, "lineage": self.start.lineage}
        path, weights = self.store.save(meta, self.model, self.optimizer, self.plan, weights=export)
        if self.plan.is_main:
            self.store.prune(self.cfg.trainer.keep_ckpts, self.start.run_id)
            if export:
                save_weights(weights, self.run_dir / WEIGHTS, config)
        self.plan.barrier()  # no rank exits (and makes torchrun stop the others) before the file is whole
        return path

    def export_missing_weights(self) -> Path | None:
        """A finished run whose final export is missing (its write failed, a full disk): write it now
        from the final checkpoint just loaded. Every rank takes part (FSDP gathers)."""
        path = self.run_dir / WEIGHTS
        if self.step != self.cfg.trainer.max_steps or path.exists():
            return None
        model_sd, _ = self.train_step.full_state()
        if self.plan.is_main:
            save_weights(model_sd, path, OmegaConf.to_container(self.cfg))
            log.info("wrote the missing %s from %s", path, self.resumed_from)
        self.plan.barrier()
        return path

    def note(self) -> str:
        """Where this run's last good checkpoint is."""
        return self.store.note(self.start.run_id)

    def _open_run_files(self, cfg: DictConfig, config: dict) -> Loggers:
        """Rank 0, once the run is accepted: the loggers (wandb first: it is the one that can fail),
        a rewind's later files set aside, the start in lineage.jsonl, config.yaml, the tokenizer."""
        loggers = Loggers(cfg, self.run_dir, config, self.wandb_id)
        record(self.run_dir, self.start, superseded_dir(self.run_dir, self.start), self.data_change)
        loggers.open_metrics(self.step if self.resumed_from else None)
        write_text(self.run_dir / CONFIG, OmegaConf.to_yaml(cfg))
        tokenizer_file = getattr(self.data.tokenizer, "path", None)   # the bytes tokenizer has none: its name says it all
        if tokenizer_file is not None:
            copy_in(tokenizer_file, self.run_dir / TOKENIZER)   # evals and generation need no corpus
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
                agreed, stopping = self.plan.agreed_stop(stop), False
                while self.step < t.max_steps and not stopping:
                    lr = lr_at(self.step, self.cfg.optim, t.max_steps)
                    self.train_step.set_lr(lr)
                    self._loss, grad_norm = self.train_step(self.next_batch)
                    self._healthy &= torch.isfinite(self._loss) & torch.isfinite(grad_norm)
                    self.step, self.tokens = self.step + 1, self.tokens + cadence.tokens_per_step
                    meter.add(cadence.tokens_per_step)
                    bar.update()
                    stop.reclaim()   # native code may have replaced the handlers during the step
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
        last_loss = self.plan.mean(self._loss) if self._loss is not None else None   # the last step's, logged or not
        self._close(exit_code)
        if exit_code and self.plan.is_main:
            log.warning("%s: checkpoint saved at step %d", stop_reason(exit_code - 128), self.step)
        if self.plan.is_main:
            report.finish(self.step, t.max_steps, self.tokens, exit_code, last_loss)
        return exit_code

    def _start_run(self) -> RunReport | None:
        """Rank 0: the run's files and loggers opened, its first line logged; the report of where it is."""
        cfg, t, plan = self.cfg, self.cfg.trainer, self.plan
        self._peak, self._flops_per_token = peak_flops(self.device, t.peak_flops), self.model.flops_per_token(t.seq_len)
        if not plan.is_main:
            return None
        self._loggers = self._open_run_files(cfg, self._config)
        report = RunReport(cfg, self.run_dir, plan.world_size, self.step)   # where the run is, how to resume it
        log.info("%s: %s params, attention=%s%s, device=%s, precision=%s, data=%s%s%s", cfg.model.name,
                 f"{cfg.run.num_params:,}", cfg.attention.name,
                 f" (kernels: {cfg.attention.plan})" if cfg.attention.name == "flash" else "",
                 self.device, t.precision,
                 cfg.run.data_fingerprint, f", {plan.describe()}" if plan.describe() else "",
                 f", resumed from {self.resumed_from} (step {self.step})" if self.resumed_from else "")
        if self.device.type == "cpu":
            log.info("CPU threads: %d (%s)", t.cpu_threads, self.cpu_threads_reason)
        return report

    def _progress_bar(self) -> tqdm:
        t = self.cfg.trainer
        return tqdm(total=t.max_steps, initial=self.step, unit="step",
                    disable=not (t.progress and self.plan.is_main and sys.stderr.isatty()),  # no bar frames in a log file
                    dynamic_ncols=True)

    def _check_finite(self) -> None:
        if not self.plan.all_true(self._healthy):
            raise FloatingPointError(
                f"loss or gradient became NaN/inf by step {self.step} (last loss {self._loss.item()}); stopped "
                f"without saving: {self.note()}")

    def _log_step(self, grad_norm: torch.Tensor, lr: float, meter: Throughput, evaluate: bool, bar: tqdm) -> None:
        """One metrics row (the validation loss too when `evaluate`), to the loggers and the log;
        tokens/s is read after the finiteness check has synced the device."""
        self._check_finite()
        t = self.cfg.trainer
        row = {"step": self.step, "loss": self.plan.mean(self._loss), "lr": lr,
               "tokens": self.tokens, "tokens_per_s": meter.rate(), "grad_norm": grad_norm.item()}
        if self._peak:
            row["mfu"] = mfu(row["tokens_per_s"], self._flops_per_token, self._peak, self.plan.world_size)
        if self.device.type == "cuda":   # the allocator's peak since the process began (this rank's)
            row["peak_memory_bytes"] = torch.cuda.max_memory_allocated(self.device)
        if evaluate:
            row["val_loss"] = self.val_loss = self.evaluate()
            row.update(self.probe_passkey())
        if self.plan.is_main:
            self._loggers.log(row)
            bar.set_postfix(loss=f"{row['loss']:.4f}", tok_s=f"{row['tokens_per_s']:.0f}")
            log.info("step %d/%d | loss %.4f | lr %.2e | %.0f tok/s%s%s%s", self.step, t.max_steps,
                     row["loss"], lr, row["tokens_per_s"],
                     f" | mfu {row['mfu']:.1%}" if self._peak else "",
                     f" | val_loss {row['val_loss']:.4f}" if evaluate else "",
                     "".join(f" | {k} {v:.2f}" for k, v in row.items() if k.startswith("passkey_")))

    def _save_checked(self, export: bool = False) -> None:
        self._check_finite()  # never let a poisoned state replace the last good checkpoint
        path = self.save(self._config, self._loggers.wandb_id if self._loggers else None, export)
        if self.plan.is_main:
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
            self._close(DIVERGED)
            print(f"error: {e}", file=sys.stderr)
            return DIVERGED
        interrupt = _second_ctrl_c(e)
        if interrupt is not None:
            self._close(INTERRUPTED)
            raise interrupt
        line = e.strerror if isinstance(e, CheckpointWriteError) else (
            str(e) if isinstance(e, ValueError) and self._loggers is None else fault_line(e))
        if line is None:
            raise e
        self._close(BAD_INPUT)
        who = "" if self.plan.is_main else f"rank {self.plan.rank}: "
        print(f"{who}error: {line.splitlines()[0]}; {self.note()}", file=sys.stderr)
        return BAD_INPUT


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
