# The two set-up commands of the README: `make serve` and `make test`; `make lint` is what CI adds.
VENV ?= .venv
PY := $(VENV)/bin/python
ARGS ?=

.PHONY: venv serve test lint clean
venv:
	@scripts/bootstrap.sh $(VENV)

serve: venv
	$(VENV)/bin/jaxserve serve $(ARGS)

# ARGS replaces the default test paths: `make test ARGS="tests/core -x"` runs only tests/core.
# The whole suite runs as three pytest processes (engine, HTTP entry points, model): one
# process holding every test's compiled XLA executables crashed (SIGSEGV) at 62% once, and
# the engine + entry-points half once at 87% (2026-12-02; each file passes alone).
ENGINE_TESTS := tests/bench tests/core tests/engine
ENTRYPOINT_TESTS := tests/entrypoints
SERVING_TESTS := $(ENGINE_TESTS) $(ENTRYPOINT_TESTS)
test: venv
ifeq ($(ARGS),)
	$(PY) -m pytest -q $(ENGINE_TESTS)
	$(PY) -m pytest -q $(ENTRYPOINT_TESTS)
	$(PY) -m pytest -q tests $(addprefix --ignore=,$(SERVING_TESTS))
else
	$(PY) -m pytest -q $(ARGS)
endif

lint: venv
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .

clean:
	rm -rf $(VENV) .pytest_cache
