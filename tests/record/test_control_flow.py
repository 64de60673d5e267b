"""Records through scan, cond, loops, remat, stop_gradient and nested derivatives."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import assert_trees_close
from jax import lax

import oryx_gradlog as gl

KEY = jax.random.PRNGKey(2)
LAYERS, WIDTH = 3, 4


def _layer(c, w):
  return jnp.tanh(c @ w)


layer = gl.record_vjp(_layer, name="layer")


def _params():
  k1, k2 = jax.random.split(KEY)
  return (jax.random.normal(k1, (LAYERS, WIDTH, WIDTH)) / 2,
          jax.random.normal(k2, (WIDTH,)))


def _scan_loss(ws, x, step=layer):
  c, _ = lax.scan(lambda c, w: (step(c, w), None), x, ws)
  return jnp.sum(jnp.sin(c) ** 2)


def _scan_reference(ws, x):
  """Per-layer input cotangents by perturbing each iteration's inputs."""
  def perturbed(deltas):
    dc, dw = deltas
    c, _ = lax.scan(lambda c, a: (_layer(c + a[1], a[0] + a[2]), None), x, (ws, dc, dw))
    return jnp.sum(jnp.sin(c) ** 2)
  return jax.grad(perturbed)((jnp.zeros((LAYERS, WIDTH)), jnp.zeros_like(ws)))


@pytest.mark.parametrize("argnums", [0, 1, (0, 1)])
def test_scan_over_layers_stacks_iterations_in_order(variant, argnums):
  ws, x = _params()
  records = variant(gl.reap, jax.grad(_scan_loss, argnums=argnums))(ws, x)
  assert_trees_close(records["layer"], _scan_reference(ws, x))


