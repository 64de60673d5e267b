"""Hand-marked layer records: dense, conv2d, embedding and layer-norm layers.

The analyses (per-example gradient norms, K-FAC factors, gradient noise) need, per
layer, the layer's input `x`, its weight `w` and the cotangent `g` of its output,
and they need to know what the layer computes. `dense`, `conv2d`, `embed` and
`layer_norm` are
`record_vjp(..., full=True)` wrappers whose single positional input is a
`LayerInputs` pytree: its data are `x`, `w`, `b`, and its static fields say the kind
of layer and its options (strides, padding, ...). So the record of a layer is an
ordinary `VJPRecord` that carries its own description through `jit`, `vmap`, `scan`
and the stacking of calls, and the analyses need no other bookkeeping:

    records["fc1"].primals[0].x        # the layer's input (batch, ..., d_in)
    records["fc1"].primals[0].w        # its weight (d_in, d_out)
    records["fc1"].out_cotangent       # dL/dy (batch, ..., d_out)
    records["fc1"].in_cotangents[0].w  # dL/dw, the batch gradient

Layout of a layer record: `(*calls, batch, *positions, features)`. `calls` are the
leading axes the record's weight has beyond its own rank (k calls of one name, a
`lax.scan` over layers); the batch axis follows; then positions (tokens, or pixels
for a convolution's output), which a per-example gradient sums over. A model written
per example and vmapped inside the loss (the Equinox style) records the same layout,
because the weight is shared by the vmap and keeps its own shape.

The analyses read these records as `MarkedUse`s (`_marked.py`), through the interface
of the uses `gl.record_layers` finds in any model's jaxpr (`_found.py`), in one loop.
Inside a loss wrapped in `gl.record_layers`, a marked layer is recorded once, as the
uses found in it, by parameter path (so `ClippedGrads.params` and the instruments
need no `where=`).

Marking Flax and Equinox layers:

    # Flax linen: nn.Dense calls its `dot_general` with (inputs, kernel, ...); the
    # bias is added after it, so tell the record that there is one.
    nn.Dense(128, dot_general=gl.dense_dot_general(name="fc1"))

    # Equinox: eqx.nn.Linear holds weight (out, in) and is applied per example.
    def linear(layer, x, name):
      return gl.dense(x, layer.weight.T, layer.bias, name=name)

Sharp edges:
  * A record describes one use of its weight. A parameter used outside its marked
    layer (a tied embedding reused as the output projection by a plain matmul) has
    per-example gradients that the analyses cannot see; mark every use.
  * Every call of a name is taken to have its own weight (a `scan` over stacked
    layers). For calls that share one weight (an RNN cell in a `scan`, a layer
    applied twice) pass `tied=("name",)` to the analyses: the calls then count as
    more positions of one layer.
  * `dense_dot_general` records no bias; `bias=True` (the default, as `nn.Dense`
    has one) makes the analyses count the bias's per-example gradient, which is the
    sum of `g` over positions. Pass `bias=False` for `use_bias=False`.
  * The analyses assume that example i's loss depends on example i's rows only (no
    batch norm, no in-batch contrastive losses); otherwise "per-example gradient"
    has no meaning.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from oryx_gradlog.record._kinds import CONV, DENSE, EMBED, LAYER_NORM
from oryx_gradlog.record._record import record_vjp
from oryx_gradlog.record._sites import DEFAULT_TAG

# The rank of the weight of each kind of layer; a record's weight has more axes
# only in front, one per stacked call axis.
WEIGHT_RANK = {DENSE: 2, CONV: 4, EMBED: 2, LAYER_NORM: 1}


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=["x", "w", "b"],
    meta_fields=["kind", "config"],
)
@dataclasses.dataclass(frozen=True)
class LayerInputs:
  """The inputs of a marked layer, as its record holds them (`primals[0]`).

  Attributes:
    x: the layer's input (token ids for an embedding).
    w: its weight: `(d_in, d_out)` for dense, the kernel for conv2d, the
      `(vocabulary, d)` table for an embedding.
    b: its bias, or `None`.
    kind: `"dense"`, `"conv"`, `"embed"` or `"layer_norm"` (static; the kinds of
      `gl.record_layers`'s uses, and `"layer_norm"`).
    config: the layer's static options as sorted `(key, value)` pairs.

  Example:
    >>> import jax, jax.numpy as jnp, oryx_gradlog as gl
    >>> loss = lambda w, x: jnp.sum(gl.dense(x, w, name="fc") ** 2)
    >>> record = gl.reap(jax.grad(loss))(jnp.ones((3, 2)), jnp.ones((4, 3)))["fc"]
    >>> record.primals[0].kind, record.primals[0].x.shape, record.out_cotangent.shape
    ('dense', (4, 3), (4, 2))
  """

  x: Any
  w: Any
  b: Any
  kind: str
  config: tuple = ()

  @property
  def options(self) -> dict[str, Any]:
    """The static options as a dict."""
    return dict(self.config)


def apply(layer: LayerInputs) -> jax.Array:
  options = layer.options
  if layer.kind == DENSE:
    y = jnp.matmul(layer.x, layer.w, precision=options.get("precision"))
  elif layer.kind == EMBED:
    return jnp.take(layer.w, layer.x, axis=0)
  elif layer.kind == LAYER_NORM:
    y = normalize(layer.x, options["eps"]) * layer.w
  else:
    y = lax.conv_general_dilated(
        layer.x, layer.w, options["window_strides"], options["padding"],
        options["lhs_dilation"], options["rhs_dilation"], options["dimension_numbers"],
        options["feature_group_count"], precision=options.get("precision"))
  if layer.b is None:
    return y
  if layer.kind == CONV:
    out_spec = lax.conv_dimension_numbers(
        layer.x.shape, layer.w.shape, options["dimension_numbers"]).out_spec
    shape = [1] * y.ndim
    shape[out_spec[1]] = -1
    return y + jnp.reshape(layer.b, shape)
  return y + layer.b


def normalize(x: jax.Array, eps: float) -> jax.Array:
  """`(x - mean) / sqrt(var + eps)` over the last axis: a layer norm without parameters."""
  mean = jnp.mean(x, axis=-1, keepdims=True)
  centred = x - mean
  return centred * lax.rsqrt(jnp.mean(centred * centred, axis=-1, keepdims=True) + eps)


def _record(layer: LayerInputs, name: str, tag: str) -> jax.Array:
  return record_vjp(apply, name=name, tag=tag, full=True)(layer)


def dense(
    x: jax.Array, w: jax.Array, b: jax.Array | None = None, *, name: str,
    tag: str = DEFAULT_TAG, precision: Any = None,
) -> jax.Array:
  """Returns `x @ w + b`, recorded as a dense layer named `name`.

  The record is a `VJPRecord` whose `primals[0]` is `LayerInputs(x, w, b)`, so the
  analyses (`per_example_norms`, `kfac_factors`, ...) know the layer's input, weight
  and output cotangent.

  Args:
    x: input, `(batch, d_in)` or `(batch, *positions, d_in)`; per example `(d_in,)`
      or `(*positions, d_in)` inside a vmap over examples.
    w: weight `(d_in, d_out)`. (An Equinox `Linear` holds `(d_out, d_in)`: pass
      `layer.weight.T`.)
    b: optional bias `(d_out,)`.
    name: the record name.
    tag: the Oryx tag of the record.
    precision: passed to `jnp.matmul`.

  Returns:
    `x @ w + b`.

  Example:
    >>> import jax, jax.numpy as jnp, oryx_gradlog as gl
    >>> loss = lambda w, x: jnp.mean(jnp.sum(gl.dense(x, w, name="fc") ** 2, axis=-1))
    >>> result = gl.per_example_norms(gl.reap(jax.grad(loss))(jnp.eye(2), jnp.eye(2)))
    >>> result.norms  # example i's loss |e_i w|^2 has gradient 2 outer(e_i, e_i)
    Array([2., 2.], dtype=float32)
  """
  w = jnp.asarray(w)
  if w.ndim != 2 or jnp.shape(x)[-1:] != w.shape[:1] or (
      b is not None and jnp.shape(b) != w.shape[1:]):
    raise ValueError(
        f"dense(name={name!r}): got x {jnp.shape(x)}, w {w.shape}, b "
        f"{None if b is None else jnp.shape(b)}; dense computes x @ w + b with w of "
        "shape (d_in, d_out), x of shape (..., d_in) and b of shape (d_out,). "
        "Transpose w if it is stored (d_out, d_in), as in Equinox.")
  config = () if precision is None else (("precision", precision),)
  return _record(LayerInputs(x, w, b, DENSE, config), name, tag)


def dense_dot_general(
    *, name: str, bias: bool = True, tag: str = DEFAULT_TAG
) -> Callable[..., jax.Array]:
  """Returns a `dot_general` that records its operands as a dense layer.

  For Flax linen's `nn.Dense(features, dot_general=...)` and Flax NNX's stock
  `nnx.Linear(din, dout, dot_general=..., rngs=...)`, which compute
  `dot_general(inputs, kernel, (((inputs.ndim - 1,), (0,)), ((), ())))` and then
  add their bias. The record holds no bias; `bias` says whether the layer adds one,
  so that the analyses count the bias's per-example gradient (the sum of `g` over
  positions, exact because the bias is added right after the product).

  Args:
    name: the record name (give each `nn.Dense` its own).
    bias: whether the layer adds a bias after the product (`use_bias`).
    tag: the Oryx tag of the record.

  Returns:
    A function with the signature of `jax.lax.dot_general`.

  Example:
    >>> import jax, jax.numpy as jnp, oryx_gradlog as gl
    >>> dot = gl.dense_dot_general(name="fc", bias=False)  # nn.Dense(..., dot_general=dot)
    >>> loss = lambda w, x: jnp.mean(jnp.sum(dot(x, w, (((1,), (0,)), ((), ()))) ** 2, -1))
    >>> gl.per_example_norms(gl.reap(jax.grad(loss))(jnp.eye(2), jnp.eye(2))).norms
    Array([2., 2.], dtype=float32)
  """

  def dot_general(lhs, rhs, dimension_numbers, precision=None, preferred_element_type=None,
                  out_sharding=None):
    if out_sharding is not None:  # NNX 0.12 passes out_sharding=None by default.
      raise ValueError(
          f"dense_dot_general(name={name!r}): got out_sharding={out_sharding}, which a "
          "recorded layer does not take. Call the layer without out_sharding and shard "
          "its output with jax.lax.with_sharding_constraint.")
    lhs, rhs = jnp.asarray(lhs), jnp.asarray(rhs)
    (lhs_contract, rhs_contract), (lhs_batch, rhs_batch) = dimension_numbers
    expected = (((lhs.ndim - 1,), (0,)), ((), ()))
    if rhs.ndim != 2 or (tuple(lhs_contract), tuple(rhs_contract), tuple(lhs_batch),
                         tuple(rhs_batch)) != ((lhs.ndim - 1,), (0,), (), ()):
      raise ValueError(
          f"dense_dot_general(name={name!r}): got dimension_numbers "
          f"{dimension_numbers} for operands {lhs.shape} and {rhs.shape}; it records "
          f"a dense layer, inputs (..., d_in) contracted with a (d_in, d_out) kernel, "
          f"i.e. dimension_numbers {expected}. Use it only as nn.Dense's dot_general.")
    config = (("bias", bool(bias)),)
    if precision is not None:
      config += (("precision", precision),)
    y = _record(LayerInputs(lhs, rhs, None, DENSE, config), name, tag)
    return y if preferred_element_type is None else y.astype(preferred_element_type)

  return dot_general


def conv2d(
    x: jax.Array, w: jax.Array, b: jax.Array | None = None, *, name: str,
    window_strides: Sequence[int] = (1, 1),
    padding: str | Sequence[tuple[int, int]] = "SAME",
    lhs_dilation: Sequence[int] | None = None,
    rhs_dilation: Sequence[int] | None = None,
    dimension_numbers: tuple[str, str, str] = ("NHWC", "HWIO", "NHWC"),
    feature_group_count: int = 1,
    tag: str = DEFAULT_TAG,
    precision: Any = None,
) -> jax.Array:
  """Returns a 2-D convolution of `x` with `w` plus `b`, recorded as a conv2d layer.

  Arguments after `b` are those of `jax.lax.conv_general_dilated` (default layout
  NHWC input, HWIO kernel, as Flax's `nn.Conv`). The bias is added along the
  output's feature axis.

  Args:
    x: the 4-D input with its batch axis (per example inside a vmap, give it a
      batch axis of one: `x[None]`).
    w: the kernel.
    b: optional bias, one per output feature.
    name: the record name.
    window_strides: see `jax.lax.conv_general_dilated`.
    padding: see `jax.lax.conv_general_dilated`.
    lhs_dilation: see `jax.lax.conv_general_dilated`.
    rhs_dilation: see `jax.lax.conv_general_dilated`.
    dimension_numbers: three strings, e.g. `("NCHW", "OIHW", "NCHW")`.
    feature_group_count: see `jax.lax.conv_general_dilated`.
    tag: the Oryx tag of the record.
    precision: passed to the convolution.

  Returns:
    The convolution plus bias.

  Example:
    >>> import jax, jax.numpy as jnp, oryx_gradlog as gl
    >>> x, w = jnp.ones((2, 4, 4, 1)), jnp.ones((3, 3, 1, 2))
    >>> loss = lambda w, x: jnp.sum(gl.conv2d(x, w, name="conv"))
    >>> gl.reap(jax.grad(loss))(w, x)["conv"].out_cotangent.shape
    (2, 4, 4, 2)
  """
  x, w = jnp.asarray(x), jnp.asarray(w)
  padding = padding if isinstance(padding, str) else tuple(map(tuple, padding))
  dimension_numbers = tuple(dimension_numbers)
  if x.ndim != 4 or w.ndim != 4 or not all(isinstance(s, str) for s in dimension_numbers):
    raise ValueError(
        f"conv2d(name={name!r}): got x {x.shape}, w {w.shape} and dimension_numbers "
        f"{dimension_numbers}; conv2d needs a batched 4-D input, a 4-D kernel and "
        "dimension_numbers given as three strings such as ('NHWC', 'HWIO', 'NHWC'). "
        "Inside a vmap over examples, add the batch axis back: x[None].")
  config = (
      ("dimension_numbers", dimension_numbers),
      ("feature_group_count", int(feature_group_count)),
      ("lhs_dilation", None if lhs_dilation is None else tuple(lhs_dilation)),
      ("padding", padding),
      ("rhs_dilation", None if rhs_dilation is None else tuple(rhs_dilation)),
      ("window_strides", tuple(window_strides)),
  )
  if precision is not None:
    config += (("precision", precision),)
  return _record(LayerInputs(x, w, b, CONV, config), name, tag)


def embed(ids: jax.Array, table: jax.Array, *, name: str, tag: str = DEFAULT_TAG) -> jax.Array:
  """Returns `table[ids]`, recorded as an embedding layer named `name`.

  Args:
    ids: integer token ids, `(batch,)` or `(batch, *positions)`.
    table: the embedding table `(vocabulary, d)`.
    name: the record name.
    tag: the Oryx tag of the record.

  Returns:
    The rows of `table` at `ids`, `(*ids.shape, d)`.

  Example:
    >>> import jax, jax.numpy as jnp, oryx_gradlog as gl
    >>> loss = lambda table, ids: jnp.sum(gl.embed(ids, table, name="emb"))
    >>> ids = jnp.array([[0, 0, 1]])  # one example, token 0 twice: its row gets 2 * ones
    >>> gl.per_example_norms(gl.reap(jax.grad(loss))(jnp.zeros((3, 2)), ids),
    ...                      reduction="sum").norms
    Array([3.1622777], dtype=float32)
  """
  table = jnp.asarray(table)
  if table.ndim != 2 or not jnp.issubdtype(jnp.result_type(ids), jnp.integer):
    raise ValueError(
        f"embed(name={name!r}): got ids of dtype {jnp.result_type(ids)} and a table of "
        f"shape {table.shape}; embed needs integer ids and a (vocabulary, d) table.")
  return _record(LayerInputs(ids, table, None, EMBED), name, tag)


def layer_norm(
    x: jax.Array, scale: jax.Array, offset: jax.Array | None = None, *, name: str,
    eps: float = 1e-6, tag: str = DEFAULT_TAG,
) -> jax.Array:
  """Returns the layer norm of `x` over its last axis, recorded as a layer named `name`.

  Computes `(x - mean) / sqrt(var + eps) * scale + offset`, mean and variance over
  the last axis (as Flax's `nn.LayerNorm`). The record's `LayerInputs` holds `x`,
  `w=scale` and `b=offset`, so that `per_example_norms` and `per_example_clip` count the
  per-example gradients of the scale (`sum_t xhat_t * g_t`) and the offset
  (`sum_t g_t`).

  Args:
    x: input `(batch, *positions, d)`.
    scale: `(d,)`.
    offset: optional `(d,)`.
    name: the record name.
    eps: added to the variance.
    tag: the Oryx tag of the record.

  Returns:
    The normalised, scaled and shifted `x`.

  Example:
    >>> import jax, jax.numpy as jnp, oryx_gradlog as gl
    >>> first = lambda y: y[..., 0]
    >>> loss = lambda s, x: jnp.sum(first(gl.layer_norm(x, s, name="ln", eps=0.0)))
    >>> x = jnp.array([[0.0, 2.0], [3.0, 1.0]])  # normalised: [-1, 1] and [1, -1]
    >>> gl.per_example_norms(gl.reap(jax.grad(loss))(jnp.ones(2), x), reduction="sum").norms
    Array([1., 1.], dtype=float32)
  """
  scale = jnp.asarray(scale)
  d = jnp.shape(x)[-1:]
  if scale.shape != d or (offset is not None and jnp.shape(offset) != d):
    raise ValueError(
        f"layer_norm(name={name!r}): got x {jnp.shape(x)}, scale {scale.shape} and offset "
        f"{None if offset is None else jnp.shape(offset)}; scale and offset must have "
        "the shape (d,) of x's last axis, which the layer normalises.")
  return _record(LayerInputs(x, scale, offset, LAYER_NORM, (("eps", float(eps)),)), name, tag)
