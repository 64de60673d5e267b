"""The main job: a quantised MLP on handwritten digits, with every step's cotangents logged.

A 64-128-64-10 MLP whose weights and activations are rounded to 4 bits with a
straight-through estimator (the seed question's quantised MVM) learns scikit-learn's
digits with optax's Adam. Every step, inside the jitted step, we record the
cotangent of each layer's output per example, summarize it on the device (norm,
mean, variance, min, max, non-finite count, magnitude histogram; per example), and
hand summaries and the full cotangents to a `RunLog` that writes them to zarr off the
training thread. The layers are marked with `gl.dense` too, so that Cockpit's
economy instruments (`gl.training_instruments("economy")`: batch-size tests, alpha's
weighted fit, update size, distance, the gradient-element histogram) are read from
the same backward pass and logged each step, with the step time. The step donates
the parameters and the optimizer's and instruments' states (`donate_argnums`), so
XLA updates them in place instead of copying them through each step.
At the end we write the report (PNG plots, an HTML page and the instruments
dashboard) and check the last step's records and instruments against plain JAX.

Run: python examples/08_digits_training.py [--steps 300] [--run-dir runs/digits]
     (or: make demo)
"""

import argparse
import functools
import os
import shutil
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from sklearn.datasets import load_digits

import oryx_gradlog as gl

WIDTHS = (64, 128, 64, 10)
BATCH = 128


def quantize(x, bits=4, scale=2.0):
  """Rounds to a symmetric grid of 2**bits - 1 levels; the gradient passes straight through."""
  levels = 2 ** (bits - 1) - 1
  q = jnp.clip(jnp.round(x / scale * levels), -levels, levels) * scale / levels
  return x + jax.lax.stop_gradient(q - x)


def init_params(key):
  keys = jax.random.split(key, len(WIDTHS) - 1)
  return [{"w": jax.random.normal(k, (m, n)) / np.sqrt(m), "b": jnp.zeros(n)}
          for k, m, n in zip(keys, WIDTHS[:-1], WIDTHS[1:])]


def forward(params, x, perturb=None):
  """Logits; `perturb` (plain-JAX reference only) adds zeros to each layer's output."""
  h = x
  for i, layer in enumerate(params):
    if perturb is not None:
      z = quantize(h) @ quantize(layer["w"]) + layer["b"] + perturb[i]
    else:  # A dense-layer record (for the instruments) and a tap of its output.
      z = gl.dense(quantize(h), quantize(layer["w"]), layer["b"], name=f"fc{i + 1}")
      z = gl.tap(z, name=f"layer{i + 1}")
    h = jnp.tanh(z) if i < len(params) - 1 else z
  return h


def losses_fn(params, x, y, perturb=None):
  logits = forward(params, x, perturb)
  return optax.softmax_cross_entropy_with_integer_labels(logits, y)


def loss_fn(params, x, y, perturb=None):
  return losses_fn(params, x, y, perturb).mean()


def loss_and_losses(params, x, y):
  losses = losses_fn(params, x, y)
  return losses.mean(), losses


# The layers see quantised weights, not the parameters themselves: say which
# parameter each layer's weight and bias come from (alpha's per-example slopes need
# each layer's slice of the update; the straight-through estimator passes it as is).
WHERE = [{"w": f"fc{i + 1}.w", "b": f"fc{i + 1}.b"} for i in range(len(WIDTHS) - 1)]


