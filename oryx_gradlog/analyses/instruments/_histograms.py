"""Histograms of per-example gradient elements, from one backward pass's records.

Cockpit's GradHist1d counts every element of every example's gradient (of example
i's own loss) in 100 equal bins on `[-2, 2]`, values outside clamped into the edge
bins (as `torch.histc` of the clamped values). Its GradHist2d counts the pairs
(per-example gradient element, parameter value) of every parameter and example in
40 x 50 bins on `[-1, 1] x [-2, 2]`, both clamped to the centres of the edge bins.
`gradient_histograms` computes both on the device from the layer records: each
layer's per-example gradients are formed (the vjp of the layer at each example's
cotangent, `Selection.per_example`), binned, and summed over the layers; the
parameter values are the weights the records hold.

Sharp edges:
  * Only the marked layers count (Cockpit counts every parameter of the model).
  * Forming a layer's per-example gradients takes `B` times its parameters in
    memory while it is binned, and a scatter-add per element: the costliest of the
    per-step instruments (see `benchmarks/RESULTS.md`). Read it every k steps.
    On JAX 0.5.0 XLA's CPU scatter-add is about 15 times slower than on 0.10.2
    (65 vs 4 ns per element), and so are the histograms.
  * Counts are int32: at most 2**31 - 1 elements (examples times parameters).
  * The 2-D histogram leaves out `gl.dense_dot_general`'s bias, whose value the
    record does not hold.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Collection, Sequence
from typing import Any

import jax
import jax.numpy as jnp

from oryx_gradlog.analyses.instruments import _instruments
from oryx_gradlog.record._selection import collect

BINS_1D, RANGE_1D = 100, (-2.0, 2.0)
BINS_2D, RANGE_2D = (40, 50), ((-1.0, 1.0), (-2.0, 2.0))


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=["counts_1d", "edges_1d", "counts_2d", "edges_2d"],
    meta_fields=[],
)
@dataclasses.dataclass(frozen=True)
class GradientHistograms:
  """Cockpit's two gradient histograms of one batch.

  Attributes:
    counts_1d: `(bins,)` counts of the per-example gradient elements.
    edges_1d: `(bins + 1,)` bin edges.
    counts_2d: `(bins_x, bins_y)` counts of (gradient element, parameter) pairs.
    edges_2d: `(x_edges, y_edges)`, the edges along each axis.
  """

  counts_1d: jax.Array
  edges_1d: jax.Array
  counts_2d: jax.Array | None
  edges_2d: tuple[jax.Array, jax.Array] | None


def _bin(values, bins: int, low: float, high: float) -> jax.Array:
  """The bin index of each value on `bins` equal bins of `[low, high]` (clamped)."""
  width = (high - low) / bins
  index = jnp.floor((values - low) / width).astype(jnp.int32)
  return jnp.clip(index, 0, bins - 1)


def histogram_1d(arrays, bins: int = BINS_1D, value_range=RANGE_1D) -> jax.Array:
  """Counts of the elements of all `arrays` in `bins` bins (clamped to the range)."""
  low, high = value_range
  counts = jnp.zeros((bins,), jnp.int32)
  for values in arrays:
    counts = counts + jnp.bincount(_bin(values, bins, low, high).ravel(), length=bins)
  return counts


def histogram_2d(pairs, bins=BINS_2D, value_range=RANGE_2D) -> jax.Array:
  """Counts of `(x, y)` element pairs (broadcast together) in `bins` bins, each value
  clamped to the centres of the edge bins as Cockpit's GradHist2d does."""
  (x_low, x_high), (y_low, y_high) = value_range
  x_bins, y_bins = bins
  counts = jnp.zeros((x_bins * y_bins,), jnp.int32)
  for x, y in pairs:
    x, y = jnp.broadcast_arrays(x, y)
    index = y_bins * _bin(x, x_bins, x_low, x_high) + _bin(y, y_bins, y_low, y_high)
    counts = counts + jnp.bincount(index.ravel(), length=x_bins * y_bins)
  return counts.reshape(x_bins, y_bins)


