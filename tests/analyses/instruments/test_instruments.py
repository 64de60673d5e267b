"""Training instruments against plain JAX: vmap(grad), eigh of jax.hessian, a quadratic."""

import functools

import jax
import jax.flatten_util
import jax.numpy as jnp
import numpy as np
import pytest

import oryx_gradlog as gl
from oryx_gradlog.analyses.instruments import _cockpit, _histograms

ECONOMY = ("alpha", "distance", "grad_hist_1d", "grad_norm", "inner_product_test", "loss",
           "norm_test", "orthogonality_test", "update_size")

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
  grads, flat = _per_example(plain, params, x, y)
  # True computation: Cockpit's MeanGSNR, gbar^2 / (mean_i g_i^2 - gbar^2 + 1e-5).
  snr = lambda g: g.mean(0) ** 2 / ((g ** 2).mean(0) - g.mean(0) ** 2 + 1e-5)
  expected = jax.tree.map(snr, grads)
  # Library computation.
  result = gl.gradient_snr(gl.reap(jax.grad(marked))(params, x, y), reduction=reduction)
  # Comparison.
  for i in (1, 2):
    np.testing.assert_allclose(result.layers[f"fc{i}"].w, expected[f"w{i}"], rtol=2e-3)
    np.testing.assert_allclose(result.layers[f"fc{i}"].b, expected[f"b{i}"], rtol=2e-3)
  np.testing.assert_allclose(result.mean, snr(flat).mean(), rtol=2e-3)
  means = [jnp.concatenate([expected[f"w{i}"].ravel(), expected[f"b{i}"]]).mean()
           for i in (1, 2)]
  np.testing.assert_allclose(result.mean_over_layers, np.mean(means), rtol=2e-3)


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


def _cockpit_alpha(t, fs, dfs, var_fs, var_dfs):
  """Cockpit's alpha in float64 numpy: the weighted least-squares parabola."""
  var = np.array(var_fs + var_dfs, np.float64)
  var = np.where(var == 0, 1e-10, var)
  phi = np.array([[1, 0, 0], [1, t, t * t], [0, 1, 0], [0, 1, 2 * t]], np.float64)
  weights = np.diag(1 / var)
  mu = np.linalg.solve(phi.T @ weights @ phi, phi.T @ weights @ np.array(fs + dfs))
  return -1.0 if mu[2] < 0 else 2 * t / (-mu[1] / mu[2]) - 1


def test_alpha_matches_cockpits_weighted_fit_and_the_quadratic():
  a = jnp.array([[3.0, 1.0], [1.0, 2.0]])
  f = lambda w: 0.5 * w @ a @ w + jnp.array([1.0, -1.0]) @ w
  w0 = jnp.array([1.0, 2.0])
  for lr in (0.05, 0.2, 0.3, 0.5):
    d = -lr * jax.grad(f)(w0)
    # True computation: the minimum of f(w0 + t d) is at t* = -<grad, d> / d^T H d.
    t_star = -(jax.grad(f)(w0) @ d) / (d @ jax.hessian(f)(w0) @ d)
    alpha = gl.step_alpha(f(w0), jax.grad(f)(w0) @ d, f(w0 + d), jax.grad(f)(w0 + d) @ d,
                          update_size=jnp.linalg.norm(d))
    np.testing.assert_allclose(alpha, 1 / t_star - 1, rtol=1e-4, atol=1e-5)
    unweighted = gl.step_alpha(f(w0), jax.grad(f)(w0) @ d, f(w0 + d),
                               jax.grad(f)(w0 + d) @ d, fit="unweighted")
    np.testing.assert_allclose(unweighted, 1 / t_star - 1, rtol=1e-4, atol=1e-5)
  # Concave: Cockpit reads -1, the unweighted fit NaN; a step of length 0 reads -1.
  assert gl.step_alpha(0.0, -1.0, -2.0, -3.0, update_size=1.0) == -1
  assert jnp.isnan(gl.step_alpha(0.0, -1.0, -2.0, -3.0, fit="unweighted"))
  assert gl.step_alpha(1.0, 0.0, 1.0, 0.0, update_size=0.0) == -1
  # Noisy per-example observations: Cockpit's weighted fit in float64.
  keys = jax.random.split(jax.random.PRNGKey(5), 4)
  obs = [m + s * jax.random.normal(k, (8,))
         for m, s, k in zip((1.0, -2.0, 0.6, -0.4), (0.3, 1.0, 0.1, 2.0), keys)]
  t = 0.7
  expected = _cockpit_alpha(t, [float(obs[0].mean()), float(obs[2].mean())],
                            [float(obs[1].mean()) / t, float(obs[3].mean()) / t],
                            [float(obs[0].var(ddof=1)), float(obs[2].var(ddof=1))],
                            [float(obs[1].var(ddof=1)) / t**2, float(obs[3].var(ddof=1)) / t**2])
  np.testing.assert_allclose(gl.step_alpha(*obs, update_size=t), expected, rtol=1e-4)
  with pytest.raises(ValueError, match="give update_size"):
    gl.step_alpha(*obs)


