"""The seed question end to end: which MVM, 1st or 2nd, and which example?

A quantised matrix-vector product `qmvm` (8-bit weights and activations, with a
straight-through estimator) is called twice per example inside `vmap`. We train its
weights for 10 steps of SGD inside one `jit`-compiled `lax.scan`, and record every
step's cotangents per call and per example: no host callbacks, no global lists, and
the records stay on the device until we choose to print them.

Run: python examples/02_seed_qmvm.py      (or: make demo)
"""

import jax
import jax.numpy as jnp
import numpy as np

import oryx_gradlog as gl

STEPS, BATCH, WIDTH, LR = 10, 10, 10, 5e-3


def quantize(x, bits=8, scale=2.0):
  """Rounds to a symmetric 8-bit grid; the gradient passes straight through."""
  levels = 2 ** (bits - 1) - 1
  q = jnp.clip(jnp.round(x / scale * levels), -levels, levels) * scale / levels
  return x + jax.lax.stop_gradient(q - x)


def _qmvm(x, w):
  return jnp.dot(quantize(x), quantize(w))


qmvm = gl.record_vjp(_qmvm, name="qmvm")


def run_nn(x, w, mvm=qmvm):
  out = mvm(x, w)  # 1st MVM
  return mvm(jnp.tanh(out), w)  # 2nd MVM


def example_loss(w, x, target):
  return jnp.sum((run_nn(x, w) - target) ** 2)


@jax.jit
def train(w, x, target):
  """10 SGD steps; per step, per-example gradients and records of both MVMs."""
  per_example = gl.call_and_reap(jax.vmap(jax.grad(example_loss), in_axes=(None, 0, 0)))

  def step(w, _):
    grads, records = per_example(w, x, target)
    return w - LR * grads.mean(0), (w, records)

  return jax.lax.scan(step, w, None, length=STEPS)


def reference_cotangents(w, x, target):
  """Per example and call, by perturbing each call's inputs (plain JAX)."""
  def perturbed(deltas, x, target):
    (dx1, dw1), (dx2, dw2) = deltas
    out = _qmvm(x + dx1, w + dw1)
    return jnp.sum((_qmvm(jnp.tanh(out) + dx2, w + dw2) - target) ** 2)

  zeros = [(jnp.zeros(WIDTH), jnp.zeros((WIDTH, WIDTH)))] * 2
  per_example = jax.vmap(jax.grad(perturbed), in_axes=(None, 0, 0))(zeros, x, target)
  return [jnp.stack(c) for c in zip(*per_example)]  # (call, example, ...) per input


def main():
  kx, kw, kt = jax.random.split(jax.random.PRNGKey(42), 3)
  x = jax.random.uniform(kx, (BATCH, WIDTH), minval=-1, maxval=1)
  w = jax.random.uniform(kw, (WIDTH, WIDTH), minval=-1, maxval=1)
  target = jax.random.uniform(kt, (BATCH, WIDTH), minval=-1, maxval=1)

  with jax.transfer_guard_device_to_host("disallow"):  # Nothing leaves the device...
    _, (w_history, records) = train(w, x, target)
    ct_x, ct_w = records["qmvm"]
  # ...until we ask for it.
  print(f"records: qmvm = (dL/dx {ct_x.shape}, dL/dw {ct_w.shape})"
        "  axes: (step, call, example, ...)")
  norms_x = jax.device_get(jnp.linalg.norm(ct_x, axis=-1))  # (step, call, example)
  norms_w = jax.device_get(jnp.linalg.norm(ct_w, axis=(-2, -1)))
  print("step | mean |dL/dx|  1st MVM  2nd MVM | mean |dL/dw|  1st MVM  2nd MVM")
  for s in range(STEPS):
    print(f"{s:4d} |             {norms_x[s, 0].mean():8.4f} {norms_x[s, 1].mean():8.4f} |"
          f"             {norms_w[s, 0].mean():8.4f} {norms_w[s, 1].mean():8.4f}")
  worst = np.unravel_index(np.argmax(norms_w[-1]), norms_w[-1].shape)
  print(f"last step: largest |dL/dw| is call {worst[0]} (0 = 1st MVM), example {worst[1]}")

  # Check every step against the perturbation reference, per call and example.
  for s in range(STEPS):
    expected_x, expected_w = reference_cotangents(w_history[s], x, target)
    np.testing.assert_allclose(ct_x[s], expected_x, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(ct_w[s], expected_w, rtol=1e-5, atol=1e-5)
  print(f"check: all {STEPS} steps x 2 calls x {BATCH} examples equal the reference")


if __name__ == "__main__":
  main()
