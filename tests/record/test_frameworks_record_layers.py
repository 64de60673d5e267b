"""`gl.record_layers` on stock Flax NNX, Flax linen, Equinox and Haiku modules, unmodified.

Each library gets one small model made of its own stock layers (dense, convolution,
embedding, layer norm, RMSNorm where it has one, multi-head attention), and a stack
of blocks run by its scan over layers. The parameters are passed functionally
(`nnx.split`, the linen variables dict, `eqx.partition`, Haiku's params), so the
loss is `loss(params, *batch)`; no module is changed or wrapped.

True computation (`per_example.py`): `vmap(grad)` on one-example batches, per
parameter path and in total, and clipping. Library computation: one backward pass
of `gl.record_layers(loss)` read by `gl.per_example_norms` and
`gl.per_example_clip(...).params` (mean loss), and `gl.clipped_grad` (sum loss).
The record names must be the parameter paths.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from per_example import check_clipped_grad, check_found, per_example_grads

import oryx_gradlog as gl

nn = pytest.importorskip("flax.linen")
nnx = pytest.importorskip("flax.nnx")
eqx = pytest.importorskip("equinox")
hk = pytest.importorskip("haiku")

B, T, VOCAB, D, DEPTH = 4, 5, 7, 4, 3


def _batch():
  """Images `(B, 6, 6, 2)` (NHWC) and token ids `(B, T)` with repeats."""
  images = jax.random.normal(jax.random.PRNGKey(1), (B, 6, 6, 2))
  ids = jax.random.randint(jax.random.PRNGKey(2), (B, T), 0, VOCAB)
  return images, ids.at[:, 1].set(ids[:, 0])


def _sq(y):
  """Per-example loss of a batched output."""
  return 0.5 * jnp.sum(jnp.tanh(y) ** 2, axis=tuple(range(1, y.ndim)))


def _losses(per_example):
  """The mean and the sum batch losses of `per_example(params, *batch) -> (B,)`."""
  return (lambda p, *batch: jnp.mean(per_example(p, *batch)),
          lambda p, *batch: jnp.sum(per_example(p, *batch)))


def _check(per_example, params, batch, names):
  """Norms per parameter path and total, per_example_clip (mean) and clipped_grad (sum);
  every stock layer's parameters are used by a layer kind with a closed form (no
  generic use)."""
  mean, total = _losses(per_example)
  grads = per_example_grads(mean, params, *batch)  # The same for both losses.
  result = check_found(mean, params, *batch, names=names, grads=grads)
  assert set(result.norms.layers) == set(names)
  check_clipped_grad(total, params, *batch, reduction="sum", grads=grads)
  coverage = gl.layer_coverage(mean, params, *batch)
  kinds = {path: {u.kind for u in c.uses} for path, c in coverage.params.items()}
  assert all(k and k <= {"dense", "conv", "embed", "elementwise"} for k in kinds.values()), (
      kinds)
  assert coverage.uncovered == [] and coverage.unused == []
  _check_influence(mean, params, batch, grads)


def _check_influence(loss, params, batch, grads):
  """`fit_influence` on the stock model: identity scores are vmap(grad)'s inner
  products, and so are EK-FAC's under a damping that swamps the curvature (each
  block's rotated gradients hold the whole per-example gradient, biases in their
  layers' blocks included)."""
  flat = np.concatenate([np.asarray(g, np.float64).reshape(B, -1)
                         for g in jax.tree.leaves(grads)], 1)
  expected = flat @ flat.T
  for strategy, damping, scale in (("identity", None, 1.0), ("ekfac", 1e6, 1e6)):
    influence = gl.fit_influence(loss, params, [batch], strategy=strategy, damping=damping)
    got = scale * np.asarray(influence.scores([batch], [batch]), np.float64)
    np.testing.assert_allclose(got, expected, rtol=1e-3, atol=1e-4 * np.abs(expected).max(),
                               err_msg=strategy)
  # LoGra's projected gradients with every side kept whole (k above every width): each
  # example's whole gradient, its blocks' products those of vmap(grad).
  projector = gl.fit_projector(loss, params, [batch], k=64)
  records = gl.reap(jax.grad(gl.record_layers(loss)))(params, *batch)
  flat = np.asarray(gl.projected_grads(records, projector).flat(), np.float64)
  np.testing.assert_allclose(flat @ flat.T, expected, rtol=1e-3,
                             atol=1e-4 * np.abs(expected).max(), err_msg="projected")


