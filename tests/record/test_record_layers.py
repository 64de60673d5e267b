"""`gl.record_layers` on plain-JAX models: every kind of use, against `vmap(grad)`.

Setup: a small model written in plain JAX (no layer marked), as a function of
parameters and a batch of per-example losses; the batch loss is their mean or sum.
True computation (`per_example.py`): each example's gradient from
`jax.vmap(jax.grad(loss))` on one-example batches, its norms per parameter and over
all parameters, and the DP-SGD clipped gradient. Library computation: one reaped
backward pass of `jax.grad(gl.record_layers(loss))` under `jit`, read by
`gl.per_example_norms` and `gl.per_example_clip(...).params`, or `gl.clipped_grad`.
Comparison: relative error at most 1e-5 (float32).

The models cover each kind of use the issue lists: `dot_general` with assorted
dimension numbers, `conv_general_dilated` in assorted layouts, embeddings, element-wise
scales and shifts, parameters reaching their use through views, a scan over stacked
layers and functions of parameters (LoRA, weight normalisation), tied weights and
generic uses; inside `jit`, `scan`, `checkpoint` and `cond`, under `vmap` (inside the
loss, and outside the recorded function) and under a sharded `jit`.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from conftest import assert_trees_close, eight_devices
from per_example import (
    assert_norms_close, assert_rel_err, check_clipped_grad, check_found, clip, found,
    median_clip, norms_of, path_name, per_example_grads)

import oryx_gradlog as gl
from oryx_gradlog.record import record_layers as record_layers_lib

B = 4


def _normal(key, *shape, scale=0.5):
  return scale * jax.random.normal(jax.random.PRNGKey(key), shape)


def _ids(key, *shape, vocabulary):
  """Token ids with repeats within every example."""
  ids = jax.random.randint(jax.random.PRNGKey(key), shape, 0, vocabulary)
  return ids.at[..., 1].set(ids[..., 0]) if len(shape) > 1 else ids


def _batch_loss(per_example, reduction="mean"):
  """The batch loss of per-example losses `per_example(params, *batch) -> (B,)`."""
  reduce = jnp.mean if reduction == "mean" else jnp.sum

  def loss(params, *batch):
    return reduce(per_example(params, *batch))
  return loss


def _sq(y):
  """A per-example loss from a batched output: half the sum of squares but axis 0."""
  return 0.5 * jnp.sum(jnp.tanh(y) ** 2, axis=tuple(range(1, y.ndim)))


# ----------------------------------------------------------------------------------
# The models: name -> () -> (per-example loss, params, batch).

MODELS = {}


def model(fn):
  MODELS[fn.__name__] = fn
  return fn


@model
def dense_vector():
  def per_example(p, x):
    return _sq(jnp.tanh(x @ p["w1"] + p["b1"]) @ p["w2"])
  params = {"w1": _normal(1, 5, 3), "b1": _normal(2, 3), "w2": _normal(3, 3, 2)}
  return per_example, params, (_normal(4, B, 5, scale=1.0),)


@model
def dense_sequence():
  def per_example(p, x):
    return _sq(x @ p["w"] + p["b"])
  params = {"w": _normal(1, 5, 3), "b": _normal(2, 3)}
  return per_example, params, (_normal(4, B, 6, 5, scale=1.0),)


@model
def dense_parameter_on_the_left():
  """`W x` with the weight as the first operand of the dot_general."""
  def per_example(p, x):
    return _sq(jnp.einsum("oi,bti->bot", p["w"], x))
  return per_example, {"w": _normal(1, 3, 5)}, (_normal(4, B, 6, 5, scale=1.0),)


@model
def dense_transposed_weight():
  def per_example(p, x):
    return _sq(x @ p["w"].T)
  return per_example, {"w": _normal(1, 3, 5)}, (_normal(4, B, 5, scale=1.0),)


@model
def dense_batch_not_leading():
  """Data whose batch axis is not its first: `x` `(T, B, d)` inside the model."""
  def per_example(p, x):
    y = jnp.swapaxes(x, 0, 1) @ p["w"]  # (T, B, o)
    return _sq(jnp.swapaxes(y, 0, 1))
  return per_example, {"w": _normal(1, 5, 3)}, (_normal(4, B, 6, 5, scale=1.0),)


@model
def attention_3d_kernels():
  """Multi-head attention with `(d, heads, k)` and `(heads, k, d)` kernels via einsum."""
  def per_example(p, x):
    q = jnp.einsum("btd,dhk->bthk", x, p["query"]["kernel"]) + p["query"]["bias"]
    k = jnp.einsum("btd,dhk->bthk", x, p["key"]["kernel"])
    v = jnp.einsum("btd,dhk->bthk", x, p["value"]["kernel"])
    weights = jax.nn.softmax(jnp.einsum("bthk,bshk->bhts", q, k) / 2.0, axis=-1)
    h = jnp.einsum("bhts,bshk->bthk", weights, v)
    return _sq(jnp.einsum("bthk,hkd->btd", h, p["out"]["kernel"]) + p["out"]["bias"])
  params = {"query": {"kernel": _normal(1, 4, 2, 3), "bias": _normal(2, 2, 3)},
            "key": {"kernel": _normal(3, 4, 2, 3)},
            "value": {"kernel": _normal(4, 4, 2, 3)},
            "out": {"kernel": _normal(5, 2, 3, 4), "bias": _normal(6, 4)}}
  return per_example, params, (_normal(7, B, 5, 4, scale=1.0),)


@model
def dot_general_batch_dims_per_head():
  """A per-head weight `(heads, k, m)` whose head axis is a dot_general batch dim
  shared with the data: once via einsum, once via `lax.dot_general` with the weight
  first (output `(heads, m, B)`)."""
  def per_example(p, x):
    y = jnp.einsum("bhk,hkm->bhm", x, p["w"])  # (B, H, m)
    z = lax.dot_general(p["v"], jnp.tanh(y), (((1,), (2,)), ((0,), (1,))))  # (H, n, B)
    return _sq(jnp.transpose(z, (2, 0, 1)))
  params = {"w": _normal(1, 2, 3, 4), "v": _normal(2, 2, 4, 3)}
  return per_example, params, (_normal(3, B, 2, 3, scale=1.0),)


@model
def tied_embedding_output_projection():
  """`table[ids]`, then the logits `h @ table.T`: one table, two uses (cross terms)."""
  def per_example(p, ids):
    h = jnp.tanh(p["embed"][ids] @ p["w"])
    logits = h @ p["embed"].T
    return -jnp.sum(jnp.take_along_axis(jax.nn.log_softmax(logits), ids[..., None], -1),
                    axis=(1, 2))
  params = {"embed": _normal(1, 7, 4), "w": _normal(2, 4, 4)}
  return per_example, params, (_ids(3, B, 5, vocabulary=7),)


def _conv(x, w, b, **options):
  y = lax.conv_general_dilated(x, w, **options)
  return y + b.reshape([-1 if c == "C" else 1 for c in options["dimension_numbers"][2]])


CONVS = {
    "nhwc_stride2_same": dict(
        x=(B, 6, 5, 3), w=(3, 3, 3, 4), window_strides=(2, 2), padding="SAME",
        dimension_numbers=("NHWC", "HWIO", "NHWC")),
    "nchw_valid_rhs_dilation": dict(
        x=(B, 3, 7, 6), w=(4, 3, 2, 2), window_strides=(1, 1), padding="VALID",
        rhs_dilation=(2, 1), dimension_numbers=("NCHW", "OIHW", "NCHW")),
    "explicit_padding_lhs_dilation": dict(
        x=(B, 4, 3, 2), w=(3, 2, 2, 3), window_strides=(1, 1),
        padding=((1, 2), (0, 1)), lhs_dilation=(2, 2),
        dimension_numbers=("NHWC", "HWIO", "NHWC")),
    "feature_groups": dict(
        x=(B, 5, 5, 4), w=(2, 2, 2, 6), window_strides=(1, 1), padding="SAME",
        feature_group_count=2, dimension_numbers=("NHWC", "HWIO", "NHWC")),
    "depthwise": dict(
        x=(B, 5, 5, 3), w=(3, 3, 1, 3), window_strides=(1, 1), padding="SAME",
        feature_group_count=3, dimension_numbers=("NHWC", "HWIO", "NHWC")),
    "conv1d": dict(
        x=(B, 8, 3), w=(3, 3, 4), window_strides=(2,), padding="SAME",
        dimension_numbers=("NWC", "WIO", "NWC")),
    "conv3d": dict(
        x=(B, 3, 4, 4, 2), w=(2, 2, 2, 2, 3), window_strides=(1, 1, 1), padding="VALID",
        dimension_numbers=("NDHWC", "DHWIO", "NDHWC")),
    "channels_first_kernel_last": dict(
        x=(B, 2, 5, 5), w=(3, 3, 2, 4), window_strides=(1, 2), padding="SAME",
        dimension_numbers=("NCHW", "HWIO", "NHWC")),
}


def _conv_model(name):
  options = dict(CONVS[name])
  x_shape, w_shape = options.pop("x"), options.pop("w")
  out_channels = w_shape[options["dimension_numbers"][1].index("O")]

  def per_example(p, x):
    return _sq(_conv(x, p["kernel"], p["bias"], **options))
  params = {"kernel": _normal(1, *w_shape), "bias": _normal(2, out_channels)}
  return per_example, params, (_normal(3, *x_shape, scale=1.0),)


for _name in CONVS:
  MODELS[f"conv_{_name}"] = functools.partial(_conv_model, _name)


@model
def conv_frames_merged_into_the_batch():
  """Each example's two frames in the convolution's batch axis `(B * 2, ...)`,
  examples outer: its kernel gradient sums over both frames' positions."""
  def per_example(p, frames):
    x = frames.reshape(-1, *frames.shape[2:])
    y = lax.conv_general_dilated(x, p["kernel"], (2, 1), ((1, 0), (1, 1)),
                                 rhs_dilation=(1, 2), feature_group_count=2,
                                 dimension_numbers=("NHWC", "HWIO", "NHWC"))
    return _sq(y.reshape(frames.shape[0], -1))
  return per_example, {"kernel": _normal(1, 2, 2, 2, 6)}, (_normal(2, B, 2, 5, 6, 4, scale=1.0),)


