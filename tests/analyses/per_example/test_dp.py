"""DP-SGD from one backward pass, against `vmap(grad)` and explicit clipping.

The true computation forms every example's gradient with
`jax.vmap(jax.grad(example_loss))`, takes its norm over all the parameters, scales
it by `min(1, C / norm)` and sums (or averages) in plain JAX; the library computes
the same from the layer records of one ordinary backward pass. Relative errors are
per parameter, `|actual - expected| / |expected|` (Frobenius norms), at most 1e-5.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from conftest import eight_devices

import oryx_gradlog as gl

REL_ERR = 1e-5


def _normal(key, shape, scale=1.0):
  return scale * jax.random.normal(jax.random.PRNGKey(key), shape)


def _layer(key, d_in, d_out, bias=True):
  w = _normal(key, (d_in, d_out), 1 / np.sqrt(d_in))
  return {"w": w, "b": _normal(key + 1000, (d_out,), 0.1)} if bias else {"w": w}


def _where(params):
  """`{name: {"w": ..., "b": ...}}` parameters -> `{name: {"w": "name.w", ...}}`; a
  stack of layers `{"blocks": {name: {...}}}` alike."""
  def source(path, _):
    keys = [p.key for p in path]
    return f"{keys[-2]}.{keys[-1]}"
  return jax.tree_util.tree_map_with_path(source, params)


def _reference(example_loss, params, data, l2_norm_clip, reduction):
  """True computation: per-example gradients, clipped by their norm, summed (or mean)."""
  in_axes = (None,) + (0,) * len(data)
  grads = jax.jit(jax.vmap(jax.grad(example_loss), in_axes=in_axes))(params, *data)
  leaves = [np.asarray(g, np.float64) for g in jax.tree.leaves(grads)]
  batch = leaves[0].shape[0]
  norms = np.sqrt(sum(np.sum(g.reshape(batch, -1) ** 2, axis=1) for g in leaves))
  factors = np.minimum(1.0, l2_norm_clip / np.maximum(norms, 1e-30))
  divisor = batch if reduction == "mean" else 1
  clipped = jax.tree.map(
      lambda g: np.tensordot(factors, np.asarray(g, np.float64), axes=1) / divisor, grads)
  return clipped, norms


def _assert_rel_err(actual, expected, tol=REL_ERR):
  assert jax.tree.structure(actual) == jax.tree.structure(expected)
  paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(expected)[0]]
  for path, a, e in zip(paths, jax.tree.leaves(actual), jax.tree.leaves(expected)):
    a, e = np.asarray(a, np.float64), np.asarray(e, np.float64)
    assert a.shape == e.shape, (path, a.shape, e.shape)
    err = np.linalg.norm(a - e) / max(np.linalg.norm(e), 1e-30)
    assert err <= tol, f"{path}: relative error {err:.2e}"


def _batch_loss(example_loss, reduction):
  def loss(params, *data):
    losses = example_loss(params, *data, batched=True)
    return jnp.mean(losses) if reduction == "mean" else jnp.sum(losses)
  return loss


def _dp_grads(example_loss, reduction, l2_norm_clip, **kwargs):
  """Library computation: records of one backward pass -> clipped grads on the tree."""
  def step(params, *data):
    records = gl.reap(jax.grad(_batch_loss(example_loss, reduction)))(params, *data)
    clipped = gl.per_example_clip(records, l2_norm_clip=l2_norm_clip, reduction=reduction,
                               **kwargs)
    return gl.to_param_tree(clipped.layers, params, _where(params)), clipped.norms
  return step


# ----------------------------------------------------------------------------------
# Models: `example_loss(params, *example, batched=False)` is example i's loss; with
# batched=True the same code runs on the batch and returns the (batch,) losses.


def mlp_loss(params, x, y, batched=False):
  h = jnp.tanh(gl.dense(x, params["fc1"]["w"], params["fc1"]["b"], name="fc1"))
  h = jnp.tanh(gl.dense(h, params["fc2"]["w"], params["fc2"]["b"], name="fc2"))
  return jnp.sum((gl.dense(h, params["fc3"]["w"], name="fc3") - y) ** 2, axis=-1)


def mlp_setup(batch=8):
  params = {"fc1": _layer(0, 5, 7), "fc2": _layer(1, 7, 6), "fc3": _layer(2, 6, 3, False)}
  return params, (_normal(3, (batch, 5)), _normal(4, (batch, 3)))


def seq_loss(params, x, y, batched=False):
  """Dense layers over tokens; the example's loss is the mean over its tokens."""
  h = jax.nn.gelu(gl.dense(x, params["up"]["w"], params["up"]["b"], name="up"))
  out = gl.dense(h, params["down"]["w"], params["down"]["b"], name="down")
  return jnp.mean(jnp.sum((out - y) ** 2, axis=-1), axis=-1)


