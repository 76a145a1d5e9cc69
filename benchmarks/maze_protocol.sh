#!/usr/bin/env bash
# The maze comparison of issue 38 (docs/results_maze.md; not part of CI): one (method, seed) at a time, resumable,
# each finished result committed at once. The reference's protocol (ryanboldi/vpo PAPER_REPRO.md section 3.1) at a
# size two CPU cores can run: every method starts from the same cold start (configs/maze5_sft.yaml), trains the
# same number of prompt visits (configs/maze5*.yaml: 100 steps x B = 4 prompts, no dynamic sampling), with the
# budgets and defaults of docs/FIDELITY.md, and is evaluated on the test split at the evaluation temperature.
#
#   METHOD=vpo SEED=0 bash benchmarks/maze_protocol.sh          # train (or resume) -> evaluate -> record
#   METHOD=sft_single SEED=0 bash benchmarks/maze_protocol.sh   # the cold start itself, single answers / chains
#   bash benchmarks/maze_protocol.sh report                     # docs/results_maze*.{md,png} from the committed files
#
# METHOD: vpo | grpo | multi_rlvr (configs/maze5{,_grpo,_multi_rlvr}.yaml) | sft_single | sft_chains.
# A run whose checkpoints/<run>/last.ckpt exists resumes from it (`--ckpt_path last`); a finished run (its
# last.ckpt at max_steps) is not retrained; an evaluation whose eval.json exists is kept. When the evaluation
# ends, eval.json, per-position rates, training curves, the run summary (benchmarks/run_summary.py), the wall times and the adapter's SHA-256 are copied to
# $RESULTS_DIR/<method>-s<seed>/ and committed in $RESULTS_REPO (only those files), so no finished seed is lost.
#
# Knobs [defaults]: SEED [0], SFT_ADAPTER [checkpoints/maze5-sft/adapters/last], N [24 solutions per maze: 8 chains
# of 3], PROMPTS [50 test mazes], TEMPERATURE [0.7, docs/FIDELITY.md], EVAL_MAX_NEW_TOKENS [256: one budget for every
# method at evaluation, the chain budget, as the reference evaluates (VPO-SPEC section 6)], THREADS [1: two runs side by side on two
# cores], RESULTS_REPO [.: the checkout that records results; the main checkout when running from an experiment
# checkout], RESULTS_DIR [docs/results/maze], COMMIT [1], PREFIX [maze5: runs checkpoints/$PREFIX-<method>-s<seed>],
# MAX_STEPS [the config's], EXTRA_FIT [more `vpo fit` arguments], EXTRA_EVAL [more `vpo eval` arguments],
# PY [.venv/bin/python if present, else python]. Issue 50 (docs/EXPERIMENTS.md "The maze, settled"): DATA_SEED [$SEED:
# the run seed also sets the prompt order; issue 38's runs used 0], LR [the config's model.optim.lr], STEP [last: the
# adapter to evaluate, e.g. 40 for checkpoints/<run>/adapters/step=40, the checkpoint a validation rule chose],
# SAVE_ADAPTER [1: the evaluated adapter's weights, config and card are recorded beside eval.json, under adapter/].
#
# TASK [maze]: tooluse runs the same protocol on BFCL tool use (issue 51): configs/tooluse{,_grpo,_multi_rlvr}.yaml,
# SFT_ADAPTER [checkpoints/tooluse-sft/adapters/last], RESULTS_DIR [docs/results/tooluse], PREFIX [tooluse],
# EVAL_MAX_NEW_TOKENS [640, the chain budget], and each evaluation also gets BFCL's own checker (bfcl.json,
# python -m vpo_lightning.tasks.tooluse.bfcl_check).
#
# Smoke run on the random tiny model (numbers meaningless, a few minutes): see tests/test_maze_protocol.py.
set -euo pipefail
cd "$(dirname "$0")/.."
if [[ -z "${PY:-}" ]]; then
  if [[ -x .venv/bin/python ]]; then PY=.venv/bin/python; else PY=python; fi
fi
vpo() { "$PY" -m vpo_lightning "$@"; }
RESULTS_REPO=${RESULTS_REPO:-.}
TASK=${TASK:-maze}
case "$TASK" in
  maze) CFG=configs/maze5 DEFAULT_PREFIX=maze5 DEFAULT_TOKENS=256 ;;
  tooluse) CFG=configs/tooluse DEFAULT_PREFIX=tooluse DEFAULT_TOKENS=640 ;;
  *) echo "TASK=$TASK: use maze or tooluse" >&2; exit 2 ;;
esac
RESULTS_DIR=${RESULTS_DIR:-docs/results/$TASK}

