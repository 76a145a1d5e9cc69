#!/usr/bin/env bash
# The speed suite of issue 43: every number of a quiet window in one script (~22 min on the 2-core AVX-512 EPYC;
# each step is time-boxed and no step starts or runs past BUDGET=1500 s, so at most ~25 min). Run it with NOTHING
# else on the machine: the script makes its own load (one busy core) where a stage asks for it.
#   bash benchmarks/speed_suite.sh --check      # before the window: venvs, imports, data; runs nothing timed
#   bash benchmarks/speed_suite.sh              # the suite; STAGES="vs_trl loaded rollout llamacpp" picks stages
#   TINY=1 LOAD=none RESULTS=/tmp/suite bash benchmarks/speed_suite.sh   # the plumbing at a tiny size (no timings)
# Interpreters: VPO_BENCH_PYTHON (default .venv/bin/python), VPO_TRL_PYTHON (benchmarks/.venv-trl, made by
# setup_trl.sh), VPO_LLAMACPP_PYTHON (benchmarks/.venv-llamacpp, made by setup_llamacpp.sh). Results go to
# benchmarks/results_*_<cpu kind>_bf16[_busy1].json (a stage overwrites its file) and a summary of the ratios
# against the targets to benchmarks/results_speed_suite_<cpu kind>.json:
#   loaded step <= 2.5x quiet step (ours); loaded ours/TRL <= 1.5x quiet ours/TRL.
# Stages and their expected times on the 2-core EPYC (quiet figures from the committed results files):
#   vs_trl    quiet vs_trl.py bf16 --rounds 1 --steps 3 --prompts 6 (ours ~65 s, TRL ~280 s; box 420 s per side)
#   loaded    the same under --load busy:1 (ours ~2 min; TRL cut off at 420 s if it collapses: a lower bound)
#   rollout   bench_rollout.py default engine: quiet (auto), quiet with OMP_WAIT_POLICY=PASSIVE at 2 threads, and
#             under busy:1 with threads auto vs 2 vs 2+PASSIVE (~4 min; each run boxed)
#   llamacpp  vs_llamacpp.py at 1 and 2 threads: ours, llama.cpp bf16 (with and without flash attention), Q4_1 + FA
#             (~5 min)
set -uo pipefail
cd "$(dirname "$0")/.."
export VPO_BENCH_PYTHON=${VPO_BENCH_PYTHON:-$PWD/.venv/bin/python}
export VPO_TRL_PYTHON=${VPO_TRL_PYTHON:-$PWD/benchmarks/.venv-trl/bin/python}
export VPO_LLAMACPP_PYTHON=${VPO_LLAMACPP_PYTHON:-$PWD/benchmarks/.venv-llamacpp/bin/python}
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
PY=$VPO_BENCH_PYTHON
STAGES=${STAGES:-"vs_trl loaded rollout llamacpp"}
LOAD=${LOAD:-busy:1}          # the load of the loaded stages (LOAD=none only to check the plumbing)
R=${RESULTS:-benchmarks}      # where the results files go
mkdir -p "$R"
KIND=$("$PY" -c "import sys; sys.path.insert(0, 'benchmarks'); from roofline import cpu_description, cpu_kind; print(cpu_kind(cpu_description()))") || exit 1
B=benchmarks
TRL_ARGS=(--rounds 1 --steps 3 --prompts 6 --dtype bf16)
ROLL_ARGS=(--variants default --dtype bf16)
LLAMA_ARGS=()
if [ -n "${TINY:-}" ]; then   # B = 1, G = 2, 4 new tokens: checks every step and the summary, measures nothing
  SHAPE=(--prompts-per-step 1 --group-size 2 --max-new-tokens 4)
  TRL_ARGS=(--rounds 1 --steps 2 --prompts 2 --dtype bf16 "${SHAPE[@]}")
  ROLL_ARGS+=("${SHAPE[@]}")
  LLAMA_ARGS=("${SHAPE[@]}")
fi