def make_step(optimizer, instruments):
  # Parameters, optimizer state and instruments' state are donated: updated in place.
  @functools.partial(jax.jit, donate_argnums=(0, 1, 2))
  def step(params, opt_state, inst_state, x, y):
    ((loss, losses), grads), records = gl.call_and_reap(
        jax.value_and_grad(loss_and_losses, has_aux=True))(params, x, y)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    readings, inst_state = instruments.update(
        records, inst_state, loss=loss, grads=grads, params=params, updates=updates,
        losses=losses)
    taps = {name: v for name, v in records.items() if name.startswith("layer")}
    # Summaries per example of every layer; the full cotangents too (they are small).
    logged = gl.summarize(taps, full="*", summary="*", keep_axes=1)
    logged = {**logged, "instruments": readings}
    return (optax.apply_updates(params, updates), opt_state, inst_state, loss, logged,
            taps)
  return step


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--steps", type=int, default=300)
  parser.add_argument("--run-dir", default=os.path.join("runs", "digits"))
  parser.add_argument("--quick", action="store_true", help="30 steps, for the tests")
  args, _ = parser.parse_known_args(argv)
  steps = 30 if args.quick else args.steps

  digits = load_digits()
  x_all = jnp.asarray(digits.data / 16.0, jnp.float32)
  y_all = jnp.asarray(digits.target)
  params = init_params(jax.random.PRNGKey(0))
  optimizer = optax.adam(3e-3)
  opt_state = optimizer.init(params)
  instruments = gl.training_instruments("economy", where=WHERE)
  inst_state = instruments.init(params)
  step = make_step(optimizer, instruments)
  rng = np.random.default_rng(0)

  shutil.rmtree(args.run_dir, ignore_errors=True)
  start = time.perf_counter()
  config = {"widths": WIDTHS, "batch": BATCH, "steps": steps, "optimizer": "adam(3e-3)",
            "quantization": "4-bit STE"}
  # Instruments (histograms) have dims of their own; the summaries an example dim.
  dims = {"instruments.*": (), "*": ("example",)}
  with gl.RunLog(args.run_dir, config=config, dims=dims) as log:
    for i in range(steps):
      batch = rng.choice(len(x_all), BATCH, replace=False)
      x, y = x_all[batch], y_all[batch]
      before = jax.tree.map(jnp.copy, params)  # The step donates (deletes) params.
      params, opt_state, inst_state, loss, logged, records = step(
          params, opt_state, inst_state, x, y)
      # Cockpit's Time: the host's clock beside the readings; the dashboard draws
      # the time per step.
      log.append(i, {**logged, "instruments": {**logged["instruments"], "time": time.time()}})
      if i % 50 == 0 or i == steps - 1:
        # The mean over examples of each example's cotangent norm, as the report plots.
        print(f"step {i:4d}  loss {float(loss):.4f}  mean |dL/dz_i| per layer: " + "  ".join(
            f"{name} {float(jnp.mean(jnp.linalg.norm(records[name], axis=-1))):.2e}"
            for name in sorted(records)))
    committed = log.flush()
  accuracy = float(jnp.mean(jnp.argmax(forward(params, x_all), -1) == y_all))
  print(f"trained {steps} steps in {time.perf_counter() - start:.1f} s; train accuracy "
        f"{accuracy:.3f}; {committed} steps logged to {args.run_dir}")
  page = gl.report(args.run_dir, progress=False)
  print(f"report: {page} and {os.path.join(os.path.dirname(page), 'dashboard.html')}")

  # Check: the last step's records against the perturbation reference (plain JAX).
  zeros = [jnp.zeros((BATCH, n)) for n in WIDTHS[1:]]
  expected = jax.grad(loss_fn, argnums=3)(before, x, y, zeros)
  for i, ct in enumerate(expected):
    np.testing.assert_allclose(records[f"layer{i + 1}"], ct, rtol=1e-5, atol=1e-7)
  run = gl.open_run(args.run_dir)
  assert run.sizes["step"] == steps and run.attrs["committed_steps"] == steps
  np.testing.assert_allclose(run["layer3.full"].values[-1], expected[2], rtol=1e-5, atol=1e-7)
  norms = np.linalg.norm(np.asarray(expected[0]), axis=1)
  np.testing.assert_allclose(run["layer1.summary.norm"].values[-1], norms, rtol=1e-5)
  # The norm test of the last step against per-example gradients from vmap(grad).
  per_example = jax.vmap(jax.grad(loss_fn), in_axes=(None, 0, 0))(before, x[:, None], y[:, None])
  flat = jnp.concatenate([g.reshape(BATCH, -1) for g in jax.tree.leaves(per_example)], 1)
  mean = flat.mean(0)
  norm_test = jnp.sqrt(jnp.sum((flat - mean) ** 2) / (BATCH * (BATCH - 1))) / jnp.linalg.norm(mean)
  np.testing.assert_allclose(run["instruments.norm_test"].values[-1], norm_test, rtol=1e-3)
  assert os.path.exists(os.path.join(os.path.dirname(page), "dashboard.html"))
  print(f"check: last step's records, norm test and the store equal plain JAX ({steps} "
        "steps logged)")


if __name__ == "__main__":
  main()
