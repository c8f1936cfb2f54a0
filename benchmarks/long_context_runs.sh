#!/usr/bin/env bash
# The H200 runs behind benchmarks/evals/*long_context_passkey*: experiment=long-context-passkey
# (gpt2-small trained at 32,768 tokens through our kernel) and experiment=long-context-passkey-naive
# (the same recipe with naive attention at 11,264 tokens, for as many tokens), each trained over
# device calls of under 10 minutes with resume=auto, then evaluated: the passkey grid over
# 2K-32K tokens x key depths 0-100%, and loss by position on the held-out corpus documents.
# What they are and why so sized: docs/long-context.md ("A model that uses its long context").
#
# On the GPU machine, from the checkout's root, results under $OUT, with hydra-core, omegaconf and
# datasets installed there (pip from wheels brought along, where the machine has no package index),
# and FLASHTRAIN_COMMIT=<the commit> set where the copy there has no git history to ask.
#
# The runs live in runs/long-context/ (git-ignored), which a machine keeps between calls only while
# it stays warm, 30 s after a call: make each call of a session right after the last, on one machine
# (a machine is held 30 minutes at most). Session 1, flash, ~15 minutes of device time:
#   bash benchmarks/long_context_runs.sh flash            # ~9.5 min: BPE, token cache, then training until stopped (SIGTERM: a checkpoint)
#   bash benchmarks/long_context_runs.sh flash continue   # at once: finishes the run ('continue' refuses to start over)
#   bash benchmarks/long_context_runs.sh flash-eval       # ~1 min: passkey grid and loss by position, final checkpoint
# then commit $OUT's files under benchmarks/evals/, the run's config.yaml and metrics.jsonl (each
# training call returns them) in benchmarks/evals/long_context_passkey_flash/.
# Session 2, naive: `naive` (which first checks that its BPE is the committed flash run's),
# `naive continue` ... and `naive-eval`, which draws session 1's committed flash results beside
# naive's, committed the same way. Its 64.9M tokens need ~55 min at the
# committed 19,870 tokens/s, more than a machine is held: see docs/long-context.md for what a
# session can do (NAIVE_STEPS=N trains N steps instead of the preset's 1,920, from its first call on).
# Last, on any machine (CPU): `bash benchmarks/long_context_runs.sh compare`, both runs' tokens/s
# and peak memory in benchmarks/evals/long_context_passkey_h200.{md,json,png}.
#
# The dense-retrieval curriculum (experiment=long-context-dense), one session, ~11 minutes of
# device time in two calls made one right after the other on the same machine:
#   bash benchmarks/long_context_runs.sh dense        # ~8-9.5 min: BPE, caches, the four stages
#   bash benchmarks/long_context_runs.sh dense-eval   # ~1.5 min: passkey grid 2K-32K x depths 0-1, loss by position
# then commit $OUT's files under benchmarks/evals/ as above (long_context_passkey_dense/ for the
# run's config.yaml and metrics.jsonl).
#
# The mixed-length recipe (experiment=long-context-mixed), ~12 minutes in calls made one right after
# the other on the same machine (the evaluation may share a call with either training stage):
#   bash benchmarks/long_context_runs.sh mixed        # ~5.7 min: BPE, caches (~2 min), 1,700 steps
#   bash benchmarks/long_context_runs.sh mixed-long   # ~4.3 min: 1,200 steps more on long-heavy units
#   bash benchmarks/long_context_runs.sh mixed-eval   # ~1.3 min: the same grid and loss by position
# and the same with model.attention_length_scale (mixed-scaled, mixed-scaled-long, mixed-scaled-eval,
# which draws the committed mixed results beside its own), and that with RoPE base 500,000 (mixed-base,
# mixed-base-long, mixed-base-eval, drawn beside mixed-scaled's; docs/long-context.md says why), and
# three other second stages, each branched from mixed-base's stage 1 and drawn beside mixed-base's grid:
# stage 2 to 4,100 steps (mixed-longer ~7.5 min, mixed-longer-eval), stage 2 with several keys in
# each long document (mixed-far ~5 min, mixed-far-eval), and stage 2 with more whole 32K documents
# (mixed-whole ~5 min, mixed-whole-eval); `mixed-base` first, on the same machine. And mixed-base
# with a BPE that keeps every digit its own token (mixed-digits ~5 min, mixed-digits-long ~4.5 min,
# mixed-digits-eval ~1.3 min, its grid drawn beside mixed-base's; its loss curve alone, its BPE being
# another), with two second stages branched from its first: mixed-digits-whole (~5 min, the README's
# recipe as first run; its -eval drawn beside mixed-digits') and mixed-digits-longer (the same to
# 4,100 steps, ~9 min; its -eval beside mixed-digits-whole's). Run a branch before mixed-digits-long:
# stage 2 keeps two checkpoints, so step 1,700 is gone once mixed-digits' own stage 2 has saved
# twice. The README's
# recipe with RoPE base 5,000,000, a run of its own beside mixed-digits-whole: mixed-digits-5m (~5 min),
# mixed-digits-5m-long (~5 min), mixed-digits-5m-eval (~1.3 min); and from seed 2,026, the same three
# cases of mixed-digits-seed2026; with every question at its document's end, mixed-digits-last; and
# with the slowest quarter of the RoPE pairs still (model.rope_fraction=0.75), mixed-digits-prope.
# And the recipe's stage 1 in 8,192-token windows with our kernel (mixed-digits-warm8k ~5 min), its
# stage 2 branched from it at 32,768 (mixed-digits-warm8k-long ~5 min), mixed-digits-warm8k-eval: the
# README's recipe now (experiment=long-context-retrieval, then -long branched); the same three from
# seed 2,026 (mixed-digits-warm8k-seed2026[-long|-eval], beside mixed-digits-seed2026); and the
# README's own commands, readme (~4.5 min), readme-long (~4.5 min), readme-eval (~1 min), beside
# mixed-digits-warm8k, and the same with one change (README_WITH: readme-keys8, keys of 8 digits,
# whose -eval asks 8-digit keys as well as 5-digit ones; readme-triton-bwd, the Triton backward;
# readme-seed2026, seed 2,026; readme-triton-atomic, the Triton backward with dQ added in arrival
# order, and readme-triton-atomic-seed2026, that from seed 2,026: its stage 1 runs at ~236K tokens/s,
# so on a fresh machine (BPE and caches first) a case's three steps need ~680 s, two calls; and
# readme-floor and readme-floor-seed2026, stage 2 annealed to a floor of 6e-6 (README_STAGE_2_WITH);
# readme-batch2 and readme-batch2-seed2026, stage 2 with two windows a step: on a fresh machine stage 1
# and most of stage 2 in one call, the rest and -eval in the next; readme-stage1-batch8, stage 1 with
# eight windows a step (README_STAGE_1_WITH): stage 1 takes a fresh machine's first call, -long and
# -eval the next).
# (benchmarks/evals/long_context_passkey_mixed/ has both stages' config, log and results).
# The same recipe with naive attention at its longest trainable 11,264 tokens, on an H200
# (experiment=long-context-mixed-naive, then MIXED_NAIVE_LONG): `mixed-naive` (which first checks that
# its BPE is the committed mixed-digits-whole run's), `mixed-naive continue` ..., `mixed-naive-long`,
# `mixed-naive-eval`, drawn beside mixed-digits-whole's. Its ~80 min of steps do not fit a machine's
# 30-minute hold; NAIVE_STEPS=N,M trains stage 1 to N steps and stage 2 to M as a whole run
# (docs/long-context.md). With NAIVE_ON=h100 the same cases run it on an H100 at its longest, 8,192
# tokens (experiment=long-context-mixed-naive-h100, then MIXED_NAIVE_H100_LONG), in
# runs/long-context/mixed-naive-h100. What a session can train of naive is a share of its tokens; the
# flash recipe cut to the same share (`recipe-share`, `recipe-share-long`, `recipe-share-eval` with
# SHARE_STEPS=N,M) is the run of as many tokens to draw it beside (NAIVE_BESIDE=recipe-share).
# `mixed-naive-flash [continue]`, `mixed-naive-flash-long` and `mixed-naive-flash-eval` train and
# evaluate naive's preset (its windows, NAIVE_STEPS) with our kernel, in runs/long-context/<naive's
# run>-flash: whether what differs between the two shares is the kernel or the window. Last, on any
# machine: `NAIVE_ON=h100 bash benchmarks/long_context_runs.sh compare`, the three H100 shares'
# tokens/s and peak memory in benchmarks/evals/long_context_passkey_h100.{md,json,png}.
set -u
export PYTHONUNBUFFERED=1 PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True WANDB_MODE=disabled
OUT=${OUT:-outputs/long_context_runs}
mkdir -p "$OUT"
LOG=$OUT/long_context_runs.log
DEADLINE=$(( $(date +%s) + ${BUDGET_S:-570} ))
RUNS=runs/long-context
EVALS=${EVALS:-benchmarks/evals}   # where the committed results are (read by naive-eval and compare)
LENGTHS="2048 4096 8192 16384 32768"
DEPTHS="0 0.1 0.2 0.3 0.4 0.5 0.6 0.7 0.8 0.9 1"
PRECISION_LENGTHS=${PRECISION_LENGTHS:-"2048 4096 8192 16384"}   # EVAL_PRECISION's grid (evaluate says why)
step() { echo "=== $(date +%T) $*" | tee -a "$LOG"; }
left() { echo $(( DEADLINE - $(date +%s) )); }
# run SECONDS CMD...: CMD under a timeout of SECONDS, or of what is left before the deadline
run() { local want=$1 have; have=$(left); shift
        (( have < want )) && want=$have; (( want > 5 )) || { step "skipped: no time left"; return 1; }
        timeout --preserve-status -s TERM -k 30 "$want" "$@" >>"$LOG" 2>&1; local rc=$?; echo "    exit $rc" | tee -a "$LOG"; return $rc; }

