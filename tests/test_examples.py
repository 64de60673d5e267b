"""Every example runs to the end, where it checks itself against a plain-JAX reference."""

import pathlib
import runpy

import pytest

EXAMPLES = sorted((pathlib.Path(__file__).parent.parent / "examples").glob("[0-9]*.py"))


def test_examples_are_found():
  assert len(EXAMPLES) >= 2


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.stem for p in EXAMPLES])
def test_example_runs_and_checks_itself(path, capsys):
  runpy.run_path(str(path), run_name="__main__")
  assert "check:" in capsys.readouterr().out
