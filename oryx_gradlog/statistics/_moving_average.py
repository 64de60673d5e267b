"""A moving average of any pytree across steps, as a small functional state.

The analyses give one step's estimate (K-FAC factors, gradient noise); curvature
and noise estimates are noisy, so optimizers and monitors keep exponential moving
averages across steps. `moving_average(decay)` is an optax-style `init`/`update`
pair (a `gl.Transform`) over a whole pytree, with Adam's bias correction as a
property. Unlike `running_statistics`, which keeps nine statistics per leaf for
monitoring, this keeps one array per leaf: the size of what it averages.

Sharp edges:
  * The EMA starts at zero; read `debiased` (divided by `1 - decay ** steps`) unless
    you want the zero start. Before the first update `debiased` is zero.
  * Static fields of the averaged pytree (e.g. `GradientNoise.batch_size`) are kept
    from `init`; an update whose structure or static fields differ is an error.
  * Ratios of averages are not averages of ratios: average a `GradientNoise` (its
    two estimates) and read `b_simple` of the average, as McCandlish et al. do.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp

from oryx_gradlog._base import Transform, check_order
from oryx_gradlog.statistics._running import debias


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=["steps", "value"],
    meta_fields=["decay"],
)
@dataclasses.dataclass(frozen=True)
class MovingAverage:
  """The state of `moving_average`.

  Attributes:
    steps: number of updates.
    value: the exponential moving average, with the structure of the averaged tree.
    decay: the decay (static).
  """

  steps: jax.Array
  value: Any
  decay: float

  @property
  def debiased(self) -> Any:
    """`value` divided by `1 - decay ** steps` (zero before the first update)."""
    return debias(self.value, self.decay, self.steps)


def moving_average(decay: float = 0.99) -> Transform:
  """Returns `init`/`update` functions of an exponential moving average of a pytree.

  `update` computes `decay * value + (1 - decay) * tree`; both are pure, so they run
  inside a jitted step or a `lax.scan` over steps.

  Args:
    decay: the decay, in [0, 1).

  Returns:
    A `gl.Transform`: `init(tree)` gives a zero `MovingAverage` with the
    structure of `tree`; `update(tree, state, params=None)` returns `(tree, state)`,
    the tree unchanged and the state with one step folded in.

  Example:
    >>> import jax.numpy as jnp, oryx_gradlog as gl
    >>> ema = gl.moving_average(decay=0.5)
    >>> state = ema.init({"a": jnp.zeros(2)})
    >>> for step in range(2):
    ...   _, state = ema.update({"a": jnp.array([2.0, 4.0])}, state)
    >>> state.value["a"], state.debiased["a"]
    (Array([1.5, 3. ], dtype=float32), Array([2., 4.], dtype=float32))
  """
  if not 0.0 <= decay < 1.0:
    raise ValueError(f"moving_average(decay={decay!r}): decay must be in [0, 1).")

  def init(tree):
    return MovingAverage(jnp.zeros((), jnp.int32), jax.tree.map(jnp.zeros_like, tree), decay)

  def update(tree, state, params=None):
    del params  # For optax.chain.
    check_order("moving_average.update", MovingAverage, tree)
    expected, got = jax.tree.structure(state.value), jax.tree.structure(tree)
    if expected != got or any(
        jnp.shape(a) != jnp.shape(b)
        for a, b in zip(jax.tree.leaves(state.value), jax.tree.leaves(tree))):
      raise ValueError(
          "moving_average.update: the tree does not match the state it updates "
          f"(state {jax.tree.map(jnp.shape, state.value)}, tree "
          f"{jax.tree.map(jnp.shape, tree)}). Keep names, structure, static fields and "
          "shapes from step to step, or init a new state.")
    value = jax.tree.map(lambda v, x: decay * v + (1.0 - decay) * x, state.value, tree)
    return tree, MovingAverage(state.steps + 1, value, decay)

  return Transform(init, update)