# train NAME EXPERIMENT [continue] [OVERRIDES...]: start or continue runs/long-context/NAME until it
# is done or the call's time is nearly up (SIGTERM: train.py saves a checkpoint and exits 143);
# its config.yaml and metrics.jsonl go back under $OUT either way. `continue` is resume=continue,
# which refuses a run with no checkpoint rather than start it over (a call's work lost is said, not
# silently redone). RESUME=<checkpoint of another run> branches a new run from it instead (into an
# empty runs/long-context/NAME).
train() {
  local name=$1 experiment=$2 dir=$RUNS/$1 resume=${RESUME:-auto}; shift 2
  if [[ "${1:-}" == continue ]]; then
    shift; resume=${RESUME:-continue}
    [[ -f $dir/config.yaml ]] || { step "error: no run in $dir: this machine is not the one that trained it (it went back after 30 s idle); start over with '$name'"; exit 2; }
  fi
  step "$name: train.py experiment=$experiment run.dir=$dir resume=$resume $*"
  run $(( $(left) - 20 )) python3 train.py "experiment=$experiment" "run.dir=$dir" "resume=$resume" logger=none \
    trainer.progress=false "$@"
  mkdir -p "$OUT/long_context_passkey_$name"
  cp "$dir/config.yaml" "$dir/metrics.jsonl" "$OUT/long_context_passkey_$name/" 2>>"$LOG"
  tail -n 2 "$dir/metrics.jsonl" >>"$LOG" 2>&1
}

