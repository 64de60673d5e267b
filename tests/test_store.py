"""The on-disk log, the report and the TensorBoard export."""

import errno
import os
import pathlib
import signal
import struct
import subprocess
import sys
import textwrap
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

zarr = pytest.importorskip("zarr")
pytest.importorskip("xarray")

import oryx_gradlog as gl

dense = gl.record_vjp(lambda x, w: jnp.tanh(x @ w), name="dense")


@jax.jit
def _step(w, x):
  loss = lambda w, x: jnp.sum(jnp.sin(gl.tap(dense(x, w), name="h")) ** 2)
  records = gl.reap(jax.vmap(jax.grad(loss), in_axes=(None, 0)))(w, x)
  return records, gl.summarize(records, full="h", keep_axes=1)


def _data(step):
  k1, k2 = jax.random.split(jax.random.PRNGKey(step))
  return jax.random.normal(k1, (3, 2)), jax.random.normal(k2, (4, 3))


def test_round_trip_through_xarray_and_zarr(tmp_path):
  expected = []
  with gl.RunLog(tmp_path, config={"lr": 0.5}, dims={"*": ("example",)}) as log:
    for step in range(0, 10, 2):
      records, logged = _step(*_data(step))
      log.append(step, logged)
      expected.append(records)
  run = gl.open_run(tmp_path)
  assert list(run["step"].values) == [0, 2, 4, 6, 8]
  assert run.attrs["config"] == {"lr": 0.5} and run.attrs["versions"]["oryx"] == "0.2.9"
  h = run["h.full"]
  assert h.dims == ("step", "example", "h.full.axis1")
  np.testing.assert_allclose(h.values, np.stack([r["h"] for r in expected]), rtol=1e-6)
  norms = run["dense.summary.1.norm"]  # The w cotangent's per-example norm.
  assert norms.dims == ("step", "example")
  np.testing.assert_allclose(
      norms.values, np.stack([np.linalg.norm(r["dense"][1].reshape(4, -1), axis=1)
                              for r in expected]), rtol=1e-5)
  assert run["dense.summary.0.histogram"].dims == ("step", "example", "magnitude_bin")
  # Plain zarr and numpy read the same arrays.
  group = zarr.open_group(str(tmp_path / "log.zarr"), mode="r")
  np.testing.assert_array_equal(group["h.full"][:], h.values)


def test_resume_appends_and_an_existing_run_is_not_overwritten(tmp_path):
  with gl.RunLog(tmp_path) as log:
    for step in range(3):
      log.append(step, {"x": np.float32(step)})
  with pytest.raises(FileExistsError, match=r"already holds a run. Pass resume=True"):
    gl.RunLog(tmp_path)
  with gl.RunLog(tmp_path, resume=True) as log:
    log.append(3, {"x": np.float32(3), "y": np.ones(2, np.int32)})
  run = gl.open_run(tmp_path)
  np.testing.assert_array_equal(run["x"].values, [0, 1, 2, 3])
  np.testing.assert_array_equal(run["y"].values, [[0, 0]] * 3 + [[1, 1]])  # Back-filled.


def test_drop_policy_counts_dropped_steps(tmp_path, monkeypatch):
  slow = gl.RunLog._stage

  def slow_write(self, step, logged):
    time.sleep(0.05)
    slow(self, step, logged)

  monkeypatch.setattr(gl.RunLog, "_stage", slow_write)
  log = gl.RunLog(tmp_path, queue_size=1, when_full="drop")
  for step in range(20):
    log.append(step, {"x": np.float32(step)})
  log.close()
  run = gl.open_run(tmp_path)
  assert log.dropped > 0 and run.attrs["dropped_steps"] == log.dropped
  assert run.sizes["step"] + log.dropped == 20
  np.testing.assert_array_equal(run["x"].values, run["step"].values)


def test_a_changed_leaf_is_a_clear_error(tmp_path):
  log = gl.RunLog(tmp_path)
  log.append(0, {"x": np.zeros(2)})
  log.append(1, {"x": np.zeros(3)})
  with pytest.raises(RuntimeError, match=r"'x' changed from float64\[2\] to float64\[3\] at "
                     r"step 1.*The 1 steps before it are saved intact"):
    log.flush()
  with pytest.raises(RuntimeError):
    log.close()
  assert gl.open_run(tmp_path).sizes["step"] == 1


def _three_steps(run_dir):
  log = gl.RunLog(run_dir)
  for step in range(3):
    log.append(step, {"x": np.float32(step)})
  return log


def _assert_steps(run_dir, steps):
  run = gl.open_run(run_dir)
  np.testing.assert_array_equal(run["step"].values, steps)
  np.testing.assert_array_equal(run["x"].values, np.asarray(steps, np.float32))


