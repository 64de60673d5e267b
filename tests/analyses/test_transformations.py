"""Every per-example analysis, on both families of layer records, under one shared
set of transformations, against plain JAX.

The families: layers marked by hand (`gl.dense`) and layers found by
`gl.record_layers` in the same model written in plain JAX. The transformations
(`TRANSFORMS`): eager, `jit`, `remat` of the loss, inside a `lax.scan` over steps,
`vmap` over an ensemble of two models, and a `jit` whose batch is sharded over the
8 CPU devices. The true computation: each example's gradient from `vmap(grad)` of
the plain model, and each analysis's definition in NumPy on it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec
from conftest import eight_devices

import oryx_gradlog as gl

B, CLIP = 8, 0.5
PARAMS = ("w1", "b1", "w2", "b2")


def _params(scale=1.0):
  keys = jax.random.split(jax.random.PRNGKey(0), 4)
  return {"w1": scale * jax.random.normal(keys[0], (3, 4)), "b1": 0.1 * jnp.ones(4),
          "w2": scale * jax.random.normal(keys[1], (4, 2)), "b2": jnp.zeros(2)}


def _data():
  keys = jax.random.split(jax.random.PRNGKey(1), 2)
  return jax.random.normal(keys[0], (B, 3)), jax.random.normal(keys[1], (B, 2))


def _losses(p, x, y, dense):
  h = jnp.tanh(dense(x, p["w1"], p["b1"], name="fc1"))
  return 0.5 * jnp.sum((dense(h, p["w2"], p["b2"], name="fc2") - y) ** 2, -1)


def _plain_dense(x, w, b, name):
  del name
  return x @ w + b


def _loss(family, remat):
  dense = gl.dense if family == "marked" else _plain_dense
  loss = lambda p, x, y: jnp.mean(_losses(p, x, y, dense))
  loss = jax.checkpoint(loss) if remat else loss
  return loss if family == "marked" else gl.record_layers(loss)


def _by_param(layers, family) -> dict:
  """An analysis's per-key `LayerParams` by parameter name."""
  if family == "found":
    return {name: layers[name].w for name in PARAMS}
  return {f"{field}{i}": getattr(layers[f"fc{i}"], field) for i in "12" for field in "wb"}


# Each analysis of one batch's records, as arrays by name (per parameter where it
# has per-parameter results).
def _analyses(records, family):
  tests = gl.batch_size_tests(records)
  return {
      "norms": gl.per_example_norms(records).norms,
      **{f"clip.{k}": v for k, v in _by_param(
          gl.per_example_clip(records, l2_norm_clip=CLIP).layers, family).items()},
      **{f"sum_sq.{k}": v for k, v in _by_param(gl.sum_grad_squared(records), family).items()},
      "norm_test": tests.norm_test, "inner_product_test": tests.inner_product_test,
      "orthogonality_test": tests.orthogonality_test,
      "snr": gl.gradient_snr(records).mean,
      "hist_1d": gl.gradient_histograms(records, two_d=False).counts_1d,
  }


def _reference(params, x, y) -> dict:
  """The same quantities from `vmap(grad)`'s per-example gradients, in NumPy."""
  one = lambda p, x, y: _losses(p, x[None], y[None], _plain_dense)[0]
  grads = jax.vmap(jax.grad(one), in_axes=(None, 0, 0))(params, x, y)
  grads = {k: np.asarray(v, np.float64) for k, v in grads.items()}
  g = np.concatenate([grads[k].reshape(B, -1) for k in PARAMS], 1)
  norms = np.linalg.norm(g, axis=1)
  factors = np.minimum(1.0, CLIP / norms)
  gbar = g.mean(0)
  gsq, pairs, products = gbar @ gbar, B * (B - 1), g @ gbar
  out = {
      "norms": norms,
      **{f"clip.{k}": np.tensordot(factors, grads[k], axes=1) / B for k in PARAMS},
      **{f"sum_sq.{k}": np.sum(grads[k] ** 2, axis=0) for k in PARAMS},
      "norm_test": np.sqrt(np.sum((g - gbar) ** 2) / pairs) / np.sqrt(gsq),
      "inner_product_test": np.sqrt(np.sum((products - gsq) ** 2) / pairs) / gsq,
      "orthogonality_test": np.sqrt(np.sum(
          (g - np.outer(products / gsq, gbar)) ** 2) / pairs) / np.sqrt(gsq),
      "snr": np.mean(gbar ** 2 / ((g ** 2).mean(0) - gbar ** 2 + 1e-5)),
      "hist_1d": np.histogram(np.clip(g, -2, 2), bins=100, range=(-2, 2))[0],
  }
  return out


def _step(family, remat=False):
  loss = _loss(family, remat)

  def step(params, x, y):
    return _analyses(gl.reap(jax.grad(loss))(params, x, y), family)
  return step


def _sharded(step, params, x, y):
  mesh = Mesh(np.array(eight_devices()), ("batch",))
  batch = NamedSharding(mesh, PartitionSpec("batch"))
  x, y = jax.device_put(x, batch), jax.device_put(y, batch)
  return jax.jit(step)(params, x, y)


def _scanned(step, params, x, y):
  def body(carry, _):
    return carry, step(params, x, y)
  _, out = jax.jit(lambda: jax.lax.scan(body, 0, None, length=2))()
  return jax.tree.map(lambda v: v[1], out)  # The second step's.


TRANSFORMS = {
    "eager": lambda step, *args: step(*args),
    "jit": lambda step, *args: jax.jit(step)(*args),
    "remat": None,  # The loss checkpointed, the step jitted.
    "scan": _scanned,
    "sharded": _sharded,
}


def _assert_close(actual, expected, where):
  assert set(actual) == set(expected), where
  for name, value in expected.items():
    value_actual = np.asarray(actual[name], np.float64)
    if name == "hist_1d":  # Counts: float32 rounding may move an element a bin.
      assert abs(value_actual - value).sum() <= 2, (where, name)
      assert value_actual.sum() == value.sum(), (where, name)
    else:
      np.testing.assert_allclose(value_actual, value, rtol=2e-4, atol=1e-6,
                                 err_msg=f"{where}: {name}")


@pytest.mark.parametrize("transform", [*TRANSFORMS, "vmap"])
@pytest.mark.parametrize("family", ["marked", "found"])
def test_every_analysis_under_every_transformation_matches_vmap_grad(family, transform):
  params, (x, y) = _params(), _data()
  if transform == "vmap":  # An ensemble of two models, each analysed inside the vmap.
    ensemble = jax.tree.map(lambda a, b: jnp.stack([a, b]), params, _params(0.5))
    out = jax.jit(jax.vmap(_step(family), in_axes=(0, None, None)))(ensemble, x, y)
    for member, member_params in enumerate((params, _params(0.5))):
      _assert_close(jax.tree.map(lambda v: v[member], out), _reference(member_params, x, y),
                    f"{family}/vmap[{member}]")
    return
  if transform == "remat":
    out = jax.jit(_step(family, remat=True))(params, x, y)
  else:
    out = TRANSFORMS[transform](_step(family), params, x, y)
  _assert_close(out, _reference(params, x, y), f"{family}/{transform}")
