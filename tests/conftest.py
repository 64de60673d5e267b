"""Shared test helpers: the ways a reaped function is run, and tolerances.

The tests are laid out like the package: `record/` (sites, reaps, `record_layers`
and the stock models it reads), `statistics/`, `storage/` (the log, the report, the
command line), `analyses/<concern>/` (per-example, instruments, attribution; the
analyses of one backward pass in `analyses/test_analyses.py`). At the top: checks
of the whole package (its API, docstrings, examples, README, install, benchmarks,
many processes, float64) and the shared helpers (`per_example.py`: `vmap(grad)`
references for found layers; this module). Tests marked `slow` run with
GRADLOG_SLOW_TESTS set (`SLOW_TESTS` below; CI: on the newest JAX, and the
newcomer's checks on the default set).
"""

import atexit
import collections
import dataclasses
import os
import shutil
import tempfile
from importlib import metadata

# Set before JAX starts its backends, and inherited by the tests' subprocesses: eight
# CPU devices for the sharding tests, and XLA's CPU backend at optimisation level 1
# without LLVM's expensive passes (the tests' programs are small, so compiling them is
# most of the suite's time; this compiles ~25% faster). Level 0 is as fast but moves
# some float32 results by ~1.5e-5 relative on JAX 0.10.2's CPU backend, past the
# tests' rtol=1e-5; jaxlib 0.8.2's CPU backend segfaults compiling some programs at
# level 1 (test_reap's jitted `sin` called twice), so it gets level 0, where its set
# passes. A flag already in XLA_FLAGS keeps its value.
XLA_TEST_FLAGS = {
    "xla_force_host_platform_device_count": "8",
    "xla_backend_optimization_level": "0" if metadata.version("jaxlib").startswith("0.8.") else "1",
    "xla_llvm_disable_expensive_passes": "true",
}

# GRADLOG_TEST_DEVICE=tpu: the suite on a TPU machine (../shared/tpu/README.md), in one
# process (`python -m pytest -p no:xdist`; the chip takes one process). JAX's products
# run at HIGHEST precision there (the default is one bfloat16 pass, ~1e-3 relative),
# so that the comparisons with plain JAX hold at the tests' tolerances; the CPU
# backend's optimisation flags are left out; the tests' subprocesses run on the
# host's CPU (JAX_PLATFORMS=cpu); tests that need eight devices or sockets skip,
# saying so. Unset or `cpu`: the suite as CI runs it.
TEST_DEVICE = os.environ.get("GRADLOG_TEST_DEVICE", "cpu")
if TEST_DEVICE not in ("cpu", "tpu"):
  raise RuntimeError(f"GRADLOG_TEST_DEVICE={TEST_DEVICE!r}: give cpu or tpu.")
if TEST_DEVICE == "tpu":
  XLA_TEST_FLAGS = {"xla_force_host_platform_device_count": "8"}  # The subprocesses'.
_given = os.environ.get("XLA_FLAGS", "")
os.environ["XLA_FLAGS"] = " ".join(
    [_given] + [f"--{k}={v}" for k, v in XLA_TEST_FLAGS.items() if k not in _given]).strip()

# JAX's persistent compilation cache, one folder per pytest run (made by the first
# process that imports this file and inherited by the xdist workers and the tests'
# subprocesses; removed by that process at exit): the suite compiles many programs
# more than once (a benchmark variant for timing and again for its memory analysis,
# a worker process launched again to resume, the same model in several tests). The
# cache key is the whole program with its compile options and XLA flags, so a hit
# runs what a compile would have given. JAX writes entries without a lock: an entry
# cut short (a process killed while writing it) is read with a warning and compiled
# again. A JAX_COMPILATION_CACHE_DIR already set is kept (GRADLOG_TEST_CACHE=0 turns
# this off).
if (os.environ.get("GRADLOG_TEST_CACHE", "1") != "0"
    and "JAX_COMPILATION_CACHE_DIR" not in os.environ):
  os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="gradlog-test-jax-cache-")
  os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
  os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")
  atexit.register(shutil.rmtree, os.environ["JAX_COMPILATION_CACHE_DIR"], ignore_errors=True)