# after_stage_1 NAME STEPS: before a second stage (to STEPS steps) continues runs/long-context/NAME,
# its first stage must have finished; else stage 2's data would take over part-way through stage 1
# (a call cut short by its deadline saves a checkpoint before stage 1's max_steps). A run already
# in stage 2 (its config's max_steps is STEPS) goes on.
after_stage_1() {
  local dir=$RUNS/$1 planned last
  [[ -f $dir/config.yaml ]] || return 0   # train's `continue` says the run is not on this machine
  planned=$(awk '/^trainer:/ {t = 1; next} /^[^ ]/ {t = 0} t && /^  max_steps:/ {print $2; exit}' "$dir/config.yaml")
  last=$(tail -n 1 "$dir/metrics.jsonl" 2>/dev/null | grep -o '"step": [0-9]*' | grep -o '[0-9]*$')
  [[ $planned == "$2" || $last == "$planned" ]] && return 0
  step "error: $1's first stage stopped at step ${last:-0} of $planned: run '$1 continue' until it is done, then this"
  exit 2
}

# evaluate NAME ATTENTION BATCHES [BESIDE [LOSS_BESIDE]]: the passkey grid and loss by position of
# NAME's newest checkpoint, with attention ATTENTION; BESIDE: the committed results of the other run
# to draw beside; LOSS_BESIDE (BESIDE unless given, `-` for none): the run whose loss curve goes
# beside, which must share NAME's tokenizer (losses per token of two BPEs do not compare).
evaluate() {
  local name=$1 attention=$2 batches=$3 beside=${4:-} stem=long_context_passkey_$1
  local loss_run=${5:-${4:-}} passkey_beside=() loss_beside=()
  [[ -n $beside ]] && passkey_beside=(--beside "$EVALS/passkey_long_context_passkey_$beside.json")
  if [[ -n $loss_run && $loss_run != - ]]; then
    loss_beside=(--beside "$EVALS/loss_by_position_long_context_passkey_$loss_run.json")
    [[ -f ${loss_beside[1]} ]] || { step "note: ${loss_beside[1]} is not committed: $name's loss curve is drawn alone"
                                     loss_beside=(); }
  fi
  # the loss curve first: it takes seconds to ~1.5 min, and a call whose time runs out in the grid
  # still has it (naive's 32K forwards take ~1 s each, ~310 GB of N x N traffic a layer, 220 of
  # them: ~5 min in all; the grid's JSON is rewritten after each length, so a grid cut short keeps
  # what it measured)
  step "$name: loss by position on the held-out corpus documents"
  run 90 python3 scripts/eval_loss_by_position.py "$RUNS/$name" --attention "$attention" --bucket-tokens 1024 \
    --batches "$batches" --name "$stem" --out "$OUT" "${loss_beside[@]}"
  step "$name: passkey grid, $attention attention"
  # shellcheck disable=SC2086 (the lengths and depths are words)
  run 470 python3 scripts/eval_passkey.py "$RUNS/$name" --attention "$attention" --lengths $LENGTHS \
    --depths $DEPTHS --trials 20 --name "$stem" --out "$OUT" "${passkey_beside[@]}"
  # EVAL_KEY_DIGITS=N: the same grid again with keys of N digits, drawn beside the same run: a run
  # trained on keys of another length (readme-keys8) is asked its own keys as well as the eval's 5-digit
  # ones, which it answers as if they were its own length (docs/long-context.md)
  if [[ -n ${EVAL_KEY_DIGITS:-} ]]; then
    step "$name: passkey grid, $attention attention, keys of $EVAL_KEY_DIGITS digits"
    # shellcheck disable=SC2086
    run 470 python3 scripts/eval_passkey.py "$RUNS/$name" --attention "$attention" --lengths $LENGTHS \
      --depths $DEPTHS --trials 20 --key-digits "$EVAL_KEY_DIGITS" --name "$stem-eval$EVAL_KEY_DIGITS" \
      --out "$OUT" "${passkey_beside[@]}"
  fi
  # EVAL_PRECISION=fp32: the same grid again with the forwards in float32, beside the bf16 one: does
  # bf16's rounding decide the wrong answers? Flash's products in IEEE fp32 run without tensor cores:
  # 2K-16K fit in 470 s on an H100 (mixed-digits-last), 32K alone would take ~20 min, so its lengths
  # are PRECISION_LENGTHS' (2K-16K unless set; 32K: eval_passkey.py --precision fp32 --lengths 32768
  # with a few --depths, in a call of its own)
  [[ -n ${EVAL_PRECISION:-} ]] || return 0
  step "$name: passkey grid, $attention attention in $EVAL_PRECISION"
  # shellcheck disable=SC2086
  run 470 python3 scripts/eval_passkey.py "$RUNS/$name" --attention "$attention" --lengths $PRECISION_LENGTHS \
    --depths $DEPTHS --trials 20 --precision "$EVAL_PRECISION" --name "$stem-$EVAL_PRECISION" --out "$OUT" \
    --beside "$OUT/passkey_$stem.json"
}

