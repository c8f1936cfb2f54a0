#!/usr/bin/env bash
# SIGTERM at varied moments of the naive-h100 preset's training; does each save a checkpoint?
set -u
export PYTHONUNBUFFERED=1 PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True WANDB_MODE=disabled
E=$(( $(date +%s) + ${BUDGET:-560} ))
which strace gdb > $OUT/tools.txt 2>&1
i=0
while (( $(date +%s) + 75 < E )); do
  i=$((i+1)); d=runs/sigt/$i; rm -rf runs/sigt
  T=$(( 25 + (i * 13) % 30 )); (( i == 1 )) && T=$((T + 140))
  timeout --preserve-status -s TERM -k 30 $T python3 benchmarks/resume/sigterm_h100/sigwatch.py train.py experiment=long-context-mixed-naive-h100 \
    run.dir=$d logger=none trainer.progress=false trainer.max_steps=340 > $OUT/t$i.log 2>&1
  rc=$?
  echo "trial $i T=$T rc=$rc saved=$(grep -c 'SIGTERM received' $OUT/t$i.log) normal_exit=$(grep -c 'exits normally' $OUT/t$i.log) last=$(grep -o 'step [0-9]*/340' $OUT/t$i.log | tail -1) ckpts=$(ls $d/checkpoints 2>/dev/null | tr '\n' ' ')" | tee -a $OUT/summary.txt
done
