"""The on-disk log, the report and the TensorBoard export."""

import errno
import os
import pathlib
import signal
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


def test_bfloat16_and_int4_records_are_stored_exactly_and_resume_as_logged(tmp_path):
  # Records of a bfloat16 model: dtypes of JAX's (ml_dtypes') that zarr has no type
  # for; stored in float32 and int8, which hold every such value exactly.
  def logged(step):
    records, _ = _step(*_data(step))
    return {"h": records["h"].astype(jnp.bfloat16), "code": jnp.arange(-8, 8, dtype=jnp.int4)}

  steps = [logged(step) for step in range(5)]
  with gl.RunLog(tmp_path, steps_per_chunk=2) as log:
    for step in range(3):
      log.append(step, steps[step])
  with gl.RunLog(tmp_path, resume=True) as log:  # The dtype logged is kept for the checks.
    with pytest.raises(ValueError, match=r"'h' was logged as bfloat16\[4, 2\] and is "
                       r"float32\[4, 2\] at step 3"):
      log.append(3, {**steps[3], "h": steps[3]["h"].astype(jnp.float32)})
    for step in (3, 4):
      log.append(step, steps[step])
  run = gl.open_run(tmp_path)
  assert run["h"].dtype == np.float32 and run["code"].dtype == np.int8
  np.testing.assert_array_equal(run["h"].values, np.stack([np.asarray(s["h"], np.float32)
                                                           for s in steps]))
  np.testing.assert_array_equal(run["code"].values, [np.arange(-8, 8)] * 5)
  assert run["h"].attrs["logged_dtype"] == "bfloat16"


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


@pytest.mark.parametrize("as_on_an_accelerator", [False, True])
def test_block_policy_counts_its_waits_and_loses_no_step(tmp_path, monkeypatch,
                                                         as_on_an_accelerator):
  if as_on_an_accelerator:  # The path that starts each leaf's copy to the host.
    from oryx_gradlog.storage import _store
    monkeypatch.setattr(_store, "_on_accelerator", lambda leaf: isinstance(leaf, jax.Array))
  slow = gl.RunLog._stage

  def slow_write(self, step, logged):
    time.sleep(0.05)
    slow(self, step, logged)

  monkeypatch.setattr(gl.RunLog, "_stage", slow_write)
  log = gl.RunLog(tmp_path, queue_size=1)
  values = [jnp.full((3,), step, jnp.float32) for step in range(10)]
  for step, value in enumerate(values):
    log.append(step, {"x": value})
  log.close()
  run = gl.open_run(tmp_path)
  assert log.waits > 0 and log.waited_s > 0
  assert run.attrs["backpressure_waits"] == log.waits
  assert run.attrs["backpressure_seconds"] == pytest.approx(log.waited_s)
  np.testing.assert_array_equal(run["x"].values, np.stack(values))  # Nothing lost.


def test_a_changed_leaf_is_a_clear_error_at_append(tmp_path):
  log = gl.RunLog(tmp_path)
  log.append(0, {"x": np.zeros(2), "n": jnp.int32(1)})
  with pytest.raises(ValueError, match=r"'x' was logged as float64\[2\] and is float64\[3\] "
                     r"at step 1: keep each key's shape and dtype.*Nothing was queued"):
    log.append(1, {"x": np.zeros(3), "n": jnp.int32(2)})
  with pytest.raises(ValueError, match=r"'n' was logged as int32\[\] and is float32\[\] at "
                     r"step 1.*astype\('int32'\)"):
    log.append(1, {"x": np.ones(2), "n": jnp.float32(2)})
  log.append(1, {"x": np.ones(2), "n": jnp.int32(2)})  # The same step, now right.
  log.close()
  run = gl.open_run(tmp_path)
  np.testing.assert_array_equal(run["x"].values, [[0, 0], [1, 1]])
  np.testing.assert_array_equal(run["n"].values, [1, 2])