# same_tokenizer_as FLASH_RUN EXPERIMENT: before a naive run's first call, its BPE must be that of the
# committed flash run it is compared with (trained on the same corpus documents, so it should be), or
# the two runs' losses per token would not compare. data_stats.py builds the BPE and token cache
# training then reuses, and names the tokenizer by its file's hash, as the flash run's committed
# config.yaml does.
same_tokenizer_as() {
  local flash=$EVALS/long_context_passkey_$1/config.yaml
  [[ -f $flash ]] || { step "error: $flash is not committed: the flash run ($1) comes first"; exit 2; }
  step "naive: the BPE and token cache, checked against $1's tokenizer"
  run 240 python3 scripts/data_stats.py "experiment=$2" --json "$OUT/naive_data.json" || exit 2
  python3 - "$flash" "$OUT/naive_data.json" <<'PY' 2>&1 | tee -a "$LOG"; (( PIPESTATUS[0] == 0 )) || exit 2
import json, sys, yaml
flash = yaml.safe_load(open(sys.argv[1]))["run"]["data_fingerprint"].split("/")[1]
naive = json.load(open(sys.argv[2]))["fingerprint"].split("/")[1]
print(f"    tokenizer: flash {flash}, naive {naive}")
sys.exit(0 if flash == naive else "error: naive's BPE is not flash's: its losses would not compare with flash's")
PY
}

# The curriculum's four stages, each a continuation of the last (resume=auto) in the same
# 32,768-token windows: the copy first, on passkey documents that are nothing but a key sentence and
# its question (the CPU probes: dense documents from scratch never formed it), then dense-retrieval
# documents of 2,048, 8,192 and 32,768 tokens (the preset's). A stage cut short by the deadline saves
# a checkpoint (exit 143) and the next one continues from it.
DENSE_STAGES=(
  "data.passkey.kind=single data.passkey.pairs=null data.passkey.length=32 data.passkey.num_docs=100000 trainer.max_steps=400"
  "data.passkey.length=2048 data.passkey.pairs=1 data.passkey.num_docs=4000 trainer.max_steps=650"
  "data.passkey.length=8192 data.passkey.pairs=4 data.passkey.num_docs=1000 trainer.max_steps=900"
  ""
)
MIXED_LONG=(data.allow_changed=true 'allow_changes=[trainer.max_steps]' 'data.passkey.pieces=[1,1,2,2,4,4,8,16,512]'
            data.passkey.num_docs=180 trainer.max_steps=2900 trainer.eval_every=1200 trainer.ckpt_every=1200)
# stage 2 run longer: the same units to 4,100 steps (docs/long-context.md: retrieval was still rising at 2,900)
MIXED_LONGER=("${MIXED_LONG[@]/trainer.max_steps=2900/trainer.max_steps=4100}")
# stage 2 with more answers far back: the same units, with 8 keys in each 32K document, 4 in each 16K
# one and 2 in each 8K one (data.passkey.piece_pairs); the short documents keep one each. Run
# 2026-12-05: retrieval fell (mean 0.75 -> 0.56), docs/long-context.md says why we think so
MIXED_FAR=("${MIXED_LONG[@]}" 'data.passkey.piece_pairs=[8,8,4,4,2,2,1,1,1]')
# stage 2 with more answers far back, one key a document: 4 of each 10 units one 32K document (2 of 9
# before; one 8K unit fewer, every length kept), the same steps and number of units
MIXED_WHOLE=("${MIXED_LONG[@]/data.passkey.pieces=*/data.passkey.pieces=[1,1,1,1,2,2,4,8,16,512]}")
# the recipe's second stage for experiment=long-context-mixed-naive: long-context-retrieval-long's units
# (MIXED_WHOLE's) in 11,264-token windows (the shortest documents 64 tokens, 11,264 / 176), as many
# passkey tokens (524 x 11,264 against 180 x 32,768) and steps of 3 windows to as many tokens in all
# (2,812 x 33,792 against 2,900 x 32,768)
MIXED_NAIVE_LONG=(data.allow_changed=true 'allow_changes=[trainer.max_steps]' 'data.passkey.pieces=[1,1,1,1,2,2,4,8,16,176]'
                  data.passkey.num_docs=524 trainer.max_steps=2812 trainer.eval_every=1164 trainer.ckpt_every=1164)
# the same for experiment=long-context-mixed-naive-h100, in 8,192-token windows (8,192 / 128 = 64): 720
# units (180 x 32,768 tokens) and flash's 2,900 steps, each of 4 windows, 32,768 tokens as flash's
MIXED_NAIVE_H100_LONG=(data.allow_changed=true 'allow_changes=[trainer.max_steps]' 'data.passkey.pieces=[1,1,1,1,2,2,4,8,16,128]'
                       data.passkey.num_docs=720 trainer.max_steps=2900 trainer.eval_every=1200 trainer.ckpt_every=1200)