def seq_setup(batch=8, tokens=5):
  params = {"up": _layer(5, 4, 9), "down": _layer(6, 9, 4)}
  return params, (_normal(7, (batch, tokens, 4)), _normal(8, (batch, tokens, 4)))


def conv_loss(params, x, batched=False):
  """Strided, dilated, grouped, padded convolutions in two layouts."""
  x = x if batched else x[None]
  h = gl.conv2d(x, params["c1"]["w"], params["c1"]["b"], name="c1", window_strides=(2, 1),
                rhs_dilation=(1, 2), feature_group_count=2)
  h = jnp.transpose(jnp.tanh(h), (0, 3, 1, 2))
  h = gl.conv2d(h, params["c2"]["w"], params["c2"]["b"], name="c2",
                padding=((1, 0), (0, 2)), lhs_dilation=(2, 1),
                dimension_numbers=("NCHW", "OIHW", "NCHW"))
  losses = jnp.sum((jnp.tanh(h) - 0.3) ** 2, axis=(1, 2, 3))
  return losses if batched else losses[0]


def conv_setup(batch=6):
  params = {"c1": {"w": _normal(10, (3, 3, 2, 6), 0.3), "b": _normal(11, (6,), 0.1)},
            "c2": {"w": _normal(12, (2, 6, 2, 2), 0.3), "b": _normal(13, (2,), 0.1)}}
  return params, (_normal(14, (batch, 6, 5, 4)),)


VOCAB, WIDTH, HEADS, TOKENS = 7, 8, 2, 5


def transformer_loss(params, ids, y, batched=False):
  """Embedding, pre-norm attention and MLP with layer norms, an output head."""
  h = gl.embed(ids, params["emb"]["w"], name="emb")
  a = gl.layer_norm(h, params["ln1"]["w"], params["ln1"]["b"], name="ln1")
  q, k, v = (gl.dense(a, params[n]["w"], name=n).reshape(a.shape[:-1] + (HEADS, -1))
             for n in ("q", "k", "v"))
  logits = jnp.einsum("...qhd,...khd->...hqk", q, k) / np.sqrt(q.shape[-1])
  attended = jnp.einsum("...hqk,...khd->...qhd", jax.nn.softmax(logits), v)
  h = h + gl.dense(attended.reshape(a.shape), params["o"]["w"], params["o"]["b"], name="o")
  m = gl.layer_norm(h, params["ln2"]["w"], params["ln2"]["b"], name="ln2")
  up = jax.nn.gelu(gl.dense(m, params["up"]["w"], params["up"]["b"], name="up"))
  h = h + gl.dense(up, params["down"]["w"], params["down"]["b"], name="down")
  out = gl.dense(h, params["head"]["w"], name="head")
  return jnp.mean(jnp.sum((out - y) ** 2, axis=-1), axis=-1)


def transformer_setup(batch=8):
  params = {"emb": {"w": _normal(20, (VOCAB, WIDTH))},
            "ln1": {"w": 1 + _normal(21, (WIDTH,), 0.1), "b": _normal(22, (WIDTH,), 0.1)},
            "ln2": {"w": 1 + _normal(23, (WIDTH,), 0.1), "b": _normal(24, (WIDTH,), 0.1)},
            **{n: _layer(25 + i, WIDTH, WIDTH, n == "o") for i, n in enumerate("qkvo")},
            "up": _layer(30, WIDTH, 2 * WIDTH), "down": _layer(31, 2 * WIDTH, WIDTH),
            "head": _layer(32, WIDTH, 3, False)}
  ids = jax.random.randint(jax.random.PRNGKey(33), (batch, TOKENS), 0, VOCAB)
  ids = ids.at[0].set(jnp.array([1, 1, 1, 2, 1]))  # Repeated ids.
  return params, (ids, _normal(34, (batch, TOKENS, 3)))