# A least-squares layer whose Hessian is diagonal (X^T X = diag(5, 4)), so that the
# Hutchinson estimates of the curvature instruments are exact.
X = jnp.array([[1.0, 0.0], [0.0, 2.0], [2.0, 0.0]])
Y = jnp.array([[0.5, -1.0], [1.0, 0.0], [-0.5, 2.0]])
LR = 0.3


def _losses(w, dense):
  return 0.5 * jnp.sum((dense(X, w, name="fc") - Y) ** 2, -1)


def _marked(w):
  losses = _losses(w, gl.dense)
  return jnp.mean(losses), losses


def _plain(w):
  return jnp.mean(_losses(w, lambda x, w, name: x @ w))


def _reference(w, w_previous, w0, w_before_previous):
  """Every instrument at `w` by its (Cockpit's) definition, from vmap(grad) and the
  dense Hessian."""
  one = lambda w, x, y: 0.5 * jnp.sum((x @ w - y) ** 2)
  per_example = lambda w: jax.vmap(jax.grad(one), in_axes=(None, 0, 0))(w, X, Y).reshape(3, -1)
  losses = lambda w: jax.vmap(one, in_axes=(None, 0, 0))(w, X, Y)
  g = np.asarray(per_example(w), np.float64)
  gbar, s2, b = g.mean(0), (g ** 2).sum(0), 3
  hessian = np.asarray(jax.hessian(lambda v: _plain(v.reshape(2, 2)))(w.ravel()))
  diag = np.diag(hessian)
  products, gsq, pairs = g @ gbar, gbar @ gbar, b * (b - 1)
  ref = {
      "norm_test": np.sqrt(np.sum((g - gbar) ** 2) / pairs) / np.sqrt(gsq),
      "inner_product_test": np.sqrt(np.sum((products - gsq) ** 2) / pairs) / gsq,
      "orthogonality_test": np.sqrt(np.sum((g - np.outer(products / gsq, gbar)) ** 2)
                                    / pairs) / np.sqrt(gsq),
      "loss": float(_plain(w)),
      "grad_norm": np.linalg.norm(gbar),
      "update_size": np.linalg.norm(LR * gbar),
      "distance": np.linalg.norm(w - w0),
      "mean_gsnr": np.mean(gbar**2 / (s2 / b - gbar**2 + 1e-5)),
      "early_stopping": 1 - b * np.mean(gbar**2 / ((s2 - b * gbar**2) / (b - 1) + 1e-5)),
      "cabs": LR * np.sum(s2 / b - gbar**2) / float(_plain(w)),
      "tic_diag": np.sum(s2 / b / (diag + 1e-7)),
      "tic_trace": np.sum(s2 / b) / (np.trace(hessian) + 1e-7),
      "hessian_trace": np.trace(hessian),
      "hessian_max_eigenvalue": np.linalg.eigvalsh(hessian)[-1],
      "grad_hist_1d": np.histogram(np.clip(g, -2, 2), bins=100, range=(-2, 2))[0],
      "grad_hist_2d": np.histogram2d(
          np.clip(g, -1 + 0.025, 1 - 0.025).ravel(),
          np.clip(np.broadcast_to(np.asarray(w).ravel(), g.shape), -2 + 0.04, 2 - 0.04).ravel(),
          bins=(40, 50), range=((-1, 1), (-2, 2)))[0],
  }
  if w_previous is not None:  # alpha of the update w_previous -> w.
    d = np.asarray(w - w_previous, np.float64).ravel()
    t = np.linalg.norm(d)
    before, after = np.asarray(per_example(w_previous)) @ d / t, g @ d / t
    f0, f1 = np.asarray(losses(w_previous)), np.asarray(losses(w))
    ref["alpha"] = _cockpit_alpha(t, [f0.mean(), f1.mean()], [before.mean(), after.mean()],
                                  [f0.var(ddof=1), f1.var(ddof=1)],
                                  [before.var(ddof=1), after.var(ddof=1)])
  return ref, hessian


ALL = _cockpit.INSTRUMENTS


def _found(w, x, y):
  """The least-squares loss with no layer marked: gl.record_layers finds `x @ w`."""
  losses = 0.5 * jnp.sum((x @ w - y) ** 2, -1)
  return jnp.mean(losses), losses


# The layers marked by hand (placed by `where=`, or by record_layers), and found by
# gl.record_layers in the plain model.
def _marked_batch(w, x, y):
  losses = 0.5 * jnp.sum((gl.dense(x, w, name="fc") - y) ** 2, -1)
  return jnp.mean(losses), losses


