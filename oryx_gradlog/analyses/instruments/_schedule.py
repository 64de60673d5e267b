"""Tracking schedules: which steps the training instruments read (Cockpit's
`linear` and `logarithmic` schedules), as functions of the step.

Sharp edges:
  * A schedule is called with a Python int (from a training loop's `phase`) or a
    traced JAX integer (the state's step count inside `jit`); a function given to
    `training_instruments(every=...)` must then work on JAX integers (the two here
    do).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax.numpy as jnp
import numpy as np


class Schedule(NamedTuple):
  """A tracking schedule: `schedule(step)` says whether to read at `step`, for a
  Python int (a bool) or a traced JAX integer (a traced bool)."""

  fn: Callable[[Any], Any]
  description: str

  def __call__(self, step):
    return self.fn(step)


def linear_schedule(interval: int, offset: int = 0) -> Schedule:
  """Returns Cockpit's `linear` schedule: read at steps `offset + n * interval`, n >= 0.

  Example:
    >>> import oryx_gradlog as gl
    >>> schedule = gl.linear_schedule(3, offset=1)
    >>> [step for step in range(9) if schedule(step)]
    [1, 4, 7]
  """
  for arg, value, least in (("interval", interval, 1), ("offset", offset, 0)):
    if not isinstance(value, int) or isinstance(value, bool) or value < least:
      raise ValueError(f"linear_schedule({arg}={value!r}): give an integer >= {least}.")

  def fn(step):
    shifted = step - offset
    if isinstance(step, int):
      return shifted >= 0 and shifted % interval == 0
    return (shifted >= 0) & (shifted % interval == 0)

  return Schedule(fn, f"steps {offset} + n * {interval}")


def logarithmic_schedule(start: float, end: float, steps: int = 300, base: float = 10,
                         init: bool = True) -> Schedule:
  """Returns Cockpit's `logarithmic` schedule: read at `int(base ** e)` for `steps`
  exponents `e` evenly spaced from `start` to `end`, and at step 0 if `init`.

  Example:
    >>> import oryx_gradlog as gl
    >>> schedule = gl.logarithmic_schedule(0, 2, steps=5)  # 1, 3, 10, 31, 100
    >>> [step for step in range(101) if schedule(step)]
    [0, 1, 3, 10, 31, 100]
  """
  tracked = np.logspace(start, end, steps, base=base).astype(np.int64)
  if init:
    tracked = np.append(tracked, 0)
  tracked = np.unique(tracked)
  members = frozenset(int(t) for t in tracked)

  def fn(step):
    if isinstance(step, int):
      return step in members
    return jnp.any(jnp.asarray(step) == jnp.asarray(tracked, jnp.int32))

  return Schedule(fn, f"{len(tracked)} logarithmically spaced steps up to {tracked[-1]}")


def as_schedule(every) -> Schedule:
  """`every` of `training_instruments` as a `Schedule`: a positive int k (steps 0,
  k, 2k, ...) or a function of the step."""
  if callable(every):
    return every if isinstance(every, Schedule) else Schedule(every, repr(every))
  if not isinstance(every, int) or isinstance(every, bool) or every < 1:
    raise ValueError(f"training_instruments(every={every!r}): give a positive integer or "
                     "a schedule function of the step (gl.linear_schedule, "
                     "gl.logarithmic_schedule).")
  return linear_schedule(every)