MODELS = {
    "dense": (mlp_loss, mlp_setup),
    "dense_sequence": (seq_loss, seq_setup),
    "conv2d": (conv_loss, conv_setup),
    "transformer": (transformer_loss, transformer_setup),
}


def _clip_norm(example_loss, params, data):
  """A clip norm that clips about half the examples."""
  _, norms = _reference(example_loss, params, data, 1.0, "sum")
  return float(np.median(norms))


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("model", list(MODELS))
def test_clipped_grads_match_vmap_grad_and_clipping_under_jit(model, reduction):
  example_loss, setup = MODELS[model]
  params, data = setup()
  l2_norm_clip = _clip_norm(example_loss, params, data)
  # True computation.
  expected, expected_norms = _reference(example_loss, params, data, l2_norm_clip, reduction)
  # Library computation, under jit.
  grads, norms = jax.jit(_dp_grads(example_loss, reduction, l2_norm_clip))(params, *data)
  # Comparison.
  np.testing.assert_allclose(norms, expected_norms, rtol=REL_ERR)
  assert 0 < np.mean(expected_norms > l2_norm_clip) < 1  # Some clipped, some not.
  _assert_rel_err(grads, expected)


def test_eager_and_a_large_clip_norm_give_the_plain_gradient():
  params, data = transformer_setup()
  loss = _batch_loss(transformer_loss, "mean")
  grads, _ = _dp_grads(transformer_loss, "mean", 1e6)(params, *data)  # Eager.
  _assert_rel_err(grads, jax.grad(loss)(params, *data))


def test_embedding_with_one_token_per_example_and_repeated_ids():
  def example_loss(params, ids, y, batched=False):
    e = gl.embed(ids, params["emb"]["w"], name="emb")
    return jnp.sum((gl.dense(e, params["fc"]["w"], params["fc"]["b"], name="fc") - y) ** 2, -1)

  params = {"emb": {"w": _normal(40, (5, 3))}, "fc": _layer(41, 3, 2)}
  data = (jnp.array([4, 0, 4, 2, 4, 1]), _normal(42, (6, 2)))
  l2_norm_clip = _clip_norm(example_loss, params, data)
  expected, _ = _reference(example_loss, params, data, l2_norm_clip, "mean")
  grads, _ = jax.jit(_dp_grads(example_loss, "mean", l2_norm_clip))(params, *data)
  _assert_rel_err(grads, expected)


def scan_loss(params, x, y, batched=False):
  """A stack of three (layer norm, dense) blocks in a scan, then a tied RNN cell."""
  def block(h, p):
    h = gl.layer_norm(h, p["ln"]["w"], p["ln"]["b"], name="ln")
    return h + jnp.tanh(gl.dense(h, p["fc"]["w"], p["fc"]["b"], name="fc")), None
  h = jax.lax.scan(block, x, params["blocks"])[0]
  def cell(state, h_t):  # One weight for every time step: tied calls.
    return jnp.tanh(gl.dense(state, params["cell"]["w"], name="cell") + h_t), None
  final = jax.lax.scan(cell, jnp.zeros(h.shape[:-2] + h.shape[-1:]), jnp.moveaxis(h, -2, 0))[0]
  return jnp.sum((final - y) ** 2, axis=-1)


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_stack_of_layers_under_scan_and_a_tied_cell(reduction):
  params = {"blocks": {"ln": {"w": 1 + _normal(50, (3, 4), 0.1), "b": _normal(51, (3, 4), 0.1)},
                       "fc": {"w": _normal(52, (3, 4, 4), 0.5), "b": _normal(53, (3, 4), 0.1)}},
            "cell": {"w": _normal(54, (4, 4), 0.5)}}
  data = (_normal(55, (6, 5, 4)), _normal(56, (6, 4)))
  l2_norm_clip = _clip_norm(scan_loss, params, data)
  expected, expected_norms = _reference(scan_loss, params, data, l2_norm_clip, reduction)
  step = _dp_grads(scan_loss, reduction, l2_norm_clip, tied=("cell",))
  with jax.transfer_guard_device_to_host("disallow"):  # Everything stays on the device.
    grads, norms = jax.jit(step)(params, *data)
  np.testing.assert_allclose(norms, expected_norms, rtol=REL_ERR)
  _assert_rel_err(grads, expected)


