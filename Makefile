# Two commands on a fresh machine with Python 3.10+ and make:
#   make demo   creates .venv, installs the package, trains the digits MLP with every
#               step's cotangents logged to runs/digits, and writes runs/digits/report
#   make test   creates .venv, installs the package with its test extras, runs pytest
# Both use the JAX 0.5.0 set, the one that installs from the package index alone.
#
# The supported matrix (README, "Versions"): one virtual environment per set, each
# installed from scratch with the exact versions of constraints/$(set).txt.
#   make test-all              every set
#   make test-set SET=jax-0.10.2
#   make bench-set SET=jax-0.10.2   (BENCH_ARGS="--only 12": some workloads)
# Sets on Oryx's main branch install Oryx with --no-deps from the wheel in
# $(SHARED_ORYX)/COMMIT/ or dist/oryx-COMMIT/ where one exists (CI, machines without
# GitHub), else from git.
#
# Installing elsewhere (oryx_gradlog is not on the package index):
#   make wheel                 dist/oryx_gradlog-VERSION-py3-none-any.whl, to pip install
#   make oryx-wheel ORYX_COMMIT=9b9ef13 [ORYX_REPO=path/to/oryx-clone-or-bundle]
#                              dist/oryx-9b9ef13/oryx-*.whl, Oryx main built from a clone;
#                              with no package index either, add
#                              PIP_WHEEL_FLAGS=--no-build-isolation (needs poetry-core)
PYTHON ?= python3
VENV ?= .venv
BIN = $(VENV)/bin
EXTRAS = test,store,report,demo
SETS = jax-0.5.0 jax-0.8.2 jax-0.10.2
SET ?= jax-0.5.0
SHARED_ORYX ?= ../shared/oryx
# pytest-xdist workers: one per core, at most 4 (PYTEST_WORKERS= runs in one process).
PYTEST_WORKERS ?= -n auto --maxprocesses 4
# What `make test-set` runs (TESTS="tests/record" runs some).
TESTS ?= oryx_gradlog tests
# The Oryx main commit of each set that needs one.
ORYX_COMMIT_jax-0.8.2 = aa33090
ORYX_COMMIT_jax-0.10.2 = 9b9ef13
# Extras of one set only: the peers that tests compare with where they run
# (kfac-jax 0.0.8 runs on JAX 0.8.2, not 0.10; its tests skip where it is missing),
# and stock models of other libraries (penzai) in the newest set.
SET_EXTRAS_jax-0.8.2 = peers
SET_EXTRAS_jax-0.10.2 = models

.PHONY: demo test bench test-all test-set bench-set wheel oryx-wheel clean

demo: $(VENV)/.installed
	@echo "==> training the digits MLP, every step's cotangents logged to runs/digits (about 40 s)"
	$(BIN)/python examples/08_digits_training.py --run-dir runs/digits

test: $(VENV)/.installed
	@echo "==> running the tests (about 5 minutes on 2 cores, pytest-xdist; a dot is a test passed; GRADLOG_SLOW_TESTS=1 adds the long checks)"
	$(BIN)/python -m pytest $(PYTEST_WORKERS) oryx_gradlog tests -q

bench: $(VENV)/.installed
	$(BIN)/python benchmarks/run.py $(BENCH_ARGS)

$(VENV)/.installed: setup.cfg pyproject.toml constraints/jax-0.5.0.txt
	$(MAKE) --no-print-directory .venv-install DIR=$(VENV) SET=jax-0.5.0

test-all:
	set -e; for set in $(SETS); do $(MAKE) --no-print-directory test-set SET=$$set; done

test-set: .venv-$(SET)/.installed
	.venv-$(SET)/bin/python -m pytest $(PYTEST_WORKERS) $(TESTS) -q