check() {
  local ok=0
  "$PY" -c "import vpo_lightning, torch; print('ours:', vpo_lightning.__file__, 'torch', torch.__version__)" || ok=1
  "$VPO_TRL_PYTHON" -c "import trl; print('TRL', trl.__version__)" || { echo "run: bash benchmarks/setup_trl.sh" >&2; ok=1; }
  "$VPO_LLAMACPP_PYTHON" -c "import llama_cpp; print('llama-cpp-python', llama_cpp.__version__)" \
    || { echo "run: bash benchmarks/setup_llamacpp.sh" >&2; ok=1; }
  test -f data/tooluse/train.jsonl || { echo "data/tooluse/train.jsonl missing" >&2; ok=1; }
  echo "cpu kind: $KIND; cores: $(nproc); load average now: $(cut -d' ' -f1-3 /proc/loadavg)"
  lscpu | grep -q amx_bf16 || echo "note: no AMX on this CPU (the AMX rows of issue 43 need another machine)"
  return $ok
}
if [ "${1:-}" = "--check" ]; then check; exit $?; fi
check >/dev/null || { echo "preflight failed: bash benchmarks/speed_suite.sh --check" >&2; exit 1; }

stage() { [[ " $STAGES " == *" $1 "* ]]; }
BUDGET=${BUDGET:-1500}         # seconds for the whole suite: no step runs past it (the steps are in priority order)
run() {  # run BOX_SECONDS CMD...: a stage step, killed at its box or at the suite's budget; the suite goes on
  local box=$1 left=$(( T0 + BUDGET - $(date +%s) )); shift
  if [ "$left" -lt 60 ]; then echo "== skipped (suite budget ${BUDGET}s spent): $*" >&2; return; fi
  [ "$box" -gt "$left" ] && box=$left
  echo "== $(date +%T) [box ${box}s] $*" >&2
  timeout --signal=INT --kill-after=20 "$box" "$@" || echo "== step ended with status $? (box ${box}s)" >&2
}
T0=$(date +%s)
echo "speed suite on $(lscpu | sed -n 's/^Model name: *//p') ($KIND), load average $(cut -d' ' -f1 /proc/loadavg)"
awk '{ exit !($1 > 0.5) }' /proc/loadavg && echo "WARNING: load average $(cut -d' ' -f1 /proc/loadavg) > 0.5:" \
  "the 'quiet' rows are not quiet; every results file records the load average at its launches" >&2

if stage vs_trl; then
  run 900 "$PY" $B/vs_trl.py "${TRL_ARGS[@]}" --timeout 420 --out $R/results_vs_trl_${KIND}_bf16.json
fi
if stage loaded; then
  run 960 "$PY" $B/vs_trl.py "${TRL_ARGS[@]}" --load "$LOAD" --timeout 420 \
    --out $R/results_vs_trl_${KIND}_bf16_busy1.json
fi
if stage rollout; then
  run 150 "$PY" $B/bench_rollout.py "${ROLL_ARGS[@]}" --threads auto --rounds 2 --warmup 1 \
    --out $R/results_rollout_${KIND}_bf16_quiet_threads.json
  OMP_WAIT_POLICY=PASSIVE run 150 "$PY" $B/bench_rollout.py "${ROLL_ARGS[@]}" --threads 2 --rounds 2 --warmup 1 \
    --out $R/results_rollout_${KIND}_bf16_passive.json
  run 300 "$PY" $B/bench_rollout.py "${ROLL_ARGS[@]}" --threads auto,2 --rounds 1 --load "$LOAD" \
    --out $R/results_rollout_${KIND}_bf16_busy1.json
  OMP_WAIT_POLICY=PASSIVE run 180 "$PY" $B/bench_rollout.py "${ROLL_ARGS[@]}" --threads 2 --rounds 1 --load "$LOAD" \
    --out $R/results_rollout_${KIND}_bf16_busy1_passive.json
fi
if stage llamacpp; then
  run 480 "$PY" $B/vs_llamacpp.py --threads 1,2 --rounds 1 --warmup 1 "${LLAMA_ARGS[@]}" \
    --sides ours,llama-bf16,llama-bf16-fa,llama-q4_1-fa --out $R/results_llamacpp_${KIND}_bf16.json
fi
echo "== suite took $(( ($(date +%s) - T0) / 60 )) min" >&2
"$PY" $B/speed_summary.py --kind "$KIND" --dir "$R"
