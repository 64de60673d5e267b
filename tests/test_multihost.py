"""Many processes: 2 and 4 CPU processes (2 devices each) log one run, as one process would.

Each test launches `multihost_worker.py` once per process (JAX's distributed runtime,
coordinator on 127.0.0.1 on a free port, gloo collectives), bounded by a timeout and
with every process killed on failure. Setup: launch. True computation: the same steps
in this one process on the whole batch, logged by a one-process `RunLog`, with the
per-example records and norms checked against plain `vmap(grad)`. Comparison: every
variable of the two stores, and the final parameters and running statistics.
"""

import functools
import importlib.util
import os
import pathlib
import signal
import socket
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

pytest.importorskip("zarr")
pytest.importorskip("xarray")

import multihost_worker as worker
from conftest import XLA_TEST_FLAGS, needs_sockets

import oryx_gradlog as gl

STEPS = 20
WORKER = pathlib.Path(__file__).with_name("multihost_worker.py")


@pytest.fixture(autouse=True)
def _sockets():
  needs_sockets()


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def _launch(processes, run_dir, *, timeout=150, extra=(), per_process=None, kill_rest_after=None):
  """Runs the worker in `processes` processes; returns their outputs and exit codes.

  `per_process` maps a process id to more flags. With `kill_rest_after`, once any
  process has exited with a signal, the others are killed that many seconds later
  (they would wait on a collective with the dead one). Every process still running
  at the deadline, or when this raises, is killed.
  """
  flags = {**XLA_TEST_FLAGS, "xla_force_host_platform_device_count": "2"}
  env = {**os.environ, "XLA_FLAGS": " ".join(f"--{k}={v}" for k, v in flags.items()),
         "JAX_PLATFORMS": "cpu", "PYTHONUNBUFFERED": "1"}
  port, logs, procs = _free_port(), [], []
  try:
    for i in range(processes):
      log = open(f"{run_dir}.process{i}.log", "w+")  # noqa: SIM115
      logs.append(log)
      command = [sys.executable, str(WORKER), "--port", str(port), "--processes",
                 str(processes), "--process-id", str(i), "--run-dir", str(run_dir),
                 "--steps", str(STEPS), "--out", f"{run_dir}.final", *extra,
                 *(per_process or {}).get(i, ())]
      procs.append(subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT,
                                    start_new_session=True))
    deadline, killed_at = time.monotonic() + timeout, None
    while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
      if kill_rest_after is not None and killed_at is None and any(
          (p.poll() or 0) < 0 for p in procs):
        killed_at = time.monotonic()
      if killed_at is not None and time.monotonic() > killed_at + kill_rest_after:
        break
      time.sleep(0.2)
  finally:
    for p in procs:
      if p.poll() is None:
        os.killpg(p.pid, signal.SIGKILL)
        p.wait()
  outputs = []
  for log in logs:
    log.seek(0)
    outputs.append(log.read())
    log.close()
  return [p.returncode for p in procs], outputs


def _check_ran(codes, outputs):
  assert codes == [0] * len(codes), "\n\n".join(o[-3000:] for o in outputs)


@functools.lru_cache
def _reference(tmp_root):
  """The same steps in this process on the whole batch, logged to a one-process RunLog."""
  run_dir = os.path.join(tmp_root, "single")
  params = worker.init_params()
  stats = jax.jit(worker.init_stats)(params, *worker.data(0))
  step_fn = jax.jit(worker.train_step)
  with gl.RunLog(run_dir, dims=worker.DIMS, steps_per_chunk=4) as log:
    for step in range(STEPS):
      x, y = worker.data(step)
      if step in (0, STEPS - 1):
        _check_against_plain_jax(params, x, y, step_fn(params, stats, x, y)[2])
      params, stats, logged = step_fn(params, stats, x, y)
      log.append(step, logged)
  return run_dir, {"params": params, "stats": stats}


def _check_against_plain_jax(params, x, y, logged):
  """Per-example norms and the h record against vmap(grad) and a zero perturbation."""
  one = lambda p, x, y: worker.loss(p, x[None], y[None])
  grads = jax.vmap(jax.grad(one), in_axes=(None, 0, 0))(params, x, y)
  flat = jnp.concatenate([g.reshape(len(x), -1) for g in jax.tree.leaves(grads)], axis=1)
  np.testing.assert_allclose(logged["norms"]["total"], jnp.linalg.norm(flat, axis=1),
                             rtol=1e-4)

  def perturbed(delta):
    h = jnp.tanh(x @ params["w1"] + params["b1"]) + delta
    return jnp.mean(((h @ params["w2"])[:, 0] - y) ** 2)
  expected_h = jax.grad(perturbed)(jnp.zeros((len(x), worker.HIDDEN)))
  np.testing.assert_allclose(logged["h"], expected_h, rtol=1e-5, atol=1e-7)