@pytest.mark.parametrize("value, what", [
    (object(), r"a builtins.object, not an array"),
    ("hello", r"a str \('hello'\): log numbers or arrays"),
    (np.array(["a", "b"]), r"an array of dtype <U1"),
])
def test_values_that_cannot_be_stored_are_refused_at_append(tmp_path, value, what):
  log = gl.RunLog(tmp_path)
  log.append(0, {"loss": jnp.float32(1.0)})
  with pytest.raises(ValueError, match=rf"RunLog.append: 'bad' is {what}.*Nothing was queued"):
    log.append(1, {"loss": jnp.float32(0.5), "bad": value})
  with pytest.raises(ValueError, match=r"'bad' is None, which would not be stored"):
    log.append(1, {"loss": jnp.float32(0.5), "bad": None})
  log.append(1, {"loss": jnp.float32(0.5)})
  log.close()  # Nothing lost: both good steps are there.
  np.testing.assert_array_equal(gl.open_run(tmp_path)["loss"].values, [1.0, 0.5])


def test_keys_logged_at_some_steps_read_back_as_missing(tmp_path):
  with gl.RunLog(tmp_path) as log:
    for step in range(4):
      logged = {"loss": jnp.float32(step)}
      if step % 2:
        logged["eval"] = {"accuracy": jnp.float32(10 * step), "seen": jnp.int32(step)}
      log.append(step, logged)
  run = gl.open_run(tmp_path)
  np.testing.assert_array_equal(run["eval.accuracy"].values, [np.nan, 10, np.nan, 30])
  np.testing.assert_array_equal(run["eval.seen"].values, [0, 1, 0, 3])


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
  assert {"norms.png", "per_example.png"} <= set(images)
  assert any(name.endswith(".histogram.png") for name in images)
  for name in images:
    pixels = matplotlib_image.imread(os.path.join(folder, name))
    assert pixels.ndim == 3 and pixels.shape[0] > 100 and pixels.std() > 0
  html = pathlib.Path(page).read_text(encoding="utf-8")
  for record in ("dense[0]", "dense[1]", "h"):
    assert record in html
  # Each figure drawn for a desktop (the image) and a phone (the narrow screens' source).
  for name in images:
    assert (f"srcset='{name}'" if name.endswith(".phone.png") else f"src='{name}'") in html
  # No NaN or inf anywhere: said in a sentence, not drawn as a flat line.
  assert "nonfinite.png" not in images
  assert "Non-finite cotangent entries: none in dense[0], dense[1], h" in html


def test_command_line_report_and_error(tmp_path, capsys):
  run_dir = _summary_run(tmp_path / "run")
  result = subprocess.run([sys.executable, "-m", "oryx_gradlog", "report", run_dir],
                          capture_output=True, text=True, timeout=300, check=False)
  assert result.returncode == 0, result.stderr
  assert result.stdout.strip().endswith("index.html")
  result = subprocess.run([sys.executable, "-m", "oryx_gradlog", "report", str(tmp_path / "no")],
                          capture_output=True, text=True, timeout=300, check=False)
  assert result.returncode == 2 and "no run here" in result.stderr
  from oryx_gradlog import __main__ as cli  # pylint: disable=import-outside-toplevel
  from importlib import metadata  # pylint: disable=import-outside-toplevel
  with pytest.raises(SystemExit):
    cli.main(["--version"])
  assert metadata.version("oryx_gradlog") in capsys.readouterr().out
  with pytest.raises(SystemExit):
    cli.main(["report", "--help"])
  assert "a run folder written by gl.RunLog" in capsys.readouterr().out


def _events(logdir):
  """TensorBoard's own reader of the event files in `logdir`."""
  accumulator = pytest.importorskip(
      "tensorboard.backend.event_processing.event_accumulator").EventAccumulator(
          str(logdir), size_guidance={"scalars": 0, "histograms": 0})
  accumulator.Reload()
  return accumulator


def test_tensorboard_export_has_scalars_and_histograms(tmp_path):
  pytest.importorskip("tensorboardX")
  run_dir = _summary_run(tmp_path / "run", steps=4)
  events = _events(gl.export_tensorboard(run_dir))
  norms = [(event.step, event.value) for event in events.Scalars("h.summary/norm")]
  expected = gl.open_run(run_dir)["h.summary.norm"].mean("example").values
  assert [step for step, _ in norms] == [0, 1, 2, 3]
  np.testing.assert_allclose([value for _, value in norms], expected, rtol=1e-5)
  histograms = events.Histograms("h.summary/magnitude")
  assert len(histograms) == 4
  assert all(sum(h.histogram_value.bucket) == 4 * 2 for h in histograms)  # 4 x h[2]


