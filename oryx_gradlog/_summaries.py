"""Summaries: small statistics of records, computed inside the compiled step.

Full records can be large (every layer's cotangent, per example, every step). A
`Summary` reduces each record leaf to a few numbers (L2 norm, mean, variance, min,
max, count of non-finite values) and a fixed-bin histogram of magnitudes, all
computed by JAX next to the backward pass, so only these small arrays leave the
device. `summarize` chooses per record name, by pattern, whether to keep the full
record, its summary, or both.

Sharp edges:
  * Statistics other than `nonfinite` ignore non-finite entries (NaN, inf), so one
    bad value does not hide the rest; `nonfinite` counts them. A leaf with no finite
    entry has mean, variance and norm 0 and min/max of +inf/-inf.
  * `keep_axes=k` keeps the first k axes (e.g. 2 for `(call, example, ...)` records,
    giving per-call, per-example norms) and reduces over the rest. A leaf with fewer
    than k axes is an error that names it.
  * Histogram bins are of magnitudes |x|: bin 0 counts |x| below the first edge
    (zeros included), bin i counts edges[i-1] <= |x| < edges[i], the last bin counts
    |x| >= the last edge.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import functools
from collections.abc import Iterable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np


def magnitude_bins(low: float = 1e-10, high: float = 1e4, count: int = 29) -> np.ndarray:
  """Returns `count` log-spaced bin edges from `low` to `high` (the default histogram).

  Example:
    >>> import oryx_gradlog as gl
    >>> gl.magnitude_bins(1e-2, 1e2, 5)
    array([1.e-02, 1.e-01, 1.e+00, 1.e+01, 1.e+02])
  """
  return np.logspace(np.log10(low), np.log10(high), count)


DEFAULT_BINS = magnitude_bins()


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=["norm", "mean", "variance", "min", "max", "nonfinite", "histogram"],
    meta_fields=[],
)
@dataclasses.dataclass(frozen=True)
class Summary:
  """Statistics of one record leaf (over all but its first `keep_axes` axes).

  Attributes:
    norm: L2 norm of the finite entries.
    mean: mean of the finite entries.
    variance: variance of the finite entries (population, ddof=0).
    min: smallest finite entry.
    max: largest finite entry.
    nonfinite: number of NaN and infinite entries.
    histogram: counts of |x| in the magnitude bins, `len(bins) + 1` of them.
  """

  norm: jax.Array
  mean: jax.Array
  variance: jax.Array
  min: jax.Array
  max: jax.Array
  nonfinite: jax.Array
  histogram: jax.Array


@functools.partial(
    jax.tree_util.register_dataclass, data_fields=["full", "summary"], meta_fields=[]
)
@dataclasses.dataclass(frozen=True)
class Logged:
  """What `summarize` keeps of one record: the full record, its summary, or both."""

  full: Any = None
  summary: Any = None


_LANES = 128


def _lanes(x, fill):
  """Reshapes the last axis to (rows, 128), padding with `fill`.

  XLA on CPU reduces the major axis of a (rows, lanes) array with vector
  instructions but a long minor axis one element at a time; reducing rows first
  makes summaries several times cheaper.
  """
  pad = -x.shape[-1] % _LANES
  if pad:
    x = jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, pad)], constant_values=fill)
  return x.reshape(x.shape[:-1] + (-1, _LANES))


def _total(x, reduce=jnp.sum):
  """Reduces the (rows, lanes) axes of `_lanes` output: rows first, then lanes."""
  return reduce(reduce(x, -2), -1)


def summarize_leaf(x: jax.Array, *, keep_axes: int = 0, bins=DEFAULT_BINS) -> Summary:
  """Returns the `Summary` of one array, reducing all but its first `keep_axes` axes."""
  x = jnp.asarray(x)
  if x.ndim < keep_axes:
    raise ValueError(f"has shape {x.shape}, fewer than keep_axes={keep_axes} axes")
  entries = x.reshape(x.shape[:keep_axes] + (-1,)).astype(jnp.float32)
  padding = -entries.shape[-1] % _LANES  # NaNs, taken off the non-finite count.
  flat = _lanes(entries, jnp.nan)
  finite = jnp.isfinite(flat)
  values = jnp.where(finite, flat, 0.0)
  count = _total(finite.astype(jnp.int32))
  mean = _total(values) / jnp.maximum(count, 1)
  centred = jnp.where(finite, flat - mean[..., None, None], 0.0)
  return Summary(
      norm=jnp.sqrt(_total(values * values)),
      mean=mean,
      variance=_total(centred * centred) / jnp.maximum(count, 1),
      min=_total(jnp.where(finite, flat, jnp.inf), jnp.min),
      max=_total(jnp.where(finite, flat, -jnp.inf), jnp.max),
      nonfinite=_total((~finite).astype(jnp.int32)) - padding,
      histogram=_histogram(values, finite, bins),
  )


def _histogram(values, finite, bins):
  """Counts |values| (where `finite`) in the magnitude bins, over the (rows, lanes) axes.

  One fused pass: count the entries at or above each edge, then take differences.
  """
  edges = jnp.asarray(bins, jnp.float32)[:, None, None]
  at_or_above = _total(((jnp.abs(values)[..., None, :, :] >= edges)
                        & finite[..., None, :, :]).astype(jnp.int32))
  total = _total(finite.astype(jnp.int32))[..., None]
  return jnp.concatenate(
      [total - at_or_above[..., :1], at_or_above[..., :-1] - at_or_above[..., 1:],
       at_or_above[..., -1:]], -1)


def magnitude_histogram(values, finite, bins=DEFAULT_BINS):
  """Counts |values| (where `finite`) in the magnitude bins, over the last axis."""
  return _histogram(_lanes(values, 0.0), _lanes(finite, False), bins)


def _matches(name: str, patterns: str | Iterable[str]) -> bool:
  patterns = (patterns,) if isinstance(patterns, str) else patterns
  return any(fnmatch.fnmatchcase(name, pattern) for pattern in patterns)


def summarize(
    records: dict[str, Any],
    *,
    full: str | Iterable[str] = (),
    summary: str | Iterable[str] = "*",
    keep_axes: int = 0,
    bins=DEFAULT_BINS,
) -> dict[str, Logged]:
  """Returns, per record name, the full record, its `Summary` tree, or both.

  Call it inside the jitted step, on the dict that `reap` returns, so that only
  what is kept leaves the device.

  Args:
    records: a dict of records, as `reap` returns.
    full: names or fnmatch patterns (`"dense*"`) of records to keep in full.
    summary: names or patterns of records to summarize (default: all).
    keep_axes: leading axes to keep in summaries (1: per call, 2: per call and
      example for `(call, example, ...)` records).
    bins: magnitude histogram edges (default `magnitude_bins()`).

  Returns:
    `{name: Logged(full=..., summary=...)}` for every name matched by `full` or
    `summary`; the part not asked for is `None`.

  Example:
    >>> import jax, jax.numpy as jnp, oryx_gradlog as gl
    >>> loss = lambda x: jnp.sum(gl.tap(3 * x, name="h") ** 2)
    >>> logged = gl.summarize(gl.reap(jax.grad(loss))(jnp.array([1.0, -1.0])))
    >>> logged["h"].summary.norm, logged["h"].full
    (Array(8.485281, dtype=float32), None)
  """
  logged = {}
  for name, record in records.items():
    keep_full, keep_summary = _matches(name, full), _matches(name, summary)
    if not (keep_full or keep_summary):
      continue
    summarized = None
    if keep_summary:
      leaves, treedef = jax.tree_util.tree_flatten_with_path(record)
      try:
        summarized = treedef.unflatten(
            [summarize_leaf(leaf, keep_axes=keep_axes, bins=bins) for _, leaf in leaves])
      except ValueError as error:
        raise ValueError(
            f"summarize: record {name!r} {error}. Pass a smaller keep_axes, or keep "
            f"this record in full (full={name!r}, summary=...) instead."
        ) from None
    logged[name] = Logged(full=record if keep_full else None, summary=summarized)
  return logged
