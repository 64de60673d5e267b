"""Per-example gradient norms: ghost norms (this package) vs vmap(grad) vs plain grad.

Three jitted variants of one training step's backward work, on two workloads:

* `grad`: `jax.jit(jax.grad(loss))`, the plain batch gradient (no norms): the floor.
* `ghost`: `gl.call_and_reap(jax.grad(loss))` with the dense layers marked by
  `gl.dense`, then `gl.per_example_norms(records)`: the batch gradient and every
  example's gradient norm from one backward pass.
* `vmap`: `jax.jit(jax.vmap(jax.grad(example_loss)))`, then the norms of the
  per-example gradients (and their mean, the batch gradient).

Workloads: a 4 x 512 tanh MLP with batch 128, and a transformer-style block
(attention with 4 heads and a 4x MLP, parameter-free RMS norms) with batch 32, 64
tokens, width 256; float32. Before timing, each workload checks that `ghost` and
`vmap` give the same norms and gradients.

Timing: variants are compiled and run once first; then, round by round, each variant
runs a block of back-to-back calls (each waits for its outputs), the order of the
variants alternating between rounds. A variant's time is the median over rounds;
a ratio is the median of the per-round ratios (a load spike hits both sides of a
round). Memory is XLA's analysis of the compiled program: peak = arguments +
outputs + temporaries - aliased.

Run: python benchmarks/per_example_norms.py [--quick]
"""

from __future__ import annotations

import argparse
import dataclasses
import platform
import statistics
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

import oryx_gradlog as gl


@dataclasses.dataclass(frozen=True)
class Workload:
  name: str
  params: dict
  data: tuple
  example_loss: Callable  # (params, *example) -> scalar; also works on a batch.


# ----------------------------------------------------------------------------------
# Models.


def mlp_workload(batch=128, width=512, layers=4, seed=0) -> Workload:
  keys = jax.random.split(jax.random.PRNGKey(seed), layers + 2)
  params = {f"fc{i}": {"w": jax.random.normal(keys[i], (width, width)) / np.sqrt(width),
                       "b": jnp.zeros(width)} for i in range(layers)}

  def example_loss(params, x, y):
    for i in range(layers):
      x = jnp.tanh(gl.dense(x, params[f"fc{i}"]["w"], params[f"fc{i}"]["b"], name=f"fc{i}"))
    return jnp.mean(jnp.sum((x - y) ** 2, axis=-1))

  x = jax.random.normal(keys[-2], (batch, width))
  y = jax.random.normal(keys[-1], (batch, width))
  return Workload(f"MLP {layers} x {width}, batch {batch}", params, (x, y), example_loss)


def _rms(x):
  return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + 1e-6)


def transformer_workload(batch=32, tokens=64, width=256, heads=4, seed=1) -> Workload:
  keys = jax.random.split(jax.random.PRNGKey(seed), 8)
  scale = 1 / np.sqrt(width)
  params = {
      **{n: jax.random.normal(k, (width, width)) * scale
         for n, k in zip(("q", "k", "v", "o"), keys[:4])},
      "up": {"w": jax.random.normal(keys[4], (width, 4 * width)) * scale,
             "b": jnp.zeros(4 * width)},
      "down": {"w": jax.random.normal(keys[5], (4 * width, width)) * scale / 2,
               "b": jnp.zeros(width)},
  }

  def example_loss(params, x, y):
    """One pre-norm block on `(..., tokens, width)`; the example's loss is a mean over
    its tokens."""
    h = _rms(x)
    q, k, v = (gl.dense(h, params[n], name=n).reshape(h.shape[:-1] + (heads, -1))
               for n in ("q", "k", "v"))
    logits = jnp.einsum("...qhd,...khd->...hqk", q, k) / np.sqrt(q.shape[-1])
    attended = jnp.einsum("...hqk,...khd->...qhd", jax.nn.softmax(logits), v)
    x = x + gl.dense(attended.reshape(x.shape), params["o"], name="o")
    up = gl.dense(_rms(x), params["up"]["w"], params["up"]["b"], name="up")
    x = x + gl.dense(jax.nn.gelu(up), params["down"]["w"], params["down"]["b"], name="down")
    return jnp.mean(jnp.sum((x - y) ** 2, axis=-1), axis=-1)

  x = jax.random.normal(keys[6], (batch, tokens, width))
  y = jax.random.normal(keys[7], (batch, tokens, width))
  return Workload(f"transformer block, batch {batch}, {tokens} tokens, width {width}",
                  params, (x, y), example_loss)


# ----------------------------------------------------------------------------------
# Variants.


