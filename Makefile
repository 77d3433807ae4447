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

serve: tiny
	$(PY) -m omni_server.cli serve $(CONFIG) --host $(HOST) --port $(PORT)

check: setup
	$(PY) -m omni_server.cli check $(CONFIG)

test: tiny
	$(PY) -m pytest -q -m "not slow" tests

soak: tiny
	$(PY) -m pytest -q -m slow tests/test_soak.py

clean:
	rm -rf $(VENV) var