if [[ "${1:-}" == report ]]; then
  if [[ "$TASK" != maze ]]; then  # no maze-only sections (cold-start gate, step-50, checkpoint sweeps)
    exec "$PY" benchmarks/maze_report.py --results "$RESULTS_REPO/$RESULTS_DIR" --out "$RESULTS_REPO/docs/results_$TASK.md"
  fi
  midpoint=()  # the post-hoc step-50 evaluations, where they exist
  [[ -d "$RESULTS_REPO/${MIDPOINT_DIR:-docs/results/maze-step50}" ]] \
    && midpoint=(--midpoint "$RESULTS_REPO/${MIDPOINT_DIR:-docs/results/maze-step50}")
  sweeps=()  # issue 50's checkpoint sweeps (benchmarks/maze_checkpoints.py), where they exist
  [[ -d "$RESULTS_REPO/${CHECKPOINTS_DIR:-docs/results/maze-settled/checkpoints}" ]] \
    && sweeps=(--checkpoints "$RESULTS_REPO/${CHECKPOINTS_DIR:-docs/results/maze-settled/checkpoints}")
  exec "$PY" benchmarks/maze_report.py --results "$RESULTS_REPO/$RESULTS_DIR" "${midpoint[@]}" "${sweeps[@]}" \
    --coldstart "$RESULTS_REPO/${COLDSTART_DIR:-docs/results/maze-coldstart}" --out "$RESULTS_REPO/docs/results_maze.md"
fi

METHOD=${METHOD:?set METHOD to vpo, grpo, multi_rlvr, sft_single or sft_chains}
SEED=${SEED:-0}
SFT_ADAPTER=${SFT_ADAPTER:-checkpoints/$([[ $TASK == maze ]] && echo maze5 || echo "$TASK")-sft/adapters/last}
N=${N:-24}
PROMPTS=${PROMPTS:-50}
TEMPERATURE=${TEMPERATURE:-0.7}
EVAL_MAX_NEW_TOKENS=${EVAL_MAX_NEW_TOKENS:-$DEFAULT_TOKENS}
THREADS=${THREADS:-1}
DATA_SEED=${DATA_SEED:-$SEED}
STEP=${STEP:-last}
SAVE_ADAPTER=${SAVE_ADAPTER:-1}
LR_ARG=()
[[ -n "${LR:-}" ]] && LR_ARG=(--model.optim.lr "$LR")
COMMIT=${COMMIT:-1}
PREFIX=${PREFIX:-$DEFAULT_PREFIX}
read -r -a FIT_EXTRA <<< "${EXTRA_FIT:-}"
read -r -a EVAL_EXTRA <<< "${EXTRA_EVAL:-}"
export OMP_NUM_THREADS=$THREADS MKL_NUM_THREADS=$THREADS
case "$METHOD" in
  vpo|sft_chains) CONFIG=$CFG.yaml ;;
  grpo|sft_single) CONFIG=${CFG}_grpo.yaml ;;
  multi_rlvr) CONFIG=${CFG}_multi_rlvr.yaml ;;
  *) echo "METHOD=$METHOD: use vpo, grpo, multi_rlvr, sft_single or sft_chains" >&2; exit 2 ;;
esac
[[ -d "$SFT_ADAPTER" ]] || { echo "SFT_ADAPTER=$SFT_ADAPTER is not a directory: run vpo sft --config ${CFG}_sft.yaml" >&2; exit 2; }
NAME="${METHOD}-s$SEED"
RUN="$PREFIX-${METHOD//_/-}-s$SEED"
EVAL_DIR="checkpoints/$PREFIX-eval/$NAME$([[ "$STEP" == last ]] || echo "-step$STEP")"
TIMES="checkpoints/$PREFIX-eval/$NAME.times.tsv"
mkdir -p "checkpoints/$PREFIX-eval"

max_steps=${MAX_STEPS:-$("$PY" -c "import sys, yaml; print(yaml.safe_load(open(sys.argv[1]))['trainer']['max_steps'])" "$CONFIG")}
done_steps() {  # the global step of checkpoints/$RUN/last.ckpt, 0 when there is none
  [[ -f "checkpoints/$RUN/last.ckpt" ]] || { echo 0; return; }
  "$PY" -c "import sys, torch; print(torch.load(sys.argv[1], map_location='cpu', weights_only=False)['global_step'])" \
    "checkpoints/$RUN/last.ckpt"
}

