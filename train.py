"""Train a GPT: `python train.py [group=option ...] [key=value ...]` (see README.md).

Exit status: 0 finished; 1 the loss went NaN/inf (no checkpoint written after it); 2 bad input
(config key or value, data path, folder, checkpoint, a run.dir in use), reported in one line before
any step runs, or a write error such as a full disk during training (older checkpoints kept); 130 (Ctrl-C)
or 143 (SIGTERM) stopped at a step boundary after saving a checkpoint: rerun with resume=auto.
"""
from __future__ import annotations

import contextlib
import logging
import sys
from pathlib import Path
from types import SimpleNamespace

import hydra
import torch
from omegaconf import DictConfig, OmegaConf, open_dict
from omegaconf.errors import OmegaConfBaseException
from tqdm import tqdm
from tqdm.contrib.logging import logging_redirect_tqdm

from data import build_data
from model import build_model
from model.attention import resolve_attention
from training.checkpoint import (CheckpointWriteError, checkpoint_dir, checkpoint_path, find_resume_checkpoint,
                                 last_checkpoint_note, prune_checkpoints, restore_training_state, save_checkpoint)
from training.config import exit_on_config_error, validate_run
from training.device import autocast, resolve_device, resolve_precision
from training.evaluate import evaluate_loss
from training.hf import apply_init_from, load_hf_weights
from training.loggers import Loggers, validate_logger
from training.metrics import Throughput, peak_flops
from training.optim import build_optimizer, lr_at, validate_optim
from training.rng import rng_state, seed_everything
from training.runlock import RunDirLock
from training.signals import StopRequest

log = logging.getLogger("train")


def setup(cfg: DictConfig) -> SimpleNamespace:
    """Everything that can fail on bad input, done before the first step."""
    OmegaConf.resolve(cfg)
    if cfg.model.get("init_from"):
        apply_init_from(cfg)  # the Hugging Face folder's architecture and tokenizer replace the configured ones
    validate_run(cfg)
    validate_optim(cfg.optim)
    validate_logger(cfg.logger)
    device = resolve_device(cfg.device)
    with open_dict(cfg):  # record what `auto` became
        cfg.device = device.type
        cfg.attention.name = resolve_attention(cfg.attention.name, device)
        cfg.trainer.precision = resolve_precision(cfg.trainer.precision, device)
    run_dir = Path(cfg.run.dir)
    lock = RunDirLock(run_dir)  # released by train(), or by the OS however this process ends
    try:
        return _setup_locked(cfg, device, run_dir, lock)
    except BaseException:
        lock.release()
        raise


def _setup_locked(cfg: DictConfig, device: torch.device, run_dir: Path, lock: RunDirLock) -> SimpleNamespace:
    resume = find_resume_checkpoint(cfg.resume, run_dir)
    seed_everything(cfg.seed)
    data = build_data(cfg, seq_len=cfg.trainer.seq_len, seed=cfg.seed, rank=0, world_size=1)
    model = build_model(cfg.model, vocab_size=data.vocab_size, attention=cfg.attention.name)
    if cfg.model.get("init_from") and not resume:  # a resumed run's weights come from its checkpoint
        load_hf_weights(model, cfg.model.init_from)
    with open_dict(cfg):
        cfg.run.data_fingerprint = data.fingerprint
        cfg.run.num_params = model.num_params()
    run = SimpleNamespace(cfg=cfg, device=device, run_dir=run_dir, lock=lock, data=data, model=model.to(device),
                          step=0, tokens=0, wandb_id=None, resumed_from=None,
                          val_batches=data.val_batches(cfg.trainer.batch_size, cfg.trainer.eval_batches))
    run.optimizer = build_optimizer(run.model, cfg.optim, device)
    if resume:
        path, state = resume
        restore_training_state(path, state, model=run.model, optimizer=run.optimizer, sampler=data.train,
                               data_fingerprint=data.fingerprint, model_cfg=OmegaConf.to_container(cfg.model),
                               allow_data_change=bool(cfg.data.get("allow_changed", False)), run_dir=run_dir)
        run.step, run.tokens, run.wandb_id, run.resumed_from = state["step"], state["tokens"], state["wandb_id"], path
    return run


