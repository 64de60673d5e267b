"""Batch-size tests and gradient signal-to-noise from one backward pass's records.

Cockpit (Schneider, Dangel and Hennig 2021) draws these "instruments" from BackPACK's
per-example quantities. Here they come from the layer records of the ordinary
backward pass, with no per-example gradient formed: per-example squared norms the
ghost way (`per_example_norms`), and per-example inner products with the batch
gradient `gbar = (1/B) sum_j grad_j`, per layer whichever way costs less:

* Gram form (dense and conv layers): `d_i = (1/B) sum_j <grad_i, grad_j>` with
  `<x_i^T g_i, x_j^T g_j> = sum_{t,u} (x_it . x_ju)(g_it . g_ju)`, two `(B T)^2`
  Gram matrices, `(B T)^2 (d_in + d_out)` multiply-adds: half of the layer's
  weight-gradient matmul for a 512-wide layer and a batch of 128;
* jvp form (any layer): `<grad_i, v> = <g_i, J_i v>`, a `jax.jvp` of the very layer
  function whose vjp `per_example_clip` takes, at `v = gbar` (that vjp at the unclipped
  cotangent), `B T d_in d_out`.

With `n_i = |grad_i|^2`, `d_i = <grad_i, gbar>`:

* norm test (Byrd et al. 2012): `sqrt(sum_i |grad_i - gbar|^2 / (B (B-1))) / |gbar|`,
  with `sum_i |grad_i - gbar|^2 = sum_i n_i - B |gbar|^2`;
* inner-product test (Bollapragada et al. 2018):
  `sqrt(sum_i (d_i - |gbar|^2)^2 / (B (B-1))) / |gbar|^2`;
* orthogonality test (Bollapragada et al. 2018):
  `sqrt(sum_i |grad_i - (d_i / |gbar|^2) gbar|^2 / (B (B-1))) / |gbar|`, with the
  squared norm `n_i - d_i^2 / |gbar|^2`.

A test below its threshold `theta` (Cockpit draws 1) says the batch is large enough
for the step; above it, the batch gradient is too noisy.

* gradient signal-to-noise (Liu et al. 2020, GSNR) per parameter, as Cockpit's
  MeanGSNR defines it: `gbar^2 / (mean_i(grad_i^2) - gbar^2 + eps)`, eps 1e-5, and
  its mean over all the parameters of the layers analysed (every layer kind); the
  mean per layer, and our earlier reading, the mean of those over the layers
  (`GradientSNR.mean_over_layers`, with `epsilon=0`), are kept beside it.

Per-parameter second moments `sum_i grad_i^2` (BackPACK's SumGradSquared, which
Cockpit's GSNR, TIC, CABS and early-stopping instruments build on) come from the
same records: for a dense layer `(x^2)^T (g^2)` without positions (one matmul);
otherwise each example's gradient of the layer is formed (`layer_moments`).

Sharp edges:
  * Only the marked layers count (as for `per_example_norms`); Cockpit averages the
    GSNR over every parameter of the model.
  * The GSNR's variance is the population variance (divided by `B`), as Cockpit's;
    with `epsilon=0`, a parameter whose gradient is the same for every example has
    an infinite GSNR, and one whose gradient is zero for every example has GSNR 0.
  * The second moments of a layer with positions (tokens, pixels), a conv2d, an
    embedding or a layer norm need each example's gradient of that layer: `B`
    times its parameters in memory while it is summed.
  * A batch of one has no tests: it is an error. `|gbar| = 0` gives inf or NaN.
  * Call them on the records as the reap returns them, inside any vmap or scan.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Collection, Sequence
from typing import Any

import jax
import jax.numpy as jnp

from oryx_gradlog.analyses import _common
from oryx_gradlog.analyses.per_example import _ghost
from oryx_gradlog.analyses.curvature import _curvature
from oryx_gradlog.record._kinds import CONV, DENSE
from oryx_gradlog.record._canonical import LayerParams, as_float


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=["norm_test", "inner_product_test", "orthogonality_test", "grad_norm"],
    meta_fields=["batch_size"],
)
@dataclasses.dataclass(frozen=True)
class BatchSizeTests:
  """The three batch-size tests of one batch (below 1: the batch is large enough).

  Attributes:
    norm_test: Byrd et al. (2012)'s norm test.
    inner_product_test: Bollapragada et al. (2018)'s inner-product test.
    orthogonality_test: Bollapragada et al. (2018)'s orthogonality test.
    grad_norm: `|gbar|`, the norm of the batch's mean gradient (marked layers).
    batch_size: `B` (static).
  """

  norm_test: jax.Array
  inner_product_test: jax.Array
  orthogonality_test: jax.Array
  grad_norm: jax.Array
  batch_size: int


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=["layers", "layer_means", "mean"],
    meta_fields=[],
)
@dataclasses.dataclass(frozen=True)
class GradientSNR:
  """Gradient signal-to-noise ratio (GSNR) per parameter, per layer and overall.

  Attributes:
    layers: per record name, the GSNR of each parameter (a `LayerParams`).
    layer_means: per record name, the mean GSNR over that layer's parameters.
    mean: the mean over all the parameters of the layers (Cockpit's MeanGSNR).
  """

  layers: dict[str, LayerParams]
  layer_means: dict[str, jax.Array]
  mean: jax.Array

  @property
  def mean_over_layers(self) -> jax.Array:
    """The mean of `layer_means` over the layers (our earlier reading)."""
    return jnp.mean(jnp.stack(list(self.layer_means.values())))


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=["mean", "sum_squares"],
    meta_fields=[],
)
@dataclasses.dataclass(frozen=True)
class LayerMoments:
  """First and second moments of one layer's per-example gradients (internal).

  Attributes:
    mean: `gbar = (1/B) sum_i grad_i`, shaped like the layer's parameters.
    sum_squares: `sum_i grad_i^2` (SumGradSquared of the per-example losses).
  """

  mean: LayerParams
  sum_squares: LayerParams


def per_example_moments(
    api: str, records: dict[str, Any], *, reduction: str, names, tied, method,
) -> tuple[jax.Array, jax.Array, int]:
  """`(n, d, B)`: per example `|grad_i|^2` and `<grad_i, gbar>` over the layers."""
  selection = _common.select(api, records, reduction=reduction, names=names, tied=tied,
                            method=method)
  batch_size = _common.one_batch_size(api, selection.batch_sizes, minimum=2)
  scale = _common.loss_scale(reduction, batch_size)
  squared, products, gram_keys = 0.0, 0.0, set()
  for key, uses in selection.groups.items():
    view = uses[0].view() if len(uses) == 1 else None
    if view is not None and _products_method(view, method) == _common.GRAM:
      pairs = (scale * scale) * _gram(view)  # <grad_i, grad_j>
      squared = squared + jnp.diagonal(pairs)
      products = products + jnp.mean(pairs, axis=1)
      gram_keys.add(key)
    else:
      square, _, _ = _ghost.group_squared_norms(selection, key, method, reduction)
      squared = squared + jnp.sum(square.reshape(-1, batch_size), axis=0)
  others = [u for u in selection.uses if not set(u.keys) <= gram_keys]
  if others:  # <grad_i, gbar> = sum over uses of <g_i, J_i gbar>, by jvps.
    gbar = {key: jax.tree.map(lambda v: (scale / batch_size) * v, grad)
            for key, grad in selection.weighted(jnp.ones(batch_size)).items()}
    for use in others:
      products = products + scale * use.inner_products(gbar)
  return squared, products, batch_size


def _products_method(view, method: str) -> str:
  """Gram form for dense and conv layers where it costs less than the jvp."""
  if view.kind not in (DENSE, CONV) or method == _common.MATERIALIZED:
    return "jvp"
  if method == _common.GRAM:
    return _common.GRAM
  _, batch, t, d_in = view.x.shape
  d_out = view.g.shape[-1]
  return _common.GRAM if batch * t * (d_in + d_out) <= d_in * d_out else "jvp"


def _gram(view) -> jax.Array:
  """`(B, B)`: `<grad_i, grad_j>` (of the recorded loss) from two Gram matrices.

  `<x_i^T g_i, x_j^T g_j> = sum_{t,u} (x_it . x_ju) (g_it . g_ju)`; the bias adds
  `<sum_t g_it, sum_u g_ju>`, i.e. 1 on every `x_it . x_ju`. Summed over the stacked
  calls (and feature groups: each group's `g` is its slice of the output features).
  """
  x, g = view.x, view.g
  bias = 0.0 if view.bias_g is None else 1.0
  if x.shape[2] == 1:
    x, g = x[:, :, 0], g[:, :, 0]
    pairs = (_common.dot("sbd,scd->sbc", x, x) + bias) * _common.dot("sbd,scd->sbc", g, g)
    return jnp.sum(pairs, axis=0)
  pairs = ((_common.dot("sbtd,scud->sbctu", x, x) + bias)
           * _common.dot("sbtd,scud->sbctu", g, g))
  return jnp.sum(pairs, axis=(0, 3, 4))


def batch_size_tests(
    records: dict[str, Any],
    *,
    reduction: str = "mean",
    names: Sequence[str] | None = None,
    tied: Collection[str] = (),
    method: str = "auto",
) -> BatchSizeTests:
  """Returns the norm, inner-product and orthogonality tests of one batch.

  From the layer records of one ordinary backward pass of the batch loss (see the
  module docstring for the formulas); no per-example gradient is formed.

  Args:
    records: the dict that `gl.reap` / `gl.call_and_reap` returns.
    reduction: `"mean"` or `"sum"`: how the loss combines the per-example losses.
    names: the layer records to use (default: every layer record).
    tied: names whose calls share one weight (see `per_example_norms`).
    method: how per-example norms are computed (see `per_example_norms`), and the
      inner products: `"gram"` in the Gram form where the layer has one (dense,
      conv2d), `"materialized"` by the jvp, `"auto"` whichever costs less per layer.

  Returns:
    A `BatchSizeTests` of scalars.

  Example:
    >>> import jax, jax.numpy as jnp, oryx_gradlog as gl
    >>> loss = lambda w, x: jnp.mean(gl.dense(x, w, name="fc"))
    >>> x = jnp.array([[1.0], [3.0]])  # grad_i = x_i: mean 2, deviations -1 and 1
    >>> tests = gl.batch_size_tests(gl.reap(jax.grad(loss))(jnp.ones((1, 1)), x))
    >>> tests.norm_test  # sqrt((1 + 1) / (2 * 1)) / 2
    Array(0.5, dtype=float32)
  """
  squared, products, batch = per_example_moments(
      "batch_size_tests", records, reduction=reduction, names=names, tied=tied,
      method=method)
  gbar_sq = jnp.mean(products)  # <gbar, gbar> = (1/B) sum_i <grad_i, gbar>.
  pairs = batch * (batch - 1)
  deviations = jnp.maximum(jnp.sum(squared) - batch * gbar_sq, 0.0)
  orthogonal = jnp.maximum(squared - products * products / gbar_sq, 0.0)
  grad_norm = jnp.sqrt(gbar_sq)
  return BatchSizeTests(
      norm_test=jnp.sqrt(deviations / pairs) / grad_norm,
      inner_product_test=jnp.sqrt(jnp.sum((products - gbar_sq) ** 2) / pairs) / gbar_sq,
      orthogonality_test=jnp.sqrt(jnp.sum(orthogonal) / pairs) / grad_norm,
      grad_norm=grad_norm,
      batch_size=batch,
  )


def _ratio(signal, noise):
  """`signal / noise`, 0 where both are 0."""
  return jnp.where((signal == 0) & (noise == 0), 0.0, signal / noise)


def layer_moments(
    api: str, records: dict[str, Any], *, reduction: str, names, tied,
) -> tuple[dict[str, LayerMoments], int]:
  """Per key, `gbar` and `sum_i grad_i^2` of the per-example losses' gradients.

  Dense layers without positions square `x` and `g` (one matmul); the others form
  each example's gradient.
  """
  selection = _common.select(api, records, reduction=reduction, names=names, tied=tied,
                            method="auto")
  batch = _common.one_batch_size(api, selection.batch_sizes, minimum=2)
  scale = _common.loss_scale(reduction, batch)
  means = selection.weighted(jnp.ones(batch))
  moments = {}
  for key in selection.groups:
    moments[key] = LayerMoments(
        jax.tree.map(lambda v: (scale / batch) * as_float(v), means[key]),
        jax.tree.map(lambda v: scale * scale * v,
                     _curvature.sum_of_squares(selection, key)))
  return moments, batch


def gradient_snr(
    records: dict[str, Any],
    *,
    reduction: str = "mean",
    names: Sequence[str] | None = None,
    tied: Collection[str] = (),
    epsilon: float = 1e-5,
) -> GradientSNR:
  """Returns the gradient signal-to-noise ratio of each layer parameter.

  `gbar^2 / (mean_i(grad_i^2) - gbar^2 + epsilon)` per parameter (Liu et al. 2020;
  Cockpit's MeanGSNR with its `epsilon`), `grad_i` the gradient of example i's
  loss, from the records of one backward pass (see the module docstring).

  Args:
    records: the dict that `gl.reap` / `gl.call_and_reap` returns.
    reduction: `"mean"` or `"sum"`: how the loss combines the per-example losses.
    names: the layer records to use (default: every dense, conv2d, embedding and
      layer-norm record).
    tied: names whose calls share one weight.
    epsilon: added to the variance (Cockpit's 1e-5). With 0, a parameter whose
      gradient is zero for every example reads 0.

  Returns:
    A `GradientSNR`; `.mean` is Cockpit's mean over all the parameters.

  Example:
    >>> import jax, jax.numpy as jnp, oryx_gradlog as gl
    >>> loss = lambda w, x: jnp.mean(gl.dense(x, w, name="fc"))
    >>> x = jnp.array([[1.0], [3.0]])  # grad_i = x_i: mean 2, variance 1
    >>> gl.gradient_snr(gl.reap(jax.grad(loss))(jnp.ones((1, 1)), x), epsilon=0.0).mean
    Array(4., dtype=float32)
  """
  moments, batch = layer_moments("gradient_snr", records, reduction=reduction,
                                 names=names, tied=tied)
  layers, layer_means, total, count = {}, {}, 0.0, 0
  for name, moment in moments.items():
    snr = jax.tree.map(lambda m, s: _ratio(m * m, s / batch - m * m + epsilon),
                       moment.mean, moment.sum_squares)
    leaves = jax.tree.leaves(snr)
    layers[name] = snr
    layer_sum, layer_count = sum(jnp.sum(v) for v in leaves), sum(v.size for v in leaves)
    layer_means[name] = layer_sum / layer_count
    total, count = total + layer_sum, count + layer_count
  return GradientSNR(layers, layer_means, total / count)
