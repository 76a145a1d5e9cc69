#!/usr/bin/env bash
# Replicate the tool-use comparison of VPO-SPEC section 7 at this project's scale (not part of CI).
#
#   1. train VPO  (configs/tooluse.yaml) for STEPS optimizer steps, and
#   2. train GRPO (configs/tooluse_grpo.yaml) from the same base model on the same compute: until it has generated
#      as many tokens as the VPO run did (rollout.max_generated_tokens; MATCH=steps: the same optimizer steps);
#   3. evaluate both and the base model (single answers and 3-answer chains) on the same seeded test prompts with
#      the same solution budget (n solutions per prompt: n/3 VPO chains vs n GRPO samples);
#   4. write docs/results.md with `vpo compare` (table + best@k plot docs/results_best_at_k.png).
# TASK=maze runs the same protocol on configs/maze.yaml / configs/maze_grpo.yaml (report: docs/results_maze.md).
#
# Same optimizer steps does not mean same tokens: a VPO chain holds 3 answers in one max_new_tokens budget, a GRPO
# sample one answer in the same budget, and sequence lengths follow the policy. Hence MATCH=tokens by default. The
# generated tokens of each run (TensorBoard `train/rollout/tokens`, summed) are in the "train tokens" column.
#
# Full run (defaults): about 1-2 hours on a 2-core CPU, minutes on a GPU.
#   bash benchmarks/replicate_tooluse.sh
# Shortened smoke run (proves the pipeline end to end; numbers meaningless):
#   STEPS=2 N=6 PROMPTS=4 MAX_NEW_TOKENS=32 DTYPE=fp32 PREFIX=smoke RESULTS=/tmp/results.md \
#     EXTRA_FIT="--rollout.group_size=2 --data.batch_size=1 --data.max_prompt_tokens=300" \
#     EXTRA_EVAL="--max_prompt_tokens 300" bash benchmarks/replicate_tooluse.sh
#
# Environment knobs (defaults in brackets):
#   TASK [tooluse]       tooluse or maze: configs/$TASK.yaml (VPO) and configs/${TASK}_grpo.yaml (GRPO)
#   STEPS [40]           optimizer steps of the VPO run (and of the GRPO run with MATCH=steps)
#   MATCH [tokens]       tokens: GRPO trains until it has generated the VPO run's tokens (at most 4 x STEPS steps);
#                        steps: GRPO trains for STEPS optimizer steps
#   N [12]               solutions per test prompt (a multiple of m = 3)
#   PROMPTS [40]         test prompts (a seeded sample of data/tooluse/test.jsonl, prompt seed 0)
#   REUSE_VPO [0]        1: keep an existing checkpoints/$PREFIX-$TASK-vpo run (its last.ckpt must be at STEPS) and
#                        only train GRPO and evaluate
#   SEED [0]             training seed (seed_everything, rollout.seed) and evaluation sampling seed
#   MAX_NEW_TOKENS []    override rollout.sampling.max_new_tokens in training and evaluation (empty: configs' 192)
#   DTYPE []             override model.model.dtype everywhere (empty: configs' auto = bf16 where the hardware has
#                        it: CUDA, or CPUs with avx512_bf16/AMX; fp32 otherwise)
#   EXTRA_FIT []         more `vpo fit` arguments for both runs, e.g. "--rollout.group_size=4 --trainer.accelerator=gpu"
#   EXTRA_EVAL []        more `vpo eval` arguments for every evaluation, e.g. "--prompts_per_call 8"
#   PREFIX [replicate]   runs go to checkpoints/$PREFIX-$TASK-{vpo,grpo}/, evaluations to
#                        checkpoints/$PREFIX-$TASK-eval/
#   RESULTS [docs/results.md for tooluse, docs/results_$TASK.md otherwise]  the report
#   PY [.venv/bin/python if present, else python]
set -euo pipefail
cd "$(dirname "$0")/.."