def fit(run: SimpleNamespace) -> int:
    """The training loop; returns the process exit status."""
    cfg, t, device, model, optimizer = run.cfg, run.cfg.trainer, run.device, run.model, run.optimizer
    config = OmegaConf.to_container(cfg)
    run.run_dir.mkdir(parents=True, exist_ok=True)
    OmegaConf.save(cfg, run.run_dir / "config.yaml")
    loggers = Loggers(cfg, run.run_dir, config, run.step if run.resumed_from else None, run.wandb_id)
    log.info("%s: %s params, attention=%s, device=%s, precision=%s, data=%s%s", cfg.model.name,
             f"{cfg.run.num_params:,}", cfg.attention.name, device, t.precision, cfg.run.data_fingerprint,
             f", resumed from {run.resumed_from} (step {run.step})" if run.resumed_from else "")
    step_fn = torch.compile(model) if t.compile else model  # checkpoints save `model`: no _orig_mod. keys
    tokens_per_step = t.batch_size * t.seq_len * t.grad_accum
    peak = peak_flops(device, t.peak_flops)
    flops_per_token = model.flops_per_token(t.seq_len)
    healthy = torch.ones((), dtype=torch.bool, device=device)  # checked when the host syncs anyway
    meter, step, tokens, saved_step = Throughput(), run.step, run.tokens, run.step

    def check_finite() -> None:
        if not healthy.item():
            raise FloatingPointError(f"loss or gradient became NaN/inf by step {step} (last loss {loss.item()}); "
                                     f"stopped without saving: {last_checkpoint_note(run.run_dir)}")

    def save() -> None:
        nonlocal saved_step
        check_finite()  # never let a poisoned state replace the last good checkpoint
        path = save_checkpoint(checkpoint_path(run.run_dir, step), {
            "step": step, "tokens": tokens, "model": model.state_dict(), "optimizer": optimizer.state_dict(),
            "rng": rng_state(), "sampler": run.data.train.state_dict(), "config": config,
            "wandb_id": loggers.wandb_id})
        prune_checkpoints(checkpoint_dir(run.run_dir), t.keep_ckpts)
        saved_step = step
        log.info("saved %s", path)

    try:
        with StopRequest() as stop, logging_redirect_tqdm(), tqdm(
                total=t.max_steps, initial=step, disable=not t.progress, unit="step", dynamic_ncols=True) as bar:
            while step < t.max_steps and not stop.requested:
                lr = lr_at(step, cfg.optim, t.max_steps)
                for group in optimizer.param_groups:
                    group["lr"] = lr
                loss = torch.zeros((), device=device)
                for _ in range(t.grad_accum):
                    x, y = run.data.train.next_batch(t.batch_size)
                    with autocast(device, t.precision):
                        micro_loss = step_fn(x.to(device, non_blocking=True), y.to(device, non_blocking=True))
                    (micro_loss / t.grad_accum).backward()
                    loss += micro_loss.detach() / t.grad_accum
                grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.optim.grad_clip or float("inf"))
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                healthy &= torch.isfinite(loss) & torch.isfinite(grad_norm)
                step, tokens = step + 1, tokens + tokens_per_step
                meter.add(tokens_per_step)
                bar.update()

                last = step == t.max_steps
                eval_now = last or (t.eval_every and step % t.eval_every == 0)
                if eval_now or step % t.log_every == 0:
                    check_finite()
                    row = {"step": step, "loss": loss.item(), "lr": lr, "tokens": tokens,
                           "tokens_per_s": meter.rate(), "grad_norm": grad_norm.item()}
                    if peak:
                        row["mfu"] = row["tokens_per_s"] * flops_per_token / peak
                    if eval_now:
                        row["val_loss"] = evaluate_loss(model, run.val_batches, device, t.precision)
                    loggers.log(row)
                    bar.set_postfix(loss=f"{row['loss']:.4f}", tok_s=f"{row['tokens_per_s']:.0f}")
                    log.info("step %d/%d | loss %.4f | lr %.2e | %.0f tok/s%s%s", step, t.max_steps, row["loss"],
                             lr, row["tokens_per_s"], f" | mfu {row['mfu']:.1%}" if peak else "",
                             f" | val_loss {row['val_loss']:.4f}" if eval_now else "")
                if last or (t.ckpt_every and step % t.ckpt_every == 0) or stop.requested:
                    save()
                if step == saved_step or eval_now:
                    meter.restart()  # tokens/s measures training steps, not evals and saves
            if stop.requested and saved_step != step:  # the signal came after this step's save decision
                save()
    except FloatingPointError as e:
        loggers.close(exit_code=1)
        print(f"error: {e}", file=sys.stderr)
        return 1
    except OSError as e:  # a full disk or a folder gone read-only: checkpoints up to the last good one remain
        with contextlib.suppress(OSError):
            loggers.close(exit_code=2)
        print(f"error: {e.strerror if isinstance(e, CheckpointWriteError) else e}; {last_checkpoint_note(run.run_dir)}",
              file=sys.stderr)
        return 2
    loggers.close(exit_code=stop.exit_code)
    if stop.requested:
        log.warning("%s received: checkpoint saved at step %d; rerun with resume=auto to continue", stop.name, step)
    return stop.exit_code


def train(cfg: DictConfig) -> int:
    """Set up (bad input -> one line on stderr, exit status 2), then train."""
    try:
        run = setup(cfg)
    except (ValueError, FileNotFoundError, OmegaConfBaseException) as e:  # CheckpointError is a ValueError
        print(f"error: {str(e).splitlines()[0]}", file=sys.stderr)
        return 2
    with run.lock:
        if run.step >= cfg.trainer.max_steps:
            print(f"nothing to do: {run.resumed_from} is at step {run.step}, trainer.max_steps={cfg.trainer.max_steps} "
                  f"is reached; raise trainer.max_steps to train further", file=sys.stderr)
            return 0
        return fit(run)


@hydra.main(config_path="configs", config_name="train", version_base=None)
def main(cfg: DictConfig) -> None:
    status = train(cfg)
    if status:
        sys.exit(status)


if __name__ == "__main__":
    with exit_on_config_error():  # Hydra's composition errors (unknown key, group typo): one line, exit 2
        main()
