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
  * `kfac_factors` takes dense layers only: other layers are an error when named (and
    skipped when `names` is not given). `sum_grad_squared` and `gradient_variance`
    take every layer record; other kinds than dense form their per-example gradients.
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

from oryx_gradlog.analyses import _common
from oryx_gradlog.record._kinds import DENSE
from oryx_gradlog.record._selection import Selection
from oryx_gradlog.record._canonical import LayerParams, LayerView, as_float

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


def _dense_views(api, selection: Selection, reduction, names):
  """The views of the dense uses, by record name (a hand-marked record's name is its
  key; a found use's is its record name)."""
  dense = {u.name for u in selection.uses if u.kind == DENSE}
  if names is not None:
    bad = [f"{key!r} is a layer of kind {uses[0].kind!r}, which {api} does not support "
           "(it supports 'dense'); leave it out of names"
           for key, uses in selection.groups.items()
           if not any(u.name in dense for u in uses)]
    if bad:
      raise ValueError(f"{api}(names=...): " + "; ".join(bad) + ".")
  for use in selection.uses:
    if use.name in dense:
      view = use.view(force=True)
      yield use.name, view, _common.loss_scale(reduction, view.batch_size)


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
  selection = _common.select(api, records, reduction=reduction, names=names, tied=tied,
                            method="auto")
  for name, view, scale in _dense_views(api, selection, reduction, names):
    x, g = view.x, scale * view.g
    if view.bias_g is not None:
      x = jnp.concatenate([x, jnp.ones(x.shape[:-1] + (1,), x.dtype)], axis=-1)
    batch, positions = g.shape[1], g.shape[2]
    if approximation == "expand":
      a = _common.dot("sbtd,sbte->sde", x, x) / (batch * positions)
      gg = _common.dot("sbtd,sbte->sde", g, g) / batch
    else:
      x, g = jnp.mean(x, axis=2), jnp.sum(g, axis=2)
      a, gg = _common.dot("sbd,sbe->sde", x, x) / batch, _common.dot("sbd,sbe->sde", g, g) / batch
    factors[name] = KFACFactors(_unstack(view, a), _unstack(view, gg))
  return factors


def _moments(api, records, reduction, names, tied, chunk_size, centred):
  """Per key, `sum_i grad_i^2` (or the variance) of the per-example losses' gradients."""
  selection = _common.select(api, records, reduction=reduction, names=names, tied=tied,
                            method="auto")
  batch = _common.one_batch_size(api, selection.batch_sizes)
  scale = _common.loss_scale(reduction, batch)
  means = selection.weighted(jnp.ones(batch)) if centred else {}
  results = {}
  for key in selection.groups:
    square = jax.tree.map(lambda v: scale * scale * v,
                          sum_of_squares(selection, key, chunk_size))
    if centred:
      mean = jax.tree.map(lambda v: (scale / batch) * as_float(v), means[key])
      square = jax.tree.map(lambda s, m: jnp.maximum(s / batch - m * m, 0.0), square, mean)
    results[key] = square
  return results


def sum_of_squares(selection: Selection, key: str, chunk_size: int | None = None,
                   ) -> LayerParams:
  """`sum_i grad_i^2` (of the recorded loss) of one key: from the use's own cheap
  form where it has one (dense layers), else from the formed per-example gradients."""
  uses = selection.groups[key]
  if len(uses) == 1:
    square = uses[0].sum_of_squares(chunk_size)
    if square is not None:
      return square[key]
  per_example = selection.per_example(key)
  return jax.tree.map(lambda v: jnp.sum(as_float(v) ** 2, axis=0), per_example)


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
