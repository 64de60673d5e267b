"""With `jax_enable_x64` on (environment variable or `jax.config`), the package imports
and records, summarizes and analyses in float64: each route in a fresh process
(`x64_worker.py`), since x64 is read when JAX starts."""

import os
import pathlib
import subprocess
import sys

import pytest

WORKER = pathlib.Path(__file__).with_name("x64_worker.py")


@pytest.mark.parametrize("route", [pytest.param("environment", marks=pytest.mark.slow),
                                   "config"])
def test_float64_records_summaries_and_analyses(route):
  env = {**os.environ, "JAX_PLATFORMS": "cpu"}
  env.pop("JAX_ENABLE_X64", None)
  if route == "environment":
    env["JAX_ENABLE_X64"] = "1"
  command = [sys.executable, str(WORKER)] + (["--config"] if route == "config" else [])
  result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300,
                          check=False)
  assert result.returncode == 0, result.stderr[-3000:]
  assert "x64 checks passed" in result.stdout