def test_model_applied_per_example_under_a_vmap_inside_the_loss():
  # The Equinox style, with conv2d's own batch axis of one under the vmap.
  params, data = conv_setup()
  l2_norm_clip = _clip_norm(conv_loss, params, data)
  expected, _ = _reference(conv_loss, params, data, l2_norm_clip, "mean")

  @jax.jit
  def step(params, x):
    loss = lambda p, x: jnp.mean(jax.vmap(conv_loss, (None, 0))(p, x))
    clipped = gl.per_example_clip(gl.reap(jax.grad(loss))(params, x), l2_norm_clip=l2_norm_clip)
    return gl.to_param_tree(clipped.layers, params, _where(params))

  _assert_rel_err(step(params, *data), expected)


def test_flax_style_dot_general_clips_the_bias_added_after_it():
  dot = gl.dense_dot_general(name="fc")

  def example_loss(params, x, y, batched=False):
    y_hat = dot(x, params["fc"]["w"], (((x.ndim - 1,), (0,)), ((), ()))) + params["fc"]["b"]
    return jnp.sum((y_hat - y) ** 2, axis=(-2, -1))

  params, data = {"fc": _layer(60, 5, 3)}, (_normal(61, (6, 4, 5)), _normal(62, (6, 4, 3)))
  l2_norm_clip = _clip_norm(example_loss, params, data)
  expected, _ = _reference(example_loss, params, data, l2_norm_clip, "sum")
  grads, _ = jax.jit(_dp_grads(example_loss, "sum", l2_norm_clip))(params, *data)
  _assert_rel_err(grads, expected)


def test_batch_sharded_over_eight_devices():
  mesh = Mesh(np.array(eight_devices()), ("data",))
  replicated, by_example = NamedSharding(mesh, P()), NamedSharding(mesh, P("data"))
  params, data = transformer_setup(batch=16)
  l2_norm_clip = _clip_norm(transformer_loss, params, data)
  expected, expected_norms = _reference(transformer_loss, params, data, l2_norm_clip, "mean")
  step = jax.jit(_dp_grads(transformer_loss, "mean", l2_norm_clip),
                 in_shardings=(replicated, by_example, by_example))
  grads, norms = step(params, *data)
  assert norms.sharding.is_equivalent_to(by_example, 1)  # Stays split by example.
  np.testing.assert_allclose(norms, expected_norms, rtol=REL_ERR)
  _assert_rel_err(grads, expected)


def test_poisson_padding_examples_have_weight_zero_and_no_effect():
  params, (x, y) = mlp_setup(batch=40)
  batch = jax.jit(lambda key: gl.poisson_batch(key, 40, sampling_rate=0.25, batch_size=16))(
      jax.random.PRNGKey(3))
  count = int(batch.count)
  assert 0 < count <= 16 and batch.indices.shape == batch.weights.shape == (16,)
  np.testing.assert_array_equal(batch.weights, np.arange(16) < count)
  assert len(set(np.asarray(batch.indices[:count]).tolist())) == count
  weighted = lambda p, x, y, w, batched=False: w * mlp_loss(p, x, y)
  data = (x[batch.indices], y[batch.indices], batch.weights)
  grads, norms = jax.jit(_dp_grads(weighted, "sum", 0.5))(params, *data)
  # True computation: only the sampled examples, no padding.
  sampled = tuple(a[batch.indices[:count]] for a in (x, y))
  expected, _ = _reference(lambda p, x, y: mlp_loss(p, x, y), params, sampled, 0.5, "sum")
  _assert_rel_err(grads, expected)
  np.testing.assert_array_equal(norms[count:], 0.0)


