"""Summaries: small statistics of records, computed inside the compiled step.

Full records can be large (every layer's cotangent, per example, every step). A
`Summary` reduces each record leaf to a few numbers (L2 norm, mean, variance, min,
max, count of non-finite values) and a fixed-bin histogram of magnitudes, all
computed by JAX next to the backward pass, so only these small arrays leave the
device. `summarize` chooses per record name, by pattern, whether to keep the full
record, its summary, or both.

Cost: XLA on CPU (JAX 0.5) turns a reduction with an elementwise producer into a
scalar loop and never merges sibling reductions, so each statistic written as its
own `jnp` reduction is a pass over the record. `summarize_leaf` reads the record in
two variadic `lax.reduce`s over chunks of at most 255 entries: one computes the
sum, sum of squares, min and max, the other the histogram, whose bins are packed
four to an int32 counter (8 bits each, enough for a chunk), unpacked with one
array op. (Newer XLA, JAX 0.10, compiles one reduction of float and packed int
operands together four times slower than the two apart, and a variadic reduction
of the four statistics slower than four plain ones; see benchmarks/RESULTS.md.)
It masks nothing, and reads the
variance as `E[x^2] - mean^2`; a `lax.cond` redoes the summary with masks and a
centred second pass only when that could be wrong (a non-finite entry, or a mean
large against the spread). With the default power-of-two edges the bin is read
off the float exponent; other edges cost one comparison per edge.

Sharp edges:
  * Statistics other than `nonfinite` ignore non-finite entries (NaN, inf), so one
    bad value does not hide the rest; `nonfinite` counts them. A leaf with no finite
    entry has mean, variance and norm 0 and min/max of +inf/-inf.
  * `keep_axes=k` keeps the first k axes (e.g. 2 for `(call, example, ...)` records,
    giving per-call, per-example norms) and reduces over the rest. A leaf with fewer
    than k axes is an error that names it.
  * Histogram bins are of magnitudes |x|: bin 0 counts |x| below the first edge
    (zeros included), bin i counts edges[i-1] <= |x| < edges[i], the last bin counts
    |x| >= the last edge. Edges are compared in float32 (rounded to float32 first).
  * The default edges are the 25 powers of 4 from 2**-34 to 2**14 (26 bins; they
    were 29 log10-spaced edges from 1e-10 to 1e4 before). `bins=None` leaves the
    histogram out (`Summary.histogram` is None): the cheapest summary, which
    `report` and `export_tensorboard` do not show (they need the histogram).
  * Under `vmap` of `summarize` the `lax.cond` becomes a select, so both the
    unmasked and the masked summary are computed.
  * A name in `full` or `summary` that matches no record is an error (a typo would
    otherwise log nothing); a pattern with a wildcard may match none.
  * A layer record (`gl.dense`, ...) is summarized by its output cotangent only,
    unless `layer_parts` asks for its inputs, weights or input cotangents too.
  * Statistics are computed in float32, or in float64 for float64 records
    (`jax_enable_x64`); histogram edges are compared in float32 either way.
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
from jax import lax

from oryx_gradlog.record._layers import LayerInputs
from oryx_gradlog.record._selection import call_axes, is_found_record, is_layer_record
from oryx_gradlog.record._record import VJPRecord


def magnitude_bins(low: float = 2.0**-34, high: float = 2.0**14, count: int = 25) -> np.ndarray:
  """Returns `count` log-spaced bin edges from `low` to `high` (the default histogram).

  The default edges are the powers of 4 from 2**-34 (6e-11) to 2**14 (2e4): with
  edges that are powers of two, a uniform number of octaves apart, summaries read
  each entry's bin off its float exponent instead of comparing it with every edge.

  Example:
    >>> import oryx_gradlog as gl
    >>> gl.magnitude_bins(1e-2, 1e2, 5)
    array([1.e-02, 1.e-01, 1.e+00, 1.e+01, 1.e+02])
    >>> gl.magnitude_bins(1 / 4, 4, 3)
    array([0.25, 1.  , 4.  ])
  """
  return 2.0 ** np.linspace(np.log2(low), np.log2(high), count)


class _DefaultBins(np.ndarray):
  """`magnitude_bins()`, shown so in signatures (`help()`) instead of 25 numbers."""

  def __repr__(self) -> str:
    return "magnitude_bins()"


DEFAULT_BINS = magnitude_bins().view(_DefaultBins)


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
    histogram: counts of |x| in the magnitude bins, `len(bins) + 1` of them (None
      when summarized with `bins=None`).
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


_IGNORED = 1 << 20  # The bin index of a non-finite entry: it falls in no bin.


def _power_of_two_steps(edges: np.ndarray) -> tuple[int, int] | None:
  """Returns `(first exponent, step)` when `edges` are 2**(first + step * i), else None."""
  if len(edges) == 0 or not np.all(edges > 0):
    return None
  mantissas, exponents = np.frexp(edges.astype(np.float64))
  exponents = exponents - 1  # edges = 2**exponents exactly when mantissas are 0.5.
  steps = np.diff(exponents)
  if (np.any(mantissas != 0.5) or exponents[0] < -126 or exponents[-1] > 127
      or np.any(steps != (steps[0] if len(steps) else 1)) or (len(steps) and steps[0] < 1)):
    return None
  return int(exponents[0]), int(steps[0]) if len(steps) else 1


def _bin_index(x: jax.Array, bins, masked: bool = True) -> jax.Array:
  """Returns each entry's magnitude bin (0 to len(bins)); if `masked`, `_IGNORED` where
  non-finite (else a non-finite entry's bin is meaningless).

  Power-of-two edges (the default) read the bin off the float32 exponent, with
  integer arithmetic only; other edges count the edges at or below |x|.
  """
  edges = np.asarray(bins, np.float32)
  magnitude = jnp.abs(x).astype(jnp.float32)  # Beyond float32's range: inf, the last bin.
  steps = _power_of_two_steps(edges)
  if steps is not None:
    first, step = steps
    exponent = (lax.bitcast_convert_type(magnitude, jnp.int32) >> 23) - 127  # 0: -127.
    index = jnp.clip((exponent - first) // step + 1, 0, len(edges))
  else:
    index = sum((magnitude >= edge).astype(jnp.int32) for edge in edges)
  return jnp.where(jnp.isfinite(x), index, _IGNORED) if masked else index


def _chunk_length(n: int) -> int:
  """Returns the length of the chunks the first reduction pass works on.

  The largest divisor of `n` up to 255, so that a bin's count in a chunk fits in 8
  bits and four bins share an int32 counter; the whole axis when that divisor is
  small (a prime length), with 16- or 32-bit counters.
  """
  length = max(d for d in range(1, min(n, 255) + 1) if n % d == 0) if n else 1
  return length if length >= 64 or n <= 255 else n


def _bin_counters(index: jax.Array, bins) -> tuple[list[jax.Array], Any]:
  """Returns int32 per-entry counters whose sums over the last axis pack the histogram.

  Bins share an int32 counter, 8 bits each when the last axis is shorter than 256
  (16 bits when shorter than 2**16), which cuts the accumulators of the reduction
  to a quarter; the second result unpacks (..., counters) sums into the counts.
  """
  count = len(bins) + 1
  length = index.shape[-1]
  width = 8 if length < 1 << 8 else 16 if length < 1 << 16 else 32
  per = 32 // width
  counters = [jnp.where(index // per == group, jnp.left_shift(1, index % per * width), 0)
              for group in range(-(-count // per))]

  def unpack(sums):
    # One array op, not one per bin: newer XLA on CPU runs each bin's shift-and-mask
    # as a kernel of its own, which costs more than the tiny work they do.
    packed = jnp.stack(sums, -1)[..., None]
    shifts = jnp.arange(per, dtype=jnp.int32) * width
    fields = jnp.right_shift(packed, shifts) & (2**width - 1) if width < 32 else packed
    return fields.reshape(fields.shape[:-2] + (-1,))[..., :count]

  return counters, unpack


def _reduce_last(operands: list[tuple[jax.Array, Any, Any]]) -> list[jax.Array]:
  """Reduces `(array, init, combine)` triples over their last axis in one pass.

  One variadic reduction: XLA on CPU does not merge sibling reductions, and each
  separate pass over a record costs about as much as the pass itself.
  """
  arrays, inits, combines = zip(*operands)
  axis = arrays[0].ndim - 1

  def combine(a, b):
    return tuple(op(p, q) for op, p, q in zip(combines, a, b))

  return list(lax.reduce(arrays, tuple(np.asarray(i, a.dtype) for i, a in zip(inits, arrays)),
                         combine, (axis,)))


def float_dtype(dtype) -> np.dtype:
  """The dtype statistics of `dtype` values are computed in: float32, or float64 for
  float64 values (with `jax_enable_x64`)."""
  return jnp.promote_types(dtype, jnp.float32)


def summarize_leaf(x: jax.Array, *, keep_axes: int = 0, bins=DEFAULT_BINS) -> Summary:
  """Returns the `Summary` of one array, reducing all but its first `keep_axes` axes.

  One pass, one variadic reduction without masks, computes the sum, the sum of
  squares, min, max and the histogram counters; the variance is `E[x^2] - mean^2`.
  That is right when every entry is finite (checked as a finite sum of squares: a
  NaN or inf entry makes it NaN or inf) and `mean^2 <= E[x^2] / 2` (so the
  subtraction cancels at most one bit). Otherwise a `lax.cond` recomputes the
  summary with masks and a centred second pass.
  """
  x = jnp.asarray(x)
  if x.ndim < keep_axes:
    raise ValueError(f"has shape {x.shape}, fewer than keep_axes={keep_axes} axes")
  entries = x.reshape(x.shape[:keep_axes] + (-1,)).astype(float_dtype(x.dtype))
  summary, mean_square = _summarize(entries, bins)
  fast = jnp.all(jnp.isfinite(mean_square) & (2 * summary.mean**2 <= mean_square))
  return lax.cond(fast, lambda: summary, lambda: _summarize(entries, bins, masked=True)[0])


def _summarize(entries, bins, masked=False) -> tuple[Summary, jax.Array]:
  """Returns the summary over the last axis, and E[x^2]; `masked` skips non-finite entries."""
  n = entries.shape[-1]
  # Chunks keep the packed bin counts within 8 bits; without a histogram, one chunk.
  length = (n or 1) if bins is None else _chunk_length(n)
  chunks = entries.reshape(entries.shape[:-1] + (-1, length))
  finite = jnp.isfinite(chunks) if masked else None
  mask = (lambda v, fill: jnp.where(finite, v, fill)) if masked else (lambda v, fill: v)
  values = mask(chunks, 0.0)
  counters, unpack = (_bin_counters(_bin_index(chunks, bins, masked), bins)
                      if bins is not None else ([], lambda sums: None))
  operands = [(values, 0.0, jnp.add), (values * values, 0.0, jnp.add),
              (mask(chunks, jnp.inf), jnp.inf, jnp.minimum),
              (mask(chunks, -jnp.inf), -jnp.inf, jnp.maximum)]
  if masked:
    operands.append((finite.astype(jnp.int32), 0, jnp.add))
  # First pass: per chunk, the statistics in one reduction and the bin counters in
  # another (newer XLA on CPU compiles one reduction of both kinds of operand, float
  # and packed int, four times slower than the two). Then the chunks, a small array.
  partials = _reduce_last(operands)
  histogram = None if bins is None else jnp.sum(
      unpack(_reduce_last([(counter, 0, jnp.add) for counter in counters])), -2,
      dtype=jnp.int32)
  total, sumsq, low, high, *count = _reduce_last(
      [(partial, init, combine) for partial, (_, init, combine) in zip(partials, operands)])
  count = count[0] if masked else jnp.full(total.shape, n, jnp.int32)
  divisor = jnp.maximum(count, 1).astype(entries.dtype)
  mean, mean_square = total / divisor, sumsq / divisor
  if masked:
    deviations = mask(chunks - mean[..., None, None], 0.0)
    variance = jnp.sum(deviations * deviations, (-2, -1)) / divisor
  else:
    variance = jnp.maximum(mean_square - mean * mean, 0.0)
  summary = Summary(norm=jnp.sqrt(sumsq), mean=mean, variance=variance, min=low, max=high,
                    nonfinite=n - count, histogram=histogram)
  return summary, mean_square


def magnitude_histogram(x: jax.Array, bins=DEFAULT_BINS) -> jax.Array:
  """Counts |x| of the finite entries of `x` in the magnitude bins, over the last axis."""
  x = x.reshape(x.shape[:-1] + (-1, _chunk_length(x.shape[-1])))
  counters, unpack = _bin_counters(_bin_index(x, bins), bins)
  return jnp.sum(unpack(_reduce_last([(counter, 0, jnp.add) for counter in counters])), -2,
                 dtype=jnp.int32)


_WILDCARDS = "*?["
LAYER_PARTS = ("primals", "out_cotangent", "in_cotangents")  # The fields of a VJPRecord.


def _patterns(patterns: str | Iterable[str]) -> tuple[str, ...]:
  return (patterns,) if isinstance(patterns, str) else tuple(patterns)


def _matches(name: str, patterns: tuple[str, ...]) -> bool:
  return any(fnmatch.fnmatchcase(name, pattern) for pattern in patterns)


def _check_names(records, full, summary, layer_parts) -> None:
  """Raises, listing every bad argument at once, for a name that matches no record."""
  bad = [f"{argument}={pattern!r}" for argument, patterns in (("full", full), ("summary", summary))
         for pattern in patterns
         if not any(c in pattern for c in _WILDCARDS) and pattern not in records]
  if bad:
    raise ValueError(
        f"summarize({', '.join(bad)}): no record has that name; the records are "
        f"{sorted(records)}. Use one of these names, or a pattern with a wildcard "
        "(e.g. 'fc*'), which may match none.")
  unknown = [part for part in layer_parts if part != "*" and part not in LAYER_PARTS]
  if unknown:
    raise ValueError(
        f"summarize(layer_parts={layer_parts!r}): {', '.join(map(repr, unknown))} is not a "
        f"part of a layer record; the parts are {', '.join(map(repr, LAYER_PARTS))}, or '*' "
        "for all of them.")


def _summarize_layer(record: VJPRecord, parts, keep_axes: int, bins) -> VJPRecord:
  """Summarizes the chosen parts of a layer record; the others are None.

  Only the input `x` and the output cotangent have an example axis: a weight or a
  bias (and their cotangents) keeps at most its call axes, so that a kept axis of a
  summary is never a weight's rows. In a record that `record_layers` found, the
  output cotangent's batch axis is moved to follow the call axes, and the operands
  (whose batch axes differ) keep at most their call axes.
  """
  calls = call_axes(record)
  found = is_found_record(record)

  def leaf(x, has_examples):
    axes = keep_axes if has_examples else min(keep_axes, calls)
    return None if x is None else summarize_leaf(x, keep_axes=axes, bins=bins)

  def layer(inputs):
    return dataclasses.replace(inputs, x=leaf(inputs.x, True), w=leaf(inputs.w, False),
                               b=leaf(inputs.b, False))

  def part(name, value):
    if "*" not in parts and name not in parts:
      return None
    if name == "out_cotangent" and found:
      return leaf(*_examples_after_calls(value, record.primals[0].spec.out_batch, calls))
    if name == "out_cotangent":
      return leaf(value, True)
    if found:
      return jax.tree.map(lambda x: leaf(x, False), value)
    return jax.tree.map(layer, value, is_leaf=lambda node: isinstance(node, LayerInputs))

  return VJPRecord(*(part(name, getattr(record, name)) for name in LAYER_PARTS))


def _examples_after_calls(g, out_batch, calls: int) -> tuple[Any, bool]:
  """`g` with its batch axis `(axis, factor)` split from the factor and moved after
  the call axes, and whether it has one."""
  if g is None or out_batch is None:
    return g, False
  axis, factor = out_batch
  axis += calls
  if factor > 1:  # The batch merged with positions, the batch the outer factor.
    g = g.reshape(g.shape[:axis] + (g.shape[axis] // factor, factor) + g.shape[axis + 1:])
  return jnp.moveaxis(g, axis, calls), True


def summarize(
    records: dict[str, Any],
    *,
    full: str | Iterable[str] = (),
    summary: str | Iterable[str] = "*",
    keep_axes: int = 0,
    bins=DEFAULT_BINS,
    layer_parts: str | Iterable[str] = ("out_cotangent",),
) -> dict[str, Logged]:
  """Returns, per record name, the full record, its `Summary` tree, or both.

  Call it inside the jitted step, on the dict that `reap` returns, so that only
  what is kept leaves the device.

  Args:
    records: a dict of records, as `reap` returns.
    full: names or fnmatch patterns (`"dense*"`) of records to keep in full.
    summary: names or patterns of records to summarize (default: all).
    keep_axes: leading axes to keep in summaries (1: per call, 2: per call and
      example for `(call, example, ...)` records). In a layer record's summary a
      weight or bias keeps only its call axes: it has no example axis.
    bins: magnitude histogram edges (default `magnitude_bins()`), or None for no
      histogram (`Summary.histogram` is None; the cheapest summaries).
    layer_parts: what to summarize of a layer record (made by `gl.dense`,
      `gl.conv2d`, `gl.embed`, `gl.layer_norm`, or found by `gl.record_layers`):
      its fields `"out_cotangent"` (default), `"in_cotangents"`, `"primals"`, or
      `"*"` for all. The summary is a `VJPRecord` of `Summary`s with `None` for
      the parts left out.

  Returns:
    `{name: Logged(full=..., summary=...)}` for every name matched by `full` or
    `summary`; the part not asked for is `None`.

  Raises:
    ValueError: a name in `full` or `summary` without wildcards names no record (the
      error lists the records), or a part in `layer_parts` is not a field of
      `VJPRecord`.

  Example:
    >>> import jax, jax.numpy as jnp, oryx_gradlog as gl
    >>> loss = lambda x: jnp.sum(gl.tap(3 * x, name="h") ** 2)
    >>> logged = gl.summarize(gl.reap(jax.grad(loss))(jnp.array([1.0, -1.0])))
    >>> logged["h"].summary.norm, logged["h"].full
    (Array(8.485281, dtype=float32), None)
  """
  full, summary, layer_parts = _patterns(full), _patterns(summary), _patterns(layer_parts)
  _check_names(records, full, summary, layer_parts)
  logged = {}
  for name, record in records.items():
    keep_full, keep_summary = _matches(name, full), _matches(name, summary)
    if not (keep_full or keep_summary):
      continue
    summarized = None
    if keep_summary:
      try:
        if is_layer_record(record) or is_found_record(record):
          summarized = _summarize_layer(record, layer_parts, keep_axes, bins)
        else:
          summarized = jax.tree.map(
              lambda leaf: summarize_leaf(leaf, keep_axes=keep_axes, bins=bins), record)
      except ValueError as error:
        raise ValueError(
            f"summarize: record {name!r} {error}. Pass a smaller keep_axes, or keep "
            f"this record in full (full={name!r}, summary=...) instead."
        ) from None
    logged[name] = Logged(full=record if keep_full else None, summary=summarized)
  return logged
