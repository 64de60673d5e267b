"""The install route of the README that needs no package index: the wheel `make wheel`
builds holds the whole package, installs, and logs and reads back a run from there."""

import os
import pathlib
import subprocess
import sys
import zipfile

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent

_USE = """
import os, sys, tempfile
import jax, jax.numpy as jnp, oryx_gradlog as gl
assert gl.__file__.startswith(sys.argv[1]), gl.__file__
run_dir = tempfile.mkdtemp()
loss = lambda x: jnp.sum(gl.tap(jnp.sin(x), name="h") ** 2)
with gl.RunLog(run_dir) as log:
  log.append(0, {"h": gl.summarize(gl.reap(jax.grad(loss))(jnp.ones(2)))["h"], "opt/lr": 0.1})
run = gl.open_run(run_dir)
assert float(run["opt/lr"][0]) == 0.1 and "h.summary.norm" in run
print("installed wheel works")
"""


def test_the_wheel_holds_the_package_and_works_installed(tmp_path):
  pytest.importorskip("wheel")  # setuptools builds wheels with it.
  pytest.importorskip("zarr")
  # What `make wheel` runs, without the package index (the build tools installed here).
  subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                  "--no-index", "-q", "-w", str(tmp_path / "dist"), str(ROOT)],
                 check=True, capture_output=True, timeout=300)
  (wheel,) = (tmp_path / "dist").glob("oryx_gradlog-*-py3-none-any.whl")
  names = set(zipfile.ZipFile(wheel).namelist())
  sources = {str(p.relative_to(ROOT)) for p in (ROOT / "oryx_gradlog").rglob("*.py")}
  assert sources <= names and "oryx_gradlog/py.typed" in names
  assert not any(name.startswith(("tests/", "examples/")) for name in names)
  site = tmp_path / "site"
  subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "--no-index", "-q",
                  "--target", str(site), str(wheel)], check=True, capture_output=True,
                 timeout=300)
  # The installed copy, not the checkout, is imported (the dependencies are this set's).
  env = {**os.environ, "PYTHONPATH": str(site), "JAX_PLATFORMS": "cpu"}
  result = subprocess.run([sys.executable, "-c", _USE, str(site)], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300, check=False)
  assert result.returncode == 0, result.stderr[-3000:]
  assert "installed wheel works" in result.stdout