TASK=${TASK:-tooluse}
STEPS=${STEPS:-40}
MATCH=${MATCH:-tokens}
REUSE_VPO=${REUSE_VPO:-0}
[[ "$MATCH" == tokens || "$MATCH" == steps ]] || { echo "MATCH=$MATCH: use tokens or steps" >&2; exit 2; }
N=${N:-12}
PROMPTS=${PROMPTS:-40}
SEED=${SEED:-0}
MAX_NEW_TOKENS=${MAX_NEW_TOKENS:-}
DTYPE=${DTYPE:-}
EXTRA_FIT=${EXTRA_FIT:-}
EXTRA_EVAL=${EXTRA_EVAL:-}
PREFIX=${PREFIX:-replicate}
if [[ "$TASK" == tooluse ]]; then DEFAULT_RESULTS=docs/results.md; else DEFAULT_RESULTS=docs/results_$TASK.md; fi
RESULTS=${RESULTS:-$DEFAULT_RESULTS}
VPO_CONFIG=configs/$TASK.yaml
GRPO_CONFIG=configs/${TASK}_grpo.yaml
for config in "$VPO_CONFIG" "$GRPO_CONFIG"; do
  [[ -f "$config" ]] || { echo "TASK=$TASK: $config does not exist" >&2; exit 2; }
done
if [[ -z "${PY:-}" ]]; then
  if [[ -x .venv/bin/python ]]; then PY=.venv/bin/python; else PY=python; fi
fi
vpo() { "$PY" -m vpo_lightning "$@"; }

FIT_SET=() EVAL_SET=()
if [[ -n "$MAX_NEW_TOKENS" ]]; then
  FIT_SET=("--rollout.sampling.max_new_tokens=$MAX_NEW_TOKENS")
  EVAL_SET=(--set "rollout.sampling.max_new_tokens=$MAX_NEW_TOKENS")
fi
if [[ -n "$DTYPE" ]]; then
  FIT_SET+=("--model.model.dtype=$DTYPE")
  EVAL_SET+=(--set "model.model.dtype=$DTYPE")
fi
read -r -a FIT_EXTRA <<< "$EXTRA_FIT"
read -r -a EVAL_EXTRA <<< "$EXTRA_EVAL"
EVAL_DIR="checkpoints/$PREFIX-$TASK-eval"
START=$(date -u +%Y-%m-%dT%H:%M:%SZ)
declare -A WALL

train() {  # $1 = vpo|grpo, $2 = config, $3 = max steps, then more `vpo fit` arguments
  local method=$1 run="$PREFIX-$TASK-$1" config=$2 steps=$3 t0=$SECONDS
  shift 3
  rm -rf "checkpoints/$run"  # a fresh run: no resumed state, no stale TensorBoard events
  echo "=== train $method: $config -> checkpoints/$run (at most $steps steps) $*"
  vpo fit --config "$config" --run_name="$run" --trainer.max_steps="$steps" --seed_everything="$SEED" \
    --rollout.seed="$SEED" --checkpoint.every_n_train_steps="$steps" "${FIT_SET[@]}" "${FIT_EXTRA[@]}" "$@"
  WALL[train-$method]=$((SECONDS - t0))
}

run_tokens() {  # generated training tokens of checkpoints/$1/last.ckpt (the report's "train tokens")
  "$PY" -c "import sys; from vpo_lightning.commands.evaluate import training_tokens as t; \
print(t(sys.argv[1], None)['generated_tokens'])" "checkpoints/$1/last.ckpt"
}

evaluate() {  # $1 = output name, $2 = label, then `vpo eval` arguments
  local name=$1 label=$2 t0=$SECONDS
  shift 2
  echo "=== eval $label -> $EVAL_DIR/$name"
  vpo eval "$@" --n "$N" --max_prompts "$PROMPTS" --seed "$SEED" --prompt_seed 0 --label "$label" \
    --out "$EVAL_DIR/$name" --overwrite "${EVAL_SET[@]}" "${EVAL_EXTRA[@]}"
  WALL[eval-$name]=$((SECONDS - t0))
}

if [[ "$REUSE_VPO" == 1 && -f "checkpoints/$PREFIX-$TASK-vpo/last.ckpt" ]]; then
  echo "=== REUSE_VPO=1: keeping checkpoints/$PREFIX-$TASK-vpo"
else
  train vpo "$VPO_CONFIG" "$STEPS"
fi
if [[ "$MATCH" == tokens ]]; then
  VPO_TOKENS=$(run_tokens "$PREFIX-$TASK-vpo")
  echo "=== the VPO run generated $VPO_TOKENS tokens: GRPO trains until it has generated as many"
  train grpo "$GRPO_CONFIG" $((4 * STEPS)) --rollout.max_generated_tokens="$VPO_TOKENS"