# ----------------------------------------------------------------------------------
# Noise, the optax-style transform, accounting.


@pytest.mark.parametrize("reduction,stddev", [("sum", 0.5 * 2.0), ("mean", 0.5 * 2.0 / 8)])
def test_noise_has_the_dp_sgd_scale(reduction, stddev):
  params, data = mlp_setup()
  records = gl.reap(jax.grad(_batch_loss(mlp_loss, reduction)))(params, *data)
  clipped = gl.per_example_clip(records, l2_norm_clip=0.5, reduction=reduction)
  noisy = jax.jit(lambda c, k: gl.add_dp_noise(c, k, noise_multiplier=2.0))(
      clipped, jax.random.PRNGKey(7))
  noise = np.concatenate([np.ravel(n - c) for n, c in zip(
      jax.tree.leaves(noisy.layers), jax.tree.leaves(clipped.layers))])
  assert noise.size > 100
  assert abs(np.std(noise) / stddev - 1) < 0.15 and abs(np.mean(noise)) < 0.3 * stddev
  np.testing.assert_array_equal(noisy.norms, clipped.norms)


def test_dp_noise_transform_in_an_optax_chain():
  optax = pytest.importorskip("optax")
  params = {"w": jnp.zeros(4000)}
  optimizer = optax.chain(gl.dp_noise(l2_norm_clip=1.0, noise_multiplier=3.0,
                                      batch_size=10, seed=1), optax.sgd(1.0))
  state = optimizer.init(params)
  first, state = jax.jit(optimizer.update)({"w": jnp.ones(4000)}, state)
  second, _ = jax.jit(optimizer.update)({"w": jnp.ones(4000)}, state)
  np.testing.assert_allclose(np.std(first["w"]), 0.3, rtol=0.05)  # sigma C / B
  np.testing.assert_allclose(np.mean(first["w"]), -1.0, atol=0.03)  # sgd: -lr * update
  assert not np.allclose(first["w"], second["w"])  # A fresh key every step.


def test_accounting_epsilon_and_its_inverse():
  pytest.importorskip("dp_accounting")
  kwargs = dict(sampling_rate=0.01, steps=1000, delta=1e-5)
  eps = gl.dp_epsilon(noise_multiplier=1.1, **kwargs)
  assert 1.0 < eps < 3.0
  assert gl.dp_epsilon(noise_multiplier=2.0, **kwargs) < eps  # More noise, less epsilon.
  assert gl.dp_epsilon(noise_multiplier=1.1, **{**kwargs, "steps": 2000}) > eps
  assert gl.dp_epsilon(noise_multiplier=1.1, accountant="pld", **kwargs) <= eps * 1.01
  sigma = gl.dp_noise_multiplier(target_epsilon=eps, **kwargs)
  np.testing.assert_allclose(sigma, 1.1, rtol=1e-3)
  assert gl.dp_epsilon(noise_multiplier=sigma, **kwargs) <= eps * (1 + 1e-6)
  assert gl.dp_epsilon(noise_multiplier=0.0, **kwargs) == float("inf")


# ----------------------------------------------------------------------------------
# Errors: what, where, how to fix.


def test_parameters_the_records_do_not_cover_are_listed():
  params, data = mlp_setup()
  records = gl.reap(jax.grad(_batch_loss(mlp_loss, "mean")))(params, *data)
  clipped = gl.per_example_clip(records, l2_norm_clip=1.0)
  params = {**params, "scale": jnp.ones(3), "extra": {"w": jnp.ones(2)}}
  where = {**_where(mlp_setup()[0]), "scale": None, "extra": {"w": None}}
  with pytest.raises(ValueError, match=r"to_param_tree: \['extra'\]\['w'\] is not covered by "
                     r"any layer record .*; \['scale'\] is not covered"):
    gl.to_param_tree(clipped.layers, params, where)
  where = {**_where(mlp_setup()[0]), "scale": "fc9.w", "extra": {"w": "fc3.b"}}
  with pytest.raises(ValueError, match=r"\['extra'\]\['w'\]: layer 'fc3' has no bias; "
                     r"\['scale'\]: 'fc9' is not among"):
    gl.to_param_tree(clipped.layers, params, where)
  where = {**_where(mlp_setup()[0]), "scale": "fc3.w", "extra": {"w": "fc1.b"}}
  where["fc1"] = {"w": "fc1.w", "b": "fc2.b"}
  with pytest.raises(ValueError, match=r"has shape \(5, 3\)|has shape \(6, 3\)"):
    gl.to_param_tree(clipped.layers, params, where)
  with pytest.raises(ValueError, match=r"`where` has the structure"):
    gl.to_param_tree(clipped.layers, params, _where(mlp_setup()[0]))