@model
def embed_index_repeated_ids():
  def per_example(p, ids):
    return _sq(p["table"][ids])
  return per_example, {"table": _normal(1, 6, 3)}, (_ids(2, B, 5, vocabulary=6),)


@model
def embed_take_one_id_per_example():
  """`jnp.take` of one row per example; two examples share an id."""
  def per_example(p, ids):
    return _sq(jnp.take(p["table"], ids, axis=0))
  ids = jnp.array([2, 0, 2, 5])
  return per_example, {"table": _normal(1, 6, 3)}, (ids,)


@model
def embed_scalar_index_under_vmap():
  """Equinox's embedding: `table[i]` of one id, vmapped over positions and examples."""
  def per_example(p, ids):
    return _sq(jax.vmap(jax.vmap(lambda i: p["table"][i]))(ids))
  return per_example, {"table": _normal(1, 6, 3)}, (_ids(2, B, 5, vocabulary=6),)


@model
def embed_vocabulary_on_the_last_axis():
  """penzai 0.2.5's `pz.nn.EmbeddingLookup`, as its jaxpr has it: the table
  transposed to (d, vocabulary), gathered at the ids with `mode="clip"` and the
  embedding axis first in the output (`offset_dims=(0, 3)`), then squeezed."""
  def per_example(p, ids):
    table = p["table"].T
    dims = lax.GatherDimensionNumbers(offset_dims=(0, ids.ndim + 1), collapsed_slice_dims=(),
                                      start_index_map=(1,))
    out = lax.gather(table, ids[..., None], dims, slice_sizes=(table.shape[0], 1),
                     mode=lax.GatherScatterMode.CLIP)
    return _sq(jnp.moveaxis(out[..., 0], 0, -1))
  return per_example, {"table": _normal(1, 7, 3)}, (_ids(2, B, 5, vocabulary=7),)


@model
def embed_take_with_bias_and_dense():
  def per_example(p, ids):
    h = jnp.take(p["table"], ids, axis=0) + p["bias"]
    return _sq(h @ p["w"])
  params = {"table": _normal(1, 9, 4), "bias": _normal(2, 4), "w": _normal(3, 4, 2)}
  return per_example, params, (_ids(4, B, 6, vocabulary=9),)


def _layer_norm(x, scale, offset, eps=1e-5):
  mean = jnp.mean(x, axis=-1, keepdims=True)
  var = jnp.mean((x - mean) ** 2, axis=-1, keepdims=True)
  return (x - mean) * lax.rsqrt(var + eps) * scale + offset


def _rms_norm(x, scale, eps=1e-6):
  return x * lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps) * scale


@model
def scale_and_shift():
  """A learned position embedding `x + pos`, layer norm and RMSNorm scales and
  offsets, a bias and a scalar gain."""
  def per_example(p, x):
    h = x + p["pos"]
    h = _layer_norm(h, p["ln"]["scale"], p["ln"]["offset"])
    h = jnp.tanh(h @ p["w"] + p["b"])
    h = _rms_norm(h, p["rms"]["scale"])
    return _sq(p["gain"] * h)
  params = {"pos": _normal(1, 5, 4), "ln": {"scale": 1 + _normal(2, 4), "offset": _normal(3, 4)},
            "w": _normal(4, 4, 3), "b": _normal(5, 3), "rms": {"scale": 1 + _normal(6, 3)},
            "gain": jnp.array(1.5)}
  return per_example, params, (_normal(7, B, 5, 4, scale=1.0),)


@model
def parameters_broadcast_to_the_output():
  """Haiku's way: `jnp.broadcast_to(b, out.shape)` of a bias, a per-position gain
  `(T, 1)` and a position embedding `(T, d)`, then added or multiplied."""
  def per_example(p, x):
    y = x @ p["w"]
    y = y + jnp.broadcast_to(p["b"], y.shape)
    y = y * jnp.broadcast_to(p["gain"], y.shape) + jnp.broadcast_to(p["pos"], y.shape)
    return _sq(y)
  params = {"w": _normal(1, 5, 3), "b": _normal(2, 3), "gain": 1 + _normal(3, 6, 1),
            "pos": _normal(4, 6, 3)}
  return per_example, params, (_normal(5, B, 6, 5, scale=1.0),)


@model
def scan_over_stacked_layers_with_views():
  """A `lax.scan` over layers whose stacked parameters are reshaped, transposed and
  sliced before their use."""
  def per_example(p, x):
    def block(h, layer):
      w = layer["w"].reshape(4, 4).T
      h = jnp.tanh(h @ w + layer["b"][:4])
      return h, None
    h, _ = lax.scan(block, x, p["blocks"])
    return _sq(h @ p["head"])
  params = {"blocks": {"w": _normal(1, 3, 16), "b": _normal(2, 3, 6)},
            "head": _normal(3, 4, 2)}
  return per_example, params, (_normal(4, B, 4, scale=1.0),)


@model
def lora_and_weight_norm():
  """Functions of parameters alone: LoRA's `W + A @ B` and `g * v / |v|`."""
  def per_example(p, x):
    w = p["lora"]["w"] + p["lora"]["a"] @ p["lora"]["b"]
    h = jnp.tanh(x @ w)
    v = p["wn"]["v"]
    w2 = p["wn"]["g"] * v / jnp.linalg.norm(v, axis=0, keepdims=True)
    return _sq(h @ w2)
  params = {"lora": {"w": _normal(1, 5, 4), "a": _normal(2, 5, 2), "b": _normal(3, 2, 4)},
            "wn": {"v": _normal(4, 4, 3), "g": 1 + _normal(5, 3)}}
  return per_example, params, (_normal(6, B, 3, 5, scale=1.0),)


@model
def jitted_function_of_parameters_called_twice():
  """One jitted weight normalisation applied to two parameters, summed into one
  weight: the same jaxpr equations in two invocations of one chain."""
  normalize = jax.jit(lambda v: v / jnp.linalg.norm(v, axis=0, keepdims=True))

  def per_example(p, x):
    return _sq(x @ (normalize(p["a"]) + 2 * normalize(p["b"])))
  return per_example, {"a": _normal(1, 4, 3), "b": _normal(2, 4, 3)}, (_normal(3, B, 4),)


