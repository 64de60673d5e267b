"""One process of a many-process run, launched by `tests/test_multihost.py`.

Each process joins JAX's distributed runtime (coordinator on 127.0.0.1), builds one
global mesh over every process's CPU devices, shards the batch over it, and runs
`train_step` for the given steps, logging each step's records, summaries and
analyses to one `RunLog`. Every process writes its final state (gathered over the
processes) to `--out` with the process id appended. The model and the step live here
so the test can run the same step in one process as the reference.

  python tests/multihost_worker.py --port 12345 --processes 2 --process-id 0 \\
      --run-dir /tmp/run --steps 20 --out /tmp/final

Not collected by pytest (no `test_` prefix).
"""

from __future__ import annotations

import argparse
import os
import signal

import jax
import jax.numpy as jnp
import numpy as np

import oryx_gradlog as gl

BATCH, D_IN, HIDDEN = 8, 3, 4  # 8 examples: one per device with 4 processes x 2.
STATS = gl.running_statistics(decay=0.9)
CLIP = 0.5
DIMS = {"h": ("example", "unit"), "summary.*": ("example",), "norms.*": ("example",),
        "clipped.norms": ("example",)}


def data(step: int) -> tuple[np.ndarray, np.ndarray]:
  """The whole batch of `step`, the same on every process."""
  kx, ky = jax.random.split(jax.random.PRNGKey(step))
  x = jax.random.normal(kx, (BATCH, D_IN))
  return np.asarray(x), np.asarray(jnp.sin(x.sum(axis=1)) + 0.1 * jax.random.normal(ky, (BATCH,)))


def init_params() -> dict[str, np.ndarray]:
  k1, k2 = jax.random.split(jax.random.PRNGKey(42))
  return {"w1": np.asarray(jax.random.normal(k1, (D_IN, HIDDEN)) / 2),
          "b1": np.zeros(HIDDEN, np.float32),
          "w2": np.asarray(jax.random.normal(k2, (HIDDEN, 1)) / 2)}


def loss(params, x, y):
  h = gl.tap(jnp.tanh(gl.dense(x, params["w1"], params["b1"], name="fc1")), name="h")
  out = gl.dense(h, params["w2"], name="fc2")
  return jnp.mean((out[:, 0] - y) ** 2)


def init_stats(params, x, y):
  return STATS.init(gl.call_and_reap(jax.grad(loss))(params, x, y)[1])


def train_step(params, stats, x, y):
  """One SGD step; returns the new state and what is logged for the step."""
  (value, grads), records = gl.call_and_reap(jax.value_and_grad(loss))(params, x, y)
  norms = gl.per_example_norms(records)
  clipped = gl.per_example_clip(records, l2_norm_clip=CLIP)
  _, stats = STATS.update(records, stats)
  params = jax.tree.map(lambda p, g: p - 0.1 * g, params, grads)
  logged = {
      "loss": value,
      "h": records["h"],  # Per-example: sharded over processes like the batch.
      "h16": records["h"].astype(jnp.bfloat16),  # Shards of a dtype zarr lacks.
      "summary": gl.summarize({"h": records["h"]}, keep_axes=1),  # Per example.
      "batch_summary": gl.summarize(records),  # Over the batch: replicated scalars.
      "norms": {"total": norms.norms, "layers": norms.layers},
      "clipped": clipped,
      "noise": gl.gradient_noise_scale(records),
  }
  return params, stats, logged


def _join(args) -> None:
  try:  # JAX 0.5: CPU collectives are off unless chosen; later JAX: gloo by default.
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
  except (AttributeError, ValueError, KeyError):
    pass
  jax.distributed.initialize(
      coordinator_address=f"127.0.0.1:{args.port}", num_processes=args.processes,
      process_id=args.process_id)


def _all_compiled() -> None:
  """Waits, without a deadline that matters, until every process has compiled.

  The first collective sets up gloo's context, and gloo gives up on a process that
  has not arrived within 30 seconds: on a loaded 2-core machine one process can
  compile that much later than another. The coordination service's barrier waits
  10 minutes (the test kills the processes long before).
  """
  from jax._src import distributed  # noqa: PLC0415  (no public barrier without a collective)

  distributed.global_state.client.wait_at_barrier("compiled", 600_000)


def main() -> None:
  parser = argparse.ArgumentParser()
  for flag in ("--port", "--processes", "--process-id", "--steps"):
    parser.add_argument(flag, type=int, required=True)
  parser.add_argument("--run-dir", required=True)
  parser.add_argument("--out", required=True)
  parser.add_argument("--steps-per-chunk", type=int, default=4)
  parser.add_argument("--resume", action="store_true")
  parser.add_argument("--flush-at", type=int, default=-1)
  parser.add_argument("--kill-at", type=int, default=-1, help="this process SIGKILLs itself")
  args = parser.parse_args()
  _join(args)

  from jax.experimental import multihost_utils  # noqa: PLC0415
  from jax.sharding import Mesh, NamedSharding  # noqa: PLC0415
  from jax.sharding import PartitionSpec as P  # noqa: PLC0415

  mesh = Mesh(np.array(jax.devices()), ("batch",))
  by_example, replicated = NamedSharding(mesh, P("batch")), NamedSharding(mesh, P())

  def global_array(value, sharding):
    value = np.asarray(value)
    return jax.make_array_from_callback(value.shape, sharding, lambda index: value[index])

  def batch(step):
    return [global_array(v, by_example) for v in data(step)]

  params = jax.tree.map(lambda v: global_array(v, replicated), init_params())
  # Made in the shardings `train_step` returns the statistics in (per-example leaves
  # over the batch, the rest replicated), so that step 1 does not compile it again.
  shapes = jax.eval_shape(init_stats, params, *batch(0))
  shardings = jax.tree.map(
      lambda v: by_example if v.ndim and v.shape[0] == BATCH else replicated, shapes)
  init_fn = jax.jit(init_stats, out_shardings=shardings).lower(params, *batch(0)).compile()
  stats_spec = jax.tree.map(lambda v, s: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=s),
                            shapes, shardings)
  step_fn = jax.jit(train_step).lower(params, stats_spec, *batch(0)).compile()
  _all_compiled()
  stats = init_fn(params, *batch(0))
  log = gl.RunLog(args.run_dir, dims=DIMS, resume=args.resume,
                  steps_per_chunk=args.steps_per_chunk)
  start = log.committed_steps if args.resume else 0
  for step in range(args.steps):
    params, stats, logged = step_fn(params, stats, *batch(step))
    if step < start:
      continue  # Replayed to rebuild the state (a checkpoint would do this).
    log.append(step, logged)
    if step == args.flush_at:
      log.flush()
      multihost_utils.sync_global_devices("flushed")
    if step == args.kill_at:
      os.kill(os.getpid(), signal.SIGKILL)
  log.close()
  final = multihost_utils.process_allgather({"params": params, "stats": stats}, tiled=True)
  leaves = jax.tree_util.tree_flatten_with_path(final)[0]
  np.savez(f"{args.out}.{args.process_id}.npz",
           **{jax.tree_util.keystr(path): np.asarray(v) for path, v in leaves})
  print(f"process {args.process_id}: done, start {start}", flush=True)


if __name__ == "__main__":
  main()
