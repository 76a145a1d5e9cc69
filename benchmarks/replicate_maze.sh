#!/usr/bin/env bash
# The maze replication (issue 22; sibling of replicate_tooluse.sh, not part of CI): VPO against GRPO from the same
# cold-start adapter, matched on generated tokens, over several training seeds, with 95% bootstrap intervals.
#
#   1. for each SEED in SEEDS: train VPO (configs/maze5_shaped.yaml) for STEPS optimizer steps from SFT_ADAPTER, then
#      GRPO (configs/maze5_shaped_grpo.yaml) from the same adapter until it has generated as many tokens as that VPO
#      run (rollout.max_generated_tokens; dynamic sampling's extra rounds count), at most 4 x STEPS steps;
#   2. evaluate every run, and the SFT policy itself (single answers and 3-answer chains, once per seed as the
#      evaluation seed), with `vpo eval` on the same PROMPTS held-out mazes and the same solution budget N;
#   3. write RESULTS with `python -m vpo_lightning.commands.replicates` (best@k, pass@k, diversity, E_w best, Pareto
#      fraction, each with a hierarchical bootstrap interval over prompts and seeds; best@k plot with bands), the
#      per-run table of `vpo compare` beside it (<RESULTS stem>_runs.md), and two PNGs of the first test maze: VPO's
#      first chain and GRPO's first three samples (<RESULTS stem>_vpo_chain.png, <RESULTS stem>_grpo_samples.png).
#
# Parts and reuse (the whole does not fit in one sitting on a CPU: one training run is meant to take <= 20 min):
#   PARTS="train eval report" (the default) or any subset, e.g. PARTS=train SEEDS=0, then PARTS=train SEEDS="1 2",
#   then PARTS="eval report". A training run whose checkpoints/<run>/last.ckpt exists is kept (REUSE_TRAIN=1, the
#   default; 0 retrains it), and so is an evaluation whose eval.json exists (REUSE_EVAL=1; 0 re-evaluates).
#
# Full run:   SFT_ADAPTER=checkpoints/maze5-sft/adapters/last bash benchmarks/replicate_maze.sh
# Smoke run (the pipeline end to end on the random tiny model, numbers meaningless; about 10 minutes on 2 cores):
#   SFT_ADAPTER=none SEEDS="0 1" STEPS=1 N=6 PROMPTS=3 MAX_NEW_TOKENS=24 DTYPE=fp32 PREFIX=smoke \
#     RESULTS=/tmp/maze_smoke/results.md EXTRA_FIT="--model.model.name=tiny-llama --rollout.group_size=2 \
#     --data.batch_size=1 --trainer.val_check_interval=null --trainer.limit_val_batches=0" \
#     EXTRA_EVAL="--set model.model.name=tiny-llama" bash benchmarks/replicate_maze.sh
#
# Environment knobs (defaults in brackets):
#   SFT_ADAPTER [required]  the `vpo sft` adapter every run starts from (model.model.adapter); "none" = the base
#                           model (smoke runs only: the embedded model writes almost no routes before a cold start)
#   VPO_CONFIG [configs/maze5_shaped.yaml]  GRPO_CONFIG [configs/maze5_shaped_grpo.yaml]
#   SEEDS ["0 1 2"]          training seeds (seed_everything, rollout.seed); also the evaluation sampling seeds
#   SFT_SEEDS [$SEEDS]       sampling seeds of the starting policy's evaluations (fewer saves CPU time)
#   STEPS [30]               optimizer steps of each VPO run
#   N [12]                   solutions per test prompt for every method (a multiple of m = 3)
#   PROMPTS [50]             held-out mazes (a seeded sample of the config's test split, prompt seed 0)
#   MAX_NEW_TOKENS []        override rollout.sampling.max_new_tokens in training and evaluation (empty: configs')
#   DTYPE []                 override model.model.dtype everywhere (empty: configs' auto)
#   EXTRA_FIT [] EXTRA_EVAL []  more `vpo fit` / `vpo eval` arguments for every run / evaluation
#   PREFIX [maze]            runs: checkpoints/$PREFIX-{vpo,grpo}-s<seed>/, evaluations: checkpoints/$PREFIX-eval/
#   RESULTS [docs/results_maze_shaped.md]
#   PY [.venv/bin/python if present, else python]
set -euo pipefail
cd "$(dirname "$0")/.."

SFT_ADAPTER=${SFT_ADAPTER:?set SFT_ADAPTER to the vpo sft adapter directory (or none for a smoke run)}
VPO_CONFIG=${VPO_CONFIG:-configs/maze5_shaped.yaml}
GRPO_CONFIG=${GRPO_CONFIG:-configs/maze5_shaped_grpo.yaml}
read -r -a SEED_LIST <<< "${SEEDS:-0 1 2}"
read -r -a SFT_SEED_LIST <<< "${SFT_SEEDS:-${SEED_LIST[*]}}"
STEPS=${STEPS:-30}
N=${N:-12}
PROMPTS=${PROMPTS:-50}
PARTS=${PARTS:-train eval report}
REUSE_TRAIN=${REUSE_TRAIN:-1}
REUSE_EVAL=${REUSE_EVAL:-1}
MAX_NEW_TOKENS=${MAX_NEW_TOKENS:-}
DTYPE=${DTYPE:-}
PREFIX=${PREFIX:-maze}
RESULTS=${RESULTS:-docs/results_maze_shaped.md}
for config in "$VPO_CONFIG" "$GRPO_CONFIG"; do
  [[ -f "$config" ]] || { echo "$config does not exist" >&2; exit 2; }
