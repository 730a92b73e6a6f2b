# Two commands: `make run` installs and runs the service; `make test` runs the tests.
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: install run demo test races cluster cluster-test lint bench

# pip's own output is long and its slow phase is silent: one line per package and a note
# before the slow phase instead; the whole output is kept in $(VENV)/install.log.
SHOW_PROGRESS := awk '\
  /^Collecting /{ n++; sub(/^Collecting /, ""); sub(/ \(from .*/, ""); \
                  printf "  [%3d] %s\n", n, $$0; fflush() } \
  /^Installing collected packages/{ print "  installing them (the slow part)..."; fflush() } \
  /^Successfully installed/{ print "  done: " NF - 2 " packages installed"; fflush() }'

$(BIN)/voice-agent: pyproject.toml
	@echo "make: installing voice-agent and its dependencies into $(VENV)"
	@echo "      (about a minute the first time; later runs skip this)"
	@$(PYTHON) -m venv $(VENV)
	@$(BIN)/pip install --quiet --upgrade pip
	@set -o pipefail; $(BIN)/pip install --progress-bar off -e ".[dev]" 2>&1 \
	  | tee $(VENV)/install.log | $(SHOW_PROGRESS) \
	  || { echo "make: the install failed; the end of $(VENV)/install.log:"; \
	       tail -n 30 $(VENV)/install.log; exit 1; }
	@touch $(BIN)/voice-agent
	@echo "make: installed; the command is $(BIN)/voice-agent (or: make run, make demo)"

install: $(BIN)/voice-agent

run: install
	$(BIN)/voice-agent serve

demo: install
	$(BIN)/voice-agent demo

# Four workers on two cores: the suite mostly waits on sockets, timers and subprocesses (with
# two workers the cores were 65-80% idle). On this 2-core machine kind, 1,657 tests: 12 min
# with four, 19.5 with two; `$(BIN)/pytest` alone runs it serially.
TEST_WORKERS ?= 4
test: install
	$(BIN)/pytest -n $(TEST_WORKERS) --durations=30

# The race scenarios alone (`make test` runs them too), serially and in file order, each
# printing one line (state, side effects, order checked, heard) in the summary's "races" part.
races: install
	$(BIN)/pytest -m races -p no:randomly -v

# Two serve replicas, a worker, nginx and Kamailio on loopback, in the foreground (Ctrl+C stops
# it all); .cluster/endpoints.json says where each part is. Needs kamailio and nginx installed.
cluster: install
	$(BIN)/voice-agent cluster

# The cluster's own tests (`make test` runs them too where kamailio and nginx are installed).
cluster-test: install
	VOICE_AGENT_REQUIRE_CLUSTER=1 $(BIN)/pytest -m cluster -p no:randomly -v -s

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
	$(BIN)/python bench/openai_sip.py
	$(BIN)/python bench/recorder.py