else
  train grpo "$GRPO_CONFIG" "$STEPS"
fi
rm -rf "$EVAL_DIR"
evaluate vpo "VPO" --config "$VPO_CONFIG" --ckpt "checkpoints/$PREFIX-$TASK-vpo/last.ckpt"
evaluate grpo "GRPO" --config "$GRPO_CONFIG" --ckpt "checkpoints/$PREFIX-$TASK-grpo/last.ckpt"
evaluate base-single "base, single answers" --config "$GRPO_CONFIG"
evaluate base-chains "base, 3-answer chains" --config "$VPO_CONFIG"

# The evaluated checkpoints are the ends of the runs: VPO at STEPS; GRPO at STEPS, or past the VPO run's tokens.
"$PY" - "$STEPS" "$EVAL_DIR" "$MATCH" <<'EOF'
import json, sys
steps, root, match = int(sys.argv[1]), sys.argv[2], sys.argv[3]
reports = {name: json.load(open(f"{root}/{name}/eval.json")) for name in ("vpo", "grpo")}
tokens = {name: (r["training"] or {}).get("generated_tokens") for name, r in reports.items()}
for name, report in reports.items():
    print(f"{name}: {report['global_step']} optimizer steps, {tokens[name]} generated training tokens")
assert reports["vpo"]["global_step"] == steps, f"vpo: checkpoint at step {reports['vpo']['global_step']}, not {steps}"
if match == "steps":
    assert reports["grpo"]["global_step"] == steps, f"grpo: checkpoint at step {reports['grpo']['global_step']}"
elif tokens["grpo"] < tokens["vpo"]:
    print(f"WARNING: GRPO hit its step cap ({4 * steps}) before generating the VPO run's {tokens['vpo']} tokens")
EOF

vpo compare "$EVAL_DIR/vpo/eval.json" "$EVAL_DIR/grpo/eval.json" "$EVAL_DIR/base-single/eval.json" \
  "$EVAL_DIR/base-chains/eval.json" --out "$RESULTS" \
  --title "$TASK: VPO vs GRPO, same base model, the same $([[ $MATCH == tokens ]] && echo "generated tokens" || echo "$STEPS optimizer steps")"

COMMIT=$(git rev-parse --short HEAD 2>/dev/null || echo unknown)
DIRTY=$(git status --porcelain 2>/dev/null | grep -q . && echo " (uncommitted changes)" || true)
DEVICE=$("$PY" -c "import torch; print(torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'CPU')")
{
  echo
  echo "## How this was produced"
  echo
  echo "\`bash benchmarks/replicate_tooluse.sh\` with TASK=$TASK STEPS=$STEPS MATCH=$MATCH REUSE_VPO=$REUSE_VPO N=$N PROMPTS=$PROMPTS SEED=$SEED" \
    "MAX_NEW_TOKENS=${MAX_NEW_TOKENS:-config} DTYPE=${DTYPE:-config} EXTRA_FIT='$EXTRA_FIT' EXTRA_EVAL='$EXTRA_EVAL'," \
    "commit $COMMIT$DIRTY, started $START on $DEVICE ($(nproc) CPU cores)."
  if [[ "$MATCH" == tokens ]]; then
    echo "Both trainings start from the same base model; VPO trains $STEPS optimizer steps, GRPO until it has generated"
    echo "as many tokens (it stops after the step that crosses the budget; column \"train tokens\", from TensorBoard)."
  else
    echo "Both trainings start from the same base model and stop after the same number of optimizer steps; they do"
    echo "not generate the same number of tokens (column \"train tokens\", from TensorBoard \`train/rollout/tokens\`)."
  fi
  echo "Each evaluation gives every method the same number of solutions per prompt (n = $N)."
  echo
  echo "| phase | wall time (s) |"
  echo "|---|---|"
  for phase in train-vpo train-grpo eval-vpo eval-grpo eval-base-single eval-base-chains; do
    echo "| $phase | ${WALL[$phase]:-not run (REUSE_VPO=1)} |"
  done
} >> "$RESULTS"
echo "=== wrote $RESULTS"