LOSSES = {"marked": _marked,
          "marked_recorded": lambda w: gl.record_layers(_marked_batch)(w, X, Y),
          "found": lambda w: gl.record_layers(_found)(w, X, Y)}


@pytest.mark.parametrize("compiled", [True, False], ids=["jit", "eager"])
@pytest.mark.parametrize("recorded", LOSSES.values(), ids=LOSSES.keys())
def test_every_instrument_matches_its_definition_in_a_jitted_loop(recorded, compiled):
  # Eager too: the curvature's `lax.cond` once staged the search for a hand-marked
  # layer's weight among the parameters (TracerBoolConversionError).
  w0 = jnp.array([[1.0, -0.5], [0.5, 1.0]])
  where = "fc.w" if recorded is _marked and not compiled else None
  instruments = gl.training_instruments(ALL, curvature_every=1, num_products=80,
                                        where=where)
  state = instruments.init(w0)
  traces = []  # One entry per trace of `step`.

  def step(state, w):
    traces.append(None)
    ((value, losses), grads), records = gl.call_and_reap(
        jax.value_and_grad(recorded, has_aux=True))(w)
    updates = -LR * grads
    readings, state = instruments.update(
        records, state, loss=value, grads=grads, params=w, updates=updates, losses=losses,
        learning_rate=LR, hessian_loss=_plain)
    return readings, state, w + updates

  ws, history = [w0], []
  run = jax.jit(step) if compiled else step
  for _ in range(3):
    readings, state, w = run(state, ws[-1])
    ws.append(w)
    history.append(readings)
  if compiled:
    assert len(traces) == 1  # No retrace.
  assert jnp.isnan(history[0]["alpha"])
  for t in (1, 2):
    ref, hessian = _reference(ws[t], ws[t - 1], w0, None)
    readings = history[t]
    assert set(readings) == set(ALL) | {"per_parameter"}
    for name in ALL:
      got = readings[name]["counts"] if name.startswith("grad_hist") else readings[name]
      if name.startswith("grad_hist"):
        # The step and the reference are other programs (eager, or fused another
        # way): float32 rounds differently, so an element on a bin edge may fall
        # on either side of it, never further.
        assert int(np.sum(got)) == int(np.sum(ref[name])), name
        drift = np.cumsum(np.ravel(got)) - np.cumsum(np.ravel(ref[name]))
        assert np.max(np.abs(drift)) <= 1, name
        continue
      np.testing.assert_allclose(got, ref[name], rtol=2e-4, atol=1e-6, err_msg=name)
    # Per-parameter readings, keyed like the parameters (one leaf here).
    per = readings["per_parameter"]
    np.testing.assert_allclose(per["grad_norm"], ref["grad_norm"], rtol=1e-5)
    np.testing.assert_allclose(per["hessian_trace"], np.trace(hessian), rtol=1e-5)
  np.testing.assert_allclose(history[1]["grad_hist_1d"]["edges"], np.linspace(-2, 2, 101),
                             atol=1e-6)


def test_per_parameter_readings_are_keyed_like_the_parameters():
  params, x, y, marked, plain = _model("mean")
  instruments = gl.training_instruments(("grad_norm", "update_size", "distance",
                                         "hessian_trace"), num_products=3)
  state = instruments.init(params)
  batch_loss = lambda p: marked(p, x, y)
  (value, grads), records = gl.call_and_reap(jax.value_and_grad(batch_loss))(params)
  moved = jax.tree.map(lambda p: p + 0.1, params)
  updates = jax.tree.map(lambda g: -0.1 * g, grads)
  readings, _ = jax.jit(lambda s, r, g, p, u: instruments.update(
      r, s, loss=value, grads=g, params=p, updates=u,
      hessian_loss=lambda p: jnp.mean(jax.vmap(plain, in_axes=(None, 0, 0))(p, x, y))))(
          state, records, grads, moved, updates)
  per = readings["per_parameter"]
  for name, tree in (("grad_norm", grads), ("update_size", updates),
                     ("distance", jax.tree.map(lambda p: p * 0 + 0.1, params))):
    assert jax.tree.structure(per[name]) == jax.tree.structure(params)
    expected = jax.tree.map(jnp.linalg.norm, tree)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5), per[name], expected)
    np.testing.assert_allclose(readings[name], np.sqrt(sum(
        float(v) ** 2 for v in jax.tree.leaves(expected))), rtol=1e-5)
  np.testing.assert_allclose(readings["hessian_trace"], sum(jax.tree.leaves(per["hessian_trace"])),
                             rtol=1e-5)


