# Set-up is part of every target: a fresh machine needs only `make serve` or `make test`.
export VENV ?= .venv
PY := $(VENV)/bin/python
CONFIG ?= configs/default.yaml
HOST ?= 127.0.0.1
PORT ?= 8000
export PIP_DISABLE_PIP_VERSION_CHECK := 1

.PHONY: setup serve test soak check tiny clean

setup:
	@bash scripts/setup-env.sh

tiny: setup
	@$(PY) -m omni_server.models.tiny_checkpoints

# ARGS: more arguments, e.g. ARGS="--stage-arg thinker.model=/models/Qwen2.5-Omni-7B --api-key KEY".
serve: tiny
	$(PY) -m omni_server.cli serve $(CONFIG) --host $(HOST) --port $(PORT) $(ARGS)

# (the default config serves the tiny models: built first for it only)
check: $(if $(filter configs/default.yaml,$(CONFIG)),tiny,setup)
	$(PY) -m omni_server.cli check $(CONFIG) $(ARGS)

test: tiny
	$(PY) -m pytest -q -m "not slow" --durations=25 tests

soak: tiny
	$(PY) -m pytest -q -m slow tests/test_soak.py

clean:
	rm -rf $(VENV) var