MIXED_SCALED=(model.attention_length_scale=1024)   # s_h from 1 / log(1024): 0.6 at 64 keys, 1.5 at 32K
MIXED_BASE=(model.rope_theta=500000)   # 7 of 32 rotation pairs turn less than a quarter over 32K (none at 10,000)
# the recipe's slowest 7 pairs keep cos >= 0.98 over 32K at base 5,000,000 (at 500,000 their mean is
# 0.96 at 16K and 0.84 at 32K, where the copy's one-token slips are): docs/long-context.md
MIXED_BASE_5M=(model.rope_theta=5000000)
MIXED_SEED_2026=(seed=2026)   # the recipe again from another seed (1,337 its own): how far two runs of it differ
# every question at its document's end, as the eval asks (data/retrieval.py): near keys at the end of 32K
# documents, where the key right before the question was missed in every run (docs/long-context.md)
MIXED_ASK_LAST=(data.passkey.ask_last=true)
# the slowest quarter of the RoPE pairs (8 of 32, those base 500,000 turns least) not rotated at all
# (p-RoPE): their match exact at any distance, every other pair as in the recipe, where base 5,000,000
# slowed every pair (docs/long-context.md)
MIXED_PROPE=(model.rope_fraction=0.75)
declare -A RECIPE_WITH=([mixed-digits-5m]=MIXED_BASE_5M [mixed-digits-seed2026]=MIXED_SEED_2026
                        [mixed-digits-last]=MIXED_ASK_LAST [mixed-digits-prope]=MIXED_PROPE)
# the README's recipe as its commands run it (stage 1 experiment=long-context-retrieval in <run>-8k,
# stage 2 long-context-retrieval-long branched from its step 1,700 into <run>), with one change or
# none, drawn beside mixed-digits-warm8k (the same settings, trained before the Gluon backward took
# the document mask)
MIXED_NONE=()
# keys of 8 digits in training, 5 in the eval: 1.6x the copy steps a key (the slips left are one digit
# of the key read one place off, docs/long-context.md); the 64-token documents still hold a key and its
# question (~58 tokens)
MIXED_KEYS_8=(data.passkey.key_digits=8)
# the backward that mixed-digits-warm8k and its seed-2,026 twin trained with (the Triton one; `auto`
# plans the Gluon one on Hopper since): readme's 75 misses against their 18 and 16 are the kernel's
# doing or one draw of a wide spread (docs/long-context.md); with readme-seed2026, the other half
MIXED_TRITON_BWD=(attention.backward_kernel=triton)
# the Triton backward adding dQ in arrival order (its float32 atomics): the rounding changes, the
# algorithm does not, so these two runs measure how far retrieval moves on rounding alone, beside
# readme's 75 and readme-seed2026's 28 on the Gluon backward (docs/long-context.md, "Both backwards")
MIXED_TRITON_ATOMIC=(attention.backward_kernel=triton attention.deterministic=false)
MIXED_TRITON_ATOMIC_2026=("${MIXED_TRITON_ATOMIC[@]}" seed=2026)
# stage 2 annealed to a tenth of the recipe's floor (6e-6, not 6e-5) over the same 1,200 steps, stage 1
# as it is: six runs differing only in rounding missed 5-75 passkeys, so the far copy ends wherever the
# last steps at the floor leave it; a lower floor should narrow that (docs/long-context.md, "Six runs")
MIXED_STAGE_2_FLOOR=(optim.min_lr=6.0e-6)   # a branch takes the changed floor (training.run.resume)
# stage 2 with two 32K windows a step (gradient accumulation), the same 1,200 steps and schedule: twice
# its tokens (~7 min of steps, the recipe ~11). Stage 1's 8K windows, 4 a step, formed the copy from both
# seeds where 32K windows one a step did so late or not; stage 2 is still one unit a step, so each update
# is one kind of unit's gradient (docs/long-context.md, "Stage 2 two windows a step")
MIXED_STAGE_2_BATCH_2=(trainer.grad_accum=2)
# stage 1 with eight 8K windows a step, not four, the same 1,700 steps and schedule: twice its tokens
# (~7.5 min of steps on an H100, the recipe ~11). Stage 2's changes moved the misses less than stage 1's
# draw did (three stage 2s on one stage 1: 47-75 and 28-29), and the weak stage 1 (seed 1,337's: 9 of 12
# keys at 8K at its end) is the one to raise (docs/long-context.md, "The other seed's pair")
MIXED_STAGE_1_BATCH_8=(trainer.grad_accum=8)
declare -A README_WITH=([readme]=MIXED_NONE [readme-keys8]=MIXED_KEYS_8 [readme-triton-bwd]=MIXED_TRITON_BWD
                        [readme-seed2026]=MIXED_SEED_2026 [readme-triton-atomic]=MIXED_TRITON_ATOMIC
                        [readme-triton-atomic-seed2026]=MIXED_TRITON_ATOMIC_2026
                        [readme-floor]=MIXED_NONE [readme-floor-seed2026]=MIXED_SEED_2026
                        [readme-batch2]=MIXED_NONE [readme-batch2-seed2026]=MIXED_SEED_2026
                        [readme-stage1-batch8]=MIXED_NONE)
# what a README_WITH case changes in stage 1 alone
declare -A README_STAGE_1_WITH=([readme-stage1-batch8]=MIXED_STAGE_1_BATCH_8)
# what a README_WITH case changes in stage 2 alone, after its README_WITH overrides
declare -A README_STAGE_2_WITH=([readme-floor]=MIXED_STAGE_2_FLOOR [readme-floor-seed2026]=MIXED_STAGE_2_FLOOR
                                [readme-batch2]=MIXED_STAGE_2_BATCH_2 [readme-batch2-seed2026]=MIXED_STAGE_2_BATCH_2)