# Benchmark-only extras per set: the bench-peers extra (jax-privacy 2.0) installs only
# where JAX >= 0.7.1; elsewhere workload 12 skips it and says so.
BENCH_EXTRA_jax-0.10.2 = bench-peers
bench-set: .venv-$(SET)/.installed
	$(if $(BENCH_EXTRA_$(SET)),.venv-$(SET)/bin/python -m pip install --quiet -c constraints/$(SET).txt -e ".[$(BENCH_EXTRA_$(SET))]")
	.venv-$(SET)/bin/python benchmarks/run.py $(BENCH_ARGS)

.venv-%/.installed: setup.cfg pyproject.toml constraints/%.txt
	$(MAKE) --no-print-directory .venv-install DIR=.venv-$* SET=$*

wheel:
	$(PYTHON) -m pip wheel --no-deps $(PIP_WHEEL_FLAGS) -w dist .

# Oryx main at $(ORYX_COMMIT) as a wheel, from a clone of ORYX_REPO: a folder or a
# `git bundle` copied from a machine that reaches GitHub (default: the bundle in
# $(SHARED_ORYX) where there is one, else GitHub).
ORYX_REPO ?= $(or $(wildcard $(SHARED_ORYX)/oryx-main.bundle),https://github.com/jax-ml/oryx)
oryx-wheel:
	@test -n "$(ORYX_COMMIT)" || { echo "make oryx-wheel: pass ORYX_COMMIT=... or SET=jax-0.10.2"; exit 2; }
	rm -rf build/oryx-$(ORYX_COMMIT) dist/oryx-$(ORYX_COMMIT)
	git clone --quiet --no-checkout $(ORYX_REPO) build/oryx-$(ORYX_COMMIT)
	git -C build/oryx-$(ORYX_COMMIT) -c advice.detachedHead=false checkout --quiet $(ORYX_COMMIT)
	$(PYTHON) -m pip wheel --no-deps $(PIP_WHEEL_FLAGS) -w dist/oryx-$(ORYX_COMMIT) build/oryx-$(ORYX_COMMIT)

# Installs set $(SET) into $(DIR) from scratch.
ORYX_COMMIT = $(ORYX_COMMIT_$(SET))
ORYX_EXTRA = $(if $(ORYX_COMMIT),oryx-main,oryx-release)
ORYX_WHEEL = $(firstword $(wildcard $(SHARED_ORYX)/$(ORYX_COMMIT)/oryx-*.whl dist/oryx-$(ORYX_COMMIT)/oryx-*.whl))
ORYX_SOURCE = $(or $(ORYX_WHEEL),oryx @ git+https://github.com/jax-ml/oryx@$(ORYX_COMMIT))
comma := ,
SET_EXTRAS = $(if $(SET_EXTRAS_$(SET)),$(comma)$(SET_EXTRAS_$(SET)))
.PHONY: .venv-install
.venv-install:
	@echo "==> creating $(DIR), a virtual environment for the $(SET) set (constraints/$(SET).txt)"
	rm -rf $(DIR)
	$(PYTHON) -m venv $(DIR)
	$(DIR)/bin/python -m pip install --quiet --upgrade pip
	@echo "==> installing $(SET), oryx_gradlog and its extras [$(ORYX_EXTRA),$(EXTRAS)$(SET_EXTRAS)] (2-3 minutes)"
	$(DIR)/bin/python -m pip install --quiet -c constraints/$(SET).txt -e ".[$(ORYX_EXTRA),$(EXTRAS)$(SET_EXTRAS)]"
	$(if $(ORYX_COMMIT),@echo "==> installing Oryx main @$(ORYX_COMMIT) from $(ORYX_SOURCE)")
	$(if $(ORYX_COMMIT),$(DIR)/bin/python -m pip install --quiet --no-deps "$(ORYX_SOURCE)")
	$(DIR)/bin/python -c "import jax, oryx_gradlog as gl; gl.reap; print('$(SET) in $(DIR): jax', jax.__version__)"
	touch $(DIR)/.installed

clean:
	rm -rf $(VENV) $(addprefix .venv-,$(SETS)) build dist *.egg-info
