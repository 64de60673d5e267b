"""Training instruments against plain JAX: vmap(grad), eigh of jax.hessian, a quadratic."""

import functools

import jax
import jax.flatten_util
import jax.numpy as jnp
import numpy as np
import pytest

import oryx_gradlog as gl

VARIANTS = {"eager": lambda f: f, "jit": jax.jit}
B = 6


def _model(reduction):
  keys = jax.random.split(jax.random.PRNGKey(0), 4)
  params = {"w1": jax.random.normal(keys[0], (3, 4)), "b1": 0.1 * jnp.ones(4),
            "w2": jax.random.normal(keys[1], (4, 2)), "b2": jnp.zeros(2)}
  x = jax.random.normal(keys[2], (B, 3))
  y = jax.random.normal(keys[3], (B, 2))

  def losses(p, x, y, dense):
    h = jnp.tanh(dense(x, p["w1"], p["b1"], name="fc1"))
    return jnp.sum((dense(h, p["w2"], p["b2"], name="fc2") - y) ** 2, -1)

  reduce = jnp.mean if reduction == "mean" else jnp.sum
  marked = lambda p, x, y: reduce(losses(p, x, y, gl.dense))
  plain_dense = lambda x, w, b, name: x @ w + b
  plain = lambda p, x, y: jnp.sum(losses(p, x[None], y[None], plain_dense))
  return params, x, y, marked, plain


def _per_example(plain, params, x, y):
  grads = jax.vmap(jax.grad(plain), in_axes=(None, 0, 0))(params, x, y)
  return grads, jnp.concatenate([g.reshape(B, -1) for g in jax.tree.leaves(grads)], 1)


# "gram": per-example inner products from Gram matrices; "materialized": from a jvp.
METHODS = ["auto", "gram", "materialized"]


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("wrap", VARIANTS.values(), ids=VARIANTS.keys())
def test_batch_size_tests_match_vmap_grad(wrap, reduction, method):
  params, x, y, marked, plain = _model(reduction)
  # True computation: per-example gradients from vmap(grad).
  _, g = _per_example(plain, params, x, y)
  gbar = g.mean(0)
  gsq, pairs = gbar @ gbar, B * (B - 1)
  products = g @ gbar
  norm = jnp.sqrt(jnp.sum((g - gbar) ** 2) / pairs) / jnp.sqrt(gsq)
  inner = jnp.sqrt(jnp.sum((products - gsq) ** 2) / pairs) / gsq
  ortho = jnp.sqrt(jnp.sum((g - jnp.outer(products / gsq, gbar)) ** 2) / pairs) / jnp.sqrt(gsq)
  # Library computation.
  tests = wrap(lambda p: gl.batch_size_tests(gl.reap(jax.grad(marked))(p, x, y),
                                             reduction=reduction, method=method))(params)
  # Comparison.
  np.testing.assert_allclose(tests.norm_test, norm, rtol=1e-4)
  np.testing.assert_allclose(tests.inner_product_test, inner, rtol=1e-4)
  np.testing.assert_allclose(tests.orthogonality_test, ortho, rtol=1e-4)
  np.testing.assert_allclose(tests.grad_norm, jnp.sqrt(gsq), rtol=1e-5)
  assert tests.batch_size == B


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_gradient_snr_matches_vmap_grad(reduction):
  params, x, y, marked, plain = _model(reduction)
  grads, _ = _per_example(plain, params, x, y)
  snr = gl.gradient_snr(gl.reap(jax.grad(marked))(params, x, y), reduction=reduction)
  expected = jax.tree.map(lambda g: g.mean(0) ** 2 / g.var(0), grads)
  for i in (1, 2):
    np.testing.assert_allclose(snr.layers[f"fc{i}"].w, expected[f"w{i}"], rtol=2e-3)
    np.testing.assert_allclose(snr.layers[f"fc{i}"].b, expected[f"b{i}"], rtol=2e-3)
  means = [jnp.concatenate([expected[f"w{i}"].ravel(), expected[f"b{i}"]]).mean()
           for i in (1, 2)]
  np.testing.assert_allclose(snr.mean, np.mean(means), rtol=2e-3)


