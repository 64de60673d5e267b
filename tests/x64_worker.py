"""Records, summaries, running statistics and analyses in float64, in a fresh process.

`test_x64.py` runs this with `JAX_ENABLE_X64=1`, or with `--config` to turn x64 on
through `jax.config` before `oryx_gradlog` is imported. Every check is against plain
JAX or numpy in float64, to float64 tolerances; it prints "x64 checks passed".
"""

import sys

import jax
import jax.flatten_util

if "--config" in sys.argv:
  jax.config.update("jax_enable_x64", True)

import jax.numpy as jnp
import numpy as np

import oryx_gradlog as gl  # The import probe runs with x64 on.

RTOL = 1e-12


def loss(params, x, t, perturb=0.0):
  """A dense tanh layer and a linear head; `perturb` adds zeros to the hidden layer."""
  h = jnp.tanh(gl.dense(x, params["w1"], params["b1"], name="fc1") + perturb)
  h = gl.tap(h, name="h")
  y = gl.dense(h, params["w2"], None, name="fc2")
  return jnp.mean(jnp.sum((y - t) ** 2, axis=-1))


def main():
  assert jax.config.jax_enable_x64
  keys = jax.random.split(jax.random.PRNGKey(0), 4)
  params = {"w1": jax.random.normal(keys[0], (3, 4)), "b1": jnp.full(4, 0.1),
            "w2": jax.random.normal(keys[1], (4, 2))}
  x, t = jax.random.normal(keys[2], (6, 3)), jax.random.normal(keys[3], (6, 2))
  assert x.dtype == jnp.float64

  # Records against the zero-perturbation trick.
  grads, records = jax.jit(gl.call_and_reap(jax.grad(loss)))(params, x, t)
  expected = jax.grad(lambda d: loss(params, x, t, d))(jnp.zeros((6, 4)))
  assert records["fc1"].out_cotangent.dtype == jnp.float64
  np.testing.assert_allclose(records["fc1"].out_cotangent, expected, rtol=RTOL)
  np.testing.assert_allclose(grads["w1"], jax.grad(loss)(params, x, t)["w1"], rtol=RTOL)

  # Summaries in float64, of values float32 cannot hold, against numpy.
  r = np.asarray(records["h"]) * 1e40
  summary = jax.jit(lambda r: gl.summarize({"r": r}, keep_axes=1))(r)["r"].summary
  assert summary.norm.dtype == jnp.float64 and summary.histogram.dtype == jnp.int32
  np.testing.assert_allclose(summary.norm, np.linalg.norm(r, axis=1), rtol=RTOL)
  np.testing.assert_allclose(summary.mean, r.mean(1), rtol=RTOL)
  np.testing.assert_allclose(summary.variance, r.var(1), rtol=1e-10)
  np.testing.assert_array_equal(summary.histogram[:, -1], 4)  # All past the last edge.

  # Running statistics over three steps.
  stats = gl.running_statistics()
  state = stats.init({"h": records["h"]})
  history = [np.asarray(records["h"]) * k for k in (1.0, -2.0, 0.5)]
  for value in history:
    _, state = jax.jit(stats.update)({"h": value}, state)
  assert state["h"].mean.dtype == jnp.float64
  np.testing.assert_allclose(state["h"].mean, np.mean(history, 0), rtol=RTOL)
  np.testing.assert_allclose(state["h"].variance, np.var(history, 0), rtol=1e-10)

  # Per-example norms and clipped gradients against vmap(grad).
  per_example = jax.vmap(jax.grad(loss), in_axes=(None, 0, 0))(params, x[:, None], t[:, None])
  flat = jnp.concatenate([g.reshape(6, -1) for g in jax.tree.leaves(per_example)], 1)
  norms = gl.per_example_norms(records)
  np.testing.assert_allclose(norms.norms, jnp.linalg.norm(flat, axis=1), rtol=RTOL)
  clipped = gl.per_example_clip(records, l2_norm_clip=10.0)  # Clips some examples, not all.
  factors = jnp.minimum(1.0, 10.0 / jnp.linalg.norm(flat, axis=1))
  assert 0 < int(jnp.sum(factors < 1)) < 6
  np.testing.assert_allclose(clipped.layers["fc1"].w,
                             jnp.einsum("i,ijk->jk", factors, per_example["w1"]) / 6, rtol=1e-10)

  # Curvature in float64 against the dense Hessian (jax.hessian).
  flat, unravel = jax.flatten_util.ravel_pytree(params)
  batch_loss = lambda p: loss(p, x, t)
  hessian = jax.hessian(lambda v: batch_loss(unravel(v)))(flat)
  diagonal = jax.jit(lambda p: gl.hessian_diagonal(batch_loss, p, exact=True))(params)
  np.testing.assert_allclose(jax.flatten_util.ravel_pytree(diagonal)[0], jnp.diag(hessian),
                             rtol=1e-10, atol=1e-14)
  trace = gl.hessian_trace(batch_loss, params, exact=True)
  assert trace.dtype == jnp.float64
  np.testing.assert_allclose(trace, jnp.trace(hessian), rtol=1e-12)
  # A diagonal Hessian (eigenvalues 5, 1, 0.5): Hutchinson's trace is exact with any
  # number of products, and power iteration converges as 0.2^k.
  scales = jnp.array([5.0, 1.0, 0.5])
  quadratic = lambda w: 0.5 * jnp.sum(scales * w["v"] ** 2)
  w, key = {"v": jnp.ones(3)}, jax.random.PRNGKey(1)
  dense = jax.hessian(lambda v: quadratic({"v": v}))(w["v"])
  estimate = jax.jit(lambda w: gl.hessian_trace(quadratic, w, key=key, num_products=3))(w)
  assert estimate.dtype == jnp.float64
  np.testing.assert_allclose(estimate, jnp.trace(dense), rtol=1e-15)
  top = gl.hessian_max_eigenvalue(quadratic, w, key=key, num_products=40)
  assert top.dtype == jnp.float64
  np.testing.assert_allclose(top, np.linalg.eigvalsh(np.asarray(dense))[-1], rtol=1e-12)
  print("x64 checks passed")


if __name__ == "__main__":
  main()
