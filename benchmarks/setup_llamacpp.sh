#!/usr/bin/env bash
# Build benchmarks/.venv-llamacpp: llama-cpp-python built from source, beside this project, for
# benchmarks/vs_llamacpp.py. An optional benchmark dependency only: the product never imports it.
#   bash benchmarks/setup_llamacpp.sh         # idempotent; the first build compiles llama.cpp (~10-20 min on 1 core)
# The sdist is compiled for this CPU (GGML_NATIVE: -march=native, so AVX-512 / AVX-512 BF16 / AMX where the CPU has
# them); build the venv again on another CPU kind. Override the pin with LLAMA_CPP_VERSION and the CMake options with
# CMAKE_ARGS; SDIST=path/to/llama_cpp_python-X.tar.gz builds from a file already downloaded
# (`pip download llama-cpp-python==0.3.16 --no-deps -d /tmp/llp`).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
VENV=${LLAMACPP_VENV:-benchmarks/.venv-llamacpp}
VERSION=${LLAMA_CPP_VERSION:-0.3.16}
# CPU only; OpenMP threading (ggml's default); no examples/tests/server: only the shared libraries the bindings load.
export CMAKE_ARGS=${CMAKE_ARGS:-"-DGGML_NATIVE=ON -DGGML_OPENMP=ON -DGGML_CUDA=OFF -DGGML_METAL=OFF -DGGML_VULKAN=OFF \
-DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF -DLLAMA_CURL=OFF"}
export CMAKE_BUILD_PARALLEL_LEVEL=${CMAKE_BUILD_PARALLEL_LEVEL:-1}

test -x "$VENV/bin/python" || "$PYTHON" -m venv "$VENV"
echo "*" > "$VENV/.gitignore"                                     # never committed
PIP=("$VENV/bin/python" -m pip install -q)
"${PIP[@]}" --upgrade pip
"${PIP[@]}" numpy scikit-build-core cmake ninja typing-extensions diskcache jinja2
if ! "$VENV/bin/python" -c "import llama_cpp, sys; sys.exit(llama_cpp.__version__ != '$VERSION')" 2>/dev/null; then
  SRC=${SDIST:-"llama-cpp-python==$VERSION"}
  nice -n 5 "${PIP[@]}" --no-build-isolation --no-binary llama-cpp-python --no-cache-dir "$SRC"
fi
"$VENV/bin/python" - <<'PY'
import llama_cpp
print("benchmarks/.venv-llamacpp: llama-cpp-python", llama_cpp.__version__,
      "| system info:", llama_cpp.llama_print_system_info().decode().strip())
PY
