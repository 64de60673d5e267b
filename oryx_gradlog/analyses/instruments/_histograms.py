"""Histograms of per-example gradient elements, from one backward pass's records.

Cockpit's GradHist1d counts every element of every example's gradient (of example
i's own loss) in 100 equal bins on `[-2, 2]`, values outside clamped into the edge
bins (as `torch.histc` of the clamped values). Its GradHist2d counts the pairs
(per-example gradient element, parameter value) of every parameter and example in
40 x 50 bins on `[-1, 1] x [-2, 2]`, both clamped to the centres of the edge bins.
`gradient_histograms` computes both on the device from the layer records and sums
them over the layers; the parameter values are the weights the records hold (or
`params`).

The 1-D counts of a dense or convolution layer (its parameter's only use) are made
from its canonical view `(x, g)`, a chunk of examples at a time inside a `lax.scan`:
each chunk's gradients `x_i^T g_i` (about `CHUNK_ELEMENTS` numbers) are formed and
binned while they are in cache, never the whole batch's. At one position (`T = 1`,
an MLP's layers) a gradient is the outer product `x_i g_i^T`, and an element
`x_j g_k` with `|x_j| max|g|` or `|g_k| max|x|` under a bin width is in one of the
two bins that meet at zero, by its sign: those are counted from the signs of `x_i`
and `g_i` alone, and the rest binned, the largest rows or columns of each example
(a 1/16, 1/4 or 1/2 cut, whichever covers the chunk) or, where none does, every
element. The 2-D histogram, which pairs each element with its parameter, and the
1-D counts of other layers form the per-example gradients in the parameter's layout:
a chunk of examples at a time inside a `lax.scan` where `gl.record_layers` found the
parameter's one use (dense, convolution, embedding, element-wise:
`FoundUse.examples`), else whole (`Selection.per_example`: hand-marked layers,
parameters with several uses, generic uses).

Sharp edges:
  * Only the marked layers count (Cockpit counts every parameter of the model).
  * Elements not counted by their signs are binned, up to B times the parameters
    per reading: then the costliest of the per-step instruments (see
    `benchmarks/RESULTS.md`). Read it every k steps. A CPU or GPU bins by one
    scatter-add (`jnp.bincount`); on JAX 0.5.0 XLA's CPU scatter-add is about 15
    times slower than on 0.10.2, and so are such histograms. A TPU, where
    scatter-adds are slow, counts by products of one-hot bin digits on its matrix
    unit (`product_counts`: `bins` multiply-adds an element). Sequences and
    convolutions (`T > 1`) bin every element.
  * Where zero is a bin edge (Cockpit's ranges), a value below zero is counted left
    of it, as `np.histogram` does, though float32 rounds `-1e-9 - low` to `-low`.
  * Counts are int32: at most 2**31 - 1 elements (examples times parameters).
  * Hand-marked layers, parameters with several uses and generic uses have their
    per-example gradients formed whole for the 2-D histogram (B times the
    parameters in memory); it leaves out `gl.dense_dot_general`'s bias, whose value
    the record does not hold.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Collection, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from oryx_gradlog.analyses import _common
from oryx_gradlog.record._kinds import CONV, DENSE
from oryx_gradlog.record._selection import Selection

BINS_1D, RANGE_1D = 100, (-2.0, 2.0)
BINS_2D, RANGE_2D = (40, 50), ((-1.0, 1.0), (-2.0, 2.0))
# Per-example gradient elements formed and binned at once (a chunk of examples):
# 2M float32, 8 MiB, binned while in cache (a 512 x 512 layer at batch 128, JAX
# 0.10.2, CPU: 41 ms in chunks of 8 examples, 114 ms at once).
CHUNK_ELEMENTS = 1 << 21
# A rank-one gradient's element `scale x_j g_k` is counted by its sign where
# `scale |x_j| max|g|` or `scale |g_k| max|x|` is below NEAR bin widths (then it is
# in one of the two bins at zero); CUTS: the parts (1/16, 1/4, 1/2) of the largest rows
# or columns that the other branches bin one by one.
NEAR, CUTS = 1 - 2.0 ** -10, (16, 4, 2)
# Indices counted by one one-hot product on a TPU (`product_counts`): float32 sums
# of ones are exact below 2**24.
PRODUCT_CHUNK = 1 << 22


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=["counts_1d", "edges_1d", "counts_2d", "edges_2d"],
    meta_fields=[],
)
@dataclasses.dataclass(frozen=True)
class GradientHistograms:
  """Cockpit's two gradient histograms of one batch.

  Attributes:
    counts_1d: `(bins,)` counts of the per-example gradient elements (`None` where
      only the 2-D histogram was asked for).
    edges_1d: `(bins + 1,)` bin edges.
    counts_2d: `(bins_x, bins_y)` counts of (gradient element, parameter) pairs.
    edges_2d: `(x_edges, y_edges)`, the edges along each axis.
  """

  counts_1d: jax.Array | None
  edges_1d: jax.Array
  counts_2d: jax.Array | None
  edges_2d: tuple[jax.Array, jax.Array] | None


def _zero_edge(bins: int, value_range) -> int | None:
  """The index of the edge at zero (bins `k - 1` and `k` meet there), or `None`."""
  low, high = value_range
  k = round(-low * bins / (high - low))
  if not 0 < k < bins or abs(low + k * (high - low) / bins) > 1e-9 * (high - low):
    return None
  return k


def _bin(values, bins: int, low: float, high: float) -> jax.Array:
  """The bin index of each value on `bins` equal bins of `[low, high]` (clamped);
  where zero is an edge, negative values fall left of it and the rest right, as
  in exact arithmetic (float32 puts values just below zero right of it)."""
  width = (high - low) / bins
  index = jnp.floor((values - low) / width).astype(jnp.int32)
  zero = _zero_edge(bins, (low, high))
  if zero is not None:
    index = jnp.where(values < 0, jnp.minimum(index, zero - 1), jnp.maximum(index, zero))
  return jnp.clip(index, 0, bins - 1)


def product_counts(index: jax.Array, length: int) -> jax.Array:
  """`jnp.bincount(index, length=length)` of indices in `[0, length)`, without a
  scatter: a product of one-hot digits, `one_hot(index // b)^T one_hot(index % b)`
  (`b = ceil(sqrt(length))`), on a TPU's matrix unit in `n length` multiply-adds.
  The one-hots are bfloat16 and the sums float32, exact a chunk of `PRODUCT_CHUNK`
  (< 2**24) indices at a time; the chunks' int32 counts are summed in a scan."""
  index = index.ravel()
  b = math.isqrt(length - 1) + 1
  a = -(-length // b)
  chunk = max(1, min(PRODUCT_CHUNK, index.size))
  pad = -index.size % chunk
  index = jnp.pad(index, (0, pad), constant_values=-1)  # One-hot rows of zeros.

  def add(total, index):
    hi = jax.nn.one_hot(index // b, a, dtype=jnp.bfloat16)
    lo = jax.nn.one_hot(index % b, b, dtype=jnp.bfloat16)
    counts = jnp.einsum("na,nb->ab", hi, lo, preferred_element_type=jnp.float32)
    return total + counts.astype(jnp.int32), None

  chunks = index.reshape(-1, chunk)
  total = lax.scan(add, jnp.zeros((a, b), jnp.int32), chunks)[0]
  return total.reshape(-1)[:length]


def _counts(index: jax.Array, length: int) -> jax.Array:
  """`jnp.bincount(index, length=length)`: a scatter-add on a CPU or a GPU, one-hot
  products on a TPU (where a scatter-add is slow: `product_counts`)."""
  return lax.platform_dependent(
      index, tpu=functools.partial(product_counts, length=length),
      default=lambda index: jnp.bincount(index.ravel(), length=length))


def histogram_1d(arrays, bins: int = BINS_1D, value_range=RANGE_1D) -> jax.Array:
  """Counts of the elements of all `arrays` in `bins` bins (clamped to the range)."""
  low, high = value_range
  counts = jnp.zeros((bins,), jnp.int32)
  for values in arrays:
    counts = counts + _counts(_bin(values, bins, low, high), bins)
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
    counts = counts + _counts(index, x_bins * y_bins)
  return counts.reshape(x_bins, y_bins)


def _edges(bins, value_range):
  return jnp.linspace(value_range[0], value_range[1], bins + 1, dtype=jnp.float32)


def _signs(a) -> tuple[jax.Array, jax.Array]:
  """The numbers of positive and of negative elements along the last axis."""
  return jnp.sum(a > 0, -1, dtype=jnp.int32), jnp.sum(a < 0, -1, dtype=jnp.int32)


def _rank_one_plan(x, g, scale: float, bins: int, value_range) -> jax.Array:
  """Which of `_rank_one_counts`'s branches counts the examples `scale x_i g_i^T`
  (`x`: `(n, I)`, `g`: `(n, O)`): the cheapest that is exact for all of them."""
  d_in, d_out = x.shape[-1], g.shape[-1]
  near = NEAR * (value_range[1] - value_range[0]) / bins
  ax, ag = jnp.max(jnp.abs(x), -1), jnp.max(jnp.abs(g), -1)
  tiny = lambda a: jnp.min(jnp.where(a == 0, jnp.inf, jnp.abs(a)), -1)
  # Signs are exact where no nonzero product can underflow to a zero.
  exact_signs = jnp.all((tiny(x) >= 2.0 ** -60) & (tiny(g) >= 2.0 ** -60)
                        & jnp.isfinite(ax) & jnp.isfinite(ag))
  rows = jnp.max(jnp.sum(scale * jnp.abs(x) * ag[:, None] >= near, -1))
  cols = jnp.max(jnp.sum(scale * jnp.abs(g) * ax[:, None] >= near, -1))
  cuts = _cuts(d_in, d_out)
  fits = jnp.stack([(rows if axis == 0 else cols) <= k for axis, k in cuts])
  cost = jnp.array([k * (d_out if axis == 0 else d_in) for axis, k in cuts])
  best = jnp.argmin(jnp.where(fits, cost, d_in * d_out))
  return jnp.where(exact_signs & fits[best], best, len(cuts))


def _cuts(d_in: int, d_out: int) -> tuple[tuple[int, int], ...]:
  """`(axis, k)`: the rank-one branches, exact where every element outside the `k`
  largest rows (axis 0) or columns (axis 1) is within a bin of zero."""
  return ((0, 0),) + tuple((axis, -(-d // part)) for part in CUTS
                           for axis, d in ((0, d_in), (1, d_out)))


def _rank_one_counts(x, g, scale: float, bins: int, value_range) -> jax.Array:
  """1-D counts of the examples' gradients `scale x_i g_i^T` (`x`: `(n, I)`, `g`:
  `(n, O)`): the elements within a bin of zero are counted by their signs, the
  others binned, a cut of the largest rows or columns at a time (`_cuts`)."""
  zero = _zero_edge(bins, value_range)
  n, d_in = x.shape
  d_out = g.shape[-1]
  px, nx = _signs(x)
  pg, ng = _signs(g)
  negative = jnp.sum(px * ng + nx * pg)  # The elements below zero.

  def by_signs(part_negative, part_size):
    rest = n * d_in * d_out - part_size
    at = jnp.arange(bins)
    return (jnp.where(at == zero - 1, negative - part_negative, 0)
            + jnp.where(at == zero, rest - negative + part_negative, 0)).astype(jnp.int32)

  def cut(axis, k):
    def branch(x, g):
      if k == 0:
        return by_signs(0, 0)
      # The other factor's signs are those counted above.
      (a, b), (pb, nb) = ((x, g), (pg, ng)) if axis == 0 else ((g, x), (px, nx))
      top = jnp.take_along_axis(a, lax.top_k(jnp.abs(a), k)[1], -1)
      pa, na = _signs(top)
      values = scale * (top[:, :, None] * b[:, None, :])
      return (histogram_1d([values], bins, value_range)
              + by_signs(jnp.sum(pa * nb + na * pb), n * k * b.shape[-1]))
    return branch

  def whole(x, g):
    return histogram_1d([scale * (x[:, :, None] * g[:, None, :])], bins, value_range)

  branches = [cut(axis, k) for axis, k in _cuts(d_in, d_out)] + [whole]
  return lax.switch(_rank_one_plan(x, g, scale, bins, value_range), branches, x, g)


def _view_counts(view, scale, bins: int, value_range) -> jax.Array:
  """1-D counts of a dense or convolution view's per-example gradients
  `scale x_i^T g_i` (and bias `scale sum_t g_i`), a chunk of examples at a time;
  at one position (`T = 1`) by `_rank_one_counts`."""
  x, g = view.x, view.g
  s, batch, positions, d_in = x.shape
  size = max(1, min(batch, CHUNK_ELEMENTS // max(1, s * d_in * g.shape[-1])))
  whole = batch - batch % size
  # Past 2048 bins, float32's rounding of `(v - low) / width` nears the margin that
  # NEAR leaves; a scale below 1 could underflow a product.
  rank_one = (positions == 1 and _zero_edge(bins, value_range) is not None
              and bins <= 2048 and 1 <= scale <= 2.0 ** 20)

  def counts(x, g):
    if rank_one:
      return _rank_one_counts(x[:, :, 0].reshape(-1, d_in),
                              g[:, :, 0].reshape(-1, g.shape[-1]), scale, bins, value_range)
    return histogram_1d([scale * _common.dot("sbti,sbto->sbio", x, g)], bins, value_range)

  total = histogram_1d([] if view.bias_g is None else [scale * view.bias_g], bins,
                       value_range)
  if whole == size:
    total = total + counts(x[:, :size], g[:, :size])
  elif whole:
    def chunks(a):  # (S, B, ...) -> (B / size, S, size, ...)
      return jnp.moveaxis(a[:, :whole].reshape((s, whole // size, size) + a.shape[2:]), 1, 0)
    total = lax.scan(lambda c, xg: (c + counts(*xg), None), total,
                     (chunks(x), chunks(g)))[0]
  if whole < batch:
    total = total + counts(x[:, whole:], g[:, whole:])
  return total


def histograms(api: str, selection: Selection, reduction: str, params: Any = None, *,
               two_d: bool, one_d: bool = True, bins_1d=BINS_1D, range_1d=RANGE_1D,
               bins_2d=BINS_2D, range_2d=RANGE_2D) -> GradientHistograms:
  """The histograms of a selection's per-example gradients (of the per-example
  losses); the 2-D one pairs them with the values the records hold, or those of
  `params` (a tree like the recorded parameters). Without `one_d`, `counts_1d` is
  `None`."""
  batch = _common.one_batch_size(api, selection.batch_sizes, minimum=2)
  scale = _common.loss_scale(reduction, batch)
  values = selection.values()
  if params is not None:
    values.update(selection.by_path(api, params))
  counts_1d = jnp.zeros((bins_1d,), jnp.int32)
  counts_2d = jnp.zeros(bins_2d, jnp.int32)
  for key, uses in selection.groups.items():
    view = uses[0].view() if len(uses) == 1 and uses[0].kind in (DENSE, CONV) else None
    if one_d and view is not None:
      counts_1d = counts_1d + _view_counts(view, scale, bins_1d, range_1d)
    if two_d and key not in values:
      raise ValueError(
          f"{api}: the 2-D histogram needs the value of parameter {key!r}, which "
          "gl.record_layers's records do not hold: pass params=.")
    if not two_d and (view is not None or not one_d):
      continue

    def counts(grads, key=key, one_d=one_d and view is None):
      grads = jax.tree.map(lambda v: scale * v, grads)
      c1 = (histogram_1d(jax.tree.leaves(grads), bins_1d, range_1d) if one_d
            else jnp.zeros((bins_1d,), jnp.int32))
      if not two_d:
        return c1, jnp.zeros(bins_2d, jnp.int32)
      pairs = [(grad, value[None]) for grad, value in (
          (grads.w, values[key].w), (grads.b, values[key].b))
               if grad is not None and value is not None]  # dense_dot_general's bias
      return c1, histogram_2d(pairs, bins_2d, range_2d)

    counts_1d, counts_2d = _per_example_counts(selection, key, counts,
                                               (counts_1d, counts_2d))
  edges_2d = None
  if two_d:
    edges_2d = (_edges(bins_2d[0], range_2d[0]), _edges(bins_2d[1], range_2d[1]))
  return GradientHistograms(counts_1d if one_d else None, _edges(bins_1d, range_1d),
                            counts_2d if two_d else None, edges_2d)


def _per_example_counts(selection: Selection, key: str, counts, total):
  """`total` plus `counts(grads)` of key `key`'s per-example gradients `(n, ...)`, in
  chunks of about `CHUNK_ELEMENTS` numbers inside a `lax.scan` where its one use
  reads any slice of the examples (`FoundUse.examples`), else all at once."""
  add = lambda total, grads: jax.tree.map(jnp.add, total, counts(grads))
  uses = selection.groups[key]
  if len(uses) != 1 or uses[0].examples(0, 1) is None:
    return add(total, selection.per_example(key))
  grads = lambda start, size: uses[0].examples(start, size).per_example_grads()[key]
  batch = uses[0].batch_size
  per_example = sum(v.size for v in jax.tree.leaves(jax.eval_shape(lambda: grads(0, 1))))
  size = max(1, min(batch, CHUNK_ELEMENTS // max(1, per_example)))
  whole = batch - batch % size
  total = lax.scan(lambda total, i: (add(total, grads(i * size, size)), None), total,
                   jnp.arange(whole // size))[0]
  if whole < batch:
    total = add(total, grads(whole, batch - whole))
  return total


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
  selection = _common.select(api, records, reduction=reduction, names=names, tied=tied,
                             method="auto")
  return histograms(api, selection, reduction, params, two_d=two_d, bins_1d=bins_1d,
                    range_1d=range_1d, bins_2d=bins_2d, range_2d=range_2d)
