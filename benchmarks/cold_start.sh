#!/usr/bin/env bash
# Does the supervised cold start give RL a gradient? (issue 21; not part of CI.) For one task:
#
#   1. sft:    `vpo sft --config SFT_CONFIG` (skipped when its adapter exists), wall time and peak RSS logged;
#   2. eval:   the base model and the SFT adapter, each as single answers (SINGLE_CONFIG) and as m-answer chains
#              (CHAIN_CONFIG), with `vpo eval` on PROMPTS validation prompts x N single answers / N_CHAINS chain
#              answers (24 = 8 chains of m = 3: one G = 8 group per prompt for the spread; 12 would be 4 chains);
#   3. spread: benchmarks/group_spread.py on those four evaluations: parse rate, each reward dimension, the fraction
#              of G-groups with reward spread (whether RL would get a gradient);
#   4. rl:     `vpo fit --config CHAIN_CONFIG` from the adapter for RL_STEPS steps, then benchmarks/run_summary.py on
#              it (per-dimension reward, parse rate, groups with spread, KL over its first and last 5 steps).
#
# Every phase appends "phase<TAB>name<TAB>seconds<TAB>peak RSS (KiB)" to checkpoints/$PREFIX-coldstart/times.tsv.
#
#   bash benchmarks/cold_start.sh                                            # tool use, the shipped configs
#   SFT_CONFIG=configs/maze5_sft.yaml CHAIN_CONFIG=configs/maze5_shaped.yaml \
#     SINGLE_CONFIG=configs/maze5_shaped_grpo.yaml PREFIX=maze5 bash benchmarks/cold_start.sh
#   PARTS="eval spread" ...                                                  # any subset of "sft eval spread rl"
#
# Knobs (defaults in brackets): SFT_CONFIG [configs/tooluse_sft.yaml], CHAIN_CONFIG [configs/tooluse.yaml],
# SINGLE_CONFIG [configs/tooluse_grpo.yaml], ADAPTER [checkpoints/<SFT run_name>/adapters/last], PREFIX [tooluse],
# N [12], N_CHAINS [24], PROMPTS [50], GROUP [8], RL_STEPS [20], PARTS ["sft eval spread rl"], WHO ["base sft": the
# evaluated policies; WHO=base evaluates the base model while the sft part runs beside it], FORMATS ["single
# chains"], REUSE_EVAL [1: keep an evaluation whose eval.json exists], EXTRA_SFT, EXTRA_EVAL, EXTRA_FIT [more
# arguments for every `vpo sft` / `vpo eval` / `vpo fit`], PY [.venv/bin/python if present].
set -euo pipefail
cd "$(dirname "$0")/.."

SFT_CONFIG=${SFT_CONFIG:-configs/tooluse_sft.yaml}
CHAIN_CONFIG=${CHAIN_CONFIG:-configs/tooluse.yaml}
SINGLE_CONFIG=${SINGLE_CONFIG:-configs/tooluse_grpo.yaml}
PREFIX=${PREFIX:-tooluse}
N=${N:-12}
N_CHAINS=${N_CHAINS:-24}
PROMPTS=${PROMPTS:-50}
GROUP=${GROUP:-8}
RL_STEPS=${RL_STEPS:-20}
PARTS=${PARTS:-sft eval spread rl}
WHO=${WHO:-base sft}
FORMATS=${FORMATS:-single chains}
REUSE_EVAL=${REUSE_EVAL:-1}
read -r -a SFT_EXTRA <<< "${EXTRA_SFT:-}"
read -r -a EVAL_EXTRA <<< "${EXTRA_EVAL:-}"
read -r -a FIT_EXTRA <<< "${EXTRA_FIT:-}"
for config in "$SFT_CONFIG" "$CHAIN_CONFIG" "$SINGLE_CONFIG"; do
  [[ -f "$config" ]] || { echo "$config does not exist" >&2; exit 2; }
done
if [[ -z "${PY:-}" ]]; then
  if [[ -x .venv/bin/python ]]; then PY=.venv/bin/python; else PY=python; fi
