"""A hand-marked layer record read as a layer use, like the uses `record_layers` finds.

`gl.dense`, `gl.conv2d`, `gl.embed` and `gl.layer_norm` record a `LayerInputs`
(`x`, `w`, `b`, kind, options). `MarkedUse` reads such a record through the
interface `FoundUse` has (`_found.py`), so every analysis reads both families in one
loop:

* `keys`: the result keys the use contributes to (its record name: weight and bias
  together, as `LayerParams(w, b)`, with the record's call axes in front);
* `view()`: its canonical `(S, B, T, d)` `LayerView`;
* `weighted_grads(c)`, `per_example_grads()`, `inner_products(directions)`,
  `sum_of_squares(chunk_size)`: `sum_i c_i grad_i`, each example's gradient,
  `<grad_i, v>`, and `sum_i grad_i^2`, all by key as `LayerParams`.

Everything is the layer's own function (`_layers.apply`) differentiated at the
recorded input: the vjp at `c g`, the jvp along `v`, the vjp of one example's slice.

Sharp edges:
  * A hand-marked layer knows no parameter path: its key is its record name, and
    its calls are taken to have their own weights unless the analysis is told
    `tied=(name,)`.
  * `dense_dot_general` records no bias; its bias's gradient is `sum_t g_t` (the
    bias is added right after the product).
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from jax import lax

from oryx_gradlog.record import _layers
from oryx_gradlog.record._kinds import CONV, DENSE, EMBED, LAYER_NORM
from oryx_gradlog.record._layers import LayerInputs, WEIGHT_RANK, normalize
from oryx_gradlog.record._record import VJPRecord
from oryx_gradlog.record._canonical import (
    LayerParams, LayerView, as_float, conv_patches, dot, finish, fold_tied)

# The rank of one example's input per call (the example axis included).
_INPUT_RANK = {DENSE: 2, CONV: 4, EMBED: 1, LAYER_NORM: 2}


def call_axes(layer: LayerInputs) -> int:
  """The leading call axes of a hand-marked layer: those of its weight beyond its rank."""
  return layer.w.ndim - WEIGHT_RANK[layer.kind]


@dataclasses.dataclass(frozen=True)
class MarkedUse:
  """A hand-marked layer record, read as a layer use (internal).

  Attributes:
    name: the record name (the use's one key).
    layer: the record's `LayerInputs`.
    g: the output cotangent `(*calls, batch, *positions, features)`.
    tied: whether the calls share one weight (`tied=(name,)`).
  """

  name: str
  layer: LayerInputs
  g: jax.Array
  tied: bool = False

  @classmethod
  def of(cls, name: str, record: VJPRecord, tied: bool) -> MarkedUse:
    return cls(name, record.primals[0], record.out_cotangent, tied)

  def check(self, api: str) -> None:
    """Raises unless the record holds one backward pass of a batch."""
    layer, n = self.layer, self.n_calls
    if layer.x.ndim < n + _INPUT_RANK[layer.kind]:
      raise ValueError(
          f"{api}: record {self.name!r} has input x of shape {layer.x.shape} and {n} "
          f"call axes {layer.w.shape[:n]}, which leaves no example axis. Per-example "
          "analyses take the records of one backward pass of the batch loss: apply the "
          "layer to a batch, or inside a vmap over the examples of the batch (not to a "
          "single example).")
    if self.g is None:
      raise ValueError(f"{api}: record {self.name!r} has no output cotangent.")

  @property
  def kind(self) -> str:
    return self.layer.kind

  @property
  def keys(self) -> tuple[str, ...]:
    return (self.name,)

  @property
  def n_calls(self) -> int:
    return call_axes(self.layer)

  @property
  def batch_size(self) -> int:
    return self.g.shape[self.n_calls]

  @property
  def keeps_calls(self) -> bool:
    """Results keep the view's call axes (calls of one name are layers of their own;
    a tied record's view has none)."""
    return True

  @property
  def simple(self) -> bool:
    """A hand-marked layer's gradient is its own: its view keeps the norms."""
    return True

  @property
  def _bias(self) -> bool:
    """Whether a bias is added that the record does not hold (`dense_dot_general`)."""
    return self.layer.b is None and self.layer.options.get("bias", False)

  def values(self) -> dict[str, LayerParams]:
    """The recorded parameter values, `(*calls, *w)` (one call's where tied)."""
    w, b = self.layer.w, self.layer.b
    if self.tied:
      first = lambda v: v.reshape((-1,) + v.shape[self.n_calls:])[0]
      w, b = first(w), None if b is None else first(b)
    return {self.name: LayerParams(w, b)}

  def examples(self, start, size) -> None:
    """A found use's examples alone (`FoundUse.examples`); a marked layer's
    per-example gradients are formed whole."""
    del start, size
    return None

  # The canonical (S, B, T, d) view.
  def view(self, force: bool = False) -> LayerView:
    """The layer's `LayerView` (`force` is for the interface of `FoundUse`)."""
    del force
    layer, g = self.layer, self.g
    w, x = layer.w, layer.x
    n = self.n_calls
    stack = tuple(w.shape[:n])
    options = layer.options
    groups, vocabulary = 1, 0
    if layer.kind == CONV:
      spec = lax.conv_dimension_numbers(x.shape[-4:], w.shape[n:],
                                        options["dimension_numbers"])
      lead = x.ndim - n - 4  # Vmapped per-example code: the vmap axes, then N.
      x, g = conv_patches(x, w.shape[n:], g, spec, options, n, lead + 1)
      groups = options["feature_group_count"]
    else:
      if layer.kind == LAYER_NORM:  # Its scale multiplies the normalised input.
        x = normalize(as_float(x), options["eps"])
      batch = x.shape[n]
      size = math.prod(stack)
      rank = _INPUT_RANK[layer.kind]
      x = x.reshape((size, batch, -1) + x.shape[x.ndim - rank + 1:])
      g = g.reshape((size, batch, -1, g.shape[-1]))
      if layer.kind == EMBED:
        vocabulary = w.shape[-2]
    has_bias = layer.b is not None or options.get("bias", False)
    if self.tied:
      x, g, stack = fold_tied(x, g, stack, [True] * len(stack))
    return finish(layer.kind, x, g, stack, groups, vocabulary, has_bias)

  # The layer as a function of its parameters.
  def _function(self, lead_axes: bool = True):
    """`(w, b, x) -> output`, vmapped over the call axes (and, for a conv2d applied
    per example under a vmap, the vmapped axes before the conv's own four)."""
    layer = self.layer
    lead = layer.x.ndim - self.n_calls - 4 if layer.kind == CONV and lead_axes else 0

    def apply(w, b, x):
      return _layers.apply(dataclasses.replace(layer, x=x, w=w, b=b))

    for _ in range(lead):
      apply = jax.vmap(apply, in_axes=(None, None, 0))
    for _ in range(self.n_calls):
      apply = jax.vmap(apply)
    return apply

  def _sum_calls(self, grads: LayerParams) -> LayerParams:
    if not self.tied:
      return grads
    axes = tuple(range(self.n_calls))
    return LayerParams(jnp.sum(grads.w, axis=axes),
                       None if grads.b is None else jnp.sum(grads.b, axis=axes))

  def _example_weights(self, c: jax.Array) -> jax.Array:
    shape = [1] * self.g.ndim
    shape[self.n_calls] = -1
    return c.reshape(shape).astype(self.g.dtype)

  def weighted_grads(self, c: jax.Array) -> dict[str, LayerParams]:
    """`sum_i c_i grad_i` (of the recorded loss): the vjp at the cotangent `c g`."""
    layer, n = self.layer, self.n_calls
    cotangent = self._example_weights(c) * self.g
    _, vjp = jax.vjp(lambda w, b: self._function()(w, b, layer.x), layer.w, layer.b)
    w_grad, b_grad = vjp(cotangent)
    if self._bias:
      b_grad = jnp.sum(cotangent, axis=tuple(range(n, cotangent.ndim - 1)))
    return {self.name: self._sum_calls(LayerParams(w_grad, b_grad))}

  def inner_products(self, directions: dict[str, LayerParams]) -> jax.Array:
    """`(B,)`: `<grad_i, v>` (of the recorded loss), `v = directions[name]` shaped
    like the layer's parameters (without the call axes where tied)."""
    layer, g, n = self.layer, self.g, self.n_calls
    direction = directions[self.name]
    w, b = direction.w, direction.b
    if self.tied:
      w = jnp.broadcast_to(w, layer.w.shape)
      b = None if b is None or layer.b is None else jnp.broadcast_to(b, layer.b.shape)
    has_b = layer.b is not None
    _, tangent = jax.jvp(lambda w, b: self._function()(w, b, layer.x), (layer.w, layer.b),
                         (w.astype(layer.w.dtype), b if has_b else None))
    if self._bias:
      tangent = tangent + b.reshape(b.shape[:-1] + (1,) * (g.ndim - b.ndim) + b.shape[-1:])
    products = g * tangent
    return jnp.sum(jnp.moveaxis(products, n, 0).reshape(g.shape[n], -1), axis=1)

  def per_example_grads(self) -> dict[str, LayerParams]:
    """Each example's gradient (of the recorded loss), `(B, *calls, *w)`: the vjp of
    the layer applied to one example's input at that example's cotangent, vmapped
    over the examples (XLA batches the matmuls or convolutions)."""
    layer, n = self.layer, self.n_calls
    apply = self._function()
    # One example keeps a batch axis of one where the batch axis was.
    split = lambda a: jnp.moveaxis(jnp.expand_dims(a, n + 1), n, 0)

    def one(x, g):
      _, vjp = jax.vjp(lambda w, b: apply(w, b, x), layer.w, layer.b)
      w_grad, b_grad = vjp(g)
      if self._bias:
        b_grad = jnp.sum(g, axis=tuple(range(n, g.ndim - 1)))
      return self._sum_calls(LayerParams(w_grad, b_grad))

    return {self.name: jax.vmap(one)(split(layer.x), split(self.g))}

  def sum_of_squares(self, chunk_size: int | None = None) -> dict[str, LayerParams] | None:
    """`sum_i grad_i^2` (of the recorded loss) of a dense layer from its view,
    `chunk_size` examples at a time; `None` for the other kinds."""
    if self.kind != DENSE:
      return None
    view = self.view()
    w = dense_sum_of_squares(view.x, view.g, chunk_size)
    b = None if view.bias_g is None else jnp.sum(view.bias_g ** 2, axis=1)
    unstack = lambda a: a.reshape(view.stack_shape + a.shape[1:])
    return {self.name: LayerParams(unstack(w), None if b is None else unstack(b))}


def dense_sum_of_squares(x: jax.Array, g: jax.Array, chunk_size: int | None) -> jax.Array:
  """`(S, d_in, d_out)`: sum over examples of the squared `x_i^T g_i` of a view."""
  if x.shape[2] == 1:
    return dot("sbd,sbe->sde", x[:, :, 0] ** 2, g[:, :, 0] ** 2)
  batch = x.shape[1]
  if chunk_size is None or chunk_size >= batch:
    per_example = dot("sbtd,sbte->sbde", x, g)
    return jnp.sum(per_example * per_example, axis=1)
  if batch % chunk_size:
    raise ValueError(
        f"sum_grad_squared(chunk_size={chunk_size}): the batch size {batch} is not a "
        "multiple of chunk_size. Pass a divisor of the batch size, or None.")

  def chunks(a):
    a = a.reshape((a.shape[0], batch // chunk_size, chunk_size) + a.shape[2:])
    return jnp.moveaxis(a, 1, 0)

  def step(total, chunk):
    per_example = dot("sbtd,sbte->sbde", *chunk)
    return total + jnp.sum(per_example * per_example, axis=1), None

  zeros = jnp.zeros((x.shape[0], x.shape[3], g.shape[3]), g.dtype)
  return lax.scan(step, zeros, (chunks(x), chunks(g)))[0]
