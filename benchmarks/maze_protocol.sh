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
#   (report knobs: RESULTS_DIR, REPORT_OUT [docs/results_$TASK.md], REPORT_TITLE, COLDSTART_DIR, MIDPOINT_DIR, CHECKPOINTS_DIR;
#   a folder that does not exist is left out. With no RESULTS_DIR the maze report is issue 50's settled one,
#   docs/results_maze.md from docs/results/maze-settled/; issue 38's, docs/results_maze_issue38.md, needs
#   RESULTS_DIR=docs/results/maze REPORT_OUT=docs/results_maze_issue38.md CHECKPOINTS_DIR=none and its title)
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
# SAVE_ADAPTER [1: the evaluated adapter is recorded beside eval.json: a run from a start adapter as adapter-delta/,
# its trained ranks only (benchmarks/adapter_delta.py; the start adapter is committed once), else under adapter/].
# Recording apart from reading the test split (issue 50: seeds train in one session, the test split is read once,
# later): EVAL [1; 0: train and record the run (adapter, config, curves, summary, wall time) without evaluating],
# ADAPTER [a recorded adapter folder, full or adapter-delta/ (rebuilt and SHA-checked first), to evaluate instead
# of training: nothing is trained, the run's recorded curves and summary are kept].
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
if [[ "${1:-}" == report && "$TASK" == maze && -z "${RESULTS_DIR:-}" ]]; then
  # the settled maze comparison (issue 50) is what docs/results_maze.md reports; its knobs, unless given
  RESULTS_DIR=docs/results/maze-settled
  COLDSTART_DIR=${COLDSTART_DIR:-docs/results/maze-settled/gate-b-step240}
  MIDPOINT_DIR=${MIDPOINT_DIR:-none}
  REPORT_TITLE=${REPORT_TITLE:-"Maze (5x5, the reference's reward), settled (issue 50): VPO vs GRPO vs the reference's Multi-RLVR, step size chosen on validation, from one committed cold start"}
fi
RESULTS_DIR=${RESULTS_DIR:-docs/results/$TASK}

if [[ "${1:-}" == report ]]; then
  REPORT_OUT=${REPORT_OUT:-docs/results_$TASK.md}
  title=(); [[ -n "${REPORT_TITLE:-}" ]] && title=(--title "$REPORT_TITLE")
  if [[ "$TASK" != maze ]]; then  # no maze-only sections (cold-start gate, step-50, checkpoint sweeps)
    exec "$PY" benchmarks/maze_report.py --results "$RESULTS_REPO/$RESULTS_DIR" --out "$RESULTS_REPO/$REPORT_OUT" "${title[@]}"
  fi
  midpoint=()  # the post-hoc step-50 evaluations, where they exist
  [[ -d "$RESULTS_REPO/${MIDPOINT_DIR:-docs/results/maze-step50}" ]] \
    && midpoint=(--midpoint "$RESULTS_REPO/${MIDPOINT_DIR:-docs/results/maze-step50}")
  sweeps=()  # issue 50's checkpoint sweeps (benchmarks/maze_checkpoints.py), where they exist
  [[ -d "$RESULTS_REPO/${CHECKPOINTS_DIR:-docs/results/maze-settled/checkpoints}" ]] \
    && sweeps=(--checkpoints "$RESULTS_REPO/${CHECKPOINTS_DIR:-docs/results/maze-settled/checkpoints}")
  exec "$PY" benchmarks/maze_report.py --results "$RESULTS_REPO/$RESULTS_DIR" "${midpoint[@]}" "${sweeps[@]}" \
    --coldstart "$RESULTS_REPO/${COLDSTART_DIR:-docs/results/maze-coldstart}" --out "$RESULTS_REPO/$REPORT_OUT" "${title[@]}"
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
EVAL=${EVAL:-1}
GIVEN_ADAPTER=${ADAPTER:-}
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
[[ -n "$GIVEN_ADAPTER" || -d "$SFT_ADAPTER" ]] || { echo "SFT_ADAPTER=$SFT_ADAPTER is not a directory: run vpo sft --config ${CFG}_sft.yaml" >&2; exit 2; }
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