fi
SFT_RUN=$(sed -n 's/^run_name: *//p' "$SFT_CONFIG" | head -1)
ADAPTER=${ADAPTER:-checkpoints/${SFT_RUN:-sft}/adapters/last}
OUT="checkpoints/$PREFIX-coldstart"
TIMES="$OUT/times.tsv"
mkdir -p "$OUT"
has_part() { [[ " $PARTS " == *" $1 "* ]]; }

timed() {  # $1 = phase, $2 = name, then the command: runs it under /usr/bin/time for wall time and peak RSS
  local phase=$1 name=$2 t0=$SECONDS rss
  shift 2
  if [[ -x /usr/bin/time ]]; then
    /usr/bin/time -f '%M' -o "$OUT/.rss-$phase-$name" "$@"
    rss=$(tail -1 "$OUT/.rss-$phase-$name")
  else
    "$@"
    rss=unknown
  fi
  printf '%s\t%s\t%s\t%s\n' "$phase" "$name" $((SECONDS - t0)) "$rss" >> "$TIMES"
}

if has_part sft; then
  if [[ -f "$ADAPTER/adapter_config.json" ]]; then
    echo "=== reuse the cold start $ADAPTER"
  else
    echo "=== sft: $SFT_CONFIG -> $ADAPTER"
    timed sft "$(basename "$(dirname "$(dirname "$ADAPTER")")")" "$PY" -m vpo_lightning sft --config "$SFT_CONFIG" "${SFT_EXTRA[@]}"
  fi
fi

if has_part eval; then
  if [[ " $WHO " == *" sft "* && ! -f "$ADAPTER/adapter_config.json" ]]; then
    echo "$ADAPTER: no adapter; run the sft part first (or WHO=base)" >&2; exit 2
  fi
  for who in $WHO; do
    for fmt in $FORMATS; do
      dir="$OUT/$who-$fmt"
      if [[ "$REUSE_EVAL" == 1 && -f "$dir/eval.json" ]]; then echo "=== reuse $dir"; continue; fi
      config=$([[ $fmt == single ]] && echo "$SINGLE_CONFIG" || echo "$CHAIN_CONFIG")
      n=$([[ $fmt == single ]] && echo "$N" || echo "$N_CHAINS")
      weights=()
      [[ $who == sft ]] && weights=(--set "model.model.adapter=$ADAPTER")
      echo "=== eval $who $fmt: $config, $PROMPTS validation prompts x $n answers -> $dir"
      timed eval "$who-$fmt" "$PY" -m vpo_lightning eval --config "$config" --split val --n "$n" \
        --max_prompts "$PROMPTS" --label "$who $fmt" --out "$dir" --overwrite "${weights[@]}" "${EVAL_EXTRA[@]}"
    done
  done
fi

if has_part spread; then  # the evaluations of WHO x FORMATS (WHO=sft: the base model's are not needed)
  dirs=()
  for who in $WHO; do for fmt in $FORMATS; do dirs+=("$OUT/$who-$fmt"); done; done
  "$PY" benchmarks/group_spread.py "${dirs[@]}" --group "$GROUP" | tee "$OUT/spread.md"
fi

if has_part rl; then
  [[ -f "$ADAPTER/adapter_config.json" ]] || { echo "$ADAPTER: no adapter; run the sft part first" >&2; exit 2; }
  run="$PREFIX-from-sft"
  echo "=== rl: $CHAIN_CONFIG from $ADAPTER, $RL_STEPS steps -> checkpoints/$run"
  timed rl "$run" "$PY" -m vpo_lightning fit --config "$CHAIN_CONFIG" --run_name="$run" \
    --model.model.adapter="$ADAPTER" --trainer.max_steps="$RL_STEPS" --overwrite "${FIT_EXTRA[@]}"
  "$PY" benchmarks/run_summary.py "checkpoints/$run" | tee "$OUT/rl_summary.md"
fi
echo "=== wall times and peak RSS: $TIMES"
cat "$TIMES" 2>/dev/null || true