def test_batch_of_one_is_an_error():
  params, x, y, marked, _ = _model("mean")
  with pytest.raises(ValueError, match="batch size of at least 2"):
    gl.batch_size_tests(gl.reap(jax.grad(marked))(params, x[:1], y[:1]))


def test_curvature_matches_eigh_and_trace_of_the_dense_hessian():
  params, x, y, _, plain = _model("mean")
  loss = lambda p: jnp.mean(jax.vmap(plain, in_axes=(None, 0, 0))(p, x, y))
  flat, unravel = jax.flatten_util.ravel_pytree(params)
  hessian = jax.hessian(lambda v: loss(unravel(v)))(flat)
  eigenvalues = jnp.linalg.eigh(hessian)[0]
  top = eigenvalues[jnp.argmax(jnp.abs(eigenvalues))]
  value = jax.jit(lambda p: gl.hessian_max_eigenvalue(
      lambda p, x: loss(p), p, x, key=jax.random.PRNGKey(1), num_products=200))(params)
  np.testing.assert_allclose(value, top, rtol=1e-3)
  n = 4000
  trace = gl.hessian_trace(loss, params, key=jax.random.PRNGKey(2), num_products=n)
  off = hessian - jnp.diag(jnp.diag(hessian))
  std = jnp.sqrt(2 * jnp.sum(off ** 2) / n)  # Hutchinson's standard deviation.
  assert abs(float(trace - jnp.trace(hessian))) < 5 * float(std)
  with pytest.raises(ValueError, match="num_products must be a positive integer"):
    gl.hessian_trace(loss, params, key=jax.random.PRNGKey(0), num_products=0)


def test_alpha_on_a_quadratic_matches_its_definition():
  a = jnp.array([[3.0, 1.0], [1.0, 2.0]])
  f = lambda w: 0.5 * w @ a @ w + jnp.array([1.0, -1.0]) @ w
  w0 = jnp.array([1.0, 2.0])
  for lr in (0.05, 0.2, 0.3, 0.5):
    d = -lr * jax.grad(f)(w0)
    # True computation: the minimum of f(w0 + t d) is at t* = -<grad, d> / d^T H d.
    t_star = -(jax.grad(f)(w0) @ d) / (d @ jax.hessian(f)(w0) @ d)
    expected = 1 / t_star - 1
    alpha = gl.step_alpha(f(w0), jax.grad(f)(w0) @ d, f(w0 + d), jax.grad(f)(w0 + d) @ d)
    np.testing.assert_allclose(alpha, expected, rtol=1e-4, atol=1e-5)
  assert jnp.isnan(gl.step_alpha(0.0, -1.0, -2.0, -3.0))  # concave: no minimum