commit_results() {  # commit $RESULTS_DIR/$NAME in $RESULTS_REPO (only those files)
  for try in 1 2 3 4 5; do  # another commit in the same checkout may hold the index lock for a moment
    if git -C "$RESULTS_REPO" add -- "$RESULTS_DIR/$NAME"; then
      if git -C "$RESULTS_REPO" diff --cached --quiet -- "$RESULTS_DIR/$NAME"; then
        echo "=== nothing new to commit in $RESULTS_DIR/$NAME"; return
      fi
      if git -C "$RESULTS_REPO" commit -q -m "$TASK results: $NAME$1 (benchmarks/maze_protocol.sh, commit $(git rev-parse --short=7 HEAD 2>/dev/null || echo unknown))" \
           -- "$RESULTS_DIR/$NAME"; then
        echo "=== committed $RESULTS_DIR/$NAME"; return
      fi
    fi
    sleep 5
  done
}
record_adapter() {  # the adapter's SHA-256 and (SAVE_ADAPTER=1, RL runs) the adapter itself, into $OUT
  sha256sum "$1/adapter_model.safetensors" | awk '{print $1}' > "$OUT/adapter.sha256"
  if [[ "$SAVE_ADAPTER" == 1 && "$METHOD" != sft_* ]]; then  # the cold start's adapter is committed once, by hand
    rm -rf "$OUT/adapter" "$OUT/adapter-delta"
    start=$("$PY" -c "import json, sys; m = json.load(open(sys.argv[1])); print(m['start_adapter'] if m.get('includes_start_adapter') else '')" "$1/vpo_adapter.json" 2>/dev/null || true)
    if [[ -n "$start" ]]; then
      "$PY" benchmarks/adapter_delta.py split "$1" --start "$start" --out "$OUT/adapter-delta"
    else
      mkdir -p "$OUT/adapter"
      for f in adapter_model.safetensors adapter_config.json vpo_adapter.json README.md; do
        [[ -f "$1/$f" ]] && cp "$1/$f" "$OUT/adapter/$f"
      done
    fi
  fi
}
record_run() {  # the training run's summary and curves, into $OUT
  "$PY" benchmarks/run_summary.py "checkpoints/$RUN" --first 10 --last 10 > "$OUT/run_summary.md"
  "$PY" benchmarks/maze_report.py --curves "checkpoints/$RUN" > "$OUT/curves.json"
}
OUT="$RESULTS_REPO/$RESULTS_DIR/$NAME"

if [[ -n "$GIVEN_ADAPTER" ]]; then  # evaluate a recorded adapter; train nothing
  if [[ -f "$GIVEN_ADAPTER/delta.json" ]]; then
    ADAPTER="checkpoints/$PREFIX-eval/$NAME-adapter"
    "$PY" benchmarks/adapter_delta.py rebuild "$GIVEN_ADAPTER" --out "$ADAPTER"
  else
    ADAPTER=$GIVEN_ADAPTER
  fi
  [[ -f "$ADAPTER/adapter_model.safetensors" ]] || { echo "ADAPTER=$GIVEN_ADAPTER: no adapter_model.safetensors" >&2; exit 2; }
  # the recorded adapter stays as recorded; its SHA-256 must match what was recorded with it (checked before evaluating)
  GIVEN_SHA=$(sha256sum "$ADAPTER/adapter_model.safetensors" | awk '{print $1}')
  if [[ -f "$OUT/adapter.sha256" && "$(cat "$OUT/adapter.sha256")" != "$GIVEN_SHA" ]]; then
    echo "ADAPTER=$GIVEN_ADAPTER: SHA-256 $GIVEN_SHA is not the one recorded in $OUT/adapter.sha256" >&2; exit 2
  fi
  # the run's own config.yaml, recorded beside the adapter folder (EVAL=0 writes it), else the method's config
  given_config=$(dirname "$GIVEN_ADAPTER")/config.yaml
  [[ -f "$given_config" ]] || given_config=$CONFIG
  EVAL_ARGS=(--adapter "$ADAPTER" --config "$given_config")
