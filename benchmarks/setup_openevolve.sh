#!/usr/bin/env bash
# Install the pinned OpenEvolve into the project's .venv, for benchmarks/openevolve_code.py.
#   bash benchmarks/setup_openevolve.sh        # idempotent
# OpenEvolve 0.4.1 needs only openai, pyyaml, numpy, tqdm, flask, dacite and cloudpickle, none of which conflicts
# with this project, so it goes into .venv itself (the benchmark's evaluator imports vpo_lightning's sandboxed
# code reward and the server runs from the same environment). The script fails if the install moved torch,
# transformers, peft or numpy.
set -euo pipefail
cd "$(dirname "$0")/.."
OPENEVOLVE=${OPENEVOLVE_VERSION:-0.4.1}
PY=.venv/bin/python
test -x "$PY" || { echo "no .venv: run 'make setup' first" >&2; exit 1; }
versions() { "$PY" - <<'PY'
import importlib.metadata as md
print(" ".join(f"{n}=={md.version(n)}" for n in ("torch", "transformers", "peft", "numpy")))
PY
}
before=$(versions)
"$PY" -m pip install -q "openevolve==$OPENEVOLVE" "openai>=1.40"
after=$(versions)
if [ "$before" != "$after" ]; then
  echo "openevolve moved core pins: before [$before] after [$after]" >&2
  exit 1
fi
"$PY" - <<'PY'
import importlib.metadata as md
import openevolve  # noqa: F401
print("OpenEvolve ready:", ", ".join(f"{n} {md.version(n)}" for n in ("openevolve", "openai", "torch", "transformers")))
PY
