# The two set-up commands of the README: `make serve` and `make test`; `make lint` is what CI adds.
VENV ?= .venv
PY := $(VENV)/bin/python
ARGS ?=

.PHONY: venv serve test lint clean
venv:
	@scripts/bootstrap.sh $(VENV)

serve: venv
	$(VENV)/bin/jaxserve serve $(ARGS)

# ARGS replaces the default test path: `make test ARGS="tests/core -x"` runs only tests/core.
test: venv
	$(PY) -m pytest -q $(if $(ARGS),$(ARGS),tests)

lint: venv
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .

clean:
	rm -rf $(VENV) .pytest_cache
