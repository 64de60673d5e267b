"""Analyses from one backward pass, against plain JAX.

Per-example quantities are checked against `jax.vmap(jax.grad(example_loss))`, the
per-example gradients formed explicitly; K-FAC factors against the layer inputs and
per-example output gradients computed directly (perturbation trick); the NaN finder
against networks where we know which site makes the NaN.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from conftest import eight_devices

import oryx_gradlog as gl

RTOL, ATOL = 2e-5, 1e-6


def _normal(key, shape, scale=1.0):
  return scale * jax.random.normal(jax.random.PRNGKey(key), shape)


def _per_example_grads(example_loss, params, *data):
  """True computation: the gradients of each example's loss, `(batch, ...)` leaves."""
  in_axes = (None,) + (0,) * len(data)
  return jax.jit(jax.vmap(jax.grad(example_loss), in_axes=in_axes))(params, *data)


def _flat(tree):
  """`(batch, n)` per-example gradients of a subtree, flattened and concatenated."""
  return jnp.concatenate([x.reshape(x.shape[0], -1) for x in jax.tree.leaves(tree)], 1)


def _norms(tree):
  return np.linalg.norm(np.asarray(_flat(tree), np.float64), axis=1)


def _batch_loss(example_loss, reduction="mean"):
  """`mean_i l_i` (or the sum), with the model applied to the whole batch at once."""
  def loss(params, *data):
    losses = example_loss(params, *data, batched=True)
    return jnp.mean(losses) if reduction == "mean" else jnp.sum(losses)
  return loss


# ----------------------------------------------------------------------------------
# Models. Each `example_loss(params, *example, batched=False)` is example i's loss;
# with batched=True the same code runs on the batch and returns the (batch,) losses.


def mlp_loss(params, x, y, batched=False):
  h = jnp.tanh(gl.dense(x, params["fc1"]["w"], params["fc1"]["b"], name="fc1"))
  out = gl.dense(h, params["fc2"]["w"], name="fc2")
  return jnp.sum((out - y) ** 2, axis=-1)


def mlp_setup(batch=6):
  params = {"fc1": {"w": _normal(0, (5, 7)), "b": _normal(1, (7,))},
            "fc2": {"w": _normal(2, (7, 3))}}
  return params, _normal(3, (batch, 5)), _normal(4, (batch, 3))


def seq_loss(params, x, y, batched=False):
  """A token-wise MLP; the example's loss is the mean over its tokens."""
  h = jax.nn.gelu(gl.dense(x, params["up"]["w"], params["up"]["b"], name="up"))
  out = gl.dense(h, params["down"]["w"], name="down")
  return jnp.mean(jnp.sum((out - y) ** 2, axis=-1), axis=-1)


def seq_setup(batch=4, tokens=5):
  params = {"up": {"w": _normal(5, (4, 6)), "b": _normal(6, (6,))},
            "down": {"w": _normal(7, (6, 4))}}
  return params, _normal(8, (batch, tokens, 4)), _normal(9, (batch, tokens, 4))


def conv_loss(params, x, y, batched=False):
  """Two convolutions: NHWC/HWIO grouped, strided and dilated; NCHW/OIHW transposed."""
  x = x if batched else x[None]
  h = gl.conv2d(x, params["c1"]["w"], params["c1"]["b"], name="c1", window_strides=(2, 1),
                rhs_dilation=(1, 2), feature_group_count=2)
  h = jnp.transpose(jnp.tanh(h), (0, 3, 1, 2))
  out = gl.conv2d(h, params["c2"]["w"], name="c2", padding=((0, 0), (0, 0)), lhs_dilation=(2, 1),
                  dimension_numbers=("NCHW", "OIHW", "NCHW"))
  losses = jnp.sum((out - (y if batched else y[None])) ** 2, axis=(1, 2, 3))
  return losses if batched else losses[0]


def conv_setup(batch=3):
  params = {"c1": {"w": _normal(10, (3, 3, 2, 6)), "b": _normal(11, (6,))},
            "c2": {"w": _normal(12, (2, 6, 2, 2))}}
  # Output: (3, 5) after c1's stride (2, 1); (5, 5) dilated, (4, 4) after c2.
  return params, _normal(13, (batch, 6, 5, 4)), _normal(14, (batch, 2, 4, 4))


def embed_loss(params, ids, y, batched=False):
  e = gl.embed(ids, params["emb"], name="emb")
  out = gl.dense(e, params["proj"]["w"], params["proj"]["b"], name="proj")
  return jnp.sum((out - y) ** 2, axis=(-2, -1))


