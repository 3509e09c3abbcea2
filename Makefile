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
# The whole suite runs as two pytest processes (the serving half, then the model half): one
# process holding every test's compiled XLA executables crashed once (SIGSEGV) at 62%.
SERVING_TESTS := tests/bench tests/core tests/engine tests/entrypoints
test: venv
ifeq ($(ARGS),)
	$(PY) -m pytest -q $(SERVING_TESTS)
	$(PY) -m pytest -q tests $(addprefix --ignore=,$(SERVING_TESTS))
else
	$(PY) -m pytest -q $(ARGS)
endif

lint: venv
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .

clean:
	rm -rf $(VENV) .pytest_cache