def test_training_instruments_economy_in_a_jitted_loop():
  x = jnp.array([[1.0, 0.0], [0.0, 2.0], [2.0, 0.0]])  # Hessian diag(5, 4) / 3
  marked = lambda w: jnp.mean(0.5 * jnp.sum(gl.dense(x, w, name="fc") ** 2, -1))
  plain = lambda w: jnp.mean(0.5 * jnp.sum((x @ w) ** 2, -1))
  w0 = jnp.array([[1.0], [1.0]])
  instruments = gl.training_instruments("full", curvature_every=2, num_products=50)
  state = instruments.init(w0)

  @jax.jit
  def step(state, w):
    (value, grads), records = gl.call_and_reap(jax.value_and_grad(marked))(w)
    updates = -0.3 * grads
    readings, state = instruments.update(state, records, loss=value, grads=grads, params=w,
                                         updates=updates, hessian_loss=plain)
    return readings, state, w + updates

  w = w0
  history = []
  for _ in range(3):
    before = w
    readings, state, w = step(state, w)
    history.append((before, readings))
  hessian = jax.hessian(lambda v: plain(v.reshape(2, 1)))(w0.ravel())
  assert len(readings) == 11 and step._cache_size() == 1  # no retrace
  np.testing.assert_allclose(readings["hessian_trace"], jnp.trace(hessian), rtol=1e-4)
  np.testing.assert_allclose(readings["hessian_max_eigenvalue"],
                             jnp.linalg.eigh(hessian)[0][-1], rtol=1e-4)
  # alpha at step 2 is that of step 1's update, by its definition on this quadratic.
  w1, w2 = history[1][0], history[2][0]
  d = (w2 - w1).ravel()
  g1 = jax.grad(plain)(w1).ravel()
  expected = -(d @ hessian @ d) / (g1 @ d) - 1
  np.testing.assert_allclose(history[2][1]["alpha"], expected, rtol=1e-4)
  assert jnp.isnan(history[0][1]["alpha"])
  np.testing.assert_allclose(readings["distance"], jnp.linalg.norm(w2 - w0), rtol=1e-5)
  np.testing.assert_allclose(readings["update_size"], jnp.linalg.norm(w - w2), rtol=1e-5)
  np.testing.assert_allclose(readings["grad_norm"], jnp.linalg.norm(jax.grad(plain)(w2)),
                             rtol=1e-5)
  np.testing.assert_allclose(readings["loss"], plain(w2), rtol=1e-6)


@pytest.mark.parametrize("schedule", ["traced", "static"])
def test_every_k_steps_reads_the_instruments_on_read_steps_only(schedule):
  x = jnp.array([[1.0, 0.0], [0.0, 2.0], [2.0, 0.0]])  # Hessian diag(5, 4) / 3
  marked = lambda w: jnp.mean(0.5 * jnp.sum(gl.dense(x, w, name="fc") ** 2, -1))
  plain = lambda w: jnp.mean(0.5 * jnp.sum((x @ w) ** 2, -1))
  hessian = jax.hessian(lambda v: plain(v.reshape(2, 1)))(jnp.ones(2))
  w0 = jnp.array([[1.0], [0.5]])
  instruments = gl.training_instruments("economy", every=3)

  @functools.partial(jax.jit, static_argnames="phase")
  def step(state, w, phase=None):
    (value, grads), records = gl.call_and_reap(jax.value_and_grad(marked))(w)
    updates = -0.3 * grads
    readings, state = instruments.update(state, records, loss=value, grads=grads, params=w,
                                         updates=updates, phase=phase)
    return readings, state, w + updates

  state, ws, history = instruments.init(w0), [w0], []
  for t in range(7):
    phase = instruments.phase(t) if schedule == "static" else None
    readings, state, w = step(state, ws[-1], phase=phase)
    ws.append(w)
    history.append(readings)
  # One program (traced schedule), or one per phase: read, skip, start.
  assert step._cache_size() == (1 if schedule == "traced" else 3)
  assert [instruments.phase(t) for t in range(7)] == [
      "read", "skip", "start", "read", "skip", "start", "read"]
  for t, readings in enumerate(history):
    if t % 3:  # Between read steps: NaN.
      assert all(jnp.isnan(v) for v in readings.values()), (t, readings)
      continue
    # Read steps, by definition in plain JAX.
    w, grad = ws[t], jax.grad(plain)(ws[t])
    np.testing.assert_allclose(readings["loss"], plain(w), rtol=1e-6)
    np.testing.assert_allclose(readings["grad_norm"], jnp.linalg.norm(grad), rtol=1e-5)
    np.testing.assert_allclose(readings["update_size"], jnp.linalg.norm(0.3 * grad), rtol=1e-5)
    np.testing.assert_allclose(readings["distance"], jnp.linalg.norm(w - w0), rtol=1e-5,
                               atol=1e-7)
    if t == 0:
      assert jnp.isnan(readings["alpha"])
      continue
    # alpha of the update from step t - 1 to t, on this quadratic.
    d = (ws[t] - ws[t - 1]).ravel()
    g = jax.grad(plain)(ws[t - 1]).ravel()
    np.testing.assert_allclose(readings["alpha"], -(d @ hessian @ d) / (g @ d) - 1,
                               rtol=1e-4)