def embed_setup(batch=4):
  params = {"emb": _normal(15, (7, 3)), "proj": {"w": _normal(16, (3, 2)),
                                                 "b": _normal(17, (2,))}}
  ids = jnp.array([[0, 1, 0, 6, 1, 0], [2, 2, 2, 2, 2, 2], [3, 4, 5, 6, 0, 1],
                   [6, 6, 1, 1, 0, 5]])[:batch]
  return params, ids, _normal(18, (batch, 6, 2))


MODELS = {
    "mlp": (mlp_loss, mlp_setup),
    "sequence": (seq_loss, seq_setup),
    "conv": (conv_loss, conv_setup),
    "embedding": (embed_loss, embed_setup),
}


def _check_norms(norms, grads):
  """Per-layer and total norms against the explicit per-example gradients."""
  assert sorted(norms.layers) == sorted(grads)
  for name, layer_grads in grads.items():
    np.testing.assert_allclose(norms.layers[name], _norms(layer_grads), rtol=RTOL, atol=ATOL)
  np.testing.assert_allclose(norms.norms, _norms(grads), rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("model", list(MODELS))
def test_per_example_norms_match_vmap_grad(model):
  example_loss, setup = MODELS[model]
  params, *data = setup()
  # True computation: per-example gradients by vmap(grad).
  grads = _per_example_grads(example_loss, params, *data)
  # Library computation: one backward pass of the mean loss, under jit, three ways.
  methods = ("auto", "gram", "materialized")

  @jax.jit
  def step(params, *data):
    records = gl.reap(jax.grad(_batch_loss(example_loss)))(params, *data)
    return [gl.per_example_norms(records, method=method) for method in methods]

  results = step(params, *data)
  for method, norms in zip(methods, results):
    _check_norms(norms, grads)
    if method != "auto":
      assert set(norms.method.values()) == {method}
  auto = {"mlp": {"fc1": "gram", "fc2": "gram"},
          "sequence": {"up": "materialized", "down": "materialized"},
          "conv": {"c1": "materialized", "c2": "materialized"},
          "embedding": {"emb": "gram", "proj": "materialized"}}[model]
  assert results[0].method == auto


def _dense_loss(w, x):
  return jnp.sum(gl.dense(x, w, name="fc") ** 2)


def test_auto_method_follows_the_cost_model():
  # (T, d_in, d_out) -> Gram iff T (d_in + d_out) <= d_in d_out. Only traced.
  for (tokens, d_in, d_out), expected in {(3, 8, 8): "gram", (5, 4, 6): "materialized",
                                          (1, 2, 2): "gram", (16, 8, 8): "materialized"}.items():
    norms = jax.eval_shape(lambda w, x: gl.per_example_norms(gl.reap(jax.grad(_dense_loss))(
        w, x)), jnp.ones((d_in, d_out)), jnp.ones((2, tokens, d_in)))
    assert norms.method == {"fc": expected}, (tokens, d_in, d_out)


def test_sum_reduction_and_eager():
  params, x, y = mlp_setup()
  grads = _per_example_grads(mlp_loss, params, x, y)
  records = gl.reap(jax.grad(_batch_loss(mlp_loss, "sum")))(params, x, y)
  _check_norms(gl.per_example_norms(records, reduction="sum"), grads)
  # The same records read as a mean loss would be B times too large.
  np.testing.assert_allclose(gl.per_example_norms(records, reduction="mean").norms,
                             x.shape[0] * _norms(grads), rtol=RTOL)


def test_model_written_per_example_and_vmapped_inside_the_loss():
  # The Equinox style: layers see one example; the loss vmaps over the batch.
  for example_loss, setup in (MODELS["sequence"], MODELS["conv"]):
    params, *data = setup()
    grads = _per_example_grads(example_loss, params, *data)

    def loss(params, *data, example_loss=example_loss):
      return jnp.mean(jax.vmap(example_loss, (None,) + (0,) * len(data))(params, *data))

    norms = jax.jit(lambda p, *d, loss=loss: gl.per_example_norms(
        gl.reap(jax.grad(loss))(p, *d)))(params, *data)
    _check_norms(norms, grads)


def test_vmap_over_independent_models():
  # An ensemble of two models on two batches: the analysis runs inside the vmap.
  params, x, y = mlp_setup()
  params2 = jax.tree.map(lambda a: jnp.stack([a, 0.5 * a]), params)
  xs, ys = jnp.stack([x, -x]), jnp.stack([y, 2 * y])
  total = jax.jit(jax.vmap(lambda p, x, y: gl.per_example_norms(
      gl.reap(jax.grad(_batch_loss(mlp_loss)))(p, x, y)).norms))(params2, xs, ys)
  for k in range(2):
    member = jax.tree.map(lambda a, k=k: a[k], params2)
    np.testing.assert_allclose(
        total[k], _norms(_per_example_grads(mlp_loss, member, xs[k], ys[k])), rtol=RTOL)


def test_embedding_of_one_token_per_example():
  def example_loss(params, ids, y):
    e = gl.embed(ids, params["emb"], name="emb")
    return jnp.sum((gl.dense(e, params["fc"], name="fc") - y) ** 2, -1)

  params = {"emb": _normal(25, (5, 3)), "fc": _normal(26, (3, 2))}
  ids, y = jnp.array([4, 0, 4, 2]), _normal(27, (4, 2))
  norms = jax.jit(lambda p, ids, y: gl.per_example_norms(gl.reap(jax.grad(
      lambda p: jnp.mean(example_loss(p, ids, y))))(p)))(params, ids, y)
  _check_norms(norms, _per_example_grads(example_loss, params, ids, y))
  assert norms.method == {"emb": "gram", "fc": "gram"}


def _scan_loss(params, x, y, batched=False):
  """Three stacked layers in a scan (one weight per iteration), then a tied RNN cell."""
  def block(h, p):
    return jnp.tanh(gl.dense(h, p["w"], p["b"], name="block")), None
  h = jax.lax.scan(block, x, params["blocks"])[0]
  def cell(state, h_t):  # One weight for every time step: the calls are tied.
    return jnp.tanh(gl.dense(state, params["cell"], name="cell") + h_t), None
  steps = jnp.moveaxis(h, -2, 0)  # (time, ..., d)
  final = jax.lax.scan(cell, jnp.zeros(steps.shape[1:]), steps)[0]
  return jnp.sum((final - y) ** 2, axis=-1)


def test_stacked_calls_give_norms_per_call_and_tied_calls_sum():
  params = {"blocks": {"w": _normal(20, (3, 4, 4)), "b": _normal(21, (3, 4))},
            "cell": _normal(22, (4, 4), 0.5)}
  x, y = _normal(23, (5, 6, 4)), _normal(24, (5, 4))
  grads = _per_example_grads(_scan_loss, params, x, y)

  @jax.jit
  def step(params, x, y):
    records = gl.reap(jax.grad(_batch_loss(_scan_loss)))(params, x, y)
    return records, gl.per_example_norms(records, tied=("cell",))

  with jax.transfer_guard_device_to_host("disallow"):  # Everything stays on the device.
    records, norms = step(params, x, y)
  assert all(isinstance(leaf, jax.Array) for leaf in jax.tree.leaves((records, norms)))
  assert records["block"].primals[0].w.shape == (3, 4, 4)
  assert records["cell"].out_cotangent.shape == (6, 5, 4)  # (time, batch, d)
  per_call = np.stack([_norms(jax.tree.map(lambda a, i=i: a[:, i], grads["blocks"]))
                       for i in range(3)])
  np.testing.assert_allclose(norms.layers["block"], per_call, rtol=RTOL, atol=ATOL)
  np.testing.assert_allclose(norms.layers["cell"], _norms(grads["cell"]), rtol=RTOL, atol=ATOL)
  np.testing.assert_allclose(norms.norms, _norms(grads), rtol=RTOL, atol=ATOL)


def _embed_scan_loss(params, ids, y, batched=False):
  """Three stacked tables in a scan (one table per field), then one table looked up
  at every step of a scan (tied calls); ids repeat within and across the calls."""
  def field(h, xs):
    table, field_ids = xs
    return h + gl.embed(field_ids, table, name="fields"), None
  h = jax.lax.scan(field, jnp.zeros(ids.shape[1:] + (3,)), (params["fields"], ids))[0]
  def step(h, step_ids):
    return h + gl.embed(step_ids, params["shared"], name="shared"), None
  h = jax.lax.scan(step, h, ids)[0]
  return jnp.sum((jnp.tanh(h) - y) ** 2, axis=(-2, -1))


@pytest.mark.parametrize("method", ["gram", "materialized"])
def test_embedding_norms_per_call_and_with_tied_calls(method):
  params = {"fields": _normal(40, (3, 5, 3)), "shared": _normal(41, (5, 3))}
  ids = jnp.array([[[0, 0, 4], [1, 2, 1]], [[3, 3, 3], [0, 4, 0]],
                   [[4, 0, 1], [1, 1, 2]]])  # (calls, batch, positions)
  y = _normal(42, (2, 3, 3))
  grads = _per_example_grads(_embed_scan_loss, params, jnp.moveaxis(ids, 1, 0), y)
  norms = jax.jit(lambda p, ids, y: gl.per_example_norms(
      gl.reap(jax.grad(_batch_loss(_embed_scan_loss)))(p, ids, y), tied=("shared",),
      method=method))(params, ids, y)
  per_call = np.stack([_norms(grads["fields"][:, i]) for i in range(3)])
  np.testing.assert_allclose(norms.layers["fields"], per_call, rtol=RTOL, atol=ATOL)
  np.testing.assert_allclose(norms.layers["shared"], _norms(grads["shared"]),
                             rtol=RTOL, atol=ATOL)
  assert norms.method == {"fields": method, "shared": method}


def test_flax_style_dot_general_counts_the_bias_added_after_it():
  dot = gl.dense_dot_general(name="fc")

  def example_loss(params, x, y, batched=False):  # What nn.Dense does with the hook.
    y_hat = dot(x, params["kernel"], (((x.ndim - 1,), (0,)), ((), ()))) + params["bias"]
    return jnp.sum((y_hat - y) ** 2, axis=-1)

  params = {"kernel": _normal(30, (5, 3)), "bias": _normal(31, (3,))}
  x, y = _normal(32, (6, 5)), _normal(33, (6, 3))
  records = jax.jit(gl.reap(jax.grad(_batch_loss(example_loss))))(params, x, y)
  grads = _per_example_grads(example_loss, params, x, y)
  np.testing.assert_allclose(gl.per_example_norms(records).norms, _norms(grads), rtol=RTOL)
  with pytest.raises(ValueError, match=r"dense_dot_general\(name='fc'\).*nn.Dense"):
    dot(x, params["kernel"].T, (((1,), (1,)), ((), ())))


def test_flax_dense_marked_with_its_dot_general_hook():
  nn = pytest.importorskip("flax.linen")

  class MLP(nn.Module):
    @nn.compact
    def __call__(self, x):
      x = jnp.tanh(nn.Dense(6, dot_general=gl.dense_dot_general(name="fc1"))(x))
      return nn.Dense(2, use_bias=False,
                      dot_general=gl.dense_dot_general(name="fc2", bias=False))(x)

  x, y = _normal(34, (5, 4, 3)), _normal(35, (5, 4, 2))  # With tokens.
  params = MLP().init(jax.random.PRNGKey(0), x)
  example_loss = lambda p, x, y, batched=False: jnp.sum((MLP().apply(p, x) - y) ** 2, (-2, -1))
  norms = jax.jit(lambda p, x, y: gl.per_example_norms(
      gl.reap(jax.grad(_batch_loss(example_loss)))(p, x, y)))(params, x, y)
  grads = _per_example_grads(example_loss, params, x, y)
  np.testing.assert_allclose(norms.norms, _norms(grads), rtol=RTOL)


def test_equinox_linear_marked_with_gl_dense_per_example():
  eqx = pytest.importorskip("equinox")

  class Model(eqx.Module):
    l1: eqx.nn.Linear
    l2: eqx.nn.Linear

    def __call__(self, x):  # One example; the loss vmaps. Linear holds (out, in).
      h = jnp.tanh(gl.dense(x, self.l1.weight.T, self.l1.bias, name="l1"))
      return gl.dense(h, self.l2.weight.T, self.l2.bias, name="l2")

  k1, k2 = jax.random.split(jax.random.PRNGKey(1))
  model = Model(eqx.nn.Linear(3, 6, key=k1), eqx.nn.Linear(6, 2, key=k2))
  x, y = _normal(36, (5, 3)), _normal(37, (5, 2))
  example_loss = lambda m, x, y: jnp.sum((m(x) - y) ** 2)
  loss = lambda m, x, y: jnp.mean(jax.vmap(example_loss, (None, 0, 0))(m, x, y))
  norms = eqx.filter_jit(lambda m, x, y: gl.per_example_norms(
      gl.reap(eqx.filter_grad(loss))(m, x, y)))(model, x, y)
  grads = jax.vmap(eqx.filter_grad(example_loss), (None, 0, 0))(model, x, y)
  np.testing.assert_allclose(norms.norms, _norms(grads), rtol=RTOL)


@pytest.fixture(scope="module")
def mesh():
  return Mesh(np.array(eight_devices()), ("data",))


def test_sharded_batch_over_eight_devices(mesh):
  params, x, y = seq_setup(batch=16, tokens=3)
  replicated, by_example = NamedSharding(mesh, P()), NamedSharding(mesh, P("data"))

  def analyses(params, x, y):
    records = gl.reap(jax.grad(_batch_loss(seq_loss)))(params, x, y)
    return (gl.per_example_norms(records), gl.gradient_noise_scale(records),
            gl.kfac_factors(records), gl.sum_grad_squared(records))

  sharded = jax.jit(analyses, in_shardings=(replicated, by_example, by_example))
  norms, noise, factors, sgs = sharded(params, x, y)
  grads = _per_example_grads(seq_loss, params, x, y)
  _check_norms(norms, grads)
  assert norms.norms.sharding.is_equivalent_to(by_example, 1)  # Stays split by example.
  single = jax.jit(analyses)(params, x, y)
  for a, b in zip(jax.tree.leaves((norms, noise, factors, sgs)), jax.tree.leaves(single)):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


# ----------------------------------------------------------------------------------
# K-FAC factors, SumGradSquared, Variance.


def _layer_inputs_and_output_grads(params, x, y):
  """True computation for `seq_loss`: each dense layer's input and per-example output
  gradient dl_i/dy, by perturbing each layer's output with a zero delta."""
  def example(params, x, y, deltas):
    pre = x @ params["up"]["w"] + params["up"]["b"] + deltas["up"]
    h = jax.nn.gelu(pre)
    out = h @ params["down"]["w"] + deltas["down"]
    return jnp.mean(jnp.sum((out - y) ** 2, -1))
  deltas = {"up": jnp.zeros(x.shape[1:2] + (6,)), "down": jnp.zeros(x.shape[1:])}
  g = jax.vmap(jax.grad(example, argnums=3), (None, 0, 0, None))(params, x, y, deltas)
  h = jax.nn.gelu(x @ params["up"]["w"] + params["up"]["b"])
  ones = jnp.ones(x.shape[:-1] + (1,))
  return {"up": (np.concatenate([x, ones], -1), g["up"]), "down": (np.asarray(h), g["down"])}


@pytest.mark.parametrize("approximation", ["expand", "reduce"])
def test_kfac_factors_match_direct_computation(approximation):
  params, x, y = seq_setup(batch=4, tokens=3)
  factors = jax.jit(lambda p, x, y: gl.kfac_factors(
      gl.reap(jax.grad(_batch_loss(seq_loss)))(p, x, y), approximation=approximation))(
          params, x, y)
  for name, (a_in, g_out) in _layer_inputs_and_output_grads(params, x, y).items():
    a_in, g_out = np.asarray(a_in, np.float64), np.asarray(g_out, np.float64)
    batch, tokens = g_out.shape[:2]
    if approximation == "expand":
      a = np.einsum("btd,bte->de", a_in, a_in) / (batch * tokens)
      g = np.einsum("btd,bte->de", g_out, g_out) / batch
    else:
      a_mean, g_sum = a_in.mean(1), g_out.sum(1)
      a, g = a_mean.T @ a_mean / batch, g_sum.T @ g_sum / batch
    np.testing.assert_allclose(factors[name].a, a, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(factors[name].g, g, rtol=1e-5, atol=1e-6)


def test_kfac_moving_average_across_steps():
  params, x, y = mlp_setup()
  ema = gl.moving_average(decay=0.8)

  @jax.jit
  def steps(params, x, y):
    def step(state, scale):
      records = gl.reap(jax.grad(_batch_loss(mlp_loss)))(params, scale * x, y)
      factors = gl.kfac_factors(records)
      return ema.update(factors, state)[1], factors
    state = ema.init(gl.kfac_factors(gl.reap(jax.grad(_batch_loss(mlp_loss)))(params, x, y)))
    return jax.lax.scan(step, state, jnp.array([1.0, 0.5, 2.0]))

  state, history = steps(params, x, y)
  expected = jax.tree.map(jnp.zeros_like, jax.tree.map(lambda h: h[0], history))
  for k in range(3):
    expected = jax.tree.map(lambda e, h, k=k: 0.8 * e + 0.2 * h[k], expected, history)
  np.testing.assert_allclose(state.value["fc1"].a, expected["fc1"].a, rtol=1e-6)
  np.testing.assert_allclose(state.debiased["fc2"].g, expected["fc2"].g / (1 - 0.8 ** 3),
                             rtol=1e-6)
  assert int(state.steps) == 3
  # One step's factor for vector inputs, directly: A = E[[x, 1][x, 1]^T].
  xb = np.concatenate([np.asarray(x, np.float64) * 2.0, np.ones((x.shape[0], 1))], 1)
  np.testing.assert_allclose(history["fc1"].a[2], xb.T @ xb / x.shape[0], rtol=1e-5)


@pytest.mark.parametrize("model,chunk_size", [("mlp", None), ("sequence", None),
                                              ("sequence", 2)])
def test_sum_grad_squared_and_variance_match_vmap_grad(model, chunk_size):
  example_loss, setup = MODELS[model]
  params, *data = setup()
  grads = _per_example_grads(example_loss, params, *data)

  @jax.jit
  def moments(params, *data):
    records = gl.reap(jax.grad(_batch_loss(example_loss)))(params, *data)
    return (gl.sum_grad_squared(records, chunk_size=chunk_size),
            gl.gradient_variance(records, chunk_size=chunk_size))

  sgs, variance = moments(params, *data)
  for name, layer in grads.items():
    for field in ("w", "b"):
      if field not in layer:
        assert getattr(sgs[name], field) is None
        continue
      per_example = np.asarray(layer[field], np.float64)
      np.testing.assert_allclose(getattr(sgs[name], field), (per_example ** 2).sum(0),
                                 rtol=1e-5, atol=1e-6)
      np.testing.assert_allclose(getattr(variance[name], field), per_example.var(0),
                                 rtol=1e-4, atol=1e-5)


def test_curvature_rejects_layers_it_does_not_support():
  params, ids, y = embed_setup()
  records = jax.eval_shape(gl.reap(jax.grad(_batch_loss(embed_loss))), params, ids, y)
  assert list(jax.eval_shape(gl.kfac_factors, records)) == ["proj"]  # Not named: skipped.
  with pytest.raises(ValueError, match=r"kfac_factors\(names=...\): 'emb' is a layer of kind "
                     r"'embed', which kfac_factors does not support"):
    gl.kfac_factors(records, names=["emb", "proj"])


# ----------------------------------------------------------------------------------
# Gradient noise scale.


def _noise_reference(grads, batch):
  flat = np.asarray(_flat(grads), np.float64)
  mean_sq = np.mean(np.sum(flat ** 2, 1))
  batch_sq = np.sum(flat.mean(0) ** 2)
  grad_sq = (batch * batch_sq - mean_sq) / (batch - 1)
  trace = (mean_sq - batch_sq) * batch / (batch - 1)
  return grad_sq, trace


@pytest.mark.parametrize("model", ["mlp", "conv", "embedding"])
def test_gradient_noise_scale_matches_per_example_gradients(model):
  example_loss, setup = MODELS[model]
  params, *data = setup()
  grads = _per_example_grads(example_loss, params, *data)
  batch = data[0].shape[0]
  noise = jax.jit(lambda p, *d: gl.gradient_noise_scale(
      gl.reap(jax.grad(_batch_loss(example_loss)))(p, *d)))(params, *data)
  grad_sq, trace = _noise_reference(grads, batch)
  np.testing.assert_allclose([noise.total.grad_sq, noise.total.trace], [grad_sq, trace],
                             rtol=1e-4)
  np.testing.assert_allclose(noise.total.b_simple, trace / grad_sq, rtol=1e-4)
  for name, layer_grads in grads.items():
    grad_sq, trace = _noise_reference(layer_grads, batch)
    layer = noise.layers[name]
    np.testing.assert_allclose([layer.grad_sq, layer.trace], [grad_sq, trace], rtol=1e-4,
                               atol=1e-5)
    np.testing.assert_allclose(layer.snr, grad_sq * batch / trace, rtol=1e-3)


def test_noise_scale_tracked_with_a_moving_average_of_its_estimates():
  params, x, y = mlp_setup(batch=8)
  ema = gl.moving_average(decay=0.5)
  noise_of = jax.jit(lambda p, x, y: gl.gradient_noise_scale(
      gl.reap(jax.grad(_batch_loss(mlp_loss)))(p, x, y)))
  batches = [(x, y), (x[::-1] * 0.5, y), (x + 1.0, -y)]
  state = ema.init(noise_of(params, *batches[0]))
  estimates = []
  for xb, yb in batches:
    estimates.append(_noise_reference(_per_example_grads(mlp_loss, params, xb, yb), 8))
    _, state = ema.update(noise_of(params, xb, yb), state)
  grad_sq = sum(0.5 ** (2 - k) * 0.5 * g for k, (g, _) in enumerate(estimates))
  trace = sum(0.5 ** (2 - k) * 0.5 * t for k, (_, t) in enumerate(estimates))
  np.testing.assert_allclose(state.debiased.total.b_simple, trace / grad_sq, rtol=1e-4)
  assert state.debiased.total.batch_size == 8


def test_noise_scale_needs_a_batch_of_two():
  params, x, y = mlp_setup(batch=1)
  records = jax.eval_shape(gl.reap(jax.grad(_batch_loss(mlp_loss))), params, x, y)
  with pytest.raises(ValueError, match="gradient_noise_scale: .* a batch of at least 2"):
    jax.eval_shape(gl.gradient_noise_scale, records)


# ----------------------------------------------------------------------------------
# Where did the NaN come from.


def _nan_loss(params, x):
  """fc1 -> tanh -> fc2 -> sqrt(|.|) -> fc3: sqrt'(0) = inf times sign'(0) = 0 is NaN at
  the output of fc2 for an example whose input is all zeros."""
  h = jnp.tanh(gl.dense(x, params["w1"], name="fc1"))
  h = jnp.sqrt(jnp.abs(gl.dense(h, params["w2"], name="fc2")))
  return jnp.mean(jnp.sum(gl.dense(h, params["w3"], name="fc3") ** 2, -1))


def test_find_nonfinite_names_the_site_nearest_the_loss():
  params = {"w1": _normal(40, (3, 4)), "w2": _normal(41, (4, 4)), "w3": _normal(42, (4, 2))}
  x = _normal(43, (5, 3)).at[2].set(0.0)
  @jax.jit
  def step(params, x):
    records = gl.reap(jax.grad(_nan_loss))(params, x)
    return records, gl.find_nonfinite(records, ["fc1", "fc2", "fc3"])

  records, report = step(params, x)
  # True computation: which cotangents are non-finite, by plain inspection.
  assert not np.isfinite(records["fc2"].out_cotangent[2]).all()
  assert np.isfinite(records["fc3"].in_cotangents[0].x).all()
  assert bool(report.found) and report.sites[int(report.site)] == ("fc2", "output")
  assert int(report.call) == 0
  np.testing.assert_array_equal(report.examples, np.arange(5) == 2)
  with pytest.raises(FloatingPointError, match=r"output cotangent of 'fc2', examples \[2\] "
                     r"\(1 of 5\)\. The backward pass reached it right after the input "
                     r"cotangents of 'fc3'.*'fc3' <- 'fc2' <- 'fc1'"):
    gl.raise_if_nonfinite(report)
  # A finite step reports nothing.
  _, clean = step(params, x.at[2].set(1.0))
  assert not bool(clean.found) and int(clean.site) == -1 and not clean.examples.any()
  gl.raise_if_nonfinite(clean)


def test_find_nonfinite_with_interleaved_names_in_a_scan():
  # Three blocks in a scan, each calling "a" then "m"; block 1's gate is 0, so
  # sqrt'(0) * 0 is NaN at the output cotangent of "a" in call 1.
  def loss(params, x):
    def block(h, p):
      a = jnp.sqrt(jnp.abs(gl.dense(h, p["wa"], name="a")) * p["gate"])
      return h + gl.dense(jnp.tanh(a), p["wm"], name="m"), None
    return jnp.sum(jax.lax.scan(block, x, params)[0] ** 2)

  params = {"wa": _normal(50, (3, 4, 4)), "wm": _normal(51, (3, 4, 4)),
            "gate": jnp.array([1.0, 0.0, 1.0])}
  records = jax.jit(gl.reap(jax.grad(loss)))(params, _normal(52, (2, 4)))
  report = gl.find_nonfinite(records, [("a", "m")])
  assert report.sites[int(report.site)] == ("a", "output") and int(report.call) == 1
  assert np.all(np.isfinite(records["m"].out_cotangent[1]))  # Nearer the loss: finite.
  np.testing.assert_array_equal(report.examples, [True, True])
  assert "call 1 of 3" in report.describe() and "input cotangents of 'm', call 1" in (
      report.describe())
  # Listing the names one after the other (all "a" calls first) is another order.
  assert gl.find_nonfinite(records, ["a", "m"]).sites[0] == ("a", "inputs")


def test_find_nonfinite_inside_a_recorded_function_and_for_taps():
  # sqrt(0) is finite, so is the cotangent 2 sqrt(0) of its output; sqrt'(0) is not.
  sqrt_layer = gl.record_vjp(jnp.sqrt, name="sqrt", full=True)
  loss = lambda x: jnp.sum(gl.tap(sqrt_layer(x) ** 2, name="out"))
  records = gl.reap(jax.grad(loss))(jnp.array([[1.0, 2.0], [0.5, 0.0]]))
  report = gl.find_nonfinite(records, ["sqrt", "out"], call_axes=0)
  assert report.sites[int(report.site)] == ("sqrt", "inputs")
  np.testing.assert_array_equal(report.examples, [False, True])
  assert "backward pass of the function recorded as 'sqrt' itself" in report.describe()


def test_find_nonfinite_needs_every_name_once_in_order():
  records = jax.eval_shape(gl.reap(jax.grad(_nan_loss)), {
      "w1": jnp.ones((3, 4)), "w2": jnp.ones((4, 4)), "w3": jnp.ones((4, 2))}, jnp.ones((2, 3)))
  with pytest.raises(ValueError, match=r"records \['fc3'\] are not in order"):
    gl.find_nonfinite(records, ["fc1", "fc2"])
  with pytest.raises(ValueError, match=r"need an order: pass order="):
    gl.find_nonfinite(records)


# ----------------------------------------------------------------------------------
# Marking layers: what the records hold, and errors.


def test_layer_records_describe_the_layer():
  params, x, y = conv_setup()
  records = jax.jit(gl.reap(jax.grad(_batch_loss(conv_loss))))(params, x, y)
  layer = records["c1"].primals[0]
  assert layer.kind == "conv" and layer.options["feature_group_count"] == 2
  assert layer.w.shape == (3, 3, 2, 6) and records["c1"].in_cotangents[0].b.shape == (6,)
  # The layers compute what plain JAX computes, and record the batch gradient.
  np.testing.assert_allclose(records["c1"].in_cotangents[0].w,
                             jax.grad(_batch_loss(conv_loss))(params, x, y)["c1"]["w"],
                             rtol=1e-5, atol=1e-6)


def test_errors_name_the_api_the_record_and_the_fix():
  with pytest.raises(ValueError, match=r"dense\(name='fc'\): .*Transpose w"):
    gl.dense(jnp.ones((2, 3)), jnp.ones((4, 3)), name="fc")
  with pytest.raises(ValueError, match=r"conv2d\(name='c'\): .*x\[None\]"):
    gl.conv2d(jnp.ones((4, 4, 1)), jnp.ones((3, 3, 1, 1)), name="c")
  with pytest.raises(ValueError, match=r"embed\(name='e'\): .*integer ids"):
    gl.embed(jnp.ones((2,)), jnp.ones((3, 2)), name="e")
  loss = lambda w, x: jnp.sum(gl.tap(gl.dense(x, w, name="fc"), name="h") ** 2)
  records = jax.eval_shape(gl.reap(jax.grad(loss)), jnp.ones((3, 2)), jnp.ones((4, 3)))
  norms = jax.eval_shape(gl.per_example_norms, records)
  assert list(norms.layers) == ["fc"]  # The tap is left out.
  with pytest.raises(ValueError, match=r"per_example_norms\(names=...\): 'h' is not a layer "
                     r"record \(record the model with gl.record_layers, or mark the layer with gl.dense"):
    gl.per_example_norms(records, names=["fc", "h"])
  with pytest.raises(ValueError, match=r"per_example_norms: none of the records \['h'\]"):
    gl.per_example_norms({"h": records["h"]})
  with pytest.raises(ValueError, match=r"reduction='none'.*'mean'"):
    gl.per_example_norms(records, reduction="none")
  one_example = jax.eval_shape(gl.reap(jax.grad(loss)), jnp.ones((3, 2)), jnp.ones(3))
  with pytest.raises(ValueError, match=r"record 'fc' has input x of shape \(3,\) .*no example "
                     r"axis"):
    gl.per_example_norms(one_example)