def test_hessian_diagonal_converges_to_the_dense_diagonal():
  params, x, y, _, plain = _model("mean")
  loss = lambda p: jnp.mean(jax.vmap(plain, in_axes=(None, 0, 0))(p, x, y))
  flat, unravel = jax.flatten_util.ravel_pytree(params)
  hessian = jax.hessian(lambda v: loss(unravel(v)))(flat)
  n = 2000
  diagonal = jax.jit(lambda p: gl.hessian_diagonal(loss, p, key=jax.random.PRNGKey(3),
                                                   num_products=n))(params)
  estimate = jax.flatten_util.ravel_pytree(diagonal)[0]
  off = hessian - jnp.diag(jnp.diag(hessian))
  std = jnp.sqrt(jnp.sum(off ** 2, axis=1) / n)  # Per element.
  assert bool(jnp.all(jnp.abs(estimate - jnp.diag(hessian)) < 5 * std + 1e-6))
  trace = gl.hessian_trace(loss, params, key=jax.random.PRNGKey(3), num_products=n)
  np.testing.assert_allclose(trace, jnp.sum(estimate), rtol=1e-4)


@pytest.mark.parametrize("layers", ["marked", "found"])
def test_exact_hessian_diagonal_and_tic_match_the_dense_hessian(layers):
  """`exact=True` gives the dense Hessian's diagonal (a tanh MLP: H is not diagonal),
  and the curvature instruments read from it match their definitions, on layers
  marked by hand or found by gl.record_layers in the plain model."""
  params, x, y, marked, plain = _model("mean")
  batch_loss = lambda p, x, y: jnp.mean(jax.vmap(plain, in_axes=(None, 0, 0))(p, x, y))
  loss = lambda p: batch_loss(p, x, y)
  if layers == "found":
    marked = gl.record_layers(batch_loss)
  flat, unravel = jax.flatten_util.ravel_pytree(params)
  hessian = np.asarray(jax.hessian(lambda v: loss(unravel(v)))(flat), np.float64)
  diagonal = jax.jit(lambda p: gl.hessian_diagonal(loss, p, exact=True, chunk=7))(params)
  np.testing.assert_allclose(jax.flatten_util.ravel_pytree(diagonal)[0], np.diag(hessian),
                             rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(gl.hessian_trace(loss, params, exact=True), np.trace(hessian),
                             rtol=1e-5)

  instruments = gl.training_instruments(("tic_diag", "tic_trace", "hessian_trace"),
                                        curvature_every=1, exact_diagonal=True)

  @jax.jit
  def step(state, p):
    (value, grads), records = gl.call_and_reap(jax.value_and_grad(marked))(p, x, y)
    return instruments.update(records, state, loss=value, grads=grads, params=p,
                              updates=jax.tree.map(jnp.zeros_like, grads), hessian_loss=loss)

  readings, _ = step(instruments.init(params), params)
  _, g = _per_example(plain, params, x, y)  # Leaves in the order ravel_pytree uses.
  s2 = np.sum(np.asarray(g, np.float64) ** 2, axis=0)
  expected = {"tic_diag": np.sum(s2 / B / (np.diag(hessian) + 1e-7)),
              "tic_trace": np.sum(s2 / B) / (np.trace(hessian) + 1e-7),
              "hessian_trace": np.trace(hessian)}
  for name, value in expected.items():
    np.testing.assert_allclose(readings[name], value, rtol=1e-4, err_msg=name)
  with pytest.raises(ValueError, match="give key="):
    gl.hessian_diagonal(loss, params)
  with pytest.raises(ValueError, match="exact_diagonal"):
    gl.training_instruments("business", exact_diagonal="yes")


# Per-example gradient elements binned at once: one example at a time, a few (a
# remainder chunk after the scan for the convolution), the default (whole batch).
CHUNKS = {"one_example": 1, "some_examples": 80, "default": None}


def _one_1d_histogram(grads, batch):
  g = np.concatenate([np.asarray(v).reshape(batch, -1) for v in jax.tree.leaves(grads)], 1)
  return np.histogram(np.clip(g, -2, 2), bins=100, range=(-2, 2))[0]


def _count_by_products(monkeypatch):
  """A TPU's counting (`product_counts`, one-hot products) on this machine, in
  chunks of 1,000 indices (several chunks, the last one padded)."""
  monkeypatch.setattr(_histograms, "_counts", _histograms.product_counts)
  monkeypatch.setattr(_histograms, "PRODUCT_CHUNK", 1000)


@pytest.mark.parametrize("length", [1, 7, 100, 2000])
def test_product_counts_equal_bincount(monkeypatch, length):
  monkeypatch.setattr(_histograms, "PRODUCT_CHUNK", 1000)
  index = np.random.default_rng(length).integers(0, length, 2500)
  index[:3] = [0, length - 1, 0]
  counts = jax.jit(_histograms.product_counts, static_argnums=1)(index, length)
  np.testing.assert_array_equal(counts, np.bincount(index, minlength=length))
  assert counts.dtype == jnp.int32


@pytest.mark.parametrize("counting", ["scatter", "products"])
@pytest.mark.parametrize("chunk", CHUNKS.values(), ids=CHUNKS.keys())
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_gradient_histogram_of_found_layers_matches_vmap_grad(monkeypatch, chunk, reduction,
                                                              counting):
  if chunk is not None:
    monkeypatch.setattr(_histograms, "CHUNK_ELEMENTS", chunk)
  if counting == "products":
    _count_by_products(monkeypatch)
  params, x, y, _, plain = _model(reduction)
  params = jax.tree.map(lambda v: 0.3 * v, params)  # Gradients inside [-2, 2] mostly.
  reduce = jnp.mean if reduction == "mean" else jnp.sum
  loss = gl.record_layers(lambda p, x, y: reduce(jax.vmap(plain, in_axes=(None, 0, 0))(p, x, y)))
  records = gl.reap(jax.grad(loss))(params, x, y)
  hist = jax.jit(lambda r, p: gl.gradient_histograms(r, reduction=reduction, params=p))(
      records, params)
  grads, _ = _per_example(plain, params, x, y)
  np.testing.assert_array_equal(hist.counts_1d, _one_1d_histogram(grads, B))
  assert int(hist.counts_2d.sum()) == B * sum(v.size for v in jax.tree.leaves(params))


def _rank_one_examples():
  """Examples of a 64 -> 48 dense layer, x_i and output cotangents g_i, whose
  gradients x_i g_i^T take each of the rank-one histogram's branches."""
  rng = np.random.default_rng(0)
  x = rng.normal(size=(7, 64)).astype(np.float32)
  g = 1e-3 * rng.normal(size=(7, 48)).astype(np.float32)  # Example 0: near zero.
  x[1, :3] *= 300  # Three large rows.
  g[2, :2] *= 300  # Two large columns.
  g[3, :20] *= 300  # Twenty.
  g[4] *= 1000  # Large everywhere.
  g[5, 0] = 1e-30  # A product that could underflow to zero.
  x[6, 7], g[6, 5] = -0.0, 0.0  # Zeros, and products near -1e-9, just below zero.
  x[6, 8] = 1e-6
  return x, g


@pytest.mark.parametrize("counting", ["scatter", "products"])
@pytest.mark.parametrize("chunk", [64 * 48, None], ids=["one_example", "default"])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_gradient_histogram_of_rank_one_layers_matches_vmap_grad(monkeypatch, chunk,
                                                                 reduction, counting):
  if counting == "products":
    _count_by_products(monkeypatch)
  x, g = _rank_one_examples()
  plans = [int(_histograms._rank_one_plan(x[i:i + 1], g[i:i + 1], 1.0, 100, (-2.0, 2.0)))  # pylint: disable=protected-access
           for i in range(len(x))]
  cuts = _histograms._cuts(64, 48)  # pylint: disable=protected-access
  # Signs alone, the 4 largest rows, the 3 largest columns, 24 of them, every element.
  assert [cuts[p] if p < len(cuts) else "whole" for p in plans] == [
      (0, 0), (0, 4), (1, 3), (1, 24), "whole", "whole", (0, 0)]
  if chunk is not None:
    monkeypatch.setattr(_histograms, "CHUNK_ELEMENTS", chunk)
  reduce = jnp.mean if reduction == "mean" else jnp.sum
  # Output cotangent g_i: the loss is linear in the layer's output.
  loss = lambda w, x, g: reduce(jnp.sum(g * gl.dense(x, w, name="fc"), -1))
  w = jnp.zeros((64, 48))
  records = gl.reap(jax.grad(loss))(w, x, g)
  hist = jax.jit(lambda r: gl.gradient_histograms(r, reduction=reduction, two_d=False))(
      records)
  grads = jax.vmap(jax.grad(lambda w, x, g: jnp.sum(g * (x @ w))), (None, 0, 0))(w, x, g)
  # Example 6's products near -1e-9 are in bin 49, as np.histogram puts them (float32
  # rounds -1e-9 + 2 to 2).
  np.testing.assert_array_equal(hist.counts_1d, _one_1d_histogram(grads, len(x)))


@pytest.mark.parametrize("chunk", [pytest.param(1, marks=pytest.mark.slow), 80, None],
                         ids=CHUNKS.keys())
@pytest.mark.parametrize("found", [False, True], ids=["marked", "found"])
@pytest.mark.parametrize("counting", ["scatter", "products"])
def test_gradient_histograms_on_every_layer_kind_match_vmap_grad(monkeypatch, chunk, found,
                                                                 counting):
  # Found by gl.record_layers, the uses read by one use each (embedding, layer norm,
  # convolution, stacked dense, dot_general and bias) are counted a chunk of examples
  # at a time, in both histograms; the tied dense layer's two uses whole.
  if chunk is not None:
    monkeypatch.setattr(_histograms, "CHUNK_ELEMENTS", chunk)
  if counting == "products":
    _count_by_products(monkeypatch)
  p, ids, img, y = _every_layer_kind_inputs()
  one = lambda p, ids, img, y: _every_layer_kind(p, ids[None], img[None], y[None])[0]
  grads = jax.vmap(jax.grad(one), in_axes=(None, 0, 0, 0))(p, ids, img, y)
  batch_loss = lambda p, ids=ids, img=img, y=y: jnp.mean(_every_layer_kind(p, ids, img, y))
  tied = () if found else ("tied",)
  if found:
    records = gl.reap(jax.grad(gl.record_layers(batch_loss)))(p, ids, img, y)
    hist = jax.jit(lambda r, p: gl.gradient_histograms(r, params=p))(records, p)
  else:
    records = gl.reap(jax.grad(batch_loss))(p)
    hist = jax.jit(lambda r: gl.gradient_histograms(r, tied=tied))(records)
  # True computation: every element of every example's gradient; dense_dot_general's
  # bias ("db") has no recorded value in its marked record, so the 2-D histogram of
  # marked records leaves it out.
  g = np.concatenate([np.asarray(v).reshape(5, -1) for v in jax.tree.leaves(grads)], 1)
  np.testing.assert_array_equal(
      hist.counts_1d, np.histogram(np.clip(g, -2, 2), bins=100, range=(-2, 2))[0])
  pairs = [(np.asarray(grads[k]), np.asarray(p[k])) for k in p if found or k != "db"]
  xs = np.concatenate([np.clip(gk, -0.975, 0.975).ravel() for gk, _ in pairs])
  ys = np.concatenate([np.clip(np.broadcast_to(pk, gk.shape), -1.96, 1.96).ravel()
                       for gk, pk in pairs])
  np.testing.assert_array_equal(
      hist.counts_2d, np.histogram2d(xs, ys, bins=(40, 50), range=((-1, 1), (-2, 2)))[0])
  # GSNR over every parameter of every layer kind (Cockpit's MeanGSNR, eps 1e-5).
  snr = gl.gradient_snr(records, tied=tied)
  np.testing.assert_allclose(
      snr.mean, np.mean(g.mean(0) ** 2 / ((g ** 2).mean(0) - g.mean(0) ** 2 + 1e-5)),
      rtol=2e-3)


def test_schedules_are_cockpits():
  linear = gl.linear_schedule(4, offset=2)
  assert [t for t in range(15) if linear(t)] == [2, 6, 10, 14]
  assert [bool(linear(jnp.int32(t))) for t in range(7)] == [linear(t) for t in range(7)]
  # Cockpit: torch.logspace(0, 3, 10, dtype=int), and 0.
  log = gl.logarithmic_schedule(0, 3, steps=10)
  assert [t for t in range(1001) if log(t)] == [0, 1, 2, 4, 10, 21, 46, 100, 215, 464, 1000]
  assert bool(log(jnp.int32(46))) and not bool(log(jnp.int32(47)))
  with pytest.raises(ValueError, match=r"linear_schedule\(interval=0\)"):
    gl.linear_schedule(0)


SCHEDULES = {"traced": 3, "static": 3, "function": gl.linear_schedule(3),
             "static function": gl.linear_schedule(3)}


@pytest.mark.parametrize("schedule", SCHEDULES.values(), ids=SCHEDULES.keys())
def test_every_k_steps_reads_the_instruments_on_read_steps_only(request, schedule):
  static = "static" in request.node.callspec.id
  w0 = jnp.array([[1.0, -0.5], [0.5, 1.0]])
  instruments = gl.training_instruments("economy", every=schedule)

  traces = []  # One entry per trace of `step`.

  @functools.partial(jax.jit, static_argnames="phase")
  def step(state, w, phase=None):
    traces.append(phase)
    ((value, losses), grads), records = gl.call_and_reap(
        jax.value_and_grad(_marked, has_aux=True))(w)
    updates = -LR * grads
    readings, state = instruments.update(records, state, loss=value, grads=grads, params=w,
                                         updates=updates, losses=losses, phase=phase)
    return readings, state, w + updates

  state, ws, history = instruments.init(w0), [w0], []
  for t in range(7):
    readings, state, w = step(state, ws[-1], phase=instruments.phase(t) if static else None)
    ws.append(w)
    history.append(readings)
  # One program (traced schedule), or one per phase: read, skip, start.
  assert len(traces) == (3 if static else 1)
  assert [instruments.phase(t) for t in range(7)] == [
      "read", "skip", "start", "read", "skip", "start", "read"]
  for t, readings in enumerate(history):
    if t % 3:  # Between read steps: NaN, histogram counts -1.
      assert all(bool(jnp.all(jnp.isnan(v) | (v == -1)))
                 for v in jax.tree.leaves(readings)), (t, readings)
      continue
    # Read steps, by definition in plain JAX.
    ref, _ = _reference(ws[t], ws[t - 1] if t else None, w0, None)
    for name in ECONOMY:
      if name == "alpha" and t == 0:
        assert jnp.isnan(readings["alpha"])
        continue
      got = readings[name]["counts"] if name == "grad_hist_1d" else readings[name]
      np.testing.assert_allclose(got, ref[name], rtol=2e-4, atol=1e-6, err_msg=name)


def test_presets_are_cockpits_configurations():
  # cockpit.utils.configuration.quantities_cls_for_configuration, by our names.
  economy = {"alpha", "distance", "grad_hist_1d", "grad_norm", "inner_product_test", "loss",
             "norm_test", "orthogonality_test", "update_size"}
  business = economy | {"tic_diag", "hessian_trace"}
  full = business | {"hessian_max_eigenvalue", "grad_hist_2d"}
  presets = _cockpit.PRESETS
  assert (set(presets["economy"]), set(presets["business"]), set(presets["full"])) == (
      economy, business, full)


def test_presets_and_bad_arguments():
  # Each family keeps its own state; economy measures no curvature, keeps no key.
  assert set(gl.training_instruments("economy").init(jnp.ones(1)).families) == {
      "norms", "alpha"}
  business = gl.training_instruments("business").init(jnp.ones(1)).families
  assert set(business) == {"norms", "alpha", "curvature"}
  assert set(business["curvature"].readings) == {"tic_diag", "hessian_trace", "per_parameter"}
  with pytest.raises(ValueError, match="the presets are"):
    gl.training_instruments("first class")
  with pytest.raises(ValueError, match="is not an instrument"):
    gl.training_instruments(("norm_test", "tic"))
  for bad in (0, 1.5, True):
    with pytest.raises(ValueError, match=r"every=.*positive integer"):
      gl.training_instruments("economy", every=bad)
  instruments = gl.training_instruments("business", every=2)
  marked = lambda w: jnp.mean(gl.dense(jnp.ones((2, 1)), w, name="fc") ** 2)
  (value, grads), records = gl.call_and_reap(jax.value_and_grad(marked))(jnp.ones((1, 1)))
  args = dict(loss=value, grads=grads, params=jnp.ones((1, 1)), updates=grads)
  # Every problem is named at once: hessian_loss, losses, the phase.
  with pytest.raises(ValueError, match=r"need hessian_loss.*alpha needs losses.*"
                     r"phase='sometimes'.*instruments.phase\(step\)"):
    instruments.update(records, instruments.init(jnp.ones((1, 1))), **args,
                       phase="sometimes")
  # The order before gl.Transform, (state, records), says the new one.
  with pytest.raises(TypeError, match=r"update takes \(inputs, state\) in optax's order"):
    instruments.update(instruments.init(jnp.ones((1, 1))), records, **args)
  cabs = gl.training_instruments(("cabs",))
  with pytest.raises(ValueError, match="cabs needs learning_rate"):
    cabs.update(records, cabs.init(jnp.ones((1, 1))), **args)
  # A layer whose weight is not a leaf of params itself (computed from it): name it
  # in where; a transposed one cannot be placed.
  w = jnp.array([[1.0, 2.0]])

  def transposed(w):
    losses = gl.dense(jnp.array([[1.0], [3.0]]), w + 0.0, name="fc")[:, 0] ** 2
    return jnp.mean(losses), losses

  @functools.partial(jax.jit, static_argnames="where")
  def step(w, where=None):
    ((value, losses), grads), records = gl.call_and_reap(
        jax.value_and_grad(transposed, has_aux=True))(w)
    instruments = gl.training_instruments(("alpha",), where=where)
    return instruments.update(records, instruments.init(w), loss=value, grads=grads,
                              params=w, updates=-grads, losses=losses)

  with pytest.raises(ValueError, match=r"records \['fc'\] have a weight .* Record the "
                     r"loss with gl.record_layers .* pass where="):
    step(w)
  eager = gl.training_instruments(("alpha",))  # Outside jit: no leaf is handed through.
  ((value, losses), grads), records = gl.call_and_reap(
      jax.value_and_grad(transposed, has_aux=True))(w)
  with pytest.raises(ValueError, match=r"records \['fc'\] have a weight"):
    eager.update(records, eager.init(w), loss=value, grads=grads, params=w, updates=-grads,
                 losses=losses)
  assert jnp.isnan(step(w, where="fc.w")[0]["alpha"])  # Step 0: no alpha yet.
  _, records = gl.call_and_reap(jax.grad(lambda w: transposed(w)[0]))(w)
  placed = gl.training_instruments(("alpha",), where="fc.w")
  with pytest.raises(ValueError, match=r"'fc.w' is recorded with shape \(1, 2\) but its "
                     r"parameter has \(2, 1\)"):
    placed.update(records, placed.init(w.T), loss=0.0, grads=w.T, params=w.T, updates=w.T,
                  losses=jnp.ones(2))


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


def test_report_draws_every_instrument_of_a_real_run(tmp_path):
  pytest.importorskip("matplotlib")
  pytest.importorskip("zarr")
  w = jnp.array([[1.0, -0.5], [0.5, 1.0]])
  instruments = gl.training_instruments(ALL, every=2, curvature_every=2, num_products=3)
  state = instruments.init(w)

  @functools.partial(jax.jit, static_argnames="phase")
  def step(state, w, phase):
    ((value, losses), grads), records = gl.call_and_reap(
        jax.value_and_grad(_marked, has_aux=True))(w)
    readings, state = instruments.update(
        records, state, loss=value, grads=grads, params=w, updates=-LR * grads,
        losses=losses, learning_rate=LR, hessian_loss=_plain, phase=phase)
    return readings, state, w - LR * grads

  with gl.RunLog(tmp_path / "run") as log:
    for t in range(5):
      readings, state, w = step(state, w, instruments.phase(t))
      log.append(t, {"instruments": {**readings, "time": np.float64(t * 0.5)}})
  page = gl.report(tmp_path / "run", progress=False)
  run = gl.open_run(tmp_path / "run")
  # Read steps 0, 2, 4; the 1-D histogram counts every per-example gradient element.
  counts = run["instruments.grad_hist_1d.counts"].values
  assert counts[0].sum() == 3 * 4 and np.all(counts[1] == -1)
  text = open(page, encoding="utf-8").read()
  assert "<tr><td>time</td><td>0.5</td></tr>" in text  # Seconds per step.
  last_alpha = run["instruments.alpha"].values[4]
  assert f"<tr><td>alpha</td><td>{last_alpha:.4g}</td></tr>" in text
  assert "instruments.per_parameter.grad_norm" in run
  # TensorBoard, read back by its own reader: the scalars at their read steps, the
  # 1-D histogram at its read steps.
  pytest.importorskip("tensorboardX")
  accumulator = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")
  events = accumulator.EventAccumulator(str(gl.export_tensorboard(tmp_path / "run")),
                                        size_guidance={"scalars": 0, "histograms": 0})
  events.Reload()
  alpha = run["instruments.alpha"].values
  assert [e.step for e in events.Scalars("instruments.alpha")] == list(
      np.flatnonzero(np.isfinite(alpha)))
  np.testing.assert_allclose([e.value for e in events.Scalars("instruments.alpha")],
                             alpha[np.isfinite(alpha)], rtol=1e-6)
  assert any(tag.startswith("instruments.per_parameter.grad_norm")
             for tag in events.Tags()["scalars"])
  histograms = events.Histograms("instruments.grad_hist_1d")
  assert [h.step for h in histograms] == [0, 2, 4]
  assert all(h.histogram_value.num == 3 * 4 for h in histograms)
  assert not any("grad_hist_2d" in tag for tags in events.Tags().values()
                 if isinstance(tags, list) for tag in tags)


def test_the_state_survives_a_step_that_donates_params_and_state():
  instruments = gl.training_instruments("economy")

  def marked(w):
    losses = gl.dense(jnp.array([[1.0], [3.0]]), w, name="fc")[:, 0] ** 2
    return jnp.mean(losses), losses

  w = jnp.ones((1, 1))
  state = instruments.init(w)

  @functools.partial(jax.jit, donate_argnums=(0, 1))
  def step(w, state):
    ((value, losses), grads), records = gl.call_and_reap(
        jax.value_and_grad(marked, has_aux=True))(w)
    readings, state = instruments.update(records, state, loss=value, grads=grads, params=w,
                                         updates=-0.05 * grads, losses=losses)
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


def _every_layer_kind_inputs():
  """Parameters and a batch of 5 for `_every_layer_kind`."""
  keys = iter(jax.random.split(jax.random.PRNGKey(3), 16))
  normal = lambda shape: jax.random.normal(next(keys), shape)
  p = {"emb": normal((7, 4)), "ln_s": normal((4,)), "ln_b": normal((4,)),
       "cw": normal((3, 3, 1, 4)), "cb": normal((4,)), "tw": normal((4, 4)) / 2,
       "tb": normal((4,)), "sw": normal((3, 4, 4)) / 2, "dw": normal((4, 3)),
       "db": normal((3,))}
  ids = jnp.array([[1, 1, 2], [3, 4, 3], [0, 6, 6], [5, 5, 5], [2, 1, 0]])
  img, y = normal((5, 6, 5, 2)), normal((5, 3))
  return p, ids, img, y


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("wrap", VARIANTS.values(), ids=VARIANTS.keys())
def test_batch_size_tests_on_every_layer_kind_match_vmap_grad(wrap, method):
  p, ids, img, y = _every_layer_kind_inputs()
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
