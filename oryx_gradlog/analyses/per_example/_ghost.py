"""Per-example gradient norms from one ordinary backward pass ("ghost" norms).

For a dense layer `y = x @ w + b`, example i's gradient of `w` is `x_i^T g_i`, where
`x_i` is `(T, d_in)` (T positions: tokens, or 1 for a vector input) and `g_i` the
`(T, d_out)` cotangent of `y_i`. Its squared Frobenius norm needs neither that
matrix nor a per-example backward pass (Goodfellow 2015; Li et al. 2021, "ghost
clipping"; Bu et al. 2023, "book-keeping"):

    ||x_i^T g_i||^2 = <x_i x_i^T, g_i g_i^T>       (Gram form, T^2 (d_in + d_out))
                    = ||x_i||^2 ||g_i||^2           (T = 1)

or, when that is cheaper, materialise `x_i^T g_i` (T d_in d_out) and square it; the
choice is made per layer and reported in `PerExampleNorms.methods`. The bias's
per-example gradient is `sum_t g_it`. An embedding's per-example gradient scatters
the rows of `g_i` into the table rows named by the ids, so its squared norm is
`sum_{t,s} [id_t == id_s] <g_t, g_s>`; its "Gram" form sorts the ids and sums the
rows of each run of equal ids (`T d`, no `(T, T)` array). A 2-D convolution is a
dense layer over the patches of its input (`jax.lax.conv_general_dilated_patches`),
one position per output pixel; feature groups are independent dense layers.

Everything comes from the layer records (`x`, `g`) of the batch loss's backward pass:
`gl.reap(jax.grad(gl.record_layers(loss)))(...)` for any model (the uses of each
parameter found in its jaxpr), or `gl.reap(jax.grad(loss))(...)` with layers marked by
`gl.dense`, `gl.conv2d`, `gl.embed`, `gl.layer_norm` (whose scale's per-example
gradient is `sum_t xhat_it * g_it`, `xhat` the normalised input). A found parameter
used once, through views (reshape, transpose, cast, the slices of a `scan` over
stacked layers), by a dense, convolution or embedding use takes the Gram form or
materialises as the cost model says; other uses (element-wise scales and biases,
generic operations) and parameters with several uses or made by functions of
parameters have their per-example gradients formed and summed in the parameter's
space, so tied weights get their cross terms exactly. Loss convention: the batch
loss is `sum_i l_i` (`reduction="sum"`) or `mean_i l_i` (`reduction="mean"`, the
default); a per-example gradient is always the gradient of `l_i` itself, so for a
mean the recorded cotangents are multiplied by the batch size.

Sharp edges:
  * Only recorded layers count: `norms` is the norm over the parameters of the layer
    records analysed. `gl.record_layers` records every use of every parameter; with
    hand-marked layers, a parameter used elsewhere (a layer norm applied without
    `gl.layer_norm`) is not in the total.
  * Results are keyed by record name for hand-marked layers (weight and bias
    together, with their call axes) and by parameter path for found records (every
    use of the parameter together, `(batch,)`).
  * A layer norm's per-example gradient is always formed (it is `(d,)`), whatever
    `method` says; its method is reported as "materialized".
  * Calls of one name are taken to have their own weights (scan over stacked
    layers: norms per call, shape `(*calls, batch)`). For calls sharing one weight
    (an RNN cell, a layer applied twice) pass `tied=(name,)`: its gradient sums
    over the calls and its norms have shape `(batch,)`.
  * Call it on the records as the reap returns them, inside any vmap or scan that
    made them: a vmap or scan outside the reap adds axes in front that would be
    taken for calls.
  * Records of a per-shard reap inside `shard_map` have the local batch: with
    `reduction="mean"` the local batch size is used, so scale the loss as the
    global mean needs.
  * The Gram form sums products of either sign; norms far smaller than the
    activations they come from lose relative precision (as any float32 sum does).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Collection, Sequence
from typing import Any

import jax
import jax.numpy as jnp

from oryx_gradlog.analyses._common import (
    GRAM, MATERIALIZED, dot, loss_scale, select)
from oryx_gradlog.record._kinds import EMBED, LAYER_NORM, NORM_KINDS
from oryx_gradlog.record._selection import Selection
from oryx_gradlog.record._canonical import LayerView, as_float, choose_method


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=["layers", "norms"],
    meta_fields=["methods"],
)
@dataclasses.dataclass(frozen=True)
class PerExampleNorms:
  """Norms of per-example gradients, per layer and in total.

  Attributes:
    layers: per record name, the norms of the per-example gradients of that
      layer's parameters (weight and bias together), shape `(*calls, batch)`, or
      `(batch,)` for a tied name.
    norms: `(batch,)`, the norm of each example's gradient over all the layers (the
      quantity `ClippedGrads.norms` and `gl.clipped_grad(..., return_norms=True)`
      give).
    methods: static `(name, "gram" | "materialized")` pairs: how each layer was done.
  """

  layers: dict[str, jax.Array]
  norms: jax.Array
  methods: tuple[tuple[str, str], ...] = ()

  @property
  def total(self):
    raise AttributeError(
        "PerExampleNorms.total was renamed PerExampleNorms.norms (the one name of each "
        "example's gradient norm, as in ClippedGrads.norms and return_norms=True).")

  @property
  def method(self) -> dict[str, str]:
    """`methods` as a dict."""
    return dict(self.methods)


def weight_squared_norms(view: LayerView, method: str) -> jax.Array:
  """`(S, B)` squared norms of `sum_t x_t^T g_t` (unscaled), for the weight."""
  x, g = view.x, view.g
  if view.kind == LAYER_NORM:  # Element-wise scale: sum_t xhat_t * g_t.
    return jnp.sum(jnp.sum(x * g, axis=2) ** 2, axis=-1)
  if view.kind == EMBED:
    if method == GRAM and g.shape[2] == 1:
      return jnp.sum(g * g, axis=(2, 3))
    if method == GRAM:
      sums = same_id_sums(x, g)
      return jnp.sum(sums * sums, axis=(2, 3))
    table = jnp.zeros(g.shape[:2] + (view.vocabulary, g.shape[3]), g.dtype)
    scatter = lambda table, ids, g: table.at[ids].add(g)
    per_example = jax.vmap(jax.vmap(scatter))(table, x, g)
    return jnp.sum(per_example * per_example, axis=(2, 3))
  if method == GRAM and g.shape[2] == 1:
    return jnp.sum(x * x, axis=(2, 3)) * jnp.sum(g * g, axis=(2, 3))
  if method == GRAM:
    return jnp.sum(dot("sbtd,sbud->sbtu", x, x) * dot("sbtd,sbud->sbtu", g, g), axis=(2, 3))
  per_example = dot("sbtd,sbte->sbde", x, g)
  return jnp.sum(per_example * per_example, axis=(2, 3))


def same_id_sums(ids: jax.Array, g: jax.Array) -> jax.Array:
  """`(S, B, T, d)`: each example's rows of `g` summed over its equal ids, one row per
  distinct id (the rest zero), in `B T log T + B T d` work with no `(T, T)` array:
  the ids are sorted, and the rows of each run of equal sorted ids summed."""
  positions = jnp.broadcast_to(jnp.arange(ids.shape[-1]), ids.shape)
  ids, order = jax.lax.sort((ids, positions), dimension=ids.ndim - 1, num_keys=1)
  g = jnp.take_along_axis(g, order[..., None], axis=-2)
  starts = jnp.concatenate(
      [jnp.ones_like(ids[..., :1], bool), ids[..., 1:] != ids[..., :-1]], axis=-1)
  runs = jnp.cumsum(starts, axis=-1) - 1
  sum_runs = functools.partial(jax.ops.segment_sum, num_segments=ids.shape[-1],
                               indices_are_sorted=True)
  return jax.vmap(jax.vmap(sum_runs))(g, runs)


def squared_norms(
    api: str, records: dict[str, Any], *, reduction: str, names: Sequence[str] | None,
    tied: Collection[str], method: str, kinds: Sequence[str] = NORM_KINDS,
    weighted: bool = False,
) -> tuple[dict[str, jax.Array], dict[str, str], Selection, dict[str, int],
           dict[str, Any]]:
  """Per-example squared norms (of `l_i`'s gradient) of the selected layers.

  `weighted`: the caller forms `sum_i c_i grad_i` next (clipping); the cost model
  counts that work, and keys whose per-example gradients get formed keep them.

  Returns `(squares, methods, selection, batch_sizes, formed)`: per key `(*calls, B)`
  squares (a hand-marked record keeps its call axes; a parameter path has none); the
  method of each; the records read; the batch size of each; and, with `weighted`,
  the per-example gradients formed (of the recorded loss), by key.
  """
  selection = select(api, records, reduction=reduction, names=names, tied=tied,
                     method=method, kinds=kinds)
  squares, methods, formed = {}, {}, {}
  for key in selection.groups:
    squares[key], methods[key], grads = group_squared_norms(
        selection, key, method, reduction, weighted)
    if weighted and grads is not None:
      formed[key] = grads
  return squares, methods, selection, selection.batch_sizes, formed


def group_squared_norms(selection: Selection, key: str, method: str, reduction: str,
                        weighted: bool = False) -> tuple[jax.Array, str, Any]:
  """Per-example squared norms of key `key`'s gradient, the method, and the
  per-example gradients where they were formed (else `None`).

  One use with a view (a hand-marked layer; a found dense, convolution or embedding
  use of a view of its parameter) takes the Gram form or materialises, as the cost
  model says: `(*calls, B)` where the use keeps its calls, else `(B,)`. Any other
  use, and a parameter with several uses (tied weights: cross terms), materialises
  the uses' per-example gradients, maps them to the parameter and sums them; so
  does a found use that materialises for a `weighted` caller, which sums the formed
  gradients instead of taking a second vjp.
  """
  uses = selection.groups[key]
  batch = uses[0].batch_size
  view = uses[0].view() if len(uses) == 1 else None
  if view is not None:
    chosen = choose_method(view, method, weighted)
    reusable = (weighted and chosen == MATERIALIZED and not uses[0].keeps_calls
                and uses[0].keys == (key,))
    if not reusable:
      square = view_squared_norms(view, chosen, reduction)
      if not uses[0].keeps_calls:
        square = jnp.sum(square.reshape(-1, batch), axis=0)
      return square, chosen, None
  scale = loss_scale(reduction, batch)
  grads = selection.per_example(key)
  square = sum(jnp.sum(as_float(v).reshape(batch, -1) ** 2, axis=1)
               for v in jax.tree.leaves(grads))
  return (scale * scale) * square, MATERIALIZED, grads


def view_squared_norms(view: LayerView, method: str, reduction: str) -> jax.Array:
  """`(*calls, B)` squared per-example norms of `l_i`'s gradient for one layer view."""
  square = weight_squared_norms(view, method)
  if view.groups > 1:
    square = square.reshape((-1, view.groups) + square.shape[1:]).sum(1)
  if view.bias_g is not None:
    square = square + jnp.sum(view.bias_g * view.bias_g, axis=-1)
  scale = loss_scale(reduction, view.batch_size)
  return (scale * scale) * square.reshape(view.stack_shape + square.shape[-1:])


def per_example_norms(
    records: dict[str, Any],
    *,
    reduction: str = "mean",
    names: Sequence[str] | None = None,
    tied: Collection[str] = (),
    method: str = "auto",
) -> PerExampleNorms:
  """Returns the norms of per-example gradients from one backward pass's records.

  Reap the records of the ordinary gradient of the batch loss, recorded by
  `gl.record_layers` (any model) or with layers marked by `gl.dense`, `gl.conv2d`,
  `gl.embed`, `gl.layer_norm` (or `gl.dense_dot_general`); per-example gradients
  are not formed where a Gram form is cheaper (see the module docstring). Works
  under `jit`, `vmap` and with sharded batches.

  Args:
    records: the dict that `gl.reap` / `gl.call_and_reap` returns.
    reduction: `"mean"` if the loss is `mean_i l_i`, `"sum"` if `sum_i l_i`; the
      norms are those of the gradients of `l_i` either way.
    names: the hand-marked layer records or found parameter paths to use (default:
      every layer record; other records, e.g. taps, are left out). A named record
      that is not a layer is an error.
    tied: hand-marked names whose calls share one weight (see "Sharp edges").
    method: `"auto"` (per layer, materialised where that takes fewer
      multiply-adds, `T d_in d_out < T^2 (d_in + d_out)`, and no more memory than
      the Gram form or the layer's activations; else the Gram form), `"gram"` or
      `"materialized"`.

  Returns:
    A `PerExampleNorms` with per-layer norms, the total, and the method per layer.

  Example:
    >>> import jax, jax.numpy as jnp, oryx_gradlog as gl
    >>> def loss(params, x):
    ...   h = jnp.tanh(gl.dense(x, params["w1"], params["b1"], name="fc1"))
    ...   return jnp.mean(gl.dense(h, params["w2"], name="fc2") ** 2)
    >>> params = {"w1": jnp.ones((3, 4)) / 4, "b1": jnp.zeros(4), "w2": jnp.ones((4, 1))}
    >>> x = jnp.arange(6.0).reshape(2, 3)
    >>> result = gl.per_example_norms(gl.reap(jax.grad(loss))(params, x))
    >>> per_example = jax.vmap(jax.grad(loss), in_axes=(None, 0))(params, x[:, None])
    >>> flat = jax.vmap(lambda g: jnp.concatenate([v.ravel() for v in jax.tree.leaves(g)]))
    >>> bool(jnp.allclose(result.norms, jnp.linalg.norm(flat(per_example), axis=1)))
    True
  """
  squares, methods, _, _, _ = squared_norms(
      "per_example_norms", records, reduction=reduction, names=names, tied=tied,
      method=method, kinds=NORM_KINDS)
  total = sum(jnp.sum(s.reshape(-1, s.shape[-1]), axis=0) for s in squares.values())
  return PerExampleNorms(
      layers={name: jnp.sqrt(s) for name, s in squares.items()},
      norms=jnp.sqrt(total),
      methods=tuple(sorted(methods.items())),
  )