def _edges(bins, value_range):
  return jnp.linspace(value_range[0], value_range[1], bins + 1, dtype=jnp.float32)


def histograms_from_moments(moments, values, *, two_d: bool, bins_1d=BINS_1D,
                            range_1d=RANGE_1D, bins_2d=BINS_2D, range_2d=RANGE_2D,
                            ) -> GradientHistograms:
  """The histograms from `layer_moments(..., per_example=True)`; `values` gives the
  parameters' values by key (`LayerParams`, for the 2-D histogram)."""
  grads = [v for m in moments.values() for v in jax.tree.leaves(m.per_example)]
  counts_1d = histogram_1d(grads, bins_1d, range_1d)
  counts_2d = edges_2d = None
  if two_d:
    pairs = []
    for key, moment in moments.items():
      if key not in values:
        raise ValueError(
            f"gradient_histograms: the 2-D histogram needs the value of parameter "
            f"{key!r}, which gl.record_layers's records do not hold: pass params=.")
      for grad, value in ((moment.per_example.w, values[key].w),
                          (moment.per_example.b, values[key].b)):
        if grad is None or value is None:  # dense_dot_general's bias is not recorded.
          continue
        pairs.append((grad, value[None]))
    counts_2d = histogram_2d(pairs, bins_2d, range_2d)
    edges_2d = (_edges(bins_2d[0], range_2d[0]), _edges(bins_2d[1], range_2d[1]))
  return GradientHistograms(counts_1d, _edges(bins_1d, range_1d), counts_2d, edges_2d)


def gradient_histograms(
    records: dict[str, Any],
    *,
    reduction: str = "mean",
    names: Sequence[str] | None = None,
    tied: Collection[str] = (),
    two_d: bool = True,
    bins_1d: int = BINS_1D,
    range_1d: tuple[float, float] = RANGE_1D,
    bins_2d: tuple[int, int] = BINS_2D,
    range_2d: tuple[tuple[float, float], tuple[float, float]] = RANGE_2D,
    params: Any = None,
) -> GradientHistograms:
  """Returns Cockpit's histograms of per-example gradient elements (and parameters).

  Args:
    records: the dict that `gl.reap` / `gl.call_and_reap` returns.
    reduction: `"mean"` or `"sum"`: how the loss combines the per-example losses.
    names: the layer records to use (default: every layer record).
    tied: names whose calls share one weight.
    two_d: also the 2-D histogram of gradient elements against parameter values.
    bins_1d, range_1d: the 1-D histogram's bins and range (Cockpit's 100, (-2, 2)).
    bins_2d, range_2d: the 2-D histogram's bins and ranges, gradient elements first
      (Cockpit's (40, 50), ((-1, 1), (-2, 2))).
    params: the parameters, for the 2-D histogram of records that
      `gl.record_layers` found (hand-marked records hold their weights).

  Returns:
    A `GradientHistograms`.

  Example:
    >>> import jax, jax.numpy as jnp, oryx_gradlog as gl
    >>> loss = lambda w, x: jnp.mean(gl.dense(x, w, name="fc"))
    >>> x = jnp.array([[0.1], [-3.0]])  # grad_i = x_i: bins 52 and 0 (clamped)
    >>> hist = gl.gradient_histograms(gl.reap(jax.grad(loss))(jnp.ones((1, 1)), x))
    >>> [int(i) for i in jnp.nonzero(hist.counts_1d)[0]], int(hist.counts_2d.sum())
    ([0, 52], 2)
  """
  api = "gradient_histograms"
  moments, _ = _instruments.layer_moments(
      api, records, reduction=reduction, names=names, tied=tied, per_example=True)
  selection = collect(api, records, names, tied=tied)
  values = selection.values()
  if params is not None:
    values.update(selection.by_path(api, params))
  return histograms_from_moments(moments, values, two_d=two_d, bins_1d=bins_1d,
                                 range_1d=range_1d, bins_2d=bins_2d, range_2d=range_2d)
