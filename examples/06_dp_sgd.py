"""DP-SGD in one backward pass: handwritten digits, with privacy accounting.

DP-SGD (Abadi et al. 2016) clips each example's gradient to norm C, sums, adds
Gaussian noise N(0, (sigma C)^2) and averages. The obvious way forms every
per-example gradient with `jax.vmap(jax.grad(...))`: batch x parameters memory.
Here one ordinary backward pass does it (Bu et al. 2023, "book-keeping"): the layer
records (`gl.dense`, `gl.layer_norm`) hold each example's input and output
cotangent, which give the per-example norms and then, with the cotangents
reweighted by the clip factors, the clipped gradient (`gl.per_example_clip`). No
second backward pass, no per-example gradient.

The pieces of a whole DP-SGD step:
1. `gl.poisson_batch`: Poisson sampling (what the accounting assumes), padded to a
   fixed size; padding examples get weight 0 in the loss.
2. `gl.reap(jax.grad(loss))` then `gl.per_example_clip` and `gl.to_param_tree`.
3. `gl.dp_noise` in an optax chain: the Gaussian noise, then SGD.
4. `gl.dp_noise_multiplier` / `gl.dp_epsilon` (dp-accounting): sigma for a target
   epsilon, and the epsilon spent.

We train a 64-64-10 MLP with a layer norm on scikit-learn's digits, and in the same
jitted scan a copy trained with the `vmap(grad)` + clipping reference and the same
noise; the check is that both agree at every step.

Run: python examples/06_dp_sgd.py
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
from sklearn.datasets import load_digits

import oryx_gradlog as gl

STEPS, EXPECTED_BATCH, PADDED_BATCH = 300, 64, 112
CLIP, TARGET_EPSILON, DELTA, LR = 1.0, 4.0, 1e-5, 2.0
WHERE = {"fc1": {"w": "fc1.w", "b": "fc1.b"}, "ln": {"w": "ln.w", "b": "ln.b"},
         "fc2": {"w": "fc2.w", "b": "fc2.b"}}  # Parameter -> the layer record it is in.


def load():
  digits = load_digits()
  x = (digits.data / 16.0).astype(np.float32)
  y = digits.target.astype(np.int32)
  order = np.random.default_rng(0).permutation(len(x))
  x, y = x[order], y[order]
  return (x[:1500], y[:1500]), (x[1500:], y[1500:])


def init(key):
  k1, k2 = jax.random.split(key)
  return {"fc1": {"w": jax.random.normal(k1, (64, 64)) / 8.0, "b": jnp.zeros(64)},
          "ln": {"w": jnp.ones(64), "b": jnp.zeros(64)},
          "fc2": {"w": jax.random.normal(k2, (64, 10)) / 8.0, "b": jnp.zeros(10)}}


def logits(params, x):
  h = jnp.tanh(gl.dense(x, params["fc1"]["w"], params["fc1"]["b"], name="fc1"))
  h = gl.layer_norm(h, params["ln"]["w"], params["ln"]["b"], name="ln")
  return gl.dense(h, params["fc2"]["w"], params["fc2"]["b"], name="fc2")


def example_loss(params, x, y):
  """Cross-entropy of one example (or `(batch,)` of them)."""
  return optax.softmax_cross_entropy_with_integer_labels(logits(params, x), y)


def batch_loss(params, x, y, weights):
  """The mean over the padded batch of the weighted losses (padding has weight 0)."""
  return jnp.mean(weights * example_loss(params, x, y))


def one_pass_grads(params, x, y, weights):
  """One ordinary backward pass: its records give the clipped mean gradient."""
  records = gl.reap(jax.grad(batch_loss))(params, x, y, weights)
  clipped = gl.per_example_clip(records, l2_norm_clip=CLIP, reduction="mean")
  return gl.to_param_tree(clipped.layers, params, WHERE), clipped.norms


def reference_grads(params, x, y, weights):
  """The reference: per-example gradients by vmap(grad), clipped one by one."""
  weighted = lambda p, x, y, w: w * example_loss(p, x, y)
  per_example = jax.vmap(jax.grad(weighted), in_axes=(None, 0, 0, 0))(params, x, y, weights)
  flat = jnp.concatenate([g.reshape(PADDED_BATCH, -1) for g in jax.tree.leaves(per_example)], 1)
  norms = jnp.linalg.norm(flat, axis=1)
  factors = jnp.minimum(1.0, CLIP / jnp.maximum(norms, 1e-12))
  mean = jax.tree.map(lambda g: jnp.tensordot(factors, g, axes=1) / PADDED_BATCH, per_example)
  return mean, norms


def optimizer(sigma):
  noise = gl.dp_noise(l2_norm_clip=CLIP, noise_multiplier=sigma, reduction="mean",
                      batch_size=PADDED_BATCH, seed=1)
  return optax.chain(noise, optax.sgd(LR, momentum=0.5))


def train(params, x_train, y_train, sigma, key):
  """Both ways in lockstep in one jitted scan, with the same batches and noise."""
  opt = optimizer(sigma)
  rate = EXPECTED_BATCH / len(x_train)

  def step(carry, key):
    (ours, ours_state), (ref, ref_state) = carry
    batch = gl.poisson_batch(key, len(x_train), sampling_rate=rate, batch_size=PADDED_BATCH)
    data = (x_train[batch.indices], y_train[batch.indices], batch.weights)
    grads, norms = one_pass_grads(ours, *data)
    updates, ours_state = opt.update(grads, ours_state)
    ours = optax.apply_updates(ours, updates)
    ref_grads, ref_norms = reference_grads(ref, *data)
    updates, ref_state = opt.update(ref_grads, ref_state)
    ref = optax.apply_updates(ref, updates)
    return ((ours, ours_state), (ref, ref_state)), (norms, ref_norms, batch.count)

  start = ((params, opt.init(params)), (params, opt.init(params)))
  ((ours, _), (ref, _)), history = jax.lax.scan(
      step, start, jax.random.split(key, STEPS))
  return ours, ref, history


def accuracy(params, x, y):
  return float(jnp.mean(jnp.argmax(logits(params, x), -1) == y))


def main():
  (x_train, y_train), (x_test, y_test) = load()
  rate = EXPECTED_BATCH / len(x_train)
  sigma = gl.dp_noise_multiplier(target_epsilon=TARGET_EPSILON, sampling_rate=rate,
                                 steps=STEPS, delta=DELTA)
  epsilon = gl.dp_epsilon(noise_multiplier=sigma, sampling_rate=rate, steps=STEPS, delta=DELTA)
  params = init(jax.random.PRNGKey(0))
  ours, ref, (norms, ref_norms, counts) = jax.jit(train, static_argnums=3)(
      params, jnp.asarray(x_train), jnp.asarray(y_train), sigma, jax.random.PRNGKey(2))

  print(f"{STEPS} steps, Poisson sampling q = {rate:.4f} (batches of {int(counts.min())} to "
        f"{int(counts.max())} examples, padded to {PADDED_BATCH}), clip C = {CLIP}, "
        f"noise multiplier sigma = {sigma:.3f}")
  print(f"privacy: epsilon = {epsilon:.2f} at delta = {DELTA} (RDP accountant, dp-accounting)")
  print(f"test accuracy: before {accuracy(params, x_test, y_test):.3f}, after DP-SGD "
        f"{accuracy(ours, x_test, y_test):.3f} (one pass), "
        f"{accuracy(ref, x_test, y_test):.3f} (vmap reference)")
  sampled = np.asarray(norms)[np.asarray(norms) > 0]
  print(f"per-example gradient norms: median {np.median(sampled):.3f}, "
        f"{100 * np.mean(sampled > CLIP):.0f}% of the sampled examples clipped")

  # Check: every step's norms, and the trained parameters, agree with the reference.
  assert int(counts.max()) <= PADDED_BATCH, "a batch overflowed its padding"
  assert epsilon <= TARGET_EPSILON * (1 + 1e-6)
  np.testing.assert_allclose(norms, ref_norms, rtol=1e-4, atol=1e-5)
  for a, b in zip(jax.tree.leaves(ours), jax.tree.leaves(ref)):
    np.testing.assert_allclose(a, b, rtol=1e-3, atol=1e-4)
  assert accuracy(ours, x_test, y_test) > 0.8
  print(f"check: {STEPS} DP-SGD steps at epsilon {epsilon:.2f}: one-pass norms and trained "
        "parameters equal the vmap(grad) + clipping reference")


if __name__ == "__main__":
  main()
