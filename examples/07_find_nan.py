"""The loss is finite, the gradient is NaN: which layer made it, for which examples?

A classifier pads its batches with all-zero rows to a fixed size and masks them out
of the loss. One layer appends the norm of its input to the features,
`concat([h, |h|])`. For a padding row `h = tanh(0 @ w1 + b1)` is zero (biases start
at zero), `|h| = 0` is fine on the forward pass, but the derivative of `sqrt(sum(h^2))` at 0 is 0/0: the backward pass makes a
NaN, even though the row's loss weight is 0 (0 * NaN is NaN).

Every step, `gl.find_nonfinite` looks at the records inside the jitted step and
returns a small report; `gl.raise_if_nonfinite` stops training at the first bad step
with the site that made the NaN (the site nearest the loss whose cotangent is not
finite) and the examples it hit. We check the report against plain JAX (zero
perturbations of the layers' outputs and inputs), then fix the layer with a safe norm.

Run: python examples/07_find_nan.py
"""

import jax
import jax.numpy as jnp
import numpy as np

import oryx_gradlog as gl

BATCH, PAD, SIZES = 16, 3, (6, 12, 12, 4)
ORDER = ["fc1", "fc2", "fc3"]  # The record names in forward order.


def norm_features(h, safe):
  """`concat([h, |h|])`; the unsafe norm has a NaN derivative at h = 0."""
  norm = jnp.sqrt(jnp.sum(h ** 2, -1, keepdims=True) + (1e-12 if safe else 0.0))
  return jnp.concatenate([h, norm], -1)


def model(params, x, safe=False, deltas=None):
  """fc1 -> tanh -> [h, |h|] -> fc2 -> tanh -> fc3. `deltas` (zero perturbations of
  fc1's output and fc2's input) are for the plain-JAX reference only."""
  d = deltas or {"fc1_out": 0.0, "fc2_in": 0.0}
  h = jnp.tanh(gl.dense(x, params["w1"], params["b1"], name="fc1") + d["fc1_out"])
  h = norm_features(h, safe) + d["fc2_in"]
  h = jnp.tanh(gl.dense(h, params["w2"], params["b2"], name="fc2"))
  return gl.dense(h, params["w3"], params["b3"], name="fc3")


def loss(params, x, y, mask, safe=False, deltas=None):
  logp = jax.nn.log_softmax(model(params, x, safe, deltas))
  nll = -jnp.take_along_axis(logp, y[:, None], -1)[:, 0]
  return jnp.sum(mask * nll) / jnp.sum(mask)


def init(key):
  k1, k2, k3 = jax.random.split(key, 3)
  d0, d1, d2, d3 = SIZES
  return {"w1": jax.random.normal(k1, (d0, d1)) / np.sqrt(d0), "b1": jnp.zeros(d1),
          "w2": jax.random.normal(k2, (d1 + 1, d2)) / np.sqrt(d1), "b2": jnp.zeros(d2),
          "w3": jax.random.normal(k3, (d2, d3)) / np.sqrt(d2), "b3": jnp.zeros(d3)}


def make_step(safe):
  @jax.jit
  def step(params, x, y, mask):
    (value, grads), records = gl.call_and_reap(jax.value_and_grad(loss))(
        params, x, y, mask, safe)
    report = gl.find_nonfinite(records, ORDER)  # Small: found, site, call, examples.
    params = jax.tree.map(lambda p, g: p - 0.1 * g, params, grads)
    return params, value, report
  return step


def train(params, x, y, mask, safe, steps=5):
  step = make_step(safe)
  for i in range(steps):
    params, value, report = step(params, x, y, mask)
    try:
      gl.raise_if_nonfinite(report)  # Stops at the first bad step, naming the site.
    except FloatingPointError as error:
      raise FloatingPointError(f"step {i}: {error}") from None
    print(f"  step {i}: loss {float(value):.4f}, gradients finite")
  return params


def reference_cotangents(params, x, y, mask):
  """Plain JAX: cotangents of fc1's output and fc2's input, by zero perturbations."""
  deltas = {"fc1_out": jnp.zeros((BATCH, SIZES[1])), "fc2_in": jnp.zeros((BATCH, SIZES[1] + 1))}
  return jax.grad(lambda d: loss(params, x, y, mask, False, d))(deltas)


def main():
  k_init, k_x, k_y = jax.random.split(jax.random.PRNGKey(0), 3)
  params = init(k_init)
  x = jax.random.normal(k_x, (BATCH, SIZES[0]))
  y = jax.random.randint(k_y, (BATCH,), 0, SIZES[-1])
  padded = np.arange(BATCH) >= BATCH - PAD  # The last rows are padding...
  x = jnp.where(padded[:, None], 0.0, x)  # ...all zeros, masked out of the loss.
  mask = jnp.asarray(~padded, jnp.float32)

  print("the symptom:", f"loss {float(loss(params, x, y, mask)):.4f},",
        "non-finite gradient entries:",
        sum(int(jnp.sum(~jnp.isfinite(g))) for g in jax.tree.leaves(
            jax.grad(loss)(params, x, y, mask))))
  print("training with the unsafe norm:")
  try:
    train(params, x, y, mask, safe=False)
    raise AssertionError("expected a FloatingPointError")
  except FloatingPointError as error:
    print(f"  {error}")
  _, _, report = make_step(False)(params, x, y, mask)

  # Check the report against plain JAX.
  reference = reference_cotangents(params, x, y, mask)
  bad_examples = ~np.all(np.isfinite(reference["fc1_out"]), axis=1)
  assert bool(report.found) and report.sites[int(report.site)] == ("fc1", "output")
  np.testing.assert_array_equal(report.examples, bad_examples)
  np.testing.assert_array_equal(bad_examples, padded)  # The padding rows, and only them.
  assert np.all(np.isfinite(reference["fc2_in"]))  # The site before it is finite.

  print("training with the safe norm, sqrt(sum(h^2) + 1e-12):")
  train(params, x, y, mask, safe=True)
  print(f"check: the report names fc1's output cotangent and examples "
        f"{np.flatnonzero(bad_examples).tolist()}, as plain JAX does; the fix trains")


if __name__ == "__main__":
  main()