@pytest.mark.parametrize("step", [2, 1, np.int64(0), jnp.int32(2)])
def test_a_repeated_or_earlier_step_is_an_error_not_a_duplicate(tmp_path, step):
  log = _three_steps(tmp_path)
  with pytest.raises(ValueError, match=rf"RunLog.append: step {int(step)} is not after the "
                     r"last step 2 .*steps must increase.*Pass a growing step counter"):
    log.append(step, {"x": np.float32(-1)})
  log.append(np.int64(5), {"x": np.float32(5)})  # The log carries on; gaps are fine.
  log.close()
  _assert_steps(tmp_path, [0, 1, 2, 5])


def test_steps_must_also_increase_across_resume(tmp_path):
  _three_steps(tmp_path).close()
  with gl.RunLog(tmp_path, resume=True) as log:
    with pytest.raises(ValueError, match=r"step 2 is not after the last step 2"):
      log.append(2, {"x": np.float32(-1)})
    log.append(jnp.int32(3), {"x": np.float32(3)})
  _assert_steps(tmp_path, [0, 1, 2, 3])


@pytest.mark.parametrize("step", ["five", "4", 2.7, 3.0, np.float32(3), jnp.float32(3), True,
                                  np.bool_(True), np.arange(2), None])
def test_a_non_integer_step_is_an_error_naming_step(tmp_path, step):
  log = _three_steps(tmp_path)
  with pytest.raises(ValueError, match=r"RunLog.append: step must be an integer, got .* of "
                     r"type .*Pass the step counter as an int"):
    log.append(step, {"x": np.float32(-1)})
  log.append(3, {"x": np.float32(3)})
  log.close()
  _assert_steps(tmp_path, [0, 1, 2, 3])


def test_a_bad_config_is_refused_before_the_folder_is_made(tmp_path):
  run_dir = tmp_path / "run"
  with pytest.raises(TypeError, match=r"config=\.\.\.\): config is not JSON-serialisable at "
                     r"'lr' \(float32\), 'mask' \(ndarray\); nothing was written"):
    gl.RunLog(run_dir, config={"lr": np.float32(0.1), "mask": np.ones(2), "ok": [1, "a"]})
  assert not run_dir.exists()
  with pytest.raises(TypeError, match=r"config must be a mapping, got list"):
    gl.RunLog(run_dir, config=[1, 2])
  assert not run_dir.exists()
  _three_steps(run_dir).close()  # The corrected retry starts clean.
  assert gl.open_run(run_dir).attrs["config"] == {}
  with pytest.raises(TypeError, match=r"'lr' \(float32\)"):  # A resume leaves the run be.
    gl.RunLog(run_dir, resume=True, config={"lr": np.float32(0.1)})
  _assert_steps(run_dir, [0, 1, 2])


def test_a_file_as_run_folder_says_it_is_not_a_directory(tmp_path):
  _three_steps(tmp_path / "run").close()
  notes = tmp_path / "notes.txt"
  notes.write_text("mine")
  with pytest.raises(NotADirectoryError, match=r"RunLog\('.*notes.txt'\): the run folder is a "
                     r"file, not a directory. Pass the path of a folder"):
    gl.RunLog(notes)
  with pytest.raises(NotADirectoryError, match=r"the run folder is under the file '.*notes.txt'"):
    gl.RunLog(notes / "run")
  assert notes.read_text() == "mine"
  _assert_steps(tmp_path / "run", [0, 1, 2])


def test_disk_full_raises_with_the_fix_and_corrupts_nothing(tmp_path, monkeypatch):
  import zarr.storage._local as local  # The file writes of zarr's LocalStore.

  def full_disk(*args, **kwargs):
    raise OSError(errno.ENOSPC, "No space left on device")

  log = gl.RunLog(tmp_path, steps_per_chunk=2)
  for step in range(3):
    log.append(step, {"x": np.full(2, step, np.float32)})
  assert log.flush() == 3  # Steps 0-1 as a chunk, step 2 in half of the next one.
  monkeypatch.setattr(local, "_put", full_disk)
  for step in range(3, 6):  # Rewrites the chunk that holds step 2: it must survive.
    log.append(step, {"x": np.full(2, step, np.float32)})
  with pytest.raises(RuntimeError, match=r"No space left on device. The 3 steps before it are "
                     r"saved intact. Free disk space.*resume=True"):
    log.flush()
  monkeypatch.undo()
  with pytest.raises(RuntimeError):
    log.close()
  run = gl.open_run(tmp_path)
  np.testing.assert_array_equal(run["x"].values, [[0, 0], [1, 1], [2, 2]])
  with gl.RunLog(tmp_path, resume=True) as log:  # And the run continues.
    log.append(3, {"x": np.full(2, 3, np.float32)})
  np.testing.assert_array_equal(gl.open_run(tmp_path)["x"].values[:, 0], [0, 1, 2, 3])