@model
def function_of_parameters_made_in_a_checkpoint():
  """A weight normalised inside a `jax.checkpoint` block, used there and after it."""
  @jax.checkpoint
  def block(h, v, g):
    w = g * v / jnp.linalg.norm(v, axis=0, keepdims=True)
    return jnp.tanh(h @ w), w

  def per_example(p, x):
    h, w = block(x, p["v"], p["g"])
    return _sq(h @ w.T)
  return per_example, {"v": _normal(1, 4, 4), "g": 1 + _normal(2, 4)}, (_normal(3, B, 4),)


@model
def tied_weight_used_twice():
  def per_example(p, x):
    return _sq(jnp.tanh(x @ p["w"] + p["b"]) @ p["w"] + p["b"])
  return per_example, {"w": _normal(1, 4, 4), "b": _normal(2, 4)}, (_normal(3, B, 4, scale=1.0),)


@jax.custom_jvp
def _soft_gate(x, w):
  return x * jax.nn.sigmoid(w * x)


@_soft_gate.defjvp
def _soft_gate_jvp(primals, tangents):
  x, w = primals
  dx, dw = tangents
  s = jax.nn.sigmoid(w * x)
  ds = s * (1 - s)
  return _soft_gate(x, w), dx * (s + x * ds * w) + dw * x * x * ds


@jax.custom_vjp
def _signed_scale(x, w):
  """`x * w`, whose backward pass passes `x` the cotangent times `sign(w)` only (a
  custom_vjp; linear in the cotangent, as a backward pass must be for per-example
  gradients to come from the batch's)."""
  return x * w


def _signed_scale_fwd(x, w):
  return x * w, (x, w)


def _signed_scale_bwd(residuals, g):
  x, w = residuals
  gw = jnp.sum(g * x, axis=tuple(range(g.ndim - w.ndim)))
  return g * jnp.sign(w), gw


_signed_scale.defvjp(_signed_scale_fwd, _signed_scale_bwd)


@model
def generic_uses():
  """custom_jvp and custom_vjp functions of data and a parameter (generic, no Gram
  form); a class token broadcast to the batch and a parameter entering a cumulative
  sum with the data (element-wise); a column gather (an embedding whose vocabulary
  is the table's last axis)."""
  def per_example(p, x, ids):
    cls = jnp.broadcast_to(p["cls"], (x.shape[0], 1, x.shape[2]))
    h = jnp.concatenate([cls, x], axis=1)  # (B, T + 1, d)
    h = _signed_scale(_soft_gate(h, p["gate"]), p["scale"])
    h = jnp.cumsum(jnp.concatenate([h, p["prefix"] + 0 * h[:, :1]], axis=1), axis=1)
    columns = p["columns"][:, ids]  # (d, B)
    return _sq(h) + jnp.sum(columns.T ** 2, axis=1)
  params = {"cls": _normal(1, 1, 4), "gate": _normal(2, 4), "prefix": _normal(3, 1, 4),
            "columns": _normal(4, 3, 5), "scale": 1 + _normal(5, 4)}
  return per_example, params, (_normal(5, B, 3, 4, scale=1.0), jnp.array([1, 4, 1, 0]))


@model
def inner_jit_checkpoint_and_cond():
  """Uses inside a jitted function, a `jax.checkpoint` block and both branches of a
  `lax.cond` on a parameter."""
  @jax.jit
  def dense(x, w, b):
    return jnp.tanh(x @ w + b)

  @jax.checkpoint
  def block(h, w):
    return jnp.tanh(h @ w) + h

  def per_example(p, x):
    h = dense(x, p["w"], p["b"])
    h = block(h, p["remat"])
    h = lax.cond(jnp.sum(p["gate"]) > 0, lambda h: h @ p["yes"], lambda h: h * p["no"], h)
    return _sq(h)
  params = {"w": _normal(1, 3, 4), "b": _normal(2, 4), "remat": _normal(3, 4, 4),
            "gate": jnp.ones(2), "yes": _normal(4, 4, 4), "no": _normal(5, 4)}
  return per_example, params, (_normal(6, B, 3, scale=1.0),)


@model
def rnn_scan_with_a_tied_cell():
  """An RNN: `lax.scan` over positions, the cell's weights closed over (tied)."""
  def per_example(p, x):
    def cell(c, xt):
      c = jnp.tanh(c @ p["u"] + xt @ p["w"] + p["b"])
      return c, c
    c, hs = lax.scan(cell, jnp.zeros((x.shape[0], 4)), jnp.swapaxes(x, 0, 1))
    return _sq(c) + _sq(jnp.swapaxes(hs, 0, 1) @ p["out"])
  params = {"u": _normal(1, 4, 4), "w": _normal(2, 3, 4), "b": _normal(3, 4),
            "out": _normal(4, 4, 2)}
  return per_example, params, (_normal(5, B, 5, 3, scale=1.0),)


@model
def rnn_scan_with_the_cell_in_its_carry():
  """The same RNN with the cell's weights carried through the scan unchanged (as Flax
  NNX 0.10's `nnx.RNN` carries its cell): loop constants, not loop state."""
  def per_example(p, x):
    def cell(carry, xt):
      (u, w), c = carry
      c = jnp.tanh(c @ u + xt @ w)
      return ((u, w), c), c
    (_, c), hs = lax.scan(cell, ((p["u"], p["w"]), jnp.zeros((x.shape[0], 4))),
                          jnp.swapaxes(x, 0, 1))
    return _sq(c) + _sq(jnp.swapaxes(hs, 0, 1) @ p["out"])
  params = {"u": _normal(1, 4, 4), "w": _normal(2, 3, 4), "out": _normal(4, 4, 2)}
  return per_example, params, (_normal(5, B, 5, 3, scale=1.0),)


@model
def vmap_inside_the_loss():
  """A model written for one example, vmapped inside the loss (Equinox style)."""
  def one(p, image, ids):
    y = lax.conv_general_dilated(image[None], p["conv"], (1, 1), "SAME",
                                 dimension_numbers=("NCHW", "OIHW", "NCHW"))[0]
    h = jnp.mean(jnp.tanh(y), axis=(1, 2)) @ p["w"]  # (4,)
    tokens = p["table"][ids] + h  # (T, 4)
    return _sq(_layer_norm(tokens, p["scale"], p["offset"])[None])[0]

  def per_example(p, images, ids):
    return jax.vmap(one, in_axes=(None, 0, 0))(p, images, ids)
  params = {"conv": _normal(1, 3, 2, 3, 3), "w": _normal(2, 3, 4), "table": _normal(3, 6, 4),
            "scale": 1 + _normal(4, 4), "offset": _normal(5, 4)}
  return per_example, params, (_normal(6, B, 2, 5, 5, scale=1.0), _ids(7, B, 3, vocabulary=6))


@model
def hand_marked_layers_inside():
  """Layers marked with gl.conv2d, gl.dense, gl.embed and gl.layer_norm, under
  record_layers: each recorded once, as the uses found in it (by parameter path)."""
  def per_example(p, images, ids):
    y = gl.conv2d(images, p["conv"], p["conv_b"], name="conv", padding="SAME")
    h = gl.dense(jnp.mean(jnp.tanh(y), axis=(1, 2)), p["w"], p["b"], name="fc")
    tokens = gl.embed(ids, p["table"], name="embed") + h[:, None]
    return _sq(gl.layer_norm(tokens, p["scale"], p["offset"], name="norm"))
  params = {"conv": _normal(1, 3, 3, 2, 3), "conv_b": _normal(2, 3), "w": _normal(3, 3, 4),
            "b": _normal(4, 4), "table": _normal(5, 6, 4), "scale": 1 + _normal(6, 4),
            "offset": _normal(7, 4)}
  return per_example, params, (_normal(8, B, 5, 5, 2, scale=1.0), _ids(9, B, 3, vocabulary=6))


def _case(name, reduction="mean"):
  per_example, params, batch = MODELS[name]()
  return _batch_loss(per_example, reduction), params, batch


# ----------------------------------------------------------------------------------
# Every model, mean and sum losses.


@pytest.mark.parametrize("name", list(MODELS))
def test_norms_and_clipped_grads_match_vmap_of_grad(name):
  loss, params, batch = _case(name)
  check_found(loss, params, *batch)


