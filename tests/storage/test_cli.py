"""The command line and the ways it finds runs: a run folder, its store, a folder of runs."""

import os
import subprocess
import sys

import jax.numpy as jnp
import numpy as np
import pytest

import oryx_gradlog as gl


def _run(run_dir, steps=3, scale=1.0):
  with gl.RunLog(run_dir) as log:
    for step in range(steps):
      log.append(step, {"loss": jnp.float32(scale / (step + 1)),
                        "w": jnp.arange(4.0) * step})
  return os.fspath(run_dir)


def _cli(*args):
  return subprocess.run([sys.executable, "-m", "oryx_gradlog", *map(str, args)],
                        capture_output=True, text=True, timeout=300, check=False)


def test_help_answers_without_importing_jax():
  code = ("import sys\nfrom oryx_gradlog import __main__ as cli\ntry:\n"
          "  cli.main(['report', '--help'])\nexcept SystemExit:\n  pass\n"
          "print('jax' in sys.modules, 'oryx' in sys.modules)")
  result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, check=True)
  assert result.stdout.splitlines()[-1] == "False False"
  assert "its log.zarr, or a folder of runs" in " ".join(result.stdout.split())


def test_a_run_opens_by_its_folder_or_its_store(tmp_path):
  run_dir = _run(tmp_path / "run")
  by_store = gl.open_run(os.path.join(run_dir, "log.zarr"))
  np.testing.assert_array_equal(by_store["loss"].values, gl.open_run(run_dir)["loss"].values)
  np.testing.assert_allclose(by_store["loss"].values, [1.0, 0.5, 1 / 3], rtol=1e-6)


def test_a_folder_of_runs_is_named_by_the_api_and_reported_each_by_the_cli(tmp_path):
  runs = [_run(tmp_path / "runs" / name, scale=scale)
          for name, scale in (("a", 1.0), ("b", 2.0))]
  with pytest.raises(FileNotFoundError, match=r"open_run\('.*runs'\): this folder holds 2 "
                     r"runs, not one \('.*a', '.*b'\)\. Pass one of them"):
    gl.open_run(tmp_path / "runs")
  result = _cli("report", tmp_path / "runs")
  assert result.returncode == 0, result.stderr
  pages = result.stdout.split()
  assert pages == [os.path.join(run, "report", "index.html") for run in runs]
  assert all(os.path.isfile(page) for page in pages)
  # A second report of the folder does not take the reports for runs.
  result = _cli("report", tmp_path / "runs")
  assert result.returncode == 0 and result.stdout.split() == pages, result.stderr
  result = _cli("tensorboard", tmp_path / "runs", "--logdir", tmp_path / "board")
  assert result.returncode == 0, result.stderr
  assert result.stdout.split() == [str(tmp_path / "board" / "a"), str(tmp_path / "board" / "b")]


def test_the_report_of_a_store_path_goes_beside_the_store(tmp_path):
  run_dir = _run(tmp_path / "run")
  result = _cli("report", os.path.join(run_dir, "log.zarr"))
  assert result.returncode == 0, result.stderr
  assert result.stdout.strip() == os.path.join(run_dir, "report", "index.html")


def test_an_empty_folder_says_no_run_here(tmp_path):
  result = _cli("report", tmp_path)
  assert result.returncode == 2 and "no run here" in result.stderr
  assert "the folder that holds log.zarr" in result.stderr


def _events(logdir):
  accumulator = pytest.importorskip(
      "tensorboard.backend.event_processing.event_accumulator").EventAccumulator(
          str(logdir), size_guidance={"scalars": 0})
  accumulator.Reload()
  return accumulator


def test_tensorboard_re_export_replaces_its_own_event_file_only(tmp_path):
  tensorboardx = pytest.importorskip("tensorboardX")
  run_dir = _run(tmp_path / "run")
  logdir = gl.export_tensorboard(os.path.join(run_dir, "log.zarr"))  # The store's path.
  assert logdir == os.path.join(run_dir, "tensorboard")
  first = os.listdir(logdir)
  logdir = gl.export_tensorboard(run_dir)
  ours = os.listdir(logdir)
  assert len(first) == len(ours) == 1  # One file, whatever its time stamp.
  losses = [event.value for event in _events(logdir).Scalars("loss")]
  np.testing.assert_allclose(losses, [1.0, 0.5, 1 / 3], rtol=1e-6)  # Each step once.
  other = tensorboardx.FileWriter(logdir)  # A user's own event file is kept.
  other.close()
  gl.export_tensorboard(run_dir)
  kept = os.listdir(logdir)
  assert len(kept) == 2 and set(kept) - set(ours)
  assert sum(name.endswith(".oryx_gradlog") for name in kept) == 1
