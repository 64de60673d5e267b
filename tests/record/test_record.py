"""`record_vjp` and `tap` against plain JAX: `jax.vjp` and the perturbation trick."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import assert_trees_close

import oryx_gradlog as gl

KEY = jax.random.PRNGKey(0)


def test_seed_oryx_recipe_value():
  # The Oryx answer in the seed: reap(grad(f))(3.) == {'square_vjp': (0.28224,)}.
  square = gl.record_vjp(lambda x: x ** 2.0, name="square_vjp")
  records = gl.reap(jax.grad(lambda x: square(jnp.sin(x))))(3.0)

  # True computation: Matt's perturbation function, differentiated w.r.t. delta_y.
  f_perturbed = lambda x, delta_y: (jnp.sin(x) + delta_y) ** 2
  _, expected = jax.grad(f_perturbed, (0, 1))(3.0, 0.0)

  assert list(records) == ["square_vjp"]
  assert isinstance(records["square_vjp"], tuple) and len(records["square_vjp"]) == 1
  np.testing.assert_allclose(records["square_vjp"][0], expected, rtol=1e-6)
  np.testing.assert_allclose(records["square_vjp"][0], 0.28224, rtol=1e-4)


def test_tap_matches_perturbation_reference(variant):
  x = jnp.arange(3.0)
  # True computation: cotangent of h = 2x via a zero perturbation.
  ref = lambda x, delta: jnp.sum(jnp.sin(2 * x + delta) ** 2)
  expected = jax.grad(ref, argnums=1)(x, jnp.zeros_like(x))
  # Library computation.
  loss = lambda x: jnp.sum(jnp.sin(gl.tap(2 * x, name="h")) ** 2)
  grads, records = variant(gl.call_and_reap, jax.grad(loss))(x)
  # Comparison.
  np.testing.assert_allclose(records["h"], expected, rtol=1e-6)
  np.testing.assert_allclose(grads, jax.grad(ref)(x, jnp.zeros_like(x)), rtol=1e-6)


def _layer(x, w):
  return jnp.tanh(x @ w)


def test_record_vjp_equals_jax_vjp_of_the_call(variant):
  k1, k2 = jax.random.split(KEY)
  x, w = jax.random.normal(k1, (5,)), jax.random.normal(k2, (5, 4))
  head = lambda y: jnp.sum(jnp.sin(y) ** 2)
  layer = gl.record_vjp(_layer, name="layer")
  loss = lambda x, w: head(layer(x, w))

  # True computation: the cotangent arriving at the output, pulled back by jax.vjp.
  y, pullback = jax.vjp(_layer, x, w)
  expected = pullback(jax.grad(head)(y))

  records = variant(gl.reap, jax.grad(loss, argnums=(0, 1)))(x, w)
  assert_trees_close(records["layer"], expected)


def test_full_record_holds_primals_output_cotangent_and_input_cotangents(variant):
  k1, k2 = jax.random.split(KEY)
  x, w = jax.random.normal(k1, (5,)), jax.random.normal(k2, (5, 4))
  head = lambda y: jnp.sum(jnp.sin(y) ** 2)
  layer = gl.record_vjp(_layer, name="layer", full=True)

  y, pullback = jax.vjp(_layer, x, w)
  g = jax.grad(head)(y)

  records = variant(gl.reap, jax.grad(lambda x, w: head(layer(x, w))))(x, w)
  record = records["layer"]
  assert isinstance(record, gl.VJPRecord)
  assert_trees_close(record.primals, (x, w))
  assert_trees_close(record.out_cotangent, g)
  assert_trees_close(record.in_cotangents, pullback(g))
  with pytest.raises(dataclasses.FrozenInstanceError):
    record.primals = None
  # A pytree: it flattens to its five arrays.
  assert len(jax.tree.leaves(record)) == 5


def test_pytree_inputs_outputs_and_keyword_arguments():
  params = {"w": jax.random.normal(KEY, (3, 3)), "b": jnp.arange(3.0)}
  x = jnp.linspace(-1.0, 1.0, 3)

  def block(params, x, *, scale):
    h = x @ params["w"] + params["b"]
    return {"out": jnp.tanh(h) * scale, "aux": (h,)}

  recorded = gl.record_vjp(block, name="block")
  head = lambda out: jnp.sum(out["out"] ** 2) + jnp.sum(jnp.cos(out["aux"][0]))
  loss = lambda params, x, scale: head(recorded(params, x, scale=scale))
  grads, records = gl.call_and_reap(jax.grad(loss, argnums=(0, 1, 2)))(params, x, 2.0)

  # Keyword arguments are differentiated (scale gets its gradient) but not recorded.
  plain = lambda params, x, scale: head(block(params, x, scale=scale))
  assert_trees_close(grads, jax.grad(plain, argnums=(0, 1, 2))(params, x, 2.0))
  out, pullback = jax.vjp(lambda p, x: block(p, x, scale=2.0), params, x)
  assert_trees_close(records["block"], pullback(jax.grad(head)(out)))


def test_integer_inputs_record_none():
  idx = jnp.array([2, 0])
  table = jnp.arange(12.0).reshape(4, 3)
  lookup = gl.record_vjp(lambda table, idx: table[idx], name="lookup")
  loss = lambda table: jnp.sum(lookup(table, idx) ** 2)
  grads, records = gl.call_and_reap(jax.grad(loss))(table)

  ct_table, ct_idx = records["lookup"]
  assert ct_idx is None
  expected = jax.vjp(lambda t: t[idx], table)[1](2 * table[idx])[0]
  np.testing.assert_allclose(ct_table, expected)
  np.testing.assert_allclose(grads, jax.grad(lambda t: jnp.sum(t[idx] ** 2))(table))


def test_a_tree_with_no_float_leaves_is_not_recorded():
  loss = lambda x: jnp.sum(x * gl.tap(jnp.arange(3), name="ints"))
  assert gl.reap(jax.grad(loss))(jnp.ones(3)) == {}


def _net(x):
  h = gl.tap(jnp.sin(x) * x, name="h")
  return jnp.sum(gl.record_vjp(lambda h: h ** 3, name="cube")(h))


def _plain_net(x):
  return jnp.sum((jnp.sin(x) * x) ** 3)


@pytest.mark.parametrize("transform", [
    jax.grad, jax.hessian, jax.jacfwd, lambda f: jax.grad(lambda x: jax.grad(f)(x).sum()),
], ids=["grad", "hessian", "jacfwd", "grad_grad"])
def test_without_a_reap_recorded_functions_are_plain(transform):
  x = jnp.array([0.3, -1.2, 2.0])
  f = _net if transform is not jax.jacfwd else jax.grad(_net)
  plain = _plain_net if transform is not jax.jacfwd else jax.grad(_plain_net)
  assert_trees_close(transform(f)(x), transform(plain)(x), rtol=1e-5)
  np.testing.assert_allclose(
      jax.jvp(_net, (x,), (jnp.ones(3),))[1], jax.jvp(_plain_net, (x,), (jnp.ones(3),))[1],
      rtol=1e-6)


def test_without_a_reap_sites_compile_to_the_plain_program():
  x = jnp.array([0.3, -1.2, 2.0])

  def instructions(f):
    hlo = jax.jit(jax.grad(f)).lower(x).compile().as_text()
    return sorted(line.split("=")[1].split("(")[0].split()[-1]
                  for line in hlo.splitlines() if " = " in line and "ENTRY" not in line)

  plain = instructions(_plain_net)
  assert len(plain) > 5
  assert instructions(_net) == plain


def test_argnums_records_only_the_chosen_inputs(variant):
  k1, k2 = jax.random.split(KEY)
  x, w = jax.random.normal(k1, (5,)), jax.random.normal(k2, (5, 4))
  head = lambda y: jnp.sum(jnp.sin(y) ** 2)
  y, pullback = jax.vjp(_layer, x, w)
  ct_x, ct_w = pullback(jax.grad(head)(y))
  for argnums, expected in [(0, (ct_x, None)), ((1,), (None, ct_w)), (-1, (None, ct_w))]:
    layer = gl.record_vjp(_layer, name="layer", argnums=argnums)
    loss = lambda x, w, layer=layer: head(layer(x, w))
    records = variant(gl.reap, jax.grad(loss, argnums=(0, 1)))(x, w)
    assert_trees_close(records["layer"], expected)
  full = gl.record_vjp(_layer, name="layer", full=True, argnums=1)
  record = gl.reap(jax.grad(lambda w: head(full(x, w))))(w)["layer"]
  assert_trees_close(record.primals, (None, w))
  assert_trees_close(record.in_cotangents, (None, ct_w))
  with pytest.raises(ValueError, match=r"record_vjp\(name='layer', argnums=\(2,\)\): the "
                     r"function was called with 2 positional arguments"):
    gl.record_vjp(_layer, name="layer", argnums=(2,))(x, w)
