"""Summaries and running statistics against numpy on the full history."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import oryx_gradlog as gl

BINS = gl.magnitude_bins(1e-3, 1e2, 11)


def _numpy_histogram(x, bins=BINS):
  magnitudes = np.abs(x[np.isfinite(x)])
  return np.histogram(magnitudes, bins=np.concatenate([[0.0], bins, [np.inf]]))[0]


def _records_with_bad_values(seed=0, shape=(3, 5, 4)):
  x = np.random.default_rng(seed).normal(size=shape).astype(np.float32) * 10.0
  x[0, 1, 2], x[2, 0, 0], x[1, 4, 3] = np.nan, np.inf, 0.0
  return x


@pytest.mark.parametrize("keep_axes", [0, 1, 2])
def test_summary_matches_numpy(keep_axes):
  x = _records_with_bad_values()
  summary = jax.jit(lambda x: gl.summarize({"r": x}, keep_axes=keep_axes, bins=BINS))(x)
  summary = summary["r"].summary
  flat = x.reshape(x.shape[:keep_axes] + (-1,))
  for index in np.ndindex(*x.shape[:keep_axes]):
    row = flat[index]
    finite = row[np.isfinite(row)]
    np.testing.assert_allclose(summary.norm[index], np.linalg.norm(finite), rtol=1e-5)
    np.testing.assert_allclose(summary.mean[index], finite.mean(), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(summary.variance[index], finite.var(), rtol=1e-5)
    assert summary.min[index] == finite.min() and summary.max[index] == finite.max()
    assert summary.nonfinite[index] == np.sum(~np.isfinite(row))
    np.testing.assert_array_equal(summary.histogram[index], _numpy_histogram(row))


def _assert_summary_matches_numpy(summary, x, keep_axes, bins, rtol=1e-5):
  flat = x.reshape(x.shape[:keep_axes] + (-1,))
  for index in np.ndindex(*x.shape[:keep_axes]):
    row = flat[index]
    finite = row[np.isfinite(row)]
    np.testing.assert_allclose(summary.norm[index], np.linalg.norm(finite), rtol=rtol)
    np.testing.assert_allclose(summary.mean[index], finite.mean(), rtol=rtol, atol=1e-6)
    np.testing.assert_allclose(summary.variance[index], finite.var(), rtol=rtol)
    assert summary.min[index] == finite.min() and summary.max[index] == finite.max()
    assert summary.nonfinite[index] == np.sum(~np.isfinite(row))
    np.testing.assert_array_equal(summary.histogram[index], _numpy_histogram(row, bins))


@pytest.mark.parametrize("bins", [BINS, gl.magnitude_bins()], ids=["log10", "default_pow2"])
@pytest.mark.parametrize("bad_values", [True, False], ids=["nan_inf", "all_finite"])
@pytest.mark.parametrize("keep_axes", [0, 1, 2])
def test_every_path_matches_numpy(keep_axes, bad_values, bins):
  # Finite records take the unmasked pass, others the masked one; both bin kinds.
  x = _records_with_bad_values(seed=1, shape=(4, 6, 300))
  x *= np.exp(np.random.default_rng(2).normal(size=x.shape) * 6).astype(np.float32)
  if not bad_values:
    x = np.where(np.isfinite(x), x, 1.5).astype(np.float32)
  step = jax.jit(lambda x: gl.summarize({"r": x}, keep_axes=keep_axes, bins=bins)["r"].summary)
  _assert_summary_matches_numpy(step(x), x, keep_axes, bins)


def test_statistics_only_without_histogram():
  x = _records_with_bad_values(seed=4, shape=(3, 5, 40)).reshape(3, 200)
  summary = jax.jit(lambda x: gl.summarize({"r": x}, keep_axes=1, bins=None))(x)["r"].summary
  assert summary.histogram is None
  full = jax.jit(lambda x: gl.summarize({"r": x}, keep_axes=1, bins=BINS))(x)["r"].summary
  _assert_summary_matches_numpy(dataclasses.replace(summary, histogram=full.histogram), x, 1,
                                BINS)


def test_histogram_is_exact_on_edges_zeros_subnormals_and_extremes():
  edges = gl.magnitude_bins().astype(np.float32)
  x = np.concatenate([edges, np.nextafter(edges, np.float32(0)), -edges, edges * 3,
                      [0.0, -0.0, 1e-45, -1e-40, 3e38, -3e38, np.inf, np.nan]]).astype(np.float32)
  for bins in (gl.magnitude_bins(), BINS, [1.0]):
    histogram = jax.jit(lambda x, bins=bins: gl.summarize({"r": x}, bins=bins))(x)
    float32_edges = np.asarray(bins, np.float32).astype(np.float64)  # Compared in float32.
    np.testing.assert_array_equal(histogram["r"].summary.histogram,
                                  _numpy_histogram(x, float32_edges))


def test_histogram_counts_past_8_and_16_bits():
  # Rows of every chunking (prime lengths too), all in one bin, with and without a NaN.
  for n in (255, 257, 4099, 65535, 65537, 70000):
    x = np.ones(n, np.float32)
    for bad in (False, True):
      x[7] = np.nan if bad else 1.0
      summary = jax.jit(gl.summarize)({"r": x})["r"].summary
      np.testing.assert_array_equal(summary.histogram, _numpy_histogram(x, gl.magnitude_bins()))
      assert summary.nonfinite == bad


def test_variance_is_stable_for_a_large_mean():
  # E[x^2] - mean^2 would lose every digit here; numpy centres in float64.
  x = (1000.0 + np.random.default_rng(3).normal(size=(4, 512))).astype(np.float32)
  for keep_axes in (0, 1):
    summary = jax.jit(lambda x, k=keep_axes: gl.summarize({"r": x}, keep_axes=k))(x)
    flat = x.astype(np.float64).reshape(x.shape[:keep_axes] + (-1,))
    np.testing.assert_allclose(summary["r"].summary.variance, flat.var(-1), rtol=1e-4)


def test_keep_full_summary_or_both_by_pattern():
  records = {"dense1": jnp.ones(3), "dense2": (jnp.ones(2), None), "h": jnp.arange(3.0)}
  logged = gl.summarize(records, full=("h", "dense1"), summary="dense*")
  assert set(logged) == {"dense1", "dense2", "h"}
  assert logged["h"].summary is None and logged["h"].full is records["h"]
  assert logged["dense1"].full is records["dense1"]
  assert float(logged["dense1"].summary.norm) == pytest.approx(np.sqrt(3))
  assert logged["dense2"].full is None and logged["dense2"].summary[1] is None
  assert gl.summarize(records, summary="none*") == {}


def test_a_name_that_matches_no_record_is_an_error_listing_the_records():
  records = {"fc1": jnp.ones(3), "fc2": jnp.ones(2)}
  with pytest.raises(ValueError, match=r"summarize\(full='fcc', summary='fc3'\): no record has "
                     r"that name; the records are \['fc1', 'fc2'\]\. Use one of these names"):
    gl.summarize(records, full="fcc", summary=("fc1", "fc3"))
  # Patterns with wildcards may match nothing: a run that has no such layer yet.
  logged = gl.summarize(records, full="conv*", summary=("fc?", "[x]"))
  assert set(logged) == {"fc1", "fc2"} and logged["fc1"].full is None
  with pytest.raises(ValueError, match=r"layer_parts=\('weights',\)\): 'weights' is not a part "
                     r"of a layer record; the parts are 'primals', 'out_cotangent', "
                     r"'in_cotangents', or '\*'"):
    gl.summarize(records, layer_parts=("weights",))


def _layer_step(keep_axes, layer_parts, calls):
  """A dense layer (applied `calls` times in a scan when calls > 0) and its records."""
  def layer(x, w, b, perturb=0.0):  # `perturb` adds zeros to the layer's output.
    return jnp.tanh(gl.dense(x, w, b, name="fc") + perturb)

  def loss(params, x, perturb=0.0):
    if not calls:
      return jnp.sum(jnp.sin(layer(x, *params, perturb)) ** 2)
    def body(h, wb):
      return layer(h, *wb), None
    return jnp.sum(jnp.sin(jax.lax.scan(body, x, params)[0]) ** 2)

  key1, key2 = jax.random.split(jax.random.PRNGKey(0))
  lead = (calls,) if calls else ()
  params = (jax.random.normal(key1, (*lead, 4, 4)) / 2, jnp.full((*lead, 4), 0.1))
  x = jax.random.normal(key2, (5, 4))
  grads, records = gl.call_and_reap(jax.grad(loss))(params, x)
  logged = gl.summarize(records, keep_axes=keep_axes, layer_parts=layer_parts)
  return loss, params, x, grads, records, logged["fc"].summary


def test_a_layer_record_is_summarized_by_its_output_cotangent():
  loss, params, x, grads, _, summary = _layer_step(1, ("out_cotangent",), calls=0)
  # True computation: dL/dy by the zero-perturbation trick; dL/dw by plain grad.
  g = jax.grad(lambda d: loss(params, x, d))(jnp.zeros((5, 4)))
  assert summary.primals is None and summary.in_cotangents is None
  np.testing.assert_allclose(summary.out_cotangent.norm, np.linalg.norm(g, axis=1), rtol=1e-5)
  # On request: the inputs and the input cotangents too, per example only where
  # the leaf has examples.
  *_, full = _layer_step(1, "*", calls=0)
  layer, cotangents = full.primals[0], full.in_cotangents[0]
  np.testing.assert_allclose(layer.x.norm, np.linalg.norm(x, axis=1), rtol=1e-5)
  assert layer.w.norm.shape == () and cotangents.w.norm.shape == () and layer.b.norm.shape == ()
  np.testing.assert_allclose(cotangents.w.norm, np.linalg.norm(grads[0]), rtol=1e-5)
  np.testing.assert_allclose(cotangents.b.norm, np.linalg.norm(grads[1]), rtol=1e-5)
  assert layer.kind == "dense" and cotangents.x.norm.shape == (5,)


def test_a_layer_summary_labels_only_example_axes_as_examples(tmp_path):
  pytest.importorskip("xarray")
  pytest.importorskip("zarr")
  # Three calls of one layer in a scan: keep (call, example) where there are examples,
  # (call,) for the weights, whose rows must not be taken for examples.
  *_, grads, records, summary = _layer_step(2, "*", calls=3)
  with gl.RunLog(tmp_path, dims={"*": ("call", "example")}) as log:
    log.append(0, {"fc": summary})
  run = gl.open_run(tmp_path)
  assert run["fc.out_cotangent.norm"].dims == ("step", "call", "example")
  assert run["fc.primals.0.x.norm"].dims == ("step", "call", "example")
  assert run["fc.primals.0.w.norm"].dims == ("step", "call")
  assert run["fc.in_cotangents.0.w.histogram"].dims == ("step", "call", "magnitude_bin")
  assert run["fc.in_cotangents.0.b.norm"].dims == ("step", "call")
  np.testing.assert_allclose(run["fc.in_cotangents.0.w.norm"].values[0],
                             np.linalg.norm(grads[0].reshape(3, -1), axis=1), rtol=1e-5)
  g = records["fc"].out_cotangent
  np.testing.assert_allclose(run["fc.out_cotangent.norm"].values[0],
                             np.linalg.norm(g, axis=-1), rtol=1e-5)


def test_a_found_layer_record_is_summarized_by_its_output_cotangent_per_example():
  # record_layers finds the uses of w (batch on axis 1 of its output) and b.
  def loss(params, x, perturb=0.0):
    z = jnp.einsum("io,bi->ob", params["w"], x) + perturb
    return jnp.sum(jnp.sin(z.T + params["b"]) ** 2)

  keys = jax.random.split(jax.random.PRNGKey(1), 2)
  params = {"w": jax.random.normal(keys[0], (3, 4)), "b": jnp.full(4, 0.1)}
  x = jax.random.normal(keys[1], (5, 3))
  records = gl.reap(jax.grad(gl.record_layers(loss)))(params, x)
  summary = gl.summarize(records, keep_axes=1)["w"].summary
  assert summary.primals is None and summary.in_cotangents is None
  # True computation: dL/dz, (4, 5), by the zero-perturbation trick.
  g = jax.grad(lambda d: loss(params, x, d))(jnp.zeros((4, 5)))
  np.testing.assert_allclose(summary.out_cotangent.norm, np.linalg.norm(g, axis=0), rtol=1e-5)
  # The operands on request keep no example axis (they have no shared one).
  full = gl.summarize(records, keep_axes=1, layer_parts="*")["w"].summary
  assert all(s.norm.shape == () for s in jax.tree.leaves(
      full.primals, is_leaf=lambda node: isinstance(node, gl.Summary)))


def test_too_many_keep_axes_names_the_record():
  with pytest.raises(ValueError, match=r"summarize: record 'h' has shape \(3,\), fewer than "
                     r"keep_axes=2 axes.*smaller keep_axes"):
    gl.summarize({"h": jnp.ones(3)}, keep_axes=2)


def test_per_example_norms_from_a_vmapped_reap():
  dense = gl.record_vjp(lambda x, w: jnp.tanh(x @ w), name="dense")
  loss = lambda w, x: jnp.sum(jnp.sin(dense(x, w)) ** 2)
  w, x = jnp.ones((4, 3)) * 0.3, jnp.arange(20.0).reshape(5, 4) / 10

  @jax.jit
  def step(w, x):
    records = gl.reap(jax.vmap(jax.grad(loss), in_axes=(None, 0)))(w, x)
    return gl.summarize(records, keep_axes=1)  # One norm per example.

  norms = step(w, x)["dense"].summary[1].norm
  per_example = jax.vmap(jax.grad(lambda d, x: jnp.sum(jnp.sin(jnp.tanh(x @ (w + d))) ** 2)),
                         in_axes=(None, 0))(jnp.zeros_like(w), x)
  np.testing.assert_allclose(norms, np.linalg.norm(per_example.reshape(5, -1), axis=1),
                             rtol=1e-5)


@pytest.mark.parametrize("finite_steps", [(), (0, 1, 2, 5, 8, 9, 10)])
def test_running_statistics_match_numpy_over_the_history(finite_steps):
  # Steps with non-finite entries take the masked update, the others the plain one.
  history = np.stack([_records_with_bad_values(seed) for seed in range(12)])
  history[list(finite_steps)] = np.nan_to_num(history[list(finite_steps)], posinf=3.0)
  decay = 0.9
  stats = gl.running_statistics(decay=decay, bins=BINS)

  @jax.jit
  def run(history):
    def step(state, x):
      return stats.update({"r": (x, x[0])}, state)[1], None
    return jax.lax.scan(step, stats.init({"r": (history[0], history[0, 0])}), history)[0]

  state = run(history)["r"][0]
  masked = np.ma.masked_invalid(history)
  np.testing.assert_array_equal(state.count, (~masked.mask).sum(0))
  np.testing.assert_allclose(state.mean, masked.mean(0).filled(0), rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(state.variance, masked.var(0).filled(0), rtol=1e-4, atol=1e-4)
  np.testing.assert_array_equal(state.min, masked.min(0).filled(np.inf))
  np.testing.assert_array_equal(state.max, masked.max(0).filled(-np.inf))
  np.testing.assert_array_equal(state.nonfinite, masked.mask.sum(0))
  np.testing.assert_array_equal(state.histogram, _numpy_histogram(history.ravel()))
  ema = np.zeros(history.shape[1:], np.float32)
  for x in history:
    ema = np.where(np.isfinite(x), decay * ema + (1 - decay) * np.nan_to_num(x), ema)
  np.testing.assert_allclose(state.ema, ema, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(state.debiased_ema, ema / (1 - decay ** 12), rtol=1e-5, atol=1e-5)
  assert int(state.steps) == 12


def test_running_statistics_reject_changed_records():
  stats = gl.running_statistics()
  state = stats.init({"h": jnp.zeros(3)})
  with pytest.raises(ValueError, match=r"running_statistics.update: record 'h' does not match"):
    stats.update({"h": jnp.zeros(4)}, state)
  with pytest.raises(ValueError, match=r"record 'g' does not match"):
    stats.update({"h": jnp.zeros(3), "g": jnp.zeros(3)}, state)


def test_statistics_pass_their_inputs_on_and_sit_in_an_optax_chain():
  """`gl.Transform`: update(inputs, state) -> (outputs, state); the statistics observe."""
  optax = pytest.importorskip("optax")
  grads = [{"w": jnp.array([2.0, -4.0]), "b": jnp.array(1.0)},
           {"w": jnp.array([0.5, 3.0]), "b": jnp.array(-1.0)}]
  tx = optax.chain(gl.running_statistics(), gl.moving_average(0.5), optax.sgd(0.1))
  params = {"w": jnp.zeros(2), "b": jnp.zeros(())}
  state = tx.init(params)
  for g in grads:
    updates, state = jax.jit(tx.update)(g, state, params)
    for leaf, want in zip(jax.tree.leaves(updates), jax.tree.leaves(g)):
      np.testing.assert_allclose(leaf, -0.1 * np.asarray(want), rtol=1e-6)
  stats, ema = state[0], state[1]
  history = {k: np.stack([g[k] for g in grads]) for k in ("w", "b")}
  for k in ("w", "b"):
    np.testing.assert_allclose(stats[k].mean, history[k].mean(0), rtol=1e-6)
    np.testing.assert_allclose(stats[k].max, history[k].max(0))
    np.testing.assert_allclose(ema.value[k], 0.25 * history[k][0] + 0.5 * history[k][1])
  x = {"h": jnp.arange(3.0)}
  out, _ = gl.moving_average().update(x, gl.moving_average().init(x))
  assert out is x


def test_the_old_argument_order_is_an_error_that_says_the_new_one():
  for transform, tree in ((gl.running_statistics(), {"h": jnp.zeros(3)}),
                          (gl.moving_average(), {"h": jnp.zeros(3)})):
    state = transform.init(tree)
    with pytest.raises(TypeError, match=r"update takes \(inputs, state\) in optax's order"):
      transform.update(state, tree)
    assert transform.phase is None
