"""Haiku: how many ReLU units does a too-large learning rate kill?

A Haiku ReLU MLP taps the output of each `hk.Linear` (the pre-activations z) with
`gl.tap`, so every step of a jitted optax loop records dL/dz for every example. A unit
whose dL/dz is zero for the whole batch is dead: ReLU blocks its gradient, so it can
no longer learn. We train the same network from the same start with two learning
rates and count the dead units per layer as training goes, then check the tapped
cotangents against plain JAX.

Run: python examples/05_haiku.py
"""

import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
import optax

import oryx_gradlog as gl

WIDTHS, N, STEPS = (32, 32), 128, 100
SHOWN = (0, 25, 50, 75, STEPS - 1)  # Steps whose dead units are printed and checked.
LEARNING_RATES = (0.01, 0.5)


def forward(x):
  h = x
  for i, width in enumerate(WIDTHS):
    z = gl.tap(hk.Linear(width, name=f"linear{i}")(h), name=f"z{i}")
    h = jax.nn.relu(z)
  return hk.Linear(1, name="head")(h)[:, 0]


net = hk.without_apply_rng(hk.transform(forward))
optimizer = optax.inject_hyperparams(optax.sgd)(learning_rate=0.0)


def loss(params, x, y):
  return jnp.mean((net.apply(params, x) - y) ** 2)


@jax.jit
def train_step(params, opt_state, x, y):
  (value, grads), records = gl.call_and_reap(jax.value_and_grad(loss))(params, x, y)
  updates, opt_state = optimizer.update(grads, opt_state, params)
  return optax.apply_updates(params, updates), opt_state, value, records


def dead_units(records):
  """Per layer: units whose dL/dz is zero for every example of the batch."""
  return [int(jnp.sum(jnp.all(records[f"z{i}"] == 0, axis=0))) for i in range(len(WIDTHS))]


def reference_cotangents(params, x, y):
  """dL/dz per layer, by adding a zero perturbation to each z in plain JAX."""
  def perturbed(deltas):
    h = x
    for i, delta in enumerate(deltas):
      layer = params[f"linear{i}"]
      h = jax.nn.relu(h @ layer["w"] + layer["b"] + delta)
    out = (h @ params["head"]["w"] + params["head"]["b"])[:, 0]
    return jnp.mean((out - y) ** 2)

  return jax.grad(perturbed)([jnp.zeros((len(x), width)) for width in WIDTHS])


def main():
  kx, kp = jax.random.split(jax.random.PRNGKey(1))
  x = jax.random.normal(kx, (N, 4))
  y = jnp.sin(x[:, 0]) + x[:, 1] * x[:, 2]
  start = net.init(kp, x)

  shapes = jax.eval_shape(gl.reap(jax.grad(loss)), start, x, y)
  print("records: " + ", ".join(f"{name} {s.shape}" for name, s in shapes.items())
        + "  axes: (example, unit)")
  print("learning rate | dead units per layer (of "
        f"{', '.join(map(str, WIDTHS))}) at steps {', '.join(map(str, SHOWN))} | final loss")
  checked = []
  for lr in LEARNING_RATES:
    params = start
    opt_state = optimizer.init(params)
    opt_state.hyperparams["learning_rate"] = jnp.asarray(lr)
    counts = []
    for step in range(STEPS):
      new_params, opt_state, value, records = train_step(params, opt_state, x, y)
      if step in SHOWN:
        counts.append(dead_units(records))
        checked.append((params, records))
      params = new_params
    print(f"{lr:13g} | " + "  ".join(",".join(f"{n:2d}" for n in c) for c in counts)
          + f" | {float(value):.4f}")
    if lr == max(LEARNING_RATES):
      print(f"at learning rate {lr:g}, {sum(counts[-1])} of {sum(WIDTHS)} units end dead: "
            "their dL/dz is zero for every example, so they stop learning")
      assert sum(counts[-1]) > 0

  # Check: every recorded step's dL/dz equals the perturbation reference.
  for params, records in checked:
    for i, expected in enumerate(reference_cotangents(params, x, y)):
      np.testing.assert_allclose(records[f"z{i}"], expected, rtol=1e-5, atol=1e-7)
  print(f"check: dL/dz of {len(checked)} steps x {len(WIDTHS)} layers equal the reference")


if __name__ == "__main__":
  main()
