"""Workload 11: what `RunLog` costs per step with 1, 2 and 4 processes, side by side.

Each process count runs as its own job on this machine: that many processes (JAX's
distributed runtime, coordinator on 127.0.0.1, gloo collectives, 2 CPU devices each;
1 process runs without the runtime), one global mesh, 64 examples per process (the
batch grows with the processes, as it does on a cluster). Every process times the
same jitted step (a 3 x 256 tanh MLP's gradient with per-example norms, per-example
summaries of every layer and the full cotangent of the first layer) in interleaved
rounds: a block of plain steps, then a block of steps whose outputs go to one shared
`RunLog` (each process writes its shards and its commit mark). The ratio is logged /
plain per round (medians and quartiles over rounds); process 0's rounds are shown.

On a shared 2-core machine the processes compete for the cores, so the absolute
times grow with the process count; the ratios say what logging adds at each count.

Run: python benchmarks/bench_multihost.py [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time

import _harness as h

NUMBER = 11
TITLE = "RunLog per step with 1, 2 and 4 processes (logged / plain step, each count alone)"
PROCESS_COUNTS = (1, 2, 4)
PER_PROCESS_BATCH, WIDTH, LAYERS = 64, 256, 3


def _worker(args) -> None:
  """One process: times plain and logged blocks of steps; process 0 writes the rounds."""
  import jax  # noqa: PLC0415
  import jax.numpy as jnp  # noqa: PLC0415
  import numpy as np  # noqa: PLC0415
  from jax.sharding import Mesh, NamedSharding  # noqa: PLC0415
  from jax.sharding import PartitionSpec as P  # noqa: PLC0415

  import oryx_gradlog as gl  # noqa: PLC0415

  if args.processes > 1:
    try:  # JAX 0.5 keeps CPU collectives off unless chosen; later JAX uses gloo.
      jax.config.update("jax_cpu_collectives_implementation", "gloo")
    except (AttributeError, ValueError, KeyError):
      pass
    jax.distributed.initialize(f"127.0.0.1:{args.port}", args.processes, args.process_id)
  mesh = Mesh(np.array(jax.devices()), ("batch",))
  by_example, replicated = NamedSharding(mesh, P("batch")), NamedSharding(mesh, P())
  batch = PER_PROCESS_BATCH * args.processes

  def to_global(value, sharding):
    return jax.make_array_from_callback(value.shape, sharding, lambda index: value[index])

  keys = jax.random.split(jax.random.PRNGKey(0), LAYERS + 1)
  params = [to_global(np.asarray(jax.random.normal(k, (WIDTH, WIDTH)) / 16), replicated)
            for k in keys[:LAYERS]]
  x = to_global(np.asarray(jax.random.normal(keys[-1], (batch, WIDTH))), by_example)

  def loss(params, x):
    for i, w in enumerate(params):
      x = jnp.tanh(gl.dense(x, w, name=f"layer{i}"))
    return jnp.mean(x**2)

  @jax.jit
  def step(params, x):
    grads, records = gl.call_and_reap(jax.grad(loss))(params, x)
    logged = {"norms": gl.per_example_norms(records).norms,
              "out": gl.summarize({k: r.out_cotangent for k, r in records.items()},
                                  keep_axes=1),
              "layer0": records["layer0"].out_cotangent}
    return [w - 0.01 * g for w, g in zip(params, grads, strict=True)], logged

  jax.block_until_ready(step(params, x))  # Compile.
  counter, plain, logged = 0, [], []
  with gl.RunLog(args.run_dir) as log:
    for _ in range(args.rounds):
      start = time.perf_counter()
      for _ in range(args.steps):
        out = step(params, x)
      jax.block_until_ready(out)
      plain.append((time.perf_counter() - start) / args.steps)
      start = time.perf_counter()
      for _ in range(args.steps):
        out = step(params, x)
        log.append(counter, out[1])
        counter += 1
      jax.block_until_ready(out)
      logged.append((time.perf_counter() - start) / args.steps)
    written = log.flush()
  if args.process_id == 0:
    with open(args.out, "w") as f:
      json.dump({"plain": plain, "logged": logged, "written": written}, f)


def _job(processes: int, settings: h.Settings, folder: str) -> dict:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
  out = os.path.join(folder, f"p{processes}.json")
  env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=2",
         "JAX_PLATFORMS": "cpu"}
  rounds, steps = (3, 5) if settings.quick else (7, 20)
  procs = [subprocess.Popen(
      [sys.executable, __file__, "--worker", "--port", str(port), "--processes",
       str(processes), "--process-id", str(i), "--run-dir", os.path.join(folder, f"p{processes}"),
       "--out", out, "--rounds", str(rounds), "--steps", str(steps)],
      env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
      for i in range(processes)]
  try:
    errors = [p.communicate(timeout=600)[1] for p in procs]
  finally:
    for p in procs:
      if p.poll() is None:
        p.kill()
  if any(p.returncode for p in procs):
    raise RuntimeError(f"bench_multihost: {processes} processes failed:\n{errors[0][-3000:]}")
  with open(out) as f:
    return json.load(f)


def run(settings: h.Settings) -> h.WorkloadResult:
  m, comparisons, notes = {}, [], []
  with tempfile.TemporaryDirectory() as folder:
    for processes in PROCESS_COUNTS:
      times = _job(processes, settings, folder)
      m[f"plain{processes}"] = h.Measurement(f"plain step, {processes} process(es)",
                                             times["plain"])
      m[f"logged{processes}"] = h.Measurement(
          f"step + RunLog.append, {processes} process(es)", times["logged"])
      comparisons.append(h.compare(
          NUMBER, m, f"logged{processes}", f"plain{processes}", None, settings,
          f"{processes} process(es) x 2 CPU devices, batch {PER_PROCESS_BATCH * processes}; "
          f"{times['written']} steps committed by every process."))
  notes.append(f"Per process: batch {PER_PROCESS_BATCH}, {LAYERS} dense layers of {WIDTH}; "
               "logged: per-example norms, per-example summaries of every layer's output "
               "cotangent, the first layer's full output cotangent.")
  return h.WorkloadResult(NUMBER, TITLE, m, comparisons, notes)


def _parse_worker():
  parser = argparse.ArgumentParser()
  parser.add_argument("--worker", action="store_true")
  for flag in ("--port", "--processes", "--process-id", "--rounds", "--steps"):
    parser.add_argument(flag, type=int)
  parser.add_argument("--run-dir")
  parser.add_argument("--out")
  return parser.parse_args()


if __name__ == "__main__":
  if "--worker" in sys.argv:
    _worker(_parse_worker())
  else:
    h.main(run, __doc__.splitlines()[0])