# the naive run of the recipe on an H200, at 11,264 tokens (an H100 does not hold that step), or with
# NAIVE_ON=h100 on an H100, at 8,192 (the GPU the flash runs trained on): its run, preset, second
# stage, and held-out windows for the loss curve (~393K tokens, as flash's 12 of 32,768)
case ${NAIVE_ON:-h200} in
h200) NAIVE_RUN=mixed-naive NAIVE_PRESET=long-context-mixed-naive NAIVE_WINDOWS=35 NAIVE_LONG=("${MIXED_NAIVE_LONG[@]}") ;;
h100) NAIVE_RUN=mixed-naive-h100 NAIVE_PRESET=long-context-mixed-naive-h100 NAIVE_WINDOWS=48
      NAIVE_LONG=("${MIXED_NAIVE_H100_LONG[@]}") ;;
*) echo "NAIVE_ON=$NAIVE_ON: expected h200 or h100" >&2; exit 2 ;;
esac
# naive_long RUN [OVERRIDES...]: the naive preset's second stage, continuing RUN to NAIVE_STEPS' M
# steps where given, else the whole stage's
naive_long() {
  local run=$1 long_steps; shift
  long_steps=$(printf '%s\n' "${NAIVE_LONG[@]}" | sed -n 's/^trainer\.max_steps=//p')
  [[ -n ${NAIVE_STEPS:-} ]] && long_steps=${NAIVE_STEPS#*,}
  after_stage_1 "$run" "$long_steps"
  train "$run" "$NAIVE_PRESET" continue "$@" "${NAIVE_LONG[@]/trainer.max_steps=*/trainer.max_steps=$long_steps}"
}
# needs_share_steps CASE: recipe-share's cases are a share of the recipe's steps, which SHARE_STEPS=N,M names
needs_share_steps() {
  [[ -n ${SHARE_STEPS:-} ]] || { step "error: $1 needs SHARE_STEPS=N,M (stage 1 to N steps, stage 2 to M)"; exit 2; }
}
dense() {
  local stage=0 more=()
  for overrides in "${DENSE_STAGES[@]}"; do
    stage=$((stage + 1))
    # shellcheck disable=SC2086 (the overrides are words)
    train dense long-context-dense "${more[@]}" $overrides
    step "dense: stage $stage done"
    more=(data.allow_changed=true 'allow_changes=[trainer.max_steps]')
  done
}

# branch_of FIRST NAME EXPERIMENT OVERRIDES...: a second stage for FIRST's first stage (mixed-base or
# mixed-digits, whose settings EXPERIMENT and OVERRIDES repeat), in runs/long-context/NAME: its first
# call branches from FIRST's step-1,700 checkpoint, a later one continues it
branch_of() {
  local first=$1 name=$2 RESUME=""; shift 2
  if [[ ! -f $RUNS/$name/config.yaml ]]; then
    RESUME=$RUNS/$first/checkpoints/step_00001700.pt
    [[ -f $RESUME ]] || { step "error: no $RESUME: run '$first' first on this machine"; exit 2; }
  fi
  train "$name" "$@"
}

variant=${1:-}; variant=${variant%-long}; variant=${variant%-eval}
# the README's recipe as its commands run it, with one change or none (README_WITH: the run -> the
# array of its overrides; adding one there adds its three cases): stage 1 in <run>-8k, stage 2
# branched from it into <run>, drawn beside mixed-digits-warm8k
if [[ -n $variant && -n ${README_WITH[$variant]:-} ]]; then
  with="${README_WITH[$variant]}[@]" with_2="${README_STAGE_2_WITH[$variant]:-MIXED_NONE}[@]"
  with_1="${README_STAGE_1_WITH[$variant]:-MIXED_NONE}[@]"
  case $1 in
  *-long) branch_of "$variant-8k" "$variant" long-context-retrieval-long "${!with}" "${!with_2}" ;;
  # a run trained on keys of other than 5 digits is asked its own keys' length too
  *-eval) digits=$(printf '%s\n' "${!with}" | sed -n 's/^data\.passkey\.key_digits=//p')
          EVAL_KEY_DIGITS=${EVAL_KEY_DIGITS:-$digits} evaluate "$variant" flash 12 mixed-digits-warm8k ;;
  *) shift; train "$variant-8k" long-context-retrieval "$@" "${!with}" "${!with_1}" ;;
  esac
  step done
  exit 0
fi
# the README's recipe as first run (stage 1 at 32K), both stages, with one change in a run of its own
# (RECIPE_WITH, as above), drawn beside mixed-digits-whole (its BPE, so its loss curve too): RoPE
# base 5,000,000 (is the fading of the slow pairs' match over 16-32K what the far slips are?),
# another seed, every question at its document's end, and the slowest pairs still
if [[ -n $variant && -n ${RECIPE_WITH[$variant]:-} ]]; then
  with="${RECIPE_WITH[$variant]}[@]"
  case $1 in
  *-long) after_stage_1 "$variant" 2900; train "$variant" long-context-retrieval-long continue "${!with}" ;;
  *-eval) evaluate "$variant" flash 12 mixed-digits-whole ;;
  *) shift; train "$variant" long-context-retrieval-32k "$@" "${!with}" ;;
  esac
  step done
  exit 0
