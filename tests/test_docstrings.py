"""Every docstring example in the package runs and prints what it says."""

import doctest
import importlib
import pkgutil

import pytest

import oryx_gradlog


def _examples(name):
  """The docstring examples of module `name` (those with at least one line)."""
  module = importlib.import_module(name)
  return [t for t in doctest.DocTestFinder().find(module, name) if t.examples]


# The modules that hold examples (the others have none to run).
MODULES = sorted(m.name for m in pkgutil.walk_packages(oryx_gradlog.__path__, "oryx_gradlog.")
                 if not m.name.endswith("__main__") and _examples(m.name))


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples_run(name):
  runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
  for test in _examples(name):
    runner.run(test)
  result = runner.summarize(verbose=False)
  assert result.attempted > 0
  assert result.failed == 0, f"{result.failed} of {result.attempted} examples in {name} failed"


def test_the_public_functions_have_examples():
  missing = [n for n in oryx_gradlog.__all__
             if callable(getattr(oryx_gradlog, n)) and not isinstance(getattr(oryx_gradlog, n), type)
             and ">>>" not in (getattr(oryx_gradlog, n).__doc__ or "")]
  assert not missing, f"public functions without a docstring example: {missing}"