# Keys as users write them: tree paths with "/", and characters the store escapes.
KEYS = ("loss", "opt/lr", "grads/fc1/norm", "grads\\fc2", "100%", "summaries/h")


def _keyed_step(step):
  """One step of a run logged under `KEYS`: scalars, a per-example vector, a summary."""
  records, logged = _step(*_data(step))
  return {
      "loss": jnp.float32(1.0 / (step + 1)),
      "opt/lr": 0.1 * 0.5**step,
      "grads/fc1/norm": jnp.linalg.norm(records["dense"][1].reshape(4, -1), axis=1),
      "grads\\fc2": np.int32(step),
      "100%": jnp.float32(step) / 100,
      "summaries/h": logged["h"],
  }


def _keyed_run(run_dir, steps=range(6), resume=False):
  appended = []
  dims = {"grads/*": ("example",), "summaries/*": ("example",)}
  with gl.RunLog(run_dir, dims=dims, steps_per_chunk=4, resume=resume) as log:
    for step in steps:
      logged = _keyed_step(step)
      log.append(step, logged)
      appended.append(_dotted(jax.device_get(logged)))
  return appended


def _dotted(tree):
  """`{name: leaf}` with the names the README gives: tree path entries joined by '.'."""
  def entry(key):
    return str(next(getattr(key, a) for a in ("key", "name", "idx") if hasattr(key, a)))
  return {".".join(map(entry, path)): leaf
          for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]}


def _assert_run_holds(run_dir, appended):
  run = gl.open_run(run_dir)
  assert set(run.data_vars) == set(appended[0])  # Every key, under its own name.
  for name in appended[0]:
    np.testing.assert_array_equal(run[name].values, np.stack([a[name] for a in appended]),
                                  err_msg=name)
  return run


def test_every_key_comes_back_from_open_run_and_plain_zarr(tmp_path):
  from urllib.parse import unquote

  appended = _keyed_run(tmp_path)
  run = _assert_run_holds(tmp_path, appended)
  assert {"loss", "opt/lr", "grads/fc1/norm", "grads\\fc2", "100%",
          "summaries/h.full", "summaries/h.summary.norm"} <= set(run.data_vars)
  assert run["grads/fc1/norm"].dims == ("step", "example")
  # Plain zarr: one array per key, named by the documented encoding, with its key.
  group = zarr.open_group(str(tmp_path / "log.zarr"), mode="r")
  names = {name for name, _ in group.arrays()} - {"step"}
  assert {unquote(name) for name in names} == set(appended[0])
  assert "opt%2Flr" in names and "grads%5Cfc2" in names and "100%25" in names
  assert group["opt%2Flr"].attrs["key"] == "opt/lr"
  np.testing.assert_array_equal(group["grads%2Ffc1%2Fnorm"][:], run["grads/fc1/norm"].values)
  # Resumed, the run carries on and loses nothing written before.
  appended += _keyed_run(tmp_path, range(6, 9), resume=True)
  _assert_run_holds(tmp_path, appended)


def test_every_key_comes_back_in_tensorboard(tmp_path):
  pytest.importorskip("tensorboardX")
  appended = _keyed_run(tmp_path / "run")
  events = _events(gl.export_tensorboard(tmp_path / "run"))
  run = gl.open_run(tmp_path / "run")
  for name in ("loss", "opt/lr", "grads\\fc2", "100%"):
    values = [(event.step, event.value) for event in events.Scalars(name)]
    assert [step for step, _ in values] == list(range(6)), name
    np.testing.assert_allclose([v for _, v in values], run[name].values, rtol=1e-6)
  assert "summaries/h.summary/norm" in events.Tags()["scalars"]
  # A per-example vector: a histogram of its entries each step.
  histograms = events.Histograms("grads/fc1/norm")
  assert [h.step for h in histograms] == list(range(6))
  for h, expected in zip(histograms, run["grads/fc1/norm"].values):
    assert h.histogram_value.num == 4
    np.testing.assert_allclose(h.histogram_value.sum, expected.sum(), rtol=1e-5)
  assert "summaries/h.full" in events.Tags()["histograms"]
  _assert_run_holds(tmp_path / "run", appended)  # Reading lost nothing.