def _stack_batch():
  return (jax.random.normal(jax.random.PRNGKey(3), (B, T, D)),)


# ----------------------------------------------------------------------------------
# Flax NNX.


class NNXModel(nnx.Module):

  def __init__(self, rngs):
    self.conv = nnx.Conv(2, 3, kernel_size=(3, 3), strides=(2, 2), rngs=rngs)
    self.embed = nnx.Embed(VOCAB, D, rngs=rngs)
    self.norm = nnx.LayerNorm(D, rngs=rngs)
    self.attn = nnx.MultiHeadAttention(num_heads=2, in_features=D, qkv_features=6,
                                       decode=False, rngs=rngs)
    self.rms = nnx.RMSNorm(D, rngs=rngs)
    self.image_head = nnx.Linear(3, D, rngs=rngs)
    self.head = nnx.Linear(D, 2, rngs=rngs)

  def __call__(self, images, ids):
    features = jnp.mean(jnp.tanh(self.conv(images)), axis=(1, 2))  # (B, 3)
    h = self.norm(self.embed(ids)) + self.image_head(features)[:, None]
    h = self.rms(h + self.attn(h))
    return self.head(h)


def _nnx_functional(model):
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)

  def per_example(params, *batch):
    return _sq(nnx.merge(graphdef, params, rest)(*batch))
  return per_example, params


@pytest.mark.slow
def test_nnx_stock_modules():
  per_example, params = _nnx_functional(NNXModel(nnx.Rngs(0)))
  _check(per_example, params, _batch(), [
      "attn.key.bias", "attn.key.kernel", "attn.out.bias", "attn.out.kernel",
      "attn.query.bias", "attn.query.kernel", "attn.value.bias", "attn.value.kernel",
      "conv.bias", "conv.kernel", "embed.embedding", "head.bias", "head.kernel",
      "image_head.bias", "image_head.kernel", "norm.bias", "norm.scale", "rms.scale"])


class NNXRecurrent(nnx.Module):
  """A GRU over the sequence (Flax NNX 0.10's `nnx.RNN` carries the cell's parameters
  through its scan unchanged; 0.12's passes them as constants), batch norm in
  evaluation mode (its statistics are not parameters) and dropout."""

  def __init__(self, rngs):
    self.embed = nnx.Embed(VOCAB, D, rngs=rngs)
    self.rnn = nnx.RNN(nnx.GRUCell(D, 3, rngs=rngs))
    self.norm = nnx.BatchNorm(3, use_running_average=True, rngs=rngs)
    self.drop = nnx.Dropout(0.5, deterministic=True)  # Per example: no batch-wide mask.
    self.head = nnx.Linear(3, 2, rngs=rngs)

  def __call__(self, images, ids):
    del images
    x = self.embed(ids)  # An initial carry given: NNX 0.12's own draws from an RNG.
    h = self.rnn(x, initial_carry=jnp.zeros((x.shape[0], 3), x.dtype))
    return self.head(self.drop(self.norm(h)))


@pytest.mark.slow
def test_nnx_rnn_with_batch_norm_in_evaluation_mode():
  per_example, params = _nnx_functional(NNXRecurrent(nnx.Rngs(0)))
  _check(per_example, params, _batch(), [
      "embed.embedding", "head.bias", "head.kernel", "norm.bias", "norm.scale",
      "rnn.cell.dense_h.kernel", "rnn.cell.dense_i.bias", "rnn.cell.dense_i.kernel"])


class NNXStack(nnx.Module):
  """`DEPTH` blocks made by `nnx.vmap` and run by `nnx.scan` (both NNX 0.10 and 0.12)."""

  def __init__(self, rngs):
    @nnx.split_rngs(splits=DEPTH)
    @nnx.vmap(in_axes=(0,), out_axes=0)
    def blocks(rngs):
      return NNXBlock(rngs)

    self.blocks = blocks(rngs)
    self.head = nnx.Linear(D, 2, rngs=rngs)

  def __call__(self, x):
    @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
    def run(h, block):
      return block(h)

    return self.head(run(x, self.blocks))


class NNXBlock(nnx.Module):

  def __init__(self, rngs):
    self.linear = nnx.Linear(D, D, rngs=rngs)
    self.norm = nnx.LayerNorm(D, rngs=rngs)

  def __call__(self, h):
    return self.norm(jnp.tanh(self.linear(h)) + h)


