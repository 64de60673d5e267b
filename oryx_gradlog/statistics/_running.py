"""Running statistics of records across training steps, as a functional state.

In the optax style: `running_statistics(...)` returns a `gl.Transform` whose
`init(records)` builds a state pytree and `update(records, state)` folds in one
step's records and returns `(records, state)`, the records unchanged (so it also
sits in an `optax.chain`, keeping statistics of the gradients). Both are pure, so
they run inside a jitted step or a `lax.scan` over steps, and the state's size does
not grow with the number of steps: per record leaf it holds a Welford mean and sum
of squared deviations (stable for long runs), an exponential moving average,
element-wise min, max and non-finite counts, and the magnitude histogram of every
entry seen.

Cost: XLA on CPU writes each state array in its own pass, so `update` keeps the
state small (the finite count is `steps - nonfinite`, not stored) and, when every
entry of the step is finite (the histogram counted them all), updates without
masks and leaves `nonfinite` as it is (`lax.cond`).

Sharp edges:
  * Non-finite entries (NaN, inf) are skipped element by element: `count` says how
    many finite values each element has seen, and `nonfinite` how many were skipped.
  * The records' structure and shapes must stay the same from step to step (they do
    under `jit`); a change is an error that names the record.
  * `ema` starts at zero; `debiased_ema` divides by `1 - decay ** steps` as Adam does.
  * The state is float32, or float64 for float64 records (`jax_enable_x64`).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from oryx_gradlog._base import Transform, check_order
from oryx_gradlog.statistics._summaries import DEFAULT_BINS, float_dtype, magnitude_histogram


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=["steps", "mean", "m2", "ema", "min", "max", "nonfinite", "histogram"],
    meta_fields=["decay"],
)
@dataclasses.dataclass(frozen=True)
class RunningStats:
  """Running statistics of one record leaf over the steps seen so far.

  Attributes:
    steps: number of updates.
    mean: per element, the running mean (Welford).
    m2: per element, the sum of squared deviations from the mean (Welford).
    ema: per element, the exponential moving average (biased towards 0 early on).
    min: per element, the smallest finite value seen.
    max: per element, the largest finite value seen.
    nonfinite: per element, the number of NaN or infinite values skipped.
    histogram: magnitude histogram of all finite entries of all steps.
    decay: the EMA decay (static).
  """

  steps: jax.Array
  mean: jax.Array
  m2: jax.Array
  ema: jax.Array
  min: jax.Array
  max: jax.Array
  nonfinite: jax.Array
  histogram: jax.Array
  decay: float

  @property
  def count(self) -> jax.Array:
    """Per element, the number of finite values seen (`steps - nonfinite`)."""
    return self.steps - self.nonfinite

  @property
  def variance(self) -> jax.Array:
    """Per element, the population variance of the finite values seen."""
    return self.m2 / jnp.maximum(self.count, 1)

  @property
  def debiased_ema(self) -> jax.Array:
    """The EMA divided by `1 - decay ** steps`."""
    return debias(self.ema, self.decay, self.steps)


def debias(tree: Any, decay: float, steps: jax.Array) -> Any:
  """Divides an EMA (a pytree) by `1 - decay ** steps`, as Adam does; zero at step 0."""
  correction = 1.0 - decay ** steps.astype(jnp.float32)
  safe = jnp.where(steps > 0, correction, 1.0)
  return jax.tree.map(lambda v: v / safe.astype(v.dtype), tree)


def running_statistics(*, decay: float = 0.99, bins=DEFAULT_BINS) -> Transform:
  """Returns `init`/`update` functions that keep running statistics of records.

  Args:
    decay: decay of the exponential moving average.
    bins: magnitude histogram edges (default `magnitude_bins()`).

  Returns:
    A `gl.Transform`: `init(records)` gives a state with the structure of
    `records` and a `RunningStats` per leaf; `update(records, state, params=None)`
    returns `(records, state)`: the records unchanged and the state with one more
    step folded in.

  Example:
    >>> import jax.numpy as jnp, oryx_gradlog as gl
    >>> stats = gl.running_statistics(decay=0.5)
    >>> state = stats.init({"h": jnp.zeros(2)})
    >>> for step in range(3):
    ...   _, state = stats.update({"h": jnp.array([1.0, 2.0]) * step}, state)
    >>> state["h"].mean, state["h"].variance
    (Array([1., 2.], dtype=float32), Array([0.6666667, 2.6666667], dtype=float32))
  """

  def init_leaf(x):
    x = jnp.asarray(x)
    zeros = jnp.zeros(x.shape, float_dtype(x.dtype))
    return RunningStats(
        steps=jnp.zeros((), jnp.int32), mean=zeros, m2=zeros, ema=zeros,
        min=jnp.full(x.shape, jnp.inf, zeros.dtype), max=jnp.full(x.shape, -jnp.inf, zeros.dtype),
        nonfinite=jnp.zeros(x.shape, jnp.int32),
        histogram=jnp.zeros((len(bins) + 1,), jnp.int32), decay=decay)

  def update_leaf(stats: RunningStats, x) -> RunningStats:
    x = jnp.asarray(x, stats.mean.dtype)
    histogram = magnitude_histogram(x.ravel(), bins)  # Of the finite entries only.
    steps = stats.steps + 1
    # Each output is its own pass on CPU (no multi-output fusion): written so that
    # each reads the inputs only, and the masks only when some entry is not finite.
    return lax.cond(jnp.sum(histogram) == x.size, _update, _masked_update, stats, x, steps,
                    stats.histogram + histogram)

  def _update(stats, x, steps, histogram):
    count = (steps - stats.nonfinite).astype(x.dtype)
    delta = x - stats.mean
    return RunningStats(
        steps=steps, mean=stats.mean + delta / count,
        m2=stats.m2 + delta * delta * ((count - 1) / count),
        ema=decay * stats.ema + (1 - decay) * x, min=jnp.minimum(stats.min, x),
        max=jnp.maximum(stats.max, x), nonfinite=stats.nonfinite, histogram=histogram,
        decay=decay)

  def _masked_update(stats, x, steps, histogram):
    finite = jnp.isfinite(x)
    nonfinite = stats.nonfinite + ~finite
    count = jnp.maximum(steps - nonfinite, 1).astype(x.dtype)
    delta = jnp.where(finite, x - stats.mean, 0.0)
    return RunningStats(
        steps=steps, mean=stats.mean + delta / count,
        m2=stats.m2 + delta * delta * ((count - 1) / count),
        ema=jnp.where(finite, decay * stats.ema + (1 - decay) * x, stats.ema),
        min=jnp.where(finite, jnp.minimum(stats.min, x), stats.min),
        max=jnp.where(finite, jnp.maximum(stats.max, x), stats.max),
        nonfinite=nonfinite, histogram=histogram, decay=decay)

  def init(records):
    return jax.tree.map(init_leaf, records)

  def update(records, state, params=None):
    del params  # For optax.chain.
    check_order("running_statistics.update", RunningStats, records)
    is_stats = lambda node: isinstance(node, RunningStats)

    def mismatch(old, new) -> bool:
      return old is None or new is None or (
          jax.tree.structure(old, is_leaf=is_stats) != jax.tree.structure(new)
          or any(s.mean.shape != jnp.shape(x) for s, x in zip(
              jax.tree.leaves(old, is_leaf=is_stats), jax.tree.leaves(new))))

    if mismatch(state, records):
      both = isinstance(state, dict) and isinstance(records, dict)
      for name in (set(state) | set(records)) if both else [None]:
        old, new = (state.get(name), records.get(name)) if both else (state, records)
        if mismatch(old, new):
          raise ValueError(
              f"running_statistics.update: "
              f"{'the records' if name is None else f'record {name!r}'} does not match "
              "the state it updates (state has "
              f"{jax.tree.map(lambda s: s.mean.shape, old, is_leaf=is_stats)}, records "
              f"have {jax.tree.map(jnp.shape, new)}). Records must keep their names, "
              "structure and shapes from step to step; init a new state for new ones.")
    return records, jax.tree.map(update_leaf, state, records, is_leaf=is_stats)

  return Transform(init, update)