def test_bad_arguments_say_what_to_pass():
  params, data = mlp_setup()
  records = gl.reap(jax.grad(_batch_loss(mlp_loss, "mean")))(params, *data)
  with pytest.raises(ValueError, match=r"per_example_clip\(l2_norm_clip=0.0\).*positive"):
    gl.per_example_clip(records, l2_norm_clip=0.0)
  with pytest.raises(ValueError, match=r"per_example_clip\(reduction='max'\)"):
    gl.per_example_clip(records, l2_norm_clip=1.0, reduction="max")
  with pytest.raises(ValueError, match=r"dp_noise\(reduction='mean'\).*pass batch_size"):
    gl.dp_noise(l2_norm_clip=1.0, noise_multiplier=1.0)
  with pytest.raises(ValueError, match=r"dp_epsilon: sampling_rate=2.0 must be in \(0, 1\]; "
                     r"delta=0.0 must be in \(0, 1\)"):
    gl.dp_epsilon(noise_multiplier=1.0, sampling_rate=2.0, steps=10, delta=0.0)
  with pytest.raises(ValueError, match=r"layer_norm\(name='ln'\).*shape \(d,\)"):
    gl.layer_norm(jnp.ones((2, 3)), jnp.ones(4), name="ln")


@pytest.mark.parametrize("method", ["gram", "materialized"])
def test_bfloat16_computation_is_clipped_like_vmap_at_the_models_precision(method):
  # Setup: float32 parameters, bfloat16 computation (mixed precision), sequences.
  params = {"fc1": _layer(1, 8, 16), "fc2": _layer(2, 16, 4)}
  x, y = _normal(3, (6, 5, 8)), _normal(4, (6, 5, 4))

  def example_loss(params, x, y, batched=False):
    del batched  # Per-example losses over the leading axes either way.
    bf16 = lambda a: a.astype(jnp.bfloat16)
    h = jnp.tanh(bf16(x) @ bf16(params["fc1"]["w"]) + bf16(params["fc1"]["b"]))
    out = h @ bf16(params["fc2"]["w"]) + bf16(params["fc2"]["b"])
    return jnp.sum((out.astype(jnp.float32) - y) ** 2, axis=(-2, -1))

  loss = _batch_loss(example_loss, "mean")
  clipped = gl.clipped_grad(loss, l2_norm_clip=1.0, return_norms=True, method=method)
  # True computation: vmap(grad) of the same bfloat16 computation.
  expected, expected_norms = _reference(example_loss, params, (x, y), 1.0, "mean")
  # Library computation, and comparison at bfloat16's precision.
  grads, norms = jax.jit(clipped)(params, x, y)
  np.testing.assert_allclose(norms, expected_norms, rtol=2e-2)
  assert np.any(expected_norms > 1.0)
  _assert_rel_err(grads, expected, tol=2e-2)
  # The analyses' products follow the precision the model's products follow (none
  # fixed: jax.default_matmul_precision decides).
  products = [e for e in jax.make_jaxpr(clipped)(params, x, y).jaxpr.eqns
              if e.primitive.name == "dot_general"]
  model_products = [e for e in jax.make_jaxpr(loss)(params, x, y).jaxpr.eqns
                    if e.primitive.name == "dot_general"]
  assert len(products) > len(model_products) > 0
  assert {e.params["precision"] for e in products} == {
      e.params["precision"] for e in model_products}
  if method == "materialized":  # Per-example gradients of bfloat16 operands, in float32.
    assert any(e.invars[0].aval.dtype == jnp.bfloat16 and e.outvars[0].aval.dtype == jnp.float32
               for e in products)