def test_nnx_scan_over_stacked_blocks():
  per_example, params = _nnx_functional(NNXStack(nnx.Rngs(0)))
  _check(per_example, params, _stack_batch(), [
      "blocks.linear.bias", "blocks.linear.kernel", "blocks.norm.bias",
      "blocks.norm.scale", "head.bias", "head.kernel"])


# ----------------------------------------------------------------------------------
# Flax linen.


class LinenModel(nn.Module):

  @nn.compact
  def __call__(self, images, ids):
    features = jnp.mean(jnp.tanh(nn.Conv(3, (3, 3), strides=(2, 2), name="conv")(images)),
                        axis=(1, 2))
    h = nn.LayerNorm(name="norm")(nn.Embed(VOCAB, D, name="embed")(ids))
    h = h + nn.Dense(D, name="image_head")(features)[:, None]
    h = h + nn.MultiHeadDotProductAttention(num_heads=2, qkv_features=6, name="attn")(h)
    return nn.Dense(2, name="head")(h)


class LinenBlock(nn.Module):

  @nn.compact
  def __call__(self, h, _):
    return nn.LayerNorm(name="norm")(jnp.tanh(nn.Dense(D, name="dense")(h)) + h), None


class LinenStack(nn.Module):

  @nn.compact
  def __call__(self, x):
    blocks = nn.scan(LinenBlock, variable_axes={"params": 0}, split_rngs={"params": True},
                     length=DEPTH)
    h, _ = blocks(name="blocks")(x, None)
    return nn.Dense(2, name="head")(h)


def _linen_functional(module, *batch):
  params = module.init(jax.random.PRNGKey(0), *batch)["params"]

  def per_example(params, *batch):
    return _sq(module.apply({"params": params}, *batch))
  return per_example, params


@pytest.mark.slow
def test_linen_stock_modules():
  batch = _batch()
  per_example, params = _linen_functional(LinenModel(), *batch)
  _check(per_example, params, batch, [
      "attn.key.bias", "attn.key.kernel", "attn.out.bias", "attn.out.kernel",
      "attn.query.bias", "attn.query.kernel", "attn.value.bias", "attn.value.kernel",
      "conv.bias", "conv.kernel", "embed.embedding", "head.bias", "head.kernel",
      "image_head.bias", "image_head.kernel", "norm.bias", "norm.scale"])


def test_linen_scan_over_stacked_blocks():
  batch = _stack_batch()
  per_example, params = _linen_functional(LinenStack(), *batch)
  _check(per_example, params, batch, [
      "blocks.dense.bias", "blocks.dense.kernel", "blocks.norm.bias", "blocks.norm.scale",
      "head.bias", "head.kernel"])


# ----------------------------------------------------------------------------------
# Equinox: modules of one example, vmapped inside the loss.


class EqxModel(eqx.Module):
  conv: eqx.nn.Conv2d
  embed: eqx.nn.Embedding
  norm: eqx.nn.LayerNorm
  attn: eqx.nn.MultiheadAttention
  image_head: eqx.nn.Linear
  head: eqx.nn.Linear

  def __init__(self, key):
    keys = jax.random.split(key, 5)
    self.conv = eqx.nn.Conv2d(2, 3, 3, stride=2, key=keys[0])
    self.embed = eqx.nn.Embedding(VOCAB, D, key=keys[1])
    self.norm = eqx.nn.LayerNorm(D)
    self.attn = eqx.nn.MultiheadAttention(2, D, key=keys[2])
    self.image_head = eqx.nn.Linear(3, D, key=keys[3])
    self.head = eqx.nn.Linear(D, 2, key=keys[4])

  def __call__(self, image, ids):
    """One example: `image` `(H, W, C)`, `ids` `(T,)`."""
    features = jnp.mean(jnp.tanh(self.conv(jnp.moveaxis(image, -1, 0))), axis=(1, 2))
    h = jax.vmap(self.norm)(jax.vmap(self.embed)(ids)) + self.image_head(features)
    h = h + self.attn(h, h, h)
    return jax.vmap(self.head)(h)


