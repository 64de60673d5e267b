"""Flax linen: which layer's gradients shrink as a deep tanh network trains?

Six identical tanh blocks are stacked with `nn.scan` (one kernel per block, stacked
along a leading axis) under a dense head, and trained with optax Adam in one jitted
step. Each block's dense layer calls `gl.record_vjp` on its (input, kernel, bias), so
every step returns, next to the new parameters and optimizer state, the cotangents of
all six blocks, stacked per block in forward order (block 0 first). We print
|dL/dkernel| per block as training goes, then check the records of every printed
step against plain JAX.

Run: python examples/03_flax.py
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

import oryx_gradlog as gl

DEPTH, WIDTH, BATCH, STEPS, LR = 6, 16, 64, 120, 3e-3
PRINT_EVERY = 20


def affine(x, kernel, bias):
  return x @ kernel + bias


class Block(nn.Module):
  """tanh(x @ kernel + bias); the affine map is recorded as "block"."""

  @nn.compact
  def __call__(self, x, _):
    kernel = self.param("kernel", nn.initializers.normal(1.5 / np.sqrt(WIDTH)),
                        (WIDTH, WIDTH))
    bias = self.param("bias", nn.initializers.zeros, (WIDTH,))
    return jnp.tanh(gl.record_vjp(affine, name="block")(x, kernel, bias)), None


class DeepMLP(nn.Module):

  @nn.compact
  def __call__(self, x):
    blocks = nn.scan(Block, variable_axes={"params": 0}, split_rngs={"params": True},
                     length=DEPTH)
    x, _ = blocks(name="blocks")(x, None)
    return nn.Dense(1, name="head")(x)


model = DeepMLP()
optimizer = optax.adam(LR)


def loss(params, x, y):
  return jnp.mean((model.apply(params, x)[:, 0] - y) ** 2)


@jax.jit
def train_step(params, opt_state, x, y):
  (value, grads), records = gl.call_and_reap(jax.value_and_grad(loss))(params, x, y)
  updates, opt_state = optimizer.update(grads, opt_state, params)
  return optax.apply_updates(params, updates), opt_state, value, records


def reference_cotangents(params, x, y):
  """(dL/dx, dL/dkernel, dL/dbias) per block, by perturbing a plain-JAX copy."""
  blocks, head = params["params"]["blocks"], params["params"]["head"]

  def perturbed(deltas):
    h = x
    for i in range(DEPTH):
      dx, dkernel, dbias = (d[i] for d in deltas)
      h = jnp.tanh(affine(h + dx, blocks["kernel"][i] + dkernel, blocks["bias"][i] + dbias))
    out = affine(h, head["kernel"], head["bias"])
    return jnp.mean((out[:, 0] - y) ** 2)

  zeros = (jnp.zeros((DEPTH, BATCH, WIDTH)), jnp.zeros_like(blocks["kernel"]),
           jnp.zeros_like(blocks["bias"]))
  return jax.grad(perturbed)(zeros)


def main():
  kx, ka, kp = jax.random.split(jax.random.PRNGKey(3), 3)
  x = jax.random.normal(kx, (BATCH, WIDTH))
  y = jnp.sin(x @ jax.random.normal(ka, (WIDTH,)) / 2)
  params = model.init(kp, x)
  opt_state = optimizer.init(params)

  print("records['block'] = (dL/dx, dL/dkernel, dL/dbias), each (block, ...)")
  print("step    loss   | |dL/dkernel| per block, block 0 (nearest the input) first")
  checked, first, last = [], None, None
  for step in range(STEPS + 1):
    new_params, opt_state, value, records = train_step(params, opt_state, x, y)
    if step % PRINT_EVERY == 0:
      norms = np.asarray(jnp.linalg.norm(records["block"][1], axis=(1, 2)))
      print(f"{step:4d} {float(value):9.2e} | " + " ".join(f"{n:7.4f}" for n in norms))
      checked.append((params, records["block"]))
      first = norms if first is None else first
      last = norms
    params = new_params

  shrink = first / last
  print(f"largest |dL/dkernel|: block {int(np.argmax(first))} at step 0, block "
        f"{int(np.argmax(last))} at step {STEPS}. As the loss falls every block's "
        f"gradient shrinks, by {shrink.min():.0f}x (block {int(np.argmin(shrink))}) to "
        f"{shrink.max():.0f}x (block {int(np.argmax(shrink))}): the blocks nearer the "
        f"{'output' if np.argmax(shrink) > np.argmin(shrink) else 'input'} settle first.")

  # Check: every printed step's records equal the perturbation reference.
  for params, record in checked:
    expected = reference_cotangents(params, x, y)
    for actual, wanted in zip(record, expected):
      np.testing.assert_allclose(actual, wanted, rtol=1e-4, atol=1e-6)
  print(f"check: {len(checked)} steps x {DEPTH} blocks of records equal the reference")


if __name__ == "__main__":
  main()