elif [[ "$METHOD" != sft_* ]]; then
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

if [[ "$EVAL" == 0 ]]; then  # record the trained run without reading the test split
  [[ "$METHOD" != sft_* && -z "$GIVEN_ADAPTER" ]] || { echo "EVAL=0 records a training run: not with $METHOD or ADAPTER" >&2; exit 2; }
  mkdir -p "$OUT"
  cp "$TIMES" "$OUT/times.tsv"
  record_run
  cp "checkpoints/$RUN/config.yaml" "$OUT/config.yaml"
  echo "$STEP" > "$OUT/step.txt"
  record_adapter "$ADAPTER"
  git rev-parse HEAD > "$OUT/commit.txt" 2>/dev/null || echo unknown > "$OUT/commit.txt"
  echo "=== recorded $OUT (trained, not evaluated)"
  [[ "$COMMIT" == 1 ]] && commit_results " trained, not evaluated"
  exit 0
fi

if [[ ! -f "$EVAL_DIR/eval.json" ]]; then
  echo "=== eval $NAME -> $EVAL_DIR"
  t0=$SECONDS
  vpo eval "${EVAL_ARGS[@]}" --split test --n "$N" --max_prompts "$PROMPTS" --seed "$SEED" --prompt_seed 0 \
    --set "eval.temperature=$TEMPERATURE" --set "rollout.sampling.max_new_tokens=$EVAL_MAX_NEW_TOKENS" --label "$NAME" --out "$EVAL_DIR" "${EVAL_EXTRA[@]}"
  EVAL_S=$((SECONDS - t0))
  printf 'eval\t%s\t-\t%s\n' "$NAME" "$EVAL_S" >> "$TIMES"
fi

mkdir -p "$OUT"
cp "$EVAL_DIR/eval.json" "$OUT/eval.json"
if [[ -z "$GIVEN_ADAPTER" ]]; then
  cp "$TIMES" "$OUT/times.tsv"
elif [[ -n "${EVAL_S:-}" ]]; then  # a recorded run keeps its training times; this evaluation's is added
  printf 'eval\t%s\t-\t%s\n' "$NAME" "$EVAL_S" >> "$OUT/times.tsv"
fi
"$PY" benchmarks/maze_report.py --positions "$EVAL_DIR" > "$OUT/positions.json"
if [[ "$TASK" == tooluse ]]; then  # BFCL's own checker on every answer (what a BFCL user reads)
  [[ -f "$EVAL_DIR/bfcl.json" ]] || "$PY" -m vpo_lightning.tasks.tooluse.bfcl_check "$EVAL_DIR"
  cp "$EVAL_DIR/bfcl.json" "$OUT/bfcl.json"
fi
[[ "$METHOD" != sft_* && -z "$GIVEN_ADAPTER" ]] && record_run
if [[ -z "$GIVEN_ADAPTER" ]]; then
  record_adapter "$ADAPTER"
else
  echo "$GIVEN_SHA" > "$OUT/adapter.sha256"
fi
COMMIT_FILE=$OUT/$([[ -z "$GIVEN_ADAPTER" ]] && echo commit.txt || echo eval_commit.txt)  # a recorded run keeps its training commit
git rev-parse HEAD > "$COMMIT_FILE" 2>/dev/null || echo unknown > "$COMMIT_FILE"
echo "=== recorded $OUT"
[[ "$COMMIT" == 1 ]] && commit_results ""
exit 0