SUM_MODELS = ["attention_3d_kernels", "conv_feature_groups", "embed_index_repeated_ids",
              "lora_and_weight_norm", "scan_over_stacked_layers_with_views", "generic_uses"]


@pytest.mark.parametrize("name", SUM_MODELS)
def test_sum_loss(name):
  loss, params, batch = _case(name, "sum")
  check_found(loss, params, *batch, reduction="sum")


METHOD_MODELS = ["attention_3d_kernels", "dot_general_batch_dims_per_head",
                 "conv_feature_groups", "conv_frames_merged_into_the_batch",
                 "embed_index_repeated_ids",
                 "embed_vocabulary_on_the_last_axis",
                 "scan_over_stacked_layers_with_views", "rnn_scan_with_a_tied_cell"]


@pytest.mark.parametrize("method", ["gram", "materialized"])
@pytest.mark.parametrize("name", METHOD_MODELS)
def test_gram_and_materialized_methods(name, method):
  loss, params, batch = _case(name)
  result = check_found(loss, params, *batch, method=method)
  # A parameter with one use that keeps its norms takes the method asked for; tied
  # weights and functions of parameters are always materialised.
  methods = result.norms.method
  assert set(methods.values()) <= {method, "materialized"}
  assert method in methods.values(), methods


def test_auto_method_chooses_by_multiply_adds_and_memory():
  """The cost model: a long sequence through a narrow dense layer is cheaper
  materialised; one position through a wide one as a Gram form; an embedding whose
  per-example tables take fewer multiply-adds but more memory than the Gram form
  and the activations takes the Gram form (the issue's B x 500 x 64 case)."""
  def per_example(p, ids, x):
    return _sq(p["table"][ids]) + _sq(x @ p["narrow"]) + _sq(x[:, :1] @ p["wide"])
  params = {"table": _normal(1, 50, 8), "narrow": _normal(2, 3, 2),
            "wide": _normal(3, 3, 40)}
  batch = (_ids(5, B, 10, vocabulary=50), _normal(4, B, 30, 3, scale=1.0))
  result = check_found(_batch_loss(per_example), params, *batch)
  assert result.norms.method == {"table": "gram", "narrow": "materialized", "wide": "gram"}


def test_clipping_counts_the_reweighted_sum_and_reuses_formed_gradients():
  """Clipping also forms `sum_i c_i grad_i`: a Gram layer pays a vjp for it, a
  materialised one sums the per-example gradients it formed. At 4 positions through
  an 8 x 8 layer both forms of the norms cost the same (the norms take the Gram
  form), but with the reweighted sum materialising is cheaper: the clipped gradient,
  now summed from the formed per-example gradients, still equals vmap(grad)'s."""
  from oryx_gradlog.record import _canonical  # pylint: disable=g-import-not-at-top
  assert _canonical.cheaper("dense", B, 4, 8, 8) == "gram"
  assert _canonical.cheaper("dense", B, 4, 8, 8, weighted=True) == "materialized"
  assert _canonical.cheaper("dense", B, 1, 8, 8, weighted=True) == "gram"
  assert _canonical.cheaper("embed", B, 4, 1, 8, vocabulary=50, weighted=True) == "gram"
  per_example = lambda p, x: _sq(jnp.tanh(x @ p["w"] + p["b"]) @ p["v"])
  params = {"w": _normal(1, 8, 8), "b": _normal(2, 8), "v": _normal(3, 8, 8)}
  x = _normal(4, B, 4, 8, scale=1.0)
  result = check_found(_batch_loss(per_example), params, x)
  assert result.norms.method == {"w": "gram", "b": "materialized", "v": "gram"}
  check_clipped_grad(_batch_loss(per_example), params, x)


@pytest.mark.parametrize("spatial, kernel, strides, padding, lhs_dilation, rhs_dilation", [
    ((9, 8), (3, 3), (1, 1), "SAME", None, None),
    ((9, 8), (3, 2), (2, 3), ((1, 2), (0, -1)), (1, 1), (2, 1)),
    ((7, 6), (2, 3), (1, 2), ((1, 0), (2, 1)), (2, 1), (1, 2)),
    ((7, 6), (3, 3), (2, 1), "SAME", None, (2, 1)),
    ((11,), (4,), (1,), ((3, 0),), None, None),
    ((5, 4, 6), (2, 2, 3), (1, 2, 1), "VALID", None, None),
])
def test_conv_patches_are_jaxs(spatial, kernel, strides, padding, lhs_dilation,
                               rhs_dilation):
  """A convolution's patches (the windows of its kernel's offsets, stacked
  channel-major) are `lax.conv_general_dilated_patches`', element for element."""
  from oryx_gradlog.record import _canonical  # pylint: disable=g-import-not-at-top
  x = _normal(1, 2, 3, *spatial, scale=1.0)  # (N, C, *spatial)
  expected = lax.conv_general_dilated_patches(
      x, kernel, strides, padding, lhs_dilation, rhs_dilation,
      precision=lax.Precision.HIGHEST)
  options = dict(window_strides=strides, padding=padding, lhs_dilation=lhs_dilation,
                 rhs_dilation=rhs_dilation)
  windows = _canonical.conv_windows(jnp.moveaxis(x, 1, -1), kernel, options)
  patches = jnp.stack(list(windows), -1)  # (N, *positions, C, prod(kernel))
  patches = jnp.moveaxis(patches.reshape(patches.shape[:-2] + (-1,)), -1, 1)
  np.testing.assert_array_equal(patches, expected)


def test_parameter_cast_from_bfloat16():
  """bfloat16 parameters cast to float32 before their use, one of them stacked and
  sliced by a scan over layers: norms in float32 from the float32 cotangents (the
  reference differentiates a float32 copy), clipped gradients in bfloat16."""
  def per_example(p, x):
    h = jnp.tanh(x @ p["w"].astype(jnp.float32) + p["b"])
    h, _ = lax.scan(lambda h, w: (jnp.tanh(h @ w.astype(jnp.float32)), None), h, p["stack"])
    return _sq(h)
  params = {"w": _normal(1, 5, 3).astype(jnp.bfloat16), "b": _normal(2, 3),
            "stack": _normal(4, 2, 3, 3).astype(jnp.bfloat16)}
  reference = jax.tree.map(lambda a: a.astype(jnp.float32), params)
  x = _normal(3, B, 5, scale=1.0)
  loss = _batch_loss(per_example)
  grads = per_example_grads(loss, reference, x)
  expected, total = norms_of(grads)
  result = found(loss, params, x, l2_norm_clip=median_clip(grads))
  for name in expected:
    assert_norms_close(result.norms.layers[name], expected[name], what=name)
  assert_norms_close(result.norms.norms, total)
  assert result.clipped["w"].dtype == result.clipped["stack"].dtype == jnp.bfloat16
  assert_rel_err(result.clipped, clip(grads, median_clip(grads), "mean"), tol=1e-2)


# ----------------------------------------------------------------------------------
# Transformations around the recorded function.


def test_hand_marked_layers_are_recorded_once_by_parameter_path():
  """Inside record_layers a hand-marked layer is its found uses (no second record by
  its name); a record of another tag is left as it is."""
  loss, params, batch = _case("hand_marked_layers_inside")
  records = jax.jit(gl.reap(jax.grad(gl.record_layers(loss))))(params, *batch)
  assert {name: r.primals[0].kind for name, r in records.items()} == {
      "conv": "conv", "conv_b": "elementwise", "w": "dense", "b": "elementwise",
      "table": "embed", "scale": "elementwise", "offset": "elementwise"}
  grads = per_example_grads(loss, params, *batch)
  expected, _ = norms_of(grads)
  got = gl.per_example_norms(records)
  assert sorted(got.layers) == sorted(expected)
  for key, norms in expected.items():
    assert_norms_close(got.layers[key], norms, what=key)

  def other_tag(p, images, ids):
    return loss(p, images, ids) + jnp.mean(gl.dense(images[:, 0, 0], p["conv"][0, 0],
                                                    name="side", tag="mine"))
  mine = gl.reap(jax.grad(gl.record_layers(other_tag)), tag="mine")(params, *batch)
  assert list(mine) == ["side"] and mine["side"].primals[0].kind == "dense"


