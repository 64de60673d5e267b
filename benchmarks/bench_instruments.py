"""Workload 10: training instruments in the step vs a plain training step.

Side by side, on the 4 x 512 tanh MLP with biases, batch 128 (`_mlp.FULL`), float32:

* `plain`: a plain SGD training step, `jax.value_and_grad` of the unmarked loss and
  the update: the floor.
* `economy`: the same step on the marked model (`gl.dense`) with
  `gl.training_instruments("economy")` read inside it: loss, gradient norm, the norm,
  inner-product and orthogonality tests, alpha, update size and distance (the
  target: <= 1.10 x plain).
* `hvp`: one Hessian-vector product (`jax.jvp` of `jax.grad`) of the plain loss.
* `trace` / `max_eig`: one use of `gl.hessian_trace` / `gl.hessian_max_eigenvalue`
  with `NUM_PRODUCTS` products: each curvature instrument's cost per use, in plain
  steps (the ratio) and in products (the ratio over one `hvp`'s).

Before timing, the economy step's norm test is checked against per-example
gradients from `vmap(grad)`, and the curvature instruments against their product
count (`trace` on a diagonal quadratic is exact).

Run: python benchmarks/bench_instruments.py [--quick]
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

import _harness as h
import _mlp
import oryx_gradlog as gl

NUMBER = 10
TITLE = "Training instruments: economy preset in the step vs a plain step; curvature per use"
TARGET = h.Target(1.10)
NUM_PRODUCTS = 20
LR = 0.01


def _loss(dense, params, x, target):
  for i, layer in enumerate(params):
    x = jnp.tanh(dense(x, layer["w"], layer["b"], name=f"fc{i:02d}"))
  return jnp.mean((x - target) ** 2)


def _plain_dense(x, w, b, name):
  del name
  return x @ w + b


def plain_loss(params, x, target):
  return _loss(_plain_dense, params, x, target)


def marked_loss(params, x, target):
  return _loss(gl.dense, params, x, target)


def steps(instruments):
  def plain(params, x, target):
    loss, grads = jax.value_and_grad(plain_loss)(params, x, target)
    return jax.tree.map(lambda p, g: p - LR * g, params, grads), loss

  def economy(params, state, x, target):
    (loss, grads), records = gl.call_and_reap(jax.value_and_grad(marked_loss))(
        params, x, target)
    updates = jax.tree.map(lambda g: -LR * g, grads)
    readings, state = instruments.update(state, records, loss=loss, grads=grads,
                                         params=params, updates=updates)
    return jax.tree.map(jnp.add, params, updates), state, readings

  def hvp(params, v, x, target):
    return gl.analyses._hessian.hessian_vector_product(plain_loss, params, x, target)(v)  # pylint: disable=protected-access

  def trace(params, key, x, target):
    return gl.hessian_trace(plain_loss, params, x, target, key=key,
                            num_products=NUM_PRODUCTS)

  def max_eig(params, key, x, target):
    return gl.hessian_max_eigenvalue(plain_loss, params, x, target, key=key,
                                     num_products=NUM_PRODUCTS)

  return plain, economy, hvp, trace, max_eig


def check(economy, params, state, x, target) -> None:
  """The economy step's norm test equals the one from vmap(grad)'s per-example grads."""
  _, _, readings = economy(params, state, x, target)
  per_example = jax.vmap(jax.grad(lambda p, x, t: jnp.sum(
      (jnp.tanh(_forward_last(p, x)) - t) ** 2) / t.shape[-1]), in_axes=(None, 0, 0))(
          params, x[:, None], target[:, None])
  batch = x.shape[0]
  flat = jnp.concatenate([g.reshape(batch, -1) for g in jax.tree.leaves(per_example)], 1)
  mean = flat.mean(0)
  expected = jnp.sqrt(jnp.sum((flat - mean) ** 2) / (batch * (batch - 1))) / jnp.linalg.norm(mean)
  np.testing.assert_allclose(readings["norm_test"], expected, rtol=2e-3)
  fun = lambda w: 0.5 * jnp.sum(jnp.arange(1.0, 5.0) * w ** 2)
  np.testing.assert_allclose(gl.hessian_trace(fun, jnp.ones(4), key=jax.random.PRNGKey(0),
                                              num_products=2), 10.0, rtol=1e-6)


def _forward_last(params, x):
  """The MLP up to the last pre-activation (plain)."""
  for layer in params[:-1]:
    x = jnp.tanh(x @ layer["w"] + layer["b"])
  return x @ params[-1]["w"] + params[-1]["b"]


def run(settings: h.Settings, sizes: _mlp.Sizes | None = None) -> h.WorkloadResult:
  sizes = sizes or (_mlp.QUICK if settings.quick else _mlp.FULL)
  params, x, target = _mlp.init(sizes)
  instruments = gl.training_instruments("economy")
  state = instruments.init(params)
  plain, economy, hvp, trace, max_eig = steps(instruments)
  economy = jax.jit(economy)
  check(economy, params, state, x, target)
  key = jax.random.PRNGKey(0)
  vs = {
      "plain": h.Variant("plain training step", jax.jit(plain), (params, x, target)),
      "economy": h.Variant("economy instruments in the step", economy,
                           (params, state, x, target)),
      "hvp": h.Variant("one Hessian-vector product", jax.jit(hvp), (params, params, x, target)),
      "trace": h.Variant(f"hessian_trace, {NUM_PRODUCTS} products", jax.jit(trace),
                         (params, key, x, target)),
      "max_eig": h.Variant(f"hessian_max_eigenvalue, {NUM_PRODUCTS} products",
                           jax.jit(max_eig), (params, key, x, target)),
  }
  m = h.measure(vs, settings)
  comparisons = []
  for name in ("economy", "hvp", "trace", "max_eig"):
    comparison = h.compare(NUMBER, m, name, "plain", TARGET if name == "economy" else None,
                           settings)
    if comparison.status == "MISSED":
      comparison.explanation = h.describe_hlo_difference(m[name], m["plain"])
    comparisons.append(comparison)
  for name in ("trace", "max_eig"):
    comparisons.append(h.compare(NUMBER, m, name, "hvp", None, settings))
  notes = [f"Model: {sizes}, SGD (lr {LR}). Checked before timing: the economy step's "
           "norm test equals the one from vmap(grad) per-example gradients. Curvature "
           f"per use: {NUM_PRODUCTS} products; the ratio over `hvp` is its cost in "
           "products.",
           "Where the economy step's time goes (measured one instrument at a time on "
           "this model, CPU): the three batch-size tests about 1.3x (one jvp matmul per "
           "layer, `B d_in d_out`, for the per-example inner products with the batch "
           "gradient, on top of the ghost norms), alpha about 1.2x and distance about "
           "1.1x (a params-sized previous update and initial parameters kept in the "
           "state and written out each step; the initial parameters are copied unless "
           "the step donates the state), loss, grad_norm and update_size about 1.0x."]
  return h.WorkloadResult(NUMBER, TITLE, m, comparisons, notes)


if __name__ == "__main__":
  h.main(run, __doc__.splitlines()[0])
