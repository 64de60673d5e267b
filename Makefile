# Two commands on a fresh machine with Python 3.11 and make:
#   make demo   creates .venv, installs the package, runs the main example
#   make test   creates .venv, installs the package with its test extras, runs pytest
PYTHON ?= python3
VENV ?= .venv
BIN = $(VENV)/bin

.PHONY: demo test clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

$(VENV)/.installed: setup.cfg pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e ".[test]"
	touch $@

demo: $(VENV)/.installed
	$(BIN)/python examples/02_seed_qmvm.py

test: $(VENV)/.installed
	$(BIN)/python -m pytest oryx_gradlog tests -q

clean:
	rm -rf $(VENV) build *.egg-info
