#!/usr/bin/env bash
# The H200 runs behind benchmarks/max_context/max_context_h200.*, benchmarks/loss_parity/loss_parity_h200.*
# and benchmarks/evals/loss_by_position_run16k.*, with the GPU kernel tests, in device calls of
# under 10 minutes each (the `training` part's throughput lines go to its log only; the committed
# throughput figures come from scripts/bench/bench_train.py).
# Usage on the GPU machine (with hydra-core, omegaconf and datasets installed there), output under $OUT:
#   bash benchmarks/h200_runs.sh million   # naive's searches, then the one-million-token step
#   bash benchmarks/h200_runs.sh rest      # needs part one's max_context_h200.json in benchmarks/max_context/
#   bash benchmarks/h200_runs.sh training  # gpt2-small throughput, then loss by position
set -u
export PYTHONUNBUFFERED=1 PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True WANDB_MODE=disabled
LOG=$OUT/h200_runs.log
DEADLINE=$(( $(date +%s) + ${BUDGET_S:-570} ))
step() { echo "=== $(date +%T) $*" | tee -a "$LOG"; }
# run SECONDS CMD...: CMD under a timeout of SECONDS, or of what is left before the deadline
run() { local left=$(( DEADLINE - $(date +%s) )) want=$1; shift
        (( left < want )) && want=$left; (( want > 5 )) || { step "skipped: no time left"; return; }
        timeout "$want" "$@" >>"$LOG" 2>&1; echo "    exit $?" | tee -a "$LOG"; }
common="model=gpt2-small logger=none trainer.progress=false"
# max context with tile shapes pinned: autotuning at every new length costs device time and
# does not change memory (the speed figures come from scripts/bench/bench_attention.py)
mc="env FLASHTRAIN_AUTOTUNE=0 python3 scripts/max_context.py $common"

case "${1:-}" in
million)
  step "naive: full checkpointing + chunked loss, then none"
  run 60 $mc --attention naive 'features=[ckpt+chunked]' --out $OUT
  run 40 $mc --attention naive 'features=[plain]' extend=true --out $OUT
  step "flash, same features as naive's first: one probe at 1,048,576 tokens, same report"
  run 570 $mc --attention flash 'features=[ckpt+chunked]' start=1048576 cap=1048576 extend=true --out $OUT
  ;;
rest)
  # Three processes: a cold run is mostly compiling kernels, which is CPU-bound (one process
  # took over 170 s; these three took 80 s together).
  step "GPU kernel and registry tests (bf16/fp16)"
  t="env FLASHTRAIN_AUTOTUNE=0 python3 -m pytest -q -p no:cacheprovider tests/test_flash_attention.py"
  run 170 $t -k bfloat16 & run 170 $t -k "not bfloat16" &
  run 170 env FLASHTRAIN_AUTOTUNE=0 python3 -m pytest -q -p no:cacheprovider tests/test_attention_registry.py &
  wait
  step "train.py: gpt2-small, attention=flash, torch.compile, T=4096"
  run 110 python3 train.py $common attention=flash trainer.compile=true trainer.seq_len=4096 \
    trainer.batch_size=4 trainer.max_steps=30 trainer.eval_every=0 trainer.ckpt_every=0 \
    trainer.log_every=10 run.dir=/tmp/run_flash_compile
  tail -n 2 /tmp/run_flash_compile/metrics.jsonl >>"$LOG" 2>&1
  step "max context without memory features: flash, sdpa (naive's is in part one's report)"
  run 240 $mc --attention flash,sdpa 'features=[plain]' cap=524288 extend=true --out benchmarks/max_context
  cp benchmarks/max_context/max_context_h200* "$OUT"/
  step "loss parity: naive vs flash, tiny model, bf16"
  run 100 python3 scripts/bench/compare_attention_losses.py --name loss_parity_h200 --out "$OUT" \
    --work /tmp/parity
  ;;
training)
  step "gpt2-small, flash, T=16384, then loss by position"
  run 75 python3 train.py $common attention=flash trainer.seq_len=16384 trainer.batch_size=1 \
    trainer.max_steps=40 optim.warmup_steps=10 trainer.eval_every=0 trainer.ckpt_every=0 \
    trainer.log_every=10 run.dir=/tmp/run16k
  tail -n 3 /tmp/run16k/metrics.jsonl >>"$LOG" 2>&1
  run 45 python3 scripts/eval_loss_by_position.py /tmp/run16k --out $OUT --batches 4
  step "gpt2-small, sdpa + compile, T=4096, 16K tokens/step"
  run 90 python3 train.py $common attention=sdpa trainer.seq_len=4096 trainer.batch_size=4 \
    trainer.compile=true trainer.max_steps=30 trainer.eval_every=0 trainer.ckpt_every=0 \
    trainer.log_every=10 run.dir=/tmp/run4k
  tail -n 2 /tmp/run4k/metrics.jsonl >>"$LOG" 2>&1
  ;;
*) echo "usage: $0 million|rest|training" >&2; exit 2 ;;
esac
step done