def test_read_only_folder_is_a_clear_error():
  with pytest.raises(OSError, match=r"RunLog\('/sys/gradlog_run'\): cannot write the run "
                     r"folder.*Choose a writable run_dir"):
    gl.RunLog("/sys/gradlog_run")
  with pytest.raises(FileNotFoundError, match=r"open_run\('/nonexistent'\): no run here"):
    gl.open_run("/nonexistent")


_CRASH_SCRIPT = textwrap.dedent("""
    import sys, numpy as np, jax.numpy as jnp, oryx_gradlog as gl
    log = gl.RunLog(sys.argv[1], resume=True)
    step = log.committed_steps
    while True:
      log.append(step, {"x": jnp.full((64, 64), step, jnp.float32), "s": jnp.float32(step)})
      if step % 5 == 4:
        print("flushed", log.flush(), flush=True)
      step += 1
""")


def test_sigkill_mid_training_leaves_every_flushed_step_intact(tmp_path):
  run_dir = str(tmp_path / "run")
  reported = 0
  for _ in range(2):  # Kill, then resume and kill again.
    process = subprocess.Popen([sys.executable, "-c", _CRASH_SCRIPT, run_dir],
                               stdout=subprocess.PIPE, text=True)
    for _ in range(4):
      line = process.stdout.readline()
      assert line.startswith("flushed"), line
      reported = int(line.split()[1])
    process.send_signal(signal.SIGKILL)
    process.wait(timeout=60)
    run = gl.open_run(run_dir)
    committed = run.sizes["step"]
    assert committed >= reported
    np.testing.assert_array_equal(run["step"].values, np.arange(committed))
    np.testing.assert_array_equal(run["s"].values, np.arange(committed))
    np.testing.assert_array_equal(run["x"].values[:, 0, 0], np.arange(committed))
  assert committed >= 40


def _summary_run(tmp_path, steps=6):
  with gl.RunLog(tmp_path, dims={"*": ("example",)}) as log:
    for step in range(steps):
      log.append(step, _step(*_data(step))[1])
  return str(tmp_path)


def test_report_writes_images_and_a_page_naming_every_record(tmp_path):
  matplotlib_image = pytest.importorskip("matplotlib.image")
  page = gl.report(_summary_run(tmp_path), progress=False)
  folder = os.path.dirname(page)
  images = sorted(name for name in os.listdir(folder) if name.endswith(".png"))
  assert {"norms.png", "nonfinite.png", "per_example.png"} <= set(images)
  assert any(name.endswith(".histogram.png") for name in images)
  for name in images:
    pixels = matplotlib_image.imread(os.path.join(folder, name))
    assert pixels.ndim == 3 and pixels.shape[0] > 100 and pixels.std() > 0
  html = pathlib.Path(page).read_text(encoding="utf-8")
  for record in ("dense", "h"):
    assert record in html
  for name in images:
    assert f"src='{name}'" in html


def test_command_line_report_and_error(tmp_path):
  run_dir = _summary_run(tmp_path / "run")
  result = subprocess.run([sys.executable, "-m", "oryx_gradlog", "report", run_dir],
                          capture_output=True, text=True, timeout=300, check=False)
  assert result.returncode == 0, result.stderr
  assert result.stdout.strip().endswith("index.html")
  result = subprocess.run([sys.executable, "-m", "oryx_gradlog", "report", str(tmp_path / "no")],
                          capture_output=True, text=True, timeout=300, check=False)
  assert result.returncode == 2 and "no run here" in result.stderr


def _read_events(path):
  from tensorboardX.proto import event_pb2

  events, data = [], pathlib.Path(path).read_bytes()
  while data:
    (length,) = struct.unpack("<Q", data[:8])
    event = event_pb2.Event()
    event.ParseFromString(data[12 : 12 + length])
    events.append(event)
    data = data[12 + length + 4 :]
  return events


def test_tensorboard_export_has_scalars_and_histograms(tmp_path):
  pytest.importorskip("tensorboardX")
  run_dir = _summary_run(tmp_path / "run", steps=4)
  logdir = gl.export_tensorboard(run_dir)
  (name,) = os.listdir(logdir)
  values = [(value.tag, event.step, value) for event in _read_events(os.path.join(logdir, name))
            for value in event.summary.value]
  norms = sorted((step, value.simple_value) for tag, step, value in values
                 if tag == "h.summary/norm")
  expected = gl.open_run(run_dir)["h.summary.norm"].mean("example").values
  np.testing.assert_allclose([v for _, v in norms], expected, rtol=1e-5)
  histograms = [value.histo for tag, _, value in values if tag == "h.summary/magnitude"]
  assert len(histograms) == 4 and all(sum(h.bucket) == 4 * 2 for h in histograms)  # 4 x h[2]