if [[ "$METHOD" != sft_* ]]; then
  steps=$(done_steps)
  if (( steps < max_steps )); then
    resume=()
    if (( steps > 0 )); then
      resume=(--ckpt_path last)
    elif [[ -d "checkpoints/$RUN" ]]; then  # killed before its first checkpoint: nothing to keep
      resume=(--overwrite)
    fi
    echo "=== train $RUN ($CONFIG, seed $SEED, from step $steps of $max_steps, $THREADS thread(s))"
    t0=$SECONDS
    vpo fit --config "$CONFIG" --run_name "$RUN" --seed_everything "$SEED" --rollout.seed "$SEED" \
      --data.seed "$DATA_SEED" "${LR_ARG[@]}" --trainer.max_steps "$max_steps" --model.model.adapter "$SFT_ADAPTER" \
      "${resume[@]}" "${FIT_EXTRA[@]}"
    printf 'train\t%s\t%s\t%s\n' "$RUN" "$steps" $((SECONDS - t0)) >> "$TIMES"
    rm -rf "$EVAL_DIR"  # an evaluation of the run before this training is stale
  fi
  ADAPTER="checkpoints/$RUN/adapters/$([[ "$STEP" == last ]] && echo last || echo "step=$STEP")"
  [[ -d "$ADAPTER" ]] || { echo "STEP=$STEP: $ADAPTER does not exist (checkpoints every 10 steps)" >&2; exit 2; }
  EVAL_ARGS=(--adapter "$ADAPTER")
else
  ADAPTER=$SFT_ADAPTER
  EVAL_ARGS=(--config "$CONFIG" --set "model.model.adapter=$SFT_ADAPTER")
fi

if [[ ! -f "$EVAL_DIR/eval.json" ]]; then
  echo "=== eval $NAME -> $EVAL_DIR"
  t0=$SECONDS
  vpo eval "${EVAL_ARGS[@]}" --split test --n "$N" --max_prompts "$PROMPTS" --seed "$SEED" --prompt_seed 0 \
    --set "eval.temperature=$TEMPERATURE" --set "rollout.sampling.max_new_tokens=$EVAL_MAX_NEW_TOKENS" --label "$NAME" --out "$EVAL_DIR" "${EVAL_EXTRA[@]}"
  printf 'eval\t%s\t-\t%s\n' "$NAME" $((SECONDS - t0)) >> "$TIMES"
fi

OUT="$RESULTS_REPO/$RESULTS_DIR/$NAME"
mkdir -p "$OUT"
cp "$EVAL_DIR/eval.json" "$OUT/eval.json"
cp "$TIMES" "$OUT/times.tsv"
"$PY" benchmarks/maze_report.py --positions "$EVAL_DIR" > "$OUT/positions.json"
if [[ "$TASK" == tooluse ]]; then  # BFCL's own checker on every answer (what a BFCL user reads)
  [[ -f "$EVAL_DIR/bfcl.json" ]] || "$PY" -m vpo_lightning.tasks.tooluse.bfcl_check "$EVAL_DIR"
  cp "$EVAL_DIR/bfcl.json" "$OUT/bfcl.json"
fi
if [[ "$METHOD" != sft_* ]]; then
  "$PY" benchmarks/run_summary.py "checkpoints/$RUN" --first 10 --last 10 > "$OUT/run_summary.md"
  "$PY" benchmarks/maze_report.py --curves "checkpoints/$RUN" > "$OUT/curves.json"
fi
sha256sum "$ADAPTER/adapter_model.safetensors" | awk '{print $1}' > "$OUT/adapter.sha256"
if [[ "$SAVE_ADAPTER" == 1 && "$METHOD" != sft_* ]]; then  # the cold start's adapter is committed once, by hand
  mkdir -p "$OUT/adapter"
  for f in adapter_model.safetensors adapter_config.json vpo_adapter.json README.md; do
    [[ -f "$ADAPTER/$f" ]] && cp "$ADAPTER/$f" "$OUT/adapter/$f"
  done
fi
git rev-parse HEAD > "$OUT/commit.txt" 2>/dev/null || echo unknown > "$OUT/commit.txt"
echo "=== recorded $OUT"
if [[ "$COMMIT" == 1 ]]; then
  for try in 1 2 3 4 5; do  # another commit in the same checkout may hold the index lock for a moment
    if git -C "$RESULTS_REPO" add -- "$RESULTS_DIR/$NAME"; then
      if git -C "$RESULTS_REPO" diff --cached --quiet -- "$RESULTS_DIR/$NAME"; then
        echo "=== nothing new to commit in $RESULTS_DIR/$NAME"; break
      fi
      if git -C "$RESULTS_REPO" commit -q -m "$TASK results: $NAME (benchmarks/maze_protocol.sh, commit $(cut -c1-7 "$OUT/commit.txt"))" \
           -- "$RESULTS_DIR/$NAME"; then
        echo "=== committed $RESULTS_DIR/$NAME"; break
      fi
    fi
    sleep 5
  done
fi
