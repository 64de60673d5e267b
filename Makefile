# Two commands on a fresh machine with Python 3.11 and make:
#   make demo   creates .venv, installs the package, trains the digits MLP with every
#               step's cotangents logged to runs/digits, and writes runs/digits/report
#   make test   creates .venv, installs the package with its test extras, runs pytest
PYTHON ?= python3
VENV ?= .venv
BIN = $(VENV)/bin

.PHONY: demo test bench clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

$(VENV)/.installed: setup.cfg pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e ".[test,store,report,demo]"
	touch $@

demo: $(VENV)/.installed
	$(BIN)/python examples/08_digits_training.py --run-dir runs/digits

test: $(VENV)/.installed
	$(BIN)/python -m pytest oryx_gradlog tests -q

bench: $(VENV)/.installed
	$(BIN)/python benchmarks/run.py

clean:
	rm -rf $(VENV) build *.egg-info