def test_scan_under_vmap_gives_iterations_then_batch():
  ws, _ = _params()
  xs = jax.random.normal(KEY, (5, WIDTH))
  loss = lambda ws, xs: jnp.sum(jax.vmap(_scan_loss, (None, 0))(ws, xs))
  ct_c, ct_w = jax.jit(gl.reap(jax.grad(loss)))(ws, xs)["layer"]
  assert ct_c.shape == (LAYERS, 5, WIDTH)
  expected_c, expected_w = jax.vmap(_scan_reference, (None, 0))(ws, xs)
  np.testing.assert_allclose(ct_c, jnp.swapaxes(expected_c, 0, 1), rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(ct_w, expected_w.sum(0), rtol=1e-5, atol=1e-5)


def test_per_example_scan_records_with_vmap_of_grad():
  ws, _ = _params()
  xs = jax.random.normal(KEY, (5, WIDTH))
  ct_c, ct_w = gl.reap(jax.vmap(jax.grad(_scan_loss), (None, 0)))(ws, xs)["layer"]
  expected_c, expected_w = jax.vmap(_scan_reference, (None, 0))(ws, xs)
  assert ct_w.shape == (LAYERS, 5, WIDTH, WIDTH)
  np.testing.assert_allclose(ct_w, jnp.swapaxes(expected_w, 0, 1), rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(ct_c, jnp.swapaxes(expected_c, 0, 1), rtol=1e-5, atol=1e-6)


def test_scan_inside_scan():
  ws, x = _params()
  inner = lambda c, w: lax.scan(lambda c, _: (layer(c, w), None), c, None, length=2)[0]
  loss = lambda ws, x: jnp.sum(lax.scan(lambda c, w: (inner(c, w), None), x, ws)[0] ** 2)
  ct_c, ct_w = gl.reap(jax.grad(loss))(ws, x)["layer"]
  assert ct_w.shape == (LAYERS, 2, WIDTH, WIDTH)  # (outer, inner, ...)

  def perturbed(dc):
    def outer(c, a):
      w, d = a
      c, _ = lax.scan(lambda c, d: (_layer(c + d, w), None), c, d)
      return c, None
    return jnp.sum(lax.scan(outer, x, (ws, dc))[0] ** 2)
  np.testing.assert_allclose(ct_c, jax.grad(perturbed)(jnp.zeros((LAYERS, 2, WIDTH))),
                             rtol=1e-5, atol=1e-6)


def test_fori_loop_with_static_bounds_is_a_scan():
  ws, x = _params()
  loss = lambda ws, x: jnp.sum(jnp.sin(lax.fori_loop(0, LAYERS, lambda i, c: layer(c, ws[i]), x))
                               ** 2)
  records = gl.reap(jax.grad(loss))(ws, x)
  assert_trees_close(records["layer"], _scan_reference(ws, x))


def test_while_loop_gives_a_clear_error():
  # A gradient step inside a while_loop: its sites cannot be stacked over iterations.
  step = lambda w: w - 0.1 * jax.grad(lambda w: jnp.sum(gl.tap(w, name="w") ** 2))(w)
  run = lambda w, n: lax.fori_loop(0, n, lambda i, w: step(w), w)
  with pytest.raises(ValueError, match=r"reap: record 'w' is made inside lax.while_loop.*"
                     r"lax.scan or lax.fori_loop with Python int bounds"):
    jax.jit(gl.reap(run))(jnp.ones(2), 3)  # Traced bounds: a while_loop.
  # With Python int bounds it is a scan: one record per iteration.
  records = gl.reap(lambda w: lax.fori_loop(0, 3, lambda i, w: step(w), w))(jnp.ones(2))
  expected = [2 * jnp.ones(2) * 0.8 ** i for i in range(3)]
  np.testing.assert_allclose(records["w"], jnp.stack(expected), rtol=1e-6)


@pytest.mark.parametrize("positive", [True, False])
def test_cond_records_zeros_for_the_branch_not_taken(variant, positive):
  x = jnp.arange(1.0, 4.0) * (1 if positive else -1)

  def loss(x):
    return lax.cond(x.sum() > 0,
                    lambda x: jnp.sum(jnp.sin(gl.tap(x * 2, name="taken")) ** 2),
                    lambda x: jnp.sum(x ** 3), x)

  records = variant(gl.reap, jax.grad(loss))(x)
  expected = (jax.grad(lambda d: jnp.sum(jnp.sin(x * 2 + d) ** 2))(jnp.zeros(3))
              if positive else jnp.zeros(3))
  np.testing.assert_allclose(records["taken"], expected, rtol=1e-6)


def test_switch_with_sites_in_different_branches():
  x = jnp.arange(1.0, 4.0)
  branches = [lambda x: jnp.sum(gl.tap(x, name="a") ** 2),
              lambda x: jnp.sum(gl.tap(x, name="b") ** 3),
              lambda x: jnp.sum(x)]
  loss = lambda i, x: lax.switch(i, branches, x)
  for index in range(3):
    records = jax.jit(gl.reap(jax.grad(loss, argnums=1)))(index, x)
    np.testing.assert_allclose(records["a"], 2 * x if index == 0 else 0 * x)
    np.testing.assert_allclose(records["b"], 3 * x ** 2 if index == 1 else 0 * x)


@pytest.mark.parametrize("policy", [
    None, jax.checkpoint_policies.nothing_saveable, jax.checkpoint_policies.everything_saveable,
    jax.checkpoint_policies.dots_saveable,
], ids=["default", "nothing", "everything", "dots"])
def test_remat_with_any_policy_and_inside_scan(policy):
  ws, x = _params()
  step = jax.checkpoint(layer, policy=policy)
  records = jax.jit(gl.reap(jax.grad(lambda ws, x: _scan_loss(ws, x, step))))(ws, x)
  assert_trees_close(records["layer"], _scan_reference(ws, x))
  # And a remat'd block outside a scan.
  loss = lambda w, x: jnp.sum(jax.checkpoint(lambda x: layer(layer(x, w), w), policy=policy)(x))
  w = ws[0]
  records = gl.reap(jax.grad(loss))(w, x)
  def perturbed(d):
    return jnp.sum(_layer(_layer(x + d[0][0], w + d[0][1]) + d[1][0], w + d[1][1]))
  zeros = [(jnp.zeros_like(x), jnp.zeros_like(w))] * 2
  expected = jax.tree.map(lambda *a: jnp.stack(a), *jax.grad(perturbed)(zeros))
  assert_trees_close(records["layer"], expected)


def test_stop_gradient_records_zeros_and_straight_through_records_the_flow():
  x = jnp.array([0.2, 1.7, -2.4])

  # The guide's straight-through estimator.
  def straight_through_f(x):
    zero = x - lax.stop_gradient(x)
    return zero + lax.stop_gradient(jnp.round(x))

  def loss(x):
    pre = gl.tap(1.5 * x, name="pre")  # The STE passes the cotangent through to here.
    q = gl.tap(straight_through_f(pre), name="ste")
    stopped = lax.stop_gradient(gl.tap(jnp.sin(x), name="stopped"))
    return jnp.sum(q ** 2 * stopped)

  grads, records = gl.call_and_reap(jax.grad(loss))(x)
  # True computation: perturb pre and q; the stopped site has no cotangent at all.
  def perturbed(x, d_pre, d_q):
    q = straight_through_f(1.5 * x + d_pre) + d_q
    return jnp.sum(q ** 2 * lax.stop_gradient(jnp.sin(x)))
  expected_pre, expected_q = jax.grad(perturbed, (1, 2))(x, jnp.zeros(3), jnp.zeros(3))
  np.testing.assert_allclose(records["ste"], expected_q, rtol=1e-6)
  np.testing.assert_allclose(records["pre"], expected_pre, rtol=1e-6)
  np.testing.assert_allclose(records["pre"], records["ste"], rtol=1e-6)  # Straight through.
  np.testing.assert_array_equal(records["stopped"], jnp.zeros(3))
  np.testing.assert_allclose(grads, jax.grad(perturbed)(x, 0.0, 0.0), rtol=1e-6)


def test_grad_of_grad_and_hessian_record_the_first_backward_pass():
  x = jnp.array([0.3, -1.2, 2.0])
  f = lambda x: jnp.sum(gl.tap(jnp.sin(x), name="y") ** 3)
  plain = lambda x: jnp.sum(jnp.sin(x) ** 3)
  first_order = 3 * jnp.sin(x) ** 2  # dL/dy

  grads, records = gl.call_and_reap(jax.grad(lambda x: jnp.sum(jax.grad(f)(x))))(x)
  np.testing.assert_allclose(grads, jax.grad(lambda x: jnp.sum(jax.grad(plain)(x)))(x),
                             rtol=1e-5)
  np.testing.assert_allclose(records["y"], first_order, rtol=1e-5)

  hessian, records = gl.call_and_reap(jax.hessian(f))(x)
  np.testing.assert_allclose(hessian, jax.hessian(plain)(x), rtol=1e-5, atol=1e-6)
  # jacrev vmaps the backward pass over the (here one) output: a leading axis of 1.
  np.testing.assert_allclose(records["y"], first_order[None], rtol=1e-5)

  # Forward mode alone makes no backward pass: the site has zeros.
  out, records = gl.call_and_reap(lambda x: jax.jvp(f, (x,), (jnp.ones(3),)))(x)
  np.testing.assert_allclose(out[1], jax.jvp(plain, (x,), (jnp.ones(3),))[1], rtol=1e-6)
  np.testing.assert_array_equal(records["y"], jnp.zeros(3))


def test_maml_inner_and_outer_records_are_kept_apart():
  # The guide's MAML: the loss after one SGD step, differentiated.
  lr = 0.1
  x = jnp.array([0.5, -1.0])

  def loss_fn(params, x):
    return jnp.sum(gl.tap(jnp.tanh(params * x), name="h") ** 2)

  def meta_loss_fn(params, x):
    grads = jax.grad(loss_fn)(params, x)
    return loss_fn(params - lr * grads, x)

  params = jnp.array([0.3, 0.8])
  meta_grads, records = gl.call_and_reap(jax.grad(meta_loss_fn))(params, x)
  plain = lambda p, x: jnp.sum(jnp.tanh(p * x) ** 2)
  plain_meta = lambda p, x: plain(p - lr * jax.grad(plain)(p, x), x)
  np.testing.assert_allclose(meta_grads, jax.grad(plain_meta)(params, x), rtol=1e-5)

  # Two calls of "h", in forward order: the inner step's, then the outer loss's.
  inner_ct = 2 * jnp.tanh(params * x)
  adapted = params - lr * jax.grad(plain)(params, x)
  outer_ct = 2 * jnp.tanh(adapted * x)
  assert records["h"].shape == (2, 2)
  np.testing.assert_allclose(records["h"][0], inner_ct, rtol=1e-5)
  np.testing.assert_allclose(records["h"][1], outer_ct, rtol=1e-5)

  # Reaping the inner gradient separately keeps its records in their own dict.
  def meta_loss_with_inner(params, x):
    grads, inner = gl.call_and_reap(jax.grad(loss_fn))(params, x)
    return loss_fn(params - lr * grads, x), inner

  (_, inner), outer = gl.call_and_reap(jax.grad(meta_loss_with_inner, has_aux=True))(params, x)
  np.testing.assert_allclose(inner["h"], inner_ct, rtol=1e-5)
  np.testing.assert_allclose(outer["h"], outer_ct, rtol=1e-5)
