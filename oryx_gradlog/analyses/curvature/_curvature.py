"""Curvature and second moments of per-example gradients of dense layers.

From the records of one ordinary backward pass (layers marked by `gl.dense` or
`gl.dense_dot_general`):

* `kfac_factors`: the Kronecker factors of K-FAC (Martens & Grosse 2015), per dense
  layer `A = E[x x^T]` and `G = E[g g^T]`, so that the layer's Fisher block is
  approximated by `A (x) G`. Average them across steps with `gl.moving_average`.
* `sum_grad_squared`: BackPACK's SumGradSquared, `sum_i (grad_i)^2` element-wise per
  parameter, where `grad_i` is the gradient of example i's loss.
* `gradient_variance`: BackPACK's Variance, `(1/B) sum_i (grad_i - mean_i grad_i)^2`.

Conventions. B examples, T positions per example (1 for vector inputs), `g_it` the
per-example output gradient `dl_i/dy_it` (the recorded cotangent times B for a mean
loss), `x_it` the input with a 1 appended when the layer has a bias (homogeneous
coordinates, so `A` covers the bias: its last row and column). With `T = 1`:

    A = (1/B) sum_i x_i x_i^T,          G = (1/B) sum_i g_i g_i^T.

With positions (Eschenhagen et al. 2023), `approximation="expand"` treats
positions as extra examples, as if the per-example gradient `sum_t x_t g_t^T` had
no cross terms between positions:

    A = (1/(B T)) sum_{i,t} x_it x_it^T,   G = (1/B) sum_{i,t} g_it g_it^T,

and `approximation="reduce"` reduces over positions first:

    A = (1/B) sum_i xbar_i xbar_i^T (xbar_i = mean_t x_it),
    G = (1/B) sum_i gsum_i gsum_i^T (gsum_i = sum_t g_it).

These are the empirical-Fisher factors of whatever loss was differentiated; for the
true Fisher, differentiate a loss on targets sampled from the model.

Per-parameter second moments: for vector inputs `sum_i (x_i g_i^T)^2 = (x^2)^T (g^2)`
costs one matmul. With positions there is no such identity (the square of a sum
over positions has cross terms), so the per-example gradients `x_i^T g_i` are
materialised, all at once or `chunk_size` examples at a time.

Sharp edges:
  * Dense layers only; conv2d and embedding records are an error when named (and
    skipped when `names` is not given).
  * Results have the record's call axes in front: `(*calls, d_in(+1), d_in(+1))` for
    `A`, `(*calls, d_in, d_out)` for `w`; tied names (`tied=...`) have none.
  * Unlike BackPACK, the per-example gradients are those of `l_i` itself, not of
    `l_i / B` for a mean loss.
  * `gradient_variance` is `E[grad^2] - E[grad]^2`, clipped at zero against rounding.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Collection, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from oryx_gradlog.analyses.per_example import _ghost
from oryx_gradlog.record import _view
from oryx_gradlog.record._layers import DENSE
from oryx_gradlog.record._record_layers import DENSE as FOUND_DENSE
from oryx_gradlog.record._view import LayerView

_APPROXIMATIONS = ("expand", "reduce")


@functools.partial(
    jax.tree_util.register_dataclass, data_fields=["a", "g"], meta_fields=[]
)
@dataclasses.dataclass(frozen=True)
class KFACFactors:
  """The K-FAC factors of one dense layer.

  Attributes:
    a: input factor `E[x x^T]`, `(*calls, d_in, d_in)`, or `d_in + 1` with a bias
      (the last row and column are the bias's homogeneous coordinate).
    g: output-gradient factor `E[g g^T]`, `(*calls, d_out, d_out)`.
  """

  a: jax.Array
  g: jax.Array


@functools.partial(
    jax.tree_util.register_dataclass, data_fields=["w", "b"], meta_fields=[]
)
@dataclasses.dataclass(frozen=True)
class LayerParams:
  """A per-parameter quantity of one layer, shaped like its parameters.

  Attributes:
    w: like the weight, `(*calls, d_in, d_out)` for a dense layer (the kernel, table
      or layer-norm scale for the other layer kinds).
    b: like the bias (or layer-norm offset), or `None` for a layer without one.
  """

  w: jax.Array
  b: jax.Array | None


def _selection(api, records, names, tied, reduction, found_kinds=None):
  return _ghost.select(api, records, reduction=reduction, names=names, tied=tied,
                       method="auto", kinds=(DENSE,), found_kinds=found_kinds)


def _dense_views(api, selection: _view.Selection, reduction):
  """Hand-marked dense layers by name, then found dense uses by record name."""
  for name, record in selection.hand.items():
    view = _view.positions(api, name, record, tied=name in selection.tied)
    yield name, view, _ghost.loss_scale(reduction, view.batch_size)
  for use in selection.uses:
    if use.spec.kind == FOUND_DENSE:
      view = use.view(force=True)
      yield use.name, view, _ghost.loss_scale(reduction, view.batch_size)


def _unstack(view: LayerView, x: jax.Array) -> jax.Array:
  lead = view.stack_shape + ((view.groups,) if view.groups > 1 else ())
  return x.reshape(lead + x.shape[1:])


def kfac_factors(
    records: dict[str, Any],
    *,
    reduction: str = "mean",
    approximation: str = "expand",
    names: Sequence[str] | None = None,
    tied: Collection[str] = (),
) -> dict[str, KFACFactors]:
  """Returns the K-FAC factors `A = E[x x^T]`, `G = E[g g^T]` of each dense layer.

  See the module docstring for the exact definitions and scaling.

  Args:
    records: the dict that `gl.reap` / `gl.call_and_reap` returns.
    reduction: `"mean"` or `"sum"`: how the loss combines the per-example losses;
      `g` is the gradient of the per-example loss either way.
    approximation: `"expand"` or `"reduce"`, for inputs with positions (tokens).
    names: the dense-layer records to use (default: all of them).
    tied: names whose calls share one weight: the calls count as positions.

  Returns:
    `{name: KFACFactors(a, g)}`.

  Example:
    >>> import jax, jax.numpy as jnp, oryx_gradlog as gl
    >>> loss = lambda w, x: jnp.mean(jnp.sum(gl.dense(x, w, name="fc") ** 2, -1) / 2)
    >>> x = jnp.array([[1.0, 0.0], [0.0, 2.0]])
    >>> factors = gl.kfac_factors(gl.reap(jax.grad(loss))(jnp.eye(2), x))
    >>> factors["fc"].a  # E[x x^T]; here g = y = x, so G = A
    Array([[0.5, 0. ],
           [0. , 2. ]], dtype=float32)
  """
  api = "kfac_factors"
  if approximation not in _APPROXIMATIONS:
    raise ValueError(
        f"{api}(approximation={approximation!r}): approximation must be 'expand' or "
        "'reduce' (Eschenhagen et al. 2023); they agree for inputs without positions.")
  factors = {}
  selection = _selection(api, records, names, tied, reduction)
  for name, view, scale in _dense_views(api, selection, reduction):
    x, g = view.x, scale * view.g
    if view.bias_g is not None:
      x = jnp.concatenate([x, jnp.ones(x.shape[:-1] + (1,), x.dtype)], axis=-1)
    batch, positions = g.shape[1], g.shape[2]
    if approximation == "expand":
      a = _ghost.dot("sbtd,sbte->sde", x, x) / (batch * positions)
      gg = _ghost.dot("sbtd,sbte->sde", g, g) / batch
    else:
      x, g = jnp.mean(x, axis=2), jnp.sum(g, axis=2)
      a, gg = _ghost.dot("sbd,sbe->sde", x, x) / batch, _ghost.dot("sbd,sbe->sde", g, g) / batch
    factors[name] = KFACFactors(_unstack(view, a), _unstack(view, gg))
  return factors


def _sum_of_squares(x, g, chunk_size):
  """`(S, d_in, d_out)`: sum over examples of the squared `x_i^T g_i`."""
  if x.shape[2] == 1:
    return _ghost.dot("sbd,sbe->sde", x[:, :, 0] ** 2, g[:, :, 0] ** 2)
  batch = x.shape[1]
  if chunk_size is None or chunk_size >= batch:
    per_example = _ghost.dot("sbtd,sbte->sbde", x, g)
    return jnp.sum(per_example * per_example, axis=1)
  if batch % chunk_size:
    raise ValueError(
        f"sum_grad_squared(chunk_size={chunk_size}): the batch size {batch} is not a "
        "multiple of chunk_size. Pass a divisor of the batch size, or None.")

  def chunks(a):
    a = a.reshape((a.shape[0], batch // chunk_size, chunk_size) + a.shape[2:])
    return jnp.moveaxis(a, 1, 0)

  def step(total, chunk):
    per_example = _ghost.dot("sbtd,sbte->sbde", *chunk)
    return total + jnp.sum(per_example * per_example, axis=1), None

  zeros = jnp.zeros((x.shape[0], x.shape[3], g.shape[3]), g.dtype)
  return lax.scan(step, zeros, (chunks(x), chunks(g)))[0]


def _moments(api, records, reduction, names, tied, chunk_size, centred):
  results = {}
  selection = _selection(api, records, names, tied, reduction)
  for name, record in selection.hand.items():
    view = _view.positions(api, name, record, tied=name in selection.tied)
    scale = _ghost.loss_scale(reduction, view.batch_size)
    batch = view.batch_size
    w = scale * scale * _sum_of_squares(view.x, view.g, chunk_size)
    b = None if view.bias_g is None else scale * scale * jnp.sum(view.bias_g ** 2, axis=1)
    if centred:
      mean_w = (scale / batch) * _ghost.dot("sbtd,sbte->sde", view.x, view.g)
      w = jnp.maximum(w / batch - mean_w * mean_w, 0.0)
      if b is not None:
        mean_b = (scale / batch) * jnp.sum(view.bias_g, axis=1)
        b = jnp.maximum(b / batch - mean_b * mean_b, 0.0)
    results[name] = LayerParams(_unstack(view, w), None if b is None else _unstack(view, b))
  if selection.found:
    batch = _ghost.one_batch_size(api, {p: u[0].batch_size for p, u in selection.found.items()})
    scale = _ghost.loss_scale(reduction, batch)
    means = selection.weighted(jnp.ones(batch)) if centred else {}
    for path, uses in selection.found.items():
      square = found_sum_of_squares(selection, path)
      w = scale * scale * square
      if centred:
        mean = (scale / batch) * _ghost.as_float(means[path])
        w = jnp.maximum(w / batch - mean * mean, 0.0)
      results[path] = LayerParams(w, None)
  return results


def found_sum_of_squares(selection: _view.Selection, path: str) -> jax.Array:
  """`sum_i grad_i^2` (of the recorded loss) of one found parameter."""
  uses = selection.found[path]
  if len(uses) == 1 and uses[0].simple:
    square = uses[0].dense_sum_of_squares()
    if square is not None:  # Views of one leaf carry squares as they carry values.
      return uses[0].to_params([square], lead=0)[path]
  per_example = _ghost.as_float(selection.per_example(path))
  return jnp.sum(per_example * per_example, axis=0)


def sum_grad_squared(
    records: dict[str, Any],
    *,
    reduction: str = "mean",
    names: Sequence[str] | None = None,
    tied: Collection[str] = (),
    chunk_size: int | None = None,
) -> dict[str, LayerParams]:
  """Returns `sum_i grad_i ** 2` per parameter of each dense layer (SumGradSquared).

  `grad_i` is the gradient of example i's loss. For vector inputs this is
  `(x ** 2)^T (g ** 2)`; with positions the per-example gradients are formed, all
  at once or `chunk_size` examples at a time (a `lax.scan`).

  Args:
    records: the dict that `gl.reap` / `gl.call_and_reap` returns.
    reduction: `"mean"` or `"sum"`: how the loss combines the per-example losses.
    names: the dense-layer records to use (default: all of them).
    tied: names whose calls share one weight.
    chunk_size: with positions, examples per chunk (a divisor of the batch size);
      `None` does the whole batch at once. Leave it `None` for sharded batches.

  Returns:
    `{name: LayerParams(w, b)}`.

  Example:
    >>> import jax, jax.numpy as jnp, oryx_gradlog as gl
    >>> loss = lambda w, x: jnp.sum(gl.dense(x, w, name="fc"))
    >>> x = jnp.array([[1.0], [2.0]])  # grad_i = x_i: 1 and 2
    >>> gl.sum_grad_squared(gl.reap(jax.grad(loss))(jnp.ones((1, 1)), x),
    ...                     reduction="sum")["fc"].w
    Array([[5.]], dtype=float32)
  """
  return _moments("sum_grad_squared", records, reduction, names, tied, chunk_size, False)


def gradient_variance(
    records: dict[str, Any],
    *,
    reduction: str = "mean",
    names: Sequence[str] | None = None,
    tied: Collection[str] = (),
    chunk_size: int | None = None,
) -> dict[str, LayerParams]:
  """Returns the variance over examples of each dense-layer parameter's gradient.

  `(1/B) sum_i (grad_i - mean_i grad_i) ** 2` (BackPACK's Variance, with `grad_i`
  the gradient of example i's own loss), as `sum_grad_squared / B - mean ** 2`.

  Args:
    records: the dict that `gl.reap` / `gl.call_and_reap` returns.
    reduction: `"mean"` or `"sum"`: how the loss combines the per-example losses.
    names: the dense-layer records to use (default: all of them).
    tied: names whose calls share one weight.
    chunk_size: as for `sum_grad_squared`.

  Returns:
    `{name: LayerParams(w, b)}`.

  Example:
    >>> import jax, jax.numpy as jnp, oryx_gradlog as gl
    >>> loss = lambda w, x: jnp.sum(gl.dense(x, w, name="fc"))
    >>> x = jnp.array([[1.0], [3.0]])  # grad_i = x_i: 1 and 3
    >>> gl.gradient_variance(gl.reap(jax.grad(loss))(jnp.ones((1, 1)), x),
    ...                      reduction="sum")["fc"].w
    Array([[1.]], dtype=float32)
  """
  return _moments("gradient_variance", records, reduction, names, tied, chunk_size, True)
