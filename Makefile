# Two commands: `make run` installs and runs the service; `make test` runs the tests.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: install run demo test lint bench

$(BIN)/voice-agent: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e ".[dev]"
	touch $(BIN)/voice-agent

install: $(BIN)/voice-agent

run: install
	$(BIN)/voice-agent serve

demo: install
	$(BIN)/voice-agent demo

test: install
	$(BIN)/pytest

lint: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy

bench: install
	$(BIN)/python bench/bridge.py
	$(BIN)/python bench/operations.py
	$(BIN)/python bench/sip_rtp.py
	$(BIN)/python bench/console.py
	$(BIN)/python bench/delivery.py