def test_presets_and_bad_arguments():
  assert set(gl.training_instruments("economy").init(jnp.ones(1)).curvature) == set()
  with pytest.raises(ValueError, match="the presets are"):
    gl.training_instruments("first class")
  with pytest.raises(ValueError, match="is not an instrument"):
    gl.training_instruments(("norm_test", "tic"))
  for bad in (0, 1.5, True):
    with pytest.raises(ValueError, match=r"every=.*positive integer"):
      gl.training_instruments("economy", every=bad)
  instruments = gl.training_instruments("business")
  marked = lambda w: jnp.mean(gl.dense(jnp.ones((2, 1)), w, name="fc") ** 2)
  (value, grads), records = gl.call_and_reap(jax.value_and_grad(marked))(jnp.ones((1, 1)))
  with pytest.raises(ValueError, match="need hessian_loss"):
    instruments.update(instruments.init(jnp.ones((1, 1))), records, loss=value, grads=grads,
                       params=jnp.ones((1, 1)), updates=grads)
  with pytest.raises(ValueError, match=r"phase='sometimes'.*instruments.phase\(step\)"):
    instruments.update(instruments.init(jnp.ones((1, 1))), records, loss=value, grads=grads,
                       params=jnp.ones((1, 1)), updates=grads, hessian_loss=lambda w: 0.0,
                       phase="sometimes")


def test_report_draws_the_dashboard_from_logged_readings(tmp_path):
  pytest.importorskip("matplotlib")
  pytest.importorskip("zarr")
  readings = {"norm_test": jnp.float32(0.5), "alpha": jnp.float32(jnp.nan),
              "hessian_trace": jnp.float32(2.0)}
  with gl.RunLog(tmp_path / "run") as log:
    for step in range(4):  # Step 3 is not a read step (`every`): NaN.
      norm_test = jnp.float32(step if step < 3 else jnp.nan)
      log.append(step, {"instruments": {**readings, "norm_test": norm_test}})
  page = gl.report(tmp_path / "run", progress=False)
  assert page.endswith("dashboard.html")
  text = open(page, encoding="utf-8").read()
  # The table shows each instrument's last finite reading: norm_test 2 from step 2.
  assert "<tr><td>norm_test</td><td>2</td></tr>" in text
  assert "<tr><td>hessian_trace</td><td>2</td></tr>" in text
  assert "<tr><td>alpha</td><td>nan</td></tr>" in text
  assert (tmp_path / "run" / "report" / "instruments.png").exists()


def test_the_state_survives_a_step_that_donates_params_and_state():
  instruments = gl.training_instruments("economy")
  marked = lambda w: jnp.mean(gl.dense(jnp.array([[1.0], [3.0]]), w, name="fc") ** 2)
  w = jnp.ones((1, 1))
  state = instruments.init(w)

  @functools.partial(jax.jit, donate_argnums=(0, 1))
  def step(w, state):
    (value, grads), records = gl.call_and_reap(jax.value_and_grad(marked))(w)
    readings, state = instruments.update(state, records, loss=value, grads=grads, params=w,
                                         updates=-0.05 * grads)
    return w - 0.05 * grads, state, readings

  for _ in range(3):
    w, state, readings = step(w, state)
  # f(w) = 5 w^2 from w0 = 1 with steps of 0.5 w: w = 0.5^k, distance 1 - 0.25.
  np.testing.assert_allclose(readings["distance"], 0.75, rtol=1e-6)