def test_tensorboard_exports_instruments_and_refuses_an_empty_export(tmp_path):
  pytest.importorskip("tensorboardX")
  with gl.RunLog(tmp_path / "run") as log:
    for step in range(3):  # alpha is NaN at step 0: not read there.
      alpha = jnp.float32(jnp.nan if step == 0 else 0.1 * step)
      log.append(step, {"instruments": {"alpha": alpha, "norm_test": jnp.float32(step)}})
  events = _events(gl.export_tensorboard(tmp_path / "run"))
  assert [e.step for e in events.Scalars("instruments.alpha")] == [1, 2]
  np.testing.assert_allclose([e.value for e in events.Scalars("instruments.norm_test")],
                             [0, 1, 2])
  with gl.RunLog(tmp_path / "complex") as log:  # Nothing that TensorBoard can show.
    log.append(0, {"z": np.complex64(1 + 2j)})
  with pytest.raises(ValueError, match=r"export_tensorboard\('.*complex'\): the run has no "
                     r"numeric variable to export \(its variables: \['z'\]\)"):
    gl.export_tensorboard(tmp_path / "complex")
  assert not (tmp_path / "complex" / "tensorboard").exists()
  result = subprocess.run([sys.executable, "-m", "oryx_gradlog", "tensorboard",
                           str(tmp_path / "complex")], capture_output=True, text=True,
                          timeout=300, check=False)
  assert result.returncode == 2 and "no numeric variable to export" in result.stderr


@pytest.mark.parametrize("logged, message", [
    (np.ones(2), r"the logged value itself has an empty name; log a dict"),
    ({"a.b": 1.0, "a": {"b": 2.0}}, r"\['a.b'\] and \['a'\]\['b'\] both have the name 'a.b'"),
    ({"step": 1}, r"'step' is reserved for the step axis"),
    ({"k" * 300: 1.0}, r"'k+' is 300 bytes long as a file name, more than 255"),
    ({"ok": 1.0, "": 2.0, "step": 3}, r"\[''\] has an empty name.*'step' is reserved"),
])
def test_a_key_that_cannot_be_stored_is_refused_before_anything_is_queued(
    tmp_path, logged, message):
  log = _three_steps(tmp_path)
  with pytest.raises(ValueError, match=r"RunLog.append: " + message + r".*Nothing was queued"):
    log.append(3, logged)
  log.append(3, {"x": np.float32(3)})  # The same step number: the bad one never counted.
  log.close()
  _assert_steps(tmp_path, [0, 1, 2, 3])


def test_open_run_before_the_first_commit_says_so(tmp_path):
  log = gl.RunLog(tmp_path, steps_per_chunk=16)
  log.append(0, {"x": np.float32(0)})  # Staged, not yet written.
  with pytest.raises(ValueError, match=r"open_run\('.*'\): the run has no committed step yet.*"
                     r"log.flush\(\)"):
    gl.open_run(tmp_path)
  log.append(1, {"x": np.float32(1)})
  assert log.flush() == 2
  _assert_steps(tmp_path, [0, 1])
  log.close()


def _report_images(page):
  """The image files `page` links, checked to exist, and the text of its table cells."""
  import html.parser
  from urllib.parse import unquote

  class Page(html.parser.HTMLParser):
    def __init__(self):
      super().__init__()
      self.images, self.cells, self._cell = [], [], False

    def handle_starttag(self, tag, attrs):
      if tag == "img":
        self.images.append(dict(attrs)["src"])
      self._cell = tag == "td"

    def handle_data(self, data):
      if self._cell:
        self.cells.append(data)

  parsed = Page()
  parsed.feed(pathlib.Path(page).read_text(encoding="utf-8"))
  folder = pathlib.Path(page).parent
  matplotlib_image = pytest.importorskip("matplotlib.image")
  for src in parsed.images:
    pixels = matplotlib_image.imread(folder / unquote(src))
    assert pixels.ndim == 3 and pixels.shape[0] > 100 and pixels.std() > 0, src
  return parsed.images, parsed.cells