def test_in_cotangents_on_request_equal_plain_jax():
  """A record holds the use's operands and output cotangent; with in_cotangents=True
  also the cotangents of the operands (one more site per use). Against plain JAX:
  jax.grad for the weight, the zero-perturbation trick for the activations."""
  w1, b1, w2, x = _normal(0, 3, 5), _normal(1, 5), _normal(2, 5, 2), _normal(3, B, 3)
  params = {"w1": w1, "b1": b1, "w2": w2}

  def loss(p, x, dh=0.0, dout=0.0):
    h = jnp.tanh(x @ p["w1"] + p["b1"]) + dh
    return jnp.mean((h @ p["w2"] + dout) ** 2)

  plain = jax.jit(gl.reap(jax.grad(gl.record_layers(loss))))(params, x)
  full = jax.jit(gl.reap(jax.grad(gl.record_layers(loss, in_cotangents=True))))(params, x)
  assert sorted(plain) == sorted(full) == ["b1", "w1", "w2"]
  h = jnp.tanh(x @ w1 + b1)
  g_out = jax.grad(lambda d: loss(params, x, dout=d))(jnp.zeros((B, 2)))
  g_h = jax.grad(lambda d: loss(params, x, dh=d))(jnp.zeros((B, 5)))
  for records in (plain, full):
    (use,) = records["w2"].primals
    np.testing.assert_allclose(use.operands[0], h, rtol=1e-6)
    np.testing.assert_allclose(use.operands[1], w2)
    np.testing.assert_allclose(records["w2"].out_cotangent, g_out, rtol=1e-6, atol=1e-7)
  assert all(r.in_cotangents is None for r in plain.values())
  (cts,) = full["w2"].in_cotangents
  np.testing.assert_allclose(cts.operands[0], g_h, rtol=1e-5, atol=1e-7)
  np.testing.assert_allclose(cts.operands[1], jax.grad(loss)(params, x)["w2"], rtol=1e-5)
  assert cts.chain_inputs == ()


def test_a_layer_whose_output_only_its_bias_reads_shares_its_bias_site():
  """A dense use whose output only its bias add reads is marked once, at the add,
  and both records hold the add's output cotangent; a dense use whose output is also
  read elsewhere keeps its own site. Against the zero-perturbation trick, under jit,
  through the pullback of jax.vjp (records without primals), and two calls stacked."""
  w1, b1, w2, b2, x = (_normal(0, 3, 5), _normal(1, 5), _normal(2, 5, 2), _normal(3, 2),
                       _normal(4, B, 3))
  params = {"w1": w1, "b1": b1, "w2": w2, "b2": b2}

  def loss(p, x, dz=0.0, dy=0.0, dv=0.0):
    z = x @ p["w1"] + p["b1"] + dz  # Only the bias reads x @ w1: one site for both.
    y = jnp.tanh(z) @ p["w2"] + dy
    v = y + p["b2"] + dv
    return jnp.mean((v + 0.5 * y) ** 2)  # y is read twice: w2 and b2 have a site each.

  recorded = gl.record_layers(loss)
  sites = [e for e in jax.make_jaxpr(recorded)(params, x).eqns
           if e.primitive.name == "gradlog_site"]
  assert len(sites) == 3
  g = {name: jax.grad(lambda d, name=name: loss(params, x, **{name: d}))(jnp.zeros(shape))
       for name, shape in (("dz", (B, 5)), ("dy", (B, 2)), ("dv", (B, 2)))}
  expected = {"w1": g["dz"], "b1": g["dz"], "w2": g["dy"], "b2": g["dv"]}
  records = jax.jit(gl.reap(jax.grad(recorded)))(params, x)
  _, pullback = jax.vjp(recorded, params, x)
  pulled = gl.reap(pullback)(jnp.ones(()))
  assert sorted(records) == sorted(pulled) == sorted(expected)
  for name, cotangent in expected.items():
    np.testing.assert_allclose(records[name].out_cotangent, cotangent, rtol=1e-6, atol=1e-8)
    np.testing.assert_allclose(pulled[name].out_cotangent, cotangent, rtol=1e-6, atol=1e-8)
    assert pulled[name].primals is None
  (dense,), (bias,) = records["w1"].primals, records["b1"].primals
  assert (dense.kind, bias.kind) == ("dense", "elementwise")
  np.testing.assert_allclose(dense.operands[0], x)
  np.testing.assert_allclose(bias.operands[0], x @ w1, rtol=1e-6)
  # Two calls in one reap: each name's calls stack in call order.
  twice = gl.reap(jax.grad(lambda p, x: recorded(p, x) + recorded(p, 2 * x)))(params, x)
  g2 = jax.grad(lambda d: loss(params, 2 * x, dz=d))(jnp.zeros((B, 5)))
  for name in ("w1", "b1"):
    np.testing.assert_allclose(twice[name].out_cotangent[0], g["dz"], rtol=1e-6, atol=1e-8)
    np.testing.assert_allclose(twice[name].out_cotangent[1], g2, rtol=1e-6, atol=1e-8)
  np.testing.assert_allclose(twice["b1"].primals[0].operands[0][1], 2 * x @ w1, rtol=1e-6)


def test_a_found_use_and_a_tap_of_one_name_is_an_error_naming_both():
  def loss(p, x):
    return jnp.mean(gl.tap(x @ p["w"], name="w") ** 2)

  with pytest.raises(ValueError, match=r"record 'w' is made both by record_layers and by "
                                       r"tap or record_vjp without full=True"):
    gl.reap(jax.grad(gl.record_layers(loss)))({"w": _normal(0, 3, 2)}, _normal(1, B, 3))


def test_eager_without_jit():
  loss, params, batch = _case("embed_take_with_bias_and_dense")
  check_found(loss, params, *batch, wrap=lambda f: f)


def test_outer_vmap_with_the_analyses_inside_it():
  """An ensemble of two models on their own batches: the recorded function, the
  reap and the analyses all inside one `vmap`."""
  per_example, params, _ = dense_vector()
  loss = _batch_loss(per_example)
  members = jax.tree.map(lambda a: jnp.stack([a, 1.5 * a]), params)
  xs = _normal(9, 2, B, 5, scale=1.0)
  c = 0.8

  def analyse(params, x):
    records = gl.reap(jax.grad(gl.record_layers(loss)))(params, x)
    norms = gl.per_example_norms(records)
    return norms, gl.per_example_clip(records, l2_norm_clip=c).params

  norms, clipped = jax.jit(jax.vmap(analyse))(members, xs)
  for m in range(2):
    member = jax.tree.map(lambda a: a[m], members)
    grads = per_example_grads(loss, member, xs[m])
    layers, total = norms_of(grads)
    assert 0 < np.sum(total > c) < B, total  # Some examples are clipped, some not.
    for name, expected in layers.items():
      assert_norms_close(norms.layers[name][m], expected, what=name)
    assert_norms_close(norms.norms[m], total)
    assert_rel_err(jax.tree.map(lambda a: a[m], clipped), clip(grads, c, "mean"))


def test_sharded_jit_over_eight_devices():
  """The batch split over 8 CPU devices, the parameters replicated."""
  assert jax.device_count() >= 8
  mesh = Mesh(np.array(eight_devices()), ("batch",))
  by_example, replicated = NamedSharding(mesh, P("batch")), NamedSharding(mesh, P())
  per_example, params, _ = attention_3d_kernels()
  loss = _batch_loss(per_example)
  x = jax.device_put(_normal(8, 8, 5, 4, scale=1.0), by_example)
  params = jax.device_put(params, replicated)

  def wrap(fun):
    return jax.jit(fun, in_shardings=(replicated, by_example))

  result = check_found(loss, params, x, wrap=wrap)
  assert result.norms.norms.shape == (8,)
  grads = per_example_grads(loss, params, x)
  c = median_clip(grads)
  step = jax.jit(gl.clipped_grad(loss, l2_norm_clip=c, return_norms=True),
                 in_shardings=(replicated, by_example))
  clipped, norms = step(params, x)
  assert_rel_err(clipped, clip(grads, c, "mean"))
  assert_norms_close(norms, norms_of(grads)[1])


# ----------------------------------------------------------------------------------
# gl.clipped_grad, used like jax.grad.


