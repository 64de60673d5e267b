"""DP-SGD with ghost clipping: per-example clipping without per-example gradients.

DP-SGD (Abadi et al. 2016) clips each example's gradient to norm C, sums, adds
Gaussian noise and divides by the batch size. The obvious way forms every
per-example gradient with `jax.vmap(jax.grad(...))`: batch x parameters memory. The
ghost way (Goodfellow 2015; Li et al. 2021; Bu et al. 2023) needs two ordinary
backward passes and no per-example gradient:

1. one backward pass of the summed loss, with the dense layers marked by `gl.dense`,
   gives each layer's inputs and output cotangents, hence the per-example gradient
   norms (`gl.per_example_norms`);
2. the clip factors `c_i = min(1, C / |grad_i|)` reweight the per-example losses, and
   the gradient of `sum_i c_i l_i` (with `c_i` held constant) is the sum of the
   clipped per-example gradients.

We train a small MLP on a synthetic 3-class problem for 30 steps both ways, with the
same noise, and check that the two agree at every step.

Run: python examples/06_dp_sgd.py
"""

import itertools

import jax
import jax.numpy as jnp
import numpy as np

import oryx_gradlog as gl

BATCH, STEPS, LR = 64, 30, 0.5
CLIP, NOISE = 0.3, 0.5  # clip norm C and noise multiplier sigma
SIZES = (10, 32, 32, 3)


def make_data(key, n=BATCH * STEPS):
  """Three Gaussian clusters in 10-D, one per class."""
  k_centres, k_x, k_y = jax.random.split(key, 3)
  centres = 2.0 * jax.random.normal(k_centres, (3, SIZES[0]))
  labels = jax.random.randint(k_y, (n,), 0, 3)
  x = centres[labels] + jax.random.normal(k_x, (n, SIZES[0]))
  return x.reshape(STEPS, BATCH, -1), labels.reshape(STEPS, BATCH)


def init(key):
  params = []
  for d_in, d_out in itertools.pairwise(SIZES):
    key, sub = jax.random.split(key)
    params.append({"w": jax.random.normal(sub, (d_in, d_out)) / np.sqrt(d_in),
                   "b": jnp.zeros(d_out)})
  return params


def mlp(params, x):
  for i, layer in enumerate(params):
    x = gl.dense(x, layer["w"], layer["b"], name=f"fc{i}")
    if i < len(params) - 1:
      x = jnp.tanh(x)
  return x


def example_losses(params, x, y):
  """Cross-entropy per example, `(batch,)` (or a scalar for one example)."""
  logits = mlp(params, x)
  return -jnp.take_along_axis(jax.nn.log_softmax(logits), y[..., None], -1)[..., 0]


def noisy_mean(clipped_sum, key):
  """Adds N(0, (sigma C)^2) to every coordinate, divides by the batch size."""
  leaves, treedef = jax.tree.flatten(clipped_sum)
  keys = jax.random.split(key, len(leaves))
  noisy = [g + NOISE * CLIP * jax.random.normal(k, g.shape) for g, k in zip(leaves, keys)]
  return jax.tree.unflatten(treedef, [g / BATCH for g in noisy])


def ghost_step(params, x, y, key):
  """Two ordinary backward passes; no per-example gradient is formed."""
  batch_loss = lambda p: jnp.sum(example_losses(p, x, y))
  records = gl.reap(jax.grad(batch_loss))(params)
  norms = gl.per_example_norms(records, reduction="sum").total
  factors = jnp.minimum(1.0, CLIP / jnp.maximum(norms, 1e-12))
  reweighted = lambda p: jnp.sum(jax.lax.stop_gradient(factors) * example_losses(p, x, y))
  clipped_sum = jax.grad(reweighted)(params)
  update = noisy_mean(clipped_sum, key)
  return jax.tree.map(lambda p, u: p - LR * u, params, update), norms, clipped_sum


def naive_step(params, x, y, key):
  """The reference: per-example gradients with vmap(grad), clipped one by one."""
  per_example = jax.vmap(jax.grad(example_losses), in_axes=(None, 0, 0))(params, x, y)
  flat = jnp.concatenate([g.reshape(BATCH, -1) for g in jax.tree.leaves(per_example)], 1)
  norms = jnp.linalg.norm(flat, axis=1)
  factors = jnp.minimum(1.0, CLIP / jnp.maximum(norms, 1e-12))
  clipped_sum = jax.tree.map(lambda g: jnp.tensordot(factors, g, axes=1), per_example)
  update = noisy_mean(clipped_sum, key)
  return jax.tree.map(lambda p, u: p - LR * u, params, update), norms, clipped_sum


@jax.jit
def train(params, xs, ys, key):
  """Trains both ways in lockstep from the same start, with the same noise."""
  def step(carry, batch):
    ghost_params, naive_params, key = carry
    key, sub = jax.random.split(key)
    x, y = batch
    ghost_params, ghost_norms, ghost_sum = ghost_step(ghost_params, x, y, sub)
    naive_params, naive_norms, naive_sum = naive_step(naive_params, x, y, sub)
    return (ghost_params, naive_params, key), (ghost_norms, naive_norms, ghost_sum, naive_sum)

  (ghost, naive, _), history = jax.lax.scan(step, (params, params, key), (xs, ys))
  return ghost, naive, history


def accuracy(params, x, y):
  return float(jnp.mean(jnp.argmax(mlp(params, x), -1) == y))


def main():
  k_data, k_init, k_noise = jax.random.split(jax.random.PRNGKey(0), 3)
  xs, ys = make_data(k_data)
  params = init(k_init)
  ghost, naive, (ghost_norms, naive_norms, ghost_sums, naive_sums) = train(
      params, xs, ys, k_noise)

  x_all, y_all = xs.reshape(-1, SIZES[0]), ys.reshape(-1)
  print(f"accuracy before {accuracy(params, x_all, y_all):.3f}, after {STEPS} DP-SGD steps: "
        f"ghost {accuracy(ghost, x_all, y_all):.3f}, naive {accuracy(naive, x_all, y_all):.3f}")
  clipped = np.mean(np.asarray(ghost_norms) > CLIP)
  print(f"per-example gradient norms: median {np.median(ghost_norms):.3f}, "
        f"{100 * clipped:.0f}% of the examples clipped to C = {CLIP}")
  records = gl.reap(jax.grad(lambda p: jnp.sum(example_losses(p, xs[0], ys[0]))))(params)
  print("norm method per layer:", gl.per_example_norms(records, reduction="sum").method)

  # Check: every step's norms and clipped sums, and the final parameters, agree.
  np.testing.assert_allclose(ghost_norms, naive_norms, rtol=1e-5, atol=1e-6)
  for a, b in zip(jax.tree.leaves(ghost_sums), jax.tree.leaves(naive_sums)):
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)
  for a, b in zip(jax.tree.leaves(ghost), jax.tree.leaves(naive)):
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)
  print(f"check: {STEPS} steps x {BATCH} examples: ghost norms, clipped gradient sums and "
        "the trained parameters equal the vmap(grad) reference")


if __name__ == "__main__":
  main()