import jax
import numpy as np
import pytest

if TEST_DEVICE == "tpu":
  if jax.default_backend() != "tpu":
    raise RuntimeError(f"GRADLOG_TEST_DEVICE=tpu, but JAX's backend is "
                       f"{jax.default_backend()}: run it on the TPU machine.")
  jax.config.update("jax_default_matmul_precision", "highest")
  os.environ["JAX_PLATFORMS"] = "cpu"  # This process has the chip; its children not.
  os.environ["XLA_FLAGS"] = " ".join(
      [_given] + [f"--{k}={v}" for k, v in XLA_TEST_FLAGS.items() if k not in _given]).strip()


def eight_devices() -> list:
  """The eight devices of the sharding tests (the CPU's, as XLA_TEST_FLAGS asks), or
  a skip that says why there are fewer."""
  devices = jax.devices()
  if len(devices) < 8:
    pytest.skip(f"needs 8 devices; JAX's {jax.default_backend()} backend here has "
                f"{len(devices)} (on a CPU, conftest.py asks XLA for 8)")
  return devices[:8]


def needs_sockets() -> None:
  """Skips a test that starts processes talking over sockets where there are none
  (the TPU machine)."""
  if TEST_DEVICE == "tpu":
    pytest.skip("starts processes that talk over local sockets (jax.distributed); the "
                "TPU machine has none: run it on a CPU machine")

# How a reaped function is run: as it is, under jit outside the reap, and with
# jit applied inside the reap (to the differentiated function).
VARIANTS = {
    "eager": lambda reaper, f: reaper(f),
    "jit_outside": lambda reaper, f: jax.jit(reaper(f)),
    "jit_inside": lambda reaper, f: reaper(jax.jit(f)),
}


# The files whose tests take longest (processes, whole programs, stock models) run
# first, so that pytest-xdist's workers are not left waiting on one of them at the end.
LONG_FIRST = ("test_multihost.py", "test_examples.py", "test_readme.py",
              "test_benchmarks.py", "test_frameworks_record_layers.py")


# GRADLOG_SLOW_TESTS: which tests marked `slow` run. Unset, none (`make test`); `1`
# every one but those marked `many_processes` (the 4-process test of
# test_multihost.py); `all` every one; `newcomer` those also marked `newcomer` (the
# README's blocks, `make demo`'s example); `others` the rest, 4 processes too. CI
# splits them: `newcomer` on the default set, `others` on the newest JAX.
SLOW_TESTS = {"1": lambda item: "many_processes" not in item.keywords,
              "all": lambda item: True,
              "newcomer": lambda item: "newcomer" in item.keywords,
              "others": lambda item: "newcomer" not in item.keywords}


def pytest_collection_modifyitems(config, items):
  """Tests marked `slow` run as GRADLOG_SLOW_TESTS says (`SLOW_TESTS`); the files of
  `LONG_FIRST` go first (in their own order)."""
  del config
  items.sort(key=lambda item: item.path.name not in LONG_FIRST)  # Stable.
  wanted = os.environ.get("GRADLOG_SLOW_TESTS")
  if wanted and wanted not in SLOW_TESTS:
    raise pytest.UsageError(f"GRADLOG_SLOW_TESTS={wanted!r}: give one of "
                            f"{', '.join(SLOW_TESTS)}, or leave it unset.")
  runs = SLOW_TESTS[wanted] if wanted else lambda item: False
  skip = pytest.mark.skip(reason="a long check that " + (
      f"GRADLOG_SLOW_TESTS={wanted} leaves out" if wanted else "runs only with "
      "GRADLOG_SLOW_TESTS set") + ": set GRADLOG_SLOW_TESTS=all to run it")
  for item in items:
    if "slow" in item.keywords and not runs(item):
      item.add_marker(skip)


@pytest.fixture(params=list(VARIANTS), ids=list(VARIANTS))
def variant(request):
  return VARIANTS[request.param]


