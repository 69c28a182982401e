# The first two targets are the README's first two commands: they do all the set-up.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
# `make demo` needs only the base install (SQLite and Celery's in-memory broker); `make test`
# adds the `dev` extra (every driver, PySpark, Django, the browser tests' Selenium, ...).
BASE   := $(VENV)/.installed-base
STAMP  := $(VENV)/.installed-dev
# `make test-lowest`: the lower bounds in pyproject.toml, installed by uv's lowest-direct resolution.
LOWEST ?= .venv-lowest
# pytest-xdist workers for `make test` (docs/design.md, "The test suite"); 0 runs it in one process.
TEST_WORKERS ?= 3

.PHONY: demo test test-lowest bench install lint clean

demo: $(BASE)           ## the whole pipeline on the embedded SQLite default (base install only)
	$(BIN)/outbox demo

test: $(STAMP)          ## the test suite (services it cannot reach are skipped, or fail under OUTBOX_REQUIRE_SERVICES)
	$(BIN)/pytest -q -ra -n $(TEST_WORKERS) --dist loadgroup --durations=15

test-lowest: $(STAMP)   ## the suite again with every direct dependency at the lowest version pyproject.toml allows
	$(BIN)/uv venv -q --clear -p $(BIN)/python $(LOWEST)   # anew: uv would keep what an earlier run installed
	VIRTUAL_ENV=$(LOWEST) $(BIN)/uv pip install -q --resolution lowest-direct -e ".[dev]"
	$(LOWEST)/bin/pytest -q -ra -n $(TEST_WORKERS) --dist loadgroup --durations=15

bench: $(STAMP)         ## benchmarks; they print ratios against a baseline measured in the same run
	$(BIN)/pip install -q "py-spy>=0.3"   # the profile phase; not needed by the tests
	$(BIN)/python -m bench

install: $(STAMP)

$(BASE): pyproject.toml
	@$(PYTHON) -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else "Python 3.11+ is required")'
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e .
	@touch $(BASE)

$(STAMP): $(BASE)
	$(BIN)/pip install -q -e ".[dev]"
	@touch $(STAMP)

lint: $(STAMP)          ## ruff and mypy, configured in pyproject.toml ([tool.ruff], [tool.mypy]): zero findings
	$(BIN)/ruff check src tests bench beat_schedule.py
	$(BIN)/mypy

clean:
	rm -rf $(VENV) $(LOWEST) build dist src/*.egg-info .pytest_cache outbox.db outbox.db-wal outbox.db-shm
