"""Clipped gradients for DP-SGD from the records of one ordinary backward pass.

DP-SGD (Abadi et al. 2016) needs `sum_i c_i grad_i` with `c_i = min(1, C / |grad_i|)`.
For a marked layer, example i's gradient is linear in its output cotangent `g_i`
(dense: `x_i^T g_i`; conv2d: the same over patches; embedding: `g_i` scattered into
the rows of the ids; layer norm: `sum_t xhat_t g_t`), so the clipped sum is the
layer's ordinary weight gradient with the cotangent `c_i g_i` in place of `g_i`:

    sum_i c_i grad_i(w) = vjp of the layer w.r.t. (w, b) at cotangent (c * g)

which `per_example_clip` computes with `jax.vjp` of the very function the layer helper
applies (so strides, padding, dilation, groups, layouts and repeated ids are handled
as the layer handles them). The norms `|grad_i|` come from `per_example_norms` of
the same records (the "book-keeping" idea of Bu et al. 2023): one forward and one
backward pass, no second, reweighted backward pass. Per layer, as fastDP (Bu et al.)
does, the cost model picks the cheaper of two forms, counting the reweighted sum:
the Gram norms and the vjp above (`B T^2 (d_in + d_out) + B T d_in d_out`
multiply-adds), or each example's gradient formed once, squared for its norm and
summed with the weights `c_i` (`B T d_in d_out + B d_in d_out`), where those
gradients take no more memory than the layer's activations. Short sequences take the
Gram form; long ones through narrow layers form the gradients, as `vmap(grad)` does.

Under `jit`, reap with `gl.reap` (not `call_and_reap`) and leave the reaped weight
cotangents unused: XLA then drops the backward pass's own weight gradients, and the
step costs about what a plain gradient does.

The same holds for every use `gl.record_layers` finds in a model's jaxpr: the
operation's vjp at `c g`, mapped back to the parameters through the views and
functions of parameters that made its operand, summed over the uses of each
parameter. `clipped_grad(loss, l2_norm_clip=...)` does all of it for any model and
is used like `jax.grad`; `ClippedGrads.params` is the clipped gradient shaped like
the parameters. Hand-marked layers in a loss wrapped in `gl.record_layers` are
recorded as the uses found in them, by parameter path, so `.params` works for them
too; for their name-keyed records (a plain `reap`), `to_param_tree` places the
per-layer results into the structure of the parameters.

Sharp edges:
  * The privacy guarantee covers only the parameters whose gradients come out of
    `per_example_clip`. With hand-marked layers every trainable parameter must be in a
    marked layer (`to_param_tree` raises for one that is not); `clipped_grad` and
    `gl.record_layers` find every use, and a use with no per-example gradient (a
    weight-decay term in the loss, batch norm) is an error that names it.
  * A parameter that no use reads (it never meets the batch) gets a zero gradient
    from `clipped_grad`; `gl.layer_coverage` lists such parameters.
  * `l2_norm_clip` is a Python number (static, as in jax-privacy); a new value
    compiles a new step.
  * A `custom_vjp` whose backward pass is not linear in its cotangent (a clipping
    or rounding backward pass) gives per-example gradients that differ from
    `vmap(grad)`'s: the backward pass sees each example's cotangent scaled by the
    loss's `1/B` and summed with the others', not alone.
  * Calls of one name under `scan` have their own weights: results have the call
    axes in front, like the stacked weights. Pass `tied=(name,)` for calls that
    share one weight; their gradients are summed over the calls.
  * `reduction="mean"` returns `(1/B) sum_i c_i grad_i` (what `jax.grad` of the mean
    loss gives when nothing is clipped) with `B` the records' batch size, padding
    included; `"sum"` returns `sum_i c_i grad_i`. Add noise to match
    (`gl.add_dp_noise` with the same `reduction`).
  * As for `per_example_norms`, call it on the records as the reap returns them,
    inside any vmap or scan that made them.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Collection, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from oryx_gradlog.analyses import _common
from oryx_gradlog.analyses.per_example import _ghost
from oryx_gradlog.record._canonical import LayerParams


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=["layers", "norms"],
    meta_fields=["l2_norm_clip", "reduction", "batch_size", "param_tree"],
)
@dataclasses.dataclass(frozen=True)
class ClippedGrads:
  """The clipped gradient of each marked layer and the norms that clipped it.

  Attributes:
    layers: per record name, a `LayerParams` shaped like the layer's parameters
      (`w` the weight, kernel, table or layer-norm scale; `b` the bias or offset,
      `None` without one), with the record's call axes in front.
    norms: `(batch,)`, each example's gradient norm over all the layers, before
      clipping.
    l2_norm_clip: the clip norm `C` (static).
    reduction: `"mean"` or `"sum"` (static).
    batch_size: the records' batch size `B` (static).
  """

  layers: dict[str, LayerParams]
  norms: jax.Array
  l2_norm_clip: float
  reduction: str
  batch_size: int
  param_tree: Any = None

  @property
  def params(self) -> Any:
    """The clipped gradient shaped like the parameters, from records that
    `gl.record_layers` found (zeros for a parameter no use reads)."""
    if self.param_tree is None:
      raise ValueError(
          "ClippedGrads.params: these records were not found by gl.record_layers, so "
          "the parameters' structure is unknown. Reap the loss wrapped in "
          "gl.record_layers (hand-marked layers are then recorded by parameter path), "
          "or place them with gl.to_param_tree(clipped.layers, params, where).")
    return self.param_tree.unflatten(
        {path: layer.w for path, layer in self.layers.items()})

  @property
  def factors(self) -> jax.Array:
    """`(batch,)`, the clip factors `min(1, C / norm)`."""
    return clip_factors(self.norms, self.l2_norm_clip)


def clip_factors(norms: jax.Array, l2_norm_clip: float) -> jax.Array:
  """`min(1, C / norm)`, and 1 for a zero norm."""
  return l2_norm_clip / jnp.maximum(norms, l2_norm_clip)


def per_example_clip(
    records: dict[str, Any],
    *,
    l2_norm_clip: float,
    reduction: str = "mean",
    names: Sequence[str] | None = None,
    tied: Collection[str] = (),
    method: str = "auto",
) -> ClippedGrads:
  """Returns each layer's clipped gradient `sum_i min(1, C / |grad_i|) grad_i`.

  From the layer records of one ordinary backward pass of the batch loss (layers
  marked by `gl.dense`, `gl.conv2d`, `gl.embed`, `gl.layer_norm` or
  `gl.dense_dot_general`): the norms are those of `per_example_norms`, over all the
  layers analysed; no per-example gradient is formed unless that layer's norm is
  cheaper materialised (see `per_example_norms`). Works under `jit`, `scan` and with
  sharded batches.

  Args:
    records: the dict that `gl.reap` / `gl.call_and_reap` returns.
    l2_norm_clip: the clip norm `C`, a positive number.
    reduction: `"mean"` if the loss is `mean_i l_i` (result divided by the batch
      size), `"sum"` if it is `sum_i l_i`.
    names: the layer records to use (default: every layer record).
    tied: names whose calls share one weight (see `per_example_norms`).
    method: how the norms are computed (see `per_example_norms`).

  Returns:
    A `ClippedGrads` with a `LayerParams` per layer and the per-example norms.

  Example:
    >>> import jax, jax.numpy as jnp, oryx_gradlog as gl
    >>> loss = lambda w, x: jnp.sum(gl.dense(x, w, name="fc"))
    >>> x = jnp.array([[3.0], [0.5]])  # grad_i = x_i: 3 is clipped to 1, 0.5 is kept
    >>> clipped = gl.per_example_clip(gl.reap(jax.grad(loss))(jnp.ones((1, 1)), x),
    ...                            l2_norm_clip=1.0, reduction="sum")
    >>> clipped.layers["fc"].w, clipped.norms
    (Array([[1.5]], dtype=float32), Array([3. , 0.5], dtype=float32))
  """
  return _clipped("per_example_clip", records, l2_norm_clip=l2_norm_clip,
                  reduction=reduction, names=names, tied=tied, method=method)


def check_clip(api: str, l2_norm_clip: Any) -> None:
  if isinstance(l2_norm_clip, jax.core.Tracer) or not isinstance(
      l2_norm_clip, (int, float, np.number)) or not l2_norm_clip > 0:
    raise ValueError(
        f"{api}(l2_norm_clip={l2_norm_clip!r}): the clip norm must be a positive Python "
        "number (it is static: a new value compiles a new step).")


def _clipped(api, records, *, l2_norm_clip, reduction, names, tied, method):
  check_clip(api, l2_norm_clip)
  squares, _, selection, sizes, formed = _ghost.squared_norms(
      api, records, reduction=reduction, names=names, tied=tied, method=method,
      weighted=True)
  batch_size = _common.one_batch_size(api, sizes)
  total = sum(jnp.sum(s.reshape(-1, s.shape[-1]), axis=0) for s in squares.values())
  norms = jnp.sqrt(total)
  factors = clip_factors(norms, l2_norm_clip)
  return ClippedGrads(selection.weighted(factors, formed), norms, float(l2_norm_clip), reduction,
                      batch_size, selection.tree)


_CLIP_TAG = "gradlog_clipped_grad"


def clipped_grad(
    fun: Callable[..., Any],
    *,
    l2_norm_clip: float,
    reduction: str = "mean",
    argnums: int | Sequence[int] = 0,
    batch_argnums: int | Sequence[int] | None = None,
    has_aux: bool = False,
    return_norms: bool = False,
    method: str = "auto",
) -> Callable[..., Any]:
  """Returns a function that computes `fun`'s DP-SGD clipped gradient, like `jax.grad`.

  Any model, as it is: the layers are found in `fun`'s jaxpr (`gl.record_layers`),
  each example's gradient norm comes from one ordinary backward pass, and the
  clipped gradient `sum_i min(1, C / |grad_i|) grad_i` (divided by the batch size
  for `reduction="mean"`) from one vjp per layer. Padding examples that the loss
  weights by 0 (as `gl.poisson_batch` makes them) have a zero gradient and add
  nothing.

  Args:
    fun: the batch loss, e.g. `loss(params, x, y)`: the mean (or, with
      `reduction="sum"`, the sum) of per-example losses over the leading axis of
      the batch arguments.
    l2_norm_clip: the clip norm `C`.
    reduction: `"mean"` or `"sum"`, how `fun` combines the per-example losses.
    argnums: the parameter argument(s), as for `jax.grad`.
    batch_argnums: the arguments holding the batch (default: all others).
    has_aux: whether `fun` returns `(loss, aux)`, as for `jax.grad`.
    return_norms: also return the `(batch,)` per-example gradient norms.
    method: how norms are computed (see `per_example_norms`).

  Returns:
    A function with `fun`'s signature returning the clipped gradient shaped like
    the parameters; `(grads, norms)` with `return_norms`; and `(..., aux)` with
    `has_aux`.

  Example:
    >>> import jax, jax.numpy as jnp, oryx_gradlog as gl
    >>> loss = lambda w, x: jnp.sum(x @ w)  # grad_i = x_i
    >>> x = jnp.array([[3.0], [0.5]])  # norms 3 and 0.5: 3 is clipped to 1
    >>> gl.clipped_grad(loss, l2_norm_clip=1.0, reduction="sum")(jnp.ones((1, 1)), x)
    Array([[1.5]], dtype=float32)
  """
  from oryx_gradlog.record._reap import call_and_reap  # pylint: disable=g-import-not-at-top
  from oryx_gradlog.record.record_layers import recorder  # pylint: disable=g-import-not-at-top
  api = "clipped_grad"
  check_clip(api, l2_norm_clip)
  _common.check_reduction(api, reduction)
  recorded = recorder(fun, argnums=argnums, batch_argnums=batch_argnums, tag=_CLIP_TAG,
                      api=api)
  grad = call_and_reap(jax.grad(recorded, argnums=argnums, has_aux=has_aux), tag=_CLIP_TAG)

  @functools.wraps(fun)
  def clipped(*args, **kwargs):
    with _common.scalar_loss(api, has_aux):
      out, records = grad(*args, **kwargs)
    if not records:
      raise ValueError(
          f"{api}: no parameter of argnums={argnums} meets the batch in the function, "
          "so there is nothing to clip. Check argnums and batch_argnums.")
    result = _clipped(api, records, l2_norm_clip=l2_norm_clip, reduction=reduction,
                      names=None, tied=(), method=method)
    grads = result.params
    if return_norms:
      grads = (grads, result.norms)
    return (grads, out[1]) if has_aux else grads

  return clipped


def _split_field(where: Any) -> tuple[str, str] | None:
  if not isinstance(where, str) or "." not in where:
    return None
  name, field = where.rsplit(".", 1)
  return (name, field) if field in ("w", "b") else None


def to_param_tree(layers: dict[str, LayerParams], params: Any, where: Any) -> Any:
  """Returns per-layer results placed into the structure of `params`.

  Args:
    layers: per record name, a `LayerParams` (`ClippedGrads.layers`, or
      `sum_grad_squared`'s result).
    params: the parameter tree; only its structure and shapes are used.
    where: a tree with the structure of `params` whose leaves say where each
      parameter's value comes from: `"NAME.w"` (the weight of record `NAME`) or
      `"NAME.b"` (its bias), or `None` for a parameter no layer record covers
      (which is an error: DP-SGD must clip every parameter's gradient).

  Returns:
    A tree with the structure of `params`.

  Raises:
    ValueError: listing, by tree path, every parameter with no or a wrong source
      (uncovered, unknown name, shape mismatch), and every layer result that no
      parameter takes.

  Example:
    >>> import jax, jax.numpy as jnp, oryx_gradlog as gl
    >>> params = {"fc": {"kernel": jnp.ones((1, 1)), "bias": jnp.zeros(1)}}
    >>> loss = lambda p, x: jnp.sum(gl.dense(x, p["fc"]["kernel"], p["fc"]["bias"], name="fc"))
    >>> x = jnp.array([[0.75], [0.0]])  # norms 1.25 and 1: clip factors 0.8 and 1
    >>> clipped = gl.per_example_clip(gl.reap(jax.grad(loss))(params, x), l2_norm_clip=1.0,
    ...                            reduction="sum")
    >>> where = {"fc": {"kernel": "fc.w", "bias": "fc.b"}}
    >>> gl.to_param_tree(clipped.layers, params, where)["fc"]["bias"]
    Array([1.8], dtype=float32)
  """
  api = "to_param_tree"
  leaves, treedef = jax.tree_util.tree_flatten_with_path(params)
  sources, where_def = jax.tree.flatten(where, is_leaf=lambda v: v is None)
  if where_def != treedef:
    raise ValueError(
        f"{api}: `where` has the structure {where_def} but `params` has {treedef}. Give "
        "`where` the structure of the parameters, with a string 'NAME.w' or 'NAME.b' "
        "(or None) for each parameter, e.g. jax.tree_util.tree_map_with_path(...).")
  out, bad, used = [], [], set()
  for (path, param), source in zip(leaves, sources):
    where_str = jax.tree_util.keystr(path)
    split = _split_field(source)
    value = None
    if source is None:
      bad.append(f"{where_str} is not covered by any layer record (mark the layer that "
                 "uses it with gl.dense, gl.conv2d, gl.embed or gl.layer_norm)")
    elif split is None:
      bad.append(f"{where_str}: {source!r} is not of the form 'NAME.w' or 'NAME.b'")
    elif split[0] not in layers:
      bad.append(f"{where_str}: {split[0]!r} is not among the layers {sorted(layers)}")
    else:
      value = getattr(layers[split[0]], split[1])
      if value is None:
        bad.append(f"{where_str}: layer {split[0]!r} has no bias")
      elif jnp.shape(value) != jnp.shape(param):
        bad.append(f"{where_str}: {source} has shape {jnp.shape(value)} but the "
                   f"parameter has {jnp.shape(param)}")
      used.add(split)
    out.append(value)
  unused = [f"{name}.{field}" for name, layer in layers.items() for field in ("w", "b")
            if getattr(layer, field) is not None and (name, field) not in used]
  if unused:
    bad.append(f"the layer results {unused} are placed nowhere (give them a parameter "
               "in `where`, or leave the layer out of `names`)")
  if bad:
    raise ValueError(f"{api}: " + "; ".join(bad) + ".")
  return jax.tree.unflatten(treedef, out)