def _mlp():
  """A regression MLP: per-example losses of `(params, x, y)`, params, x and y."""
  _, params, (x,) = dense_vector()
  y = _normal(11, B, 2, scale=1.0)

  def example_losses(p, x, y):
    return 0.5 * jnp.sum((jnp.tanh(x @ p["w1"] + p["b1"]) @ p["w2"] - y) ** 2, axis=-1)
  return example_losses, params, x, y


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_clipped_grad_is_vmap_grad_and_clip(reduction):
  example_losses, params, x, y = _mlp()
  loss = _batch_loss(example_losses, reduction)
  grads = per_example_grads(loss, params, x, y)
  c = median_clip(grads)
  clipped = jax.jit(gl.clipped_grad(loss, l2_norm_clip=c, reduction=reduction))(params, x, y)
  assert_rel_err(clipped, clip(grads, c, reduction))


def test_clipped_grad_has_aux_and_return_norms():
  example_losses, params, x, y = _mlp()

  def loss(p, x, y):
    losses = example_losses(p, x, y)
    return jnp.mean(losses), {"losses": losses}

  grads = per_example_grads(loss, params, x, y, has_aux=True)
  c = median_clip(grads)
  (clipped, norms), aux = jax.jit(gl.clipped_grad(
      loss, l2_norm_clip=c, has_aux=True, return_norms=True))(params, x, y)
  assert_rel_err(clipped, clip(grads, c, "mean"))
  assert_norms_close(norms, norms_of(grads)[1])
  np.testing.assert_allclose(aux["losses"], example_losses(params, x, y), rtol=1e-6)


def test_clipped_grad_argnums_tuple():
  """Two parameter arguments, as `jax.grad(argnums=(0, 1))`: a tuple of gradients
  clipped by the norm over both."""
  example_losses, params, x, y = _mlp()
  first = {"w1": params["w1"], "b1": params["b1"]}
  second = {"w2": params["w2"]}
  loss = lambda p, q, x, y: jnp.mean(example_losses({**p, **q}, x, y))
  grads = per_example_grads(loss, first, second, x, y, argnums=(0, 1))
  c = median_clip(grads)
  clipped = jax.jit(gl.clipped_grad(loss, l2_norm_clip=c, argnums=(0, 1)))(
      first, second, x, y)
  assert isinstance(clipped, tuple) and len(clipped) == 2
  assert_rel_err(clipped, clip(grads, c, "mean"))


def test_clipped_grad_batch_argnums_and_keyword_arguments():
  """Only argument 1 holds the batch; argument 2 (a temperature) and a keyword
  argument are passed through."""
  example_losses, params, x, y = _mlp()

  def loss(p, batch, temperature, *, offset):
    x, y = batch
    return jnp.mean(example_losses(p, x / temperature + offset, y))

  t, offset = jnp.array(2.0), jnp.array(0.25)
  grads = per_example_grads(lambda p, b, t: loss(p, b, t, offset=offset), params, (x, y), t,
                            batch_argnums=1)
  c = median_clip(grads)
  clipped = gl.clipped_grad(loss, l2_norm_clip=c, batch_argnums=1)(params, (x, y), t,
                                                                    offset=offset)
  assert_rel_err(clipped, clip(grads, c, "mean"))


def test_clipped_grad_poisson_padding_has_weight_zero():
  """Padding examples of `gl.poisson_batch` weigh 0: the clipped gradient is that of
  the sampled examples alone, and the padding's norms are 0."""
  example_losses, params, _, _ = _mlp()
  x, y = _normal(12, 40, 5, scale=1.0), _normal(13, 40, 2, scale=1.0)
  batch = gl.poisson_batch(jax.random.PRNGKey(3), 40, sampling_rate=0.2, batch_size=16)
  count = int(batch.count)
  assert 0 < count < 16

  def loss(p, x, y, weights):
    return jnp.sum(weights * example_losses(p, x, y))

  sampled = batch.indices[:count]
  plain = lambda p, x, y: jnp.sum(example_losses(p, x, y))
  grads = per_example_grads(plain, params, x[sampled], y[sampled])
  c = median_clip(grads)
  clipped, norms = jax.jit(gl.clipped_grad(loss, l2_norm_clip=c, reduction="sum",
                                           return_norms=True))(
      params, x[batch.indices], y[batch.indices], batch.weights)
  assert_rel_err(clipped, clip(grads, c, "sum"))
  assert_norms_close(norms[:count], norms_of(grads)[1])
  np.testing.assert_array_equal(norms[count:], 0.0)


# ----------------------------------------------------------------------------------
# Errors and coverage.


def _weight_decay_loss():
  example_losses, params, x, y = _mlp()

  def loss(p, x, y):
    return jnp.mean(example_losses(p, x, y)) + 1e-3 * jnp.sum(p["w2"] ** 2)
  return loss, params, x, y


def _batch_norm_loss():
  def loss(p, x):
    h = x @ p["w"]
    mean, var = jnp.mean(h, axis=0), jnp.var(h, axis=0)
    h = (h - mean) * lax.rsqrt(var + 1e-5) * p["bn"]["scale"]
    return jnp.mean(_sq(h))
  params = {"w": _normal(1, 5, 3), "bn": {"scale": 1 + _normal(2, 3)}}
  return loss, params, _normal(3, B, 5, scale=1.0)


def test_weight_decay_in_the_loss_is_an_error_naming_the_parameter_and_the_op():
  loss, params, x, y = _weight_decay_loss()
  with pytest.raises(ValueError, match=r"clipped_grad: these parameters have no "
                     r"per-example gradient: 'w2' \((mul|add)\b.*no batch axis.*"
                     r"optax.add_decayed_weights"):
    gl.clipped_grad(loss, l2_norm_clip=1.0)(params, x, y)
  records = gl.reap(jax.grad(gl.record_layers(loss)))(params, x, y)
  with pytest.raises(ValueError, match=r"per_example_norms: these parameters have no "
                     r"per-example gradient: 'w2'.*layer_coverage"):
    gl.per_example_norms(records)


def test_a_loss_with_aux_and_no_has_aux_is_an_error_naming_has_aux():
  def loss(p, x):
    h = x @ p["w"]
    return jnp.mean(_sq(h)), {"h": h}
  params, x = {"w": _normal(1, 3, 2)}, _normal(2, B, 3, scale=1.0)
  for api, call in (("clipped_grad", lambda: gl.clipped_grad(loss, l2_norm_clip=1.0)),
                    ("layer_coverage", lambda: lambda *a: gl.layer_coverage(loss, *a))):
    with pytest.raises(TypeError, match=rf"{api}: the loss returned more than a scalar. A "
                       r"loss that returns \(loss, aux\).*needs has_aux=True, as for "
                       rf"jax.grad: gl.{api}\(loss, \.\.\., has_aux=True\)"):
      call()(params, x)
  # With has_aux=True: the clipped gradient of the loss, aux as jax.grad gives it.
  grads, aux = gl.clipped_grad(loss, l2_norm_clip=1e9, has_aux=True)(params, x)
  expected, expected_aux = jax.grad(loss, has_aux=True)(params, x)
  np.testing.assert_allclose(grads["w"], expected["w"], rtol=1e-5)
  np.testing.assert_allclose(aux["h"], expected_aux["h"], rtol=1e-6)
  assert gl.layer_coverage(loss, params, x, has_aux=True).uncovered == []


def test_batch_norm_is_an_error_naming_the_parameter_and_the_op():
  loss, params, x = _batch_norm_loss()
  # One short message: where the loss mixes examples, every parameter, the fix.
  with pytest.raises(ValueError, match=r"clipped_grad: the function's output mixes "
                     r"examples at sub .*\(2 parameters: 'bn.scale', 'w'\)\. Fix: run "
                     r"batch norm in evaluation mode .* use LayerNorm or GroupNorm") as info:
    gl.clipped_grad(loss, l2_norm_clip=1.0)(params, x)
  assert len(str(info.value)) < 800


def test_examples_mixed_after_the_last_use_is_an_error():
  """A parameter-free batch centring after the last use (as batch norm without scale
  and offset, or a contrastive loss) leaves no per-example gradient."""
  def loss(p, x):
    h = x @ p["w"]
    return jnp.mean(jnp.sum((h - jnp.mean(h, axis=0)) ** 2, axis=-1))
  params, x = {"w": _normal(1, 3, 2)}, _normal(2, B, 3, scale=1.0)
  with pytest.raises(ValueError, match=r"clipped_grad: the function's output mixes "
                     r"examples at sub .*\(1 parameter: 'w'\)"):
    gl.clipped_grad(loss, l2_norm_clip=1.0)(params, x)
  assert gl.layer_coverage(loss, params, x).uncovered == ["w"]