def test_report_plots_every_series_under_its_key(tmp_path):
  appended = _keyed_run(tmp_path)
  page = gl.report(tmp_path, progress=False)
  images, cells = _report_images(page)
  # The loss first, the other scalars, the summaries (the record's histogram in one
  # file despite its "/"), then the other arrays.
  assert images == ["scalar.loss.png", "scalars_1.png", "norms.png",
                    "summaries%252Fh.summary.histogram.png", "per_example.png", "arrays_1.png"]
  # The scalar series, by key, with their last values.
  for name in ("loss", "opt/lr", "grads\\fc2", "100%"):
    assert float(cells[cells.index(name) + 1]) == pytest.approx(float(appended[-1][name]), rel=1e-3), name
  assert "summaries/h.summary" in cells
  _assert_run_holds(tmp_path, appended)


def test_report_of_a_run_without_summaries(tmp_path):
  with gl.RunLog(tmp_path, dims={"per_example": ("example",)}) as log:
    for step in range(40):
      log.append(step, {"loss": jnp.float32(np.exp(-step / 10)), "lr": 1e-3,
                        "per_example": jnp.arange(8.0) * step,
                        **{f"extra{i}": np.float32(i * step) for i in range(12)}})
  page = gl.report(tmp_path, progress=False)
  images, cells = _report_images(page)
  # The loss in a figure of its own; 13 other scalars, 6 to an image; the array.
  assert images == ["scalar.loss.png", "scalars_1.png", "scalars_2.png", "scalars_3.png",
                    "arrays_1.png"]
  assert cells[cells.index("loss") + 1] == f"{np.exp(-39 / 10):.4g}"
  with gl.RunLog(tmp_path / "complex") as log:
    log.append(0, {"z": np.complex64(1 + 2j)})
  with pytest.raises(ValueError, match=r"report\('.*complex'\): the run has no numeric "
                     r"variable to plot \(its variables: \['z'\]\)"):
    gl.report(tmp_path / "complex", progress=False)


def test_report_images_load_in_a_headless_browser(tmp_path):
  import shutil

  browser = shutil.which("chromium") or shutil.which("chromium-browser")
  if browser is None:
    pytest.skip("no chromium (apt-get install chromium) for the headless-browser check")
  _keyed_run(tmp_path)
  page = pathlib.Path(gl.report(tmp_path, progress=False))
  # The page as it is, plus a script that lists each image and its decoded width.
  check = page.with_name("browser_check.html")
  check.write_text(page.read_text(encoding="utf-8").replace("</body>", (
      "<script>window.addEventListener('load', () => { document.body.innerHTML = "
      "'<pre id=result>' + [...document.images].map(i => i.getAttribute('src') + ' ' + "
      "i.naturalWidth).join('\\n') + '</pre>'; });</script></body>")), encoding="utf-8")
  result = subprocess.run(
      [browser, "--headless", "--no-sandbox", "--disable-gpu", "--allow-file-access-from-files",
       # No network here: nothing in the background tries to reach one.
       "--disable-background-networking", "--disable-component-update", "--disable-sync",
       "--no-first-run", f"--user-data-dir={tmp_path / 'chromium'}",
       "--virtual-time-budget=10000", "--dump-dom", check.as_uri()],
      capture_output=True, text=True, timeout=120, check=False)
  lines = result.stdout.split("<pre id=\"result\">")[-1].split("</pre>")[0].splitlines()
  widths = dict(line.rsplit(" ", 1) for line in lines)
  images, _ = _report_images(page)
  assert set(widths) == set(images) and len(images) == 6, result.stdout[-2000:]
  assert all(int(width) > 0 for width in widths.values()), widths  # Each one decoded.