def variants(workload: Workload) -> dict[str, Callable]:
  example_loss = workload.example_loss
  in_axes = (None,) + (0,) * len(workload.data)

  def batch_loss(params, *data):
    return jnp.mean(example_loss(params, *data))

  def plain(params, *data):
    return jax.grad(batch_loss)(params, *data)

  def ghost(params, *data):
    grads, records = gl.call_and_reap(jax.grad(batch_loss))(params, *data)
    return grads, gl.per_example_norms(records).norms

  def vmapped(params, *data):
    per_example = jax.vmap(jax.grad(example_loss), in_axes=in_axes)(params, *data)
    leaves = jax.tree.leaves(per_example)
    norms = jnp.sqrt(sum(jnp.sum(g.reshape(g.shape[0], -1) ** 2, axis=1) for g in leaves))
    return jax.tree.map(lambda g: jnp.mean(g, axis=0), per_example), norms

  return {"grad": plain, "ghost": ghost, "vmap": vmapped}


def peak_bytes(fn, args) -> tuple[int, int]:
  """(peak, temporaries) in bytes, from XLA's analysis of the compiled program."""
  stats = jax.jit(fn).lower(*args).compile().memory_analysis()
  peak = (stats.argument_size_in_bytes + stats.output_size_in_bytes
          + stats.temp_size_in_bytes - stats.alias_size_in_bytes)
  return peak, stats.temp_size_in_bytes


def _block(fn, args, min_seconds):
  """Seconds per call over a block of back-to-back calls lasting `min_seconds`."""
  calls, start = 0, time.perf_counter()
  while True:
    jax.block_until_ready(fn(*args))
    calls += 1
    elapsed = time.perf_counter() - start
    if elapsed >= min_seconds:
      return elapsed / calls


def run(workload: Workload, rounds: int, min_seconds: float) -> None:
  fns = {name: jax.jit(fn) for name, fn in variants(workload).items()}
  args = (workload.params, *workload.data)
  # Check, and compile and warm up every variant.
  outputs = {name: jax.block_until_ready(fn(*args)) for name, fn in fns.items()}
  (ghost_grads, ghost_norms), (vmap_grads, vmap_norms) = outputs["ghost"], outputs["vmap"]
  np.testing.assert_allclose(ghost_norms, vmap_norms, rtol=1e-4)
  for a, b in zip(jax.tree.leaves(ghost_grads), jax.tree.leaves(vmap_grads)):
    np.testing.assert_allclose(a, b, rtol=1e-3, atol=1e-5)
  for a, b in zip(jax.tree.leaves(outputs["grad"]), jax.tree.leaves(ghost_grads)):
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)
  records = jax.eval_shape(gl.reap(jax.grad(lambda p, *d: jnp.mean(
      workload.example_loss(p, *d)))), *args)
  methods = jax.eval_shape(gl.per_example_norms, records).method

  names = list(fns)
  times = {name: [] for name in names}
  for r in range(rounds):
    order = names if r % 2 == 0 else names[::-1]
    for name in order:
      times[name].append(_block(fns[name], args, min_seconds))
  memory = {name: peak_bytes(fn, args) for name, fn in variants(workload).items()}

  print(f"\n{workload.name} (float32; per-layer method: "
        f"{', '.join(f'{k}={v}' for k, v in methods.items())})")
  print(f"  {'variant':8s} {'median ms':>10s} {'x grad':>8s} {'IQR':>13s} "
        f"{'peak MB':>9s} {'x grad':>7s} {'temp MB':>9s}")
  base_peak = memory["grad"][0]
  for name in names:
    ratios = [t / g for t, g in zip(times[name], times["grad"])]
    q1, _, q3 = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else (ratios * 3)
    peak, temp = memory[name]
    print(f"  {name:8s} {1e3 * statistics.median(times[name]):10.3f} "
          f"{statistics.median(ratios):8.2f} {f'[{q1:.2f}, {q3:.2f}]':>13s} "
          f"{peak / 2**20:9.1f} {peak / base_peak:7.2f} {temp / 2**20:9.1f}")
  ratio = statistics.median([v / g for v, g in zip(times["vmap"], times["ghost"])])
  print(f"  ghost vs vmap: {ratio:.2f}x faster, "
        f"{memory['vmap'][0] / memory['ghost'][0]:.2f}x less peak memory")


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--quick", action="store_true",
                      help="small sizes and few rounds, for a smoke run")
  parser.add_argument("--rounds", type=int, default=None, help="timed rounds per workload")
  args = parser.parse_args(argv)
  rounds = args.rounds or (3 if args.quick else 9)
  min_seconds = 0.02 if args.quick else 0.2
  if args.quick:
    workloads = [mlp_workload(batch=16, width=64), transformer_workload(8, 16, 32)]
  else:
    workloads = [mlp_workload(), transformer_workload()]
  device = jax.devices()[0]
  print(f"per-example gradient norms: jax {jax.__version__}, {device.platform} "
        f"({device.device_kind}), {platform.machine()}, {rounds} rounds"
        f"{', quick sizes' if args.quick else ''}")
  for workload in workloads:
    run(workload, rounds, min_seconds)


if __name__ == "__main__":
  main()