def _one_trace(fun, params, *batch) -> bool:
  """Whether record_layers found `fun`'s batch axes from its one trace at B."""
  traced, _ = record_layers_lib.trace("record_layers", fun, (params, *batch), {}, 0, None)
  return traced.analysis.propagation is not None


def test_batch_axes_from_one_trace_and_the_second_trace_where_it_cannot_tell():
  """The batch axes come from the one trace where a rule tells them: values made to
  the batch's size (positions broadcast to the batch, an RNN's zero initial carry)
  count once they meet the batch. The second trace at 2B is the fallback where one
  trace cannot tell. Either way the records are plain JAX's (the recurrent model's
  cotangents by the zero-perturbation trick; conftest also checks every walk of the
  suite against the two-trace walk)."""
  t, d = 3, 2
  params = {"w": _normal(1, d, d), "u": _normal(2, d, d), "pos": _normal(3, t, d)}
  x = _normal(4, B, t, d, scale=1.0)

  def positions(p, x):  # Position ids made to the batch's size, gathered, then added.
    ids = jnp.broadcast_to(jnp.arange(x.shape[1]), x.shape[:2])
    return jnp.mean((x + p["pos"][ids]) @ p["w"]) ** 2

  def recurrent(p, x):  # The carry starts as zeros of shape (len(x), d).
    def cell(h, x_t):
      h = jnp.tanh(x_t @ p["w"] + h @ p["u"])
      return h, h
    _, hs = lax.scan(cell, jnp.zeros((x.shape[0], d)), jnp.swapaxes(x, 0, 1))
    return jnp.mean(hs ** 2)

  def square_mask(p, x):  # A (B, B) made value: which axis is the batch's?
    mask = jnp.tril(jnp.ones((x.shape[0], x.shape[0])))
    return jnp.mean((x @ p["w"]) ** 2) + 0.0 * jnp.sum(mask)

  def per_example_map(p, x):  # A scan over the batch.
    return jnp.mean(lax.map(lambda xi: jnp.sum((xi @ p["w"]) ** 2), x))

  def unconfirmed(p, x):  # Zeros of the batch's size that never meet the batch.
    return jnp.mean((x @ p["w"]) ** 2) + jnp.sum(jnp.zeros(x.shape[0]))

  assert _one_trace(positions, params, x) and _one_trace(recurrent, params, x)
  for fun in (square_mask, per_example_map, unconfirmed):
    assert not _one_trace(fun, params, x), fun.__name__
  assert not _one_trace(positions, params, x[:1])  # A batch of one.

  records = gl.reap(jax.grad(gl.record_layers(recurrent)))(params, x)
  assert_trees_close(jax.grad(gl.record_layers(recurrent))(params, x),
                     jax.grad(recurrent)(params, x))
  # The cotangent of each step's `x_t @ w` (a tied use: steps first): the gradient
  # of the loss with respect to zeros added to it.
  def perturbed(eps):
    def cell(h, inputs):
      x_t, eps_t = inputs
      h = jnp.tanh(x_t @ params["w"] + eps_t + h @ params["u"])
      return h, h
    return jnp.mean(lax.scan(cell, jnp.zeros((B, d)), (jnp.swapaxes(x, 0, 1), eps))[1] ** 2)
  np.testing.assert_allclose(records["w"].out_cotangent,
                             jax.grad(perturbed)(jnp.zeros((t, B, d))), rtol=1e-5, atol=1e-7)


def test_a_loss_whose_structure_depends_on_the_batch_size():
  """Where one trace tells the batch axes, a loss whose structure depends on the batch
  size is recorded as it traces at this size. Where it cannot (a value made with two
  axes of the batch's size), record_layers traces again at 2B, and a function that
  traces to another program there is refused, naming the API, both sizes, where, and
  the fix."""
  def loss(p, x, ambiguous=False):
    h = x @ p["w"]
    if ambiguous:  # Zeros of shape (B, B): which axis, if either, is the batch's?
      h = h + jnp.sum(jnp.zeros((x.shape[0], x.shape[0])), axis=1, keepdims=True)
    if x.shape[0] <= B:  # Another program at batch 2B.
      h = jnp.tanh(h)
    return jnp.mean(h ** 2)
  params, x = {"w": _normal(1, 3, 2)}, _normal(2, B, 3, scale=1.0)
  records = gl.reap(jax.grad(gl.record_layers(loss)))(params, x)
  np.testing.assert_allclose(
      records["w"].out_cotangent,
      jax.grad(lambda h: jnp.mean(jnp.tanh(h) ** 2))(x @ params["w"]), rtol=1e-6)

  ambiguous = functools.partial(loss, ambiguous=True)
  message = (rf": the function traced differently at batch sizes {B} and {2 * B}: tanh "
             rf"\(.*test_record_layers.py:\d+\) at batch {B}, integer_pow \(.*\) at "
             rf"batch {2 * B}\. record_layers finds the batch axis by tracing at both sizes; "
             r"make the function's structure independent of the batch size \(no Python "
             r"branch on x.shape\[0\]\)\.")
  with pytest.raises(ValueError, match="record_layers" + message):
    gl.reap(jax.grad(gl.record_layers(ambiguous)))(params, x)
  with pytest.raises(ValueError, match="clipped_grad" + message):
    gl.clipped_grad(ambiguous, l2_norm_clip=1.0)(params, x)

  def scaled(p, x):  # One more equation, at the end, at batch B.
    zero = jnp.sum(jnp.zeros((x.shape[0], x.shape[0])))
    out = jnp.mean((x @ p["w"]) ** 2) + zero
    return 2.0 * out if x.shape[0] <= B else out
  with pytest.raises(ValueError, match=rf"record_layers: the function traced differently "
                     rf"at batch sizes {B} and {2 * B}: mul \(.*test_record_layers.py:\d+\) "
                     rf"only at batch {B}\. "):
    gl.reap(jax.grad(gl.record_layers(scaled)))(params, x)
  # The same loss at a batch size whose two traces agree is recorded as plain JAX
  # differentiates it.
  x = _normal(3, 2 * B, 3, scale=1.0)
  records = gl.reap(jax.grad(gl.record_layers(ambiguous)))(params, x)
  np.testing.assert_allclose(records["w"].out_cotangent,
                             jax.grad(lambda h: jnp.mean(h ** 2))(x @ params["w"]), rtol=1e-6)


def test_mismatched_batch_axis_is_an_error():
  example_losses, params, x, y = _mlp()
  loss = _batch_loss(example_losses)
  message = (r": the batch arguments' leaves must all have the batch as their "
             r"leading axis, of one size; got shapes \[\(4, 5\), \(3, 2\)\]. Name the "
             r"arguments that hold the batch with batch_argnums")
  with pytest.raises(ValueError, match="clipped_grad" + message):
    gl.clipped_grad(loss, l2_norm_clip=1.0)(params, x, y[:3])
  with pytest.raises(ValueError, match="record_layers" + message):
    gl.record_layers(loss)(params, x, y[:3])
  with pytest.raises(ValueError, match=r"clipped_grad\(l2_norm_clip=.*positive Python number"):
    jax.jit(lambda c: gl.clipped_grad(loss, l2_norm_clip=c)(params, x, y))(1.0)
  with pytest.raises(ValueError, match=r"layer_coverage: the batch arguments' leaves"):
    gl.layer_coverage(loss, params, x, y[:3])


