"""Gradient noise scale and signal-to-noise ratio from one backward pass.

McCandlish et al. (2018), "An Empirical Model of Large-Batch Training": with `G` the
true gradient and `Sigma` the covariance of per-example gradients, the simple noise
scale `B_simple = tr(Sigma) / |G|^2` predicts the useful batch size. Their appendix
A.1 gives unbiased estimators from squared gradient norms measured at two batch
sizes; we take `B_small = 1` (per-example gradients, from the ghost norms) and
`B_big = B` (the batch gradient):

    mean_sq = (1/B) sum_i |grad_i|^2          E[mean_sq] = |G|^2 + tr(Sigma)
    batch_sq = |(1/B) sum_i grad_i|^2         E[batch_sq] = |G|^2 + tr(Sigma) / B

    |G|^2     ~ (B batch_sq - mean_sq) / (B - 1)
    tr(Sigma) ~ (mean_sq - batch_sq) B / (B - 1)

Both are estimated per layer (from that layer's parameters) and in total. The
per-layer signal-to-noise ratio of the batch gradient is `|G|^2 / (tr(Sigma) / B)`:
the squared norm of the mean gradient over the variance of the batch gradient
around it (above 1: the batch gradient is mostly signal).

Track them over training with `gl.moving_average` of the `NoiseScale` (which
averages the two estimates, not their ratio, as the paper does) and read
`b_simple` / `snr` of the average.

Sharp edges:
  * The estimators are unbiased but noisy; on one batch either can be negative,
    and so can their ratio. Average over steps before reading `b_simple`.
  * A batch of one has no estimate: it is an error.
  * Only the marked layers count (as for `per_example_norms`).
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
from oryx_gradlog.record._kinds import CONV, DENSE, ELEMENTWISE, EMBED, GENERIC
from oryx_gradlog.record._canonical import as_float

# Every kind but the hand-marked layer norm's.
_KINDS = (DENSE, CONV, EMBED, ELEMENTWISE, GENERIC)


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=["grad_sq", "trace"],
    meta_fields=["batch_size"],
)
@dataclasses.dataclass(frozen=True)
class GradientNoise:
  """Unbiased estimates of `|G|^2` and `tr(Sigma)` for some parameters.

  Attributes:
    grad_sq: the squared norm of the true (expected) gradient.
    trace: the trace of the per-example gradient covariance.
    batch_size: the batch size `B` they were measured at (static).
  """

  grad_sq: jax.Array
  trace: jax.Array
  batch_size: int

  @property
  def b_simple(self) -> jax.Array:
    """The simple noise scale `tr(Sigma) / |G|^2`."""
    return self.trace / self.grad_sq

  @property
  def snr(self) -> jax.Array:
    """The batch gradient's signal-to-noise ratio `|G|^2 / (tr(Sigma) / B)`."""
    return self.grad_sq * self.batch_size / self.trace


@functools.partial(
    jax.tree_util.register_dataclass, data_fields=["layers", "total"], meta_fields=[]
)
@dataclasses.dataclass(frozen=True)
class NoiseScale:
  """Gradient noise per layer and over all the layers analysed.

  Attributes:
    layers: per record name, a `GradientNoise` whose arrays have the record's call
      axes (`()` for a layer called once).
    total: the `GradientNoise` of all the layers' parameters together.
  """

  layers: dict[str, GradientNoise]
  total: GradientNoise


def _estimate(mean_sq, batch_sq, batch_size):
  return GradientNoise(
      grad_sq=(batch_size * batch_sq - mean_sq) / (batch_size - 1),
      trace=(mean_sq - batch_sq) * batch_size / (batch_size - 1),
      batch_size=batch_size,
  )


def gradient_noise_scale(
    records: dict[str, Any],
    *,
    reduction: str = "mean",
    names: Sequence[str] | None = None,
    tied: Collection[str] = (),
    method: str = "auto",
) -> NoiseScale:
  """Returns unbiased estimates of `|G|^2`, `tr(Sigma)`, `B_simple` and the SNR.

  From the layer records of one ordinary backward pass of the batch loss (see the
  module docstring for the estimators).

  Args:
    records: the dict that `gl.reap` / `gl.call_and_reap` returns.
    reduction: `"mean"` or `"sum"`: how the loss combines the per-example losses.
    names: the layer records to use (default: every layer record).
    tied: names whose calls share one weight.
    method: how per-example norms are computed (see `per_example_norms`).

  Returns:
    A `NoiseScale`; `.total.b_simple` is the noise scale of the whole model.

  Example:
    >>> import jax, jax.numpy as jnp, oryx_gradlog as gl
    >>> loss = lambda w, x: jnp.mean(gl.dense(x, w, name="fc"))
    >>> x = jnp.array([[1.0], [3.0]])  # grad_i = x_i: mean 2, variance 1
    >>> noise = gl.gradient_noise_scale(gl.reap(jax.grad(loss))(jnp.ones((1, 1)), x))
    >>> noise.total.grad_sq, noise.total.trace  # 2**2 - trace / 2, the sample variance
    (Array(3., dtype=float32), Array(2., dtype=float32))
  """
  api = "gradient_noise_scale"
  squares, _, selection, sizes, _ = _ghost.squared_norms(
      api, records, reduction=reduction, names=names, tied=tied, method=method,
      kinds=_KINDS)
  batch_size = _common.one_batch_size(api, sizes)
  if batch_size < 2:
    raise ValueError(
        f"{api}: the layer records have batch size {batch_size}; the noise estimators "
        "need a batch of at least 2.")
  scale = _common.loss_scale(reduction, batch_size)
  means = selection.weighted(jnp.ones(batch_size))
  layers, total_mean_sq, total_batch_sq = {}, 0.0, 0.0
  for key, square in squares.items():
    mean_sq = jnp.mean(square, axis=-1)
    calls = square.ndim - 1  # A hand-marked record keeps its call axes.
    batch_sq = (scale / batch_size) ** 2 * sum(
        jnp.sum(as_float(v) ** 2, axis=tuple(range(calls, v.ndim)))
        for v in jax.tree.leaves(means[key]))
    layers[key] = _estimate(mean_sq, batch_sq, batch_size)
    total_mean_sq = total_mean_sq + jnp.sum(mean_sq)
    total_batch_sq = total_batch_sq + jnp.sum(batch_sq)
  return NoiseScale(layers, _estimate(total_mean_sq, total_batch_sq, batch_size))