def _assert_same_run(run_dir, reference_dir, steps):
  run, expected = gl.open_run(run_dir), gl.open_run(reference_dir)
  assert run.attrs["committed_steps"] == steps
  np.testing.assert_array_equal(run["step"].values, np.arange(steps))
  assert sorted(run.data_vars) == sorted(expected.data_vars)
  for name in expected.data_vars:
    assert run[name].dims == expected[name].dims, name
    assert run[name].attrs.get("logged_dtype") == expected[name].attrs.get("logged_dtype")
    # bfloat16 (stored as float32): the processes' float32 may round to neighbours.
    rtol = 2 ** -8 if expected[name].attrs.get("logged_dtype") == "bfloat16" else 2e-5
    np.testing.assert_allclose(run[name].values, expected[name].values[:steps], rtol=rtol,
                               atol=1e-6, err_msg=name)


def _assert_same_final_state(out, reference):
  saved = np.load(f"{out}.0.npz")
  leaves = jax.tree_util.tree_flatten_with_path(reference)[0]
  for path, value in leaves:
    np.testing.assert_allclose(saved[jax.tree_util.keystr(path)], value, rtol=2e-5,
                               atol=1e-6, err_msg=jax.tree_util.keystr(path))


# 4 processes take ~1 minute on 2 cores: GRADLOG_SLOW_TESTS=all or =others runs them
# (CI: =others, on the newest JAX).
@pytest.mark.parametrize("processes", [
    2, pytest.param(4, marks=(pytest.mark.slow, pytest.mark.many_processes))])
def test_processes_log_one_run_equal_to_one_process(processes, tmp_path_factory):
  root = tmp_path_factory.getbasetemp()
  run_dir = tmp_path_factory.mktemp(f"p{processes}") / "run"
  codes, outputs = _launch(processes, run_dir, timeout=60 * processes + 60)
  _check_ran(codes, outputs)
  reference_dir, final = _reference(str(root))
  _assert_same_run(run_dir, reference_dir, STEPS)
  _assert_same_final_state(f"{run_dir}.final", final)
  # The per-example record is chunked like its shards: one file per device (2 per
  # process) per chunk of 4 steps, each written by the process holding the shard.
  chunks = list((run_dir / "log.zarr" / "h" / "c").rglob("*"))
  assert len([c for c in chunks if c.is_file()]) == 2 * processes * STEPS // 4
  # The report and the TensorBoard export read it like any run.
  page = gl.report(run_dir, progress=False)
  assert "src='norms.png'" in pathlib.Path(page).read_text(encoding="utf-8")
  if importlib.util.find_spec("tensorboardX"):
    assert os.listdir(gl.export_tensorboard(run_dir))


def test_sigkill_of_one_process_keeps_committed_steps_and_resume_finishes(tmp_path_factory):
  root = tmp_path_factory.getbasetemp()
  run_dir = tmp_path_factory.mktemp("p2kill") / "run"
  # All flush after step 9; process 1 is killed right after appending step 13.
  codes, outputs = _launch(2, run_dir, timeout=150, extra=("--flush-at", "9"),
                           per_process={1: ("--kill-at", "13")}, kill_rest_after=3)
  assert codes[1] == -signal.SIGKILL, "\n\n".join(o[-3000:] for o in outputs)
  run = gl.open_run(run_dir)
  committed = run.attrs["committed_steps"]
  assert 10 <= committed <= 14
  reference_dir, final = _reference(str(root))
  _assert_same_run(run_dir, reference_dir, committed)
  # Restart every process: resume after the committed steps, to the end.
  codes, outputs = _launch(2, run_dir, timeout=150, extra=("--resume",))
  _check_ran(codes, outputs)
  assert f"start {committed}" in outputs[0]
  _assert_same_run(run_dir, reference_dir, STEPS)
  _assert_same_final_state(f"{run_dir}.final", final)


def test_a_many_process_run_resumed_by_one_process_is_a_clear_error(tmp_path):
  with gl.RunLog(tmp_path) as log:
    log.append(0, {"x": np.float32(0)})
  zarr = pytest.importorskip("zarr")
  zarr.open_group(str(tmp_path / "log.zarr"), mode="r+").attrs["processes"] = 2
  with pytest.raises(ValueError, match="written by 2 processes; resume it with as many"):
    gl.RunLog(tmp_path, resume=True)