done
if [[ "$SFT_ADAPTER" != none && ! -d "$SFT_ADAPTER" ]]; then
  echo "SFT_ADAPTER=$SFT_ADAPTER is not a directory: train the cold start with \`vpo sft\` first" >&2
  exit 2
fi
if (( N % 3 )); then echo "N=$N: use a multiple of m = 3" >&2; exit 2; fi
if [[ -z "${PY:-}" ]]; then
  if [[ -x .venv/bin/python ]]; then PY=.venv/bin/python; else PY=python; fi
fi
vpo() { "$PY" -m vpo_lightning "$@"; }
has_part() { [[ " $PARTS " == *" $1 "* ]]; }

FIT_SET=() EVAL_SET=()
if [[ "$SFT_ADAPTER" != none ]]; then
  FIT_SET+=("--model.model.adapter=$SFT_ADAPTER")
  EVAL_SET+=(--set "model.model.adapter=$SFT_ADAPTER")
fi
if [[ -n "$MAX_NEW_TOKENS" ]]; then
  FIT_SET+=("--rollout.sampling.max_new_tokens=$MAX_NEW_TOKENS")
  EVAL_SET+=(--set "rollout.sampling.max_new_tokens=$MAX_NEW_TOKENS")
fi
if [[ -n "$DTYPE" ]]; then
  FIT_SET+=("--model.model.dtype=$DTYPE")
  EVAL_SET+=(--set "model.model.dtype=$DTYPE")
fi
read -r -a FIT_EXTRA <<< "${EXTRA_FIT:-}"
read -r -a EVAL_EXTRA <<< "${EXTRA_EVAL:-}"
EVAL_DIR="checkpoints/$PREFIX-eval"
LOG="checkpoints/$PREFIX-wall_times.tsv"
mkdir -p checkpoints

train() {  # $1 = run name, $2 = config, $3 = max steps, $4 = seed, then more `vpo fit` arguments
  local run=$1 config=$2 steps=$3 seed=$4 t0=$SECONDS
  shift 4
  if [[ "$REUSE_TRAIN" == 1 && -f "checkpoints/$run/last.ckpt" ]]; then
    echo "=== reuse checkpoints/$run (REUSE_TRAIN=1)"
    return
  fi
  rm -rf "checkpoints/$run"
  echo "=== train $run: $config, seed $seed, at most $steps steps $*"
  vpo fit --config "$config" --run_name="$run" --trainer.max_steps="$steps" --seed_everything="$seed" \
    --rollout.seed="$seed" --checkpoint.every_n_train_steps="$steps" "${FIT_SET[@]}" "${FIT_EXTRA[@]}" "$@"
  printf 'train\t%s\t%s\n' "$run" $((SECONDS - t0)) >> "$LOG"
}

run_tokens() {  # generated training tokens of checkpoints/$1/last.ckpt
  "$PY" -c "import sys; from vpo_lightning.commands.evaluate import training_tokens as t; \
print(t(sys.argv[1], None)['generated_tokens'])" "checkpoints/$1/last.ckpt"
}

evaluate() {  # $1 = output name, $2 = label, $3 = eval seed, then `vpo eval` arguments
  local name=$1 label=$2 seed=$3 t0=$SECONDS
  shift 3
  if [[ "$REUSE_EVAL" == 1 && -f "$EVAL_DIR/$name/eval.json" ]]; then
    echo "=== reuse $EVAL_DIR/$name (REUSE_EVAL=1)"
    return
  fi
  echo "=== eval $label (seed $seed) -> $EVAL_DIR/$name"
  vpo eval "$@" --n "$N" --max_prompts "$PROMPTS" --seed "$seed" --prompt_seed 0 --label "$label" \
    --out "$EVAL_DIR/$name" --overwrite "${EVAL_SET[@]}" "${EVAL_EXTRA[@]}"
  printf 'eval\t%s\t%s\n' "$name" $((SECONDS - t0)) >> "$LOG"
}

if has_part train; then
  for seed in "${SEED_LIST[@]}"; do
    train "$PREFIX-vpo-s$seed" "$VPO_CONFIG" "$STEPS" "$seed"
    tokens=$(run_tokens "$PREFIX-vpo-s$seed")
    echo "=== VPO seed $seed generated $tokens tokens: GRPO seed $seed trains until it has generated as many"
    train "$PREFIX-grpo-s$seed" "$GRPO_CONFIG" $((4 * STEPS)) "$seed" --rollout.max_generated_tokens="$tokens"
  done
