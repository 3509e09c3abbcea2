# The two set-up commands of the README: `make serve` and `make test`.
VENV ?= .venv
PY := $(VENV)/bin/python
ARGS ?=

.PHONY: venv serve test test-fast bench clean
venv:
	@scripts/bootstrap.sh $(VENV)

serve: venv
	$(VENV)/bin/jaxserve serve $(ARGS)

test: venv
	$(PY) -m pytest -q tests $(ARGS)

clean:
	rm -rf $(VENV) .pytest_cache