fi
case "${1:-}" in
flash) shift; train flash long-context-passkey "$@" ;;
dense) dense ;;
# one stage: documents of 64 to 32,768 tokens, one key each, document-masked (the preset's comments)
mixed) shift; train mixed long-context-mixed "$@" ;;
# its second stage, from the first's checkpoint: units weighted to long documents, 1,200 steps more
mixed-long) after_stage_1 mixed 2900; train mixed long-context-mixed continue "${MIXED_LONG[@]}" ;;
mixed-eval) evaluate mixed flash 12 ;;
# the same two stages with the queries scaled by s_h log(n) (model.attention_length_scale), drawn
# beside the committed mixed run: does a softmax that scales with the context retrieve further?
mixed-scaled) shift; train mixed-scaled long-context-mixed "${MIXED_SCALED[@]}" "$@" ;;
mixed-scaled-long) after_stage_1 mixed-scaled 2900; train mixed-scaled long-context-mixed continue "${MIXED_SCALED[@]}" "${MIXED_LONG[@]}" ;;
mixed-scaled-eval) evaluate mixed-scaled flash 12 mixed ;;
# mixed-scaled with RoPE base 500,000, beside it: does a match that no rotation undoes over the window
# carry retrieval past the 4-8K tokens where mixed-scaled's falls off?
mixed-base) shift; train mixed-base long-context-mixed "${MIXED_SCALED[@]}" "${MIXED_BASE[@]}" "$@" ;;
mixed-base-long) after_stage_1 mixed-base 2900; train mixed-base long-context-mixed continue "${MIXED_SCALED[@]}" "${MIXED_BASE[@]}" "${MIXED_LONG[@]}" ;;
mixed-base-eval) evaluate mixed-base flash 12 mixed-scaled ;;
# mixed-base's two stages with each digit its own token (tokenizer.split_digits), beside it: are its
# garbled copies the BPE's? Its first stage is experiment=long-context-retrieval-32k, the README's
# recipe as first run; its second mixed-base's (MIXED_LONG's units) with the digits split
mixed-digits) shift; train mixed-digits long-context-retrieval-32k "$@" ;;
mixed-digits-long) after_stage_1 mixed-digits 2900; train mixed-digits long-context-retrieval-long continue "${MIXED_LONG[@]}" ;;
mixed-digits-eval) evaluate mixed-digits flash 12 mixed-base - ;;   # its own BPE: no loss curve to put beside
# two second stages for mixed-digits' first, branched from its step 1,700 (run `mixed-digits` first, on
# the same machine), drawn beside mixed-digits: with its garbled copies gone, what failed was 16-32K
# back, so more whole 32K documents (MIXED_WHOLE's units: long-context-retrieval-long, the README's
# stage 2 since it lifted that band from 0.85 to 0.96), and that stage 2 to 4,100 steps
mixed-digits-whole) branch_of mixed-digits mixed-digits-whole long-context-retrieval-long ;;
mixed-digits-whole-eval) evaluate mixed-digits-whole flash 12 mixed-digits ;;
mixed-digits-longer) branch_of mixed-digits mixed-digits-longer long-context-retrieval-long trainer.max_steps=4100 ;;
mixed-digits-longer-eval) evaluate mixed-digits-longer flash 12 mixed-digits-whole ;;
# the README's recipe with its stage 1 in 8,192-token windows, 4 a step (naive's H100 preset with our
# kernel, run mixed-digits-8k: experiment=long-context-retrieval, the README's stage 1 since it held
# from two seeds), and its stage 2 branched from that at 32,768 tokens (a branch may change
# trainer.seq_len): at a fifth of the tokens the 8K windows had learned retrieval where 32K had not
mixed-digits-warm8k) shift; train mixed-digits-8k long-context-mixed-naive-h100 "$@" attention=flash ;;
mixed-digits-warm8k-long) branch_of mixed-digits-8k mixed-digits-warm8k long-context-retrieval-long ;;
mixed-digits-warm8k-eval) evaluate mixed-digits-warm8k flash 12 mixed-digits-whole ;;
# the same from seed 2,026, drawn beside the 32K stage 1's run from that seed (mixed-digits-seed2026,
# 133 wrong of 1,100 where seed 1,337 made 20): does the 8K stage 1 make retrieval hold across seeds?
mixed-digits-warm8k-seed2026) shift; train mixed-digits-8k-seed2026 long-context-mixed-naive-h100 "$@" attention=flash "${MIXED_SEED_2026[@]}" ;;
mixed-digits-warm8k-seed2026-long) branch_of mixed-digits-8k-seed2026 mixed-digits-warm8k-seed2026 long-context-retrieval-long "${MIXED_SEED_2026[@]}" ;;
mixed-digits-warm8k-seed2026-eval) evaluate mixed-digits-warm8k-seed2026 flash 12 mixed-digits-seed2026 ;;
# three other second stages for mixed-base's first, each in its own run branched from mixed-base's
# step-1,700 checkpoint (run `mixed-base` first, on the same machine) and drawn beside mixed-base's
# committed grid: stage 2 to 4,100 steps (MIXED_LONGER), with several keys in each long document
# (MIXED_FAR), and with more of its units one 32K document (MIXED_WHOLE)
mixed-longer) branch_of mixed-base mixed-longer long-context-mixed "${MIXED_SCALED[@]}" "${MIXED_BASE[@]}" "${MIXED_LONGER[@]}" ;;
mixed-longer-eval) evaluate mixed-longer flash 12 mixed-base ;;
mixed-far) branch_of mixed-base mixed-far long-context-mixed "${MIXED_SCALED[@]}" "${MIXED_BASE[@]}" "${MIXED_FAR[@]}" ;;
mixed-far-eval) evaluate mixed-far flash 12 mixed-base ;;
mixed-whole) branch_of mixed-base mixed-whole long-context-mixed "${MIXED_SCALED[@]}" "${MIXED_BASE[@]}" "${MIXED_WHOLE[@]}" ;;
mixed-whole-eval) evaluate mixed-whole flash 12 mixed-base ;;
# 12 held-out windows of 32,768, as for flash
dense-eval) evaluate dense flash 12 ;;
# the recipe with naive attention at its longest context: ~80 min of steps for as many tokens as
# mixed-digits-whole, more than one machine is held, so a session runs a share of it as a whole run,
# NAIVE_STEPS=N,M (stage 1 to N steps, stage 2 to M; docs/long-context.md)
mixed-naive)
  shift
  [[ "${1:-}" == continue ]] || same_tokenizer_as mixed-digits-whole "$NAIVE_PRESET"
  train "$NAIVE_RUN" "$NAIVE_PRESET" "$@" ${NAIVE_STEPS:+trainer.max_steps=${NAIVE_STEPS%,*}} ;;