fi

if has_part eval; then
  for seed in "${SEED_LIST[@]}"; do
    evaluate "vpo-s$seed" "VPO s$seed" "$seed" --config "$VPO_CONFIG" --ckpt "checkpoints/$PREFIX-vpo-s$seed/last.ckpt"
    evaluate "grpo-s$seed" "GRPO s$seed" "$seed" --config "$GRPO_CONFIG" \
      --ckpt "checkpoints/$PREFIX-grpo-s$seed/last.ckpt"
  done
  for seed in "${SFT_SEED_LIST[@]}"; do
    evaluate "sft-single-s$seed" "SFT single s$seed" "$seed" --config "$GRPO_CONFIG"
    evaluate "sft-chains-s$seed" "SFT chains s$seed" "$seed" --config "$VPO_CONFIG"
  done
fi

if has_part report; then
  group() {  # $1 = evaluation name, then the seeds
    local name=$1 IFS=,; shift; local out=(); for s in "$@"; do out+=("$EVAL_DIR/$name-s$s"); done; echo "${out[*]}"
  }
  SFT_LABEL=$([[ "$SFT_ADAPTER" == none ]] && echo "base" || echo "SFT")
  "$PY" -m vpo_lightning.commands.replicates --group "VPO=$(group vpo "${SEED_LIST[@]}")" --group "GRPO=$(group grpo "${SEED_LIST[@]}")" \
    --group "$SFT_LABEL, 3-answer chains=$(group sft-chains "${SFT_SEED_LIST[@]}")" \
    --group "$SFT_LABEL, single answers=$(group sft-single "${SFT_SEED_LIST[@]}")" \
    --out "$RESULTS" \
    --title "Maze ($(basename "$VPO_CONFIG" .yaml)): VPO vs GRPO from the same cold start, matched on generated tokens"
  STEM="${RESULTS%.md}"
  all=()
  for s in "${SEED_LIST[@]}"; do all+=("$EVAL_DIR/vpo-s$s" "$EVAL_DIR/grpo-s$s"); done
  for s in "${SFT_SEED_LIST[@]}"; do all+=("$EVAL_DIR/sft-chains-s$s" "$EVAL_DIR/sft-single-s$s"); done
  vpo compare "${all[@]}" --out "${STEM}_runs.md" --title "Maze: every evaluated run (one row per seed)"
  first=${SEED_LIST[0]}
  read -r DATA_FILE FIRST_ID < <("$PY" -c "import json, sys; r = json.load(open(sys.argv[1])); \
print(r['data_file'], r['prompts'][0]['id'])" "$EVAL_DIR/vpo-s$first/eval.json")
  "$PY" -m vpo_lightning.tasks.maze --data "$DATA_FILE" --id "$FIRST_ID" --samples "$EVAL_DIR/vpo-s$first/samples.jsonl" \
    --chains 0 --title "VPO (seed $first): the 3 routes of its first chain" --out "${STEM}_vpo_chain.png"
  "$PY" -m vpo_lightning.tasks.maze --data "$DATA_FILE" --id "$FIRST_ID" \
    --samples "$EVAL_DIR/grpo-s$first/samples.jsonl" --chains 0 1 2 \
    --title "GRPO (seed $first): its first 3 samples" --out "${STEM}_grpo_samples.png"
  COMMIT=$(git rev-parse --short HEAD 2>/dev/null || echo unknown)
  {
    echo
    echo "## How this was produced"
    echo
    echo "\`bash benchmarks/replicate_maze.sh\` with SFT_ADAPTER=$SFT_ADAPTER VPO_CONFIG=$VPO_CONFIG" \
      "GRPO_CONFIG=$GRPO_CONFIG SEEDS='${SEED_LIST[*]}' SFT_SEEDS='${SFT_SEED_LIST[*]}' STEPS=$STEPS N=$N PROMPTS=$PROMPTS" \
      "MAX_NEW_TOKENS=${MAX_NEW_TOKENS:-config} DTYPE=${DTYPE:-config} EXTRA_FIT='${EXTRA_FIT:-}'" \
      "EXTRA_EVAL='${EXTRA_EVAL:-}', commit $COMMIT, $(nproc) CPU cores. Each VPO run trains $STEPS optimizer" \
      "steps; the GRPO run of the same seed trains until it has generated as many tokens. The $SFT_LABEL rows" \
      "are the starting policy, evaluated once per SFT seed (as the sampling seed). Per-run rows: ${STEM##*/}_runs.md."
    echo
    echo "![VPO chain](${STEM##*/}_vpo_chain.png) ![GRPO samples](${STEM##*/}_grpo_samples.png)"
    echo
    echo "| phase | run | wall time (s) |"
    echo "|---|---|---|"
    if [[ -f "$LOG" ]]; then awk -F'\t' '{print "| " $1 " | " $2 " | " $3 " |"}' "$LOG"; fi
  } >> "$RESULTS"
  echo "=== wrote $RESULTS"
fi