def assert_trees_close(actual, expected, rtol=1e-5, atol=1e-6):
  """Asserts two pytrees have the same structure and close leaves."""
  assert jax.tree.structure(actual) == jax.tree.structure(expected), (
      jax.tree.structure(actual), jax.tree.structure(expected))
  for a, e in zip(jax.tree.leaves(actual), jax.tree.leaves(expected)):
    assert np.shape(a) == np.shape(e), (np.shape(a), np.shape(e))
    np.testing.assert_allclose(np.asarray(a), np.asarray(e), rtol=rtol, atol=atol)


# How the tests' `record_layers` walks found their batch axes: from one trace
# (`_propagate`), or from the second trace at 2B (its fallback), by why.
ONE_TRACE = "one trace"
WALKS: collections.Counter = collections.Counter()


@pytest.fixture(autouse=True, scope="session")
def _one_trace_checked():
  """Every walk whose batch axes came from one trace is done again with the second
  trace at 2B, and the two must agree: uses, their classes and batch axes, the
  coupling, and the loss's info. (A function that does not trace at 2B, or traces
  differently there, is only walked once.)"""
  # pylint: disable-next=g-import-not-at-top
  from oryx_gradlog.record.record_layers import _propagate, _transform
  walk = _transform._walk

  def checked(flat, closed, signature, kinds, names, one_trace=True):
    analysis, outs = walk(flat, closed, signature, kinds, names, one_trace)
    if analysis.propagation is None:
      try:  # Why, for the summary.
        _propagate.batch_axes(closed.jaxpr, [k == "batch" for k in kinds],
                              signature.batch_size)
        reason = "the walk met a value the rules did not reach"
      except _propagate.Ambiguous as error:
        reason = str(error)
      WALKS[reason] += 1
      return analysis, outs
    WALKS[ONE_TRACE] += 1
    try:
      twin, twin_outs = walk(flat, closed, signature, kinds, names, one_trace=False)
    except Exception:  # pylint: disable=broad-except
      return analysis, outs  # Its structure depends on the batch size.
    differ = [f"{path}: {use} != {twin.uses.get(path)}" for path, use in analysis.uses.items()
              if _fields(twin.uses.get(path)) != _fields(use)]
    differ += [f"{path}: only in the two-trace walk" for path in twin.uses
               if path not in analysis.uses]
    differ += [f"{field}: {getattr(analysis, field)} != {getattr(twin, field)}"
               for field in ("coupling", "inline", "marked", "marked_names")
               if getattr(analysis, field) != getattr(twin, field)]
    if _fields(outs) != _fields(twin_outs):
      differ.append(f"outputs: {outs} != {twin_outs}")
    assert not differ, ("record_layers' batch axes from one trace differ from the two "
                        "traces':\n" + "\n".join(differ))
    return analysis, outs

  _transform._walk = checked
  yield
  _transform._walk = walk


def _fields(value):
  """`value` with its dataclasses (a `Chain` compares by identity) as tuples of fields."""
  if dataclasses.is_dataclass(value) and not isinstance(value, type):
    return (type(value),) + tuple(_fields(getattr(value, f.name))
                                  for f in dataclasses.fields(value))
  if isinstance(value, (tuple, list)):
    return tuple(_fields(v) for v in value)
  return value


def pytest_sessionfinish(session):
  output = getattr(session.config, "workeroutput", None)  # An xdist worker's.
  if output is not None:
    output["record_layers_walks"] = dict(WALKS)


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error):  # xdist's controller: a worker's counts.
  del error
  WALKS.update(getattr(node, "workeroutput", {}).get("record_layers_walks", {}))


def pytest_terminal_summary(terminalreporter):
  if WALKS:
    fallbacks = [(reason, n) for reason, n in WALKS.most_common() if reason != ONE_TRACE]
    terminalreporter.write_line(
        f"record_layers walks: {WALKS[ONE_TRACE]} with batch axes from the one trace, "
        f"{sum(n for _, n in fallbacks)} with batch axes from the second trace")
    for reason, n in fallbacks:
      terminalreporter.write_line(f"  second trace, {n} x: {reason}")