class EqxBlock(eqx.Module):
  linear: eqx.nn.Linear
  norm: eqx.nn.LayerNorm

  def __init__(self, key):
    self.linear = eqx.nn.Linear(D, D, key=key)
    self.norm = eqx.nn.LayerNorm(D)

  def __call__(self, h):
    return self.norm(jnp.tanh(self.linear(h)) + h)


class EqxStack(eqx.Module):
  """Blocks made by `eqx.filter_vmap`, run by `lax.scan` over the stacked arrays."""
  blocks: EqxBlock
  head: eqx.nn.Linear

  def __init__(self, key):
    keys = jax.random.split(key, DEPTH + 1)
    self.blocks = eqx.filter_vmap(EqxBlock)(keys[:DEPTH])
    self.head = eqx.nn.Linear(D, 2, key=keys[DEPTH])

  def __call__(self, x):
    """One example: `x` `(T, D)`."""
    arrays, static = eqx.partition(self.blocks, eqx.is_array)

    def step(h, block_arrays):
      block = eqx.combine(block_arrays, static)
      return jax.vmap(block)(h), None

    h, _ = jax.lax.scan(step, x, arrays)
    return jax.vmap(self.head)(h)


def _eqx_functional(model):
  params, static = eqx.partition(model, eqx.is_array)

  def per_example(params, *batch):
    return _sq(jax.vmap(eqx.combine(params, static))(*batch))
  return per_example, params


@pytest.mark.slow
def test_equinox_stock_modules():
  per_example, params = _eqx_functional(EqxModel(jax.random.PRNGKey(0)))
  _check(per_example, params, _batch(), [
      "attn.key_proj.weight", "attn.output_proj.weight", "attn.query_proj.weight",
      "attn.value_proj.weight", "conv.bias", "conv.weight", "embed.weight", "head.bias",
      "head.weight", "image_head.bias", "image_head.weight", "norm.bias", "norm.weight"])


def test_equinox_scan_over_stacked_blocks():
  per_example, params = _eqx_functional(EqxStack(jax.random.PRNGKey(0)))
  _check(per_example, params, _stack_batch(), [
      "blocks.linear.bias", "blocks.linear.weight", "blocks.norm.bias",
      "blocks.norm.weight", "head.bias", "head.weight"])


# ----------------------------------------------------------------------------------
# Haiku.


def _hk_model(images, ids):
  features = jnp.mean(jnp.tanh(hk.Conv2D(3, 3, stride=2, name="conv")(images)), axis=(1, 2))
  h = hk.LayerNorm(axis=-1, create_scale=True, create_offset=True, name="norm")(
      hk.Embed(VOCAB, D, name="embed")(ids))
  h = h + hk.Linear(D, name="image_head")(features)[:, None]
  attn = hk.MultiHeadAttention(num_heads=2, key_size=3, model_size=D,
                               w_init=hk.initializers.VarianceScaling(1.0), name="attn")
  h = hk.RMSNorm(axis=-1, name="rms")(h + attn(h, h, h))
  return hk.Linear(2, name="head")(h)


def _hk_stack(x):
  def block(h):
    h = jnp.tanh(hk.Linear(D, name="linear")(h)) + h
    return hk.LayerNorm(axis=-1, create_scale=True, create_offset=True, name="norm")(h)
  h = hk.layer_stack(DEPTH, name="blocks")(block)(x)
  return hk.Linear(2, name="head")(h)


def _hk_functional(fn, *batch):
  model = hk.without_apply_rng(hk.transform(fn))
  params = model.init(jax.random.PRNGKey(0), *batch)

  def per_example(params, *batch):
    return _sq(model.apply(params, *batch))
  return per_example, params


@pytest.mark.slow
def test_haiku_stock_modules():
  batch = _batch()
  per_example, params = _hk_functional(_hk_model, *batch)
  _check(per_example, params, batch, [
      "attn/key.b", "attn/key.w", "attn/linear.b", "attn/linear.w",
      "attn/query.b", "attn/query.w", "attn/value.b", "attn/value.w",
      "conv.b", "conv.w", "embed.embeddings", "head.b", "head.w", "image_head.b",
      "image_head.w", "norm.offset", "norm.scale", "rms.scale"])


def test_haiku_layer_stack():
  batch = _stack_batch()
  per_example, params = _hk_functional(_hk_stack, *batch)
  _check(per_example, params, batch, [
      "blocks/linear.b", "blocks/linear.w", "blocks/norm.offset",
      "blocks/norm.scale", "head.b", "head.w"])