def test_layer_coverage_lists_covered_uncovered_and_unused_parameters():
  """A LoRA layer (covered), a weight-decayed head (not covered), a parameter that
  never meets the batch (unused), and batch norm (nothing covered)."""
  def loss(p, x):
    h = jnp.tanh(x @ (p["w"] + p["lora"]["a"] @ p["lora"]["b"]))
    return jnp.mean(_sq(h @ p["head"])) + 1e-3 * jnp.sum(p["head"] ** 2)
  params = {"w": _normal(1, 5, 3), "lora": {"a": _normal(2, 5, 2), "b": _normal(3, 2, 3)},
            "head": _normal(4, 3, 2), "unused": jnp.zeros(3)}
  x = _normal(5, B, 5, scale=1.0)
  coverage = gl.layer_coverage(loss, params, x)
  assert list(coverage.params) == ["head", "lora.a", "lora.b", "unused", "w"]
  assert coverage.uncovered == ["head"]
  assert coverage.unused == ["unused"]
  assert coverage.batch_size == B
  head = coverage.params["head"]
  assert not head.covered and head.shape == (3, 2) and head.method == ""
  assert [u.kind for u in head.uses] == ["dense", "unsupported"]
  assert "no batch axis" in head.uses[1].reason and "add" in head.uses[1].where
  w = coverage.params["w"]
  assert w.covered and [u.kind for u in w.uses] == ["dense"]
  assert w.method == "materialized" and "function of parameters" in w.note
  assert coverage.params["lora.a"].uses == w.uses  # One use of `w + a @ b`.
  assert coverage.params["unused"].covered and coverage.params["unused"].uses == ()
  table = str(coverage)
  lines = table.splitlines()
  assert lines[0].split() == ["parameter", "shape", "uses", "method", "MACs", "MiB",
                              "influence", "note"]
  assert [line.split()[0] for line in lines[1:6]] == list(coverage.params)
  assert "1 not covered" in lines[-1]

  loss, params, x = _batch_norm_loss()
  coverage = gl.layer_coverage(loss, params, x)
  assert coverage.uncovered == ["bn.scale", "w"]
  assert all("mixes examples" in c.note for c in coverage.params.values())


KINDS = {
    "attention_3d_kernels": {"query.kernel": "dense", "query.bias": "elementwise",
                             "key.kernel": "dense", "value.kernel": "dense",
                             "out.kernel": "dense", "out.bias": "elementwise"},
    "conv_depthwise": {"kernel": "conv", "bias": "elementwise"},
    "embed_scalar_index_under_vmap": {"table": "embed"},
    "embed_vocabulary_on_the_last_axis": {"table": "embed"},
    "embed_take_with_bias_and_dense": {"table": "embed", "bias": "elementwise",
                                       "w": "dense"},
    "tied_embedding_output_projection": {"embed": "embed,dense", "w": "dense"},
    "parameters_broadcast_to_the_output": {"w": "dense", "b": "elementwise",
                                           "gain": "elementwise", "pos": "elementwise"},
    "generic_uses": {"cls": "elementwise", "gate": "generic", "prefix": "elementwise",
                     "columns": "embed", "scale": "generic"},
    "lora_and_weight_norm": {"lora.w": "dense", "lora.a": "dense", "lora.b": "dense",
                             "wn.v": "dense", "wn.g": "dense"},
}


@pytest.mark.parametrize("name", list(KINDS))
def test_layer_coverage_kinds(name):
  """The kind of every use, as `gl.layer_coverage` reports it."""
  loss, params, batch = _case(name)
  coverage = gl.layer_coverage(loss, params, *batch)
  kinds = {path: ",".join(u.kind for u in c.uses) for path, c in coverage.params.items()}
  assert kinds == KINDS[name]
  assert coverage.uncovered == [] and coverage.unused == []


def test_layer_coverage_of_a_covered_model_matches_the_methods_used():
  loss, params, batch = _case("attention_3d_kernels")
  coverage = gl.layer_coverage(loss, params, *batch)
  assert coverage.uncovered == [] and coverage.unused == []
  norms = found(loss, params, *batch).norms
  assert {p: c.method for p, c in coverage.params.items()} == norms.method
  assert all(c.macs > 0 and c.floats > 0 for c in coverage.params.values())


def test_a_use_under_stop_gradient_is_no_use():
  """A target computed from the same weights under `stop_gradient` (a second forward
  pass, as for sampled labels or a teacher) gets a zero cotangent: each parameter has
  one use, recorded once, its bias in its dense layer's influence block, and the
  norms and clipped gradient equal vmap(grad)'s."""
  params = {"w": _normal(1, 3, 2), "b": _normal(2, 2)}

  def per_example(p, x):
    out = x @ p["w"] + p["b"]
    target = jax.lax.stop_gradient(jnp.tanh(x @ p["w"] + p["b"]))
    return 0.5 * jnp.sum((out - target) ** 2, axis=-1)

  loss, x = _batch_loss(per_example), _normal(3, B, 3)
  coverage = gl.layer_coverage(loss, params, x)
  assert {p: [u.kind for u in c.uses] for p, c in coverage.params.items()} == {
      "w": ["dense"], "b": ["elementwise"]}
  assert coverage.params["b"].influence == "kronecker (bias of w)"
  records = gl.reap(jax.grad(gl.record_layers(loss)))(params, x)
  assert sorted(records) == ["b", "w"]
  check_found(loss, params, x)


def test_penzai_embedding_lookup_is_an_embedding_use():
  """penzai's stock `EmbeddingLookup` (named axes), with its table's value given as
  a frozen parameter (as `pz.freeze_params` leaves it): one embedding use whose
  per-example norms and clipped gradient equal vmap(grad)'s."""
  pz = pytest.importorskip("penzai.pz")
  table = pz.nn.EmbeddingTable.from_config(
      name="emb", init_base_rng=jax.random.key(0), vocab_size=7,
      embedding_axes={"embedding": 3})

  def per_example(p, ids):
    value = pz.nx.wrap(p["table"]).tag("vocabulary", "embedding")
    layer = pz.nn.EmbeddingLookup(pz.nn.EmbeddingTable(
        embeddings=pz.ParameterValue(value=value, label="emb"),
        vocabulary_axis="vocabulary"))
    out = layer(pz.nx.wrap(ids).tag("batch", "seq"))
    return _sq(out.untag("batch", "seq", "embedding").unwrap())

  values = {"table": table.embeddings.value.untag("vocabulary", "embedding").unwrap()}
  loss, ids = _batch_loss(per_example), _ids(2, B, 5, vocabulary=7)
  coverage = gl.layer_coverage(loss, values, ids)
  assert [u.kind for u in coverage.params["table"].uses] == ["embed"], coverage
  for method in ("gram", "materialized"):
    check_found(loss, values, ids, method=method)


@pytest.mark.parametrize("name", list(MODELS))
def test_every_parameter_the_loss_depends_on_has_a_use(name):
  """Completeness: every parameter leaf with a nonzero gradient (plain `jax.grad`)
  has at least one use, covered or unsupported with its reason."""
  loss, params, batch = _case(name)
  grads = jax.grad(loss)(params, *batch)
  coverage = gl.layer_coverage(loss, params, *batch)
  for path, grad in jax.tree_util.tree_flatten_with_path(grads)[0]:
    if np.any(np.asarray(grad, np.float64) != 0):
      entry = coverage.params[path_name(path)]
      assert entry.uses, (name, path_name(path))


def test_a_parameter_reaching_the_loss_without_the_batch_is_an_error():
  """A leaf whose effect on the loss never meets the batch has no per-example
  gradient: an error naming it, not a silent zero in `gl.clipped_grad`."""
  def loss(p, x):
    del x
    return jnp.sum(p["s"] ** 2)

  params, x = {"s": jnp.ones(3)}, jnp.ones((B, 2))
  with pytest.raises(ValueError, match=r"clipped_grad: the parameters 's' \(first read by "
                     r"integer_pow.*\) reach the loss without meeting the batch"):
    gl.clipped_grad(loss, l2_norm_clip=1.0)(params, x)
  with pytest.raises(ValueError, match="'s'"):
    gl.layer_coverage(loss, params, x)


@pytest.mark.parametrize("mode", ["promise_in_bounds", "clip", "fill"])
def test_out_of_range_ids_get_the_gradient_jax_grad_gives(mode):
  """`table[ids]` and `mode="fill"` drop an out-of-range id's gradient, `mode="clip"`
  sends it to the clamped row: per-example norms and clipping as vmap(grad)."""
  def per_example(p, ids):
    if mode == "promise_in_bounds":
      return _sq(p["table"][ids])
    return _sq(jnp.take(p["table"], ids, axis=0, mode=mode))
  ids = jnp.array([[1, 9, 2], [6, 6, 0], [3, 4, 12], [5, 0, 1]])  # 9 and 12 are out of range.
  check_found(_batch_loss(per_example), {"table": _normal(1, 7, 3)}, ids)
