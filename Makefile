# Two entry points for a fresh machine:  `make demo`  and  `make test`.
# Everything installs into .venv; torch is pinned to the CPU build first so nothing pulls a CUDA build.

PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
PROMPT ?= import os\n

.PHONY: demo test install install-test clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q torch==2.13.0

$(VENV)/.installed: $(BIN)/python pyproject.toml plugins/qwen3/pyproject.toml plugins/ssm/pyproject.toml plugins/kimi_k3/pyproject.toml plugins/glm53/pyproject.toml
	$(BIN)/pip install -q -e . -e plugins/qwen3 -e plugins/ssm -e plugins/kimi_k3 -e plugins/glm53
	touch $@

$(VENV)/.installed-test: $(VENV)/.installed
	$(BIN)/pip install -q -e ".[test]"
	touch $@

install: $(VENV)/.installed
install-test: $(VENV)/.installed-test

demo: install
	$(BIN)/layerzoo generate --prompt "$$(printf '$(PROMPT)')" --max-tokens 96 --loop-watchdog

test: install-test
	HF_HUB_OFFLINE=1 $(BIN)/python -m pytest -q

clean:
	rm -rf $(VENV)