mixed-naive-long) naive_long "$NAIVE_RUN" ;;
mixed-naive-eval) evaluate "$NAIVE_RUN" naive "$NAIVE_WINDOWS" "${NAIVE_BESIDE:-mixed-digits-whole}" ;;
# naive's share again with our kernel, in naive's windows (run $NAIVE_RUN-flash): where the naive share
# and recipe-share differ, whether the kernel or the window length makes it
mixed-naive-flash)
  shift
  train "$NAIVE_RUN-flash" "$NAIVE_PRESET" "$@" attention=flash ${NAIVE_STEPS:+trainer.max_steps=${NAIVE_STEPS%,*}} ;;
mixed-naive-flash-long) naive_long "$NAIVE_RUN-flash" attention=flash ;;
mixed-naive-flash-eval) evaluate "$NAIVE_RUN-flash" flash "$NAIVE_WINDOWS" "$NAIVE_RUN" ;;
# the flash recipe (the README's two presets) cut to a share of its steps as a whole run, beside which
# a naive share of as many tokens is drawn (NAIVE_BESIDE=recipe-share): SHARE_STEPS=N,M, stage 1 to N
# steps and stage 2 to M, as NAIVE_STEPS does for naive (on an H100 the same N,M: 32,768 tokens a step
# both; on an H200 naive's steps hold 33,792, so flash's are 3% more)
recipe-share)
  needs_share_steps recipe-share
  shift
  train recipe-share long-context-retrieval-32k "$@" trainer.max_steps=${SHARE_STEPS%,*} ;;
recipe-share-long)
  needs_share_steps recipe-share-long
  after_stage_1 recipe-share "${SHARE_STEPS#*,}"
  train recipe-share long-context-retrieval-long continue trainer.max_steps=${SHARE_STEPS#*,} ;;
recipe-share-eval) evaluate recipe-share flash 12 mixed-digits-whole ;;
naive)
  shift
  [[ "${1:-}" == continue ]] || same_tokenizer_as flash long-context-passkey-naive
  train naive long-context-passkey-naive "$@" ${NAIVE_STEPS:+trainer.max_steps=$NAIVE_STEPS} ;;
# 12 windows of 32,768 and 35 of 11,264 tokens: the same ~393K held-out tokens for both
flash-eval) evaluate flash flash 12 ;;
naive-eval) evaluate naive naive 35 flash ;;
compare)
  step "tokens/s and peak memory of both runs"
  case ${NAIVE_ON:-h200} in
  # the H200 runs of experiment=long-context-passkey and its naive twin
  h200) runs=(flash naive) name=long_context_passkey_h200 ;;
  # the H100 shares of the README's recipe: flash at 32,768, naive at 8,192, and flash in naive's windows
  h100) runs=(recipe-share mixed-naive-h100 mixed-naive-h100-flash) name=long_context_passkey_h100 ;;
  esac
  python3 scripts/compare_runs.py "${runs[@]/#/$EVALS/long_context_passkey_}" --out "$EVALS" --name "$name" 2>&1 | tee -a "$LOG"
  ;;
*) echo "usage: $0 flash|naive [continue] | flash-eval|naive-eval | dense | dense-eval | mixed [continue] | mixed-long | mixed-eval | mixed-scaled[-long|-eval] | mixed-base[-long|-eval] | mixed-digits[-long|-eval] | mixed-digits-whole[-eval] | mixed-digits-longer[-eval] | RUN [continue] | RUN-long | RUN-eval, RUN one of: ${!RECIPE_WITH[*]} | mixed-digits-warm8k[-seed2026] [continue] | mixed-digits-warm8k[-seed2026]-long | mixed-digits-warm8k[-seed2026]-eval | mixed-longer[-eval] | mixed-far[-eval] | mixed-whole[-eval] | mixed-naive [continue] | mixed-naive-long | mixed-naive-eval | mixed-naive-flash [continue] | mixed-naive-flash-long | mixed-naive-flash-eval | recipe-share [continue] | recipe-share-long | recipe-share-eval | compare" >&2; exit 2 ;;
esac
step done
