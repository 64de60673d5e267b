"""Many hosts: one run log written by every process of a multi-controller JAX job.

One process per host (`jax.distributed.initialize`), one global mesh over every
host's devices, the batch sharded over it. Each step's per-example gradient norms
(`gl.per_example_norms`), per-example summaries of a record and the loss go to one
`gl.RunLog` on storage every host sees: each process writes the shards it holds and
its own committed-step mark; `gl.open_run` reads the steps all of them wrote.

Run:
  python examples/09_many_hosts.py                  # one process, this machine's devices
  python examples/09_many_hosts.py --processes 2    # 2 local processes, 2 CPU devices each
  # On a cluster, the same command on every host (SLURM: `srun python ...`; TPU pod:
  # `gcloud compute tpus tpu-vm ssh NAME --worker=all --command "python ..."`), with
  # --cluster so that jax.distributed.initialize() finds the coordinator, process
  # count and id by itself, and --run-dir on a shared file system:
  python examples/09_many_hosts.py --cluster --run-dir /shared/runs/exp1

It ends by checking the logged norms of step 0 against plain `vmap(grad)`.
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import tempfile

import jax
import jax.numpy as jnp
import numpy as np

import oryx_gradlog as gl

BATCH, D_IN, HIDDEN = 32, 8, 16


def data(step):
  kx, ky = jax.random.split(jax.random.PRNGKey(step))
  x = jax.random.normal(kx, (BATCH, D_IN))
  return np.asarray(x), np.asarray(jnp.tanh(x[:, 0] - x[:, 1]) + 0.1 * jax.random.normal(ky, (BATCH,)))


def init_params():
  k1, k2 = jax.random.split(jax.random.PRNGKey(0))
  return {"w1": np.asarray(jax.random.normal(k1, (D_IN, HIDDEN)) / np.sqrt(D_IN)),
          "b1": np.zeros(HIDDEN, np.float32),
          "w2": np.asarray(jax.random.normal(k2, (HIDDEN, 1)) / np.sqrt(HIDDEN))}


def loss(params, x, y):
  h = jnp.tanh(gl.dense(x, params["w1"], params["b1"], name="fc1"))
  return jnp.mean((gl.dense(h, params["w2"], name="fc2")[:, 0] - y) ** 2)


@jax.jit
def train_step(params, x, y):
  (value, grads), records = gl.call_and_reap(jax.value_and_grad(loss))(params, x, y)
  logged = {"loss": value, "norms": gl.per_example_norms(records).norms,
            "fc1": gl.summarize({"out": records["fc1"].out_cotangent}, keep_axes=1)}
  return jax.tree.map(lambda p, g: p - 0.2 * g, params, grads), logged


def train(run_dir: str, steps: int) -> None:
  """Runs `steps` steps in this process, one of `jax.process_count()`, logging each."""
  from jax.sharding import Mesh, NamedSharding  # noqa: PLC0415
  from jax.sharding import PartitionSpec as P  # noqa: PLC0415

  mesh = Mesh(np.array(jax.devices()), ("batch",))  # Every process's devices.
  by_example, replicated = NamedSharding(mesh, P("batch")), NamedSharding(mesh, P())

  def to_global(value, sharding):  # Each process fills only the shards it holds.
    return jax.make_array_from_callback(value.shape, sharding, lambda index: value[index])

  params = jax.tree.map(lambda v: to_global(v, replicated), init_params())
  with gl.RunLog(run_dir, dims={"norms": ("example",), "fc1.*": ("example",)},
                 config={"processes": jax.process_count()}) as log:
    for step in range(steps):
      params, logged = train_step(params, *(to_global(v, by_example) for v in data(step)))
      log.append(step, logged)
  print(f"process {jax.process_index()}/{jax.process_count()}: {steps} steps logged")


def check(run_dir: str, steps: int) -> None:
  run = gl.open_run(run_dir)
  assert run.attrs["committed_steps"] == steps, run.attrs["committed_steps"]
  one = lambda p, x, y: loss(p, x[None], y[None])
  grads = jax.vmap(jax.grad(one), in_axes=(None, 0, 0))(init_params(), *data(0))
  flat = jnp.concatenate([g.reshape(BATCH, -1) for g in jax.tree.leaves(grads)], axis=1)
  np.testing.assert_allclose(run["norms"].values[0], jnp.linalg.norm(flat, axis=1), rtol=1e-4)
  print(f"check: {steps} steps from {run.attrs['config']['processes']} process(es) in "
        f"{run_dir}; step-0 per-example norms match vmap(grad); loss "
        f"{float(run['loss'][0]):.3f} -> {float(run['loss'][-1]):.3f}")


def spawn(processes: int, run_dir: str, steps: int) -> None:
  """Starts `processes` copies of this script on this machine, as a cluster would."""
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
  env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=2",
         "JAX_PLATFORMS": "cpu"}
  procs = [subprocess.Popen([sys.executable, __file__, "--run-dir", run_dir, "--steps",
                             str(steps), "--coordinator", f"127.0.0.1:{port}", "--processes",
                             str(processes), "--process-id", str(i)], env=env)
           for i in range(processes)]
  try:
    codes = [p.wait(timeout=300) for p in procs]
  finally:
    for p in procs:
      if p.poll() is None:
        p.kill()
  if any(codes):
    raise SystemExit(f"a process failed: exit codes {codes}")


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--run-dir", default=None)
  parser.add_argument("--steps", type=int, default=40)
  parser.add_argument("--quick", action="store_true", help="10 steps")
  parser.add_argument("--processes", type=int, default=1)
  parser.add_argument("--cluster", action="store_true",
                      help="jax.distributed.initialize() detects the cluster")
  parser.add_argument("--coordinator", default=None)
  parser.add_argument("--process-id", type=int, default=None)
  args = parser.parse_args()
  steps = 10 if args.quick else args.steps
  run_dir = args.run_dir or os.path.join(tempfile.mkdtemp(), "run")
  if args.process_id is None and args.processes > 1:  # The launcher of local processes.
    spawn(args.processes, run_dir, steps)
    check(run_dir, steps)
    return
  if args.cluster or args.process_id is not None:
    try:  # JAX 0.5 keeps CPU collectives off unless chosen; later JAX uses gloo.
      jax.config.update("jax_cpu_collectives_implementation", "gloo")
    except (AttributeError, ValueError, KeyError):
      pass
    if args.cluster:
      jax.distributed.initialize()  # SLURM, Open MPI, TPU pods, ... fill in the rest.
    else:
      jax.distributed.initialize(args.coordinator, args.processes, args.process_id)
  train(run_dir, steps)
  if args.process_id is None and jax.process_index() == 0:
    check(run_dir, steps)


if __name__ == "__main__":
  main()
