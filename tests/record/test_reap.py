"""`reap` and `call_and_reap`: naming repeated calls, vmap, jit, residency, errors."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import assert_trees_close

import oryx_gradlog as gl

KEY = jax.random.PRNGKey(1)


def _mvm(x, w):
  return x @ w


mvm = gl.record_vjp(_mvm, name="mvm")


def _two_calls(x, w, target, deltas=None):
  """The seed's run_nn: the same MVM twice. `deltas` perturb each call's inputs."""
  d = deltas or [(0.0, 0.0), (0.0, 0.0)]
  f = _mvm if deltas else mvm
  out = jnp.tanh(f(x + d[0][0], w + d[0][1]))
  out = f(out + d[1][0], w + d[1][1])
  return jnp.sum((out - target) ** 2)


def _zeros_like_calls(x, w):
  return [(jnp.zeros_like(x), jnp.zeros_like(w))] * 2


def _data(batch=None):
  k1, k2, k3 = jax.random.split(KEY, 3)
  lead = () if batch is None else (batch,)
  return (jax.random.normal(k1, lead + (4,)), jax.random.normal(k2, (4, 4)),
          jax.random.normal(k3, lead + (4,)))


def test_repeated_calls_stack_in_forward_order(variant):
  x, w, t = _data()
  # True computation: perturb each call's inputs separately.
  expected = jax.grad(lambda d: _two_calls(x, w, t, d))(_zeros_like_calls(x, w))
  records = variant(gl.reap, jax.grad(_two_calls))(x, w, t)
  ct_x, ct_w = records["mvm"]
  assert ct_x.shape == (2, 4) and ct_w.shape == (2, 4, 4)
  for call in range(2):
    assert_trees_close((ct_x[call], ct_w[call]), expected[call])


def test_records_under_vmap_inside_grad_are_per_example_for_batched_values(variant):
  x, w, t = _data(batch=6)
  batch_loss = lambda w, x, t: jnp.sum(jax.vmap(_two_calls, (0, None, 0))(x, w, t))
  # True computation: per example, perturb each call (jax.vmap(jax.grad(...))).
  expected = jax.vmap(
      lambda x, t: jax.grad(lambda d: _two_calls(x, w, t, d))(_zeros_like_calls(x, w))
  )(x, t)
  grads, records = variant(gl.call_and_reap, jax.grad(batch_loss))(w, x, t)
  ct_x, ct_w = records["mvm"]
  # x is batched: (call, batch, ...). w is shared by the batch (in_axes=None), and the
  # backward pass of grad(vmap(f)) only ever forms its cotangent summed over the batch.
  assert ct_x.shape == (2, 6, 4) and ct_w.shape == (2, 4, 4)
  for call in range(2):
    assert_trees_close(ct_x[call], expected[call][0])
    assert_trees_close(ct_w[call], expected[call][1].sum(0), rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(grads, jax.grad(batch_loss)(w, x, t), rtol=1e-5)


def test_vmap_of_grad_in_jit_gives_per_example_records():
  # vmap over grad (rather than grad of a vmapped loss), as jit(vmap(grad)).
  x, w, t = _data(batch=5)
  expected = jax.vmap(
      lambda x, t: jax.grad(lambda d: _two_calls(x, w, t, d))(_zeros_like_calls(x, w))
  )(x, t)
  perex = jax.jit(gl.reap(jax.vmap(jax.grad(_two_calls), in_axes=(0, None, 0))))
  ct_x, ct_w = perex(x, w, t)["mvm"]
  assert ct_w.shape == (2, 5, 4, 4)
  for call in range(2):
    assert_trees_close((ct_x[call], ct_w[call]), expected[call])


def test_batch_axis_moves_to_front_for_other_in_axes():
  x = jax.random.normal(KEY, (3, 5))  # Examples along axis 1.
  loss = lambda x: jnp.sum(jax.vmap(lambda r: jnp.sum(gl.tap(jnp.sin(r), name="v") ** 2),
                                    in_axes=1)(x))
  record = gl.reap(jax.grad(loss))(x)["v"]
  expected = jax.vmap(jax.grad(lambda r: jnp.sum(r ** 2)), in_axes=1)(jnp.sin(x))
  assert record.shape == (5, 3)
  np.testing.assert_allclose(record, expected, rtol=1e-6)


def test_advanced_autodiff_guide_td_loss_per_example():
  # The guide's TD(0) example, with the value function recorded.
  value_fn = gl.record_vjp(lambda theta, state: jnp.dot(theta, state), name="value")
  plain_value_fn = lambda theta, state: jnp.dot(theta, state)

  def td_loss(theta, s_tm1, r_t, s_t, v=value_fn):
    v_tm1 = v(theta, s_tm1)
    target = r_t + v(theta, s_t)
    return (jax.lax.stop_gradient(target) - v_tm1) ** 2

  theta = jnp.array([0.1, -0.1, 0.0])
  s_tm1, r_t, s_t = jnp.array([1.0, 2.0, -1.0]), jnp.array(1.0), jnp.array([2.0, 1.0, 0.0])
  batched = [jnp.stack([a, 2 * a]) for a in (s_tm1, r_t, s_t)]

  perex_grads = jax.jit(jax.vmap(jax.grad(td_loss), in_axes=(None, 0, 0, 0)))
  grads, records = jax.jit(gl.call_and_reap(
      jax.vmap(jax.grad(td_loss), in_axes=(None, 0, 0, 0))))(theta, *batched)
  # Gradients are those of the guide; records of value_fn's two calls per example.
  np.testing.assert_allclose(grads, perex_grads(theta, *batched), rtol=1e-6)
  ct_theta, _ = records["value"]
  assert ct_theta.shape == (2, 2, 3)  # (call, example, theta)
  # Call 0 (v_tm1) gets the TD error's cotangent; call 1 (the target) is stopped: zeros.
  delta = jax.vmap(lambda s1, r, s: r + plain_value_fn(theta, s) - plain_value_fn(theta, s1))(
      *batched)
  np.testing.assert_allclose(ct_theta[0], (-2 * delta)[:, None] * batched[0], rtol=1e-5)
  np.testing.assert_allclose(ct_theta[0], perex_grads(theta, *batched), rtol=1e-5)
  np.testing.assert_array_equal(ct_theta[1], 0.0)


def test_jit_outside_and_inside_give_identical_records():
  x, w, t = _data(batch=3)
  loss = lambda w, x, t: jnp.sum(jax.vmap(_two_calls, (0, None, 0))(x, w, t))
  eager = gl.reap(jax.grad(loss))(w, x, t)
  outside = jax.jit(gl.reap(jax.grad(loss)))(w, x, t)
  inside = gl.reap(jax.jit(jax.grad(loss)))(w, x, t)
  assert_trees_close(outside, inside, rtol=0, atol=0)
  assert_trees_close(outside, eager)


def test_no_retrace_on_second_call():
  traces = []

  def loss(w, x):
    traces.append(None)
    return jnp.sum(mvm(x, w) ** 2)

  step = jax.jit(gl.call_and_reap(jax.grad(loss)))
  x, w, _ = _data()
  step(w, x)
  step(w + 1.0, x * 2.0)
  assert len(traces) == 1


def test_records_stay_on_the_device():
  x, w, t = _data(batch=3)
  loss = lambda w, x, t: jnp.sum(jax.vmap(_two_calls, (0, None, 0))(x, w, t))
  step = jax.jit(gl.call_and_reap(jax.grad(loss)))
  device = jax.devices()[0]
  with jax.transfer_guard_device_to_host("disallow"):
    grads, records = step(w, x, t)
    leaves = jax.tree.leaves((grads, records))
    assert leaves and all(isinstance(leaf, jax.Array) for leaf in leaves)
    assert all(leaf.devices() == {device} for leaf in leaves)
  lowered = step.lower(w, x, t).as_text()
  assert "callback" not in lowered and "custom_call" not in lowered


def test_function_without_sites_reaps_empty_dict():
  assert gl.reap(jax.grad(lambda x: jnp.sum(x ** 2)))(jnp.ones(2)) == {}
  out, records = gl.call_and_reap(lambda x: x + 1)(1.0)
  assert out == 2.0 and records == {}


BODIES = {
    "plain": lambda f: f,
    "jit_body": jax.jit,
    "scan_body": lambda f: lambda x: jnp.sum(jax.lax.scan(lambda c, _: (c, f(x)), 0.0, None,
                                                          length=2)[1]),
    "cond_branch": lambda f: lambda x: jax.lax.cond(x[0] > 0, f, jnp.sum, x),
}


@pytest.mark.parametrize("body", BODIES.values(), ids=BODIES.keys())
def test_a_reap_that_sees_only_other_tags_names_them(variant, body):
  loss = body(lambda x: jnp.sum(gl.tap(jnp.sin(x), name="h", tag="mine") ** 2))
  x = jnp.array([1.0, 2.0])
  with pytest.raises(ValueError, match=r"reap\(tag='vjp'\): the function traced record sites "
                     r"of tag 'mine' but none of tag 'vjp'.*Pass tag='mine' to reap"):
    variant(gl.reap, jax.grad(loss))(x)
  # With the right tag: the records, against the perturbation trick.
  records = variant(lambda f: gl.reap(f, tag="mine"), jax.grad(loss))(x)
  expected = jax.grad(lambda h: jnp.sum(h ** 2))(jnp.sin(x))  # dL/dh in each body.
  h = records["h"][0] if body is BODIES["scan_body"] else records["h"]
  np.testing.assert_allclose(h, expected, rtol=1e-6)


def test_calls_that_cannot_be_stacked_raise_naming_the_record():
  x, w, _ = _data()
  loss = lambda x, w: jnp.sum(mvm(mvm(x, w), w[:, :2]))
  with pytest.raises(ValueError, match=r"reap: record 'mvm' was made by 2 calls.*cannot be "
                     r"stacked.*name='mvm_1'"):
    gl.reap(jax.grad(loss))(x, w)


def test_value_and_grad_with_aux_vjp_and_argnums():
  x, w, t = _data()
  expected = jax.grad(lambda d: _two_calls(x, w, t, d))(_zeros_like_calls(x, w))
  expected = jax.tree.map(lambda *a: jnp.stack(a), *expected)

  aux_loss = lambda x, w, t: (_two_calls(x, w, t), {"norm": jnp.linalg.norm(w)})
  ((value, aux), grads), records = gl.call_and_reap(
      jax.value_and_grad(aux_loss, argnums=(0, 1), has_aux=True))(x, w, t)
  np.testing.assert_allclose(value, _two_calls(x, w, t), rtol=1e-6)
  np.testing.assert_allclose(aux["norm"], jnp.linalg.norm(w), rtol=1e-6)
  assert_trees_close(grads, jax.grad(_two_calls, argnums=(0, 1))(x, w, t))
  assert_trees_close(records["mvm"], expected)

  # The pullback of jax.vjp, reaped on its own.
  _, pullback = jax.vjp(_two_calls, x, w, t)
  assert_trees_close(gl.reap(pullback)(1.0)["mvm"], expected)

  # argnums that reach the sites through w only: the same records.
  assert_trees_close(gl.reap(jax.grad(_two_calls, argnums=(1, 2)))(x, w, t)["mvm"], expected)
  # Only the target differentiated: no tangent reaches the sites, so no records.
  assert gl.reap(jax.grad(_two_calls, argnums=2))(x, w, t) == {}


def test_keyword_arguments_to_the_reaped_function():
  x, w, t = _data()
  loss = lambda w, *, x, t: _two_calls(x, w, t)
  records = gl.reap(jax.grad(loss))(w, x=x, t=t)
  assert records["mvm"][1].shape == (2, 4, 4)


def test_tags_separate_records_and_nested_reaps_keep_them_apart():
  x = jnp.arange(3.0)

  def inner_loss(x):
    return jnp.sum(gl.tap(jnp.sin(x), name="h") ** 2)

  def loss(x):
    g, inner = gl.call_and_reap(jax.grad(inner_loss))(x)
    return jnp.sum(gl.tap(g, name="g", tag="other") ** 2), inner

  (_, inner), outer = gl.call_and_reap(jax.grad(loss, has_aux=True), tag="other")(x)
  expected_h = jax.grad(lambda d: jnp.sum((jnp.sin(x) + d) ** 2))(jnp.zeros(3))
  np.testing.assert_allclose(inner["h"], expected_h, rtol=1e-6)
  g = jax.grad(inner_loss)(x)
  np.testing.assert_allclose(outer["g"], 2 * g, rtol=1e-6)
  assert list(outer) == ["g"]


def test_a_jitted_function_called_twice_is_recorded_twice():
  layer = jax.jit(gl.record_vjp(jnp.sin, name="s"))
  loss = lambda x: jnp.sum(layer(layer(x)) ** 2)
  x = jnp.array([0.1, 0.7])
  records = gl.reap(jax.grad(loss))(x)
  # JAX reuses one trace of `layer` for both calls; both are recorded, in order.
  def perturbed(d):
    return jnp.sum(jnp.sin(jnp.sin(x + d[0]) + d[1]) ** 2)
  np.testing.assert_allclose(records["s"][0], jax.grad(perturbed)(jnp.zeros((2, 2))), rtol=1e-6)


def test_an_error_inside_oryx_leaves_jax_usable():
  import gc

  from jax._src import core

  layer = jax.jit(gl.record_vjp(jnp.sin, name="s"))
  loss = lambda x: jnp.sum(layer(layer(x)) ** 2)
  # Inside an outer jit, Oryx cannot reap the reused trace twice: a clear error...
  with pytest.raises(ValueError, match=r"reap: record 's' comes from a function that JAX "
                     r"traced once and called several times") as info:
    gl.reap(jax.jit(jax.grad(loss)))(jnp.ones(2))
  del info
  gc.collect()
  # ...after which JAX still works (no stale trace left behind by Oryx's generators).
  assert type(core.trace_ctx.trace).__name__ == "EvalTrace"
  assert gl.reap(jax.grad(lambda x: jnp.sum(gl.tap(x, name="h") ** 2)))(jnp.ones(2))["h"].sum() == 4
