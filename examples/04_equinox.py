"""Equinox: which training example is mislabelled? Per-example gradients per layer.

An Equinox MLP learns y = sin(3 x0) cos(2 x1) from 32 examples, one of which has a
wrong label. Each `eqx.nn.Linear` is called through `gl.record_vjp` with the layer
itself as an input: a module is a pytree, so its record is an `eqx.nn.Linear` whose
weight and bias are the cotangents. Under `eqx.filter_vmap(eqx.filter_grad(...))` the
records are per example, so every optax step of a `filter_jit`-compiled loop also
says how hard each example pulls on each layer. We watch which examples pull
hardest as training goes, then check the last step's per-example records against
plain JAX.

Run: python examples/04_equinox.py
"""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax

import oryx_gradlog as gl

SIZES, N, STEPS, LR, BAD = (2, 32, 32, 1), 32, 300, 1e-2, 13


def call(layer, x):
  return layer(x)


class MLP(eqx.Module):
  """tanh MLP on one example; layer i is recorded as "linear{i}"."""

  layers: list

  def __init__(self, key):
    keys = jax.random.split(key, len(SIZES) - 1)
    self.layers = [eqx.nn.Linear(din, dout, key=k)
                   for din, dout, k in zip(SIZES[:-1], SIZES[1:], keys)]

  def __call__(self, x):
    for i, layer in enumerate(self.layers):
      x = gl.record_vjp(call, name=f"linear{i}")(layer, x)
      if i < len(self.layers) - 1:
        x = jnp.tanh(x)
    return x[0]


def example_loss(model, x, y):
  return (model(x) - y) ** 2


optimizer = optax.adam(LR)


@eqx.filter_jit
def train_step(model, opt_state, x, y):
  per_example = eqx.filter_vmap(eqx.filter_grad(example_loss), in_axes=(None, 0, 0))
  grads, records = gl.call_and_reap(per_example)(model, x, y)
  grads = jax.tree.map(lambda g: g.mean(0), grads)
  updates, opt_state = optimizer.update(grads, opt_state, eqx.filter(model, eqx.is_array))
  return eqx.apply_updates(model, updates), opt_state, records


def pull(records, i):
  """Per-example norm of layer i's (weight, bias) cotangent."""
  linear, _ = records[f"linear{i}"]
  return jnp.sqrt(jnp.sum(linear.weight ** 2, axis=(1, 2)) + jnp.sum(linear.bias ** 2, 1))


def records_shapes(model, x, y):
  """The shapes of one step's records, without running it."""
  per_example = eqx.filter_vmap(eqx.filter_grad(example_loss), in_axes=(None, 0, 0))
  return jax.eval_shape(gl.reap(per_example), model, x, y)["linear0"]


def reference_cotangents(model, x, y):
  """Per example and layer: (dL/dweight, dL/dbias, dL/dx), by zero perturbations."""
  def perturbed(deltas, x, y):
    h = x
    for i, (layer, (dweight, dbias, dx)) in enumerate(zip(model.layers, deltas)):
      h = (layer.weight + dweight) @ (h + dx) + layer.bias + dbias
      h = jnp.tanh(h) if i < len(model.layers) - 1 else h
    return (h[0] - y) ** 2

  zeros = [(jnp.zeros_like(layer.weight), jnp.zeros_like(layer.bias),
            jnp.zeros(layer.in_features)) for layer in model.layers]
  return jax.vmap(jax.grad(perturbed), in_axes=(None, 0, 0))(zeros, x, y)


def main():
  kx, km = jax.random.split(jax.random.PRNGKey(0))
  x = jax.random.uniform(kx, (N, 2), minval=-1, maxval=1)
  y = jnp.sin(3 * x[:, 0]) * jnp.cos(2 * x[:, 1])
  y = y.at[BAD].set(-y[BAD] + 1.5)  # The wrong label.
  model = MLP(km)
  opt_state = optimizer.init(eqx.filter(model, eqx.is_array))

  linear, ct_x = records_shapes(model, x, y)
  print(f"records['linear0'] = (Linear(weight={linear.weight.shape}, "
        f"bias={linear.bias.shape}), dL/dx {ct_x.shape})  axes: (example, ...)")
  print("step | examples pulling hardest on linear0: example (|dL/d(weight, bias)|)")
  for step in range(STEPS):
    before = model
    model, opt_state, records = train_step(model, opt_state, x, y)
    if step % 60 == 0 or step == STEPS - 1:
      norms = np.asarray(pull(records, 0))
      top = np.argsort(norms)[::-1][:3]
      print(f"{step:4d} | " + ", ".join(f"{k:2d} ({norms[k]:.3f})" for k in top)
            + f"; median {np.median(norms):.3f}")
  neighbour = int(np.argsort(np.linalg.norm(x - x[BAD], axis=1))[1])
  hardest = [set(np.argsort(np.asarray(pull(records, i)))[::-1][:2].tolist())
             for i in range(len(SIZES) - 1)]
  print(f"on every layer the two hardest pulls come from {sorted(hardest[0])}: the wrong "
        f"label (example {BAD}) and its nearest neighbour (example {neighbour}, "
        f"{float(np.linalg.norm(x[neighbour] - x[BAD])):.3f} away), which the network "
        "cannot both fit")
  assert all(pair == {BAD, neighbour} for pair in hardest)

  # Check: the last step's per-example records (taken at the parameters before that
  # step's update) equal the perturbation reference.
  expected = reference_cotangents(before, x, y)
  for i, (dweight, dbias, dx) in enumerate(expected):
    linear, ct_x = records[f"linear{i}"]
    np.testing.assert_allclose(linear.weight, dweight, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(linear.bias, dbias, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(ct_x, dx, rtol=1e-5, atol=1e-6)
  print(f"check: per-example records of all {len(SIZES) - 1} layers x {N} examples "
        "equal the reference")


if __name__ == "__main__":
  main()