def _every_layer_kind(p, ids, img, y):
  """Embedding (repeated ids), layer norm, grouped strided conv2d, a dense layer applied
  twice (tied), a scan over stacked dense layers, and a flax-style dot_general."""
  e = gl.layer_norm(gl.embed(ids, p["emb"], name="emb"), p["ln_s"], p["ln_b"], name="ln")
  c = gl.conv2d(img, p["cw"], p["cb"], name="conv", window_strides=(2, 1),
                feature_group_count=2)
  h = jnp.mean(e, 1) + jnp.mean(c, (1, 2))
  for _ in range(2):
    h = jnp.tanh(gl.dense(h, p["tw"], p["tb"], name="tied"))
  h, _ = jax.lax.scan(lambda h, w: (jnp.tanh(gl.dense(h, w, name="stack")), None), h, p["sw"])
  dot = gl.dense_dot_general(name="dg")
  out = dot(h, p["dw"], (((1,), (0,)), ((), ()))) + p["db"]
  return jnp.sum((out - y) ** 2, -1)


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("wrap", VARIANTS.values(), ids=VARIANTS.keys())
def test_batch_size_tests_on_every_layer_kind_match_vmap_grad(wrap, method):
  keys = iter(jax.random.split(jax.random.PRNGKey(3), 16))
  normal = lambda shape: jax.random.normal(next(keys), shape)
  p = {"emb": normal((7, 4)), "ln_s": normal((4,)), "ln_b": normal((4,)),
       "cw": normal((3, 3, 1, 4)), "cb": normal((4,)), "tw": normal((4, 4)) / 2,
       "tb": normal((4,)), "sw": normal((3, 4, 4)) / 2, "dw": normal((4, 3)),
       "db": normal((3,))}
  ids = jnp.array([[1, 1, 2], [3, 4, 3], [0, 6, 6], [5, 5, 5], [2, 1, 0]])
  img, y = normal((5, 6, 5, 2)), normal((5, 3))
  # True computation: per-example gradients from vmap(grad).
  one = lambda p, ids, img, y: _every_layer_kind(p, ids[None], img[None], y[None])[0]
  grads = jax.vmap(jax.grad(one), in_axes=(None, 0, 0, 0))(p, ids, img, y)
  g = jnp.concatenate([v.reshape(5, -1) for v in jax.tree.leaves(grads)], 1)
  gbar, pairs = g.mean(0), 5 * 4
  products = g @ gbar
  inner = jnp.sqrt(jnp.sum((products - gbar @ gbar) ** 2) / pairs) / (gbar @ gbar)
  norm = jnp.sqrt(jnp.sum((g - gbar) ** 2) / pairs) / jnp.linalg.norm(gbar)
  # Library computation.
  batch_loss = lambda p: jnp.mean(_every_layer_kind(p, ids, img, y))
  tests = wrap(lambda p: gl.batch_size_tests(gl.reap(jax.grad(batch_loss))(p),
                                             tied=("tied",), method=method))(p)
  # Comparison.
  np.testing.assert_allclose(tests.inner_product_test, inner, rtol=1e-3)
  np.testing.assert_allclose(tests.norm_test, norm, rtol=1e-3)


def test_curvature_of_a_loss_with_marked_layers_equals_the_plain_one():
  x = jnp.array([[1.0, 2.0], [0.5, -1.0]])
  marked = lambda w: jnp.sum(jnp.tanh(gl.dense(x, w, name="fc")) ** 2)
  plain = lambda w: jnp.sum(jnp.tanh(x @ w) ** 2)
  w, key = jnp.array([[0.3, -0.2], [0.1, 0.4]]), jax.random.PRNGKey(4)
  np.testing.assert_allclose(gl.hessian_trace(marked, w, key=key, num_products=3),
                             gl.hessian_trace(plain, w, key=key, num_products=3), rtol=1e-5)
