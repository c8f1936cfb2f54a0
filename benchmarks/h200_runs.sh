#!/usr/bin/env bash
# The H200 runs behind benchmarks/max_context_h200.*, loss_by_position_*, and the training
# throughput lines in benchmarks/training_h200.md, in one device call (output under $OUT).
# Usage on the GPU machine: bash benchmarks/h200_runs.sh   (after installing .whl/, see shared/gpu)
set -u
export PYTHONUNBUFFERED=1 PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True WANDB_MODE=disabled
LOG=$OUT/h200_runs.log
step() { echo "=== $(date +%T) $*" | tee -a "$LOG"; }
common="model=gpt2-small logger=none trainer.progress=false"

step "max context: flash with full checkpointing + chunked loss, one probe at 1,048,576"
timeout 330 python3 scripts/max_context.py $common 'impls=[flash]' 'features=[ckpt+chunked]' \
  start=1048576 cap=1048576 granularity=262144 out_dir=$OUT >>"$LOG" 2>&1
step "max context: naive with the same features; flash and naive without"
timeout 80 python3 scripts/max_context.py $common 'impls=[naive]' 'features=[ckpt+chunked]' \
  extend=true out_dir=$OUT >>"$LOG" 2>&1
timeout 70 python3 scripts/max_context.py $common 'impls=[flash,naive]' 'features=[plain]' \
  cap=524288 extend=true out_dir=$OUT >>"$LOG" 2>&1

step "gpt2-small, flash, T=16384, then loss by position"
timeout 75 python3 train.py $common attention=flash trainer.seq_len=16384 trainer.batch_size=1 \
  trainer.max_steps=40 optim.warmup_steps=10 trainer.eval_every=0 trainer.ckpt_every=0 \
  trainer.log_every=10 run.dir=/tmp/run16k >>"$LOG" 2>&1
tail -n 3 /tmp/run16k/metrics.jsonl >>"$LOG"
timeout 45 python3 scripts/eval_loss_by_position.py /tmp/run16k --out-dir $OUT --batches 4 >>"$LOG" 2>&1

step "gpt2-small, sdpa + compile, T=4096, 16K tokens/step"
timeout 90 python3 train.py $common attention=sdpa trainer.seq_len=4096 trainer.batch_size=4 \
  trainer.compile=true trainer.max_steps=30 trainer.eval_every=0 trainer.ckpt_every=0 \
  trainer.log_every=10 run.dir=/tmp/run4k >>"$LOG" 2>&1
tail -n 2 /tmp/run4k/metrics.jsonl >>"$LOG"
step done
