"""Every docstring example in the package runs and prints what it says."""

import doctest
import importlib
import pkgutil

import pytest

import oryx_gradlog

MODULES = sorted(m.name for m in pkgutil.walk_packages(oryx_gradlog.__path__, "oryx_gradlog.")
                 if not m.name.endswith("__main__"))


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples_run(name):
  module = importlib.import_module(name)
  finder = doctest.DocTestFinder()
  runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
  for test in finder.find(module, name):
    if test.examples:
      runner.run(test)
  result = runner.summarize(verbose=False)
  assert result.failed == 0, f"{result.failed} of {result.attempted} examples in {name} failed"


def test_the_public_functions_have_examples():
  missing = [n for n in oryx_gradlog.__all__
             if callable(getattr(oryx_gradlog, n)) and not isinstance(getattr(oryx_gradlog, n), type)
             and ">>>" not in (getattr(oryx_gradlog, n).__doc__ or "")]
  assert not missing, f"public functions without a docstring example: {missing}"
